"""Multimodal checkpoints served as their language model alone (text in, text out).

`Gemma3ForConditionalGeneration` (Gemma 3 4B/12B/27B, the instruction-tuned releases) nests
the decoder's config under `text_config` beside a vision tower's. The engine sizes its
KV cache, context and dtype from one flat config, so the text config is lifted out here,
keeping the wrapper's architecture name (its ArchSpec maps the checkpoint's
`language_model.` names and skips the vision tensors) and the settings the wrapper keeps
at its own level. Images are not served: the vision tower is not loaded.
"""

from __future__ import annotations

import copy

# wrapper architectures whose `text_config` is the served model
TEXT_ONLY_WRAPPERS = ("Gemma3ForConditionalGeneration",)
# settings a wrapper's top level may hold for the whole model
_TOP_LEVEL = ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings",
              "quantization_config", "torch_dtype", "dtype")


def language_model_config(config):
    """`config` itself, or for a multimodal wrapper its text config made the model's."""
    archs = list(getattr(config, "architectures", None) or [])
    text = getattr(config, "text_config", None)
    if text is None or not any(a in TEXT_ONLY_WRAPPERS for a in archs):
        return config
    flat = copy.deepcopy(text)
    flat.architectures = [a for a in archs if a in TEXT_ONLY_WRAPPERS]
    for key in _TOP_LEVEL:
        value = getattr(config, key, None)
        if value is not None:
            setattr(flat, key, value)
    return flat
