"""Per-request pooling parameters of an embedding request (no torch).

An embedding request is a prefill-only engine request: the model runs over its prompt,
never samples, and the final hidden states of its prompt positions (after the model's
final norm, before the LM head) are pooled into one vector:

* ``last`` -- the last prompt position (the usual choice for decoder-only models: under
  causal attention it is the only position that has seen the whole input);
* ``mean`` -- the average over every prompt position;
* ``cls``  -- the first prompt position.

The vector is then cut to its first ``dimensions`` entries (when set) and, with
``normalize``, scaled to unit L2 norm -- in that order, so a shortened vector is still
unit length (OpenAI's ``dimensions``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: Pooling methods, in the order the CLI lists them (the first is the default).
POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """How one embedding request turns its prompt's hidden states into a vector.

    ``method`` None means the engine's default (``--pooling``); the engine resolves it
    before the request is scheduled. ``dimensions`` must not exceed the model's hidden
    size (the engine checks; it knows the size).
    """

    method: Optional[str] = None
    normalize: bool = True
    dimensions: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}; "
                             f"got {self.method!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be a boolean")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hits): mean
        reads them all, cls the first; last only needs the final one, always computed."""
        return self.method != "last"
