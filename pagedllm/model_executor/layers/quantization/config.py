"""Which quantization a checkpoint uses, read from its own files, and checked against what
the user asked for.

A checkpoint says how it was quantized in `config.json -> quantization_config` (transformers
/ optimum / compressed-tensors style) or in a side file (`quantize_config.json` from
AutoGPTQ, `quant_config.json` from older AutoAWQ). The user's `quantization=` setting is
only a check: the checkpoint is the authority, because a wrong layout would load without
error and produce garbage. The one exception is `quantization="fp8"` on a float
checkpoint: there is nothing to contradict, and the linear layers are quantized at load.

FP8 (e4m3) checkpoints come in three published spellings, all method "fp8" here:
- compressed-tensors (llm-compressor): `{"quant_method": "compressed-tensors", "format":
  "float-quantized", "config_groups": {..: {"weights": {"num_bits": 8, "type": "float",
  "strategy": "tensor" | "channel" | "block" | "group"}, ..}}, "ignore": ["lm_head"]}`;
  tensors `weight` (float8_e4m3fn) and `weight_scale` ([1], [out, 1], [out/bs, in/bs] or
  [out, in/group]), w = weight * scale.
- transformers FineGrainedFP8 (DeepSeek-V3, Qwen3-FP8): `{"quant_method": "fp8",
  "weight_block_size": [128, 128], "activation_scheme": "dynamic"}`; tensors `weight` and
  `weight_scale_inv` [ceil(out/128), ceil(in/128)], w = weight * weight_scale_inv
  (multiplied despite the name). Without weight_block_size (null, or absent as in AutoFP8's
  `{"quant_method": "fp8", "activation_scheme": "static"}` files, which vLLM reads the same
  way) the scale is one per tensor, named `weight_scale` or `weight_scale_inv`.
- transformers fbgemm_fp8: `{"quant_method": "fbgemm_fp8"}`; `weight` and `weight_scale`
  [out, 1] float32.
- NVIDIA ModelOpt (TensorRT Model Optimizer; nvidia/*-FP8 checkpoints): a side file
  `hf_quant_config.json` `{"producer": {"name": "modelopt"}, "quantization": {"quant_algo":
  "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}`, or the same in
  config.json as `{"quant_method": "modelopt", "quant_algo": "FP8", "ignore": [...]}`.
  quant_algo FP8: `weight` + a float32 scalar `weight_scale` per tensor (and a static
  `input_scale`); FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` [out]; FP8_PB_WO: 128x128
  blocks, `weight_scale` [out/128, 1, in/128, 1]. Exclusions are wildcards (fnmatch).
  Its fp8 KV scales are `self_attn.k_proj.k_scale` / `v_proj.v_scale` (the model reads
  those).
MXFP4 (gpt-oss): `{"quant_method": "mxfp4"}` quantizes the MoE experts only: tensors
`*_blocks` (uint8, two e2m1 values a byte, 32 values a block) and `*_scales` (uint8 e8m0
exponents, bias 127). The model reads them itself (models/gpt_oss.py) and its linear layers
stay float.
Static activation scales that some of them carry (`input_scale`, `activation_scale`,
`input_scale_ub`) are read and ignored: activations are always quantized per token, at run
time, which is at least as fine as one calibrated scale per tensor.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass

from pagedllm.config import FP8_SPELLINGS, QUANTIZATION_METHODS

# Values accepted for EngineConfig.quantization ("gguf" names the GGUF loader: dequantized at
# load, or Q4_0/Q8_0 linear layers kept packed on CUDA, see loader/gguf_file.py); FP8_SPELLINGS
# are also accepted for an FP8 checkpoint of that format (the names vLLM's --quantization
# takes), the method "fp8" all the same. Both live with EngineConfig, which checks them first.
METHODS = QUANTIZATION_METHODS
_SIDE_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")
# checkpoint_format of an FP8 QuantConfig: where its tensors come from ("float": a float
# checkpoint that quantization="fp8" quantizes at load, per output channel).
FP8_FORMATS = ("compressed-tensors", "fp8", "fbgemm_fp8", "modelopt", "float")
FP8_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class QuantConfig:
    """How the linear layers of a GPTQ, AWQ, (kept packed) GGUF or FP8 checkpoint are stored.

    Only what changes the arithmetic is kept: `sym` needs no field because the stored zeros
    say it. `desc_act` (act-order) is also written in g_idx, but a row-parallel rank must
    know before reading any tensor whether it may keep only its own groups of scales and
    zeros (in group order) or needs the whole group table (act-order scatters groups over
    the input features), so it is kept. For FP8, `strategy` and `block_size` say which
    shape of weight scale to expect, checked against every scale tensor before it is sliced
    (a per-channel scale read as per-tensor would load without error).
    """

    method: str  # "gptq" | "awq" | "gguf" | "fp8" | "mxfp4" (MoE experts only)
    bits: int = 4
    group_size: int = 128  # -1: one group spanning the whole input dimension
    # gptq: "gptq" (v1) | "gptq_v2"; awq: "awq" (GEMM) | "awq_gemv"; gguf: "q4_0" | "q8_0";
    # fp8: one of FP8_FORMATS
    checkpoint_format: str = "gptq"
    lm_head: bool = False  # GPTQModel (or a compressed-tensors FP8 export) can quantize the head too
    desc_act: bool = False  # GPTQ act-order: g_idx is not in group order
    # fp8: weight scales per "tensor", per output "channel", or per `block_size` = (rows,
    # input columns) tile ("block"; compressed-tensors' per-group scales are (1, group) blocks)
    strategy: str = ""
    block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unsupported quantization method {self.method!r}")
        if self.method == "fp8":
            self._check_fp8()
            return
        if self.method == "mxfp4":
            if (self.bits, self.group_size) != (4, 32):
                raise ValueError(f"MXFP4 has 4-bit values in blocks of 32, not {self!r}")
            return
        if self.method == "gguf" and (self.group_size, self.checkpoint_format) != (32, f"q{self.bits}_0"):
            raise ValueError(f"GGUF layers are kept packed as Q4_0 or Q8_0 blocks of 32, not {self!r}")
        if self.method == "gptq" and self.bits not in (2, 4, 8):
            raise ValueError(f"GPTQ with {self.bits} bits is not supported (2, 4 and 8 are)")
        if self.method == "awq" and self.bits != 4:
            raise ValueError(f"AWQ with {self.bits} bits is not supported (only 4)")
        if self.group_size != -1 and (self.group_size < 1 or self.group_size % (32 // self.bits)):
            raise ValueError(f"group_size must be -1 or a multiple of {32 // self.bits}, got {self.group_size}")

    def _check_fp8(self) -> None:
        if self.bits != 8:
            raise ValueError(f"FP8 weights have 8 bits, not {self.bits}")
        if self.checkpoint_format not in FP8_FORMATS:
            raise ValueError(f"unknown FP8 checkpoint format {self.checkpoint_format!r} ({', '.join(FP8_FORMATS)})")
        if self.strategy not in FP8_STRATEGIES:
            raise ValueError(f"FP8 weight scales per {self.strategy!r} are not supported "
                             f"({', '.join(FP8_STRATEGIES)} are)")
        if (self.strategy == "block") != (self.block_size is not None):
            raise ValueError("FP8 block scales need a block_size, and only they have one")
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise ValueError(f"FP8 block_size must be two positive integers, got {self.block_size}")

    @property
    def scale_names(self) -> tuple[str, ...]:
        """The checkpoint's names of an FP8 weight's scale tensor, the usual one first
        (transformers' FineGrainedFP8 calls it weight_scale_inv and multiplies by it all the
        same; AutoFP8's per-tensor files, also "fp8", call it weight_scale)."""
        return ("weight_scale_inv", "weight_scale") if self.checkpoint_format == "fp8" else ("weight_scale",)

    @property
    def pack_factor(self) -> int:
        """Quantized values per int32 word."""
        return 32 // self.bits

    @property
    def zero_offset(self) -> int:
        """What to add to a stored zero point: GPTQ v1 files store z - 1."""
        return 1 if self.method == "gptq" and self.checkpoint_format == "gptq" else 0

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    @classmethod
    def default(cls, method: str) -> QuantConfig:
        """The common published layout, for random (dummy) weights without a checkpoint."""
        if method == "fp8":
            return cls.fp8_at_load()
        if method == "mxfp4":
            return cls("mxfp4", 4, 32, "mxfp4")
        return cls(method, 4, 128, "gptq" if method == "gptq" else "awq")

    @classmethod
    def fp8_at_load(cls) -> QuantConfig:
        """quantization="fp8" on a float checkpoint: each linear layer quantized at load to
        e4m3 with one scale per output channel (the head and embeddings stay float)."""
        return cls("fp8", 8, checkpoint_format="float", strategy="channel")


def _as_dict(qc) -> dict:
    if qc is None:
        return {}
    if isinstance(qc, dict):
        return dict(qc)
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    return dict(vars(qc))


def parse_quant_config(raw: dict) -> QuantConfig:
    """A QuantConfig from any of the published spellings; unsupported layouts fail loudly."""
    method = raw.get("quant_method") or raw.get("method") or ""
    method = str(getattr(method, "value", method)).lower()  # transformers' enum or a string
    if method.startswith("modelopt") or (not method and isinstance(raw.get("quantization"), dict)):
        return _parse_modelopt(raw)  # (hf_quant_config.json names no method: its producer is ModelOpt)
    if not method:
        # AutoGPTQ's quantize_config.json has no quant_method; AutoAWQ's files use w_bit.
        method = "awq" if ("w_bit" in raw or "zero_point" in raw or "version" in raw) else "gptq"
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    group_size = int(raw.get("group_size", raw.get("q_group_size", 128)))
    if method == "gptq":
        fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
        if raw.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2 are)")
        if raw.get("dynamic"):
            raise ValueError("GPTQModel per-module 'dynamic' overrides are not supported")
        return QuantConfig("gptq", bits, group_size, fmt, bool(raw.get("lm_head", False)),
                           bool(raw.get("desc_act", False)))
    if method in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return _parse_fp8(method, raw)
    if method == "mxfp4":
        return QuantConfig.default("mxfp4")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version not in ("gemm", "gemv"):
            raise ValueError(f"AWQ version {version!r} is not supported (the GEMM and GEMV layouts are)")
        if not raw.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        return QuantConfig("awq", bits, group_size, "awq" if version == "gemm" else "awq_gemv")
    raise ValueError(f"quantization method {method!r} is not supported (gptq, awq, fp8, "
                     "fbgemm_fp8, compressed-tensors FP8, ModelOpt FP8 and mxfp4 are)")


