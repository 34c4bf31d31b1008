"""Triton functions the MoE kernels share (fused_moe.py and skinny_moe.py): a token's router
softmax and top k, and an expert's activation. One copy, so that skinny_moe's routing inside
its gate|up kernel picks the experts and weights fused_moe's _route_kernel picks, and both
paths apply the same activation."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernels
    triton = None

if triton is not None:

    @triton.jit
    def router_probs(Logits, E, EB: tl.constexpr):
        """One token's router softmax in float32 over EB slots (Logits: its row), the slots
        past E at -1 so that top k never takes them, and the slot indices."""
        eb = tl.arange(0, EB)
        x = tl.load(Logits + eb, mask=eb < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        return tl.where(eb < E, p, -1.0), eb

    @triton.jit
    def take_best(left, eb, EB: tl.constexpr):
        """The largest probability in `left`, its expert (the lowest index among ties), and
        `left` without it: one step of top k."""
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, eb, EB), 0)
        return best, idx, tl.where(eb == idx, -1.0, left)

    @triton.jit
    def expert_activation(gate, up, alpha, limit, SWIGLU: tl.constexpr):
        """An expert's silu(gate) * up in float32, or (SWIGLU) gpt-oss's clamped SwiGLU:
        (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
        if SWIGLU:
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            out = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        else:
            out = gate / (1.0 + tl.exp(-gate)) * up
        return out
