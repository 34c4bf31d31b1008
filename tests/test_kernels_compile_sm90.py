"""The decode-step kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter checks what a kernel computes, not that it lowers: a construct the
interpreter runs (a 3-D broadcast, a runtime scalar where a constant was, an inline PTX
wait) can still fail in the compiler. Triton compiles ahead of time for a named target
with its bundled ptxas, so these tests build the kernels of the batch-1 decode path for
sm_90 in the variants a step launches (PDL on and off, key splits on and off, fp8 pages)."""

from __future__ import annotations

import inspect
import itertools

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, signature: dict, constexprs: dict, warps: int = 4):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        target = GPUTarget("cuda", 90, 32)
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                              options={"num_warps": warps})
    except (ImportError, FileNotFoundError) as e:  # no NVIDIA backend or ptxas in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {e}")


def _signature(fn, constexprs: dict, pointers: dict, floats: set[str]) -> dict:
    """Triton's signature for every parameter: constexpr, a pointer type, fp32 or i32."""
    sig = {}
    for p in inspect.signature(fn.fn).parameters:
        if p in constexprs:
            sig[p] = "constexpr"
        elif p in pointers:
            sig[p] = pointers[p]
        else:
            sig[p] = "fp32" if p in floats else "i32"
    return sig


@pytest.mark.parametrize("pdl", [False, True])
def test_skinny_gemm_compiles(pdl):
    from pagedllm.model_executor.layers import skinny_gemm

    fn = skinny_gemm._skinny_kernel
    for mb, bn in ((1, 4), (1, 2), (4, 1)):
        const = {"MB": mb, "BN": bn, "BK": 1024, "BIAS": mb == 1, "SCALED": False, "PDL": pdl}
        sig = _signature(fn, const, {"X": "*bf16", "W": "*bf16", "B": "*bf16", "S": "*bf16", "Y": "*bf16"}, set())
        assert "ld.global" in _compile(fn, sig, const).asm["ptx"]
    # e4m3 weights with float32 row scales (weight-only FP8), bf16 and fp16 activations
    for x, mb, bn in (("*bf16", 1, 8), ("*fp16", 1, 4), ("*bf16", 2, 4)):
        const = {"MB": mb, "BN": bn, "BK": 1024, "BIAS": mb == 1, "SCALED": True, "PDL": pdl}
        sig = _signature(fn, const, {"X": x, "W": "*fp8e4nv", "B": x, "S": "*fp32", "Y": x}, set())
        ptx = _compile(fn, sig, const).asm["ptx"]
        assert "ld.global" in ptx and "e4m3" in ptx  # the weight widened from e4m3 in the kernel


def test_moe_sum_k_compiles():
    from pagedllm.model_executor.layers import fused_moe

    fn = fused_moe._sum_k_kernel
    for pdl in (False, True):
        const = {"K": 8, "KB": 8, "BLOCK": 256, "PDL": pdl}
        _compile(fn, _signature(fn, const, {"Rows": "*bf16", "Out": "*bf16"}, set()), const)


@pytest.mark.parametrize("pdl", [False, True])
def test_skinny_moe_compiles(pdl):
    """The one-token expert kernels: routed in the kernel or given ids, Qwen3-30B-A3B's
    tiles and gpt-oss's biases and SwiGLU."""
    from pagedllm.model_executor.layers import skinny_moe

    floats = {"alpha", "limit"}
    for route, extras in ((True, False), (False, True)):
        const = {"K": 8, "EB": 128, "ROUTE": route, "RENORM": route, "BIAS": extras, "SWIGLU": extras,
                 "BN": 4, "BK": 1024, "PDL": pdl}
        ptrs = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Hout": "*bf16", "Logits": "*bf16", "Ids": "*i32",
                "Weights": "*bf16"}
        fn = skinny_moe._gate_up_kernel
        assert "ld.global" in _compile(fn, _signature(fn, const, ptrs, floats), const).asm["ptx"]
        const = {"K": 8, "KB": 8, "BIAS": extras, "BN": 2, "BK": 256, "PDL": pdl}
        ptrs = {"A": "*bf16", "W": "*bf16", "B": "*bf16", "Out": "*bf16", "Ids": "*i32", "Weights": "*fp32"}
        fn = skinny_moe._down_kernel
        _compile(fn, _signature(fn, const, ptrs, set()), const)


def test_fused_moe_gate_up_compiles():
    """The grouped gate|up kernel with the expert activation it shares with skinny_moe
    (moe_math: silu, and gpt-oss's biases and clamped SwiGLU), and the routing kernel."""
    from pagedllm.model_executor.layers import fused_moe

    fn = fused_moe._gate_up_kernel
    ptrs = {"X": "*bf16", "W": "*bf16", "S": "*bf16", "B": "*bf16", "Out": "*bf16", "SortedIds": "*i32",
            "BlockExpert": "*i32", "Used": "*i32"}
    for swiglu in (False, True):
        const = {"IEEE": False, "BIAS": swiglu, "SWIGLU": swiglu, "MXFP4": False, "BM": 16, "BN": 64, "BK": 128}
        _compile(fn, _signature(fn, const, ptrs, {"alpha", "limit"}), const)
    fn = fused_moe._route_kernel
    for renorm in (False, True):
        const = {"K": 8, "EB": 128, "RENORM": renorm}
        _compile(fn, _signature(fn, const, {"Logits": "*bf16", "Weights": "*fp32", "Ids": "*i32"}, set()), const)


def test_paged_attention_and_combine_compile():
    """Decode (one query a row) and prefill tiles, bf16 and fp8 pages, key splits on and
    off: the split count a runtime argument, the switch a constant."""
    from pagedllm.attention import triton_backend as tb

    i32 = {p: "*i32" for p in ("block_tables", "q_starts", "q_lens", "ctx_lens", "tile_seq", "tile_q")}
    floats = {"scale_log2", "v_scale", "softcap_log2"}
    for direct, fp8, splits in itertools.product((True, False), (False, True), (False, True)):
        const = dict(GROUP=4, TILE_Q=1 if direct else 16, BLOCK_M=16 if direct else 64, HEAD_DIM=128,
                     BLOCK_D=128, PAGE=16, BLOCK_N=128 if fp8 else 64, DIRECT=direct, ALIBI=False, IEEE=False,
                     WINDOW=False, FP8=fp8, PDL=True, SOFTCAP=False, SINKS=False, CAUSAL=True, SPLIT=True,
                     FP8_F16=fp8, KEY_SPLITS=splits, SPLIT_MIN_KEYS=tb.SPLIT_MIN_KEYS)
        cache = "*fp8e4nv" if fp8 else "*bf16"
        ptrs = {"Q": "*bf16", "KC": cache, "VC": cache, "Out": "*bf16", "Slopes": "*bf16", "Sinks": "*bf16",
                "Part": "*fp32", "PartML": "*fp32", **i32}
        _compile(tb._paged_attention_kernel, _signature(tb._paged_attention_kernel, const, ptrs, floats), const)
    const = dict(GROUP=4, TILE_Q=1, HEAD_DIM=128, BLOCK_M=16, BLOCK_D=128, FP8=False, PDL=True, BLOCK_N=64,
                 SPLIT_MIN_KEYS=tb.SPLIT_MIN_KEYS, DIRECT=True, CAUSAL=True)
    ptrs = {"Part": "*fp32", "PartML": "*fp32", "Out": "*bf16", **i32}
    _compile(tb._combine_splits_kernel, _signature(tb._combine_splits_kernel, const, ptrs, {"v_scale"}), const)
