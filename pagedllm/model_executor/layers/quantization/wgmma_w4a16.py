"""Hopper (sm_90) W4A16 kernel for many rows (large decode batches, prefill), in Gluon.

Why a second kernel: from 128 rows on, the Triton path dequantized the weights into a
16-bit scratch buffer and let cuBLAS multiply. That pass writes and reads back four times
the packed bytes, which left it well behind bf16 at 256 rows. Here the weights go from
their packed words to the tensor cores without leaving the registers:

- Swap-AB: acc[BLOCK_N, BLOCK_M] = W^T tile @ x^T tile. The weights are wgmma's A
  operand, which may live in registers; the activations are the B operand in shared memory.
- The packed words are loaded straight into A's register layout. With k_width=2 a thread
  holds input rows (2t, 2t+1) and (2t+8, 2t+9) of each 16 at two columns; in the tiled layout
  (packing.tile_rows) those are word rows 2t, 2t+1, 2t+8, 2t+9 of the tile, and one word
  holds a column's values for all 8 planes (16-row steps) of the 128-row tile. So the
  magic-sub PTX of triton_w4a16 makes the 8 planes' fragments, (q - z) s in bf16, with no
  shuffle: the weights a dequantized checkpoint holds.
- The activations come by TMA: two [BLOCK_M, 64] boxes a tile (128-byte swizzle), one
  mbarrier a stage. Per-thread copies (cp.async) cost more issue slots than the
  dequantization, and were slower.
- The 8 wgmma of tile i run asynchronously while tile i + 1 is dequantized; words and
  scales are loaded two tiles ahead.
- 64 x 128 tiles, one warpgroup and two stages: three programs share an SM, so one's
  dequantization overlaps another's MMAs. Problems with too few tiles (4096-wide
  outputs) are split along K into float32 partials that a second kernel adds up.

Scope: 4-bit weights, bf16 activations, groups a multiple of 128 rows (or one group),
K a multiple of 8 (TMA strides). Everything else takes triton_w4a16's paths."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pagedllm.model_executor.layers.quantization.triton_w4a16 import _MAGIC_SUB_SCALED_BF16

TILE_K = 128  # input rows per tile: 8 planes of 16
BLOCK_N, BLOCK_M, STAGES, WARPS = 64, 128, 2, 4
PROGRAMS_PER_SM = 3  # 64 KB of shared memory and 157 registers a thread each
MAX_SPLIT = 4


@gluon.jit
def _group_params(s_ptr, z_ptr, g, offs_n, n_mask, stride_sg, stride_zg, EVEN_N: gl.constexpr):
    """Group g's fp16 scales and packed zero words for the columns offs_n."""
    if EVEN_N:
        s = gl.load(s_ptr + g * stride_sg + offs_n)
        zw = gl.load(z_ptr + g * stride_zg + offs_n // 8)
    else:
        s = gl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0)
        zw = gl.load(z_ptr + g * stride_zg + offs_n // 8, mask=n_mask, other=0)
    return s, zw


@gluon.jit
def _load_words(w_ptrs, t, stride_qk, n_mask, EVEN_N: gl.constexpr):
    """Tile t's packed words, in the A operand's layout."""
    if EVEN_N:
        return gl.load(w_ptrs + t * 16 * stride_qk)
    return gl.load(w_ptrs + t * 16 * stride_qk, mask=n_mask[:, None], other=0)


@gluon.jit
def _tile_planes(words, s, zw, offs_n, ZERO_OFFSET: gl.constexpr):
    """The tile's 8 planes, (q - z) s in bf16 (the scale rounded to bf16 first, as a
    dequantized checkpoint has it), in the words' layout."""
    z = ((zw >> ((offs_n % 8) * 4)) & 0xF).to(gl.float32) + ZERO_OFFSET
    off = 0.0 - (z + 128.0)  # -(MAGIC_F + z)
    offw, _ = gl.broadcast((off.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF)[:, None], words)
    sw, _ = gl.broadcast((s.to(gl.float32).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF)[:, None],
                         words)
    return gl.inline_asm_elementwise(_MAGIC_SUB_SCALED_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                     [words, offw, sw], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)


@gluon.jit
def _load_x(x_desc, bar, xs, slot, row, t, pred):
    """Tile t's activations (two [BLOCK_M, 64] boxes) into stage `slot`, signalling `bar`."""
    mbarrier.expect(bar, 2 * x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [row, t * 128], bar, xs.index(2 * slot), pred=pred)
    tma.async_copy_global_to_shared(x_desc, [row, t * 128 + 64], bar, xs.index(2 * slot + 1), pred=pred)


@gluon.jit
def _wgmma_w4a16(x_desc, qw_ptr, s_ptr, z_ptr, c_ptr, M, N, tiles_per_split, n_tiles,
                 stride_qk, stride_sg, stride_zg, stride_cm, stride_cs,
                 ZERO_OFFSET: gl.constexpr, GROUP_TILES: gl.constexpr, EVEN_N: gl.constexpr,
                 SPLIT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    t0 = pid_k * tiles_per_split
    count = gl.minimum(n_tiles - t0, tiles_per_split)  # >= 1: the host makes no empty split
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    offs_r = gl.arange(0, 16, layout=gl.SliceLayout(0, a_l))
    n_mask = offs_n < N
    w_ptrs = qw_ptr + offs_r[None, :] * stride_qk + offs_n[:, None]  # qweight[word row, column]
    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2, BLOCK_M, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    row = pid_m * BLOCK_M
    for j in gl.static_range(STAGES - 1):
        _load_x(x_desc, bars.index(j), xs, j, row, t0 + j, j < count)
    last = t0 + count - 1
    words = _load_words(w_ptrs, t0, stride_qk, n_mask, EVEN_N)
    s, zw = _group_params(s_ptr, z_ptr, t0 // GROUP_TILES, offs_n, n_mask, stride_sg, stride_zg, EVEN_N)
    t1 = gl.minimum(t0 + 1, last)  # past the end: a harmless in-bounds reload
    words_next = _load_words(w_ptrs, t1, stride_qk, n_mask, EVEN_N)
    s_next, zw_next = _group_params(s_ptr, z_ptr, t1 // GROUP_TILES, offs_n, n_mask, stride_sg, stride_zg, EVEN_N)
    planes = _tile_planes(words, s, zw, offs_n, ZERO_OFFSET)
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma)
    for j in range(count):
        nxt = j + STAGES - 1
        gl.thread_barrier()  # every warp is past its wait on the stage about to be refilled
        _load_x(x_desc, bars.index(nxt % STAGES), xs, nxt % STAGES, row, t0 + nxt, nxt < count)
        cur = j % STAGES
        mbarrier.wait(bars.index(cur), (j // STAGES) & 1)
        lo = xs.index(2 * cur)
        hi = xs.index(2 * cur + 1)
        acc = warpgroup_mma(planes[0], lo.slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[1], lo.slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[2], lo.slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[3], lo.slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[4], hi.slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[5], hi.slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[6], hi.slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(planes[7], hi.slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
        # while the tensor cores work: tile j + 2's words and scales out, tile j + 1 dequantized
        far = gl.minimum(t0 + j + 2, last)
        words_far = _load_words(w_ptrs, far, stride_qk, n_mask, EVEN_N)
        s_far, zw_far = _group_params(s_ptr, z_ptr, far // GROUP_TILES, offs_n, n_mask, stride_sg, stride_zg,
                                      EVEN_N)
        planes_next = _tile_planes(words_next, s_next, zw_next, offs_n, ZERO_OFFSET)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(acc, planes[0], planes[1], planes[2], planes[3],
                                                           planes[4], planes[5], planes[6], planes[7]))
        acc = done[0]
        planes = planes_next
        words_next = words_far
        s_next = s_far
        zw_next = zw_far
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))
    # acc is out^T [BLOCK_N, BLOCK_M]: stored transposed, each thread down a column of out
    out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                           warps_per_cta=[1, num_warps], order=[0, 1])
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_l))
    ptrs = c_ptr + pid_k * stride_cs + om[None, :] * stride_cm + on[:, None]
    mask = (on < N)[:, None] & (om < M)[None, :]
    if SPLIT:
        gl.store(ptrs, gl.convert_layout(acc, out_l), mask=mask)
    else:
        gl.store(ptrs, gl.convert_layout(acc.to(gl.bfloat16), out_l), mask=mask)


@triton.jit
def _sum_splits(p_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = the float32 partials [SPLIT, total] added in a fixed order, rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=8)
def available(device_index: int) -> bool:
    """A Hopper GPU (wgmma, TMA): the kernel's only target."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(x: torch.Tensor, k: int, group_size: int, bits: int) -> bool:
    """The kernel's scope (see the module docstring)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and bits == 4 and k % 8 == 0
            and (group_size % TILE_K == 0 or group_size >= k) and available(x.device.index or 0))


