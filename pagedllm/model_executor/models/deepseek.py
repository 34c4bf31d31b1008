"""DeepSeek-V2 and DeepSeek-V3 (transformers' `DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`): multi-head latent attention (MLA) over latent pages, and
Mixture-of-Experts layers with shared experts and DeepSeek's routing.

Attention. q comes from hidden states directly (`q_proj`, V2-Lite: `q_lora_rank` null)
or through a low-rank bottleneck (`q_a_proj` -> RMSNorm -> `q_b_proj`, V2/V3); K and V
come from one compressed latent per token (`kv_a_proj_with_mqa` -> kv_lora_rank values,
normed, plus qk_rope_head_dim values of a rope key shared by all heads). The page pool
holds that latent (kv_lora_rank + qk_rope_head_dim values a token a layer; the layer's
`page_spec`) instead of K and V per head: for V2-Lite 576 values where full K/V would
need 16 heads x (192 + 128) = 5120. attention/mla.py computes over it: prefill chunks
decompress the context through `kv_b_proj`, decodes absorb its two halves into the
query and the output. The rope part uses transformers' YaRN tables with DeepSeek's
`mscale` / `mscale_all_dim`: the cos/sin scaled by mscale / mscale_all_dim, the softmax
scale by mscale_all_dim squared; on interleaved pairs (V3: unless `rope_interleave` is
false).

MLP. Dense on the first `first_k_dense_replace` layers and off the `moe_layer_freq`
step; elsewhere `n_routed_experts` experts (models/moe.py's expert stacks, fused kernels
on CUDA) routed as layers/moe_routing.py says, plus `n_shared_experts` experts fused into
one always-on MLP. The router weights (and V3's score-correction bias) stay float32, as
transformers keeps them.

Tensor parallelism: query heads split over the ranks (q_proj / q_b_proj / kv_b_proj by
heads, o_proj by input), the latent projections replicated, so every rank's pages hold
the same latents for its own heads to read; experts split as in models/moe.py.

Not served: quantized checkpoints (the absorbed decode reads kv_b_proj as float), V3's
multi-token-prediction layer (its tensors are skipped: it only drafts), the
batch-invariant mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.mla import mla_forward
from pagedllm.attention.page_spec import PageSpec
from pagedllm.distributed import all_reduce, get_tp_rank, get_tp_world_size
from pagedllm.model_executor.layers import moe_routing
from pagedllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.model_executor.layers.norm import RMSNorm
from pagedllm.model_executor.layers.parallel import ParallelLMHead
from pagedllm.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model_executor.layers.sharding import head_partition
from pagedllm.model_executor.models.llama import MLP, DecoderLayer, DecoderModel, ModelShape
from pagedllm.model_executor.models.moe import MoeForCausalLM, SparseMoeBlock

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's default, not rms_norm_eps


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale(config, qk_head_dim: int) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN: the
    non-rotary dims are corrected too (the rotary ones also get it through cos/sin)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config)
    if params["rope_type"] not in ("default", None) and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class MlaShape(ModelShape):
    """ModelShape plus the MLA ranks and head sizes, and this rank's heads."""

    def __init__(self, config, architecture: str):
        super().__init__(config, architecture)
        self.q_lora_rank = getattr(config, "q_lora_rank", None) or None
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.attention_bias = bool(getattr(config, "attention_bias", False))
        self.rotary_interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config, self.qk_head_dim)
        # every query head has its own K/V out of the latent: they split like query heads
        self.head_start, self.num_heads = head_partition(self.total_num_heads, get_tp_rank(),
                                                         self.tp_size, "num_attention_heads")
        self.num_kv_heads = self.num_heads  # for kernels that tile by query group: one each


