"""Hopper W4A16 kernel for decode batches of 1 to 8 rows, in Gluon (mma.sync).

The engine routes one row (batch-1 decode) here; from 2 rows on the Triton planes kernel
was as fast or faster on an H200, so it keeps them.

Why a third kernel: a decode step at small batch reads every weight once, so the product
should run at the card's memory bandwidth. The Triton kernels of triton_w4a16 fell well
short of it on Llama-2-7B's linears: the GEMV spent seven instructions a weight (one
activation load per 16-bit value, addresses, masks) and was bound by issue; the tensor-core
planes kernel needed 189 registers, so two warps a scheduler were too few to hide its
latencies; and both split K over programs whose float32 partials a last arrival adds.

Here, per warp and 128-row tile:
- Swap-AB: acc[cols, rows] = W^T tile @ x^T tile, the weights as mma's A operand (16
  columns), the batch rows as its 8 wide N side: one mma.m16n8k16 takes 256 weights,
  whatever the batch up to 8.
- The packed words are loaded straight into A's register layout (k_width=2: input rows
  2t, 2t+1, 2t+8, 2t+9 of each 16 at two columns, the word rows of the tiled layout of
  packing.tile_rows), and the magic-sub PTX of triton_w4a16 turns them into the 8 planes'
  fragments, (q - z) s in bf16 (the weights a dequantized checkpoint holds): about two
  instructions a weight for a thread, a sixteenth of that for the warp.
- The activations are loaded into B's register layout (two 32-bit loads a plane, from L1).
- K is split over the warps of a program, not over programs: a 3-d product [splits, cols,
  rows] puts each split on its own warp, and one sum over the splits' axis (through shared
  memory, once a program) adds them in a fixed order. No float32 partials in global memory,
  no counters, no second pass.
- The next tile's words and scales are loaded before this tile is dequantized.
- Launched with PDL (pagedllm.pdl): placed while the kernel before it runs, it loads its
  first two tiles' words and scales, then waits for that kernel before it reads the
  activations.

Scope: bf16 activations, 4-bit weights, groups a multiple of 128 rows (or one group), on
sm_90 (the only card it was measured on). Everything else takes triton_w4a16's paths."""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from pagedllm import pdl
from pagedllm.model_executor.layers.quantization.triton_w4a16 import (
    _MAGIC_ASM_BF16,
    _MAGIC_SUB_SCALED_BF16,
)
from pagedllm.pdl import LAUNCH_DEPENDENTS_ASM as _PDL_LAUNCH_DEPENDENTS_ASM
from pagedllm.pdl import WAIT_ASM as _PDL_WAIT_ASM

TILE_K = 128  # input rows per tile: 8 planes of 16
_TILE_K = gl.constexpr(TILE_K)
MAX_ROWS = 8  # the mma's N side; measured faster than the Triton kernels at 1 row only


@gluon.jit
def _along0(size: gl.constexpr, layout: gl.constexpr):
    """0..size-1 along axis 0 of a 3-d tensor of `layout` ([size, 1, 1])."""
    return gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout))), 1), 2)


@gluon.jit
def _along1(size: gl.constexpr, layout: gl.constexpr):
    """0..size-1 along axis 1 ([1, size, 1])."""
    return gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout))), 0), 2)


@gluon.jit
def _along2(size: gl.constexpr, layout: gl.constexpr):
    """0..size-1 along axis 2 ([1, 1, size])."""
    return gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout))), 0), 1)


@gluon.jit
def _zero_points(zw, n, ZERO_OFFSET: gl.constexpr):
    """Column n's zero point (float32) from its packed word."""
    return ((zw >> ((n % 8) * 4)) & 0xF).to(gl.float32) + ZERO_OFFSET


@gluon.jit
def _tile_words(qw_ptr, t, n, r, n_mask, n_tiles, stride_qk):
    """Tile t's words ([splits, cols, 16], A's layout). A tile past the last reads tile 0
    instead: it is in bounds, and its activations are 0."""
    t = gl.where(t < n_tiles, t, 0)
    return gl.load(qw_ptr + (t * 16 + r) * stride_qk + n, mask=n_mask)


