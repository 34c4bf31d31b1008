"""Multi-LoRA through the real server and the official openai client: adapters listed in
/v1/models with their parent, chosen by `model`, each answering as transformers + PEFT
with that adapter; loaded and unloaded at run time; unknown and bad adapters refused
while the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from hf_models import hf_greedy, save_tiny_model
from lora_adapters import make_adapter
from server_process import launch_server

from pagedllm.config import default_model_path

PROMPT = [5, 17, 300, 42, 9, 1000]
MAX_NEW = 6


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory) -> Iterator[tuple[str, dict, object]]:
    """(url, adapter dirs and reference models by name, tokenizer)."""
    from pagedllm.tokenizers import gguf_tokenizer

    root = tmp_path_factory.mktemp("lora-server")
    path = root / "tiny"
    tok = gguf_tokenizer(default_model_path())
    hf = save_tiny_model(str(path), "llama", vocab_size=len(tok), max_position_embeddings=256)
    tok.save_pretrained(str(path))
    refs = {"base": (None, hf)}
    for i, name in enumerate(("sql", "poet", "rank64")):
        d = str(root / name)
        refs[name] = (d, make_adapter(hf, d, seed=20 + i, r=64 if name == "rank64" else 8))
    flags = ["--model", str(path), "--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "128",
             "--max-num-seqs", "8", "--enable-lora", "--lora-modules", f"sql={refs['sql'][0]}",
             "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating"]
    with launch_server(root, flags) as sp:
        yield sp.url, refs, tok


def _answer(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_adapters_answer_as_peft(lora_server):
    url, refs, tok = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    base_name = client.models.list().data[0].id
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base_name, "sql"}
    assert cards["sql"].model_extra["parent"] == base_name

    want = {name: tok.decode(hf_greedy(ref, PROMPT, MAX_NEW)[0]) for name, (_, ref) in refs.items()}
    assert want["sql"] != want["base"] and want["poet"] != want["base"]
    assert _answer(client, "sql") == want["sql"]
    assert _answer(client, base_name) == want["base"]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0)
    assert chat.model == "sql"
    stream = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(c.model == "sql" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat.choices[0].message.content

    # unknown adapter: 404, as for an unknown model
    with pytest.raises(openai.NotFoundError):
        _answer(client, "poet")

    # loaded at run time, then served beside the others
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": refs["poet"][0]})
        assert r.status_code == 200, r.text
        # the same name twice, a rank above --max-lora-rank, a missing folder: 400
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": refs["poet"][0]})
        assert r.status_code == 400
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": refs["rank64"][0]})
        assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/no/such/dir"})
        assert r.status_code == 400
    assert "poet" in {m.id for m in client.models.list().data}
    assert _answer(client, "poet") == want["poet"]
    chat_free = client.completions.create(model="sql", prompt=[PROMPT, PROMPT[:3]], max_tokens=2,
                                          temperature=0)
    assert len(chat_free.choices) == 2

    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _answer(client, "poet")
    assert _answer(client, "sql") == want["sql"]  # still serving
    assert 'pagedllm:lora_requests_info{max_lora="2"' in httpx.get(f"{url}/metrics").text


def test_lora_flags_are_checked_before_the_model_loads():
    from pagedllm.entrypoints.openai.cli_args import engine_config, lora_modules, make_arg_parser

    parser = make_arg_parser()
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2",
                              "--max-lora-rank", "32", "--max-cpu-loras", "4"])
    assert lora_modules(args) == [("a", "/x"), ("b", "/y")]
    cfg = engine_config(args)
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (True, 2, 32, 4)
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_modules(parser.parse_args(["--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_modules(parser.parse_args(["--allow-runtime-lora-updating"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-lora", "--lora-modules", "no-equals-sign"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        engine_config(parser.parse_args(["--max-loras", "4", "--max-cpu-loras", "2"]))
