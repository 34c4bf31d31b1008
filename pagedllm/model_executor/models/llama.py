"""One parametrised decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, GLM, Gemma 2/3,
Phi-3/Phi-4), also serving the remote-code families of models/remote_code.py (InternLM,
Baichuan, Qwen v1, ChatGLM).

They differ only in switches: what the architecture fixes comes from its entry in
models/architectures.py (bias on q/k/v for Qwen2, per-head q/k RMSNorm for Qwen3,
interleaved-pair rotary for GLM, extra norms after each sublayer for GLM-4-0414 and Gemma,
Gemma's (1 + w) RMSNorm and scaled embeddings, checkpoint names to map or cut apart),
what a checkpoint decides from its config (bias on every attention projection, Llama
`attention_bias`; an explicit head_dim; tied embeddings; the rope scaling; partial rotary;
ALiBi instead of rotary, Baichuan-13B `alibi`; sliding-window layers and their own rope,
Gemma 3; the attention scale `query_pre_attn_scalar`; tanh soft-capping of attention
scores and of the final logits, Gemma 2; the MLP activation). ModelShape merges the two once.
q/k/v and gate/up are fused into single matmuls; the loader fills the fused weights shard by
shard. Every linear layer is one family (layers/linear.py): its parallel style is chosen
here, its storage (float, GPTQ/AWQ, GGUF-packed) by the checkpoint's QuantConfig. Under
tensor parallelism every rank builds the same modules over its own heads and slices, and
each layer cuts its part out of the full checkpoint tensors.

The model sees one flat batch of tokens and an attention-metadata object; it knows nothing
of requests, blocks or the scheduler.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import batch_invariant
from pagedllm.attention import AttentionMetadata
from pagedllm.attention.page_spec import PageSpec, common_page_spec
from pagedllm.distributed import get_tp_rank, get_tp_world_size
from pagedllm.model_executor.layers import fused_ops
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.norm import RMSNorm
from pagedllm.model_executor.layers.parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_logits,
)
from pagedllm.model_executor.layers.quantization import QuantConfig
from pagedllm.model_executor.layers.rotary import (
    RotaryEmbedding,
    per_layer_type_rope,
    rope_parameters,
)
from pagedllm.model_executor.layers.sharding import (
    ShardedWeights,
    head_partition,
    read_block,
    rows,
    shape_of,
)
from pagedllm.model_executor.models.architectures import arch_spec


class ModelShape:
    """The numbers and switches a decoder layer needs: the architecture's spec merged with
    the checkpoint's config, once."""

    def __init__(self, config, architecture: str, quant: QuantConfig | None = None):
        self.spec = spec = arch_spec(architecture)
        self.quant = quant  # the linear layers' storage format; None: float
        self.hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        self.intermediate = config.intermediate_size
        self.eps = getattr(config, "rms_norm_eps", 1e-6)
        self.vocab = config.vocab_size
        self.num_layers = config.num_hidden_layers
        self.tie_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        attn_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_bias = spec.qkv_bias or attn_bias or bool(getattr(config, "qkv_bias", False))
        self.o_bias = attn_bias and spec.attention_bias_on_o
        self.sandwich_norm = spec.sandwich_norm
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qk_norm = spec.qk_norm
        # Gemma names its activation `hidden_activation`
        self.hidden_act = (getattr(config, "hidden_activation", None)
                           or getattr(config, "hidden_act", None) or "silu")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}")
        self.gemma_norm = spec.gemma_norm
        self.embed_scale = self.hidden**0.5 if spec.embed_scale else None
        scalar = getattr(config, "query_pre_attn_scalar", None)  # Gemma: the scale's own number
        self.attn_scale = (scalar if scalar else self.head_dim) ** -0.5
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None) or None
        self.final_softcap = getattr(config, "final_logit_softcapping", None) or None
        if getattr(config, "use_bidirectional_attention", False):  # embedding models (EmbeddingGemma)
            raise NotImplementedError("use_bidirectional_attention (EmbeddingGemma's windows seen both "
                                      "ways): not supported; `is_causal: false` (gte-Qwen2) is")
        # Bidirectional attention (every input token sees every other): embedding models that
        # say `is_causal: false` (gte-Qwen2), served by the pooling runner, which reads each
        # input whole in one step (load_model_config keeps other runners causal).
        self.causal = getattr(config, "is_causal", True) is not False
        packed = quant is not None and not (quant.method == "fp8" and quant.checkpoint_format == "float")
        if spec.fused_checkpoint and packed:
            # packed qkv_proj / gate_up_proj split along their output columns, not rows: untested
            # (float rows quantized to FP8 at load split as float ones do)
            raise NotImplementedError(f"quantized {architecture} checkpoints are not supported "
                                      "(float weights only; quantization='fp8' at load works)")
        # transformers 5 moved partial_rotary_factor into rope_parameters
        rotary_pct = (getattr(config, "partial_rotary_factor", None)
                      or rope_parameters(config).get("partial_rotary_factor") or 1.0)
        self.rotary_dim = int(self.head_dim * rotary_pct)
        self.rotary_interleaved = spec.rotary_interleaved or bool(getattr(config, "rotary_interleaved", False))
        self.alibi = bool(getattr(config, "alibi", False))
        self.layer_windows = sliding_windows(config)
        # Per layer, whose rope it rotates with: its layer type where local and global
        # layers have their own (Gemma 3), else None (one rope for all).
        kinds = getattr(config, "layer_types", None) or [None] * self.num_layers
        self.layer_rope = list(kinds) if per_layer_type_rope(config) else [None] * self.num_layers
        # Tensor parallelism: from here on num_heads / num_kv_heads / intermediate are this
        # rank's (what its KV cache and attention kernels see); the totals size the checkpoint.
        self.tp_size = tp = get_tp_world_size()
        self.total_num_heads, self.total_num_kv_heads = self.num_heads, self.num_kv_heads
        self.head_start, self.num_heads = head_partition(self.num_heads, get_tp_rank(), tp,
                                                         "num_attention_heads")
        _, self.num_kv_heads = head_partition(self.num_kv_heads, get_tp_rank(), tp,
                                              "num_key_value_heads", replicate=True)
        self.total_intermediate = self.intermediate
        self.intermediate = self.intermediate // tp  # divisibility checked by the layers


