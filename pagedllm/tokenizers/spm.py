"""SentencePiece tokenizers of remote-code checkpoints (Baichuan, InternLM, InternLM2,
ChatGLM2/3), read from `tokenizer.model` + `tokenizer_config.json` as data.

Their own classes are thin wrappers over SentencePiece in the slow-Llama style: special
tokens (`added_tokens_decoder`) are cut out of the text first, every other chunk is
SentencePiece-encoded on its own, and a BOS is prefixed when `add_bos_token` is set.
ChatGLM appends its command tokens ([MASK], [gMASK], [sMASK], sop, eop, <|system|>,
<|user|>, <|assistant|>, <|observation|>) after the SentencePiece vocabulary and starts
every encoded prompt with [gMASK] sop. Baichuan ships no chat template: its role-token
format is built in (BAICHUAN_TEMPLATE).
"""

from __future__ import annotations

import json
import os
import re

from pagedllm.tokenizers.chat import render_chat_template

CHATGLM_COMMANDS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>",
                    "<|assistant|>", "<|observation|>")
CHATGLM2_COMMANDS = 5  # ChatGLM2 has only the first five; the role tokens came with ChatGLM3
# ChatGLM3's prompt format: [gMASK]sop, then "<|role|>\n content" per message.
CHATGLM3_TEMPLATE = (
    "[gMASK]sop{% for m in messages %}<|{{ m['role'] }}|>\n {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# ChatGLM2's prompt format (its build_prompt): numbered rounds of plain text,
# "[Round n]\n\n问：{query}\n\n答：{response}\n\n", with no place for a system message.
CHATGLM2_TEMPLATE = (
    "[gMASK]sop{% set ns = namespace(round=0) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set ns.round = ns.round + 1 %}"
    "[Round {{ ns.round }}]\n\n问：{{ m['content'] }}\n\n答："
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}\n\n"
    "{% else %}{{ raise_exception('the built-in ChatGLM2 chat format has no place for a '"
    " ~ m['role'] ~ ' message: pass chat_template=...') }}{% endif %}{% endfor %}"
)
INTERNLM_MARKS = ("<eoh>", "<eoa>")  # InternLM (v1) turn ends: pieces of its SentencePiece model
# InternLM (v1) chat's prompt format (its build_inputs): BOS, an optional system line, then
# "<|User|>:{query}<eoh>\n<|Bot|>:{response}<eoa>\n" per round; a reply ends with <eoa>.
INTERNLM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<|System|>:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|User|>:{{ m['content'] }}<eoh>\n"
    "{% elif m['role'] == 'assistant' %}<|Bot|>:{{ m['content'] }}<eoa>\n"
    "{% else %}{{ raise_exception('the built-in InternLM chat format has no place for a '"
    " ~ m['role'] ~ ' message: pass chat_template=...') }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Bot|>:{% endif %}"
)


# Baichuan's chat format marks each turn with a role token whose id generation_config.json
# names (`user_token_id`, `assistant_token_id`; 195 and 196 in Baichuan2): the token, then
# the turn's text; a reply is prompted by the assistant token. The role tokens are written as
# their pieces and the template has no place for a system message.
BAICHUAN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ user_token }}"
    "{% elif m['role'] == 'assistant' %}{{ assistant_token }}"
    "{% else %}{{ raise_exception('the built-in Baichuan chat format has no place for a '"
    " ~ m['role'] ~ ' message: pass chat_template=...') }}{% endif %}{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}{{ assistant_token }}{% endif %}"
)


def _content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def is_chatglm(config: dict) -> bool:
    return config.get("tokenizer_class") == "ChatGLMTokenizer" or "chatglm" in json.dumps(
        config.get("auto_map") or {}).lower()


