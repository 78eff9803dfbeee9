"""The `llmserve` command line: generate, serve, engine, router, serve-ray, eval, bench, kv-calc,
export-hf, keys, billing."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from llmserve.config import INT4_ACTIVATIONS, EngineConfig
from llmserve.pooling_params import POOLING_METHODS
from llmserve.server.reasoning.parsers import REASONING_PARSERS
from llmserve.structured_output.spec import JSON_WHITESPACE
from llmserve.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from llmserve.contract.server_limits import ServerLimits
    from llmserve.server.responses_api.store import ResponseStore

logger = logging.getLogger("llmserve")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags; each maps to the EngineConfig field of the same name in snake case."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX512_BF16/AMX), "
                        "else float32")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3"],
                   help="KV cache dtype, independent of the weights (auto: same as --dtype); "
                        "int8 / fp8_e4m3 store a float32 scale per token and head")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weights: auto keeps a GGUF file's quantized weights packed (bf16 on "
                        "CPU); none dequantizes; int8 (per channel) / int4 (group-wise) "
                        "quantize any checkpoint at load (docs/QUANTIZATION.md)")
    g.add_argument("--quantization-group-size", type=int, default=32,
                   choices=[32, 64, 128, 256], help="int4 group size along the input dimension")
    g.add_argument("--int4-activations", default="auto", choices=INT4_ACTIVATIONS,
                   help="what meets int4 weights: int8 (rows quantized in blocks of 32, "
                        "llama.cpp's Q8 arithmetic, faster many-row products: docs/BENCHMARKS.md) "
                        "or bf16 (exact codes x bf16); auto: int8 where the CPU has AVX512-VNNI, "
                        "except a q/k/v projection of int4 groups, which keeps bf16 where the "
                        "CPU has AVX512-BF16 (block-format q/k/v and the avx2 tier stay int8; "
                        "docs/QUANTIZATION.md)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool size (default: max-num-seqs x max-model-len tokens, capped by "
                        "--kv-cache-fraction of free memory; committed only as used on CPU)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.5)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-commit-tokens", type=int, default=5120,
                   help="CPU: KV tokens of the pool written (memory committed) at start; "
                        "cached blocks that served no prefix hit are recycled before the pool "
                        "commits more, so resident KV memory follows the peak in use (a "
                        "number >= the pool commits all)")
    g.add_argument("--kv-cache-prefault-tokens", type=int, default=None,
                   help="CPU: KV tokens beyond those committed at start that a background "
                        "thread commits while no step runs (default: max-num-seqs x 256, at "
                        "most 1 GiB of KV; 0: off), so a burst's new blocks take no page "
                        "faults inside its steps")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-prefill-tokens-per-step", type=int, default=512,
                   help="prompt tokens per step, shared by the prefill chunks beside the "
                        "decodes (default 512: first tokens sooner under load, bursts "
                        "spread over steps; 0: no cap but --max-num-batched-tokens)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--aging-rate", type=float, default=0.1)
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--engine-seed", dest="seed", type=int, default=0)
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never compile the decode step (default: compile at start-up)")
    g.add_argument("--startup-compile", choices=["wait", "background"], default=None,
                   help="graphs not saved yet (a first start): compile them before serving "
                        "(wait) or in a child process while steps run eagerly (background; "
                        "serve's default)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "paged", "reference"])
    g.add_argument("--json-whitespace", default="flexible", choices=list(JSON_WHITESPACE),
                   help="JSON answers (response_format, structured_outputs json): flexible "
                        "allows whitespace between tokens, as vLLM does (pretty-printed JSON, "
                        "what models were trained on); compact allows none")
    g.add_argument("--pooling", default="last", choices=list(POOLING_METHODS),
                   help="embeddings (/v1/embeddings): pool the final hidden state of the "
                        "last prompt position (decoder models), the mean of all, or the "
                        "first (cls); see docs/EMBEDDINGS.md")
    s = p.add_argument_group("speculative decoding (docs/SPECULATIVE.md)")
    s.add_argument("--speculative-method", default=None, choices=["ngram", "suffix", "draft"],
                   help="ngram: prompt lookup (no extra model); suffix: suffix decoding over "
                        "the request's tokens and recent outputs (agent loops, edits); draft: "
                        "a smaller model with the same tokenizer (--draft-model)")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="most draft tokens per sequence and step (k)")
    s.add_argument("--ngram-min", type=int, default=1, help="shortest suffix the n-gram "
                   "proposer matches")
    s.add_argument("--ngram-max", type=int, default=4, help="longest suffix it matches")
    s.add_argument("--suffix-min-confidence", type=float, default=0.1,
                   help="suffix: stop a draft when the share of its most frequent "
                        "continuation (multiplied along the draft) falls below this")
    s.add_argument("--suffix-max-depth", type=int, default=32,
                   help="suffix: longest match plus draft its suffix trees spell out")
    s.add_argument("--suffix-cache-max-nodes", type=int, default=200_000,
                   help="suffix: nodes of the tree over recent requests' outputs (oldest "
                        "requests evicted past it; 0: own tokens only)")
    s.add_argument("--draft-model", default=None,
                   help="draft model (HF folder or .gguf); the target's own GGUF with "
                        "--draft-quantization int4 drafts with its packed 4-bit weights")
    s.add_argument("--draft-quantization", default="auto",
                   choices=["auto", "none", "int8", "int4"], help="draft model weights")
    s.add_argument("--speculative-max-batch", type=int, default=16,
                   help="no speculation while more sequences run (see docs/SPECULATIVE.md)")
    s.add_argument("--no-speculative-adaptive", dest="speculative_adaptive",
                   action="store_false", help="always draft k tokens (no per-request "
                   "back-off on low acceptance)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard every layer over N ranks (processes; gloo on CPU, NCCL on CUDA); "
                        "under torchrun, ranks > 0 become workers (docs/SCALING.md)")
    lo = p.add_argument_group("LoRA adapters (docs/LORA.md)")
    lo.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module,
                    metavar="NAME=PATH", help="PEFT adapter folders served as model NAME")
    lo.add_argument("--max-loras", type=int, default=None,
                    help="LoRA slots: most distinct adapters in one step (default 4 with "
                         "--lora-modules, else 0: LoRA off; > 0 enables runtime loading)")
    lo.add_argument("--max-lora-rank", type=int, default=16,
                    help="largest adapter rank accepted (slot size)")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib, num_kv_blocks=args.num_kv_blocks,
        kv_cache_commit_tokens=args.kv_cache_commit_tokens,
        kv_cache_prefault_tokens=args.kv_cache_prefault_tokens,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        aging_rate=args.aging_rate, num_threads=args.num_threads, seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype, kv_cache_fraction=args.kv_cache_fraction,
        quantization=args.quantization, quantization_group_size=args.quantization_group_size,
        int4_activations=args.int4_activations,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        json_whitespace=args.json_whitespace, pooling=args.pooling,
        compile_in_background=getattr(args, "startup_compile", None) == "background",
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
        ngram_max=args.ngram_max, suffix_min_confidence=args.suffix_min_confidence,
        suffix_max_depth=args.suffix_max_depth,
        suffix_cache_max_nodes=args.suffix_cache_max_nodes, draft_model=args.draft_model,
        draft_quantization=args.draft_quantization,
        speculative_max_batch=args.speculative_max_batch,
        speculative_adaptive=args.speculative_adaptive,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras if args.max_loras is not None else (
            4 if args.lora_modules else 0),
        max_lora_rank=args.max_lora_rank,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.llm_engine import LLMEngine
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    engine.add_request("cli-0", prompt, params)
    out = sys.stdout
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for c in delta.outputs:
                out.write(c.text)
                out.flush()
    out.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.async_llm import AsyncLLM
    from llmserve.contract.names import check_name
    from llmserve.server.launch import serve

    for flag in ("served_model_name", "fallback_name"):   # names reach headers and labels
        if getattr(args, flag, None) is not None:
            check_name(getattr(args, flag), "--" + flag.replace("_", "-"))

    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        from llmserve.model.distributed.workers import run_worker_from_env

        run_worker_from_env(engine_config_from_args(args))   # a torchrun rank > 0: no HTTP
        return 0
    if args.data_parallel_size > 1:
        from llmserve.router.cli import cmd_serve_replicas

        if args.kv_events_config:
            raise ValueError("--kv-events-config is not supported with --data-parallel-size > 1 "
                             "(run one pod per replica: docs/SCALING.md)")
        if args.lora_modules or args.max_loras:
            raise ValueError("LoRA adapters are not supported with --data-parallel-size > 1")

        return cmd_serve_replicas(args, add_engine_args, server_limits_from_args)
    if args.startup_compile is None:
        args.startup_compile = "background"
    config = engine_config_from_args(args)
    from llmserve.integrations.kv_events.publisher import build_publisher

    kv_events = build_publisher(args.kv_events_config)   # None unless events are enabled
    try:
        engine = AsyncLLM.from_config(config, kv_events=kv_events)
    except BaseException:
        if kv_events is not None:
            kv_events.shutdown()
        raise
    names = [args.served_model_name] if args.served_model_name else None
    engines = {}
    try:
        if args.fallback_model:
            fallback = AsyncLLM.from_config(config.replace(
                model=None if args.fallback_model == "default" else args.fallback_model,
                lora_modules=(), max_loras=0))   # adapters belong to the main model
            fallback_name = args.fallback_name or fallback.model_name
            if fallback_name in (names or [engine.model_name]):
                fallback.shutdown()
                raise ValueError(f"the fallback model is served as {fallback_name!r}, the main "
                                 "model's name; pass --fallback-name")
            engines[fallback_name] = fallback
        gateway = None
        if args.config:
            from llmserve.gateway.hook import build_gateway

            gateway = build_gateway(args.config, engine, fallback_engines=engines,
                                    served_model_names=names)
        serve(engine, args.host, args.port, log_level=str(args.log_level).lower(),
              served_model_names=names, gateway=gateway, engines=engines,
              limits=server_limits_from_args(args, gateway),
              responses_store=responses_store_from_args(args),
              timeout_graceful_shutdown=args.drain_timeout,
              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    finally:
        for other in engines.values():
            other.shutdown()
        engine.shutdown()
        if kv_events is not None:
            kv_events.shutdown()
    return 0


def add_server_limit_args(p: argparse.ArgumentParser) -> None:
    """HTTP limit flags; each overrides the gateway config's ``server`` section (and the
    defaults of ``llmserve.contract.server_limits.ServerLimits``)."""
    g = p.add_argument_group("HTTP limits (default: the config's `server` section, else safe defaults)")
    g.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (413)")
    g.add_argument("--body-read-timeout", dest="body_read_timeout_s", type=float, default=None,
                   help="seconds for the whole body to arrive (408)")
    g.add_argument("--header-read-timeout", dest="header_read_timeout_s", type=float,
                   default=None, help="seconds for the request line and headers to arrive (408)")
    g.add_argument("--keep-alive-timeout", dest="keep_alive_timeout_s", type=float, default=None,
                   help="idle seconds before a kept-alive connection is closed")
    g.add_argument("--max-connections", type=int, default=None,
                   help="open connections / requests at once (uvicorn limit_concurrency; 503)")
    g.add_argument("--tokenizer-threads", type=int, default=None,
                   help="threads that parse and tokenize, shared fairly among tenants")
    r = p.add_argument_group("Responses API (/v1/responses with store: true)")
    r.add_argument("--responses-store", default=":memory:", metavar="PATH",
                   help="SQLite file of stored responses (default: in memory, kept while "
                        "the server runs)")
    r.add_argument("--responses-ttl", type=float, default=30 * 24 * 3600.0, metavar="SECONDS",
                   help="how long a stored response is kept (default 30 days)")


def server_limits_from_args(args: argparse.Namespace, gateway: object = None) -> "ServerLimits":
    """The server's limits: the gateway config's ``server`` section (if any), then flags."""
    from llmserve.contract.server_limits import ServerLimits

    config = getattr(gateway, "config", None)
    base = getattr(config, "server", None) or ServerLimits()
    return base.replace(**{name: getattr(args, name, None) for name in (
        "max_body_bytes", "body_read_timeout_s", "header_read_timeout_s", "keep_alive_timeout_s",
        "max_connections", "tokenizer_threads")})


def responses_store_from_args(args: argparse.Namespace) -> "ResponseStore":
    """The store of ``/v1/responses`` (``--responses-store``, ``--responses-ttl``)."""
    from llmserve.server.responses_api.store import ResponseStore

    return ResponseStore(args.responses_store, args.responses_ttl)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and stream it to stdout")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--config", default=None, help="gateway config file (tenants, quotas)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--fallback-model", default=None, metavar="PATH_OR_default",
                   help="load a second engine (same engine flags) to serve as a fallback model")
    s.add_argument("--fallback-name", default=None,
                   help="served name of the fallback model (default: its model name)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (processes) behind this server's router (SCALING.md)")
    s.add_argument("--replica-log-dir", default=None, help="log files of the replicas")
    s.add_argument("--drain-timeout", type=int, default=30, metavar="SECONDS",
                   help="on SIGTERM: refuse new requests, give in-flight ones this long to "
                        "finish, abort the rest, exit 0 (keep it below the pod's "
                        "terminationGracePeriodSeconds)")
    s.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV-cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": "
                        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' "
                        "(needs llmserve[kv-events]; docs/SCALING.md)")
    s.add_argument("--reasoning-parser", default="auto", choices=list(REASONING_PARSERS),
                   help="how the model marks its reasoning (a <think> block), sent apart as "
                        "reasoning_content / reasoning items / thinking blocks; auto: from the "
                        "chat template (deepseek_r1 when its generation prompt opens <think>, "
                        "qwen3 when it mentions one, else none) (docs/REASONING.md)")
    s.add_argument("--tool-call-parser", default="auto", choices=list(TOOL_CALL_PARSERS),
                   help="the tool-call format read from (and forced on) the model's output "
                        "and described to templates without tool support; auto: from the "
                        "chat template (<|python_tag|> llama3_json, [TOOL_CALLS] mistral, "
                        "<function= qwen3_coder, else hermes) (docs/STRUCTURED_OUTPUTS.md)")
    add_server_limit_args(s)
    from llmserve.router.cli import add_router_args, add_scale_commands

    add_router_args(s)
    s.set_defaults(func=cmd_serve)
    add_scale_commands(sub, add_engine_args, engine_config_from_args, add_server_limit_args,
                       server_limits_from_args)
    from llmserve.integrations.ray_serve.cli import add_serve_ray_command

    add_serve_ray_command(sub)   # imports Ray only when run

    from llmserve.eval.cli import add_eval_parser
    from llmserve.gateway.cli_commands import add_admin_commands

    add_eval_parser(sub)

    add_admin_commands(sub)
    from llmserve.gateway.releases.cli import add_release_commands

    add_release_commands(sub)
    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    from llmserve.bench.lora_step import add_lora_bench_parser
    from llmserve.bench.offline import add_offline_bench_parser
    from llmserve.bench.quant_step import add_quant_bench_parser
    from llmserve.bench.step_profile import add_step_bench_parser
    from llmserve.model.loading.export_hf import add_export_hf_subparser

    add_export_hf_subparser(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    add_offline_bench_parser(bsub, add_engine_args, engine_config_from_args)
    add_step_bench_parser(bsub, add_engine_args, engine_config_from_args)
    add_quant_bench_parser(bsub, add_engine_args, engine_config_from_args)
    add_lora_bench_parser(bsub, add_engine_args, engine_config_from_args)
    try:
        from llmserve.bench.cli import add_bench_subparsers, add_kv_calc_subparser
    except ImportError:  # pragma: no cover - bench tool not present
        return
    add_bench_subparsers(bsub)
    add_kv_calc_subparser(sub)
    from llmserve.bench.routing import add_routing_bench_parser

    add_routing_bench_parser(bsub)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        parser.exit(2, f"llmserve: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
