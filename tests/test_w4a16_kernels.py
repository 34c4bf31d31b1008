"""The W4A16 kernels on small problems, against dequantize-then-matmul: each of the three
paths (GEMV, planes, dequantize + matmul), 2/4/8-bit, act-order, partial groups, and K
split several ways, where the split that finishes last adds the partials and resets its
counter. Small enough for Triton's CPU interpreter.

Runs on CUDA; with TRITON_INTERPRET=1 and Triton installed it also runs on the CPU."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEV, INTERPRET  # first: skips this module without CUDA or the interpreter
from w4a16_reference import check_kernel

from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

FP = torch.float16  # bf16 products are wrong in Triton's interpreter; fp16 ones are right


def _config(m: int, k: int, split: int, block_n: int = 32) -> dict:
    kps = -(-k // split // 128) * 128
    return dict(gemv=m == 1, planes=m > 1, BLOCK_M=16, BLOCK_N=block_n, num_warps=4, num_stages=2,
                split=-(-k // kps), k_per_split=kps)


@pytest.mark.parametrize(("m", "k", "n", "group_size", "act_order", "bits", "zero_offset"), [
    (1, 512, 72, 128, False, 4, 1),  # GEMV, one tile per group
    (1, 800, 72, 48, True, 4, 0),  # GEMV, groups smaller than a tile, K not a tile multiple
    (1, 1024, 40, 64, False, 8, 1),
    (1, 512, 48, 128, True, 2, 0),
    (3, 800, 72, 48, True, 4, 1),  # planes
    (7, 1024, 40, 128, True, 8, 1),
    (2, 512, 48, -1, False, 2, 0),
    (17, 512, 40, 32, False, 4, 1),
    (130, 512, 40, 128, True, 4, 1),  # dequantize + matmul
    (130, 800, 72, 48, False, 8, 0),
])
def test_each_path_matches_dequantized_matmul(m, k, n, group_size, act_order, bits, zero_offset):
    check_kernel(m, k, n, group_size, act_order, bits, zero_offset, torch.float32, seed=m + k + n, device=DEV)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("split", [1, 2, 3, 8])
def test_split_k_is_added_in_the_same_launch(m, split):
    """Splits of uneven length (the last one short); the counters are back to zero after
    every launch, so the next product starts clean."""
    cfg = _config(m, 1000, split)
    assert cfg["split"] == split
    for seed in (0, 1):  # twice: the second launch reuses the counters the first one left
        check_kernel(m, 1000, 40, 128, act_order=m > 1, dtype=torch.float32, seed=seed, device=DEV, config=cfg)
        assert int(tw.counters(torch.device(DEV)).abs().sum()) == 0


def test_dequantize_in_chunks_of_equal_width():
    """600 columns through a scratch chunk of at most 256 columns: three products of 256,
    256 and 88 columns (widths rounded to the dequantizing block), each in its place."""
    cfg = dict(gemv=False, planes=False, dequant=True, chunk_elements=512 * 256)
    check_kernel(130, 512, 600, 128, False, 4, 1, torch.float32, seed=5, device=DEV, config=cfg)
    check_kernel(130, 512, 600, 64, True, 4, 0, FP, seed=6, device=DEV, config=cfg)


def test_half_precision_activations():
    check_kernel(5, 512, 72, 128, False, 4, 0, FP, seed=3, device=DEV)
    check_kernel(1, 512, 72, 64, True, 4, 1, FP, seed=4, device=DEV)


@pytest.mark.parametrize("unpack", [dict(magic=True), dict(magic=True, two_acc=True),
                                    dict(magic=True, fold=True), dict(magic=True, two_acc=True, fold=True),
                                    dict(magic=False, zero_in_dot=True), dict(magic=False, zero_in_dot=False)],
                         ids=["magic", "magic-two-acc", "fold", "fold-two-acc", "zero_in_dot", "fma"])
@pytest.mark.parametrize("group_size", [128, 48])
@pytest.mark.parametrize("dtype", [torch.float32, FP, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(INTERPRET, reason="the interpreter's bf16 products are wrong"))],
    ids=["fp32", "fp16", "bf16"])
def test_planes_each_way_of_unpacking_gives_the_product(unpack, group_size, dtype):
    """The tensor-core kernel's ways to the weights give the same product: 16-bit floats
    from the bits (q - z made in 16 bits when a tile lies in one group, group 128; the
    zero point and magic offset through a second product per plane, group 48), in one
    accumulator or two, the scale on each tile's partial or folded into the 16-bit weights
    (fold, with the pipelined loop); float32 values with the zero point in a second
    product; float32 q - z. fp32 activations take the float32 routes whatever the
    configuration asks."""
    cfg = {**_config(5, 800, 2), **unpack}
    check_kernel(5, 800, 72, group_size, True, 4, 1, dtype, seed=group_size, device=DEV, config=cfg)


@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize(("n", "k"), [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (72, 800)])
@pytest.mark.parametrize("sms", [132, 108, 8])
def test_small_batches_split_k_within_one_wave(m, n, k, sms):
    """Up to 16 rows the split fills one wave of 4 programs an SM and never starts a
    second (a second, nearly empty wave took almost as long as the first), at most 8
    splits, and the splits cover K in whole tiles."""
    cfg = tw.pick_config(m, n, k, 128, 4, sms)
    tiles = -(-n // cfg["BLOCK_N"])
    assert cfg["fold"] and cfg["BLOCK_M"] == 16
    assert cfg["split"] == 1 or tiles * cfg["split"] <= 4 * sms
    assert 1 <= cfg["split"] <= 8
    assert cfg["k_per_split"] % tw.tile_k_for(4) == 0
    assert (cfg["split"] - 1) * cfg["k_per_split"] < k <= cfg["split"] * cfg["k_per_split"]
    if tiles * 2 <= 4 * sms and k >= 4 * tw.tile_k_for(4):  # room for a second split: it is taken
        assert cfg["split"] >= 2
