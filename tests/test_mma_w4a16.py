"""The Hopper one-row kernel (mma_w4a16) equals dequantize-then-matmul, and wna16_matmul
hands it the products in its scope. Skipped without a GPU; the kernel tests also need an
sm_90 GPU. Run on the lent H200:

    python -m pytest -q tests/test_mma_w4a16.py
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
        pytest.skip("the kernel is built and measured for sm_90")
    from pagedllm.model_executor.layers.quantization import mma_w4a16

    return mma_w4a16


@pytest.fixture
def calls(kernel, monkeypatch):
    """The shapes and configurations the kernel was called with."""
    seen = []
    real = kernel.mma_w4a16

    def spy(x, qweight, *a, **kw):
        seen.append(tuple(x.shape))
        return real(x, qweight, *a, **kw)

    monkeypatch.setattr(kernel, "mma_w4a16", spy)
    return seen


@pytest.mark.parametrize(("k", "n"), [(4096, 12288), (4096, 1000), (2752, 1024), (11008, 512), (128, 8192)])
@pytest.mark.parametrize(("group_size", "act_order", "zero_offset"), [
    (128, False, 1), (128, True, 0), (256, False, 0), (-1, True, 1),
])
def test_one_row_matches_dequantized_matmul(calls, k, n, group_size, act_order, zero_offset):
    """The built-in choice at one row: N not a multiple of the block (1000), K not a
    multiple of the tile (2752: the last tile half empty), splits of uneven length (11008:
    86 tiles over 8 warps, and the row-sums variant), one tile only (128: one warp), groups of one and two tiles and one group, act-order, both zero offsets."""
    if group_size > 0 and k % group_size:
        pytest.skip("K not a multiple of the group size")
    check_kernel(1, k, n, group_size, act_order, zero_offset=zero_offset, seed=k + n + group_size)
    assert calls == [(1, k)], "wna16_matmul did not take the Hopper kernel"


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("config", [(16, 8, False), (16, 8, True), (32, 4, True), (32, 2, False), (64, 2, True),
                                    (16, 1, False)])
def test_every_configuration_gives_the_product(kernel, m, config):
    """Each tile shape, number of warps (K splits) and way to the weights, up to 8 rows;
    K of 9 tiles with groups of 128 (splits of 2, 3 and 5 tiles, the last ones short)."""
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    k, n = 1152, 640
    t, gs = random_layer(k, n, 128, 4, 1, False, seed=m)
    w = dequantize(t["qweight"], t["qzeros"], t["scales"], gs, 4, 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
    ref = x.double() @ w.double().t()
    tiled = tile_rows(t["qweight"], 4, tw.tile_k_for(4))
    out = kernel.mma_w4a16(x, tiled, t["scales"], t["qzeros"], gs, 1, 132, config)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.bfloat16 and out.shape == (m, n) and err < 1e-2, f"relative error {err:.2e}"


def test_replays_in_a_cuda_graph(kernel, calls):
    """Captured in a CUDA graph (the engine's decode), the kernel reads the activations'
    buffer at replay: new values give the eager product, bit for bit."""
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    t, gs = random_layer(4096, 12288, 128, 4, 1, False, seed=3)
    tiled = tile_rows(t["qweight"], 4, tw.tile_k_for(4))
    run = lambda x: tw.wna16_matmul(x, tiled, t["scales"], t["qzeros"], None, gs, 4, 1)  # noqa: E731
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    run(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(x))
    assert calls == [(1, 4096)] * 3


def test_out_of_scope_products_take_the_other_paths(calls):
    """fp16 activations, groups smaller than a tile, 8-bit weights and two rows or more
    keep the Triton kernels."""
    check_kernel(1, 1024, 528, 128, False, dtype=torch.float16)
    check_kernel(1, 1024, 528, 64, False)
    check_kernel(1, 1024, 528, 128, False, bits=8)
    check_kernel(2, 1024, 528, 128, False)
    assert calls == []


def test_configuration_rule(kernel):
    """Llama-2-7B's linears on 132 SMs get the configurations measured fastest at one row;
    a K of one tile gets one warp."""
    assert kernel.pick_config(12288, 4096, 132) == (32, 4, False)  # qkv
    assert kernel.pick_config(22016, 4096, 132) == (32, 2, False)  # gate_up
    assert kernel.pick_config(4096, 4096, 132) == (32, 8, False)  # o
    assert kernel.pick_config(4096, 11008, 132) == (32, 8, True)  # down
    assert kernel.pick_config(4096, 128, 132) == (32, 1, False)
