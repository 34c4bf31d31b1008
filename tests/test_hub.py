"""Hugging Face Hub ids as model arguments (pagedllm.hub), offline: a cache laid out by
hand the way huggingface_hub writes it (models--org--name/refs/main -> a commit,
snapshots/<commit>/ with the files), read with HF_HUB_OFFLINE=1; and the weight loader's
progress lines."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.hub import hub_cache_dir, looks_like_hub_id
from pagedllm.model_executor.loader import loader
from pagedllm.model_source import resolve_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-qwen3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["w1 w2 w3", "w200 w7"]


def _save_tokenizer(path: str) -> None:
    """A word-level tokenizer over the tiny model's 256 ids: w0..w254 and [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 255, **{f"w{i}": i for i in range(255)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


def _lay_out_cache(cache: str, repo: str, snapshot_files_from: str, commit: str = COMMIT) -> str:
    """huggingface_hub's cache layout for one repo at `commit`, its main branch; returns
    the snapshot directory."""
    import shutil

    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(commit)
    snap = os.path.join(root, "snapshots", commit)
    shutil.copytree(snapshot_files_from, snap)
    return snap


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random Qwen3 in two safetensors files, with tokenizer files."""
    from hf_models import random_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    random_tiny_model("qwen3").save_pretrained(path, safe_serialization=True,
                                               max_shard_size="300KB")
    _save_tokenizer(path)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 2
    return path


@pytest.fixture
def hf_home(tmp_path, monkeypatch, checkpoint) -> str:
    """HF_HOME in tmp_path with REPO in its hub cache; offline."""
    home = str(tmp_path / "hf-home")
    monkeypatch.setenv("HF_HOME", home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _lay_out_cache(os.path.join(home, "hub"), REPO, checkpoint)
    return home


def _greedy(model: str, **kw) -> list[list[int]]:
    llm = LLM(model=model, block_size=4, num_kv_blocks=64, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


def test_which_arguments_are_hub_ids(tmp_path, monkeypatch):
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and looks_like_hub_id("org/name.v2")
    for local in ("/models/x", "./a/b", "a/b/c", "model.gguf", "dir/model.gguf", "../a/b"):
        assert not looks_like_hub_id(local), local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_hub_id("org/name")  # an existing local directory wins


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert hub_cache_dir() == str(tmp_path / "h" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == str(tmp_path / "c")
    assert hub_cache_dir(str(tmp_path / "d")) == str(tmp_path / "d")


def test_a_cached_hub_id_generates_like_its_snapshot_directory(hf_home, checkpoint):
    source = resolve_source(REPO)
    assert source.path == os.path.join(hf_home, "hub", "models--tiny-org--tiny-qwen3",
                                       "snapshots", COMMIT)
    assert source.load_format == "safetensors"
    by_id = _greedy(REPO)
    assert by_id == _greedy(source.path) == _greedy(checkpoint)
    assert all(len(t) == GREEDY.max_tokens for t in by_id)
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.serving_engine import model_aliases

    config = EngineConfig(model=REPO)
    assert config.model_name == REPO  # the id, as vLLM serves it
    assert model_aliases(config) == {REPO, "tiny-qwen3"}


def test_download_dir_is_the_cache(tmp_path, monkeypatch, checkpoint):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = str(tmp_path / "models")
    snap = _lay_out_cache(cache, REPO, checkpoint)
    with pytest.raises(FileNotFoundError):  # not in HF_HOME's cache
        resolve_source(REPO)
    assert resolve_source(REPO, download_dir=cache).path == snap
    # The Python API and the server's flags reach the same field.
    from pagedllm.entrypoints.openai.cli_args import engine_config, make_arg_parser

    args = make_arg_parser().parse_args(["--model", REPO, "--download-dir", cache,
                                         "--revision", COMMIT])
    config = engine_config(args)
    assert (config.download_dir, config.revision) == (cache, COMMIT)
    assert _greedy(REPO, download_dir=cache, revision=COMMIT) == _greedy(checkpoint)


def _one_line_error(excinfo, *parts: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


def test_a_revision_not_in_the_cache_is_one_line(hf_home):
    with pytest.raises(FileNotFoundError) as e:
        LLM(model=REPO, revision="v9-not-cached")
    _one_line_error(e, REPO, "v9-not-cached", os.path.join(hf_home, "hub"), "HF_HUB_OFFLINE")


def test_an_absent_id_offline_is_one_line(hf_home):
    with pytest.raises(FileNotFoundError) as e:
        resolve_source("tiny-org/absent")
    msg = _one_line_error(e, "tiny-org/absent", os.path.join(hf_home, "hub"), "HF_HUB_OFFLINE")
    assert "local directory" in msg


def test_plan_reads_a_cached_hub_id(hf_home):
    from pagedllm.entrypoints.plan import plan_rows

    info, rows = plan_rows(REPO)
    assert info["model"] == REPO and info["architecture"] == "Qwen3ForCausalLM" and rows


def test_serve_an_absent_id_exits_with_one_line(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "org/absent",
                        "--host", "127.0.0.1", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "org/absent" in ln]
    assert len(lines) == 1 and str(tmp_path / "hub") in lines[0], r.stderr


def test_load_progress_is_logged_per_file(checkpoint, caplog, monkeypatch):
    monkeypatch.setattr(loader, "PROGRESS_EVERY_S", 0.0)  # a line per file
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        LLM(model=checkpoint, block_size=4, num_kv_blocks=16).engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    n = len([f for f in os.listdir(checkpoint) if f.endswith(".safetensors")])
    assert lines[0].startswith(f"loading weights: {n} files")
    assert [ln.split(",")[0] for ln in lines[1:]] == [
        f"loading weights: {i}/{n} files" for i in range(1, n + 1)]
    assert lines[-1].endswith(" s") and "GiB" in lines[-1]


def test_load_progress_is_throttled(checkpoint, caplog, monkeypatch):
    monkeypatch.setattr(loader, "PROGRESS_EVERY_S", 3600.0)  # only the start and the end
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        LLM(model=checkpoint, block_size=4, num_kv_blocks=16).engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    n = len([f for f in os.listdir(checkpoint) if f.endswith(".safetensors")])
    assert len(lines) == 2 and lines[1].startswith(f"loading weights: {n}/{n} files")


def test_plan_needs_only_the_config_but_loading_needs_every_shard(tmp_path, monkeypatch,
                                                                   checkpoint):
    """A snapshot with the config alone (what a plan fetches) plans; one with a shard
    missing from its index is not loaded as if complete."""
    import shutil

    from pagedllm.entrypoints.plan import plan_rows

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(os.path.join(checkpoint, "config.json"), config_only)
    _lay_out_cache(str(tmp_path / "cache"), "tiny-org/config-only", str(config_only))
    info, _ = plan_rows("tiny-org/config-only")
    assert info["architecture"] == "Qwen3ForCausalLM"
    with pytest.raises(FileNotFoundError) as e:
        resolve_source("tiny-org/config-only")
    _one_line_error(e, "tiny-org/config-only", "incomplete", str(tmp_path / "cache"))

    snap = _lay_out_cache(str(tmp_path / "cache"), "tiny-org/cut-short", checkpoint)
    shards = sorted(f for f in os.listdir(snap) if f.endswith(".safetensors"))
    os.remove(os.path.join(snap, shards[-1]))
    with pytest.raises(FileNotFoundError) as e:
        resolve_source("tiny-org/cut-short")
    _one_line_error(e, "tiny-org/cut-short", "incomplete")


def test_a_missing_id_is_downloaded_once_in_one_weight_format(tmp_path, monkeypatch,
                                                              checkpoint):
    """Online (HF_HUB_OFFLINE unset), a cache miss downloads the config, tokenizer and
    the safetensors only (not the same weights again as .bin); a failed download is one
    line. huggingface_hub's network calls are stood in for."""
    import shutil

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls: list[dict] = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append(kw)
        if kw.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        snap = os.path.join(kw["cache_dir"], "fake-snapshot")
        shutil.copytree(checkpoint, snap, dirs_exist_ok=True)
        return snap

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision=None: [
        "config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"])
    source = resolve_source("tiny-org/remote", revision="v1")
    assert source.path == str(tmp_path / "cache" / "fake-snapshot")
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    patterns = calls[1]["allow_patterns"]
    assert "*.safetensors" in patterns and "*.bin" not in patterns and "*.json" in patterns
    assert calls[1]["revision"] == "v1" and calls[1]["cache_dir"] == str(tmp_path / "cache")

    def no_network(repo_id, revision=None):
        raise ConnectionError("Name or service not known\nsecond line")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", no_network)
    with pytest.raises(FileNotFoundError) as e:
        resolve_source("tiny-org/unreachable")
    _one_line_error(e, "tiny-org/unreachable", "could not be downloaded", "ConnectionError",
                    str(tmp_path / "cache"))