def _parse_fp8(method: str, raw: dict) -> QuantConfig:
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "fbgemm_fp8":  # one float32 scale per output row, always
        return QuantConfig("fp8", 8, checkpoint_format="fbgemm_fp8", strategy="channel")
    # transformers always writes weight_block_size (null: one scale per tensor); files
    # without it are AutoFP8's per-tensor ones (vLLM's reading: no key, no blocks).
    if raw.get("modules_to_convert"):
        raise ValueError("FP8 embeddings (FineGrainedFP8 modules_to_convert) are not supported")
    if str(raw.get("expert_dtype", "fp8")) != "fp8":
        raise ValueError(f"FP8 checkpoints with {raw['expert_dtype']} experts are not supported")
    block = raw.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", 8, checkpoint_format="fp8", strategy="tensor")
    return QuantConfig("fp8", 8, checkpoint_format="fp8", strategy="block",
                       block_size=(int(block[0]), int(block[1])))


# ModelOpt's FP8 algorithms: the weight scales each one stores
_MODELOPT_FP8 = {"FP8": ("tensor", None), "FP8_PER_CHANNEL_PER_TOKEN": ("channel", None),
                 "FP8_PB_WO": ("block", (128, 128))}


def _parse_modelopt(raw: dict) -> QuantConfig:
    """ModelOpt's FP8 checkpoints, from hf_quant_config.json (`quantization` holds the
    algorithm) or from config.json (the algorithm at the top, `ignore` for the exclusions).
    Its other algorithms (NVFP4, MXFP8, INT8/INT4 AWQ, mixed precision) fail loudly."""
    inner = raw["quantization"] if isinstance(raw.get("quantization"), dict) else raw
    algo = str(inner.get("quant_algo") or "").upper()
    if not algo:
        raise ValueError("ModelOpt quantization config has no quant_algo")
    if algo not in _MODELOPT_FP8:
        raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported ({', '.join(_MODELOPT_FP8)} are)")
    strategy, block = _MODELOPT_FP8[algo]
    excluded = inner.get("exclude_modules", inner.get("ignore")) or []
    if not isinstance(excluded, list):
        raise ValueError(f"ModelOpt exclude_modules must be a list, got {type(excluded).__name__}")
    head_excluded = any(fnmatch.fnmatchcase("lm_head", p) or p.rstrip("*").rstrip(".") == "lm_head"
                        for p in map(str, excluded))
    return QuantConfig("fp8", 8, checkpoint_format="modelopt", strategy=strategy, block_size=block,
                       lm_head=not head_excluded)


