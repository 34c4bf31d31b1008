"""Quantized checkpoints: GPTQ and AWQ linear layers kept packed, with a Triton kernel on
CUDA and a cached dequantized weight on CPU. GGUF files are dequantized at load by the
GGUF loader instead (loader/gguf_file.py), so they need nothing here.

Nothing in this package imports triton until a CUDA tensor reaches a quantized layer.
"""

from pagedllm.model_executor.layers.quantization.config import (
    METHODS,
    QuantConfig,
    detect_quant_config,
    parse_quant_config,
    resolve_quant_config,
)
from pagedllm.model_executor.layers.quantization.linear import QuantizedLinear

__all__ = [
    "METHODS",
    "QuantConfig",
    "QuantizedLinear",
    "detect_quant_config",
    "parse_quant_config",
    "resolve_quant_config",
]
