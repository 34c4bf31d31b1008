"""Triton kernels for GPTQ/AWQ weights: float activations x packed 4-bit (or 2/8-bit) weights.

`out[M, N] = x[M, K] @ W[K, N]` where W is never materialised in memory: each program
loads the int32 words of its weight tile and turns each value into q - z in registers
(`_plane_values`: one logic op and one FMA per weight, no shifts, no int-to-float
conversion; one row at a time the group's scale multiplies partial sums). So the weights stay
packed in GPU memory, and decode, which is bound by reading the weights, has about a
quarter of the bytes of bf16 to read. At batch 1 the kernel is bound by instruction issue
rather than by memory, which is why the instruction count per weight is the design's
first concern (checked on the SASS of each kernel).

Three paths share the layout:
- `_wna16_gemv` (one row: batch-1 decode) multiplies element-wise into a float32
  accumulator and reduces once at the end: no tensor cores, no operand shuffles. On
  Hopper, bf16, 4-bit and groups of whole 128-row tiles take mma_w4a16 instead (Gluon:
  the packed words go straight into mma.sync's register operand, each warp a K split,
  the splits added in the program), which issues about half the instructions a weight.
- `_wna16_planes` (a few rows: small decode batches) loads each packed word once and feeds
  its values to `tl.dot`. With 4-bit values, 16-bit activations and the tile in one
  group, the values become 16-bit floats straight from the bits, MAGIC | q = MAGIC_F + q,
  two to a register, and one FMA with -(MAGIC_F + z) leaves q - z exactly
  (`_magic_sub_planes`: 5-6 instructions per 4 weights); the scale multiplies each tile's
  product, or, up to 16 rows, one more FMA folds it into the weights, which then are the
  16-bit weights a dequantized checkpoint has, and every product goes straight into one
  accumulator. With groups smaller than a tile a second product with -(z + MAGIC_F) per
  plane removes the offset (`_magic_planes_asm`) and the scale multiplies each plane's
  product; else the values go through float32 (`_plane_values`).
- `_dequant_chunk` + cuBLAS (many rows: large batches, prefill) dequantizes chunks of
  columns into a scratch buffer and multiplies them with torch.mm. On Hopper, bf16, 4-bit
  and groups of whole tiles take wgmma_w4a16 instead (Gluon: wgmma and TMA), which never
  writes the 16-bit weights to memory.
Small problems are split along K so that every SM has work; the split that finishes
last adds the float32 partials (`_finish`) in the same launch, in a fixed order. The
split counters are shared by the device's launches, which therefore must not overlap
(the engine runs its model on one stream; these kernels let the next kernel be placed
early, pagedllm.pdl, but are never launched early themselves).

Layout: qweight is in the tiled layout of packing.tile_rows (K padded to a multiple of
TILE_K = 16 * values-per-word; value j of each word of a tile is a "plane" of 16
consecutive input rows). qzeros [G, N/pack] int32 packed along N; scales [G, N] fp16;
row k belongs to group k // group_size (act-order checkpoints were sorted at load, and
`perm` gathers the activation columns to match).

Robustness over cleverness: plain loads, arithmetic, `tl.dot` and one atomic counter per
split tile; no autotuning (block sizes come from a small table measured on an H200), no
TMA, no warp specialisation. Two pieces of inline PTX (byte permutes, masks and 16-bit
FMAs, in `_magic_planes_asm` and `_magic_sub_planes`), each with plain-Triton code that
gives the same values where no PTX runs (Triton's CPU interpreter, in the tests).

This module imports triton at the top: import it only when a CUDA tensor needs it.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from pagedllm import pdl
from pagedllm.attention.triton_backend import num_sms
from pagedllm.pdl import launch_dependents as _pdl_launch_dependents


@triton.jit
def _plane_values(qw, qw_hi, z, exp23, J: tl.constexpr, BITS: tl.constexpr):
    """q - z for value J of every word, exact in float32 ([rows, BLOCK_N]; z broadcasts).

    The value is not shifted down: masked where it lies (bit E = BITS * J) and placed
    under 2^23's exponent, its bits read as the float 2^23 + q * 2^E, and one fused
    multiply-add, f * 2^-E - (2^(23-E) + z), leaves q - z exactly (both sides are small
    integers). Per weight that is one logic op and one FMA: no shift, no int-to-float
    conversion. Values above bit 23 come from the word shifted down by 16 once (qw_hi).
    `exp23` is 0x4B000000 passed at run time: as a constant the compiler would emit the
    mask and the OR as two instructions (one immediate each); in a register they fuse."""
    if BITS * (J + 1) <= 23:
        E: tl.constexpr = BITS * J
        bits = qw & (((1 << BITS) - 1) << E)
    else:
        E: tl.constexpr = BITS * J - 16
        bits = qw_hi & (((1 << BITS) - 1) << E)
    f = (bits | exp23).to(tl.float32, bitcast=True)
    return f * (1.0 / (1 << E)) - ((1 << (23 - E)) + z)


@triton.jit
def _group_scales(s_ptr, g, offs_n, mask, stride_sg, stride_sn):
    """The scales of group g as stored ([BLOCK_N], fp16): a caller that loads them ahead
    converts them where they are used, so the load is not waited for at once."""
    return tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask, other=0.0)


@triton.jit
def _group_zeros(z_ptr, g, offs_n, mask, stride_zg, stride_zn, exp23, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """The zero points (float32, [BLOCK_N]) of group g. Each becomes a float through 2^23's
    exponent too (int-to-float conversions run at a quarter rate)."""
    PACK: tl.constexpr = 32 // BITS
    zw = tl.load(z_ptr + g * stride_zg + (offs_n // PACK) * stride_zn, mask=mask, other=0)
    zf = (((zw >> ((offs_n % PACK) * BITS)) & ((1 << BITS) - 1)) | exp23).to(tl.float32, bitcast=True)
    return zf - (8388608.0 - ZERO_OFFSET)


@triton.jit
def _group_params(s_ptr, z_ptr, g, offs_n, mask, stride_sg, stride_sn, stride_zg, stride_zn, exp23,
                  BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """Scales and zero points (float32, [BLOCK_N]) of group g."""
    s = _group_scales(s_ptr, g, offs_n, mask, stride_sg, stride_sn).to(tl.float32)
    return s, _group_zeros(z_ptr, g, offs_n, mask, stride_zg, stride_zn, exp23, BITS, ZERO_OFFSET)


@triton.jit
def _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK: tl.constexpr):
    """The [16, BLOCK_N] packed words of the tile that starts at input row k0 (0 past K)."""
    return tl.load(qw_ptr + (k0 // PACK + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                   mask=(k0 < K) & n_mask[None, :], other=0)


@triton.jit
def _finish(acc, c_ptrs, p_ptrs, stride_ps, mask, cnt_ptr, tile, pid_k, n_split, SPLIT_K: tl.constexpr):
    """Write a tile of the output. Split along K, each split stores its float32 partial
    and counts itself in; the split that arrives last adds the partials in split order
    (the same sum every run) and writes the tile, then resets the counter for the next
    launch. One launch per product: no second kernel to add the splits. The partials are
    read 4 at a time, their loads in flight together rather than a chain of L2 round
    trips (all at once would take registers from the main loop)."""
    if SPLIT_K:
        tl.store(p_ptrs + pid_k * stride_ps, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == n_split - 1:
            total = tl.zeros_like(acc)
            for i0 in range(0, n_split, 4):
                for i in tl.static_range(4):
                    total += tl.load(p_ptrs + (i0 + i) * stride_ps, mask=mask & (i0 + i < n_split), other=0.0,
                                     cache_modifier=".cg")
            tl.store(c_ptrs, total.to(c_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)
    else:
        tl.store(c_ptrs, acc.to(c_ptrs.dtype.element_ty), mask=mask)


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
    a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr, p_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, exp23,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cm, stride_cn, stride_ps,
    GROUP: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_IN_GROUP: tl.constexpr, SPLIT_K: tl.constexpr, TRIGGER: tl.constexpr,
):
    """One row (batch-1 decode): no tensor cores, so no operand shuffles through shared
    memory. Each plane of 16 rows is dequantized in registers and multiplied into a
    [16, BLOCK_N] float32 accumulator of the same layout, reduced once at the end.

    The kernel is bound by instruction issue, not by memory, so every instruction per
    weight counts: q - z costs a logic op and an FMA (_plane_values), the product one
    FMA, and when a whole tile lies in one group (TILE_IN_GROUP: group size a multiple of
    the tile, or one group) the scale is applied once per tile, to the partial sums."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = 16
    TILE_K: tl.constexpr = ROWS * PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_mask = offs_n < N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    if TRIGGER:  # the next kernel (a norm, rotary, SiLU) may be placed now (pagedllm.pdl)
        _pdl_launch_dependents()
    # Loop bounds independent of program_id (Triton's CPU interpreter needs that); the
    # last split's tiles past K are masked out, scales and zeros included.
    for k_step in range(0, K_PER_SPLIT, TILE_K):
        k0 = pid_k * K_PER_SPLIT + k_step
        qw = _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK)
        qw_hi = qw >> 16
        if TILE_IN_GROUP:
            s, z = _group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K),
                                 stride_sg, stride_sn, stride_zg, stride_zn, exp23, BITS, ZERO_OFFSET)
            part = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(PACK):
                a = _plane_activations(a_ptr, perm_ptr, k0 + j * ROWS + offs_r, K, stride_ak, HAS_PERM)
                part += a[:, None] * _plane_values(qw, qw_hi, z[None, :], exp23, j, BITS)
            acc += s[None, :] * part
        else:
            for j in tl.static_range(PACK):
                kj = k0 + j * ROWS  # value j of the tile's words: rows kj .. kj + 15
                a = _plane_activations(a_ptr, perm_ptr, kj + offs_r, K, stride_ak, HAS_PERM)
                # 16 | group_size (or a single group): the plane lies in one group.
                s, z = _group_params(s_ptr, z_ptr, kj // GROUP, offs_n, n_mask & (kj < K),
                                     stride_sg, stride_sn, stride_zg, stride_zn, exp23, BITS, ZERO_OFFSET)
                acc += a[:, None] * (_plane_values(qw, qw_hi, z[None, :], exp23, j, BITS) * s[None, :])
    _finish(tl.sum(acc, axis=0), c_ptr + offs_n * stride_cn, p_ptr + offs_n, stride_ps, n_mask,
            cnt_ptr, pid_n, pid_k, tl.num_programs(1), SPLIT_K)


