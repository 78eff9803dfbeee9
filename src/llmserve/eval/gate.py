"""The quality gate: run configurations on a fixed text and prompts, compare to a reference.

Each configuration is a named preset of engine settings (dtype, ``--quantization``,
``--kv-cache-dtype``) applied to the same model. For each one the gate

1. scores the shipped text (``eval_text.txt``) in windows of ``window`` tokens: every
   position's next-token distribution (one prefill per window, prefix cache off);
2. generates ``continuation_tokens`` greedy tokens for each fixed prompt;
3. compares with the reference configuration: perplexity change, top-1 agreement, mean KL,
   greedy agreement (see :mod:`llmserve.eval.metrics`).

A configuration passes when its perplexity rises at most ``max_ppl_increase`` (relative),
its top-1 agreement is at least ``min_top1`` and its mean KL at most ``max_kl``; greedy
agreement is reported, not gated (one near-tie token flips every token after it).
Thresholds per preset are in :mod:`llmserve.eval.presets`; docs/QUANTIZATION.md explains them.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from llmserve.config import EngineConfig
from llmserve.eval import metrics
from llmserve.eval.presets import PRESETS, PROMPTS, TEXT_PATH
from llmserve.model.executor.capture import LogitsCapture

logger = logging.getLogger(__name__)

@dataclass
class ConfigResult:
    name: str
    quantization: str
    kv_dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    ppl: float
    seconds: float
    greedy: list[list[int]] = field(repr=False, default_factory=list)
    ppl_increase: float = 0.0
    top1: float = 1.0
    kl: float = 0.0
    greedy_agreement: float = 1.0
    passed: Optional[bool] = None    # None: the reference
    failures: list[str] = field(default_factory=list)


def eval_engine(model: Optional[str], settings: dict, window: int,
                num_threads: Optional[int] = None):
    """An eager engine for scoring ``window``-token windows with ``settings`` (a preset's
    engine settings), prefix cache off."""
    from llmserve.llm_engine import LLMEngine

    cfg = EngineConfig.from_kwargs(model=model, enable_prefix_caching=False, enforce_eager=True,
                       num_kv_blocks=max(64, 2 * window // 16 + 8), block_size=16,
                       max_num_batched_tokens=max(2048, window), max_num_seqs=len(PROMPTS),
                       num_threads=num_threads, **settings)
    return LLMEngine(cfg)


def run_prompts(engine, prompts: list[list[int]], max_tokens: int, capture: bool):
    """Greedy outputs of ``prompts`` and (capture) each prompt's all-position logits."""
    from llmserve.sampling_params import SamplingParams

    runner = engine.runner
    runner.capture = LogitsCapture.ALL if capture else LogitsCapture.NONE
    logits: dict[str, list[torch.Tensor]] = {}
    inner = runner.execute

    def execute(step):
        out = inner(step)
        for rid, rows in (out.all_logits or {}).items():
            logits.setdefault(rid, []).append(rows)
        return out

    runner.execute = execute
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"eval-{i}", ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    tokens.setdefault(out.request_id, []).extend(c.token_ids)
    finally:
        runner.execute = inner
        runner.capture = LogitsCapture.NONE
    rids = [f"eval-{i}" for i in range(len(prompts))]
    prompt_logits = [torch.cat(logits[r])[:len(p)] for r, p in zip(rids, prompts)] if capture \
        else []
    return [tokens.get(r, []) for r in rids], prompt_logits


