"""Byte-level BPE tokenizers shipped as tiktoken rank files: Qwen v1 (`qwen.tiktoken`) and
GLM-4 (`tokenizer.model`), without running the checkpoint's Python.

The file holds one `base64(token bytes) rank` per line; the BPE over those ranks is
tiktoken's. Special tokens are not in the file: they follow the last rank in a fixed,
family-specific order. Special-token text in the input becomes the special id (as the
original tokenizers do for the prompts a chat template writes).
"""

from __future__ import annotations

import base64
import os
import unicodedata
from dataclasses import dataclass

from pagedllm.tokenizers.chat import render_chat_template

# cl100k-like pre-split; Qwen splits digits one by one, GLM-4 in runs of up to three.
_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|{digits}"""
        r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class Family:
    name: str
    file: str
    pat_str: str
    special_tokens: tuple[str, ...]  # in id order, from len(ranks) upward
    prefix: tuple[str, ...]  # special tokens encode() puts first
    eos: tuple[str, ...]  # ids that end a generation
    chat_template: str
    nfc: bool


QWEN = Family(
    name="qwen", file="qwen.tiktoken", pat_str=_PAT.replace("{digits}", r"\p{N}"),
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                    *(f"<|extra_{i}|>" for i in range(205))),
    prefix=(), eos=("<|endoftext|>", "<|im_end|>"), nfc=True,
    # ChatML, with Qwen's default system prompt when the conversation has none
    chat_template=(
        "{% if not messages or messages[0]['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
)

GLM4 = Family(
    name="glm4", file="tokenizer.model", pat_str=_PAT.replace("{digits}", r"\p{N}{1,3}"),
    special_tokens=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                    "<|end_of_video|>"),
    prefix=("[gMASK]", "<sop>"), eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    nfc=False,
    chat_template=(
        "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
)


def load_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def is_rank_file(path: str) -> bool:
    """A tiktoken rank file (GLM-4's tokenizer.model) rather than a SentencePiece proto."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256).split()
        return len(first) == 2 and first[1].isdigit() and bool(base64.b64decode(first[0],
                                                                                  validate=True))
    except (OSError, ValueError):
        return False


class TiktokenTokenizer:
    """The part of the transformers tokenizer interface the engine and server use."""

    def __init__(self, path: str, family: Family, chat_template: str | None = None):
        import tiktoken

        self.family = family
        ranks = load_ranks(os.path.join(path, family.file) if os.path.isdir(path) else path)
        n = len(ranks)
        self.special_tokens = {tok: n + i for i, tok in enumerate(family.special_tokens)}
        self._enc = tiktoken.Encoding(family.name, pat_str=family.pat_str, mergeable_ranks=ranks,
                                      special_tokens=self.special_tokens)
        self._id_to_special = {i: t for t, i in self.special_tokens.items()}
        self._prefix = [self.special_tokens[t] for t in family.prefix]
        self._eos = [self.special_tokens[t] for t in family.eos]
        self.name_or_path = path
        self.chat_template = chat_template or family.chat_template
        self.eos_token = family.eos[0]
        self.bos_token_id = None
        self.pad_token_id = self._eos[0]

    # -------------------------------------------------------------- special ids
    @property
    def eos_token_id(self) -> list[int]:
        """Every id that ends a generation: end of text, and the end of a chat turn."""
        return list(self._eos)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.special_tokens.values())

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def __len__(self) -> int:
        return self._enc.n_vocab

    # -------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.family.nfc:
            text = unicodedata.normalize("NFC", text)
        ids = self._enc.encode(text, allowed_special="all", disallowed_special=())
        return (self._prefix + ids) if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        if isinstance(ids, int):
            ids = [ids]
        n = self._enc.n_vocab
        # ids past the tokenizer (embedding rows are padded to vocab_size) decode to nothing
        keep = [i for i in ids if i < n and not (skip_special_tokens and i in self._id_to_special)]
        return self._enc.decode(keep, errors="replace")

    def convert_ids_to_tokens(self, ids):
        """Token bytes as latin-1 text for BPE tokens, the token string for special ones."""
        def one(i):
            if i in self._id_to_special:
                return self._id_to_special[i]
            return self._enc.decode_single_token_bytes(i).decode("latin-1")

        return one(ids) if isinstance(ids, int) else [one(i) for i in ids]

    def apply_chat_template(self, conversation, chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False, **kwargs):
        text = render_chat_template(chat_template or self.chat_template, conversation,
                                    add_generation_prompt=add_generation_prompt,
                                    eos_token=self.eos_token, bos_token="", **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text
