"""Tensor parallelism: the process group, sharded layers and worker ranks (docs/SCALING.md)."""
