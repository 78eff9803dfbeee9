"""Chat prompts as token ids: the one builder of chat prompts, for requests and bundles.

A chat template that renders ``tools`` itself gets them as they are; for one that does not
(the default SmolLM2 template), the tools and the call format of the tool-call parser
(:mod:`llmserve.tool_parsers`; Hermes unless told otherwise) are described in the system
message, assistant ``tool_calls`` are written in that format and tool results become
``<tool_response>`` blocks (:func:`prepare_messages`). Message text is never parsed for
special tokens (:mod:`llmserve.tokenizer.chat`). No torch.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from llmserve.tool_parsers import ToolParser, detect_parser
from llmserve.tool_parsers.base import loads_or_text
from llmserve.tool_parsers.hermes import CLOSE, OPEN

__all__ = ["CLOSE", "OPEN", "ChatTokenizer", "chat_prompt_tokens", "loads_or_text",
           "prepare_messages", "tools_preamble"]


class ChatTokenizer(Protocol):
    """What a chat prompt needs of a tokenizer (:class:`~llmserve.tokenizer.tokenizer.Tokenizer`
    has it all; ``encode_chat`` and ``chat_template`` are optional)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


def tools_preamble(tools: list[dict], parser: Optional[ToolParser] = None) -> str:
    """How the tools and the call format are described to a model whose template cannot
    (Hermes blocks unless ``parser`` says otherwise)."""
    return (parser or detect_parser(None)[0]).describe_tools(tools)


def prepare_messages(messages: list[dict], tools: list[dict], template: Optional[str],
                     parser: Optional[ToolParser] = None
                     ) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) for the chat template. A template that mentions ``tools`` gets them
    as they are; otherwise the preamble joins the system message. Where the template does
    not render ``tool_calls``, assistant calls are written in ``parser``'s format (default:
    the one the template names, :func:`~llmserve.tool_parsers.detect_parser`) and tool
    results become ``<tool_response>`` blocks."""
    template = template or ""
    parser = parser or detect_parser(template)[0]
    native = "tools" in template
    native_calls = "tool_calls" in template
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") and not native_calls:
            calls = parser.render_calls(m.pop("tool_calls"))
            m["content"] = "\n".join(filter(None, [m.get("content") or "", calls]))
        if m.get("role") == "tool" and not native_calls:
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if not tools or native:
        return out, (tools or None)
    preamble = parser.describe_tools(tools)
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{preamble}".strip()}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out, None


def chat_prompt_tokens(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       tools: Optional[list[dict[str, Any]]] = None,
                       parser: Optional[ToolParser] = None) -> list[int]:
    """The chat template's token ids for ``messages``: tools go into the template, or into
    the system message (in ``parser``'s format, default the template's) when the template
    has no tools; message text is never parsed for special tokens (``encode_chat``). The
    one builder of chat prompts (requests, bundles)."""
    messages, tools = prepare_messages(messages, tools or [],
                                       getattr(tokenizer, "chat_template", None), parser)
    extra = {"tools": tools} if tools else {}
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if encode_chat is not None:
        return list(encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         **extra)
    return list(tokenizer.encode(text, add_special_tokens=False))
