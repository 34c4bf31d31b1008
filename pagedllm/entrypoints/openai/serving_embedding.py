"""POST /v1/embeddings: each input one pooling request, batched by the engine with
everything else it runs. The vectors come from the model's pooling (sentence-transformers'
files, else the last token, normalized); `dimensions` cuts them where the model declares
Matryoshka dimensions, and `encoding_format=base64` sends little-endian float32 bytes, as
OpenAI does (the official client asks for base64 unless told otherwise)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from .protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from .serving_engine import APIError, OpenAIServing, as_api_error, random_id

# One input as the engine takes it: text, or token ids.
EmbeddingInput = str | list[int]


def split_inputs(value: object) -> list[EmbeddingInput]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of
    token-id lists. 400 naming the first item that is none of these."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise APIError("input must be a string, a list of strings, a list of token ids or a "
                       "list of token-id lists", 400, "input")
    if not value:
        raise APIError("input must not be an empty list", 400, "input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise APIError(f"input has {len(value)} items; one request may embed at most "
                       f"{MAX_EMBEDDING_INPUTS}", 400, "input")
    if all(_is_token(t) for t in value):
        return [list(value)]
    items: list[EmbeddingInput] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            items.append(list(item))
        elif isinstance(item, list) and not item:
            raise APIError(f"input[{i}] is an empty list of token ids", 400, "input")
        else:
            raise APIError(f"input[{i}] must be a string or a list of token ids, got "
                           f"{type(item).__name__}", 400, "input")
    kinds = {isinstance(i, str) for i in items}
    if len(kinds) > 1:
        raise APIError("input mixes strings and token-id lists: send one kind", 400, "input")
    return items


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def encode_vector(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class OpenAIServingEmbedding(OpenAIServing):
    endpoint = "/v1/embeddings"

    async def create(self, req: EmbeddingRequest) -> dict:
        """OpenAI's embedding list, as plain data: the server writes it with msgspec (a
        large batch of float vectors is most of the response's cost)."""
        self.check_request(req)
        inputs = split_inputs(req.input)
        self.admission.check(len(inputs), "input")
        try:
            params = self.engine.processor.pooler_config.params(req.dimensions)
        except ValueError as e:
            raise APIError(str(e), 400, "dimensions") from None
        truncate = req.truncate_prompt_tokens
        if truncate is not None and truncate != -1 and not 1 <= truncate <= self.max_model_len:
            raise APIError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}], "
                           f"got {truncate}", 400, "truncate_prompt_tokens")
        texts = [item for item in inputs if isinstance(item, str)]
        if truncate is None:
            for text in texts:
                self.check_text_size(len(text), "input")
        if texts:  # one batch, off the event loop
            self.require_tokenizer()
            encoded = iter(await asyncio.to_thread(self.engine.processor.encode_many, texts))
        prompts = [self._tokens(i, (item, next(encoded)) if isinstance(item, str) else (None, item),
                                truncate) for i, item in enumerate(inputs)]
        request_id = random_id("embd")
        self.admission.enter(len(prompts))
        tasks = [asyncio.ensure_future(self.engine.encode(f"{request_id}-{i}", text, ids,
                                                          params, truncate))
                 for i, (text, ids) in enumerate(prompts)]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException as e:  # one failed, or the client left: the rest stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(e, Exception):
                raise as_api_error(e, req) from None
            raise
        finally:
            self.admission.leave(len(prompts))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_vector(o.outputs.embedding, req.encoding_format)}
                for i, o in enumerate(outs)]
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _tokens(self, i: int, prompt: tuple[str | None, list[int]], truncate: int | None
                ) -> tuple[str | None, list[int]]:
        """One input's (text, token ids), checked: 400 for an empty one, or one longer than
        the context (unless truncate_prompt_tokens cuts it)."""
        text, ids = prompt
        limit = self.max_model_len
        if not ids:
            raise APIError(f"input[{i}] is empty: it must contain at least one token", 400, "input")
        if truncate is None and len(ids) > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens, and input[{i}] "
                           f"has {len(ids)} tokens. Please shorten it, or set "
                           "truncate_prompt_tokens.", 400, "input", "context_length_exceeded")
        return text, ids
