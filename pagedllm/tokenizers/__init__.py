"""Tokenizers: which one a model gets (loading), the remote-code families' own tokenizers
read from their files (families, tiktoken_bpe, spm), chat templates (chat), and streaming
detokenization (detokenizer)."""

from pagedllm.tokenizers.detokenizer import IncrementalDetokenizer
from pagedllm.tokenizers.families import load_family_tokenizer
from pagedllm.tokenizers.loading import gguf_tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "gguf_tokenizer", "load_family_tokenizer", "load_tokenizer"]
