"""Rotary position embeddings with the scalings Hugging Face configs describe.

The frequency tables come from transformers' own rope initialisers (llama3, linear,
dynamic, yarn, longrope), so every scaling a config can name is computed exactly as the
reference does; the rotation itself is applied here on the flat token batch.

Two scalings change with the sequence length in transformers, which a cache of rotated
keys cannot follow; each is fixed here once, from max_model_len:
- dynamic NTK keeps the unscaled frequencies up to max_position_embeddings, the most the
  engine serves for it (EngineConfig.resolve), so it equals transformers there.
- longrope (Phi-3) uses its short factors for sequences within
  original_max_position_embeddings and its long factors beyond. The engine uses the long
  ones for every sequence when max_model_len exceeds that length (as vLLM does), else the
  short ones: equal to transformers for prompts past it, and for all sequences when
  max_model_len stays within it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.model_executor.layers import fused_ops


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """Normalise transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
    (`rope_parameters`) spellings into one dict with `rope_type` and `rope_theta`.

    Gemma 3 gives its local (sliding) layers a rope of their own: transformers 5 keys
    `rope_parameters` by layer type, 4.x names a `rope_local_base_freq` (no scaling there;
    `rope_scaling` is the global layers'). `layer_type` picks one; None means the global
    ("full_attention") layers'."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # keyed by layer type
        params = dict(params.get(layer_type or "full_attention") or {})
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return {"rope_type": "default", "rope_theta": float(config.rope_local_base_freq)}
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def per_layer_type_rope(config) -> bool:
    """Whether local and global layers rotate with different frequencies (Gemma 3)."""
    nested = getattr(config, "rope_parameters", None) or {}
    if nested and all(isinstance(v, dict) for v in nested.values()):
        return True
    return bool(getattr(config, "rope_local_base_freq", None))


def inv_freq_and_scale(config, rotary_dim: int, max_positions: int,
                       layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's and longrope's attention factor)
    for a cache of `max_positions` positions."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] in ("default", None):
        base = float(params["rope_theta"])
        inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS.get(params["rope_type"])
    if fn is None:
        raise ValueError(f"unsupported rope scaling type {params['rope_type']!r}")
    # longrope's factor set is picked by this length (the module docstring says why once).
    seq_len = max_positions if params["rope_type"] == "longrope" else None
    if per_layer_type_rope(config) and not getattr(config, "rope_local_base_freq", None):
        # transformers 5: parameters per layer type, which its initialisers take by name
        inv, scale = fn(config, torch.device("cpu"), seq_len=seq_len, layer_type=layer_type or "full_attention")
    else:
        inv, scale = fn(config, torch.device("cpu"), seq_len=seq_len)
    return inv.float(), float(scale)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes m_h (Press et al.; as Baichuan-13B): a geometric series over the largest
    power of two p <= n heads, then every other member of the 2p series for the rest."""
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    slopes += [2.0 ** (-4.0 * (2 * k + 1) / p) for k in range(num_heads - p)]
    return torch.tensor(slopes, dtype=torch.float32)


class RotaryEmbedding(nn.Module):
    """Rotation on the first `rotary_dim` dims of each head: neox style (halves) by default,
    or GPT-J style (`interleaved`: pairs 2i, 2i+1, as ChatGLM/GLM) where frequency i turns
    the pair (2i, 2i+1)."""

    def __init__(self, config, head_dim: int, rotary_dim: int, max_positions: int,
                 interleaved: bool = False, alibi_heads: int = 0, layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type  # whose rope parameters (rope_parameters); None: global
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        # ALiBi models keep their per-head slopes here instead: the same one-time table
        # build, on the model's device, before any CUDA graph is captured.
        self.alibi_heads = alibi_heads
        self.register_buffer("alibi_slopes", torch.empty(0), persistent=False)
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build_tables(self, device: torch.device) -> None:
        """Fill the float32 cos/sin tables (after the model is materialised on `device`)."""
        if self.alibi_heads:
            self.alibi_slopes = alibi_slopes(self.alibi_heads).to(device)
            return
        inv, scale = inv_freq_and_scale(self.config, self.rotary_dim, self.max_positions, self.layer_type)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv)
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)

    def can_fuse_norm(self, q: torch.Tensor) -> bool:
        """Whether forward() can RMS-norm the heads in its own kernel (`norms`): on CUDA,
        neox-style, rotating the whole head."""
        return not self.interleaved and fused_ops.available(q) and self.rotary_dim == q.shape[-1]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, norms=None):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated (in place on CUDA, copies elsewhere).
        `norms` (q_norm, k_norm RMSNorm modules; only where can_fuse_norm): each head is
        normed first, in the same kernel."""
        if not self.interleaved and fused_ops.available(q):  # the kernel is neox-only
            norm = None
            if norms is not None:
                qn, kn = norms
                norm = (qn.weight, kn.weight, qn.eps, qn.gemma)
            fused_ops.rotary_(q, k, positions, self.cos, self.sin, norm)
            return q, k
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rot, rest = (x, None) if rd == x.shape[-1] else (x[..., :rd], x[..., rd:])
        if self.interleaved:
            x1, x2 = rot.float()[..., 0::2], rot.float()[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            out = out.flatten(-2).to(x.dtype)
        else:
            x1, x2 = rot.float().chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return out if rest is None else torch.cat((out, rest), dim=-1)
