"""KV events in vLLM's wire format: ``--kv-events-config`` (docs/SCALING.md)."""
