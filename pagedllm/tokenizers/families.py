"""Tokenizers of remote-code model families, built from the checkpoint's tokenizer files
without running its Python (transformers' AutoTokenizer would need trust_remote_code):
tiktoken rank files (Qwen v1, GLM-4) and SentencePiece models (Baichuan, InternLM,
InternLM2, ChatGLM2/3)."""

from __future__ import annotations

import json
import os


def _tokenizer_config(path: str) -> dict:
    cfg = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(cfg):
        return {}
    with open(cfg) as f:
        return json.load(f)


def load_family_tokenizer(path: str):
    """A family tokenizer for the checkpoint directory `path`, or None when transformers'
    AutoTokenizer should load it."""
    from pagedllm.tokenizers.tiktoken_bpe import GLM4, QWEN, TiktokenTokenizer, is_rank_file

    if os.path.exists(os.path.join(path, QWEN.file)):
        return TiktokenTokenizer(path, QWEN)
    cfg = _tokenizer_config(path)
    model_file = os.path.join(path, "tokenizer.model")
    if not (os.path.exists(model_file) and "AutoTokenizer" in (cfg.get("auto_map") or {})):
        return None
    if is_rank_file(model_file):
        return TiktokenTokenizer(path, GLM4, cfg.get("chat_template"))
    from pagedllm.tokenizers.spm import SentencePieceTokenizer

    return SentencePieceTokenizer(path)
