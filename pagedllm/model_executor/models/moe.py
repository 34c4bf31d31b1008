"""Mixture-of-Experts decoders: transformers' `MixtralForCausalLM`, `Qwen2MoeForCausalLM`
and `Qwen3MoeForCausalLM`, built as the Llama decoder (llama.py) whose MLP is replaced,
in the sparse layers, by a routed block of experts.

The routing is transformers': router logits -> softmax in float32 -> top-k experts ->
(Mixtral always, Qwen when `norm_topk_prob`) the k weights renormalised to sum to one ->
sum of the chosen experts' silu(gate) * up -> down, each scaled by its weight. Qwen2-MoE
adds a shared expert scaled by sigmoid(shared_expert_gate(x)); Qwen2/3-MoE keep a dense
MLP in `mlp_only_layers` and in layers not on the `decoder_sparse_step`.

Experts are stacked into two 3-D parameters per layer. On CUDA a layer runs the fused
kernels (layers/fused_moe.py: routed pairs sorted into per-expert blocks on the device, two
grouped GEMMs), the same eagerly and inside CUDA graphs; on CPU (and in the batch-invariant
mode) a step loops over the experts that got tokens. Under tensor parallelism every expert
is split like the dense MLP (its intermediate rows over the ranks, the router
replicated), so every rank routes the same tokens to the same experts and the partial
outputs are summed by one all-reduce.

Expert parallelism (whole experts per rank, tokens exchanged all-to-all) would slot in at
`SparseMoeBlock.forward`: route, dispatch the pairs to the ranks owning their experts,
run `fused_experts` on the local experts (it already takes any subset of expert weights
with ids remapped), combine. Not built yet.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import batch_invariant
from pagedllm.distributed import all_reduce, divide, get_tp_rank, get_tp_world_size
from pagedllm.model_executor.layers import fused_moe, skinny_moe
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.sharding import read_block, shape_of
from pagedllm.model_executor.models.architectures import ARCHITECTURES
from pagedllm.model_executor.models.llama import MLP, LlamaForCausalLM, ModelShape

MOE_ARCHITECTURES = tuple(arch for arch, spec in ARCHITECTURES.items() if spec.moe is not None)

# per-expert checkpoint tensors (what save_pretrained writes): Mixtral w1/w3/w2, Qwen names
_EXPERT = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# transformers' in-memory fused layout ([E, 2I, H] gate|up and [E, H, I]), if a checkpoint has it
_FUSED = re.compile(r"(.+\.mlp)\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class Activation:
    """What an expert computes from its gate and up rows: silu(gate) * up, or gpt-oss's
    clamped SwiGLU (the gate clamped above at `limit`, up on both sides, then
    (up + 1) * gate * sigmoid(alpha * gate)), in transformers' order of operations."""

    def __init__(self, kind: str = "silu", alpha: float = 1.702, limit: float = 7.0):
        if kind not in ("silu", "clamped_swiglu"):
            raise ValueError(f"unknown expert activation {kind!r}")
        self.kind, self.alpha, self.limit = kind, float(alpha), float(limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return batch_invariant.elementwise(F.silu, gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * batch_invariant.elementwise(torch.sigmoid, gate * self.alpha))


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ the optional gated shared expert).

    `w13[e]` holds this rank's rows of expert e's gate then up projection; `w2[e]` its
    columns of the down projection. Which pieces were filled is tracked here, because the
    Llama loader only knows whole parameters."""

    checks_own_loading = True  # llama.load_weights leaves w13/w2 to `missing_pieces`

    def __init__(self, s: ModelShape, num_experts: int, top_k: int, intermediate: int,
                 norm_topk_prob: bool, weights_in_fp32: bool, shared_intermediate: int = 0,
                 activation: Activation | None = None, router_bias: bool = False,
                 expert_bias: bool = False):
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) > number of experts ({num_experts})")
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        # Mixtral scales expert outputs by the float32 weights; Qwen casts them first
        self.weights_in_fp32 = weights_in_fp32
        self.full_inter = intermediate
        self.inter = divide(intermediate, get_tp_world_size(), "moe intermediate size")
        self.start = get_tp_rank() * self.inter
        self.gate = ReplicatedLinear(s.hidden, num_experts, bias=router_bias)  # the router
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, s.hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, s.hidden, self.inter))
        self.act = activation or Activation()
        # Expert biases (gpt-oss): b13 this rank's gate then up rows; b2 the down projection's,
        # held by rank 0 only (zeros elsewhere) so that the all-reduce adds it once.
        self.b13 = self.b2 = None
        if expert_bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter))
            self.b2 = nn.Parameter(torch.empty(num_experts, s.hidden))
        self.shared_expert = None
        if shared_intermediate:
            shared = copy.copy(s)
            shared.total_intermediate = shared_intermediate
            shared.intermediate = divide(shared_intermediate, get_tp_world_size(),
                                         "shared_expert_intermediate_size")
            self.shared_expert = MLP(shared)
            self.shared_expert_gate = ReplicatedLinear(s.hidden, 1, bias=False)
        self._loaded: set[tuple[int, str]] = set()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as transformers computes them."""
        if fused_moe.available(x):  # per token in one program: batch-invariant as it is
            weights, ids = fused_moe.route(self.gate(x), self.top_k, self.norm_topk_prob)
            return (weights if self.weights_in_fp32 else weights.to(x.dtype)), ids
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_in_fp32 else weights.to(x.dtype)), ids

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate_up = batch_invariant.linear(h, self.w13[e])
        if self.b13 is not None:
            gate_up = gate_up + self.b13[e]
        gate, up = gate_up.split(self.inter, dim=-1)
        out = batch_invariant.linear(self.act(gate, up), self.w2[e])
        return out if self.b2 is None else out + self.b2[e]

    def experts_sparse(self, x, weights, ids) -> torch.Tensor:
        """Each expert runs on the tokens routed to it only (one host sync for the counts)."""
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_w = weights.flatten()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tokens = sel // self.top_k
            y = self._expert(e, x.index_select(0, tokens)) * flat_w[sel, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def experts_dense(self, x, weights, ids) -> torch.Tensor:
        """Every expert on every token, unchosen ones weighted by zero: no data-dependent
        shapes and no host sync, so a CUDA graph can capture it (decode steps)."""
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        combine.scatter_(1, ids, weights)
        gate_up = torch.einsum("th,eih->eti", x, self.w13)
        if self.b13 is not None:
            gate_up = gate_up + self.b13[:, None, :]
        gate, up = gate_up.split(self.inter, dim=-1)
        y = torch.einsum("eti,ehi->eth", self.act(gate, up), self.w2)
        if self.b2 is not None:
            y = y + self.b2[:, None, :]
        return torch.einsum("eth,te->th", y.to(combine.dtype), combine).to(x.dtype)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    config: dict | None = None, aligned: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """This rank's part of the weighted sum of the chosen experts (not yet all-reduced):
        fused kernels on CUDA, else the sparse loop (the dense form inside a CUDA graph).
        `config` / `aligned`: the tiles and the pairs route_align already laid out for them."""
        if fused_moe.available(x):
            swiglu = (self.act.alpha, self.act.limit) if self.act.kind == "clamped_swiglu" else None
            return fused_moe.fused_experts(x, self.w13, self.w2, weights, ids, config=config,
                                           invariant=batch_invariant.is_enabled(), b13=self.b13,
                                           b2=self.b2, swiglu=swiglu, aligned=aligned)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return (self.experts_dense if capturing else self.experts_sparse)(x, weights, ids)

    def _route_align_experts(self, x: torch.Tensor) -> torch.Tensor | None:
        """run_experts(x, *route(x)) with the routing and the pair alignment in one kernel
        (fused_moe.route_align), for the small steps of decoding on CUDA, or inside the
        expert kernels for one or two tokens (skinny_moe); None where it does not apply (another
        routing, more tokens, the batch-invariant mode)."""
        tokens = x.shape[0]
        if (type(self).route is not SparseMoeBlock.route or not fused_moe.available(x)
                or not 0 < tokens <= fused_moe.ROUTE_ALIGN_TOKENS or batch_invariant.is_enabled()):
            return None
        if skinny_moe.applies(x, self.w13, self.w2):  # routed inside the expert kernels
            swiglu = (self.act.alpha, self.act.limit) if self.act.kind == "clamped_swiglu" else None
            return skinny_moe.routed_experts(
                x, self.w13, self.w2, logits=self.gate(x), top_k=self.top_k, renormalise=self.norm_topk_prob,
                weights_dtype=torch.float32 if self.weights_in_fp32 else x.dtype, b13=self.b13, b2=self.b2,
                swiglu=swiglu)
        cfg = fused_moe.pick_config(tokens * self.top_k, self.num_experts, x.shape[1], self.inter, self.top_k)
        weights, ids, aligned = fused_moe.route_align(self.gate(x), self.top_k, self.norm_topk_prob, cfg["BM"],
                                                      torch.float32 if self.weights_in_fp32 else x.dtype)
        return self.run_experts(x, weights, ids, cfg, aligned)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._route_align_experts(x)
        if out is None:
            weights, ids = self.route(x)
            out = self.run_experts(x, weights, ids)
        if self.shared_expert is not None:
            # its row-parallel down_proj has already summed over the ranks
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            if get_tp_world_size() > 1:
                return all_reduce(out) + shared
            return out + shared
        return all_reduce(out) if get_tp_world_size() > 1 else out

    def load_expert(self, e: int, kind: str, tensor) -> None:
        """One checkpoint tensor of expert e (`kind` gate / up / down, full size): this
        rank's rows (gate, up) or columns (down) of it."""
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} out of range (the config has {self.num_experts})")
        full, hidden = self.full_inter, self.w13.shape[-1]
        want = (hidden, full) if kind == "down" else (full, hidden)
        if shape_of(tensor) != want:
            raise ValueError(f"expert {e} {kind}: checkpoint shape {shape_of(tensor)} != {want}")
        cut = slice(self.start, self.start + self.inter)
        with torch.no_grad():
            if kind == "down":
                self.w2[e].copy_(read_block(tensor, slice(None), cut))
            else:
                off = 0 if kind == "gate" else self.inter
                self.w13[e, off : off + self.inter].copy_(read_block(tensor, cut))
        self._loaded.add((e, kind))

    def load_expert_bias(self, e: int, kind: str, tensor) -> None:
        """One bias of expert e (`kind` gate / up / down, full size): this rank's part of
        the gate and up biases; the down bias on rank 0, zeros on the others."""
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} out of range (the config has {self.num_experts})")
        want = (self.w2.shape[1],) if kind == "down" else (self.full_inter,)
        if shape_of(tensor) != want:
            raise ValueError(f"expert {e} {kind} bias: checkpoint shape {shape_of(tensor)} != {want}")
        with torch.no_grad():
            if kind == "down":
                if get_tp_rank() == 0:
                    self.b2[e].copy_(read_block(tensor))
                else:
                    self.b2[e].zero_()
            else:
                off = 0 if kind == "gate" else self.inter
                self.b13[e, off : off + self.inter].copy_(read_block(tensor, slice(self.start, self.start + self.inter)))
        self._loaded.add((e, f"{kind}_bias"))

    def missing_pieces(self) -> list[tuple[int, str]]:
        kinds = ("gate", "up", "down")
        if self.b13 is not None:
            kinds += ("gate_bias", "up_bias", "down_bias")
        return [(e, k) for e in range(self.num_experts) for k in kinds if (e, k) not in self._loaded]