def sliding_windows(config) -> list[int | None]:
    """Per layer, how many past positions a query sees (itself included), or None for all:
    transformers' `sliding_window`, on every layer (Mistral, Mixtral) or on the layers that
    `layer_types` marks "sliding_attention" (Qwen2/Qwen3 with use_sliding_window)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return [int(window)] * n
    return [int(window) if kind == "sliding_attention" else None for kind in kinds]


# config activation name -> elementwise function (gate side of the gated MLP)
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma
}


class Attention(nn.Module):
    def __init__(self, s: ModelShape, rotary: RotaryEmbedding, backend, window: int | None = None):
        super().__init__()
        self.s = s
        self.window = window
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        # split by heads, not evenly by rows: KV heads may be replicated
        self.qkv_proj = ColumnParallelLinear.qkv(s.hidden, s.total_num_heads, s.total_num_kv_heads,
                                                 s.head_dim, s.qkv_bias, s.quant)
        self.o_proj = RowParallelLinear(s.total_num_heads * s.head_dim, s.hidden, s.o_bias, s.quant)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.eps, gemma=s.gemma_norm)
            self.k_norm = RMSNorm(s.head_dim, s.eps, gemma=s.gemma_norm)
        self.rotary = rotary
        self.backend = backend
        self.scale = s.attn_scale
        # Only passed when set, so backends without soft-capping keep their signature.
        self.extra = {"logits_soft_cap": s.attn_softcap} if s.attn_softcap else {}
        if not s.causal:
            if backend is not None and not getattr(backend, "supports_bidirectional", False):
                raise NotImplementedError(f"bidirectional attention (is_causal: false) needs an "
                                          f"attention backend with it; {backend.name!r} has none")
            if window is not None:
                raise NotImplementedError("bidirectional attention with a sliding window")
            self.extra["causal"] = False
        if s.attn_softcap and backend is not None and not getattr(backend, "supports_softcap", False):
            raise NotImplementedError(f"attention logit soft-capping (Gemma 2) needs an attention "
                                      f"backend with it; {backend.name!r} has none")
        # what a token costs in this layer's pages: K and V of this rank's KV heads
        self.page_spec = PageSpec.full_kv(s.num_kv_heads, s.head_dim)
        # An fp8 KV cache stores k / k_scale and v / v_scale (the checkpoint's, else 1.0).
        self.k_scale = 1.0
        self.v_scale = 1.0
        if window is not None and s.alibi:
            raise NotImplementedError("ALiBi with a sliding window")
        self.sinks = None
        if s.spec.attention_sinks:  # every head's, replicated; a rank reads its own heads'
            if backend is not None and not getattr(backend, "supports_sinks", False):  # None: sizing only
                raise NotImplementedError(f"attention sinks (gpt-oss) need an attention backend with "
                                          f"sinks; {backend.name!r} has none")
            self.sinks = nn.Parameter(torch.empty(s.total_num_heads))
        if s.alibi and not getattr(backend, "supports_alibi", False):
            raise NotImplementedError(
                f"ALiBi models (Baichuan-13B) need an attention backend with ALiBi; "
                f"{backend.name!r} has none")

    takes_keep = True  # forward(keep=...) returns the kept rows alone (DecoderLayer)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata, keep: torch.Tensor | None = None):
        """`keep` (the last layer's AttentionMetadata.keep_rows): return those rows alone.
        Every row's keys and values still go to the pages; with meta.keep_meta and causal
        attention only the kept rows attend (as decodes over the pages), else all do and
        the output projection takes the kept rows. An empty `keep` (a step that samples
        nothing: a long prompt's earlier chunks) writes the keys and values and stops."""
        s = self.s
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        norms = None
        if s.qk_norm:
            if not s.alibi and self.rotary.can_fuse_norm(q):  # one kernel: norm, then rotate
                norms = (self.q_norm, self.k_norm)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        extra = dict(self.extra, k_scale=self.k_scale, v_scale=self.v_scale)
        if not s.alibi:
            q, k = self.rotary(positions, q, k, norms)
            extra["sliding_window"] = self.window
            if self.sinks is not None:
                extra["sinks"] = self.sinks[s.head_start : s.head_start + s.num_heads]
        else:
            extra["alibi_slopes"] = self.rotary.alibi_slopes[s.head_start : s.head_start + s.num_heads]  # this rank's heads
        if keep is not None and (keep.numel() == 0 or (meta.keep_meta is not None and s.causal)):
            # all keys and values to the pages; then nothing more (a step that samples
            # nothing), or the kept rows attend alone, as decodes
            self.backend.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, self.k_scale, self.v_scale)
            if keep.numel() == 0:
                return qkv.new_empty((0, s.hidden))
            q, k, v = (t.index_select(0, keep) for t in (q, k, v))
            meta, keep = meta.keep_meta, None
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **extra)
        o = o.reshape(-1, self.q_size)
        return self.o_proj(o if keep is None else o.index_select(0, keep))


