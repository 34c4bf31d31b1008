"""vLLM's serving flags end to end (issue 30), on one real server over HTTPS: a self-signed
certificate made here, --root-path behind a (simulated) proxy prefix, --generation-config
from a folder, --max-logprobs, and the default model's id without `.gguf`."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
from server_process import launch_server

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
MAX_NEW_TOKENS = 3
MAX_LOGPROBS = 2


def self_signed_cert(folder: Path) -> tuple[str, str]:
    """(key, certificate) for 127.0.0.1, from the openssl command line."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return str(key), str(cert)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flags")
    key, cert = self_signed_cert(tmp)
    gen = tmp / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": MAX_NEW_TOKENS, "top_k": 1}))
    flags = ["--max-model-len", "512", "--num-kv-blocks", "64", "--root-path", "/llm",
             "--ssl-keyfile", key, "--ssl-certfile", cert, "--generation-config", str(gen),
             "--max-logprobs", str(MAX_LOGPROBS), "--log-level", "info"]
    with launch_server(tmp, flags, https_ca=cert) as sp:
        yield sp, cert


@pytest.fixture(scope="module")
def http(server):
    sp, cert = server
    trust = ssl.create_default_context(cafile=cert)
    with httpx.Client(base_url=sp.url, verify=trust, timeout=60) as client:
        yield client


def test_https_with_the_given_certificate(server, http):
    sp, _ = server
    assert sp.url.startswith("https://")
    assert http.get("/health").status_code == 200
    with pytest.raises(httpx.ConnectError):  # a client that does not trust it is refused
        httpx.get(f"{sp.url}/health", timeout=10)
    assert f"{sp.url}/llm/v1" in sp.log.read_text()  # the banner names scheme and prefix


def test_the_default_gguf_is_served_without_its_suffix(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL_ID]
    for name in (MODEL_ID, f"{MODEL_ID}.gguf"):  # the old id still answers
        r = http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == MODEL_ID


def test_root_path_names_the_prefix(http):
    """The routes answer as the proxy passes them on, and links carry the prefix."""
    assert http.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    assert http.get("/docs").status_code == 200 and "/llm/openapi.json" in http.get("/docs").text


def test_generation_config_gives_defaults_a_request_can_override(server, http):
    sp, _ = server
    log = sp.log.read_text()
    assert f"max_tokens={MAX_NEW_TOKENS}" in log and "top_k=1" in log, log[-2000:]
    body = {"prompt": "Once upon a time", "ignore_eos": True}
    unset = http.post("/v1/completions", json=body).json()
    assert unset["usage"]["completion_tokens"] == MAX_NEW_TOKENS  # not the schema's 16
    sent = http.post("/v1/completions", json={**body, "max_tokens": 16}).json()
    assert sent["usage"]["completion_tokens"] == 16  # sent, even if equal to the schema's
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me a story"}], "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == MAX_NEW_TOKENS


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": MAX_LOGPROBS + 1, "echo": True},
     "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     "top_logprobs"),
])
def test_max_logprobs_caps_a_request_with_a_400(http, path, body, param):
    r = http.post(path, json={**body, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "--max-logprobs" in err["message"]
    assert str(MAX_LOGPROBS) in err["message"]


def test_logprobs_up_to_the_cap_are_served(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                           "logprobs": MAX_LOGPROBS})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == MAX_LOGPROBS
