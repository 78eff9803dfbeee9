"""JSON forms of what crosses the router <-> engine-process link (no torch, no HTTP).

The router front keeps the OpenAI protocol, the gateway and billing; an engine process
only runs requests. Between them travel token ids, sampling parameters, streamed
``RequestOutput`` increments, ``EngineStats`` snapshots and, once at connect time, the
tokenizer (so the front tokenizes and renders chat templates exactly as the engine would).

Dataclasses are converted field by field from their declared fields, so fields other
work adds to ``SamplingParams`` or ``EngineStats`` travel without changes here when they
hold JSON values; those that do not (``reasoning_budget``: a dataclass of token ids;
``logit_bias``: int keys, ``structured_output``: a
dataclass) are converted explicitly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Awaitable, Optional, Sequence, cast

from llmserve.protocol import (
    CompletionOutput,
    EngineStats,
    FinishReason,
    RequestFailedError,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    TopLogprob,
)
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output.reasoning_budget import ReasoningBudget
from llmserve.structured_output.spec import StructuredOutputSpec

#: Bumped when a message changes incompatibly; the router refuses an engine of another one.
WIRE_VERSION = 2


def _init_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """The constructor arguments of ``params``."""
    out = {name: getattr(params, name) for name in _init_fields(SamplingParams)}
    if out.get("stop") is not None and not isinstance(out["stop"], str):
        out["stop"] = list(out["stop"])
    if out.get("logit_bias"):
        out["logit_bias"] = [[int(t), float(b)] for t, b in out["logit_bias"].items()]
    spec = out.get("structured_output")
    if spec is not None:   # the constraint, never the engine's compiled grammar
        out["structured_output"] = {"kind": spec.kind, "value": spec.value}
    budget = out.get("reasoning_budget")
    if budget is not None:
        out["reasoning_budget"] = {"max_tokens": budget.max_tokens,
                                   "end_ids": list(budget.end_ids),
                                   "start_ids": list(budget.start_ids)}
    return out


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    """SamplingParams from :func:`params_to_dict`; unknown keys are a ValueError."""
    if not isinstance(data, dict):
        raise ValueError("params must be a JSON object")
    unknown = set(data) - set(_init_fields(SamplingParams))
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)} (engine and router "
                         "run different llmserve versions?)")
    data = dict(data)
    if data.get("logit_bias"):
        data["logit_bias"] = {int(t): float(b) for t, b in data["logit_bias"]}
    spec = data.get("structured_output")
    if spec is not None:
        data["structured_output"] = StructuredOutputSpec(kind=spec["kind"], value=spec["value"])
    budget = data.get("reasoning_budget")
    if budget is not None:
        data["reasoning_budget"] = ReasoningBudget(int(budget["max_tokens"]),
                                                   tuple(budget["end_ids"]),
                                                   tuple(budget.get("start_ids", ())))
    return SamplingParams(**data)


def _logprobs_to_list(items: Optional[Sequence[TokenLogprob]]) -> Optional[list[dict]]:
    if items is None:
        return None
    return [{"token_id": t.token_id, "token": t.token, "logprob": t.logprob,
             "top": [[x.token_id, x.token, x.logprob] for x in t.top_logprobs]} for t in items]


def _logprobs_from_list(items: Optional[list[dict]]) -> Optional[list[TokenLogprob]]:
    if items is None:
        return None
    return [TokenLogprob(t["token_id"], t["token"], t["logprob"],
                         [TopLogprob(a, b, c) for a, b, c in t["top"]]) for t in items]


def _finish_reason(value: Optional[str]) -> Optional[FinishReason]:
    """A finish reason off the wire: the engine's enum (an unknown value is a protocol error)."""
    if value is None:
        return None
    try:
        return FinishReason(value)
    except ValueError:
        raise ValueError(f"unknown finish_reason {value!r} from the engine") from None


def output_to_dict(out: RequestOutput, with_prompt: bool = True) -> dict[str, Any]:
    """One streamed increment (``error`` is sent separately, see :func:`error_to_dict`).

    ``with_prompt=False`` leaves out the prompt and its token ids, which the receiver
    already has (a stream would otherwise carry the whole prompt with every token)."""
    data = {
        "request_id": out.request_id, "finished": out.finished,
        "num_cached_tokens": out.num_cached_tokens,
        "metrics": dataclasses.asdict(out.metrics) if out.metrics is not None else None,
        "prompt_logprobs": (None if out.prompt_logprobs is None else
                            [None, *(_logprobs_to_list(  # only the first prompt token has none
                                cast(list[TokenLogprob], out.prompt_logprobs[1:])) or [])]),
        "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "logprobs": _logprobs_to_list(c.logprobs), "num_tokens": c.num_tokens,
                     "accepted_prediction_tokens": c.accepted_prediction_tokens,
                     "rejected_prediction_tokens": c.rejected_prediction_tokens}
                    for c in out.outputs],
    }
    if with_prompt:
        data["prompt"] = out.prompt
        data["prompt_token_ids"] = list(out.prompt_token_ids)
    return data


