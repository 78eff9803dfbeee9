"""Batch invariance on the default kind of path (issue 34): a request's logits, bit for bit,
do not depend on what else shares its steps, how its prompt is chunked or whether its prefix
came from the cache.

A tiny random Llama as a Q4_1 GGUF, served as the default model is: packed int4 weights
(int8 activations where the CPU has AVX512-VNNI), bf16, the compiled decode graphs and the
compiled many-row functions on. Each sampled row's logits are captured from the runner
(``LogitsCapture.SAMPLED``, which keeps the compiled path) and compared with
``torch.equal``: any arithmetic that depends on the row count, on eager vs compiled steps or
on chunking shows here even where it flips no greedy token. Q8_0, Q5_1, Q5_0 (the GGUF
block kernel, issue 29) and Q4_0 files are checked alone, in batches and chunked the same
way, and so are the bf16-activation kernels (``--int4-activations bf16``, a dense bf16
checkpoint with a tied head). With
``LLMSERVE_FAST_ROUNDING=1`` (compiled code rounding once per fused chain) this test fails.
"""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.layers.rotary import native_rotate_qk
from llmserve.model.native.ops import native_available
from llmserve.model.quant.native_int4 import native_int4_a8_available, native_int4_available
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
TARGETS = [[(7 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 19, 33, 70))]
FILLERS = [[(13 * i + 5 * j) % 500 + 3 for j in range(9 + 6 * i)] for i in range(12)]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    hf = make_tiny_checkpoint(str(root / "hf"), arch="llama", hidden=128, intermediate=256,
                              num_heads=4, num_kv_heads=2, seed=11)
    return make_tiny_gguf(hf, str(root / "tiny-q4_1.gguf"), quant="Q4_1", with_tokenizer=True)


def engine(path: str, max_num_seqs: int = 16, num_kv_blocks: int = 512, **kw) -> LLM:
    return LLM(path, dtype="bfloat16", quantization="auto", num_kv_blocks=num_kv_blocks,
               block_size=16, max_num_seqs=max_num_seqs, enforce_eager=False, **kw)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams,
        ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy (or seeded) tokens of each prompt and its sampled rows' logits, stacked."""
    runner = llm.engine.runner
    rows: dict[str, list[torch.Tensor]] = {}
    execute = runner.execute

    def capturing(step):
        out = execute(step)
        if out.logits is not None:   # a sequence's rows: one per sample (k + 1 with drafts)
            samples = dict(zip(step.request_ids, step.num_samples))
            first = 0
            for rid, tokens in zip(out.request_ids, out.token_ids):
                # the rows its emitted tokens came from (accepted drafts, then its own)
                rows.setdefault(rid, []).extend(out.logits[first:first + len(tokens)])
                first += samples[rid]
        return out

    runner.capture, runner.execute = LogitsCapture.SAMPLED, capturing
    try:
        outs = llm.generate(prompts, params)
    finally:
        runner.capture, runner.execute = LogitsCapture.NONE, execute
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, [torch.stack((rows[o.request_id + "-0"] if o.request_id + "-0" in rows
                                 else rows[o.request_id])[:len(t)]) for o, t in zip(outs, tokens)]


