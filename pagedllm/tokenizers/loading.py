"""Which tokenizer a model gets.

transformers' AutoTokenizer (from the checkpoint directory, or built from GGUF metadata),
except for the remote-code families, whose tokenizer files are read as data (families.py)
because AutoTokenizer would have to run the checkpoint's Python.
"""

from __future__ import annotations

import os

from pagedllm.model_source import ModelSource
from pagedllm.tokenizers.families import load_family_tokenizer


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None):
    """`tokenizer_path` (the user's override) wins over the model's own files."""
    from transformers import AutoTokenizer

    if tokenizer_path:
        if os.path.isdir(tokenizer_path) and (family := load_family_tokenizer(tokenizer_path)):
            return family
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if source.kind == "gguf":
        return gguf_tokenizer(source.path)
    if (family := load_family_tokenizer(source.path)) is not None:
        return family  # remote-code tokenizers (Qwen v1's tiktoken, ...), read as data
    if not any(
        os.path.exists(os.path.join(source.path, f))
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    ):
        raise ValueError(
            f"no tokenizer files in {source.path!r}: pass tokenizer=... or skip_tokenizer_init=True"
        )
    return with_processor_chat_template(AutoTokenizer.from_pretrained(source.path), source.path)


def with_processor_chat_template(tokenizer, path: str):
    """Multimodal checkpoints (Gemma 3) may keep their chat template only in the processor's
    `chat_template.json`, which AutoTokenizer does not read: served as text models, they
    take it from there when the tokenizer has none."""
    file = os.path.join(path, "chat_template.json")
    if getattr(tokenizer, "chat_template", None) or not os.path.exists(file):
        return tokenizer
    import json

    with open(file) as f:
        template = json.load(f).get("chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def gguf_tokenizer(path: str):
    """transformers builds a fast tokenizer (with the chat template) from GGUF metadata."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)
