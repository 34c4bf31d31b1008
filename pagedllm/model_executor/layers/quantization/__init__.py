"""Quantized checkpoints: which format a checkpoint uses (config.py) and the weight methods
that keep its linear layers packed (gptq_awq.py: GPTQ and AWQ; gguf.py: GGUF Q4_0/Q8_0
blocks), with a Triton kernel on CUDA and a cached dequantized weight on CPU; fp8.py keeps
FP8 (e4m3) weights for torch._scaled_mm on GPUs with FP8 tensor cores and dequantizes them
once at load elsewhere. Other GGUF types are dequantized at load by the GGUF loader
(loader/gguf_file.py).

Nothing in this package imports triton until a CUDA tensor reaches a quantized layer.
"""

from pagedllm.model_executor.layers.quantization.config import (
    METHODS,
    QuantConfig,
    detect_quant_config,
    parse_quant_config,
    resolve_quant_config,
)

__all__ = [
    "METHODS",
    "QuantConfig",
    "detect_quant_config",
    "parse_quant_config",
    "resolve_quant_config",
]
