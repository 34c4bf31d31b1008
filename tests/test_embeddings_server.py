"""/v1/embeddings end to end: the real SmolLM2 server (the default model) and the official
openai client. Vectors are checked against the engine's own one-by-one answers (batching
must not change them) and against each other across encodings; every malformed input gets
OpenAI's error object with a 400."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from server_process import launch_server

TEXTS = ["The cat sat on the mat.", "Paged attention keeps the KV cache in blocks.",
         "hello", "A longer sentence about embeddings, which are vectors of numbers."]
HIDDEN = 576  # SmolLM2-135M
MAX_LEN = 128


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    flags = ["--max-context-length", str(MAX_LEN), "--num-kv-blocks", "64",
             "--served-model-name", "smol",
             # the same request twice is the same computation: no prefix-cache hit between
             "--no-enable-prefix-caching"]
    with launch_server(tmp_path_factory.mktemp("embed-server"), flags) as sp:
        yield sp.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])


def test_shapes_usage_and_normalization(client: openai.OpenAI):
    resp = client.embeddings.create(model="smol", input=TEXTS, encoding_format="float")
    got = vectors(resp)
    assert resp.object == "list" and resp.model == "smol"
    assert got.shape == (len(TEXTS), HIDDEN)
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)  # last token, L2
    assert len({tuple(v[:4]) for v in got}) == len(TEXTS)  # different texts, different vectors
    tokens = sum(len(client.post("/../tokenize", body={"prompt": t}, cast_to=httpx.Response)
                     .json()["tokens"]) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens


def test_base64_equals_float_and_batch_equals_one_by_one(client: openai.OpenAI, url: str):
    # One input runs alone in its steps, so two requests for it compute the same bits:
    # base64 must carry exactly the float32 values the float encoding shows.
    one = vectors(client.embeddings.create(model="smol", input=TEXTS[1],
                                           encoding_format="float")).astype(np.float32)
    # The client asks for base64 by default and decodes it itself; decode by hand too.
    decoded = vectors(client.embeddings.create(model="smol", input=TEXTS[1]))
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[1],
                                                   "encoding_format": "base64"}, timeout=60).json()
    by_hand = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, one)
    np.testing.assert_array_equal(by_hand, one[0])
    # Several inputs are batched as their requests arrive (the batch's shape varies, and
    # with it the last bits of a CPU matmul): equal within float32 rounding.
    floats = vectors(client.embeddings.create(model="smol", input=TEXTS, encoding_format="float"))
    batched_b64 = vectors(client.embeddings.create(model="smol", input=TEXTS))
    one_by_one = np.array([vectors(client.embeddings.create(model="smol", input=t,
                                                            encoding_format="float"))[0]
                           for t in TEXTS])
    np.testing.assert_allclose(batched_b64, floats, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(floats, one_by_one, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(one_by_one[1].astype(np.float32), one[0])


def test_token_id_inputs(client: openai.OpenAI, url: str):
    ids = [httpx.post(f"{url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS[:2]]
    from_text = vectors(client.embeddings.create(model="smol", input=TEXTS[:2],
                                                 encoding_format="float"))
    from_ids = vectors(client.embeddings.create(model="smol", input=ids, encoding_format="float"))
    one = vectors(client.embeddings.create(model="smol", input=ids[0], encoding_format="float"))
    np.testing.assert_allclose(from_ids, from_text, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one[0], from_text[0], rtol=1e-5, atol=1e-6)


def test_truncate_prompt_tokens(client: openai.OpenAI, url: str):
    ids = list(range(100, 100 + MAX_LEN + 20))
    cut = vectors(client.embeddings.create(model="smol", input=[ids], encoding_format="float",
                                           extra_body={"truncate_prompt_tokens": -1}))
    tail = vectors(client.embeddings.create(model="smol", input=[ids[-MAX_LEN:]],
                                            encoding_format="float"))
    np.testing.assert_allclose(cut, tail, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("body", "words"), [
    ({"input": []}, "empty list"),
    ({"input": ["ok", 3.5]}, "input[1]"),
    ({"input": ["ok", {"text": "x"}]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": None}, "input must be"),
    ({"input": "word " * (MAX_LEN + 10)}, "maximum context length"),
    ({"input": [list(range(1, MAX_LEN + 2))]}, "maximum context length"),
    ({"input": [[1, 10**9]]}, "token ids"),
    ({"input": "hi", "dimensions": 8}, "Matryoshka"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": "nope"}, "does not exist"),
])
def test_bad_inputs_get_openai_errors(url: str, body: dict, words: str):
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == (404 if "model" in body else 400), r.text
    assert words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_bad_input_through_the_client(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="smol", input=[])
    assert e.value.body["message"]  # OpenAI's error object, read by the client
