"""The body of ``POST /v1/embeddings`` and the response it gets (OpenAI's shapes; no torch).

Request::

    {"model"?, "input": "text" | ["text", ...] | [ids] | [[ids], ...],
     "encoding_format"?: "float" | "base64", "dimensions"?: n, "user"?,
     "truncate_prompt_tokens"?: k, "normalize"?: true}          (the last two: vLLM's)

Response::

    {"object": "list", "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n},
     "data": [{"object": "embedding", "index": i, "embedding": [floats] | "base64"}]}

``base64`` is the vector's little-endian float32 bytes, base64-encoded, as OpenAI sends
it (the official client asks for it by default and decodes it itself).
"""
from __future__ import annotations

import base64
import struct
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict

from llmserve.contract.errors import bad_request
from llmserve.server.limits import RequestLimits
from llmserve.server.protocol.openai import JsonInt, JsonInts

#: Most inputs one request may embed (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048

#: What ``input`` accepts, for error messages.
INPUT_HINT = "a string, an array of strings, an array of token ids or an array of arrays of " \
             "token ids"


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Optional[str] = None
    input: Union[str, list[str], JsonInts, list[JsonInts]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[JsonInt] = None
    user: Optional[str] = None
    #: vLLM's extension: keep only the last k tokens of each input (-1: the context length)
    truncate_prompt_tokens: Optional[JsonInt] = None
    #: vLLM's extension: False returns the pooled vector as it is (no L2 normalization)
    normalize: Optional[bool] = None

    def inputs(self) -> list[Union[str, list[int]]]:
        """``input`` as a list of inputs (one text or one token-id list each)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(x, int) for x in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]

    def check(self, limits: RequestLimits) -> list[Union[str, list[int]]]:
        """Request-level checks beyond types (400s naming the field); returns the inputs."""
        inputs = self.inputs()
        if not inputs:
            raise bad_request("input must not be empty", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise bad_request(f"input has {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} "
                              "are allowed", param="input", code="too_many_items")
        size = ids = 0
        for i, item in enumerate(inputs):
            where = "input" if len(inputs) == 1 else f"input[{i}]"
            if not item:
                raise bad_request(f"{where} is empty; every input needs at least one token",
                                  param="input")
            if isinstance(item, str):
                size += len(item.encode("utf-8", "surrogatepass"))
            else:
                ids += len(item)
        if size > limits.max_prompt_bytes:
            raise bad_request(f"the text of the input exceeds {limits.max_prompt_bytes} bytes "
                              "(UTF-8); shorten it", param="input", code="prompt_too_large")
        if ids > limits.max_prompt_token_ids:
            raise bad_request(f"the input holds {ids} token ids; at most "
                              f"{limits.max_prompt_token_ids} are allowed", param="input",
                              code="prompt_too_large")
        if self.dimensions is not None and self.dimensions < 1:
            raise bad_request(f"dimensions must be at least 1, got {self.dimensions}",
                              param="dimensions")
        t = self.truncate_prompt_tokens
        if t is not None and t < 1 and t != -1:
            raise bad_request("truncate_prompt_tokens must be at least 1 (or -1: the context "
                              f"length), got {t}", param="truncate_prompt_tokens")
        if self.user is not None and len(self.user) > limits.max_name_chars:
            raise bad_request(f"user must be at most {limits.max_name_chars} characters",
                              param="user", code="string_too_long")
        return inputs


def encode_vector(vector: Sequence[float], encoding_format: str) -> Union[list[float], str]:
    """A vector as the response carries it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def embeddings_body(vectors: Sequence[Sequence[float]], encoding_format: str, model: str,
                    prompt_tokens: int) -> dict[str, Any]:
    """The response body of one request (vectors in input order)."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i,
                  "embedding": encode_vector(v, encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
