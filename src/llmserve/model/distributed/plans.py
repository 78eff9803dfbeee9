"""Per-family tensor-parallel plans: which projections of a decoder layer are split by
output rows (column-parallel) and which by input columns (row-parallel, then summed).

A family without a plan cannot be served with ``--tensor-parallel-size > 1``:
:func:`plan_for` refuses it by name, before any worker process is spawned. The dense
families share one plan because their model classes fuse the same projections
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``); the mixture-of-experts
families have none yet (their experts would need an expert- or row-parallel split).
No torch here: the plan is data, :func:`~llmserve.model.distributed.layers.shard_model`
applies it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelPlan:
    """How one family's decoder layers are cut across ranks.

    Attributes:
        attention: the attention module's attribute name in a decoder layer.
        mlp: the MLP module's attribute name in a decoder layer.
        qkv: the fused q/k/v projection (column-parallel: heads split, K/V heads split or
            replicated).
        attn_out: the attention output projection (row-parallel).
        gate_up: the fused gate/up projection (column-parallel, both halves split).
        down: the MLP output projection (row-parallel).
    """

    attention: str = "self_attn"
    mlp: str = "mlp"
    qkv: str = "qkv_proj"
    attn_out: str = "o_proj"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"


DENSE_DECODER = TensorParallelPlan()

#: architecture -> plan; an architecture missing here has no tensor-parallel support.
PLANS: dict[str, TensorParallelPlan] = {
    "llama": DENSE_DECODER,
    "mistral": DENSE_DECODER,
    "qwen2": DENSE_DECODER,
    "qwen3": DENSE_DECODER,
    "gemma2": DENSE_DECODER,
    "gemma3": DENSE_DECODER,
    "phi3": DENSE_DECODER,
}

MIXTURE_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe")


def plan_for(architecture: str, world_size: int) -> TensorParallelPlan:
    """The plan that splits ``architecture`` over ``world_size`` ranks.

    Raises:
        ValueError: the family has no plan (a mixture-of-experts model, or an architecture
            without one), naming the family and what to do instead.
    """
    plan = PLANS.get(architecture)
    if plan is not None:
        return plan
    if architecture in MIXTURE_OF_EXPERTS:
        raise ValueError(f"--tensor-parallel-size {world_size}: the {architecture} family is a "
                         "mixture-of-experts model and tensor parallelism has no plan for its "
                         "experts yet; serve it with --tensor-parallel-size 1 (or replicas "
                         "behind `llmserve router`)")
    raise ValueError(f"--tensor-parallel-size {world_size}: no tensor-parallel plan for "
                     f"architecture {architecture!r}; families with one: {sorted(PLANS)}")
