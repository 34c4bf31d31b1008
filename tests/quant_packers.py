"""Test-side converters: a float Hugging Face Llama -> GPTQ / AWQ / GGUF checkpoints.

Written from the format facts (the project's format notes), in numpy and independently of
pagedllm's own unpacking, so a loader bug cannot cancel out a packer bug. Every converter
also returns the float weights the quantized checkpoint stands for (the exact
dequantization of the integers it wrote); a Hugging Face model holding those weights is
the reference that pagedllm must match.

Quantization is plain round-to-nearest per group: GPTQ's error feedback changes which
integers are chosen, not how they are stored, and storage is what a loader must get right.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Layers that read the same input share one act-order permutation (one Hessian in GPTQ).
_INPUT_OF = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
             "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down"}


@dataclass(frozen=True)
class GPTQSpec:
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    checkpoint_format: str = "gptq"  # "gptq" (v1: zeros stored minus one) | "gptq_v2"
    lm_head: bool = False
    side_file: bool = False  # AutoGPTQ style quantize_config.json instead of config.json

    def config(self) -> dict:
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "sym": self.sym, "desc_act": self.act_order, "static_groups": False,
                "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head,
                "damp_percent": 0.01, "true_sequential": True}


@dataclass(frozen=True)
class AWQSpec:
    group_size: int = 128
    not_converted: tuple[str, ...] = ()  # modules left in float (modules_to_not_convert)
    version: str = "gemm"  # "gemm" | "gemv"

    def config(self) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                "version": self.version, "modules_to_not_convert": list(self.not_converted) or None}


# ---------------------------------------------------------------------------- bit packing
def pack(vals: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Pack unsigned values along `axis`, 32/bits per int32, LSB first. With `order`,
    value k of a word holds element order[k] of its run (AWQ's interleave)."""
    per = 32 // bits
    v = np.moveaxis(np.asarray(vals, dtype=np.uint64), axis, -1)
    assert v.shape[-1] % per == 0 and v.max(initial=0) < (1 << bits)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., order]
    words = np.zeros(v.shape[:-1], dtype=np.uint64)
    for k in range(per):
        words |= v[..., k] << np.uint64(bits * k)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)


