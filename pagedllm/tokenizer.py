"""Tokenizer loading and the incremental detokenizer.

Tokenizers come from transformers (from the checkpoint directory, or built from GGUF
metadata), or for remote-code families from pagedllm.tokenizers. Detokenization is
incremental: each new token costs a decode of a few tokens, and text is released only once
it is valid UTF-8 (a multi-byte character split over tokens is held back until complete).
"""

from __future__ import annotations

import os

from pagedllm.model_executor.loader.loader import ModelSource
from pagedllm.tokenizers import load_family_tokenizer


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None):
    from transformers import AutoTokenizer

    if tokenizer_path:
        if os.path.isdir(tokenizer_path) and (family := load_family_tokenizer(tokenizer_path)):
            return family
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if source.kind == "gguf":
        from pagedllm.model_executor.loader.gguf_file import gguf_tokenizer

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
    return AutoTokenizer.from_pretrained(source.path)


# How many tokens before the new ones are re-decoded, so that tokenizers whose pieces
# depend on their left neighbour (SentencePiece's leading-space rule) render correctly.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into a growing string, one step at a time."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete UTF-8 sequence: wait
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += new
        return new