def score_text(engine, text_ids: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of every scored position of ``text_ids`` (windows of ``window`` tokens, each
    a fresh prompt) and the tokens they predict: ``(logp (N, V), targets (N,))``."""
    windows = [text_ids[i:i + window] for i in range(0, len(text_ids), window)]
    logps, targets = [], []
    for w in (w for w in windows if len(w) >= 2):
        _, (logits,) = run_prompts(engine, [w], 1, capture=True)
        logps.append(metrics.log_probs(logits[:-1, :engine.vocab_size]))
        targets.append(torch.tensor(w[1:]))
    return torch.cat(logps), torch.cat(targets)


def evaluate_config(name: str, model: Optional[str], text_ids: list[int], window: int,
                    prompt_ids: list[list[int]], continuation_tokens: int,
                    num_threads: Optional[int] = None):
    """Run one preset: (result, log-probs of every scored text position, their targets)."""
    t0 = time.time()
    engine = eval_engine(model, PRESETS[name].settings, window, num_threads)
    logp, target = score_text(engine, text_ids, window)
    greedy, _ = run_prompts(engine, prompt_ids, continuation_tokens, capture=False)
    runner = engine.runner
    result = ConfigResult(name=name, quantization=runner.quantization, kv_dtype=engine.kv_dtype,
                          weight_bytes=runner.weight_bytes,
                          kv_bytes_per_token=runner.kv.bytes_per_token,
                          ppl=float(torch.exp(torch.tensor(metrics.mean_nll(logp, target)))),
                          seconds=0.0, greedy=greedy)
    del engine, runner
    gc.collect()
    result.seconds = time.time() - t0
    return result, logp, target


def compare(result: ConfigResult, reference: ConfigResult, ref_logp: torch.Tensor,
            logp: torch.Tensor) -> None:
    """Fill ``result``'s comparison fields and its pass/fail against its preset's thresholds."""
    th = PRESETS[result.name].thresholds
    result.ppl_increase = result.ppl / reference.ppl - 1.0
    result.top1 = metrics.top1_agreement(ref_logp, logp)
    result.kl = metrics.mean_kl(ref_logp, logp)
    result.greedy_agreement = metrics.greedy_agreement(reference.greedy, result.greedy)
    if result.ppl_increase > th.max_ppl_increase:
        result.failures.append(f"PPL +{result.ppl_increase:.2%} > +{th.max_ppl_increase:.1%}")
    if result.top1 < th.min_top1:
        result.failures.append(f"top-1 {result.top1:.1%} < {th.min_top1:.0%}")
    if result.kl > th.max_kl:
        result.failures.append(f"KL {result.kl:.4f} > {th.max_kl}")
    result.passed = not result.failures


def run_gate(model: Optional[str], configs: list[str], reference: str = "fp32",
             max_tokens: int = 512, window: int = 256, continuation_tokens: int = 32,
             num_threads: Optional[int] = None) -> list[ConfigResult]:
    """Evaluate ``reference`` then every other configuration; results in that order."""
    unknown = [c for c in [reference, *configs] if c not in PRESETS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; presets: {sorted(PRESETS)}")
    if window < 2 or max_tokens < 2:
        raise ValueError("window and max_tokens must be >= 2")
    from llmserve.default_model import resolve_model_path
    from llmserve.tokenizer.tokenizer import Tokenizer

    path = resolve_model_path(model)
    tokenizer = Tokenizer.from_path(path)
    with open(TEXT_PATH, encoding="utf-8") as f:
        text_ids = tokenizer.encode(f.read())[:max_tokens]
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    args = (path, text_ids, window, prompt_ids, continuation_tokens, num_threads)
    ref, ref_logp, _ = evaluate_config(reference, *args)
    logger.info("reference %s: PPL %.3f in %.1fs", reference, ref.ppl, ref.seconds)
    results = [ref]
    for name in configs:
        if name == reference:
            continue
        res, logp, _ = evaluate_config(name, *args)
        compare(res, ref, ref_logp, logp)
        logger.info("%s: PPL %.3f (%+.2f%%) top-1 %.3f KL %.4f in %.1fs", name, res.ppl,
                    100 * res.ppl_increase, res.top1, res.kl, res.seconds)
        results.append(res)
    return results


def format_table(results: list[ConfigResult]) -> str:
    """A plain-text table, one row per configuration (the reference first)."""
    width = max([10, *(len(r.name) for r in results)])
    head = (f"{'config':<{width}} {'weights':>8} {'KV B/tok':>8} {'PPL':>8} {'dPPL':>7} {'top-1':>6} "
            f"{'KL':>7} {'greedy':>6}  {'gate':<5} quantization")
    lines = [head, "-" * len(head)]
    for r in results:
        gate = "ref" if r.passed is None else ("pass" if r.passed else "FAIL")
        lines.append(f"{r.name:<{width}} {r.weight_bytes / 1e6:7.1f}M {r.kv_bytes_per_token:8d} "
                     f"{r.ppl:8.3f} {100 * r.ppl_increase:+6.2f}% {r.top1:6.3f} {r.kl:7.4f} "
                     f"{r.greedy_agreement:6.2f}  {gate:<5} {r.quantization} kv={r.kv_dtype}")
        lines.extend(f"{'':<{width + 2}}- {f}" for f in r.failures)
    return "\n".join(lines)