def _is_chatglm2(path: str, tokenizer_config: dict) -> bool:
    """ChatGLM2 and ChatGLM3 ship the same tokenizer files and the same config fields; only
    the name the checkpoint was saved under tells them apart (`name_or_path` in
    tokenizer_config.json, `_name_or_path` in config.json, or the directory's name).
    Anything not named chatglm2 gets ChatGLM3's format."""
    names = [tokenizer_config.get("name_or_path"), os.path.basename(os.path.normpath(path))]
    cfg_path = os.path.join(path, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            names.append(json.load(f).get("_name_or_path"))
    return any(isinstance(n, str) and "chatglm2" in n.lower() for n in names)


def _is_internlm_v1(tokenizer_config: dict) -> bool:
    auto = json.dumps(tokenizer_config.get("auto_map") or {})
    return tokenizer_config.get("tokenizer_class") == "InternLMTokenizer" or "tokenization_internlm." in auto


def _baichuan_roles(path: str, sp) -> list[tuple[str, int]] | None:
    """(piece, id) of the user and assistant role tokens that generation_config.json names,
    or None. Only reserved-looking pieces (`<...>`, or control pieces) qualify: an ordinary
    piece written into the prompt text could not be told apart from the user's own text."""
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return None
    with open(gen_path) as f:
        gen = json.load(f)
    ids = [gen.get("user_token_id"), gen.get("assistant_token_id")]
    if not all(isinstance(i, int) and 0 <= i < sp.get_piece_size() for i in ids):
        return None
    pieces = [sp.id_to_piece(i) for i in ids]
    if not all(sp.is_control(i) or (p.startswith("<") and p.endswith(">") and len(p) > 2)
               for i, p in zip(ids, pieces, strict=True)):
        return None
    return list(zip(pieces, ids, strict=True))


class SentencePieceTokenizer:
    """The part of the transformers tokenizer interface the engine and server use."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.name_or_path = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path}/tokenizer.model is not a SentencePiece model: pass "
                             "tokenizer=... or skip_tokenizer_init=True") from e
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = {}
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        n = self.sp.get_piece_size()
        self.chatglm = is_chatglm(cfg)
        chatglm2 = self.chatglm and _is_chatglm2(path, cfg)
        specials: dict[str, int] = {}
        if self.chatglm:
            commands = CHATGLM_COMMANDS[:CHATGLM2_COMMANDS] if chatglm2 else CHATGLM_COMMANDS
            specials = {t: n + i for i, t in enumerate(commands)}
        for sid, tok in (cfg.get("added_tokens_decoder") or {}).items():
            specials.setdefault(_content(tok), int(sid))
        self._template_vars: dict[str, str] = {}
        roles = None if self.chatglm or cfg.get("chat_template") else _baichuan_roles(path, self.sp)
        if roles:
            self._template_vars = {"user_token": roles[0][0], "assistant_token": roles[1][0]}
            specials.update(roles)  # so that encode() maps the written pieces back to the ids
        for i in range(n):  # control / user-defined pieces written literally in prompts
            piece = self.sp.id_to_piece(i)
            if self.sp.is_control(i) or (piece.startswith("<|") and piece.endswith("|>")):
                specials.setdefault(piece, i)
        internlm = _is_internlm_v1(cfg)
        for piece in INTERNLM_MARKS if internlm else ():
            i = self.sp.piece_to_id(piece)
            if i != self.sp.unk_id():
                specials.setdefault(piece, i)
        self.special_tokens = specials
        self._id_to_special = {i: t for t, i in specials.items()}
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")") if specials else None
        self.bos_token = _content(cfg.get("bos_token")) or self._piece(self.sp.bos_id())
        self.eos_token = _content(cfg.get("eos_token")) or self._piece(self.sp.eos_id())
        self.bos_token_id = self._id(self.bos_token)
        self.add_bos = bool(cfg.get("add_bos_token", not self.chatglm)) and self.bos_token_id is not None
        eos = self._id(self.eos_token)
        self._eos = [eos] if eos is not None else []
        if self.chatglm and not chatglm2:  # a ChatGLM3 turn ends when the model starts the next role
            self._eos += [specials["<|user|>"], specials["<|observation|>"]]
        elif internlm and "<eoa>" in specials:  # an InternLM chat reply ends with <eoa>
            self._eos.append(specials["<eoa>"])
        self.pad_token_id = self._id(_content(cfg.get("pad_token")))
        builtin = (CHATGLM2_TEMPLATE if chatglm2 else CHATGLM3_TEMPLATE if self.chatglm
                   else BAICHUAN_TEMPLATE if roles else INTERNLM_TEMPLATE if internlm else None)
        self.chat_template = cfg.get("chat_template") or builtin
        self._size = max([n - 1, *specials.values()]) + 1

    def _piece(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self.special_tokens:
            return self.special_tokens[token]
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self._piece(self.sp.unk_id()) else i

    # -------------------------------------------------------------- special ids
    @property
    def eos_token_id(self) -> int | list[int] | None:
        if not self._eos:
            return None
        return self._eos[0] if len(self._eos) == 1 else list(self._eos)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(set(self._id_to_special) | {self.sp.bos_id(), self.sp.eos_id()} - {-1})

    @property
    def vocab_size(self) -> int:
        return self._size

    def __len__(self) -> int:
        return self._size

    # -------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        if add_special_tokens:
            if self.chatglm:
                ids += [self.special_tokens["[gMASK]"], self.special_tokens["sop"]]
            elif self.add_bos:
                ids.append(self.bos_token_id)
        for chunk in (self._split.split(text) if self._split else [text]):
            if chunk in self.special_tokens:
                ids.append(self.special_tokens[chunk])
            elif chunk:
                ids += self.sp.encode(chunk)
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        if isinstance(ids, int):
            ids = [ids]
        out, run = [], []
        n = self.sp.get_piece_size()
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        for i in ids:
            if i in skip:
                continue
            if i in self._id_to_special or not 0 <= i < n:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if i in self._id_to_special:
                    out.append(self._id_to_special[i])
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def convert_ids_to_tokens(self, ids):
        def one(i):
            return self._id_to_special.get(i) or self._piece(i) or ""

        return one(ids) if isinstance(ids, int) else [one(i) for i in ids]

    def apply_chat_template(self, conversation, chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False, **kwargs):
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.name_or_path!r} has no chat template: pass chat_template=...")
        text = render_chat_template(template, conversation,
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                    **{**self._template_vars, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text
