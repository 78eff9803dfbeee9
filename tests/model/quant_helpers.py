"""GGUF block data for tests: real quantizations where the ``gguf`` package can write the type,
random but valid blocks (finite scales) for the K-quants it can only read."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmserve.model.loading.gguf import RawGGUFTensor

Q = GGMLQuantizationType
#: Byte offsets of the float16 super-scales in each K-quant block.
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                    Q.Q6_K: (208,)}


def gguf_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0,
                super_scale: float = 0.001) -> RawGGUFTensor:
    """A ``rows x cols`` tensor of ``qtype`` as the loader's raw form; a K-quant's
    super-scales are drawn from ``[super_scale, 5 * super_scale)``."""
    import gguf

    rng = np.random.default_rng(seed)
    if qtype in _K_SCALE_OFFSETS:
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for off in _K_SCALE_OFFSETS[qtype]:
            d = ((rng.random((rows, cols // block)) * 4 + 1) * super_scale).astype(np.float16)
            data[..., off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
        data = data.reshape(rows, -1)
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        data = gguf.quants.quantize(w, qtype)
    return RawGGUFTensor(f"test.{qtype.name}", qtype, (rows, cols), np.ascontiguousarray(data))