def output_from_dict(data: dict[str, Any],
                     prompt_token_ids: Optional[list[int]] = None) -> RequestOutput:
    """The RequestOutput of :func:`output_to_dict`; ``prompt_token_ids`` stand in for the
    ones an increment sent without its prompt."""
    metrics = RequestMetrics(**data["metrics"]) if data.get("metrics") else None
    outputs = [CompletionOutput(index=c["index"], text=c["text"], token_ids=c["token_ids"],
                                finish_reason=_finish_reason(c["finish_reason"]), stop_reason=c["stop_reason"],
                                logprobs=_logprobs_from_list(c["logprobs"]),
                                num_tokens=c["num_tokens"],
                                accepted_prediction_tokens=c.get("accepted_prediction_tokens"),
                                rejected_prediction_tokens=c.get("rejected_prediction_tokens"))
               for c in data["outputs"]]
    prompt_lps = data.get("prompt_logprobs")
    if prompt_lps is not None:
        prompt_lps = [None] + (_logprobs_from_list(prompt_lps[1:]) or [])
    return RequestOutput(request_id=data["request_id"], prompt=data.get("prompt"),
                         prompt_token_ids=data.get("prompt_token_ids", prompt_token_ids or []),
                         outputs=outputs,
                         finished=data["finished"], num_cached_tokens=data["num_cached_tokens"],
                         metrics=metrics, prompt_logprobs=prompt_lps)


def error_to_dict(exc: BaseException) -> dict[str, Any]:
    """An error event: ``kind`` is ``invalid`` (ValueError: the caller's input),
    ``request_failed`` (the model step failed on this request alone) or ``engine``
    (the engine cannot serve: dead, shutting down, or an unexpected failure)."""
    if isinstance(exc, RequestFailedError):
        return {"kind": "request_failed", "message": str(exc), "error_id": exc.error_id,
                "input_error": exc.input_error}
    if isinstance(exc, ValueError):
        return {"kind": "invalid", "message": str(exc)}
    return {"kind": "engine", "message": f"{type(exc).__name__}: {exc}"}


def stats_to_dict(stats: EngineStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def stats_from_dict(data: dict[str, Any]) -> EngineStats:
    known = {f.name for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{k: v for k, v in data.items() if k in known})


def sum_stats(snapshots: list[EngineStats]) -> EngineStats:
    """Counters, gauges and per-tenant dicts summed over replicas (the high-water mark too:
    it is then an upper bound of the fleet's simultaneous use)."""
    total = EngineStats()
    for s in snapshots:
        for f in dataclasses.fields(EngineStats):
            mine, theirs = getattr(total, f.name), getattr(s, f.name)
            if isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            elif f.name in ("kv_bytes_per_token", "weight_bytes", "block_size", "max_loras"):
                setattr(total, f.name, max(mine, theirs))   # per replica, not additive
            elif isinstance(mine, (int, float)):
                setattr(total, f.name, mine + theirs)
    return total


def tokenizer_to_dict(tokenizer: Any) -> dict[str, Any]:
    """Everything needed to rebuild ``llmserve.tokenizer.tokenizer.Tokenizer`` elsewhere."""
    return {"backend": tokenizer.backend.to_str(), "special_tokens": tokenizer.special_tokens,
            "add_bos_token": tokenizer.add_bos_token, "add_eos_token": tokenizer.add_eos_token,
            "chat_template": tokenizer.chat_template,
            "eos_token_ids": sorted(tokenizer.eos_token_ids)}


def tokenizer_from_dict(data: dict[str, Any]) -> Any:
    """The Tokenizer of :func:`tokenizer_to_dict` (same fingerprint as the original)."""
    from tokenizers import Tokenizer as BackendTokenizer

    from llmserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer(BackendTokenizer.from_str(data["backend"]), **data["special_tokens"],
                     add_bos_token=data["add_bos_token"], add_eos_token=data["add_eos_token"],
                     chat_template=data["chat_template"],
                     extra_eos_token_ids=data["eos_token_ids"])


def encode_line(event: dict[str, Any]) -> bytes:
    """One newline-delimited JSON event of a generate stream."""
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def error_from_event(err: dict[str, Any], lost: BaseException) -> BaseException:
    """The exception an engine's ``error`` event stands for: a ValueError (invalid
    request), a RequestFailedError (this request failed, the engine lives on), else
    ``lost`` (the replica is gone or broken: the caller may retry elsewhere)."""
    kind, message = err.get("kind"), str(err.get("message", "engine error"))
    if kind == "invalid":
        return ValueError(message)
    if kind == "request_failed":
        return RequestFailedError(message, error_id=str(err.get("error_id", "")),
                                  input_error=bool(err.get("input_error")))
    return lost


class CutShortOutputs:
    """Final outputs of streams whose caller went away, kept (a bounded number, oldest
    dropped first) for the caller's ``abort``, which bills from them."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._outputs: dict[str, Optional[RequestOutput]] = {}

    async def abort_and_keep(self, request_id: str,
                             abort: Awaitable[Optional[RequestOutput]],
                             timeout_s: Optional[float] = None) -> None:
        """Await a replica's ``abort`` of a stream cut short and keep its final output
        (None when the abort timed out or was cancelled)."""
        try:
            final = await asyncio.wait_for(abort, timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            final = None
        self.keep(request_id, final)

    def keep(self, request_id: str, final: Optional[RequestOutput]) -> None:
        self._outputs[request_id] = final
        while len(self._outputs) > self.limit:
            self._outputs.pop(next(iter(self._outputs)))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._outputs

    def pop(self, request_id: str) -> Optional[RequestOutput]:
        return self._outputs.pop(request_id)
