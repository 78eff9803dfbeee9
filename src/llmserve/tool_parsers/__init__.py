"""Tool-call formats per model family, shared by the prompt side (tokenizer) and the
output side (server): one :class:`~llmserve.tool_parsers.base.ToolParser` each (no torch).

=============  =====================================================================
``hermes``     ``<tool_call>{"name", "arguments"}</tool_call>`` (Qwen 2.5, Hermes; the
               format llmserve describes to templates without tool support)
``llama3_json`` ``{"name", "parameters"}`` first in the answer or after ``<|python_tag|>``
``mistral``    ``[TOOL_CALLS][{"name", "arguments"}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``
``qwen3_coder`` ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...``
``pythonic``   ``[fn(a=1, b="x"), g()]`` first in the answer
=============  =====================================================================

``auto`` (:func:`detect_parser`) picks one from the model's chat template.
"""
from __future__ import annotations

import logging
from typing import Optional

from llmserve.tool_parsers.base import ToolCall, ToolCallDeltaStream, ToolParser, new_call_id
from llmserve.tool_parsers.hermes import HermesParser
from llmserve.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from llmserve.tool_parsers.mistral import TOOL_CALLS, MistralParser
from llmserve.tool_parsers.pythonic import PythonicParser
from llmserve.tool_parsers.qwen3_coder import FUNCTION, Qwen3CoderParser

__all__ = ["PARSERS", "TOOL_CALL_PARSERS", "ToolCall", "ToolCallDeltaStream", "ToolParser",
           "detect_parser", "get_parser", "new_call_id", "resolve_parser"]

logger = logging.getLogger(__name__)

PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    HermesParser(), Llama3JsonParser(), MistralParser(), Qwen3CoderParser(), PythonicParser())}
#: The choices of ``--tool-call-parser``.
TOOL_CALL_PARSERS = ("auto", *PARSERS)


def get_parser(name: str) -> ToolParser:
    """The parser called ``name`` (ValueError for an unknown one)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}; "
                         f"got {name!r}") from None


def detect_parser(template: Optional[str]) -> tuple[ToolParser, str]:
    """(parser, why) for a chat template: the call markers it writes, Hermes otherwise."""
    template = template or ""
    for marker, name in ((FUNCTION, "qwen3_coder"), (TOOL_CALLS, "mistral"),
                         (PYTHON_TAG, "llama3_json"), ("[func_name1(", "pythonic"),
                         ("<tool_call>", "hermes")):
        if marker in template:
            return PARSERS[name], f"the chat template mentions {marker}"
    why = "the chat template has no tool support" if "tools" not in template else \
        "the chat template names no known call format"
    return PARSERS["hermes"], why


def resolve_parser(name: str, template: Optional[str], model: str = "") -> ToolParser:
    """``--tool-call-parser``: the named parser, or (``auto``) the one the template says;
    logs the choice."""
    if name == "auto":
        parser, why = detect_parser(template)
        logger.info("tool-call parser for %s: %s (auto: %s)", model or "the model",
                    parser.name, why)
        return parser
    parser = get_parser(name)
    logger.info("tool-call parser for %s: %s (--tool-call-parser)", model or "the model",
                parser.name)
    return parser
