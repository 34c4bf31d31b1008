"""The Hopper many-row kernel (wgmma_w4a16) equals dequantize-then-matmul, and
wna16_matmul hands it the products in its scope. Skipped without a GPU; the kernel
tests also need an sm_90 GPU. Run on the lent H200:

    python -m pytest -q tests/test_wgmma_w4a16.py
"""

from __future__ import annotations

import pytest
import torch
from w4a16_reference import check_kernel, random_layer

from pagedllm.model_executor.layers.quantization.packing import dequantize, tile_rows

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernel():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma and TMA need an sm_90 GPU")
    from pagedllm.model_executor.layers.quantization import wgmma_w4a16

    return wgmma_w4a16


@pytest.fixture
def calls(kernel, monkeypatch):
    """The shapes the Hopper kernel was called with."""
    seen = []
    real = kernel.wgmma_w4a16

    def spy(x, *a, **kw):
        seen.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(kernel, "wgmma_w4a16", spy)
    return seen


@pytest.mark.parametrize("m", [128, 200, 256, 513])
@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (4096, 1376), (2752, 1024), (11008, 512)])
@pytest.mark.parametrize(("group_size", "act_order", "zero_offset"), [
    (128, False, 1), (128, True, 0), (256, False, 0), (-1, True, 1),
])
def test_many_rows_match_dequantized_matmul(calls, m, k, n, group_size, act_order, zero_offset):
    """Row tails (200, 513: TMA fills past the last row with zeros), N not a multiple of
    the block (1376), K not a multiple of the tile (2752: the last tile half empty), groups
    of one and two tiles and one group, act-order (x gathered first), both zero offsets,
    and K splits (4096-wide and narrower outputs have few tiles)."""
    if group_size > 0 and k % group_size:
        pytest.skip("K not a multiple of the group size")
    check_kernel(m, k, n, group_size, act_order, zero_offset=zero_offset, seed=m + k + n + group_size)
    assert calls == [(m, k)], "wna16_matmul did not take the Hopper kernel"


@pytest.mark.parametrize("split", [1, 2, 3, 4])
def test_every_split_gives_the_product(kernel, split):
    """However K is split (here 9 tiles: splits of 9, 5+4, 3+3+3, 3+3+3 after dropping an
    empty fourth), the float32 partials add up to the product."""
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    k, n, m = 1152, 640, 300
    t, gs = random_layer(k, n, 128, 4, 1, False, seed=split)
    w = dequantize(t["qweight"], t["qzeros"], t["scales"], gs, 4, 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
    ref = x.double() @ w.double().t()
    tiled = tile_rows(t["qweight"], 4, tw.tile_k_for(4))
    out = kernel.wgmma_w4a16(x, tiled, t["scales"], t["qzeros"], gs, 1, 132, split=split)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.bfloat16 and err < 1e-2, f"relative error {err:.2e}"


def test_replays_in_a_cuda_graph_and_takes_unaligned_rows(kernel, calls):
    """Captured in a CUDA graph (the engine's decode), the kernel reads the activations'
    buffer at replay: new values give the eager product, bit for bit (K split included).
    Rows that do not start 16 bytes apart (a column slice) are copied for TMA first."""
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    t, gs = random_layer(4096, 1024, 128, 4, 1, False, seed=3)
    tiled = tile_rows(t["qweight"], 4, tw.tile_k_for(4))
    run = lambda x: tw.wna16_matmul(x, tiled, t["scales"], t["qzeros"], None, gs, 4, 1)  # noqa: E731
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    run(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(x))
    wide = torch.randn(256, 4100, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(run(wide[:, 3:4099]), run(wide[:, 3:4099].contiguous()))
    assert all(shape[0] == 256 for shape in calls) and len(calls) == 5


def test_out_of_scope_products_take_the_other_paths(calls):
    """fp16 activations, groups smaller than a tile and 8-bit weights keep the dequantize +
    cuBLAS path; below 128 rows the Triton kernels run."""
    check_kernel(256, 1024, 528, 128, False, dtype=torch.float16)
    check_kernel(256, 1024, 528, 64, False)
    check_kernel(256, 1024, 528, 128, False, bits=8)
    check_kernel(100, 1024, 528, 128, False)
    assert calls == []


def test_split_rule_fills_one_wave(kernel):
    """Llama-2-7B on 132 SMs: the 4096-wide outputs at 256 rows (128 tiles) are split in
    three, the wide ones (qkv, gate_up) are not; never more than MAX_SPLIT, and every
    split has at least 8 tiles of K."""
    assert kernel.pick_split(256, 4096, 4096, 132) == 3
    assert kernel.pick_split(256, 4096, 11008, 132) == 3
    assert kernel.pick_split(256, 12288, 4096, 132) == 1
    assert kernel.pick_split(256, 22016, 4096, 132) == 1
    assert kernel.pick_split(128, 1024, 4096, 132) == kernel.MAX_SPLIT
    assert kernel.pick_split(128, 1024, 1024, 132) == 1