# Fused checkpoint tensors (Phi-3): [q | k | v] rows and [gate | up] rows.
_FUSED = re.compile(r"(.+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")
# Per-layer fp8 KV-cache scales as checkpoints name them.
# (ModelOpt writes k_proj.k_scale / v_proj.v_scale, its older exports *_proj.output_scale)
_KV_SCALE = re.compile(r"(.+\.self_attn)\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale"
                       r"|k_proj\.k_scale|v_proj\.v_scale)$")


class MLP(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.inter = s.intermediate
        full = s.total_intermediate
        self.gate_up_proj = ColumnParallelLinear(s.hidden, {"gate": full, "up": full}, s.mlp_bias, s.quant)
        self.down_proj = RowParallelLinear(full, s.hidden, s.mlp_bias, s.quant)
        self.silu = s.hidden_act in ("silu", "swish")  # the fused kernel's activation
        self.act = ACTIVATIONS[s.hidden_act]

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.silu and fused_ops.available(gate_up):
            if self.down_proj.takes_fp8_rows(gate_up.shape[0]):  # quantized for the FP8 product as it is made
                return self.down_proj(fused_ops.silu_and_mul_quant(gate_up))
            return self.down_proj(fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(batch_invariant.elementwise(self.act, gate) * up)


def _takes_fp8_rows(module: nn.Module, name: str, rows: int) -> bool:
    """Whether `module.<name>` is a linear layer that takes an Fp8Rows right now."""
    layer = getattr(module, name, None)
    return layer is not None and layer.takes_fp8_rows(rows)


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, rotary, backend, window: int | None = None):
        super().__init__()
        self.self_attn = Attention(s, rotary, backend, window)
        self.mlp = MLP(s)
        g = s.gemma_norm
        self.input_layernorm = RMSNorm(s.hidden, s.eps, gemma=g)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps, gemma=g)
        self.sandwich_norm = s.sandwich_norm
        if s.sandwich_norm:
            self.post_self_attn_layernorm = RMSNorm(s.hidden, s.eps, gemma=g)
            self.post_mlp_layernorm = RMSNorm(s.hidden, s.eps, gemma=g)

    def forward(self, positions, x, residual, kv_cache, meta, keep: torch.Tensor | None = None):
        """`keep`: the rows whose output is read (the last layer's, AttentionMetadata.keep_rows);
        every row still writes its keys and values, only these go through the MLP (and,
        where the attention takes `keep`, through its queries and output projection)."""
        quant = fused_ops.available(x) and x.dim() == 2  # norms hand FP8 layers e4m3 rows
        qkv_quant = quant and _takes_fp8_rows(self.self_attn, "qkv_proj", x.shape[0])
        if residual is None:
            residual = x
            h = self.input_layernorm(x, quant=qkv_quant)
        else:
            h, residual = self.input_layernorm(x, residual, quant=qkv_quant)
        if keep is None:
            h = self.self_attn(positions, h, kv_cache, meta)
        elif getattr(self.self_attn, "takes_keep", False):
            h, residual = self.self_attn(positions, h, kv_cache, meta, keep), residual.index_select(0, keep)
        else:
            h = self.self_attn(positions, h, kv_cache, meta)
            h, residual = h.index_select(0, keep), residual.index_select(0, keep)
        if h.shape[0] == 0:  # no row is read (keep empty): no MLP
            return h, residual
        if self.sandwich_norm:  # normed before the (fused) residual add of the next norm
            h = self.post_self_attn_layernorm(h)
        mlp_quant = quant and isinstance(self.mlp, MLP) and _takes_fp8_rows(self.mlp, "gate_up_proj", h.shape[0])
        h, residual = self.post_attention_layernorm(h, residual, quant=mlp_quant)
        h = self.mlp(h)
        if self.sandwich_norm:
            h = self.post_mlp_layernorm(h)
        return h, residual


