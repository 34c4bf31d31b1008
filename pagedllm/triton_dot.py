"""The one tensor-core product the Triton kernels share: acc + a @ b, in full float32
precision when the operands are float32 (tl.dot's float32 default is TF32, which would
break the kernels' float32 parity with torch). Imports Triton: only CUDA paths (or the
interpreter) import this module."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
