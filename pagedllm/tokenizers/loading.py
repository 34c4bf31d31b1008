"""Which tokenizer a model gets.

transformers' AutoTokenizer (from the checkpoint directory, or built from GGUF metadata),
except for the remote-code families, whose tokenizer files are read as data (families.py)
because AutoTokenizer would have to run the checkpoint's Python.
"""

from __future__ import annotations

import logging
import os

from pagedllm.model_source import ModelSource
from pagedllm.tokenizers.families import load_family_tokenizer

logger = logging.getLogger(__name__)


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
    """transformers builds a fast tokenizer (with the chat template) from GGUF metadata.

    That conversion re-reads the whole vocabulary and takes seconds (9 s for SmolLM2 on a
    small CPU), on every start of every process that tokenizes. Its result is kept as
    tokenizer files under the cache directory (`gguf_tokenizer_cache`), keyed by the file's
    path, size and modification time and by the transformers and tokenizers versions;
    loading those takes a fraction of a second. A cache that cannot be written is skipped."""
    from transformers import AutoTokenizer

    cache = gguf_tokenizer_cache(path)
    if cache is not None and os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception as e:  # a damaged entry: convert again (and replace it below)
            logger.warning("ignoring the cached tokenizer %s: %s", cache, e)
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if cache is not None:
        _save_atomically(tokenizer, cache)
    return tokenizer


def cache_root() -> str | None:
    """$PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm (~/.cache/pagedllm); an empty
    PAGEDLLM_CACHE_DIR turns caching off."""
    if "PAGEDLLM_CACHE_DIR" in os.environ:
        return os.path.expanduser(os.environ["PAGEDLLM_CACHE_DIR"]) or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedllm")


def gguf_tokenizer_cache(path: str) -> str | None:
    """The directory that holds (or will hold) the converted tokenizer of this GGUF file."""
    import hashlib

    import tokenizers
    import transformers

    root = cache_root()
    if root is None:
        return None
    path = os.path.abspath(path)
    st = os.stat(path)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}"
    return os.path.join(root, "gguf-tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def _save_atomically(tokenizer, cache: str) -> None:
    """Written beside the entry and renamed into place, so that a process starting at the
    same time sees either no entry or a whole one."""
    import shutil
    import tempfile

    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache), prefix=".tmp-")
        try:
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(cache, ignore_errors=True)
            os.rename(tmp, cache)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except Exception as e:  # read-only home, full disk, a race lost: the cache is only a speed-up
        logger.debug("tokenizer cache %s not written: %s", cache, e)
