"""Integrations with the serving platforms people already run (Kubernetes inference gateway)."""
