"""Triton kernels for GPTQ/AWQ weights: float activations x packed 4-bit (or 2/8-bit) weights.

`out[M, N] = x[M, K] @ W[K, N]` where W is never materialised in memory: each program
loads the int32 words of its weight tile, shifts the values out, subtracts the group's
zero point and multiplies by the group's scale in float32, in registers. So the weights
stay packed in GPU memory, and decode, which is bound by reading the weights, has about a
quarter of the bytes of bf16 to read.

Three paths share the layout:
- `_wna16_gemv` (one row: batch-1 decode) multiplies element-wise into a float32
  accumulator and reduces once at the end: no tensor cores, no operand shuffles.
- `_wna16_planes` (a few rows: small decode batches) loads each packed word once and feeds
  its raw values to `tl.dot`, scale and zero point applied to the product.
- `_dequant_chunk` + cuBLAS (many rows: large batches, prefill) dequantizes chunks of
  columns into a small scratch buffer that stays in L2 and multiplies them with torch.mm.
Small problems are split along K so that every SM has work; `_sum_splits` adds the
float32 partials and casts in one launch.

Layout: qweight is in the tiled layout of packing.tile_rows (K padded to a multiple of
TILE_K = 16 * values-per-word; value j of each word of a tile is a "plane" of 16
consecutive input rows). qzeros [G, N/pack] int32 packed along N; scales [G, N] fp16;
row k belongs to group k // group_size (act-order checkpoints were sorted at load, and
`perm` gathers the activation columns to match).

Robustness over cleverness: plain loads, arithmetic and `tl.dot`; no autotuning (block
sizes come from a small table measured on an H200), no TMA, no warp specialisation, no
inline assembly.

This module imports triton at the top: import it only when a CUDA tensor needs it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant(qw, shift, z, s, BITS: tl.constexpr):
    """Shifted-out values -> float32 weights, (q - z) * s. q becomes a float without an
    int-to-float conversion (a slow instruction): placed under 2^23's exponent, its bits
    read as the float 2^23 + q exactly."""
    q = ((qw >> shift) & ((1 << BITS) - 1)) | 0x4B000000
    return (q.to(tl.float32, bitcast=True) - (8388608.0 + z)) * s


@triton.jit
def _group_params(s_ptr, z_ptr, g, offs_n, mask, stride_sg, stride_sn, stride_zg, stride_zn,
                  BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """Scales and zero points (float32, [BLOCK_N]) of group g."""
    PACK: tl.constexpr = 32 // BITS
    s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask, other=0.0).to(tl.float32)
    zw = tl.load(z_ptr + g * stride_zg + (offs_n // PACK) * stride_zn, mask=mask, other=0)
    z = ((zw >> ((offs_n % PACK) * BITS)) & ((1 << BITS) - 1)) + ZERO_OFFSET
    return s, z.to(tl.float32)


@triton.jit
def _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK: tl.constexpr):
    """The [16, BLOCK_N] packed words of the tile that starts at input row k0 (0 past K)."""
    return tl.load(qw_ptr + (k0 // PACK + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                   mask=(k0 < K) & n_mask[None, :], other=0)


@triton.jit
def _plane_activations(a_ptr, perm_ptr, offs_k, K, stride_ak, HAS_PERM: tl.constexpr):
    """The activations of 16 input rows (float32; 0 past K), through `perm` for act-order."""
    k_mask = offs_k < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    return tl.load(a_ptr + cols * stride_ak, mask=k_mask, other=0.0).to(tl.float32)


@triton.jit
def _wna16_gemv(
    a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr,
    M, N, K, K_PER_SPLIT, group_size,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cs, stride_cm, stride_cn,
    BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_IN_GROUP: tl.constexpr,
):
    """One row (batch-1 decode): no tensor cores, so no operand shuffles through shared
    memory. Each plane of 16 rows is dequantized in registers and multiplied into a
    [16, BLOCK_N] float32 accumulator of the same layout, reduced once at the end.

    The kernel is bound by the arithmetic of unpacking, not by memory, so when a whole
    tile lies in one group (TILE_IN_GROUP: group size a multiple of the tile, or one
    group) the scale and zero point are applied once per tile instead of per weight:
    sum_k a_k (q_k - z) s = s (sum_k a_k q_k - z sum_k a_k). Per weight that leaves shift,
    mask, one float subtract and one multiply-add."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = 16
    TILE_K: tl.constexpr = ROWS * PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_mask = offs_n < N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    # Loop bounds independent of program_id (Triton's CPU interpreter needs that); the
    # last split's tiles past K are masked out, scales and zeros included.
    for k_step in range(0, K_PER_SPLIT, TILE_K):
        k0 = pid_k * K_PER_SPLIT + k_step
        qw = _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK)
        if TILE_IN_GROUP:
            s, z = _group_params(s_ptr, z_ptr, k0 // group_size, offs_n, n_mask & (k0 < K),
                                 stride_sg, stride_sn, stride_zg, stride_zn, BITS, ZERO_OFFSET)
            part = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            a_sum = tl.zeros((ROWS,), dtype=tl.float32)
            for j in tl.static_range(PACK):
                a = _plane_activations(a_ptr, perm_ptr, k0 + j * ROWS + offs_r, K, stride_ak, HAS_PERM)
                q = ((qw >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
                part += a[:, None] * (q.to(tl.float32, bitcast=True) - 8388608.0)
                a_sum += a
            acc += s[None, :] * (part - a_sum[:, None] * z[None, :])
        else:
            for j in tl.static_range(PACK):
                kj = k0 + j * ROWS  # value j of the tile's words: rows kj .. kj + 15
                a = _plane_activations(a_ptr, perm_ptr, kj + offs_r, K, stride_ak, HAS_PERM)
                # 16 | group_size (or a single group): the plane lies in one group.
                s, z = _group_params(s_ptr, z_ptr, kj // group_size, offs_n, n_mask & (kj < K),
                                     stride_sg, stride_sn, stride_zg, stride_zn, BITS, ZERO_OFFSET)
                acc += a[:, None] * _dequant(qw, j * BITS, z[None, :], s[None, :], BITS)
    out = tl.sum(acc, axis=0)
    tl.store(c_ptr + pid_k * stride_cs + offs_n * stride_cn, out.to(c_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sum_splits(p_ptr, c_ptr, numel, SPLIT, BLOCK: tl.constexpr):
    """out = sum of the split-K partials (float32), cast to the output dtype: one launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, SPLIT):
        acc += tl.load(p_ptr + i * numel + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, offs_k, K, stride_am, stride_ak, HAS_PERM: tl.constexpr):
    """[BLOCK_M, 16] activations of one plane's input rows (0 past K), through `perm`."""
    k_mask = offs_k < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    return tl.load(a_ptr + offs_m[:, None] * stride_am + cols[None, :] * stride_ak,
                   mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _plane_dot(a, qw, shift, BITS: tl.constexpr, IEEE: tl.constexpr):
    """a [BLOCK_M, 16] @ the raw values of one plane [16, BLOCK_N]: small integers, exact in
    the activations' dtype, so tensor cores take them as they are."""
    q = ((qw >> shift) & ((1 << BITS) - 1)) | 0x4B000000
    w = q.to(tl.float32, bitcast=True) - 8388608.0
    if IEEE:
        return tl.dot(a, w, input_precision="ieee")
    return tl.dot(a, w.to(a.dtype))


@triton.jit
def _wna16_planes(
    a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr,
    M, N, K, K_PER_SPLIT, group_size,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cs, stride_cm, stride_cn,
    BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, IEEE: tl.constexpr,
    TILE_IN_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Several rows (decode batches, prefill): each packed word is loaded once per program
    and each of its values ("planes": 16 consecutive input rows) goes to tensor cores as a
    raw integer, [BLOCK_M, 16] @ [16, BLOCK_N]. The zero point and scale are applied to
    the product, not to every weight: sum_k a_k (q_k - z) s = s (sum_k a_k q_k - z sum_k a_k),
    once per tile when the tile lies in one group (TILE_IN_GROUP), else once per plane.
    Per weight that leaves shift, mask and a conversion, and no 8-fold reload of a word
    (one per value it holds) as a dequantized [BLOCK_K, BLOCK_N] tile would need."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = 16
    TILE_K: tl.constexpr = ROWS * PACK
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, K_PER_SPLIT, TILE_K):
        k0 = pid_k * K_PER_SPLIT + k_step
        qw = _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK)
        if TILE_IN_GROUP:
            s, z = _group_params(s_ptr, z_ptr, k0 // group_size, offs_n, n_mask & (k0 < K),
                                 stride_sg, stride_sn, stride_zg, stride_zn, BITS, ZERO_OFFSET)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for j in tl.static_range(PACK):
                a = _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, k0 + j * ROWS + offs_r, K,
                                stride_am, stride_ak, HAS_PERM)
                part += _plane_dot(a, qw, j * BITS, BITS, IEEE)
                a_sum += tl.sum(a.to(tl.float32), axis=1)
            acc += s[None, :] * (part - a_sum[:, None] * z[None, :])
        else:
            for j in tl.static_range(PACK):
                kj = k0 + j * ROWS
                a = _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, kj + offs_r, K, stride_am, stride_ak, HAS_PERM)
                s, z = _group_params(s_ptr, z_ptr, kj // group_size, offs_n, n_mask & (kj < K),
                                     stride_sg, stride_sn, stride_zg, stride_zn, BITS, ZERO_OFFSET)
                part = _plane_dot(a, qw, j * BITS, BITS, IEEE)
                acc += s[None, :] * (part - tl.sum(a.to(tl.float32), axis=1)[:, None] * z[None, :])
    c = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_chunk(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K, n0, group_size,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_wk,
    BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Columns n0 .. n0 + chunk of the float weight, W[k, n - n0] = (q - z) s, written to a
    scratch buffer [K, chunk] (row-major: stores coalesce along N)."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = 16
    TILE_K: tl.constexpr = ROWS * PACK
    k0 = tl.program_id(1) * TILE_K
    offs_c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_c
    offs_r = tl.arange(0, ROWS)
    n_mask = offs_n < N
    qw = _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK)
    for j in tl.static_range(PACK):
        kj = k0 + j * ROWS
        s, z = _group_params(s_ptr, z_ptr, kj // group_size, offs_n, n_mask & (kj < K),
                             stride_sg, stride_sn, stride_zg, stride_zn, BITS, ZERO_OFFSET)
        w = _dequant(qw, j * BITS, z[None, :], s[None, :], BITS)
        rows = kj + offs_r
        tl.store(w_ptr + rows[:, None] * stride_wk + offs_c[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=(rows < K)[:, None] & n_mask[None, :])


# Many rows (large decode batches, prefill): dequantize a chunk of columns into a scratch
# buffer and let cuBLAS multiply, chunk after chunk. The buffer is reused by every chunk and
# every layer and is small enough to stay in L2 (60 MB on an H200), so the float weights are
# written and read back mostly in cache: per weight HBM sees the packed read only.
SCRATCH_ELEMENTS = 16 * 1024 * 1024
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The shared dequantization buffer of a device and dtype (made once, at load time by
    QuantizedLinear, so never inside a CUDA-graph capture)."""
    key = (torch.device(device), dtype)
    if key not in _scratch:
        _scratch[key] = torch.empty(SCRATCH_ELEMENTS, dtype=dtype, device=device)
    return _scratch[key]


def _dequant_matmul(x, qweight, scales, qzeros, perm, group_size, bits, zero_offset, out, chunk_elements):
    m, k = x.shape
    n = out.shape[1]
    if perm is not None:  # act-order: rows were sorted at load; gather x's columns to match
        x = x.index_select(1, perm)
    block_n = 128
    chunk = max(block_n, min(triton.cdiv(n, block_n) * block_n, chunk_elements // k // block_n * block_n))
    buf = scratch(x.device, x.dtype)
    tile_k = tile_k_for(bits)
    for n0 in range(0, n, chunk):
        width = min(chunk, n - n0)
        w = buf[:k * width].view(k, width)
        _dequant_chunk[(triton.cdiv(width, block_n), triton.cdiv(k, tile_k))](
            qweight, scales, qzeros, w, n0 + width, k, n0, group_size,
            qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
            qzeros.stride(0), qzeros.stride(1), w.stride(0),
            BITS=bits, ZERO_OFFSET=zero_offset, BLOCK_N=block_n, num_warps=4)
        torch.mm(x, w, out=out[:, n0:n0 + width])
    return out


def tile_k_for(bits: int) -> int:
    """Input rows per kernel tile: one 16-row plane per value in a word."""
    return 16 * (32 // bits)


def supports(in_features: int, group_size: int, bits: int) -> bool:
    """A 16-row plane must lie in one group."""
    return group_size % 16 == 0 or group_size >= in_features


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


DEQUANT_MIN_ROWS = 128  # from this many rows on, dequantize-to-scratch + cuBLAS wins


def pick_config(m: int, n: int, k: int, group_size: int, bits: int, num_sms: int) -> dict:
    """Kernel, block sizes and K split for one problem: a fixed table measured on an H200
    with `benchmarks/quant_decode.py --sweep` (no autotuning: the first request of a new
    batch size must not pay for a search)."""
    if m >= DEQUANT_MIN_ROWS:
        return dict(gemv=False, planes=False, dequant=True, chunk_elements=SCRATCH_ELEMENTS)
    if m == 1:
        bm, bn, warps, stages, programs = 1, 64, 4, 3, (8 if n < 8192 else 4) * num_sms
    elif m <= 16:
        bm, bn, warps, stages, programs = 16, 128, 4, 2, 8 * num_sms
    else:
        bm, bn, warps, stages, programs = 64, 128, 4, 3, 4 * num_sms
    tile_k = tile_k_for(bits)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # Enough programs to keep every SM's memory pipe full, at least two K tiles each.
    split = max(1, min(triton.cdiv(programs, tiles), k // (2 * tile_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), tile_k) * tile_k
    return dict(gemv=m == 1, planes=m > 1, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                split=triton.cdiv(k, k_per_split), k_per_split=k_per_split)


def wna16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 perm: torch.Tensor | None, group_size: int, bits: int, zero_offset: int,
                 config: dict | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequant(qweight) -> [M, N] in x's dtype. `qweight` is
    in the tiled layout (packing.tile_rows): K padded to a multiple of tile_k_for(bits)."""
    m, k = x.shape
    n = qweight.shape[1]
    tile_k = tile_k_for(bits)
    if qweight.shape[0] * (32 // bits) != triton.cdiv(k, tile_k) * tile_k:
        raise ValueError(f"x has {k} features: qweight is not the tiled layout of that many rows")
    if not supports(k, group_size, bits):
        raise ValueError(f"group size {group_size} is not a multiple of 16")
    if m == 0:
        return x.new_empty(0, n)
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 8  # CPU: Triton's interpreter (tests)
    cfg = config or pick_config(m, n, k, group_size, bits, sms)
    if cfg.get("dequant"):
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        return _dequant_matmul(x, qweight, scales, qzeros, perm, group_size, bits, zero_offset, out,
                               cfg["chunk_elements"])
    split = cfg["split"]
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        out_strides = (0, out.stride(0), out.stride(1))
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        out_strides = out.stride()
    args = (x, qweight, scales, qzeros, perm if perm is not None else qweight, out,
            m, n, k, cfg["k_per_split"], group_size,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
            scales.stride(0), scales.stride(1), qzeros.stride(0), qzeros.stride(1), *out_strides)
    common = dict(BITS=bits, ZERO_OFFSET=zero_offset, HAS_PERM=perm is not None, BLOCK_N=cfg["BLOCK_N"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  TILE_IN_GROUP=group_size % tile_k == 0 or group_size >= k)
    if cfg["gemv"]:
        if m != 1:
            raise ValueError("the GEMV kernel takes one row")
        _wna16_gemv[(triton.cdiv(n, cfg["BLOCK_N"]), split)](*args, **common)
    else:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
        _wna16_planes[grid](*args, IEEE=x.dtype == torch.float32, BLOCK_M=cfg["BLOCK_M"], **common)
    if split == 1:
        return out
    result = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _sum_splits[(triton.cdiv(m * n, 1024),)](out, result, m * n, split, BLOCK=1024)
    return result
