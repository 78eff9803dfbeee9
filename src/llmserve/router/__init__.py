"""Engine replicas behind one front: the internal engine API, its client, the prefix-aware
router (an ``EngineClient``) and the launcher of local replicas. No torch (docs/SCALING.md)."""
