"""What each served model writes: its tool-call format and how it marks its reasoning.

Both are chosen once per chat template (``--tool-call-parser`` and ``--reasoning-parser``,
or, with ``auto``, read from the template) and logged at start-up; every endpoint that
builds a chat prompt or reads an answer asks here (chat, Responses, Messages, /tokenize).
No torch.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.errors import INCOMPATIBLE_PARAMETERS, bad_request
from llmserve.sampling_params import SamplingParams
from llmserve.server.reasoning.parsers import REASONING_PARSERS, ReasoningParser, reasoning_parser, thinking_budget
from llmserve.tool_parsers import ToolParser, get_parser, resolve_parser

logger = logging.getLogger(__name__)


def _template(engine: EngineClient) -> Optional[str]:
    template = getattr(engine.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


class ModelFormats:
    """The tool-call and reasoning parsers of the served models (see the module docstring)."""

    def __init__(self, tool_call_parser: str = "auto", reasoning: str = "auto") -> None:
        """Raises ValueError for a parser name that does not exist."""
        if tool_call_parser != "auto":
            get_parser(tool_call_parser)
        if reasoning not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {reasoning!r}")
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser_name = reasoning
        self._tool_parsers: dict[Optional[str], ToolParser] = {}          # template -> parser
        self._reasoning: dict[Optional[str], Optional[ReasoningParser]] = {}

    def tool_parser(self, engine: EngineClient, name: str = "") -> ToolParser:
        """The tool-call format of ``engine``'s model: ``--tool-call-parser``, or (auto)
        the one its chat template names."""
        template = _template(engine)
        parser = self._tool_parsers.get(template)
        if parser is None:
            parser = resolve_parser(self.tool_call_parser, template,
                                    name or getattr(engine, "model_name", ""))
            self._tool_parsers[template] = parser
        return parser

    def reasoning_parser(self, engine: EngineClient, name: str = "") -> Optional[ReasoningParser]:
        """How ``engine``'s model marks its reasoning: ``--reasoning-parser``, or (auto)
        from its chat template; None when it does not reason."""
        template = _template(engine)
        if template not in self._reasoning:
            parser = reasoning_parser(self.reasoning_parser_name, template)
            self._reasoning[template] = parser
            logger.info("model %s: reasoning parser %s", name or getattr(engine, "model_name", ""),
                        parser.name if parser is not None else "none")
        return self._reasoning[template]

    def with_thinking_budget(self, budget: Optional[int], params: SamplingParams,
                             engine: EngineClient) -> SamplingParams:
        """``params`` with a request's ``thinking_budget`` (400 when the model does not
        reason, or a grammar shapes the output)."""
        if budget is None:
            return params
        parser = self.reasoning_parser(engine)
        if parser is None:
            raise bad_request("thinking_budget needs a reasoning model; this model has no "
                              "reasoning parser (see --reasoning-parser)",
                              param="thinking_budget")
        if params.structured_output is not None:
            raise bad_request("thinking_budget cannot be combined with response_format, "
                              "structured_outputs or a required/named tool_choice",
                              param="thinking_budget", code=INCOMPATIBLE_PARAMETERS)
        return dataclasses.replace(params, reasoning_budget=thinking_budget(
            parser, engine.tokenizer, int(budget)))