def _ignored(module: str, patterns: list[str]) -> bool:
    """compressed-tensors' `ignore` entries: a module name, or `re:<regex>` matched from the
    start of the name."""
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def _parse_compressed_tensors(raw: dict) -> QuantConfig:
    """The FP8 schemes of compressed-tensors (float-quantized weights); every other scheme it
    can describe (packed int4, int8, NVFP4, sparsity) fails loudly."""
    groups = raw.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if raw.get("sparsity_config") and (raw["sparsity_config"].get("format") or "dense") != "dense":
        raise ValueError("sparse compressed-tensors checkpoints are not supported")
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or raw.get("format")
        if (fmt not in ("float-quantized", "naive-quantized") or weights.get("type") != "float"
                or int(weights.get("num_bits") or 0) != 8):
            raise ValueError(f"compressed-tensors {name}: format {fmt!r} with {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} weights is not supported (8-bit float weights, "
                             "'float-quantized', are)")
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise ValueError(f"compressed-tensors {name}: only symmetric, static FP8 weight scales are supported")
        strategy = str(weights.get("strategy") or "tensor")
        if strategy == "block":
            rows, cols = weights["block_structure"]
            schemes.add(("block", (int(rows), int(cols))))
        elif strategy == "group":  # one scale per output row and group of inputs: a 1 x group block
            schemes.add(("block", (1, int(weights["group_size"]))))
        else:
            schemes.add((strategy, None))
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors FP8 with different weight scales per layer ({sorted(map(str, schemes))}) "
                         "is not supported")
    (strategy, block), = schemes
    return QuantConfig("fp8", 8, checkpoint_format="compressed-tensors", strategy=strategy, block_size=block,
                       lm_head=not _ignored("lm_head", list(raw.get("ignore") or [])))


