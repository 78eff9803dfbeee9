"""What a request asks of its response beyond the generated text (no torch).

:class:`ResponseOptions` is built once per request (``from_request``) and tells the body
and stream builders (streaming.py) to

* chat: read tool calls out of the text (``tools`` with ``tool_choice`` not ``none``) in
  the served model's format (``tool_parser``): ``message.tool_calls`` with ids, ``content`` without the blocks (null when empty),
  ``finish_reason: "tool_calls"``;
* completions: put the prompt before the text and its token logprobs before the output's
  (``echo``; the first prompt token has a null logprob, as OpenAI sends it), drop the one
  generated token of a ``max_tokens: 0`` scoring request, and keep the ``n`` of
  ``best_of`` candidates with the highest cumulative logprob of their sampled tokens;
* ``suffix``: fill-in-the-middle prompts for tokenizers that have FIM tokens
  (:func:`fim_prompt`), a 400 otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from llmserve.contract.engine_client import TokenizerLike
from llmserve.contract.errors import bad_request
from llmserve.protocol import TokenLogprob
from llmserve.server.protocol.responses import chat_logprobs, completion_logprobs, openai_finish_reason
from llmserve.server.protocol.tool_calls import HERMES
from llmserve.server.reasoning.parsers import ReasoningParser
from llmserve.tool_parsers import ToolParser

#: StarCoder-style fill-in-the-middle tokens (prefix, suffix, middle).
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def has_fim_tokens(tokenizer: TokenizerLike) -> bool:
    """Whether the tokenizer has the fill-in-the-middle tokens a ``suffix`` needs."""
    lookup = getattr(tokenizer, "token_to_id", None)
    return lookup is not None and all(lookup(t) is not None for t in FIM_TOKENS)


def fim_prompt(tokenizer: TokenizerLike, prompt: str, suffix: str) -> list[int]:
    """``<fim_prefix>prompt<fim_suffix>suffix<fim_middle>`` as token ids; 400 when the
    tokenizer has no FIM tokens."""
    lookup = getattr(tokenizer, "token_to_id", None)
    ids = [lookup(t) if lookup is not None else None for t in FIM_TOKENS]
    if any(i is None for i in ids):
        raise bad_request("suffix needs a model whose tokenizer has fill-in-the-middle tokens "
                          f"({', '.join(FIM_TOKENS)}); this model's has none", param="suffix")
    from llmserve.tokenizer.chat import encode_plain

    pre, suf, mid = ids
    if pre is None or suf is None or mid is None:   # checked above; narrows the types
        raise bad_request("fill-in-the-middle tokens are missing", param="suffix")
    return [pre, *encode_plain(tokenizer, prompt), suf, *encode_plain(tokenizer, suffix), mid]


@dataclass
class ResponseOptions:
    """See the module docstring."""

    want_logprobs: bool = False
    tools: list[dict] = field(default_factory=list)     # chat: parse tool calls when set
    tool_parser: ToolParser = HERMES                    # chat: the tool-call format
    reasoning: Optional[ReasoningParser] = None         # chat: splits off the think block
    include_reasoning: bool = True                      # chat: send it as reasoning_content
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)
    drop_output: bool = False                           # max_tokens 0: prompt only
    keep_best: Optional[int] = None                     # best_of > n: keep this many
    tokenizer: Optional[TokenizerLike] = None                               # echo: spells the first prompt token

    @classmethod
    def from_request(cls, req: Any, chat: bool, prompt_texts: Sequence[str] = (),
                     tokenizer: Optional[TokenizerLike] = None) -> "ResponseOptions":
        if chat:
            return cls(want_logprobs=bool(req.logprobs),
                       tools=req.checked_tools if req.parses_tool_calls else [],
                       tool_parser=req.tool_parser, reasoning=req.reasoning_parser,
                       include_reasoning=req.include_reasoning)
        n = req.n or 1
        return cls(want_logprobs=req.logprobs is not None, echo=bool(req.echo),
                   prompt_texts=list(prompt_texts), drop_output=req.max_tokens == 0,
                   keep_best=n if req.num_candidates > n else None, tokenizer=tokenizer)

    def echo_logprobs(self, run: Any, prompt_idx: int) -> list[Any]:
        """The prompt's token logprobs as sent with echo (first token: null logprob)."""
        prompt_lps = run.prompt_logprobs[prompt_idx] if run.prompt_logprobs else None
        if not (self.echo and self.want_logprobs and prompt_lps):
            return []
        first = _first_token(self.tokenizer, run.prompts[prompt_idx]) if self.tokenizer else None
        return [first, *prompt_lps[1:]]


def chat_message(text: str, opts: ResponseOptions) -> tuple[dict[str, Any], bool]:
    """(assistant message, whether it called tools). A reasoning model's think block
    goes to ``reasoning_content`` (left out with ``include_reasoning`` false); tool calls
    are read from the answer after it."""
    reasoning = None
    if opts.reasoning is not None:
        reasoning, text = opts.reasoning.split(text)
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning is not None and opts.include_reasoning:
        message["reasoning_content"] = reasoning
    if opts.tools:
        content, calls = opts.tool_parser.parse(text, opts.tools)
        if calls:
            message["content"] = content
            message["tool_calls"] = [c.to_openai() for c in calls]
            return message, True
    return message, False


def chat_choices(run: Any, opts: ResponseOptions) -> list[dict[str, Any]]:
    """The choices of a non-streamed chat completion."""
    out = []
    for c in run.choices:
        message, called = chat_message(c.text, opts)
        reason = openai_finish_reason(c.finish_reason)
        out.append({"index": c.index, "message": message,
                    "logprobs": chat_logprobs(c.logprobs or []) if opts.want_logprobs else None,
                    "finish_reason": "tool_calls" if called and reason == "stop" else reason,
                    "stop_reason": c.stop_reason})
    return out


def _first_token(tokenizer: TokenizerLike, prompt_ids: Sequence[int]) -> Optional[TokenLogprob]:
    if not prompt_ids:
        return None
    return TokenLogprob(prompt_ids[0], tokenizer.decode([prompt_ids[0]],
                                                        skip_special_tokens=False), None)  # type: ignore[arg-type]  # the first token has no logprob


def _cumulative(c: Any) -> float:
    return sum(e.logprob for e in (c.logprobs or []))


def completion_choices(run: Any, opts: ResponseOptions) -> list[dict[str, Any]]:
    """The choices of a non-streamed text completion (echo, max_tokens 0, best_of)."""
    choices = list(run.choices)
    if opts.keep_best is not None:
        kept = []
        for p in range(len(run.prompts)):
            group = choices[p * run.n:(p + 1) * run.n]
            kept.extend(sorted(group, key=_cumulative, reverse=True)[:opts.keep_best])
        choices = kept
    per_prompt = len(choices) // max(1, len(run.prompts))
    out = []
    for index, c in enumerate(choices):
        p = index // per_prompt
        text = "" if opts.drop_output else c.text
        entries: list[Any] = [] if opts.drop_output else list(c.logprobs or [])
        if opts.echo:
            text = opts.prompt_texts[p] + text
            entries = opts.echo_logprobs(run, p) + entries
        reason = "length" if opts.drop_output else openai_finish_reason(c.finish_reason)
        out.append({"index": index, "text": text,
                    "logprobs": completion_logprobs(entries, 0) if opts.want_logprobs else None,
                    "finish_reason": reason, "stop_reason": None if opts.drop_output
                    else c.stop_reason})
    return out
