"""Chat prompts as token ids: the one builder of chat prompts, for requests and bundles.

A chat template that renders ``tools`` itself gets them as they are; for one that does not
(the default SmolLM2 template), the tools and the Hermes call format are described in the
system message, assistant ``tool_calls`` become ``<tool_call>`` blocks and tool results
``<tool_response>`` blocks (:func:`prepare_messages`). Message text is never parsed for
special tokens (:mod:`llmserve.tokenizer.chat`). No torch.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Protocol, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ChatTokenizer(Protocol):
    """What a chat prompt needs of a tokenizer (:class:`~llmserve.tokenizer.tokenizer.Tokenizer`
    has it all; ``encode_chat`` and ``chat_template`` are optional)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


def tools_preamble(tools: list[dict]) -> str:
    """How the tools and the call format are described to a model whose template cannot."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures are listed in <tools></tools>:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, answer with one block per call:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{CLOSE}')


def prepare_messages(messages: list[dict], tools: list[dict], template: Optional[str]
                     ) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) for the chat template. A template that mentions ``tools`` gets them
    as they are; otherwise the preamble joins the system message, assistant ``tool_calls``
    become ``<tool_call>`` blocks and tool results ``<tool_response>`` blocks."""
    template = template or ""
    native = "tools" in template
    native_calls = "tool_calls" in template
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") and not native_calls:
            blocks = [f"{OPEN}\n" + json.dumps(
                {"name": c["function"]["name"],
                 "arguments": loads_or_text(c["function"].get("arguments", "{}"))},
                ensure_ascii=False) + f"\n{CLOSE}" for c in m.pop("tool_calls")]
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *blocks]))
        if m.get("role") == "tool" and not native_calls:
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if not tools or native:
        return out, (tools or None)
    preamble = tools_preamble(tools)
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{preamble}".strip()}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out, None


def loads_or_text(text: Any) -> Any:
    """``text`` parsed as JSON, or as it is when it is not JSON (or not a string)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def chat_prompt_tokens(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """The chat template's token ids for ``messages``: tools go into the template, or into
    the system message when the template has no tools; message text is never parsed for
    special tokens (``encode_chat``). The one builder of chat prompts (requests, bundles)."""
    messages, tools = prepare_messages(messages, tools or [],
                                       getattr(tokenizer, "chat_template", None))
    extra = {"tools": tools} if tools else {}
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if encode_chat is not None:
        return list(encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         **extra)
    return list(tokenizer.encode(text, add_special_tokens=False))
