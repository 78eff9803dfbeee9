"""Sampling defaults a gateway sets for a request (e.g. a release's): applied to the
parsed request for the fields the client left out, before SamplingParams are built.

``max_tokens`` counts as given when the client set ``max_tokens`` or
``max_completion_tokens``. A value the client sent is never changed. No torch.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

#: The request fields a default may fill.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "seed", "max_tokens")


def apply_sampling_defaults(req: Any, defaults: Optional[Mapping[str, Any]]) -> list[str]:
    """Fill ``req``'s omitted fields from ``defaults``; returns the names filled.

    Raises ValueError for a default this module does not know (a gateway bug).
    """
    filled: list[str] = []
    for name, value in (defaults or {}).items():
        if name not in DEFAULTABLE:
            raise ValueError(f"unknown sampling default {name!r} (known: {DEFAULTABLE})")
        if name == "max_tokens":
            if req.requested_max_tokens[0] is not None:
                continue
        elif getattr(req, name, None) is not None:
            continue
        setattr(req, name, value)
        filled.append(name)
    return filled