class MoeForCausalLM(LlamaForCausalLM):
    """Serves MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM."""

    def __init__(self, config, architecture: str, max_positions: int, backend, quant=None,
                 block_cls: type[SparseMoeBlock] | None = None):
        if quant is not None:
            raise ValueError(f"quantized {architecture} checkpoints are not supported "
                             "(float weights only)")
        super().__init__(config, architecture, max_positions, backend)
        s = self.shape
        moe = s.spec.moe
        num_experts, inter = getattr(config, moe.num_experts_key), getattr(config, moe.intermediate_key)
        norm = moe.renormalise if moe.renormalise is not None else bool(getattr(config, "norm_topk_prob", False))
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(config, "mlp_only_layers", None) or [])
        sparse = {i for i in range(s.num_layers)
                  if i not in dense_only and num_experts > 0 and (i + 1) % step == 0}
        act = Activation(moe.activation, getattr(config, "swiglu_alpha", 1.702),
                         getattr(config, "swiglu_limit", 7.0))
        for i in sorted(sparse):
            self.model.layers[i].mlp = (block_cls or SparseMoeBlock)(
                s, num_experts, config.num_experts_per_tok, inter, norm,
                weights_in_fp32=moe.weights_in_fp32, shared_intermediate=shared, activation=act,
                router_bias=moe.router_bias, expert_bias=moe.expert_bias)

    def _route_expert_tensors(self, weights: Iterable[tuple[str, torch.Tensor]],
                              blocks: dict[str, SparseMoeBlock]) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors go to their block; everything else on to the Llama loader."""
        for name, t in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
            if (m := _EXPERT.match(name)) and m[1] in blocks:
                blocks[m[1]].load_expert(int(m[2]), _KIND[m[3]], t)
            elif (m := _FUSED.match(name)) and m[1] in blocks:
                block, full = blocks[m[1]], read_block(t)
                for e in range(full.shape[0]):
                    if m[2] == "down_proj":
                        block.load_expert(e, "down", full[e])
                    else:
                        gate, up = full[e].chunk(2, dim=0)
                        block.load_expert(e, "gate", gate)
                        block.load_expert(e, "up", up)
            else:
                yield name, t

    def load_weights(self, weights) -> None:
        blocks = {n: m for n, m in self.named_modules() if isinstance(m, SparseMoeBlock)}
        super().load_weights(self._route_expert_tensors(weights, blocks))
        for name, block in blocks.items():
            if missing := block.missing_pieces():
                raise ValueError(f"checkpoint is missing {len(missing)} expert tensors of {name}, "
                                 f"e.g. (expert, projection) {missing[:4]}")
