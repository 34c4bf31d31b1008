"""Token ids to text, one step at a time, for streaming.

Text is released only once it is valid UTF-8 (a multi-byte character split over tokens is
held back until complete). Fast tokenizers use the `tokenizers` library's own incremental
decoder (`DecodeStream`, in Rust: about a fifth of the time of two Python-level decodes per
token, and the same text); others re-decode a few tokens per step.
"""

from __future__ import annotations

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
        self._stream = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # Clean-up of tokenization spaces is a Python-side rewrite DecodeStream does not do.
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for t in self.ids:  # the prompt's last tokens: their leading-space context
                self._stream.step(backend, t)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty)."""
        if self._stream is not None:
            new = self._stream.step(self._backend, token_id) or ""
            self.text += new
            return new
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