def unpack(words: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Inverse of `pack` (a second, loop-based reading of the layout, for round trips)."""
    per = 32 // bits
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    out = np.empty((*w.shape, per), dtype=np.int64)
    for k in range(per):
        col = order[k] if order is not None else k
        out[..., col] = (w >> np.uint32(bits * k)) & np.uint32((1 << bits) - 1)
    return np.moveaxis(out.reshape(*w.shape[:-1], w.shape[-1] * per), -1, axis)


# ---------------------------------------------------------------------------- GPTQ
def quantize_gptq(w: np.ndarray, spec: GPTQSpec, perm: np.ndarray | None = None
                  ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One HF weight [out, in] -> GPTQ tensors and the float weight they encode.

    With act-order, `perm` is the order columns are quantized in; group g holds the
    columns perm[g*gs:(g+1)*gs] and g_idx records it, tensors staying in column order."""
    n_out, k = w.shape
    gs = k if spec.group_size == -1 else spec.group_size
    maxq = (1 << spec.bits) - 1
    order = perm if spec.act_order else np.arange(k)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[order] = np.arange(k) // gs
    groups = -(-k // gs)
    wt = w.T.astype(np.float64)  # [in, out]
    q = np.zeros((k, n_out), dtype=np.int64)
    scales = np.zeros((groups, n_out), dtype=np.float16)
    zeros = np.zeros((groups, n_out), dtype=np.int64)
    for g in range(groups):
        rows = np.nonzero(g_idx == g)[0]
        x = wt[rows]
        lo, hi = np.minimum(x.min(0), 0), np.maximum(x.max(0), 0)
        if spec.sym:
            hi = np.maximum(-lo, hi)
            s = 2 * hi / maxq
            z = np.full(n_out, (maxq + 1) // 2)
        else:
            s = (hi - lo) / maxq
            s = np.where(s == 0, 1.0, s)
            z = np.round(-lo / s)
            if spec.checkpoint_format == "gptq":
                z = np.maximum(z, 1)  # v1 stores z - 1, which cannot be negative
        s = np.where(s == 0, 1.0, s).astype(np.float16)
        z = np.clip(z, 0, maxq).astype(np.int64)
        q[rows] = np.clip(np.round(x / s.astype(np.float64)) + z, 0, maxq)
        scales[g], zeros[g] = s, z
    deq = (q - zeros[g_idx]).astype(np.float32) * scales[g_idx].astype(np.float32)
    stored_zeros = zeros - (1 if spec.checkpoint_format == "gptq" else 0)
    tensors = {
        "qweight": pack(q, spec.bits, axis=0),
        "qzeros": pack(stored_zeros, spec.bits, axis=1),
        "scales": scales,
        "g_idx": g_idx,
    }
    return tensors, deq.T.copy()


# ---------------------------------------------------------------------------- AWQ
def quantize_awq(w: np.ndarray, spec: AWQSpec) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One HF weight [out, in] -> AWQ GEMM tensors and the float weight they encode."""
    n_out, k = w.shape
    gs = spec.group_size
    wt = w.T.astype(np.float64).reshape(k // gs, gs, n_out)
    lo, hi = wt.min(1), wt.max(1)  # [G, out]
    s = ((hi - lo) / 15).astype(np.float16)
    s = np.where(s == 0, np.float16(1), s)
    z = np.clip(-np.round(lo / s.astype(np.float64)), 0, 15).astype(np.int64)
    q = np.clip(np.round(wt / s[:, None].astype(np.float64)) + z[:, None], 0, 15).astype(np.int64)
    deq = ((q - z[:, None]).astype(np.float32) * s[:, None].astype(np.float32)).reshape(k, n_out)
    q = q.reshape(k, n_out)
    if spec.version == "gemv":
        # Transposed and sequential: qweight [out, in/8] packed along the input; scales and
        # zeros per output row, groups padded to words (ceil(G/8), aligned for g64 / g32).
        groups = k // gs
        align = 1 if gs >= 128 else 128 // gs
        words = math.ceil(math.ceil(groups / 8) / align) * align
        zt = np.zeros((n_out, words * 8), dtype=np.int64)
        zt[:, :groups] = z.T
        st = np.zeros((n_out, words * 8), dtype=np.float16)
        st[:, :groups] = s.T
        return {"qweight": pack(q.T, 4, axis=1), "qzeros": pack(zt, 4, axis=1), "scales": st}, deq.T.copy()
    tensors = {"qweight": pack(q, 4, axis=1, order=AWQ_ORDER),
               "qzeros": pack(z, 4, axis=1, order=AWQ_ORDER),
               "scales": s}
    return tensors, deq.T.copy()


# ---------------------------------------------------------------------------- checkpoints
def write_quantized_checkpoint(hf_model, path: str, spec: GPTQSpec | AWQSpec, seed: int = 0
                               ) -> dict[str, torch.Tensor]:
    """Save `hf_model` quantized per `spec` to `path` (config + model.safetensors).
    Returns the reference state dict: the float weights the checkpoint encodes."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    perms: dict[str, np.ndarray] = {}
    quantized = {f"model.layers.{i}.{lin}" for i in range(hf_model.config.num_hidden_layers) for lin in LINEARS}
    if isinstance(spec, GPTQSpec) and spec.lm_head:
        quantized.add("lm_head")
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in hf_model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf == "weight":
            w = t.detach().float().numpy()
            if isinstance(spec, AWQSpec) and any(m in module for m in spec.not_converted):
                tensors[name] = t.detach().clone().contiguous()
                reference[name] = t.detach().clone()
                continue
            if isinstance(spec, GPTQSpec):
                key = module.rsplit(".", 1)[0] + "/" + _INPUT_OF.get(module.split(".", 3)[-1], module)
                perm = perms.setdefault(key, rng.permutation(w.shape[1]))
                parts, deq = quantize_gptq(w, spec, perm)
            else:
                parts, deq = quantize_awq(w, spec)
            for k, v in parts.items():
                tensors[f"{module}.{k}"] = torch.from_numpy(np.ascontiguousarray(v))
            reference[name] = torch.from_numpy(deq)
        else:
            tensors[name] = t.detach().clone().contiguous()
            reference[name] = t.detach().clone()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = hf_model.config.to_dict()
    if isinstance(spec, GPTQSpec) and spec.side_file:
        with open(os.path.join(path, "quantize_config.json"), "w") as f:
            json.dump({k: v for k, v in spec.config().items() if k != "quant_method"}, f)
    else:
        config["quantization_config"] = spec.config()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def reference_model(hf_model, state: dict[str, torch.Tensor]):
    """A copy of `hf_model` holding `state` (the dequantized weights)."""
    import copy

    ref = copy.deepcopy(hf_model)
    ref.load_state_dict(state)
    return ref.eval()


# ---------------------------------------------------------------------------- checking
def prompts(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 24))] for _ in range(n)]


def hf_check_greedy(ref, prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced check, one forward instead of a generate loop: every token is the
    reference's argmax given the ones before it (so HF's greedy decoding yields the same
    sequence). Returns the reference's logprobs of the tokens."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(ref(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    assert logp.argmax(-1).tolist() == tokens
    return logp[torch.arange(len(tokens)), tokens].tolist()