class MlaAttention(nn.Module):
    def __init__(self, s: MlaShape, rotary: RotaryEmbedding, kernels: bool = False):
        super().__init__()
        self.s = s
        self.kernels = kernels  # Triton latent write and decode (attention/mla_triton.py) on CUDA
        h0, nh = s.head_start, s.num_heads

        def by_heads(in_features: int, per_head: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(in_features, s.total_num_heads * per_head, False,
                                        parts={None: (h0 * per_head, nh * per_head)})

        if s.q_lora_rank is None:
            self.q_proj = by_heads(s.hidden, s.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(s.hidden, s.q_lora_rank, s.attention_bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = by_heads(s.q_lora_rank, s.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(s.hidden, s.kv_lora_rank + s.qk_rope_head_dim,
                                                   s.attention_bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = by_heads(s.kv_lora_rank, s.qk_nope_head_dim + s.v_head_dim)
        self.o_proj = RowParallelLinear(s.total_num_heads * s.v_head_dim, s.hidden, s.attention_bias)
        self.rotary = rotary
        # what a token costs in this layer's pages: the latent and the rope key, for all heads
        self.page_spec = PageSpec.latent(s.kv_lora_rank + s.qk_rope_head_dim)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        s = self.s
        t = x.shape[0]
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, s.num_heads, s.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.reshape(t, 1, s.qk_rope_head_dim).contiguous())
        latent = torch.cat((c, k_pe.reshape(t, s.qk_rope_head_dim)), dim=-1)
        # kv_b_proj's rows, per head: qk_nope_head_dim of W_UK then v_head_dim of W_UV
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = w.split([s.qk_nope_head_dim, s.v_head_dim], dim=1)
        o = mla_forward(q_nope, q_pe, latent, kv_cache[0], meta, s.scale, w_uk, w_uv, self.kernels)
        return self.o_proj(o.reshape(t, s.num_heads * s.v_head_dim))


class Router(nn.Module):
    """The router's float32 weight (and V3's score-correction bias), as transformers keeps
    them whatever the model's dtype: routing decides by small score differences."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
                                        if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


class DeepseekMoe(SparseMoeBlock):
    """Routed experts (the shared stacks and kernels) + DeepSeek routing + always-on
    shared experts (one MLP n_shared_experts times as wide, no gate)."""

    def __init__(self, s: MlaShape, config):
        num_experts = config.n_routed_experts
        super().__init__(s, num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                         norm_topk_prob=False, weights_in_fp32=True)
        self.routing = moe_routing.RoutingSpec.from_config(config, num_experts)
        self.gate = Router(s.hidden, num_experts, self.routing.method == "noaux_tc")
        self.shared_experts = None
        if n_shared := getattr(config, "n_shared_experts", None):
            self.shared_experts = MLP(_mlp_shape(s, config.moe_intermediate_size * n_shared))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moe_routing.route(self.gate(x), self.routing, self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.run_experts(x, weights, ids)
        if get_tp_world_size() > 1:
            out = all_reduce(out)
        if self.shared_experts is not None:  # its row-parallel down_proj already summed the ranks
            out = out + self.shared_experts(x)
        return out


def _mlp_shape(s: MlaShape, intermediate: int) -> ModelShape:
    import copy

    shape = copy.copy(s)
    shape.total_intermediate = intermediate
    shape.intermediate = intermediate // s.tp_size  # divisibility checked by the layers
    return shape


class MlaDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer (its forward) around latent attention and a dense or MoE MLP."""

    def __init__(self, s: MlaShape, rotary, mlp: nn.Module, kernels: bool = False):
        nn.Module.__init__(self)
        self.self_attn = MlaAttention(s, rotary, kernels)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.sandwich_norm = False


def is_moe_layer(config, i: int) -> bool:
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return (bool(getattr(config, "n_routed_experts", 0))
            and i >= (getattr(config, "first_k_dense_replace", 0) or 0) and i % freq == 0)


class DeepseekForCausalLM(MoeForCausalLM):
    """Serves DeepseekV2ForCausalLM and DeepseekV3ForCausalLM. The Llama loader (through
    MoeForCausalLM's expert routing) fills it; only gate/up are fused here."""

    stacked_params = {
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, config, architecture: str, max_positions: int, backend, quant=None):
        if quant is not None:
            raise ValueError(f"quantized {architecture} checkpoints are not supported "
                             "(float weights only)")
        if getattr(backend, "name", "") in ("batch_invariant", "triton_invariant"):
            raise NotImplementedError(f"{architecture}: the batch-invariant mode has no multi-head "
                                      "latent attention (its decodes are batched by length)")
        nn.Module.__init__(self)
        # With the Triton attention backend (CUDA), the MLA decodes and latent writes run in
        # Triton too and read nothing from the host: decode steps can be CUDA graphs. With
        # the torch one, decodes gather pages by host-known lengths: not capturable.
        self.graph_safe = bool(getattr(backend, "graph_safe", False))
        self.prefill_graph_safe = False  # its prefill chunks are laid out from host lengths
        self.shape = s = MlaShape(config, architecture)
        rotary = RotaryEmbedding(config, s.qk_rope_head_dim, s.qk_rope_head_dim, max_positions,
                                 interleaved=s.rotary_interleaved)
        self.model = DecoderModel(s, rotary, backend, [
            MlaDecoderLayer(s, rotary, DeepseekMoe(s, config) if is_moe_layer(config, i) else MLP(s),
                            kernels=self.graph_safe)
            for i in range(s.num_layers)])
        self.rotary = rotary
        if not s.tie_embeddings:
            self.lm_head = ParallelLMHead(s.vocab, s.hidden)

    def load_weights(self, weights) -> None:
        """V3 checkpoints carry a multi-token-prediction layer after the last one
        (`model.layers.<num_hidden_layers>.*`): skipped."""
        n = self.shape.num_layers

        def served(name: str) -> bool:
            if name.startswith("model.layers."):
                return int(name.split(".")[2]) < n
            return True

        super().load_weights((name, t) for name, t in weights if served(name))
