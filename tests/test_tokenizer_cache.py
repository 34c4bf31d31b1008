"""The GGUF tokenizer cache: the tokenizer loaded from the cache behaves as the one
transformers converts from the GGUF file (encodings, decodings, special tokens, chat
template); the key follows the file; a damaged entry is converted again and replaced; an
unusable cache directory only costs the conversion."""

from __future__ import annotations

import os

import pytest

from pagedllm.config import default_model_path
from pagedllm.tokenizers import loading

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — 東京 🚀",
         "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x ** 2  # ok", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


def assert_same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids, text
        ids = a(text).input_ids
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert len(a) == len(b) and a.get_vocab() == b.get_vocab()
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.all_special_ids == b.all_special_ids
    assert a.chat_template == b.chat_template
    for prompt in (True, False):
        assert (a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
                == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt))


def test_cached_tokenizer_equals_the_conversion_and_a_damaged_entry_is_redone(
        gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    from transformers import AutoTokenizer

    conversions = []
    original = AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    converted = loading.gguf_tokenizer(gguf_path)
    entry = loading.gguf_tokenizer_cache(gguf_path)
    assert len(conversions) == 1 and os.path.isfile(os.path.join(entry, "tokenizer.json"))
    cached = loading.gguf_tokenizer(gguf_path)
    assert len(conversions) == 1  # read from the entry, not converted again
    assert_same_tokenizer(cached, converted)

    with open(os.path.join(entry, "tokenizer.json"), "w") as f:
        f.write("{ not json")
    repaired = loading.gguf_tokenizer(gguf_path)
    assert len(conversions) == 2
    assert_same_tokenizer(repaired, converted)
    assert_same_tokenizer(loading.gguf_tokenizer(gguf_path), converted)
    assert len(conversions) == 2
    assert [n for n in os.listdir(os.path.dirname(entry)) if n.startswith(".tmp-")] == []


def test_the_key_follows_the_file_and_the_setting(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "c"))
    first = loading.gguf_tokenizer_cache(str(model))
    assert first.startswith(str(tmp_path / "c" / "gguf-tokenizers"))
    assert loading.gguf_tokenizer_cache(str(model)) == first
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert loading.gguf_tokenizer_cache(str(model)) != first  # a replaced file is converted again
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "")
    assert loading.gguf_tokenizer_cache(str(model)) is None  # caching off
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.gguf_tokenizer_cache(str(model)).startswith(str(tmp_path / "xdg" / "pagedllm"))


def test_an_unwritable_cache_only_costs_the_conversion(gguf_path, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker))
    tokenizer = loading.gguf_tokenizer(gguf_path)
    assert tokenizer("Hello").input_ids and blocker.read_text() == "not a directory"
