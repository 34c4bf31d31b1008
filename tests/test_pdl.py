"""Programmatic dependent launch: a quantized linear placed while the kernel before it
still runs reads that kernel's output of this step, never an older one. GPU tests (sm_90
and a Triton that launches with PDL); run on the lent H200:

    python -m pytest -q tests/test_pdl.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from w4a16_reference import random_layer

from pagedllm.model_executor.layers.quantization.packing import dequantize, tile_rows

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def on_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    from pagedllm import pdl

    if not pdl.launch(torch.empty(1, device="cuda")):
        pytest.skip("this Triton cannot launch with PDL (or PAGEDLLM_PDL=0)")


def _check_replays(step, x: torch.Tensor, gen: torch.Generator, reference, what: str) -> None:
    """Capture `step` in a CUDA graph, then three times: new random values into x, replay,
    and compare the graph's output with reference() (float64)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"relative error {err:.2e}: {what}"


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)) * w.double()


@pytest.mark.parametrize("primary", ["rms_norm", "silu_and_mul"])
@pytest.mark.parametrize(("m", "group_size", "act_order"), [
    (1, 128, False),  # mma_w4a16 (Gluon)
    (1, 64, True),    # the Triton GEMV
    (5, 128, False),  # the Triton planes kernel
    (16, 64, True),
])
def test_linear_reads_this_replays_output_of_the_kernel_before(on_hopper, primary, m, group_size, act_order):
    """A CUDA graph of [RMSNorm or SiLU-and-mul over 32768 rows] -> [4-bit linear of the
    last m rows], replayed with new inputs. The rows the linear reads are written by the
    first kernel's last programs, long after the linear was placed (the first kernel lets
    it be placed at its start): a linear that read them before its wait would see the
    previous replay's rows, and its product would be the product of other inputs."""
    from pagedllm.model_executor.layers import fused_ops
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    rows, k, n = 32768, 4096, 2048
    t, gs = random_layer(k, n, group_size, 4, 1, act_order, seed=m + group_size)
    w = dequantize(t["qweight"], t["qzeros"], t["scales"], gs, 4, 1, t["perm"]).double()
    tiled = tile_rows(t["qweight"], 4, tw.tile_k_for(4))
    perm = t["perm"]
    gen = torch.Generator(device="cuda").manual_seed(m)
    width = k if primary == "rms_norm" else 2 * k
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5

    def step() -> torch.Tensor:
        h = fused_ops.rms_norm(x, norm_w, 1e-5) if primary == "rms_norm" else fused_ops.silu_and_mul(x)
        return tw.wna16_matmul(h[-m:], tiled, t["scales"], t["qzeros"], perm, gs, 4, 1)

    def reference() -> torch.Tensor:
        last = x[-m:]
        h = _rms_ref(last, norm_w, 1e-5) if primary == "rms_norm" else F.silu(last[:, :k].double()) * last[:, k:].double()
        return h.to(torch.bfloat16).double() @ w.t()

    _check_replays(step, x, gen, reference, "the linear read rows of another replay")


@pytest.mark.parametrize(("m", "group_size"), [(1, 128), (16, 128), (4, 64)])
def test_kernel_after_a_linear_reads_this_replays_product(on_hopper, m, group_size):
    """[4-bit gate_up linear, 22016 wide] -> [SiLU-and-mul], in a CUDA graph replayed with
    new inputs. The linear lets the SiLU kernel be placed at its start, and that kernel
    waits for it: it must multiply this replay's product, not the last one's."""
    from pagedllm.model_executor.layers import fused_ops
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    k, n = 4096, 22016
    t, gs = random_layer(k, n, group_size, 4, 1, False, seed=m)
    w = dequantize(t["qweight"], t["qzeros"], t["scales"], gs, 4, 1, None).double()
    tiled = tile_rows(t["qweight"], 4, tw.tile_k_for(4))
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step() -> torch.Tensor:
        return fused_ops.silu_and_mul(tw.wna16_matmul(x, tiled, t["scales"], t["qzeros"], None, gs, 4, 1))

    def reference() -> torch.Tensor:
        y = x.double() @ w.t()
        return F.silu(y[:, : n // 2]) * y[:, n // 2 :]

    _check_replays(step, x, gen, reference, "SiLU-and-mul read another replay's product")


def test_off_switch(monkeypatch):
    """PAGEDLLM_PDL=0 launches every kernel plainly; CPU tensors never use PDL."""
    from pagedllm import pdl

    assert not pdl.launch(torch.empty(1))
    if torch.cuda.is_available():
        monkeypatch.setenv("PAGEDLLM_PDL", "0")
        assert not pdl.launch(torch.empty(1, device="cuda"))
        assert pdl.kernel_options(torch.empty(1, device="cuda")) == {"PDL": False}