def pick_split(m: int, n: int, k: int, num_sms: int) -> int:
    """K splits so that a wave of PROGRAMS_PER_SM programs an SM is about full: Llama-2-7B's
    4096-wide outputs at 256 rows make 128 tiles, one program an SM without a split, and a
    lone warpgroup leaves its tensor cores idle while it dequantizes."""
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, BLOCK_M)
    return max(1, min(MAX_SPLIT, PROGRAMS_PER_SM * num_sms // tiles, triton.cdiv(k, TILE_K) // 8))


def wgmma_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                group_size: int, zero_offset: int, num_sms: int, split: int | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ dequant(qweight) -> [M, N] bf16; qweight in the tiled layout, rows
    already in x's column order (act-order callers gather x first)."""
    m, k = x.shape
    n = qweight.shape[1]
    if not (x.stride(1) == 1 and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0):
        x = x.clone(memory_format=torch.contiguous_format)  # TMA: 16-byte aligned rows
    n_tiles = triton.cdiv(k, TILE_K)
    split = split or pick_split(m, n, k, num_sms)
    per = triton.cdiv(n_tiles, split)
    split = triton.cdiv(n_tiles, per)  # no empty split
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_M, 64], layout)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M), split)
    group_tiles = group_size // TILE_K if group_size < k else n_tiles
    _wgmma_w4a16[grid](x_desc, qweight, scales, qzeros, target, m, n, per, n_tiles,
                       qweight.stride(0), scales.stride(0), qzeros.stride(0), target.stride(-2),
                       m * n if split > 1 else 0, ZERO_OFFSET=zero_offset, GROUP_TILES=group_tiles,
                       EVEN_N=n % BLOCK_N == 0, SPLIT=split > 1, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
                       STAGES=STAGES, num_warps=WARPS)
    if split > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](target, out, m * n, SPLIT=split, BLOCK=block, num_warps=4)
    return out
