"""Which quantization a checkpoint uses, read from its own files, and checked against what
the user asked for.

A checkpoint says how it was quantized in `config.json -> quantization_config` (transformers
/ optimum style) or in a side file (`quantize_config.json` from AutoGPTQ, `quant_config.json`
from older AutoAWQ). The user's `quantization=` setting is only a check: the checkpoint is
the authority, because a wrong layout would load without error and produce garbage.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# Values accepted for EngineConfig.quantization ("gguf" names the GGUF loader: dequantized at
# load, or Q4_0/Q8_0 linear layers kept packed on CUDA, see loader/gguf_file.py).
METHODS = ("gptq", "awq", "gguf")
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class QuantConfig:
    """How the linear layers of a GPTQ, AWQ or (kept packed) GGUF checkpoint are stored.

    Only what changes the arithmetic is kept: `sym` needs no field because the stored zeros
    say it. `desc_act` (act-order) is also written in g_idx, but a row-parallel rank must
    know before reading any tensor whether it may keep only its own groups of scales and
    zeros (in group order) or needs the whole group table (act-order scatters groups over
    the input features), so it is kept.
    """

    method: str  # "gptq" | "awq" | "gguf"
    bits: int = 4
    group_size: int = 128  # -1: one group spanning the whole input dimension
    # gptq: "gptq" (v1) | "gptq_v2"; awq: "awq" (GEMM) | "awq_gemv"; gguf: "q4_0" | "q8_0"
    checkpoint_format: str = "gptq"
    lm_head: bool = False  # GPTQModel can quantize the output head too
    desc_act: bool = False  # GPTQ act-order: g_idx is not in group order

    def __post_init__(self) -> None:
        if self.method not in ("gptq", "awq", "gguf"):
            raise ValueError(f"unsupported quantization method {self.method!r}")
        if self.method == "gguf" and (self.group_size, self.checkpoint_format) != (32, f"q{self.bits}_0"):
            raise ValueError(f"GGUF layers are kept packed as Q4_0 or Q8_0 blocks of 32, not {self!r}")
        if self.method == "gptq" and self.bits not in (2, 4, 8):
            raise ValueError(f"GPTQ with {self.bits} bits is not supported (2, 4 and 8 are)")
        if self.method == "awq" and self.bits != 4:
            raise ValueError(f"AWQ with {self.bits} bits is not supported (only 4)")
        if self.group_size != -1 and (self.group_size < 1 or self.group_size % (32 // self.bits)):
            raise ValueError(f"group_size must be -1 or a multiple of {32 // self.bits}, got {self.group_size}")

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
        return cls(method, 4, 128, "gptq" if method == "gptq" else "awq")


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
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version not in ("gemm", "gemv"):
            raise ValueError(f"AWQ version {version!r} is not supported (the GEMM and GEMV layouts are)")
        if not raw.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        return QuantConfig("awq", bits, group_size, "awq" if version == "gemm" else "awq_gemv")
    raise ValueError(f"quantization method {method!r} is not supported (gptq and awq are)")


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
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} or None, got {requested!r}")
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
        if load_format == "dummy":
            return QuantConfig.default(requested)
        raise ValueError(f"quantization={requested!r} given, but the checkpoint has no "
                         "quantization_config (config.json) or quantize_config.json: it is a "
                         "float checkpoint")
    if detected.method != requested:
        raise ValueError(f"quantization={requested!r} given, but the checkpoint is quantized "
                         f"with {detected.method!r}")
    return detected
