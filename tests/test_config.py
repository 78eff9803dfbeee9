"""EngineConfig is composed of one section per part; the CLI's flat flags map onto them."""
from __future__ import annotations

import dataclasses

import pytest

from llmserve.config import FLAGS, EngineConfig


def test_flags_land_in_their_sections_and_round_trip():
    config = EngineConfig.from_kwargs(model="m.gguf", max_num_seqs=3, block_size=32,
                                      speculative_method="ngram", speculative_max_batch=5,
                                      max_loras=2, int4_activations="bf16")
    assert config.model.path == "m.gguf" and config.model.int4_activations == "bf16"
    assert config.scheduler.max_num_seqs == 3 and config.cache.block_size == 32
    assert (config.speculative.method, config.speculative.max_batch) == ("ngram", 5)
    assert config.lora.max_loras == 2
    assert EngineConfig.from_kwargs(**config.flags()) == config
    changed = config.replace(num_threads=2, enable_prefix_caching=False)
    assert changed.model.num_threads == 2 and not changed.cache.enable_prefix_caching
    assert changed.scheduler == config.scheduler        # untouched sections are shared


def test_every_section_field_has_exactly_one_flag():
    flagged = set(FLAGS.values())
    assert len(flagged) == len(FLAGS)
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(getattr(EngineConfig(), section.name)):
            if (section.name, f.name) == ("speculative", "min_acceptance"):
                continue   # not a CLI flag: the adaptive-k rule's constant
            assert (section.name, f.name) in flagged, (section.name, f.name)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"bogus": 1}, TypeError, "unknown engine argument"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be >= 1"),
    ({"speculative_method": "draft"}, ValueError, "draft_model is required"),
    ({"suffix_max_depth": 1}, ValueError, "suffix_max_depth must be in"),
    ({"suffix_cache_max_nodes": -1}, ValueError, "suffix_cache_max_nodes must be"),
    ({"max_loras": 1, "tensor_parallel_size": 2}, ValueError, "not supported with"),
    ({"lora_modules": (("a", "/x"),)}, ValueError, "need max_loras"),
    ({"dtype": "int3"}, ValueError, "dtype must be one of"),
])
def test_bad_flags_fail_with_a_clear_message(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_json_whitespace_is_flexible_by_default_and_checked():
    from llmserve.config import EngineConfig

    assert EngineConfig().model.json_whitespace == "flexible"
    assert EngineConfig.from_kwargs(json_whitespace="compact").model.json_whitespace == "compact"
    with pytest.raises(ValueError, match="json_whitespace"):
        EngineConfig.from_kwargs(json_whitespace="pretty")