@triton.jit
def _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, offs_k, K, stride_am, stride_ak, HAS_PERM: tl.constexpr):
    """[BLOCK_M, 16] activations of one plane's input rows (0 past K), through `perm`."""
    k_mask = offs_k < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    return tl.load(a_ptr + offs_m[:, None] * stride_am + cols * stride_ak,
                   mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _plane_dots(a_ptr, perm_ptr, planes, acc, acc_odd, offs_m, m_mask, k0, offs_r, K, stride_am, stride_ak,
                HAS_PERM: tl.constexpr, TWO_ACC: tl.constexpr, PACK: tl.constexpr):
    """acc and acc_odd plus each 16-bit plane of a tile times its 16 activation columns:
    the planes go to the tensor cores as they are; TWO_ACC sends the odd planes to
    acc_odd, two chains of dependent tensor-core instructions, half as long."""
    for j in tl.static_range(PACK):
        a = _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, k0 + j * 16 + offs_r, K, stride_am, stride_ak, HAS_PERM)
        if TWO_ACC and j % 2 == 1:
            acc_odd = tl.dot(a, planes[j], acc_odd)
        else:
            acc = tl.dot(a, planes[j], acc)
    return acc, acc_odd


@triton.jit
def _plane_dot(a, w, acc, IEEE: tl.constexpr):
    """acc + a [BLOCK_M, 16] @ w [16, BLOCK_N] (w = q - z: small integers, exact in the
    activations' dtype, so tensor cores take them as they are)."""
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w.to(a.dtype), acc)


