"""Batch invariance beyond the default model's shape and format (issue 34: "every weight
format", batches "of 1-64"): a request's greedy tokens and sampled rows' logits, bit for bit,
are the same alone, inside batches of up to 64 requests and with its prompt chunked, for
GGUFs whose layers are Q4_K / Q5_K / Q6_K blocks (the GGUF block kernel with int8
activations where the CPU has VNNI; elsewhere Q4_K as int4 groups, the others int8 per
channel), a tied Q6_K table (its head on the block kernel, its lookup decoding rows; with
Q4_K layers also after a prefix-cache hit, preemption and suffix drafts), a wide
attention group (seven query heads over one KV head), contexts past one of decode
attention's 128-key pull chunks, and on the forced avx2 tier; compiled decode graphs on. The Q8_0 / Q5_x / Q4_x files are covered in test_batch_invariance.py,
whose helpers these tests share.
"""
from __future__ import annotations

import pytest
import torch

from tests.model.test_batch_invariance import GREEDY, SEEDED, TARGETS, assert_same, engine, run
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

#: 60 more requests of 3..62 tokens beside the four targets: a step of 64 rows
MANY_FILLERS = [[(17 * i + 3 * j) % 500 + 3 for j in range(3 + i)] for i in range(60)]


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_files_give_the_same_tokens_alone_and_in_batches_of_up_to_64(tmp_path, quant):
    from llmserve.model.quant.native_qblock import native_qblock_available

    # the Q6_K file ties its head to a Q6_K table (a Q4_K_M file's): the lookup decodes
    # rows from the head's packed blocks inside the compiled graph; the Q5_K file has an
    # untied Q6_K table, only looked up
    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=256, intermediate=512,
                              num_heads=4, num_kv_heads=2, seed=17, tie=quant == "Q6_K")
    path = make_tiny_gguf(hf, str(tmp_path / f"tiny-{quant}.gguf"), quant=quant,
                          with_tokenizer=True,
                          embedding_quant="Q6_K" if quant in ("Q5_K", "Q6_K") else None)
    llm = engine(path, max_num_seqs=64, enable_prefix_caching=False)
    assert llm.engine.runner.compiled is not None
    if native_qblock_available():   # every K-quant in its own blocks
        assert f"gguf-{quant.lower()}-a8" in llm.engine.runner.quantization
        plan = llm.engine.runner.kernel_plan
        if quant in ("Q5_K", "Q6_K"):
            assert plan["embedding"] == "gguf-q6_k"
        if quant == "Q6_K":
            assert plan["lm_head"] == "tied:gguf-q6_k-a8"
    elif quant == "Q4_K":   # the int4 kernels, an exact re-layout of its sub-blocks
        assert "linear:int4-g32" in llm.engine.runner.quantization
    alone = [run(llm, [p], GREEDY) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    for rows in alone[1]:
        assert torch.isfinite(rows).all()       # a NaN row would compare unequal to itself
    for extra in (5, 60):
        got = run(llm, TARGETS + MANY_FILLERS[:extra], GREEDY)
        assert_same(alone, (got[0][:4], got[1][:4]), f"{quant}: batch of {4 + extra}")
    chunked = engine(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    got = run(chunked, TARGETS + MANY_FILLERS[:4], GREEDY)
    assert_same(alone, (got[0][:4], got[1][:4]), f"{quant}: chunks of 16 tokens")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_q4_k_m_like_file_gives_the_same_tokens_after_prefix_hits_preemption_and_drafts(
        tmp_path, params):
    """Q4_K layers and a tied Q6_K table (a Q4_K_M file of Llama-3.2-1B or Qwen3: the block
    kernel's 4-bit mode, its Q6_K head, the lookup decoding rows from the head's blocks):
    tokens and logits alone equal those after a prefix-cache hit, after preemption and
    recompute, and with suffix-decoding drafts verified, bit for bit."""
    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=256, intermediate=512,
                              num_heads=4, num_kv_heads=2, seed=29, tie=True)
    path = make_tiny_gguf(hf, str(tmp_path / "tiny-q4_k_m.gguf"), quant="Q4_K",
                          embedding_quant="Q6_K", with_tokenizer=True)
    from llmserve.model.quant.native_qblock import native_qblock_available

    plain = engine(path, enable_prefix_caching=False)
    if native_qblock_available():   # else Q4_K is int4 groups and the table int8 rows
        assert "gguf-q4_k-a8" in plain.engine.runner.quantization
        assert plain.engine.runner.kernel_plan["lm_head"] == "tied:gguf-q6_k-a8"
        assert plain.engine.runner.kernel_plan["embedding"] == "gguf-q6_k"
    alone = [run(plain, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    cached = engine(path, enable_prefix_caching=True)
    run(cached, TARGETS, params)
    got = run(cached, TARGETS, params)
    assert cached.engine.get_stats().prefix_hit_tokens > 0
    assert_same(alone, got, "Q4_K + Q6_K table: after a prefix-cache hit")
    tight = engine(path, enable_prefix_caching=False, num_kv_blocks=20)
    got = run(tight, TARGETS + MANY_FILLERS[:8], params)
    assert tight.engine.get_stats().num_preemptions > 0
    assert_same(alone, (got[0][:4], got[1][:4]), "Q4_K + Q6_K table: after preemption")
    spec = engine(path, enable_prefix_caching=False, speculative_method="suffix",
                  num_speculative_tokens=3)
    assert_same(alone, run(spec, TARGETS, params), "Q4_K + Q6_K table: with suffix drafts")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_wide_attention_group_gives_the_same_tokens_alone_and_in_batches(tmp_path, params):
    """Seven query heads over one KV head (head size 64: Qwen2.5-0.5B's group), whose decode
    attention runs a fixed kernel since it covers groups of up to 8: tokens and logits alone,
    in batches of 4, 9 and 16 and chunked, bit for bit."""
    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=448, intermediate=256,
                              num_heads=7, num_kv_heads=1, seed=23)
    path = make_tiny_gguf(hf, str(tmp_path / "tiny-q4_1.gguf"), quant="Q4_1",
                          with_tokenizer=True)
    llm = engine(path, enable_prefix_caching=False)
    alone = [run(llm, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    for extra in (0, 5, 12):
        got = run(llm, TARGETS + MANY_FILLERS[:extra], params)
        assert_same(alone, (got[0][:4], got[1][:4]), f"7 heads over 1: batch of {4 + extra}")
    chunked = engine(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    got = run(chunked, TARGETS + MANY_FILLERS[:4], params)
    assert_same(alone, (got[0][:4], got[1][:4]), "7 heads over 1: chunks of 16 tokens")



#: Prompts of 150-300 tokens: decode attention walks two or three 128-key pull chunks. The
#: last three start with the same 64 tokens (four blocks), so after a prefix-cache hit their
#: rows share first blocks but not tails.
LONG_TARGETS = [[(7 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((300, 150))]
LONG_TARGETS += [LONG_TARGETS[0][:64] + [(19 * i + 7 * j) % 500 + 3 for j in range(n)]
                 for i, n in enumerate((100, 170, 210))]


def test_long_contexts_give_the_same_tokens_alone_in_batches_chunked_and_cached(tmp_path):
    """Decode attention's fixed kernel (4 heads over 2 of 64) with contexts past one pull
    chunk: a row's tokens and logits alone (one task per KV head), in batches of 5 to 21 (a
    task a row, split over the threads by keys), chunked (causal rows that skip their pulls)
    and after prefix-cache hits (rows that share first blocks), bit for bit."""
    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=256, intermediate=512,
                              num_heads=4, num_kv_heads=2, seed=31)
    path = make_tiny_gguf(hf, str(tmp_path / "tiny-q4_0.gguf"), quant="Q4_0",
                          with_tokenizer=True)
    llm = engine(path, num_kv_blocks=1024, enable_prefix_caching=False)
    alone = [run(llm, [p], GREEDY) for p in LONG_TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    for extra in (0, 16):
        got = run(llm, LONG_TARGETS + MANY_FILLERS[:extra], GREEDY)
        assert_same(alone, (got[0][:5], got[1][:5]), f"long contexts: batch of {5 + extra}")
    chunked = engine(path, num_kv_blocks=1024, max_num_batched_tokens=48,
                     enable_prefix_caching=False)
    got = run(chunked, LONG_TARGETS + MANY_FILLERS[:3], GREEDY)
    assert_same(alone, (got[0][:5], got[1][:5]), "long contexts: chunks of 48 tokens")
    cached = engine(path, num_kv_blocks=1024, enable_prefix_caching=True)
    run(cached, LONG_TARGETS[:1], GREEDY)
    got = run(cached, LONG_TARGETS, GREEDY)
    assert cached.engine.get_stats().prefix_hit_tokens >= 3 * 64
    assert_same(alone, got, "long contexts: after prefix-cache hits")

_FORCED_TIER = """
import sys, torch
from tests.model.test_batch_invariance import GREEDY, TARGETS, run
from tests.model.test_batch_invariance_formats import MANY_FILLERS
from llmserve import LLM, SamplingParams
dtype = sys.argv[3]
llm = LLM(sys.argv[1], quantization="auto", num_kv_blocks=512, block_size=16, max_num_seqs=64,
          enforce_eager=False, enable_prefix_caching=False, dtype=dtype)
plan = llm.engine.runner.kernel_plan
alone = [run(llm, [p], GREEDY) for p in TARGETS]
batched = run(llm, TARGETS + MANY_FILLERS, GREEDY)
small = run(llm, TARGETS + MANY_FILLERS[:5], GREEDY)
chunked = run(LLM(sys.argv[1], quantization="auto", num_kv_blocks=512, block_size=16,
                  enforce_eager=False, enable_prefix_caching=False, dtype=dtype,
                  max_num_batched_tokens=16), TARGETS + MANY_FILLERS[:6], GREEDY)
# suffix drafts: the first pass's outputs join the global tree, the second pass drafts
# from them (every draft a verified row)
long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
plain = [run(llm, [p], long) for p in TARGETS[:3]]
spec = LLM(sys.argv[1], quantization="auto", num_kv_blocks=512, block_size=16, dtype=dtype,
           enforce_eager=False, enable_prefix_caching=False, speculative_method="suffix",
           num_speculative_tokens=3, speculative_adaptive=False)
first = run(spec, TARGETS[:3], long)
before = spec.engine.get_stats().spec_accepted_tokens_total
drafted = run(spec, TARGETS[:3], long)
torch.save({"tier": plan["cpu"]["tier"], "compiled": llm.engine.runner.compiled is not None,
            "dtype": plan["dtype"], "head": plan["lm_head"], "linears": plan["linear"],
            "f32": plan["native_kernels"].get("f32"), "granules": plan["gemm_row_granule"],
            "alone": ([a[0][0] for a in alone], [a[1][0] for a in alone]),
            "batched": (batched[0][:4], batched[1][:4]), "first": first, "drafted": drafted,
            "small": (small[0][:4], small[1][:4]),
            "chunked": (chunked[0][:4], chunked[1][:4]),
            "plain": ([a[0][0] for a in plain], [a[1][0] for a in plain]),
            "accepted": spec.engine.get_stats().spec_accepted_tokens_total - before},
           sys.argv[2])
"""


@pytest.mark.parametrize("tier,quant,dtype", [("avx2", "Q6_K", "auto"),
                                              ("avx2", "dense", "auto"),
                                              ("none", "Q4_1", "bfloat16"),
                                              ("none", "dense", "float32"),
                                              ("none", "dense", "bfloat16")])
def test_lower_tiers_give_the_same_tokens_alone_in_a_batch_of_64_and_chunked(tmp_path, tier,
                                                                            quant, dtype):
    """The same check on a forced lower tier (``LLMSERVE_CPU_ISA``, a fresh process: the
    tier is chosen once at start-up), batches of 9 and 64, compiled graphs on, also with
    suffix drafts verified
    (issue 32: exact on every tier): avx2 (its own int8-activation products, decode
    attention and norm) for a Q6_K file and for a dense checkpoint, both ``--dtype auto``
    (float32 on this tier: the dense linears run the library's ``f32_mm``, PyTorch's
    float32 GEMM sums by the row count); none (PyTorch's int4 product at every row count,
    decode and verified rows through one attention op) for a Q4_1 file in bf16, and for a
    dense checkpoint in float32 and bf16 (oneDNN's prepacked products, every call's rows
    padded to the granule at which they sum a row as alone: gemm_row_granule; float32 took
    MKL's unpadded GEMM before, 2.9e-06 apart in a batch of 9)."""
    import os
    import subprocess
    import sys

    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=256, intermediate=512,
                              num_heads=4, num_kv_heads=2, seed=19,
                              tie=quant == "dense")
    path = hf if quant == "dense" else make_tiny_gguf(
        hf, str(tmp_path / f"tiny-{quant}.gguf"), quant=quant, with_tokenizer=True)
    out = tmp_path / "result.pt"
    env = dict(os.environ, LLMSERVE_CPU_ISA=tier)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", _FORCED_TIER, path, str(out), dtype], env=env,
                   check=True, capture_output=True, text=True, timeout=600, cwd=repo)
    got = torch.load(out)
    assert got["tier"] == tier and got["compiled"]
    if quant == "dense" and tier != "none":   # float32 weights through the library's f32_mm
        assert got["dtype"] == "float32" and got["head"] == "tied:f32_mm", got["head"]
        assert got["linears"] == {"dense": 4 * 2} and got["f32"]
        assert got["granules"] == {}
    elif quant == "dense":   # PyTorch's GEMMs, their calls padded to a row granule
        onednn = got["head"] == "tied:onednn-prepacked"
        kind = ("onednn-" if onednn else "") + ("bf16" if onednn and dtype == "bfloat16"
                                                 else dtype)
        assert got["granules"].get(kind, 0) > 1, got["granules"]
    what = f"{tier} tier, {quant}"
    assert_same(got["alone"], got["small"], f"{what}: batch of 9")
    assert_same(got["alone"], got["batched"], f"{what}: batch of 64")
    assert_same(got["alone"], got["chunked"], f"{what}: chunks of 16 tokens")
    assert got["accepted"] > 0    # the second pass verified drafts and kept some
    assert_same(got["plain"], got["first"], f"{what}: suffix speculation on")
    assert_same(got["plain"], got["drafted"], f"{what}: with suffix drafts")


_WIDE_GROUP_NONE_TIER = """
import sys, torch
from tests.model.test_batch_invariance import GREEDY, run
from tests.model.test_batch_invariance_formats import MANY_FILLERS, LONG_TARGETS
from llmserve import LLM
llm = LLM(sys.argv[1], quantization="auto", num_kv_blocks=1024, block_size=16, max_num_seqs=64,
          enforce_eager=False, enable_prefix_caching=False, dtype="bfloat16")
alone = [run(llm, [p], GREEDY) for p in LONG_TARGETS]
batched = {n: run(llm, LONG_TARGETS + MANY_FILLERS[:n - 5], GREEDY) for n in (9, 21)}
torch.save({"tier": llm.engine.runner.kernel_plan["cpu"]["tier"],
            "alone": ([a[0][0] for a in alone], [a[1][0] for a in alone]),
            "batched": {n: (b[0][:5], b[1][:5]) for n, b in batched.items()}}, sys.argv[2])
"""


def test_none_tier_wide_head_groups_give_the_same_logits_alone_and_in_a_batch(tmp_path):
    """16 query heads over 2 KV heads of 128 (Qwen2.5-3B's grouping) on the none tier, with
    150-300-token contexts: greedy tokens and logits alone against batches of 9 and 21. SDPA
    sums a row differently when its padded key count changes, so each row attends over a
    key count of its own
    (``reference.key_width``); padded to the step's widest table, logits were 0.06-0.08
    apart here."""
    import os
    import subprocess
    import sys

    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=2048, intermediate=256,
                              num_heads=16, num_kv_heads=2, seed=31)
    path = make_tiny_gguf(hf, str(tmp_path / "wide.gguf"), quant="Q4_0", with_tokenizer=True)
    out = tmp_path / "result.pt"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", _WIDE_GROUP_NONE_TIER, path, str(out)],
                   env=dict(os.environ, LLMSERVE_CPU_ISA="none"), check=True,
                   capture_output=True, text=True, timeout=600, cwd=repo)
    got = torch.load(out)
    assert got["tier"] == "none"
    for n, batched in got["batched"].items():
        assert_same(got["alone"], batched, f"none tier, 16 heads over 2 of 128: batch of {n}")
