"""Programmatic dependent launch (PDL, sm_90 on) for the decode step's own kernels.

A decode step at small batch is a chain of about ten short kernels a layer, each reading
what the one before wrote. Launched plainly, a kernel is placed only when the one before
has drained, then computes its addresses and sends its first loads: time, every kernel,
in which the memory does nothing. Launched with PDL (`launch(x)`), a kernel is
placed while the one before still runs, once that one has said so
(`griddepcontrol.launch_dependents`, which every kernel here says at its start), and
waits (`griddepcontrol.wait`: the kernel before has finished and its writes are
visible) before it touches memory the step writes. mma_w4a16 loads its first weights
before it waits, the one thing no kernel of the step writes.

Which kernels launch so was measured on Llama-2-7B's decode step (the figures are in
benchmarks/results): the norms, rotary, the KV write, attention, SiLU-and-mul and
mma_w4a16, which made the step faster in 4-bit and in bf16. The Triton W4A16 kernels only
let the next kernel be placed: launched with PDL themselves they were slower, their
pipelined loads cannot be put before the wait. L2 prefetches of the first tiles before the
wait were slower too.

Captured CUDA graphs keep the launch attribute, so the replayed step overlaps the same
way. PAGEDLLM_PDL=0 turns it off (every kernel then launches as before).

The wait's result is a 0 (to the compiler a multiple of 64) that a kernel adds to the
pointers it reads the step's data through: those loads then depend on the wait, and no
compiler can move them above it, and the pointers keep their alignment (without the 64
the loads lost their vector width, and the step was much slower)."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these kernels
    triton = None


@functools.lru_cache(maxsize=1)
def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=8)
def _device_has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch(x: torch.Tensor) -> bool:
    """Whether kernels working on `x` launch with PDL: a CUDA device of compute capability
    9.0 or newer, a Triton that can launch so, and PAGEDLLM_PDL not 0."""
    return (x.is_cuda and triton is not None and os.environ.get("PAGEDLLM_PDL", "1") != "0"
            and _device_has_pdl(x.device.index or 0) and _triton_launches_pdl())


def kernel_options(x: torch.Tensor) -> dict:
    """A waiting kernel's launch arguments, from one `launch(x)`: its PDL constexpr and,
    when true, Triton's launch option."""
    return {"PDL": True, "launch_pdl": True} if launch(x) else {"PDL": False}


if triton is not None:
    # PTX for tl/gl.inline_asm_elementwise (constexpr: jitted code reads no other globals)
    WAIT_ASM = tl.constexpr("griddepcontrol.wait;\n\tmov.u32 $0, 0;")
    LAUNCH_DEPENDENTS_ASM = tl.constexpr("griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;")

    @triton.jit
    def wait():
        """Wait for the kernel before this one (all its writes visible); returns 0, which
        the compiler only knows to be a multiple of 64: added to a pointer it keeps the
        pointer's alignment (else the loads through it lose their vector width)."""
        return tl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1) * 64

    @triton.jit
    def launch_dependents():
        """Let the next kernel in the stream be placed now (it still waits for this one)."""
        tl.inline_asm_elementwise(LAUNCH_DEPENDENTS_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
