"""Client-side serving metrics: pure arithmetic over per-request timelines (no I/O, no torch).

Definitions (all measured at the client; times in seconds inside, milliseconds in reports):

* **send time**: when the request's POST was issued (after the concurrency limit let it go).
* **arrival**: a streamed SSE event whose choice carries non-empty text (``choices[].text``
  or ``choices[].delta.content``). A role-only or usage-only event is not an arrival.
* **TTFT**: first arrival - send time.
* **E2E latency**: end of the stream (``[DONE]`` or end of body) - send time.
* **ITL**: every gap between consecutive arrivals. An event that carries k > 1 tokens still
  yields exactly one gap (the time since the previous arrival); it is not divided by k.
  So ITL describes what a user sees (chunk cadence); per-token cost is TPOT's job.
* **output tokens**: ``usage.completion_tokens`` from the final usage event when the server
  sends one, otherwise the number of arrivals (one token per arrival assumed).
* **TPOT** (per request): (E2E - TTFT) / (output tokens - 1), for requests with >= 2 tokens.
  Multi-token events are accounted for here, because the token count comes from usage.
* **Failed requests** (HTTP status >= 400, a broken or truncated stream, an error event, a
  timeout) are excluded from every latency and token statistic and counted under
  ``errors`` by key: the HTTP status code as a string, or ``"connection"``, ``"timeout"``,
  ``"incomplete_stream"`` (no ``[DONE]`` and no finish_reason), ``"stream_error"`` (an
  error object or unparsable data inside the stream), ``"client_error"`` (a client bug).
* **Percentiles** use linear interpolation between closest ranks (numpy's default
  ``"linear"`` method): for sorted values x[0..n-1] the q-th percentile sits at rank
  h = (n - 1) * q / 100 and equals x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h]).
* **Throughput**: completed requests, input tokens, output tokens and their sum, each divided
  by the run's duration (first send to last completion of the whole run).
* **Mean in flight**: the sum of every request's send-to-end time over the duration
  (Little's law), failed requests included.
* **Goodput**: successful requests meeting every given SLO (``ttft_ms``, ``tpot_ms``,
  ``e2e_ms``; TPOT is not checked for one-token answers) per second of run duration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

#: The percentiles every summary reports.
PERCENTILES = (50, 90, 95, 99)
#: SLO names accepted by --slo and the record field each one bounds.
SLO_FIELDS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2e_ms": "e2e"}
#: Default input-length bucket edges, in tokens (the last bucket is open-ended).
DEFAULT_BUCKET_EDGES = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class RequestRecord:
    """What the client observed for one request. Times are seconds relative to ``send_time``.

    ``arrival_times`` are the offsets of content-bearing events; ``usage_completion_tokens``
    and ``usage_prompt_tokens`` are None when the server sent no usage.
    """

    request_id: str
    input_len: int                      # prompt length by the client's tokenizer
    send_time: float = 0.0              # absolute (time.perf_counter based) send time
    arrival_times: list[float] = field(default_factory=list)
    end_time: Optional[float] = None    # offset of the end of the stream
    success: bool = False
    error: Optional[str] = None         # error key when success is False
    error_detail: str = ""
    usage_completion_tokens: Optional[int] = None
    usage_prompt_tokens: Optional[int] = None
    expected_output_len: Optional[int] = None
    conversation_id: Optional[int] = None
    turn: Optional[int] = None
    usage_cached_tokens: Optional[int] = None   # usage.prompt_tokens_details.cached_tokens
    reply_text: list[str] = field(default_factory=list)  # the streamed answer
    finish_reason: Optional[str] = None  # the last finish_reason streamed (first choice)

    @property
    def output_tokens(self) -> int:
        """Tokens generated: server usage when known, else one per arrival."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.arrival_times)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens: server usage when known, else the client's count."""
        if self.usage_prompt_tokens is not None:
            return self.usage_prompt_tokens
        return self.input_len

    @property
    def ttft(self) -> Optional[float]:
        """Time to first arrival; the whole E2E when nothing content-bearing arrived."""
        if not self.success:
            return None
        if self.arrival_times:
            return self.arrival_times[0]
        return self.end_time

    @property
    def e2e(self) -> Optional[float]:
        return self.end_time if self.success else None

    @property
    def itls(self) -> list[float]:
        """One gap per arrival after the first (see the module docstring)."""
        if not self.success:
            return []
        t = self.arrival_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.output_tokens < 2:
            return None
        e2e, ttft = self.e2e, self.ttft
        if e2e is None or ttft is None:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        """JSON-ready form (seconds, rounded to microseconds)."""

        def r(x: Optional[float]) -> Optional[float]:
            return None if x is None else round(x, 6)

        return {
            "id": self.request_id, "success": self.success, "error": self.error,
            "error_detail": self.error_detail[:300], "input_len": self.input_len,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "expected_output_len": self.expected_output_len,
            "usage_reported": self.usage_completion_tokens is not None,
            "conversation_id": self.conversation_id, "turn": self.turn,
            "cached_tokens": self.usage_cached_tokens, "finish_reason": self.finish_reason,
            "send_time": r(self.send_time), "ttft": r(self.ttft), "tpot": r(self.tpot),
            "e2e": r(self.e2e), "itl": [round(x, 6) for x in self.itls],
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(values: Iterable[float], scale: float = 1.0) -> dict:
    """count, mean, p50/p90/p95/p99, min, max of ``values`` times ``scale`` (None when empty)."""
    xs = [v * scale for v in values]
    out: dict = {"count": len(xs)}
    if not xs:
        out.update({"mean": None, **{f"p{q}": None for q in PERCENTILES}, "min": None, "max": None})
        return out
    out["mean"] = sum(xs) / len(xs)
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["min"] = min(xs)
    out["max"] = max(xs)
    return out


def parse_slo(text: Optional[str]) -> dict[str, float]:
    """Parse ``"ttft_ms=500,tpot_ms=50"`` into ``{"ttft_ms": 500.0, "tpot_ms": 50.0}``."""
    slo: dict[str, float] = {}
    if not text:
        return slo
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SLO_FIELDS:
            raise ValueError(f"bad SLO {part!r}; use NAME=MS with NAME in {sorted(SLO_FIELDS)}")
        try:
            ms = float(value)
        except ValueError as exc:
            raise ValueError(f"SLO {name} needs a number of milliseconds, got {value!r}") from exc
        if ms <= 0 or math.isnan(ms):
            raise ValueError(f"SLO {name} must be > 0 ms, got {value!r}")
        slo[name] = ms
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """True when the request succeeded and every SLO bound holds (TPOT skipped if undefined)."""
    if not record.success:
        return False
    for name, limit_ms in slo.items():
        value = getattr(record, SLO_FIELDS[name])
        if value is None:
            if name == "tpot_ms":
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def bucket_label(lo: float, hi: float) -> str:
    return f"[{int(lo)}, {'inf' if math.isinf(hi) else int(hi)})"


def bucket_of(length: int, edges: Sequence[int]) -> tuple[float, float]:
    """The [lo, hi) bucket of ``length`` for ascending ``edges`` (the last one is open)."""
    if not edges or list(edges) != sorted(set(edges)):
        raise ValueError(f"bucket edges must be strictly ascending, got {list(edges)}")
    bounds = list(edges) + [math.inf]
    if length < bounds[0]:
        return (-math.inf, bounds[0])
    for lo, hi in zip(bounds, bounds[1:]):
        if lo <= length < hi:
            return (lo, hi)
    raise ValueError(f"no bucket for length {length}")  # unreachable: the last is open


def _latency_block(records: Sequence[RequestRecord]) -> dict:
    ok = [r for r in records if r.success]
    return {
        "ttft_ms": summarize((r.ttft for r in ok if r.ttft is not None), 1000.0),
        "tpot_ms": summarize((r.tpot for r in ok if r.tpot is not None), 1000.0),
        "itl_ms": summarize((g for r in ok for g in r.itls), 1000.0),
        "e2e_ms": summarize((r.e2e for r in ok if r.e2e is not None), 1000.0),
    }


def errors_by_key(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = r.error or "unknown"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: Optional[dict[str, float]] = None,
    bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
) -> dict:
    """Aggregate one run: latency summaries, throughput, goodput, errors, per-bucket slices."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slo = dict(slo or {})
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in records if meets_slo(r, slo))
    out = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "mean_in_flight": sum(r.end_time or 0.0 for r in records) / duration_s,
        "usage_reported_fraction": (
            sum(1 for r in ok if r.usage_completion_tokens is not None) / len(ok) if ok else 0.0
        ),
        "request_throughput": len(ok) / duration_s,
        "input_token_throughput": input_tokens / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **_latency_block(records),
        "slo": slo,
        "good_requests": good,
        "goodput": good / duration_s,
        "goodput_fraction": good / len(records) if records else 0.0,
        "errors": errors_by_key(records),
        "by_input_len": [],
        "turn_reuse": turn_reuse(records),
    }
    groups: dict[tuple[float, float], list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(bucket_of(r.input_len, bucket_edges), []).append(r)
    for lo, hi in sorted(groups):
        rs = groups[(lo, hi)]
        out["by_input_len"].append({
            "bucket": bucket_label(max(lo, 0), hi), "lo": max(lo, 0),
            "hi": None if math.isinf(hi) else hi,
            "num_requests": len(rs), "completed": sum(1 for r in rs if r.success),
            "total_input_tokens": sum(r.prompt_tokens for r in rs if r.success),
            "total_output_tokens": sum(r.output_tokens for r in rs if r.success),
            "good_requests": sum(1 for r in rs if meets_slo(r, slo)),
            "errors": errors_by_key(rs), **_latency_block(rs),
        })
    return out


def turn_reuse(records: Sequence[RequestRecord]) -> list[dict]:
    """Per turn k >= 1 of multi-turn conversations: the prefix-cache tokens the server
    reported against the previous turn's prompt + answer (``coverage`` = their ratio,
    summed over conversations). Empty without conversations or cached-token usage."""
    by_key = {(r.conversation_id, r.turn): r for r in records
              if r.conversation_id is not None and r.turn is not None and r.success}
    per_turn: dict[int, list[int]] = {}
    for (conv, turn), r in by_key.items():
        prev = by_key.get((conv, turn - 1))
        if turn < 1 or prev is None or r.usage_cached_tokens is None:
            continue
        acc = per_turn.setdefault(turn, [0, 0, 0])
        acc[0] += 1
        acc[1] += r.usage_cached_tokens
        acc[2] += prev.prompt_tokens + prev.output_tokens
    return [{"turn": t, "conversations": n, "cached_tokens": c, "previous_context_tokens": p,
             "coverage": c / p if p else None} for t, (n, c, p) in sorted(per_turn.items())]


def concurrency_throughput_series(
    records: Sequence[RequestRecord], num_windows: int = 20
) -> list[tuple[float, float]]:
    """(mean in-flight requests, output tokens/s) per time window over the run.

    In-flight time of a request runs from its send to its end (failed ones included while
    they were in flight). A successful request's tokens are spread evenly over its arrivals
    (all at the end when it had none); the window that holds an arrival gets its tokens.
    """
    if num_windows < 1:
        raise ValueError("num_windows must be >= 1")
    spans = [(r.send_time, r.send_time + (r.end_time or 0.0)) for r in records if r.end_time]
    if not spans:
        return []
    t0 = min(s for s, _ in spans)
    t1 = max(e for _, e in spans)
    if t1 <= t0:
        return []
    width = (t1 - t0) / num_windows
    busy = [0.0] * num_windows
    tokens = [0.0] * num_windows
    for s, e in spans:
        for w in range(num_windows):
            a, b = t0 + w * width, t0 + (w + 1) * width
            busy[w] += max(0.0, min(b, e) - max(a, s))
    for r in records:
        if not r.success or r.end_time is None:
            continue
        times = r.arrival_times or [r.end_time]
        per = r.output_tokens / len(times)
        for t in times:
            w = min(int((r.send_time + t - t0) / width), num_windows - 1)
            tokens[w] += per
    return [(busy[w] / width, tokens[w] / width) for w in range(num_windows)]
