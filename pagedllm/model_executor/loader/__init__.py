"""Turn a checkpoint (HF directory, GGUF file, or nothing: dummy weights) into a model."""

from pagedllm.model_executor.loader.loader import ModelSource, load_model, resolve_source

__all__ = ["ModelSource", "load_model", "resolve_source"]