@gluon.jit
def _tile_params(s_ptr, z_ptr, t, n, n_mask, n_tiles, stride_sg, stride_zg, GROUP_TILES: gl.constexpr):
    """The scales and zero words of tile t's group for columns n (tile 0 past the last)."""
    g = gl.where(t < n_tiles, t, 0) // GROUP_TILES
    return (gl.load(s_ptr + g * stride_sg + n, mask=n_mask, other=0.0),
            gl.load(z_ptr + g * stride_zg + n // 8, mask=n_mask, other=0))


@gluon.jit
def _scaled_planes(words, s, zw, n, ZERO_OFFSET: gl.constexpr):
    """The tile's 8 planes, (q - z) s in bf16 (the scale rounded to bf16 first, as a
    dequantized checkpoint has it), in the words' layout. s, zw: [splits, cols, 1]."""
    off = 0.0 - (_zero_points(zw, n, ZERO_OFFSET) + 128.0)  # -(MAGIC_F + z)
    offw, _ = gl.broadcast(off.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF, words)
    sw, _ = gl.broadcast(s.to(gl.float32).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF, words)
    return gl.inline_asm_elementwise(_MAGIC_SUB_SCALED_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                     [words, offw, sw], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)


@gluon.jit
def _x_plane(x_rows, k, m_mask, K, EVEN_K: gl.constexpr):
    """Input rows k of the batch (B's layout; 0 past K and past the batch)."""
    if EVEN_K:
        return gl.load(x_rows + k, mask=m_mask, other=0.0)
    return gl.load(x_rows + k, mask=m_mask & (k < K), other=0.0)


@gluon.jit
def _mma_w4a16(x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, M, N, K, n_tiles, tiles_per_split,
               stride_xm, stride_qk, stride_sg, stride_zg, stride_cm,
               ZERO_OFFSET: gl.constexpr, GROUP_TILES: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_M: gl.constexpr, EVEN_K: gl.constexpr, ROW_SUMS: gl.constexpr, PDL: gl.constexpr,
               num_warps: gl.constexpr):
    """out[:, pid's BLOCK_N columns]; warp w adds up tiles w * tiles_per_split onwards.

    ROW_SUMS: the planes go to the tensor cores as MAGIC_F + q (a mask and a byte permute
    per two weights, no FMA), and per tile acc += s (sum x (MAGIC_F + q) - (MAGIC_F + z)
    sum x), the activations' sums made by one more mma a plane with a matrix of ones.
    Fewer instructions a weight; a float32 multiply-add per output instead of a bf16
    rounding per weight (measured faster with 32 columns a program, slower with 16)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    SPLITS: gl.constexpr = num_warps
    n0 = gl.program_id(0) * BLOCK_N
    # A side [splits, cols, 16]: split, column, word row of the tile
    t_first = _along0(SPLITS, a_l) * tiles_per_split
    na = n0 + _along1(BLOCK_N, a_l)
    ra = _along2(16, a_l)
    na_mask = na < N
    # B side [splits, 16, rows]: split, input row within the plane, batch row
    mb = _along2(BLOCK_M, b_l)
    x_rows = x_ptr + mb * stride_xm
    m_mask = mb < M
    kb = _along0(SPLITS, b_l) * (tiles_per_split * _TILE_K) + _along1(16, b_l)  # the split's first input rows
    acc = gl.zeros((SPLITS, BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma)
    # the scales and zero points: per column of A, or per row of the accumulator
    p_l: gl.constexpr = mma if ROW_SUMS else a_l
    t_p = _along0(SPLITS, p_l) * tiles_per_split
    n_p = n0 + _along1(BLOCK_N, p_l)
    ones = gl.full((SPLITS, BLOCK_N, 16), 1.0, gl.bfloat16, layout=a_l)  # ROW_SUMS only
    # each tile's words are loaded two tiles ahead, its scales and zero points one
    s, zw = _tile_params(s_ptr, z_ptr, t_p, n_p, n_p < N, n_tiles, stride_sg, stride_zg, GROUP_TILES)
    cur = _tile_words(qw_ptr, t_first, na, ra, na_mask, n_tiles, stride_qk)
    nxt = _tile_words(qw_ptr, t_first + 1, na, ra, na_mask, n_tiles, stride_qk)
    if PDL:  # the first words are asked for; the activations are the previous kernel's output
        x_rows += gl.inline_asm_elementwise(_PDL_WAIT_ASM, "=r,r", [mb], dtype=gl.int32, is_pure=False, pack=1) * 64
        gl.inline_asm_elementwise(_PDL_LAUNCH_DEPENDENTS_ASM, "=r,r", [mb], dtype=gl.int32, is_pure=False, pack=1)
    for j in range(tiles_per_split):
        far = _tile_words(qw_ptr, t_first + j + 2, na, ra, na_mask, n_tiles, stride_qk)
        s_next, zw_next = _tile_params(s_ptr, z_ptr, t_p + j + 1, n_p, n_p < N, n_tiles, stride_sg, stride_zg,
                                       GROUP_TILES)
        k0 = kb + j * _TILE_K
        if ROW_SUMS:
            planes = gl.inline_asm_elementwise(_MAGIC_ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [cur],
                                               dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
            part = gl.zeros((SPLITS, BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma)
            sums = gl.zeros((SPLITS, BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma)
            for p in gl.static_range(8):
                xp = _x_plane(x_rows, k0 + p * 16, m_mask, K, EVEN_K)
                part = mma_v2(planes[p], xp, part)
                sums = mma_v2(ones, xp, sums)
            acc += s.to(gl.float32) * (part - (_zero_points(zw, n_p, ZERO_OFFSET) + 128.0) * sums)
        else:
            planes = _scaled_planes(cur, s, zw, na, ZERO_OFFSET)
            for p in gl.static_range(8):
                acc = mma_v2(planes[p], _x_plane(x_rows, k0 + p * 16, m_mask, K, EVEN_K), acc)
        cur = nxt
        nxt = far
        s = s_next
        zw = zw_next
    out = gl.sum(acc, axis=0)  # [cols, rows]: the splits added in order, through shared memory
    o_l: gl.constexpr = gl.SliceLayout(0, mma)
    on = n0 + gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_l)), 1)
    om = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_l)), 0)
    gl.store(c_ptr + om * stride_cm + on, out.to(gl.bfloat16), mask=(on < N) & (om < M))


@functools.lru_cache(maxsize=8)
def available(device_index: int) -> bool:
    """A Hopper GPU: the card the kernel was measured on."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(x: torch.Tensor, k: int, group_size: int, bits: int) -> bool:
    """The kernel's scope (see the module docstring)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and bits == 4 and 1 <= x.shape[0] <= MAX_ROWS
            and (group_size % TILE_K == 0 or group_size >= k) and available(x.device.index or 0))


def pick_config(n: int, k: int, num_sms: int) -> tuple[int, int, bool]:
    """(columns a program, warps = K splits a program, ROW_SUMS), from Llama-2-7B's
    linears at one row on an H200 (benchmarks/results, 'mma_sweep'): 32 columns, the
    fewest warps that make about 10 a SM (qkv 4, gate_up 2, o and down 8), never more
    warps than tiles of K; row sums for long inputs (faster for down, the longest; every
    other linear was slower with them)."""
    programs = triton.cdiv(n, 32)
    warps = next((w for w in (2, 4) if programs * w >= 10 * num_sms), 8)
    while warps > 1 and warps > triton.cdiv(k, TILE_K):
        warps //= 2
    return 32, warps, k >= 8192


def mma_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
              group_size: int, zero_offset: int, num_sms: int,
              config: tuple[int, int, bool] | None = None) -> torch.Tensor:
    """x [M, K] bf16 (M <= 8) @ dequant(qweight) -> [M, N] bf16; qweight in the tiled
    layout, rows already in x's column order (act-order callers gather x first)."""
    m, k = x.shape
    n = qweight.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"the mma kernel takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n, warps, row_sums = config or pick_config(n, k, num_sms)
    n_tiles = triton.cdiv(k, TILE_K)
    per = triton.cdiv(n_tiles, warps)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    group_tiles = group_size // TILE_K if group_size < k else n_tiles
    _mma_w4a16[(triton.cdiv(n, block_n),)](
        x, qweight, scales, qzeros, out, m, n, k, n_tiles, per,
        x.stride(0), qweight.stride(0), scales.stride(0), qzeros.stride(0), out.stride(0),
        ZERO_OFFSET=zero_offset, GROUP_TILES=group_tiles, BLOCK_N=block_n, BLOCK_M=8,
        EVEN_K=k % TILE_K == 0 and n_tiles % warps == 0, ROW_SUMS=row_sums, num_warps=warps,
        **pdl.kernel_options(x))
    return out