# The 16-bit floats whose low mantissa bits take a 4-bit value q exactly: MAGIC | q reads
# as MAGIC_F + q (bf16 128, fp16 1024: the value's bits are the lowest of the mantissa).
BF16_MAGIC = 0x4300
FP16_MAGIC = 0x6400


def _byte_pair(b: int) -> int:
    """prmt selector: byte b of the first word into the low half, of the second into the
    high half (each byte twice; the masks keep one nibble)."""
    return b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)


def _magic_asm(magic: int) -> str:
    """PTX of _magic_planes_asm: outputs $0..$7 (planes 0..7, two words per register),
    inputs $8, $9 (two words). lop3 0xEA is (a & b) | c."""
    pair = f"0x{magic:04X}{magic:04X}"
    lines = ["{", ".reg .b32 t, u;"]
    for b in range(4):
        lines += [f"prmt.b32 t, $8, $9, 0x{_byte_pair(b):04X};",
                  f"lop3.b32 ${2 * b}, t, 0x000F000F, {pair}, 0xEA;",
                  "shr.u32 u, t, 4;",
                  f"lop3.b32 ${2 * b + 1}, u, 0x000F000F, {pair}, 0xEA;"]
    return "\n".join(lines + ["}"])


_MAGIC_ASM_BF16 = tl.constexpr(_magic_asm(BF16_MAGIC))
_MAGIC_ASM_FP16 = tl.constexpr(_magic_asm(FP16_MAGIC))


def _magic_sub_asm(magic: int, fma: str, one: int, sixteenth: int, scaled: bool) -> str:
    """PTX of _magic_sub_planes: outputs $0..$7 (planes 0..7 as q - z, or (q - z) s when
    `scaled`, two words per register), inputs $8, $9 (two words), $10, $11 (their
    -(MAGIC_F + z)), with `sixteenth` $12, $13 (their -(MAGIC_F / 16 + z)) and, when
    `scaled`, last the two words' scales. Zero points and scales are paired per word (one
    prmt each), so the code holds in any layout. Per 4 weights: a byte permute, two masks
    and two FMAs (bf16: and a shift), and two more FMAs to scale. q - z is exact; the
    product with the scale rounds once, to the 16-bit weight a dequantized checkpoint has."""
    pair = f"0x{magic:04X}{magic:04X}"
    regs = "t, u, v, zl, zh, one, sixteenth" + (", h, sl, nz" if scaled else "")
    lines = ["{", f".reg .b32 {regs};", f"mov.b32 one, 0x{one:04X}{one:04X};", "prmt.b32 zl, $10, $11, 0x5410;"]
    if sixteenth:
        lines += [f"mov.b32 sixteenth, 0x{sixteenth:04X}{sixteenth:04X};", "prmt.b32 zh, $12, $13, 0x5410;"]
    if scaled:  # nz: -0.0, so that fma(h, s, -0) is the product h s, rounded once
        sc = 14 if sixteenth else 12
        lines += ["mov.b32 nz, 0x80008000;", f"prmt.b32 sl, ${sc}, ${sc + 1}, 0x5410;"]

    def out(reg: int, v: str, mul: str, zero: str) -> list[str]:
        if not scaled:
            return [f"{fma} ${reg}, {v}, {mul}, {zero};"]
        return [f"{fma} h, {v}, {mul}, {zero};", f"{fma} ${reg}, h, sl, nz;"]

    for b in range(4):
        lines += [f"prmt.b32 t, $8, $9, 0x{_byte_pair(b):04X};",
                  f"lop3.b32 v, t, 0x000F000F, {pair}, 0xEA;", *out(2 * b, "v", "one", "zl")]
        if sixteenth:  # fp16 (10 mantissa bits): the high nibble in place reads as MAGIC_F + 16 q
            lines += [f"lop3.b32 v, t, 0x00F000F0, {pair}, 0xEA;", *out(2 * b + 1, "v", "sixteenth", "zh")]
        else:  # bf16 has 7 mantissa bits: the high nibble is shifted down first
            lines += ["shr.u32 u, t, 4;",
                      f"lop3.b32 v, u, 0x000F000F, {pair}, 0xEA;", *out(2 * b + 1, "v", "one", "zl")]
    return "\n".join(lines + ["}"])


