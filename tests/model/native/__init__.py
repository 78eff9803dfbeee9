"""Tests of llmserve's native CPU kernels (model/native/csrc)."""
import pytest

from llmserve.model.native import ops as native

#: Skips a test where the native library cannot run (no AVX512-BF16 or no C++ compiler).
needs_native = pytest.mark.skipif(not native.native_available(),
                                  reason="native kernels need AVX512-BF16 and a C++ compiler")