def detect_quant_config(model_dir: str | None, hf_config) -> QuantConfig | None:
    """The checkpoint's own quantization, or None for a float checkpoint."""
    raw = _as_dict(getattr(hf_config, "quantization_config", None))
    if not raw and model_dir and os.path.isdir(model_dir):
        for name in _SIDE_FILES:
            path = os.path.join(model_dir, name)
            if os.path.exists(path):
                with open(path) as f:
                    raw = json.load(f)
                break
    return parse_quant_config(raw) if raw else None


def resolve_quant_config(requested: str | None, kind: str, load_format: str, model_dir: str | None,
                         hf_config) -> QuantConfig | None:
    """What the model is built with. `requested` is the user's setting (None: detect).

    A mismatch is an error rather than a silent override: asking for AWQ and getting GPTQ
    would mean the user's other assumptions (kernels, memory) are wrong too.
    """
    requested = requested.lower() if requested else None
    fp8_format = None
    if requested in FP8_SPELLINGS:  # vLLM's names of FP8 checkpoint formats: "fp8", of that format
        requested, fp8_format = "fp8", requested
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS + FP8_SPELLINGS)} or None, "
                         f"got {requested!r}")
    if kind == "gguf":
        if requested not in (None, "gguf"):
            raise ValueError(f"quantization={requested!r} given, but the model is a GGUF file "
                             "(its own tensor types decide how it is loaded)")
        return None
    if requested == "gguf":
        raise ValueError("quantization='gguf' given, but the model is not a GGUF file")
    detected = detect_quant_config(model_dir, hf_config)
    if requested is None:
        return detected
    if detected is None:
        if requested == "fp8" or load_format == "dummy":
            return QuantConfig.default(requested)
        raise ValueError(f"quantization={requested!r} given, but the checkpoint has no "
                         "quantization_config (config.json) or quantize_config.json: it is a "
                         "float checkpoint")
    if detected.method != requested:
        raise ValueError(f"quantization={requested!r} given, but the checkpoint is quantized "
                         f"with {detected.method!r}")
    if fp8_format is not None and detected.checkpoint_format != fp8_format:
        raise ValueError(f"quantization={fp8_format!r} given, but the checkpoint is a "
                         f"{detected.checkpoint_format} FP8 checkpoint")
    return detected