_MAGIC_SUB_BF16 = tl.constexpr(_magic_sub_asm(BF16_MAGIC, "fma.rn.bf16x2", 0x3F80, 0, False))
_MAGIC_SUB_FP16 = tl.constexpr(_magic_sub_asm(FP16_MAGIC, "fma.rn.f16x2", 0x3C00, 0x2C00, False))
_MAGIC_SUB_SCALED_BF16 = tl.constexpr(_magic_sub_asm(BF16_MAGIC, "fma.rn.bf16x2", 0x3F80, 0, True))
_MAGIC_SUB_SCALED_FP16 = tl.constexpr(_magic_sub_asm(FP16_MAGIC, "fma.rn.f16x2", 0x3C00, 0x2C00, True))


@triton.jit
def _half_words(x, DT: tl.constexpr, shape):
    """x ([BLOCK_N] float32) rounded to DT, as DT's bits in the low half of int32 words,
    broadcast to `shape` (an operand of the inline PTX)."""
    return tl.broadcast_to((x.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)[None, :], shape)


@triton.jit
def _sub_plane(qw, J: tl.constexpr, z, s, DT: tl.constexpr, SCALED: tl.constexpr):
    """Plane J as q - z, or (q - z) s, in DT with plain Triton ops (_magic_sub_planes
    without PTX): the scale in DT, its product with q - z (exact in float32) rounded once."""
    w = ((qw >> (4 * J)) & 0xF).to(tl.float32) - z[None, :]
    if SCALED:
        w = w * s.to(DT).to(tl.float32)[None, :]
    return w.to(DT)