class DecoderModel(nn.Module):
    def __init__(self, s: ModelShape, rotaries: dict[str | None, RotaryEmbedding], backend,
                 layers: list[nn.Module] | None = None):
        """`layers`: decoder layers of another kind (models/deepseek.py), else Llama's, each
        with the rotary table of its layer type."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(s.vocab, s.hidden)
        if layers is None:
            layers = [DecoderLayer(s, rotaries[kind], backend, w)
                      for w, kind in zip(s.layer_windows, s.layer_rope, strict=True)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(s.hidden, s.eps, gemma=s.gemma_norm)
        self.embed_scale = s.embed_scale
        self._embed_scales: dict[torch.dtype, float] = {}

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: sqrt(hidden) rounded to the dtype first, as HF
            scale = self._embed_scales.get(x.dtype)
            if scale is None:
                scale = self._embed_scales[x.dtype] = float(torch.tensor(self.embed_scale, dtype=x.dtype))
            x = x * scale
        residual = None
        last = len(self.layers) - 1
        keep = getattr(meta, "keep_rows", None)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i == last and keep is not None:  # then the hidden states of `keep` alone
                x, residual = layer(positions, x, residual, cache, meta, keep)
            else:
                x, residual = layer(positions, x, residual, cache, meta)
        if x.shape[0] == 0:  # keep_rows empty: the step's keys and values were all it needed
            return x
        x, _ = self.norm(x, residual)
        return x


# The first name part of a base model's tensors (saved without the `model.` prefix).
_BASE_MODEL_PARTS = frozenset({"embed_tokens", "layers", "norm"})


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2/Gemma3 and
    Phi3ForCausalLM."""

    # checkpoint name fragment -> (our fused module fragment, shard)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, config, architecture: str, max_positions: int, backend,
                 quant: QuantConfig | None = None):
        super().__init__()
        self.shape = s = ModelShape(config, architecture, quant)
        # one rope table per kind of layer that has its own (Gemma 3 local/global), else one
        rotaries = {kind: RotaryEmbedding(config, s.head_dim, s.rotary_dim, max_positions,
                                          interleaved=s.rotary_interleaved,
                                          alibi_heads=s.total_num_heads if s.alibi else 0,
                                          layer_type=kind)
                    for kind in dict.fromkeys(s.layer_rope)}
        self.model = DecoderModel(s, rotaries, backend)
        self.rotary = next(iter(rotaries.values()))  # registered once, shared by its layers
        self.rotaries = nn.ModuleList(rotaries.values())  # every table the loader builds
        if not s.tie_embeddings:
            # A quantized head (GPTQModel's lm_head=true) is a linear layer split by output
            # rows, each rank's logits gathered; a float one is split by vocabulary rows
            # like the embedding (padded, layers/parallel.py).
            self.lm_head = (ColumnParallelLinear(s.hidden, s.vocab, False, quant, gather_output=True)
                            if quant and quant.lm_head else ParallelLMHead(s.vocab, s.hidden))

    @property
    def page_spec(self) -> PageSpec:
        """What one token costs in the page pool, as the attention layers say."""
        return common_page_spec(layer.self_attn.page_spec for layer in self.model.layers)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (each rank computes its vocabulary slice),
        soft-capped to (-cap, cap) by cap * tanh(logits / cap) where the config says so (Gemma 2)."""
        if self.shape.tie_embeddings:  # the embedding's slice is the head's slice
            logits = gather_logits(batch_invariant.linear(hidden, self.model.embed_tokens.weight),
                                   self.shape.vocab)
        else:
            logits = self.lm_head(hidden)
        cap = self.shape.final_softcap
        if cap:
            logits = (batch_invariant.elementwise(torch.tanh, logits.float() / cap) * cap).to(logits.dtype)
        return logits

    def load_weights(self, weights) -> None:
        """Fill parameters from (checkpoint name, tensor) pairs in HF naming. Sharded
        modules (every linear layer, the embedding and the head) take their tensors whole
        and keep their rank's block, through their weight method for the linear layers; a
        tensor may be a lazy safetensors slice, of which only that block is read. The
        remaining parameters (norms) are replicated and copied whole.

        Embedding checkpoints saved as a base model (names without `model.`, no
        `lm_head`) load too: a missing head is the embedding's copy, so the model still
        runs its logits (such a checkpoint serves embeddings; its text means nothing)."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        head = None if self.shape.tie_embeddings else modules.get("lm_head")
        head_loaded = False
        for name, tensor in self._checkpoint_names(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.shape.tie_embeddings:
                continue
            if name.split(".", 1)[0] in _BASE_MODEL_PARTS:
                name = f"model.{name}"
            if name.startswith("lm_head."):
                head_loaded = True
            elif (name == "model.embed_tokens.weight" and not head_loaded
                  and isinstance(head, ParallelLMHead)):
                head.load_shard("weight", None, tensor)  # stands in until a head comes
            if (kv := _KV_SCALE.match(name)) and isinstance(modules.get(kv[1]), Attention):
                # fp8 KV scales (compressed-tensors' kv_cache_scheme, ModelOpt's, older output_scale)
                value = float(read_block(tensor).float().reshape(-1)[0])
                attn = modules[kv[1]]
                if kv[2] in ("k_scale", "kv_scale", "k_proj.output_scale", "k_proj.k_scale"):
                    attn.k_scale = value
                if kv[2] in ("v_scale", "kv_scale", "v_proj.output_scale", "v_proj.v_scale"):
                    attn.v_scale = value
                continue
            target, shard = self._checkpoint_target(name)
            module_name, _, param_name = target.rpartition(".")
            module = modules.get(module_name)
            if isinstance(module, ShardedWeights):
                try:
                    module.load_shard(param_name, shard, tensor)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            p = params[target]
            if tuple(p.shape) != shape_of(tensor):
                raise ValueError(f"{name}: checkpoint shape {shape_of(tensor)} != {tuple(p.shape)}")
            p.data.copy_(read_block(tensor))  # replicated (norms): the whole tensor
            loaded.add(target)
        sharded = {n: m for n, m in modules.items() if isinstance(m, ShardedWeights)}
        missing = [f"{n}.{piece}" for n, m in sharded.items() for piece in m.missing()]
        for name, module in modules.items():
            if name in sharded or getattr(module, "checks_own_loading", False):
                continue  # e.g. MoE expert stacks (models/moe.py), filled piece by piece
            missing += [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)
                        if f"{name}.{p}" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
        for module in sharded.values():
            module.finish_loading()

    def _checkpoint_names(self, weights):
        """The architecture's checkpoint naming made ours (architectures.py): prefixes of
        a multimodal wrapper mapped, parts not served skipped, fragments renamed, fused
        q/k/v and gate/up tensors cut into their shards (rows, lazily: a rank reads only
        its own part)."""
        spec, s = self.shape.spec, self.shape
        q, kv = s.total_num_heads * s.head_dim, s.total_num_kv_heads * s.head_dim
        for name, tensor in weights:
            if name.startswith(spec.ignore_prefixes):
                continue
            for old, new in spec.prefixes:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            for old, new in spec.renames:
                if old in name:
                    name = name.replace(old, new)
                    break
            if spec.fused_checkpoint and (m := _FUSED.match(name)):
                base, kind, param = m[1], m[2], m[3]
                if kind == "self_attn.qkv_proj":
                    cuts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
                else:
                    half = shape_of(tensor)[0] // 2
                    cuts = {"gate_proj": (0, half), "up_proj": (half, 2 * half)}
                for piece, (lo, hi) in cuts.items():
                    owner = "self_attn" if kind == "self_attn.qkv_proj" else "mlp"
                    yield f"{base}.{owner}.{piece}.{param}", rows(tensor, lo, hi)
                continue
            yield name, tensor

    def _checkpoint_target(self, name: str) -> tuple[str, str | None]:
        """(our parameter name, fused shard) of a checkpoint tensor: q/k/v and gate/up go
        to their fused layer as shards, packed tensors (`.qweight`, ...) keep their names."""
        for frag, (fused, shard) in self.stacked_params.items():
            if frag in name:
                return name.replace(frag, fused), shard
        return name, None