def assert_parity(llm, ref, prompt_ids: list[list[int]], max_new: int = 8) -> None:
    """pagedllm's greedy tokens and logprobs equal the reference model's."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    for p, o in zip(prompt_ids, outs, strict=True):
        got = o.outputs[0]
        lps = hf_check_greedy(ref, p, got.token_ids)
        assert [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids, strict=True)] == pytest.approx(lps, abs=1e-4)


# ---------------------------------------------------------------------------- GGUF
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows (2, d/2) -> (d/2, 2), so its interleaved-pair
    rope reproduces HF's rotate-half rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant_blocks(qtype, n_values: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Valid blocks of a K-quant type, which gguf can dequantize but not quantize: random
    bit fields with the fp16 super-block scales set so the values have about `std`."""
    import gguf

    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    # Byte offsets of the fp16 d (and dmin) fields, read from the block layouts.
    fp16_fields = {gguf.GGMLQuantizationType.Q2_K: (80, 82), gguf.GGMLQuantizationType.Q3_K: (108,),
                   gguf.GGMLQuantizationType.Q4_K: (0, 2), gguf.GGMLQuantizationType.Q5_K: (0, 2),
                   gguf.GGMLQuantizationType.Q6_K: (208,)}[qtype]
    blocks = rng.integers(0, 256, size=(n_values // block_values, block_bytes), dtype=np.uint8)

    def set_scale(value: float) -> None:
        for off in fp16_fields:
            blocks[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)

    set_scale(1.0)
    spread = gguf.quants.dequantize(blocks, qtype).std()
    set_scale(std / spread)
    return blocks


def write_gguf(hf_model, path: str, qtype_name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save `hf_model` (a Llama) as a llama.cpp GGUF with every matrix in `qtype_name`
    (norms stay F32, as llama.cpp keeps them). Returns the HF-named float weights the file
    encodes (its tensors dequantized and un-permuted back to HF's layout)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_vocab_size(cfg.vocab_size)
    reference: dict[str, torch.Tensor] = {}
    for name, t in hf_model.state_dict().items():
        w = t.detach().float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, leaf = rest.rpartition(".")
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{leaf}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        n_head = heads if ".attn_q." in gname else kv_heads if ".attn_k." in gname else None
        if n_head is not None:
            w = llama_cpp_permute(w, n_head)
        if w.ndim == 1:
            data, stored_type = w.astype(np.float32), gguf.GGMLQuantizationType.F32
            deq = data
        else:
            if qtype_name.endswith("_K"):
                data = _random_kquant_blocks(qtype, w.size, rng, float(w.std())).reshape(w.shape[0], -1)
            else:
                data = gguf.quants.quantize(w.astype(np.float32), qtype)
            stored_type = qtype
            deq = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if n_head is not None:  # back to HF's row order for the reference
            deq = deq.reshape(n_head, deq.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        writer.add_tensor(gname, data, raw_dtype=None if stored_type == gguf.GGMLQuantizationType.F32 else stored_type)
        reference[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


# ---------------------------------------------------------------------------- FP8
@dataclass(frozen=True)
class FP8Spec:
    """An FP8 (e4m3) checkpoint as one of the published tools writes it.

    fmt "compressed-tensors" (llm-compressor): `weight` fp8 + `weight_scale` in the model's
    dtype, [1] per tensor, [out, 1] per channel, [ceil(out/b0), ceil(in/b1)] per block;
    fmt "fp8" (transformers FineGrainedFP8): `weight` + float32 `weight_scale_inv`, per
    128x128 block (a scalar with weight_block_size null, strategy "tensor"); fmt
    "fbgemm_fp8": `weight` + float32 `weight_scale` [out, 1]; fmt "autofp8" (AutoFP8, the
    older `quant_method: fp8` files): `weight` + a float32 scalar `weight_scale`, static
    scalar `input_scale`s, no weight_block_size; fmt "modelopt" (NVIDIA ModelOpt): `weight` +
    float32 `weight_scale`, a scalar per tensor (quant_algo FP8, with a scalar
    `input_scale`), [out] per channel (FP8_PER_CHANNEL_PER_TOKEN) or [out/128, 1, in/128, 1]
    per block (FP8_PB_WO), described by an hf_quant_config.json beside config.json, or with
    fmt "modelopt-config" in config.json's quantization_config. In every one w = q * scale."""

    fmt: str = "compressed-tensors"
    strategy: str = "channel"  # "tensor" | "channel" | "block"
    block: tuple[int, int] = (128, 128)
    static_input: bool = False  # compressed-tensors: calibrated input_scale tensors
    not_converted: tuple[str, ...] = ()  # modules left in float (ignore / modules_to_not_convert)

    @property
    def modelopt(self) -> bool:
        return self.fmt.startswith("modelopt")

    def config(self, num_layers: int) -> dict:
        skipped = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in self.not_converted]
        if self.modelopt:
            algo = {"tensor": "FP8", "channel": "FP8_PER_CHANNEL_PER_TOKEN", "block": "FP8_PB_WO"}[self.strategy]
            if self.fmt == "modelopt-config":
                return {"quant_method": "modelopt", "quant_algo": algo, "ignore": skipped,
                        "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}}
            return {"producer": {"name": "modelopt", "version": "0.37.0"},
                    "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8",
                                     "exclude_modules": [m + "*" for m in skipped]}}
        if self.fmt == "fbgemm_fp8":
            return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": skipped}
        if self.fmt == "autofp8":
            return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": skipped}
        if self.fmt == "fp8":
            return {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": skipped,
                    "weight_block_size": list(self.block) if self.strategy == "block" else None}
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": self.strategy,
                   "group_size": None, "block_structure": list(self.block) if self.strategy == "block" else None,
                   "actorder": None, "observer": "minmax"}
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not self.static_input,
                  "strategy": "tensor" if self.static_input else "token", "group_size": None,
                  "block_structure": None, "observer": None if not self.static_input else "minmax"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": inputs, "output_activations": None,
                                              "format": "float-quantized"}},
                "ignore": skipped, "kv_cache_scheme": None, "sparsity_config": {}}


FP8_MAX = 448.0


def _fp8_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest e4m3 with one scale per rows x cols tile (partial tiles at the
    edges, as transformers' FineGrainedFP8 has them): (fp8 [out, in], scale tile grid)."""
    n, k = w.shape
    grid = torch.zeros(math.ceil(n / rows), math.ceil(k / cols))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            s = max(tile.abs().max().item(), 1e-12) / FP8_MAX
            grid[i, j] = s
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (tile / s).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q, grid


def quantize_fp8(w: torch.Tensor, spec: FP8Spec, scale_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One float weight [out, in] -> the FP8 tensors of `spec` and the float32 weight they
    encode (q * scale as stored, scale cast to float32 first)."""
    n, k = w.shape
    if spec.strategy == "tensor":
        q, grid = _fp8_blocks(w, n, k)
        scale = grid.reshape(()) if spec.fmt in ("fp8", "autofp8") or spec.modelopt else grid.reshape(1)
        expanded = grid.to(scale_dtype).float().reshape(1, 1)
    elif spec.strategy == "channel":
        q, grid = _fp8_blocks(w, 1, k)  # [out, 1]
        scale = grid.reshape(n) if spec.modelopt else grid
        expanded = grid.to(scale_dtype).float()
    else:
        rows, cols = spec.block
        q, grid = _fp8_blocks(w, rows, cols)
        scale = grid.reshape(grid.shape[0], 1, grid.shape[1], 1) if spec.modelopt else grid
        expanded = grid.to(scale_dtype).float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    name = "weight_scale_inv" if spec.fmt == "fp8" else "weight_scale"
    return {"weight": q, name: scale.to(scale_dtype).contiguous()}, q.float() * expanded


def write_fp8_checkpoint(hf_model, path: str, spec: FP8Spec) -> dict[str, torch.Tensor]:
    """Save `hf_model` as an FP8 checkpoint per `spec` (config.json with its
    quantization_config + model.safetensors). The head, embeddings and norms stay in
    float. Returns the reference state dict: the float weights the checkpoint encodes."""
    from safetensors.torch import save_file

    layers = hf_model.config.num_hidden_layers
    quantized = {f"model.layers.{i}.{lin}" for i in range(layers) for lin in LINEARS if lin not in spec.not_converted}
    # compressed-tensors writes scales in the model's dtype; the transformers formats in float32
    scale_dtype = torch.bfloat16 if spec.fmt == "compressed-tensors" else torch.float32
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in hf_model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf == "weight":
            parts, deq = quantize_fp8(t.detach().float(), spec, scale_dtype)
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
            if spec.static_input or (spec.modelopt and spec.strategy == "tensor"):
                shape = () if spec.fmt == "autofp8" or spec.modelopt else (1,)
                tensors[f"{module}.input_scale"] = torch.full(shape, 0.05, dtype=scale_dtype)
            reference[name] = deq
        else:
            tensors[name] = t.detach().clone().contiguous()
            reference[name] = t.detach().clone()
    if spec.modelopt:  # kv_cache_quant_algo FP8: per-layer KV scales on k_proj / v_proj
        for i in range(layers):
            tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
            tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.25)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = hf_model.config.to_dict()
    if spec.fmt == "modelopt":  # ModelOpt's own export: the side file, config.json unquantized
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(spec.config(layers), f)
    else:
        config["quantization_config"] = spec.config(layers)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def fake_quantize_fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """What quantization="fp8" makes of a float weight: e4m3 with one scale per output
    row (row amax / 448), dequantized again."""
    s = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
