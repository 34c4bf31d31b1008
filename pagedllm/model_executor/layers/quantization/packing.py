"""Bit packing of GPTQ and AWQ tensors, in plain torch so it runs on any device.

One internal layout serves both formats and every kernel (see gptq_awq.PackedMethod):
`qweight` [K / pack, N] packed along the input dimension, value j of word (r, n) being
input row `pack * r + j` (GPTQ's order, LSB first); `qzeros` [G, N / pack] packed along the
output dimension in sequential order; `scales` [G, N]. AWQ's output-packed, interleaved
tensors are converted to it once at load; so are AWQ GEMV's transposed ones (`qweight`
[N, K / 8] packed along the input, `scales` [N, Wz * 8] and `qzeros` [N, Wz] with groups
packed 8 to a word, Wz zero-padded to the GEMV kernel's alignment).
"""

from __future__ import annotations

import torch

# AWQ GEMM: nibble k of a word holds output column 8c + AWQ_ORDER[k].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same bits (checkpoints store int32)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, N] int32 -> [R * pack, N] int32 values, row pack*r + j from bits j*bits.."""
    pack = 32 // bits
    vals = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, pack, 1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * pack, packed.shape[1])


def pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of unpack_rows: [K, N] values in [0, 2^bits) -> [K / pack, N] int32."""
    pack = 32 // bits
    k, n = vals.shape
    if k % pack:
        raise ValueError(f"{k} rows cannot be packed {pack} to a word")
    v = vals.to(torch.int64).view(k // pack, pack, n) << _shifts(bits, vals.device).to(torch.int64).view(1, pack, 1)
    return _to_int32(v.sum(1))


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] int32 -> [R, C * pack] values. With `order`, value k of word c is column
    pack*c + order[k] (AWQ's interleave); without, column pack*c + k."""
    pack = 32 // bits
    r, c = packed.shape
    vals = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)  # [R, C, pack]
    if order is not None:
        inverse = sorted(range(pack), key=lambda k: order[k])  # column j comes from value inverse[j]
        vals = vals[..., inverse]
    return vals.reshape(r, c * pack)


def pack_cols(vals: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of unpack_cols: [R, N] values -> [R, N / pack] int32."""
    pack = 32 // bits
    r, n = vals.shape
    if n % pack:
        raise ValueError(f"{n} columns cannot be packed {pack} to a word")
    v = vals.to(torch.int64).view(r, n // pack, pack)
    if order is not None:
        v = v[..., list(order)]  # value k holds column order[k]
    return _to_int32((v << _shifts(bits, vals.device).to(torch.int64)).sum(-1))


def awq_to_internal(name: str, packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM `qweight` [K, N/8] or `qzeros` [G, N/8], interleaved along the output ->
    the internal layout. AWQ stores zeros as they are, so no offset changes."""
    vals = unpack_cols(packed, 4, AWQ_ORDER)
    return pack_rows(vals, 4) if name == "qweight" else pack_cols(vals, 4)


def awq_gemv_to_internal(name: str, block: torch.Tensor, groups: slice) -> torch.Tensor:
    """One block of an AWQ GEMV tensor (all its input or group columns for some output
    rows) -> the internal layout. `groups` picks the real groups out of the padded ones.
    qweight's words already hold 8 consecutive inputs LSB first, as the internal layout's
    do, so it only needs transposing; zeros are unpacked along the groups and re-packed
    along the output."""
    if name == "qweight":
        return block.to(torch.int32).t().contiguous()
    if name == "scales":
        return block[:, groups].t().contiguous()
    return pack_cols(unpack_cols(block.to(torch.int32), 4)[:, groups].t().contiguous(), 4)


def tile_rows(qweight: torch.Tensor, bits: int, tile_k: int, chunk: int = 4096) -> torch.Tensor:
    """Sequential [K/pack, N] -> the GPU kernel's tiled layout [Kp/pack, N], K padded to
    a multiple of `tile_k` with zero values.

    Within each tile of `tile_k` input rows, word r holds rows r, r + R, r + 2R, ...
    (R = tile_k / pack), so value j of every word in the tile is one contiguous block of R
    rows: the kernel takes a "plane" of 16 consecutive rows with one shift and mask, and
    feeds it to a matrix product with 16 consecutive activation columns. Done in column
    chunks to bound the unpacked temporary."""
    pack = 32 // bits
    k = qweight.shape[0] * pack
    kp = -(-k // tile_k) * tile_k
    rows = tile_k // pack
    out = []
    for c in range(0, qweight.shape[1], chunk):
        q = unpack_rows(qweight[:, c:c + chunk], bits)
        q = torch.nn.functional.pad(q, (0, 0, 0, kp - k))
        q = q.view(kp // tile_k, pack, rows, q.shape[1]).transpose(1, 2).reshape(kp, q.shape[1])
        out.append(pack_rows(q, bits))
    return torch.cat(out, dim=1)


def untile_rows(qweight: torch.Tensor, bits: int, tile_k: int, k: int) -> torch.Tensor:
    """Values [K, N] of a tiled qweight (inverse of tile_rows, unpacked)."""
    pack = 32 // bits
    q = unpack_rows(qweight, bits)
    kp, n = q.shape
    q = q.view(kp // tile_k, tile_k // pack, pack, n).transpose(1, 2).reshape(kp, n)
    return q[:k]


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               bits: int, zero_offset: int, perm: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, tile_k: int | None = None,
               in_features: int | None = None, groups: torch.Tensor | None = None) -> torch.Tensor:
    """Internal layout -> float weight [N, K] in Hugging Face's (out, in) orientation.

    Row i of the internal tensors is input feature `perm[i]` (act-order checkpoints are
    sorted by group at load); its group is i // group_size, or `groups[i]` where a
    tensor-parallel rank's rows are not whole groups in order (act-order, row-parallel).
    With `tile_k`, qweight is in the GPU kernel's tiled layout (tile_rows). The product is
    formed in float32: (q - z) is a small integer and the scale an fp16, so it is exact.
    """
    if tile_k is None:
        q = unpack_rows(qweight, bits)  # [K, N]
    else:
        q = untile_rows(qweight, bits, tile_k, in_features)
    k, n = q.shape
    if groups is None:
        groups = torch.arange(k, device=q.device) // group_size
    else:
        groups = groups.to(device=q.device, dtype=torch.long)
    z = unpack_cols(qzeros, bits)[:, :n] + zero_offset  # [G, N]
    w = (q - z[groups]).to(torch.float32) * scales.to(torch.float32)[groups]
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.to(torch.long), w)
    return w.t().to(dtype).contiguous()