@triton.jit
def _magic_sub_planes(qw, z, s, DT: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr):
    """The tile's 8 planes as q - z in DT, or (q - z) s when SCALED (4-bit values, one zero
    point and scale per column: the tile lies in one group). MAGIC | q reads as
    MAGIC_F + q, and one FMA with -(MAGIC_F + z) leaves q - z, exact (small integers),
    ready for the tensor cores: no second product for the zero point, no float32 on the
    way; SCALED, one more FMA multiplies by the scale and rounds once to DT, the weight a
    dequantized checkpoint holds (bf16 takes the fp16 scales rounded to bf16). For fp16 the
    high nibble is not even shifted: MAGIC | 16 q reads as MAGIC_F + 16 q, and
    x / 16 - (MAGIC_F / 16 + z) is q - z. Without PTX (Triton's CPU interpreter) the same
    values in plain Triton."""
    if not ASM:
        return (_sub_plane(qw, 0, z, s, DT, SCALED), _sub_plane(qw, 1, z, s, DT, SCALED),
                _sub_plane(qw, 2, z, s, DT, SCALED), _sub_plane(qw, 3, z, s, DT, SCALED),
                _sub_plane(qw, 4, z, s, DT, SCALED), _sub_plane(qw, 5, z, s, DT, SCALED),
                _sub_plane(qw, 6, z, s, DT, SCALED), _sub_plane(qw, 7, z, s, DT, SCALED))
    off = _magic_offset_zero(z, DT)
    if DT == tl.bfloat16:
        if SCALED:
            return tl.inline_asm_elementwise(_MAGIC_SUB_SCALED_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                             [qw, _half_words(0.0 - off, DT, qw.shape),
                                              _half_words(s, DT, qw.shape)],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_MAGIC_SUB_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                             [qw, _half_words(0.0 - off, DT, qw.shape)],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        off16 = off - _magic_offset_zero(0.0, DT) * (15.0 / 16.0)  # MAGIC_F / 16 + z
        if SCALED:
            return tl.inline_asm_elementwise(_MAGIC_SUB_SCALED_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                             [qw, _half_words(0.0 - off, DT, qw.shape),
                                              _half_words(0.0 - off16, DT, qw.shape), _half_words(s, DT, qw.shape)],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_MAGIC_SUB_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                             [qw, _half_words(0.0 - off, DT, qw.shape),
                                              _half_words(0.0 - off16, DT, qw.shape)],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)


@triton.jit
def _magic_planes_asm(qw, DT: tl.constexpr):
    """The 8 planes of 4-bit words as 16-bit floats MAGIC_F + q, two words at a time: one
    byte permute puts byte b of both words in the two halves of a register, then a mask
    (and a shift for the high nibble) leaves value 2b (2b+1) of each word under MAGIC, a
    finished pair of 16-bit floats. 4 instructions per 4 weights, against about 14 on the
    float32 route (masks, FMA, convert; counted in the SASS). Inline PTX because no Triton
    op permutes bytes across elements; `pack=2` hands each instance two neighbouring words
    of a thread, which with Triton's layout for the tensor cores are two neighbouring
    input rows."""
    if DT == tl.bfloat16:
        return tl.inline_asm_elementwise(_MAGIC_ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [qw],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_MAGIC_ASM_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [qw],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=2)


@triton.jit
def _magic_plane(qw, J: tl.constexpr, DT: tl.constexpr, MAGIC: tl.constexpr):
    """Plane J as 16-bit floats MAGIC_F + q with plain Triton ops: the same values as
    _magic_planes_asm, for Triton's CPU interpreter (which runs no PTX)."""
    return (((qw >> (4 * J)) & 0xF) | MAGIC).to(tl.int16).to(DT, bitcast=True)


@triton.jit
def _magic_planes(qw, DT: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    """The tile's 8 planes as 16-bit floats MAGIC_F + q."""
    if ASM:
        return _magic_planes_asm(qw, DT)
    return (_magic_plane(qw, 0, DT, MAGIC), _magic_plane(qw, 1, DT, MAGIC), _magic_plane(qw, 2, DT, MAGIC),
            _magic_plane(qw, 3, DT, MAGIC), _magic_plane(qw, 4, DT, MAGIC), _magic_plane(qw, 5, DT, MAGIC),
            _magic_plane(qw, 6, DT, MAGIC), _magic_plane(qw, 7, DT, MAGIC))


@triton.jit
def _magic_offset_zero(z, DT: tl.constexpr):
    """z + MAGIC_F (float32, [BLOCK_N]) for activations of dtype DT (the pattern follows the
    dtype, as in _magic_planes_asm and `_magic`)."""
    if DT == tl.bfloat16:
        return z + 128.0
    return z + 1024.0


@triton.jit
def _magic_neg_zero(z, DT: tl.constexpr):
    """-(z + MAGIC_F) as a [16, BLOCK_N] operand: a @ this adds the zero point and takes
    away the magic offset of a @ plane (both exact: small integers)."""
    return (tl.zeros((16, z.shape[0]), dtype=tl.float32) - _magic_offset_zero(z, DT)[None, :]).to(DT)


@triton.jit
def _plane_product(a, qw, qw_hi, z, acc, exp23, J: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr,
                   ZERO_IN_DOT: tl.constexpr):
    """acc + a @ (q - z) for plane J, through float32 values. ZERO_IN_DOT: q alone goes
    through the unpacking (whose only other operands are constants, so Triton converts the
    packed words, not the weights, to the tensor cores' layout: no shared-memory round
    trip and no barrier per plane), and a second product a @ (-z) adds the zero point on
    the tensor cores. Otherwise q - z is formed per weight (one instruction fewer, a
    shuffle per plane)."""
    if ZERO_IN_DOT:
        neg_z = tl.zeros((16, qw.shape[1]), dtype=tl.float32) - z[None, :]
        acc = _plane_dot(a, _plane_values(qw, qw_hi, 0.0, 0x4B000000, J, BITS), acc, IEEE)
        return _plane_dot(a, neg_z, acc, IEEE)
    return _plane_dot(a, _plane_values(qw, qw_hi, z[None, :], exp23, J, BITS), acc, IEEE)


@triton.jit
def _plane_step(a, qw, qw_hi, planes, z, acc, exp23, J: tl.constexpr, BITS: tl.constexpr,
                IEEE: tl.constexpr, ZERO_IN_DOT: tl.constexpr, MAGIC: tl.constexpr):
    """acc + a @ (q - z) for plane J. MAGIC (4-bit values, 16-bit activations): plane J of
    `planes` (_magic_planes) is MAGIC_F + q, and a second product with -(z + MAGIC_F)
    leaves q - z. Else _plane_product, through float32 values."""
    if MAGIC:
        return tl.dot(a, _magic_neg_zero(z, a.dtype), tl.dot(a, planes[J], acc))
    return _plane_product(a, qw, qw_hi, z, acc, exp23, J, BITS, IEEE, ZERO_IN_DOT)


@triton.jit
def _wna16_planes(
    a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr, p_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, exp23,
    stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_cm, stride_cn, stride_ps,
    GROUP: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, IEEE: tl.constexpr,
    TILE_IN_GROUP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ZERO_IN_DOT: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr, TWO_ACC: tl.constexpr, FOLD: tl.constexpr,
    LOOP_STAGES: tl.constexpr, TRIGGER: tl.constexpr,
):
    """Several rows (decode batches): each packed word is loaded once per program and each
    of its values ("planes": 16 consecutive input rows) goes to tensor cores as a small
    integer, [BLOCK_M, 16] @ [16, BLOCK_N].

    MAGIC with the tile in one group (SUB): the planes arrive as q - z in 16 bits
    (_magic_sub_planes), one product per plane into a partial sum that the tile's scale
    multiplies. FOLD (up to 16 rows): the planes arrive as (q - z) s and every product
    goes straight into the accumulator, with no partial per tile (faster up to 16 rows;
    from 17 rows the partials win, a scale per weight costing more than one per output).
    MAGIC with smaller groups: the planes are MAGIC_F + q and a second product with
    -(z + MAGIC_F) per plane takes the offset and the zero point away (_plane_step).
    TWO_ACC adds even and odd planes into two accumulators: two chains of dependent
    tensor-core instructions, half as long.

    FOLD's loop is `tl.range(num_stages=LOOP_STAGES)`, so that Triton's pipeliner makes
    every load of the loop an asynchronous copy some tiles ahead, the scales and zero
    points included (with the kernel's num_stages alone only loads feeding `tl.dot` are).
    Otherwise the scale of the next tile is loaded a tile ahead: a 2-byte load per thread
    cannot go through those asynchronous copies, and loaded where it is used it cost a
    memory round trip per tile."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = 16
    TILE_K: tl.constexpr = ROWS * PACK
    DT: tl.constexpr = a_ptr.dtype.element_ty
    SUB: tl.constexpr = MAGIC != 0 and TILE_IN_GROUP
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # FOLD and TWO_ACC only
    k_first = pid_k * K_PER_SPLIT
    if TRIGGER:  # the next kernel (a norm, rotary, SiLU) may be placed now (pagedllm.pdl)
        _pdl_launch_dependents()
    if not FOLD:
        s_next = _group_scales(s_ptr, k_first // GROUP, offs_n, n_mask & (k_first < K), stride_sg, stride_sn)
    for k_step in tl.range(0, K_PER_SPLIT, TILE_K, num_stages=LOOP_STAGES):
        k0 = k_first + k_step
        qw = _tile_words(qw_ptr, k0, offs_r, offs_n, n_mask, K, stride_qk, stride_qn, PACK)
        qw_hi = qw >> 16
        planes = qw
        if MAGIC and not SUB:
            planes = _magic_planes(qw, DT, MAGIC, ASM)
        if FOLD:
            s, z = _group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K),
                                 stride_sg, stride_sn, stride_zg, stride_zn, exp23, BITS, ZERO_OFFSET)
            planes = _magic_sub_planes(qw, z, s, DT, ASM, True)
            acc, acc_odd = _plane_dots(a_ptr, perm_ptr, planes, acc, acc_odd, offs_m, m_mask, k0, offs_r, K,
                                       stride_am, stride_ak, HAS_PERM, TWO_ACC, PACK)
        elif TILE_IN_GROUP:
            z = _group_zeros(z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K), stride_zg, stride_zn, exp23, BITS,
                             ZERO_OFFSET)
            s = s_next.to(tl.float32)  # loaded a tile ago
            k_next = k0 + TILE_K  # the next tile's scale, if this split has one
            s_next = _group_scales(s_ptr, k_next // GROUP, offs_n,
                                   n_mask & (k_next < K) & (k_step + TILE_K < K_PER_SPLIT), stride_sg, stride_sn)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part_odd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # TWO_ACC only
            if SUB:
                planes = _magic_sub_planes(qw, z, s, DT, ASM, False)
                part, part_odd = _plane_dots(a_ptr, perm_ptr, planes, part, part_odd, offs_m, m_mask, k0, offs_r, K,
                                             stride_am, stride_ak, HAS_PERM, TWO_ACC, PACK)
                if TWO_ACC:
                    part += part_odd
            else:
                for j in tl.static_range(PACK):
                    a = _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, k0 + j * ROWS + offs_r, K,
                                    stride_am, stride_ak, HAS_PERM)
                    part = _plane_step(a, qw, qw_hi, planes, z, part, exp23, j, BITS, IEEE, ZERO_IN_DOT, MAGIC)
            acc += s[None, :] * part
        else:
            for j in tl.static_range(PACK):
                kj = k0 + j * ROWS
                a = _plane_rows(a_ptr, perm_ptr, offs_m, m_mask, kj + offs_r, K, stride_am, stride_ak, HAS_PERM)
                s, z = _group_params(s_ptr, z_ptr, kj // GROUP, offs_n, n_mask & (kj < K),
                                     stride_sg, stride_sn, stride_zg, stride_zn, exp23, BITS, ZERO_OFFSET)
                zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc += s[None, :] * _plane_step(a, qw, qw_hi, planes, z, zero, exp23, j, BITS, IEEE,
                                                ZERO_IN_DOT, MAGIC)
    if FOLD and TWO_ACC:
        acc += acc_odd
    tile = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    _finish(acc, c_ptr + tile, p_ptr + offs_m[:, None] * N + offs_n[None, :], stride_ps,
            m_mask[:, None] & n_mask[None, :], cnt_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k,
            tl.num_programs(2), SPLIT_K)


@triton.jit
def _dequant_chunk(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K, n0, exp23,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_wk,
    GROUP: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
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
    qw_hi = qw >> 16
    for j in tl.static_range(PACK):
        kj = k0 + j * ROWS
        s, z = _group_params(s_ptr, z_ptr, kj // GROUP, offs_n, n_mask & (kj < K),
                             stride_sg, stride_sn, stride_zg, stride_zn, exp23, BITS, ZERO_OFFSET)
        w = _plane_values(qw, qw_hi, z[None, :], exp23, j, BITS) * s[None, :]
        rows = kj + offs_r
        tl.store(w_ptr + rows[:, None] * stride_wk + offs_c[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=(rows < K)[:, None] & n_mask[None, :])


# Many rows (large decode batches, prefill): dequantize a chunk of columns into a scratch
# buffer and let cuBLAS multiply, chunk after chunk; the buffer is reused by every chunk and
# every layer. It holds 64M values (128 MB in 16 bits): a 7B model's qkv and down in one
# product, gate_up in two equal halves. A buffer that fits in L2 (16M values) was slower:
# the float weights did not stay in cache anyway, and the narrower products kept cuBLAS
# from filling the SMs.
SCRATCH_ELEMENTS = 64 * 1024 * 1024
EXP23 = 0x4B000000  # the bits of the float 2^23 (_plane_values)
# Split-K tiles count their finished splits here (_finish); each count is back to 0 when
# its launch ends. One slot per output tile of one product.
COUNTERS = 1 << 16
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (zeros)."""
    device = torch.device(device)
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def scratch(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The shared dequantization buffer of a device and dtype. The packed weight method calls this
    at load time, which also makes the device's counters: so neither is allocated inside
    a CUDA-graph capture."""
    device = torch.device(device)
    counters(device)
    key = (device, dtype)
    if key not in _scratch:
        _scratch[key] = torch.empty(SCRATCH_ELEMENTS, dtype=dtype, device=device)
    return _scratch[key]


def _dequant_matmul(x, qweight, scales, qzeros, perm, group_size, bits, zero_offset, out, chunk_elements):
    m, k = x.shape
    n = out.shape[1]
    if perm is not None:  # act-order: rows were sorted at load; gather x's columns to match
        x = x.index_select(1, perm)
    block_n = 128
    chunks = triton.cdiv(n, max(block_n, chunk_elements // k // block_n * block_n))
    chunk = triton.cdiv(triton.cdiv(n, chunks), block_n) * block_n  # equal widths: balanced products
    buf = scratch(x.device, x.dtype)
    tile_k = tile_k_for(bits)
    for n0 in range(0, n, chunk):
        width = min(chunk, n - n0)
        w = buf[:k * width].view(k, width)
        _dequant_chunk[(triton.cdiv(width, block_n), triton.cdiv(k, tile_k))](
            qweight, scales, qzeros, w, n0 + width, k, n0, EXP23,
            qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
            qzeros.stride(0), qzeros.stride(1), w.stride(0),
            GROUP=group_size, BITS=bits, ZERO_OFFSET=zero_offset, BLOCK_N=block_n, num_warps=4)
        torch.mm(x, w, out=out[:, n0:n0 + width])
    return out


def _magic(dtype: torch.dtype, bits: int) -> int:
    """The bit pattern that turns 4-bit values into 16-bit floats of this dtype (0: none;
    the planes then go through float32)."""
    if bits != 4:
        return 0
    return {torch.bfloat16: BF16_MAGIC, torch.float16: FP16_MAGIC}.get(dtype, 0)


def tile_k_for(bits: int) -> int:
    """Input rows per kernel tile: one 16-row plane per value in a word."""
    return 16 * (32 // bits)


def supports(in_features: int, group_size: int, bits: int) -> bool:
    """A 16-row plane must lie in one group."""
    return group_size % 16 == 0 or group_size >= in_features


DEQUANT_MIN_ROWS = 128  # from this many rows on, dequantize-to-scratch + cuBLAS wins


def pick_config(m: int, n: int, k: int, group_size: int, bits: int, num_sms: int) -> dict:
    """Kernel, block sizes and K split for one problem: a fixed table measured on an H200
    with `benchmarks/quant_decode.py --sweep` (no autotuning: the first request of a new
    batch size must not pay for a search)."""
    if m >= DEQUANT_MIN_ROWS:  # on Hopper, bf16: wgmma_w4a16 instead (wna16_matmul; wgmma=False: never)
        return dict(gemv=False, planes=False, dequant=True, chunk_elements=SCRATCH_ELEMENTS)
    # Splits finish in the same launch (_finish), but each one writes a float32 partial and
    # the last one adds them up, so a split must pay for that. From 2 rows on the weights
    # reach the tensor cores as 16-bit floats made from the bits (magic; 4-bit values and
    # 16-bit activations, else float32 with the zero point in a second product); up to 16
    # rows even and odd planes go to two accumulators (two_acc) and the scales are folded
    # into the 16-bit weights (fold; from 17 rows a float32 partial per tile is scaled
    # instead, which was faster there).
    tile_k = tile_k_for(bits)
    if m == 1:
        bm, bn, warps, stages = 1, 64, 4, 3
        tiles = triton.cdiv(n, bn)
        split = min(triton.cdiv(8 * num_sms, tiles), k // (3 * tile_k))
    elif m <= 16:
        # One tile shape for every linear, and as many splits as fill one wave of programs
        # and no more (at most 8): 4 programs fit on an SM (189 registers a thread and
        # 26 KB of shared memory each), and a second wave of a few programs would take
        # nearly as long as the first.
        bm, bn, warps, stages = 16, 128, 2, 3
        tiles = triton.cdiv(n, bn)
        split = min(8, 4 * num_sms // tiles, k // (2 * tile_k))
    else:  # 17..127 rows
        bm, bn, warps, stages = 32, 128, 4, 3
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = min(triton.cdiv(2 * num_sms, tiles), k // (2 * tile_k))
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, split)), tile_k) * tile_k
    return dict(gemv=m == 1, planes=m > 1, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                split=triton.cdiv(k, k_per_split), k_per_split=k_per_split, zero_in_dot=True, magic=True,
                two_acc=m <= 16, fold=m <= 16, mma=m == 1)


def _gluon_fits(module: str, x, qweight, scales, qzeros, k: int, group_size: int, bits: int) -> bool:
    """Whether a Hopper kernel (wgmma_w4a16 or mma_w4a16) takes this product: its scope,
    contiguous rows of weights, and a Triton with Gluon."""
    if not (x.is_cuda and qweight.stride(1) == 1 and scales.stride(1) == 1 and qzeros.stride(1) == 1):
        return False
    try:
        kernel = importlib.import_module(f"pagedllm.model_executor.layers.quantization.{module}")
    except ImportError:  # a Triton without Gluon
        return False
    return kernel.supports(x, k, group_size, bits)


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
    sms = num_sms(x.device)  # CPU (Triton's interpreter, tests): a small GPU's 8
    cfg = config or pick_config(m, n, k, group_size, bits, sms)
    hopper = None  # on Hopper, bf16 and 4-bit: one row by mma_w4a16, 128 and more by wgmma_w4a16 (Gluon)
    if cfg.get("mma") and _gluon_fits("mma_w4a16", x, qweight, scales, qzeros, k, group_size, bits):
        hopper = "mma_w4a16"
    elif cfg.get("dequant") and cfg.get("wgmma", True) and _gluon_fits("wgmma_w4a16", x, qweight, scales, qzeros,
                                                                        k, group_size, bits):
        hopper = "wgmma_w4a16"
    if hopper:
        kernel = importlib.import_module(f"pagedllm.model_executor.layers.quantization.{hopper}")
        x = x.index_select(1, perm) if perm is not None else x  # act-order: rows sorted at load
        if hopper == "mma_w4a16":
            return kernel.mma_w4a16(x, qweight, scales, qzeros, group_size, zero_offset, sms, cfg.get("mma_config"))
        return kernel.wgmma_w4a16(x, qweight, scales, qzeros, group_size, zero_offset, sms)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if cfg.get("dequant"):
        return _dequant_matmul(x, qweight, scales, qzeros, perm, group_size, bits, zero_offset, out,
                               cfg["chunk_elements"])
    split = cfg["split"]
    grid_n = triton.cdiv(n, cfg["BLOCK_N"])
    grid_m = 1 if cfg["gemv"] else triton.cdiv(m, cfg["BLOCK_M"])
    if split > 1 and grid_n * grid_m > COUNTERS:
        raise ValueError(f"{grid_n * grid_m} output tiles: more than the {COUNTERS} split-K counters")
    # Split-K partials (float32, [split, m, n]); without a split the kernel never reads it.
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    args = (x, qweight, scales, qzeros, perm if perm is not None else qweight, out, partials,
            counters(x.device), m, n, k, cfg["k_per_split"], EXP23,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
            scales.stride(0), scales.stride(1), qzeros.stride(0), qzeros.stride(1),
            out.stride(0), out.stride(1), m * n)
    common = dict(GROUP=group_size, BITS=bits, ZERO_OFFSET=zero_offset, HAS_PERM=perm is not None, BLOCK_N=cfg["BLOCK_N"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  TILE_IN_GROUP=group_size % tile_k == 0 or group_size >= k, SPLIT_K=split > 1, TRIGGER=pdl.launch(x))
    if cfg["gemv"]:
        if m != 1:
            raise ValueError("the GEMV kernel takes one row")
        _wna16_gemv[(grid_n, split)](*args, **common)
    else:
        magic = _magic(x.dtype, bits) if cfg.get("magic", True) else 0
        fold = cfg.get("fold", False) and magic != 0 and common["TILE_IN_GROUP"]
        _wna16_planes[(grid_n, grid_m, split)](*args, IEEE=x.dtype == torch.float32, BLOCK_M=cfg["BLOCK_M"],
                                               ZERO_IN_DOT=cfg.get("zero_in_dot", True), MAGIC=magic,
                                               ASM=x.is_cuda, TWO_ACC=cfg.get("two_acc", False), FOLD=fold,
                                               LOOP_STAGES=cfg["num_stages"] if fold else None, **common)
    return out