def assert_same(alone, other, what: str) -> None:
    for i, ((t0, l0), (t1, l1)) in enumerate(zip(zip(*alone), zip(*other))):
        assert t0 == t1, f"{what}: prompt {i} tokens differ"
        assert torch.equal(l0, l1), (f"{what}: prompt {i} logits differ by up to "
                                     f"{(l0.float() - l1.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logits_are_the_same_alone_batched_chunked_and_cached(gguf_path, params):
    llm = engine(gguf_path, enable_prefix_caching=False)
    assert llm.engine.runner.compiled is not None, "the compiled decode step must be on"
    a8 = "-a8" if native_int4_a8_available() else ""   # the default path of this CPU
    assert f"int4-g32{a8}x" in llm.engine.runner.quantization
    if a8 and native_int4_available():   # auto: q/k/v keeps bf16 activations, both products
        assert "linear:int4-g32x2," in llm.engine.runner.quantization
    if native_available():   # the native SwiGLU, rotary and K/V writes are what runs here
        runner = llm.engine.runner
        assert runner.kernel_plan["mlp_activation"] == "native silu_mul"
        assert runner.kernel_plan["norm"] == "native rms_norm (llmserve_native)"
        assert runner.model.rotary.rows_rotary is native_rotate_qk
        assert runner.backend.native_store
    alone = [run(llm, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    # all four together, then inside batches of 4 + 4 and 4 + 12 other requests (the
    # prefill rows pass the many-row threshold, decode steps change size as others end)
    for extra in (0, 4, 12):
        got = run(llm, TARGETS + FILLERS[:extra], params)
        assert_same(alone, (got[0][:4], got[1][:4]), f"batch of {4 + extra}")
    # prompts chunked at several budgets, sharing their steps with the fillers' decodes
    for budget in (16, 48):
        chunked = engine(gguf_path, enable_prefix_caching=False, max_num_batched_tokens=budget)
        got = run(chunked, TARGETS + FILLERS[:6], params)
        assert_same(alone, (got[0][:4], got[1][:4]), f"chunks of {budget} tokens")
    # the second run of each prompt reads its prefix from the cache
    cached = engine(gguf_path, enable_prefix_caching=True)
    run(cached, TARGETS, params)
    got = run(cached, TARGETS, params)
    assert cached.engine.get_stats().prefix_hit_tokens > 0
    assert_same(alone, got, "after a prefix-cache hit")


@pytest.mark.parametrize("method,kv", [("ngram", "auto"), ("suffix", "auto"), ("ngram", "int8")])
def test_speculation_gives_the_logits_of_plain_decoding(gguf_path, method, kv):
    """Drafts (n-gram or suffix decoding) verified in a compiled verify step: each emitted
    token comes from the same logits as without speculation (the verify rows run as the
    decodes at their positions), over a bf16 or an int8 KV cache."""
    loop = [[(5 * i + j % 7) % 400 + 3 for j in range(42 + 9 * i)] for i in range(6)]
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = engine(gguf_path, enable_prefix_caching=False, kv_cache_dtype=kv)
    alone = [run(plain, [p], long) for p in loop]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    extra = dict(ngram_min=2, ngram_max=3) if method == "ngram" else {}
    spec = engine(gguf_path, enable_prefix_caching=False, speculative_method=method,
                  num_speculative_tokens=3, kv_cache_dtype=kv, **extra)
    assert spec.engine.runner.compiled_verify is not None
    # alone, every step with drafts is a compiled verify step; together, mixed steps
    # verify eagerly
    solo = [run(spec, [p], long) for p in loop]
    assert_same(alone, ([a[0][0] for a in solo], [a[1][0] for a in solo]),
                f"with {method} speculation, alone")
    assert_same(alone, run(spec, loop, long), f"with {method} speculation, batched")
    assert spec.engine.get_stats().spec_accepted_tokens_total > 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logits_are_the_same_after_preemption_and_recompute(gguf_path, params):
    """A pool too small for the whole batch preempts running requests and recomputes
    them later (their prompt and the tokens they had, as one prefill): each request still
    gets the tokens and logits it gets alone."""
    llm = engine(gguf_path, enable_prefix_caching=False)
    alone = [run(llm, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    tight = LLM(gguf_path, dtype="bfloat16", quantization="auto", num_kv_blocks=20,
                block_size=16, max_num_seqs=16, enforce_eager=False,
                enable_prefix_caching=False)
    got = run(tight, TARGETS + FILLERS[:8], params)
    assert tight.engine.get_stats().num_preemptions > 0
    assert_same(alone, (got[0][:4], got[1][:4]), "after preemption")
    assert tight.engine.kv.num_used_blocks == 0


def test_draft_model_speculation_gives_the_logits_of_plain_decoding(gguf_path):
    """A draft model (the target's own file, its own engine) proposes tokens that the
    target verifies: each emitted token comes from the logits plain decoding gives it,
    alone and batched."""
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = engine(gguf_path, enable_prefix_caching=False)
    alone = [run(plain, [p], long) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    spec = engine(gguf_path, enable_prefix_caching=False, speculative_method="draft",
                  draft_model=gguf_path, num_speculative_tokens=3)
    solo = [run(spec, [p], long) for p in TARGETS]
    assert_same(alone, ([a[0][0] for a in solo], [a[1][0] for a in solo]),
                "with a draft model, alone")
    assert_same(alone, run(spec, TARGETS, long), "with a draft model, batched")
    assert spec.engine.get_stats().spec_accepted_tokens_total > 0


@pytest.mark.parametrize("quant", ["Q8_0", "Q5_1", "Q5_0", "Q4_0"])
def test_block_quantized_files_give_the_same_tokens_alone_and_in_batches(tmp_path, quant):
    """A GGUF whose layers are Q8_0 / Q5_1 / Q5_0 blocks (qblock_a8_mm where the CPU has VNNI,
    int8 per channel elsewhere) or Q4_0 blocks (the int4 kernels), compiled decode graphs on: each prompt's greedy tokens and
    sampled logits are the same alone as inside batches of 4, 8 and 16 requests and with its
    prompt chunked."""
    from llmserve.model.quant.native_qblock import native_qblock_available

    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=128, intermediate=256,
                              num_heads=4, num_kv_heads=2, seed=13)
    path = make_tiny_gguf(hf, str(tmp_path / f"tiny-{quant}.gguf"), quant=quant,
                          with_tokenizer=True)
    llm = engine(path, enable_prefix_caching=False)
    assert llm.engine.runner.compiled is not None
    if quant == "Q4_0":   # 4-bit blocks: the int4 kernels
        assert "linear:int4-g32" in llm.engine.runner.quantization
    elif native_qblock_available():
        assert f"gguf-{quant.lower()}-a8" in llm.engine.runner.quantization
    alone = [run(llm, [p], GREEDY) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    for extra in (0, 4, 12):
        got = run(llm, TARGETS + FILLERS[:extra], GREEDY)
        assert_same(alone, (got[0][:4], got[1][:4]), f"{quant}: batch of {4 + extra}")
    chunked = engine(path, enable_prefix_caching=False, max_num_batched_tokens=16)
    got = run(chunked, TARGETS + FILLERS[:4], GREEDY)
    assert_same(alone, (got[0][:4], got[1][:4]), f"{quant}: chunks of 16 tokens")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", ["q4_1-bf16-activations", "dense-bf16-tied"])
def test_bf16_activation_kernels_give_the_same_logits_alone_and_in_batches(gguf_path, tmp_path,
                                                                            case, params):
    """The bf16-activation products (int4_mm for ``--int4-activations bf16``, bf16_mm for a
    dense bf16 checkpoint and its tied LM head with float32 logits) sum every row in one
    order at every row count: a row's logits are the same alone, in batches whose prefill
    steps pass the many-row panels, and chunked."""
    if case == "dense-bf16-tied":
        path = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden=128,
                                    intermediate=256, num_heads=4, num_kv_heads=2, seed=17,
                                    tie=True)
        kw: dict = {}
    else:
        path, kw = gguf_path, {"int4_activations": "bf16"}
    llm = engine(path, enable_prefix_caching=False, **kw)
    assert llm.engine.runner.compiled is not None
    if case != "dense-bf16-tied":
        assert "linear:int4-g32x" in llm.engine.runner.quantization
    alone = [run(llm, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    for extra in (4, 12):
        got = run(llm, TARGETS + FILLERS[:extra], params)
        assert_same(alone, (got[0][:4], got[1][:4]), f"{case}: batch of {4 + extra}")
    chunked = engine(path, enable_prefix_caching=False, max_num_batched_tokens=16, **kw)
    got = run(chunked, TARGETS + FILLERS[:4], params)
    assert_same(alone, (got[0][:4], got[1][:4]), f"{case}: chunks of 16 tokens")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_norm_sums_a_row_the_same_way_alone_batched_and_in_every_compiled_graph(dtype):
    """The default model's width (576) and the embedding lookup of a GGUF table before the
    first norm (int8 rows), as the runner runs them: eagerly for 1..300 rows and compiled
    (a graph for one row, a dynamic one for several). Each row's normed values are
    bit-identical on every path. Inductor's own norm summed a row's squares in an order of
    its choosing per graph: fused with the lookup it vectorized across rows, and in the
    many-row function of prefill chunks about 1 row in 150 came out an ulp apart from
    ATen's; on the default model that moved a prompt's logits by up to 1.1."""
    from llmserve.model.executor.inductor_setup import configure_inductor
    from llmserve.model.layers.compiled_rows import enable_compiled_rows
    from llmserve.model.layers.embedding import VocabEmbedding
    from llmserve.model.layers.norm import RMSNorm
    from llmserve.model.quant.kernels import Int8Weight, quantize_int8

    configure_inductor()
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    embed = VocabEmbedding(1000, 576, dtype, cpu)
    q, scale = quantize_int8(torch.randn(1000, 576, generator=gen))
    embed.weight, embed.qweight = None, Int8Weight(q, scale).with_int8_activations()
    norm = RMSNorm(576, 1e-5, dtype, cpu)
    norm.weight.data.copy_(torch.rand(576, generator=gen) + 0.5)
    enable_compiled_rows(norm, dtype, cpu)   # whatever a compiling engine gives its norms

    def first_norm(ids: torch.Tensor) -> torch.Tensor:
        return norm(embed(ids))   # as ModelBase.forward and a layer begin

    torch._dynamo.reset()
    one, many = torch.compile(first_norm, dynamic=False), torch.compile(first_norm, dynamic=True)
    ids = torch.randint(0, 1000, (300,), generator=gen)
    with torch.inference_mode():
        alone = torch.cat([first_norm(ids[i:i + 1]) for i in range(len(ids))])
        paths = {"eager, 300 rows": first_norm(ids),
                 "compiled, one row": torch.cat([one(ids[i:i + 1]) for i in range(len(ids))]),
                 "compiled, 8 rows": torch.cat([many(ids[i:i + 8])
                                                for i in range(0, len(ids), 8)])}
        # rows of other magnitudes, through the norm alone (a residual stream's rows)
        for scale_ in (0.05, 1.0, 40.0):
            x = (torch.randn(300, 576, generator=gen) * scale_).to(dtype)
            rows = torch.cat([norm(x[i:i + 1]) for i in range(len(x))])
            for count in (2, 64, 300):
                batched = torch.cat([norm(x[i:i + count]) for i in range(0, len(x), count)])
                differing = (rows != batched).any(-1).sum().item()
                assert differing == 0, f"x{scale_}, {count} rows a call: {differing} rows differ"
    for path, got in paths.items():
        differing = (alone != got).any(-1).sum().item()
        assert differing == 0, f"{path}: {differing} of {len(ids)} rows differ"


@pytest.mark.parametrize("kv,params", [("auto", GREEDY), ("auto", SEEDED), ("int8", GREEDY)],
                         ids=["greedy", "seeded", "int8-kv-greedy"])
def test_a_float32_model_gives_the_same_logits_alone_batched_and_chunked(gguf_path, kv, params):
    """``--dtype float32`` (exact fp32) beside the bf16 kernels of an AVX-512 tier: its
    float32 (or int8) KV cache is read by the avx2 library's ``paged_decode`` in decodes and
    prompt rows alike, so a row's logits do not depend on the batch or on chunking (compiled
    decodes once attended by inductor's loops, summed in another order than mixed steps)."""
    from llmserve.model.attention.native_decode import native_decode_serves

    def fp32(**kw) -> LLM:
        return LLM(gguf_path, dtype="float32", quantization="auto", num_kv_blocks=512,
                   block_size=16, max_num_seqs=16, enforce_eager=False,
                   enable_prefix_caching=False, kv_cache_dtype=kv, **kw)

    llm = fp32()
    assert llm.engine.runner.compiled is not None
    native = native_decode_serves(torch.float32, torch.int8 if kv == "int8" else None)
    assert llm.engine.runner.backend.native_decode is native
    if not native:
        pytest.skip("no float32 decode kernel for this cache on this CPU tier")
    alone = [run(llm, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    got = run(llm, TARGETS + FILLERS[:12], params)
    assert_same(alone, (got[0][:4], got[1][:4]), "batch of 16")
    chunked = fp32(max_num_batched_tokens=16)
    got = run(chunked, TARGETS + FILLERS[:6], params)
    assert_same(alone, (got[0][:4], got[1][:4]), "chunks of 16 tokens")


@pytest.mark.parametrize("kv,params", [("int8", GREEDY), ("int8", SEEDED),
                                       ("fp8_e4m3", GREEDY)], ids=["int8-greedy", "int8-seeded",
                                                                  "fp8-greedy"])
def test_an_8bit_kv_cache_gives_the_same_logits_alone_batched_chunked_and_from_the_prefix_cache(
        gguf_path, kv, params):
    """``--kv-cache-dtype int8`` / ``fp8_e4m3``: where a tier has a library, a native kernel
    reads the codes and scales in place for decodes, verified drafts and prompt rows alike
    (compiled decodes once attended by inductor's loops, summed in another order than mixed
    steps); on the none tier every row takes the eager gather + SDPA op. Either way a row's
    logits do not depend on the batch, on chunking or on a prefix hit."""
    from llmserve.model.native.ops import tier_ops

    llm = engine(gguf_path, kv_cache_dtype=kv, enable_prefix_caching=False)
    assert llm.engine.runner.compiled is not None
    assert llm.engine.runner.backend.native_decode is (tier_ops() is not None)
    alone = [run(llm, [p], params) for p in TARGETS]
    alone = ([a[0][0] for a in alone], [a[1][0] for a in alone])
    for extra in (0, 5, 12):                   # batches of 4, 9 and 16
        got = run(llm, TARGETS + FILLERS[:extra], params)
        assert_same(alone, (got[0][:4], got[1][:4]), f"{kv} KV: batch of {4 + extra}")
    chunked = engine(gguf_path, kv_cache_dtype=kv, enable_prefix_caching=False,
                     max_num_batched_tokens=16)
    got = run(chunked, TARGETS + FILLERS[:6], params)
    assert_same(alone, (got[0][:4], got[1][:4]), f"{kv} KV: chunks of 16 tokens")
    cached = engine(gguf_path, kv_cache_dtype=kv)
    run(cached, TARGETS, params)
    got = run(cached, TARGETS + FILLERS[:3], params)
    assert cached.engine.get_stats().prefix_hit_tokens > 0
    assert_same(alone, (got[0][:4], got[1][:4]), f"{kv} KV: after a prefix-cache hit")
