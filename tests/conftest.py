"""Shared fixtures: tiny random HF models on disk, the real SmolLM2 model, GPU marker."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

try:
    import torch
except ImportError:  # CI's run of the pure-Python core tests has no torch installed
    torch = None

sys.path.insert(0, os.path.dirname(__file__))
if torch is not None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Engines freeze the heap they start with (pagedllm/heap.py): right for a process that
# serves for its lifetime, not for this one, which builds hundreds of engines and drops
# them (frozen objects are never collected). The servers the tests start freeze as in
# production (tests/server_process.py sets it back for them).
os.environ.setdefault("PAGEDLLM_GC_FREEZE", "0")

# pagedllm's cache (converted GGUF tokenizers) goes to a directory of this test run, not the
# user's: set here, at import, so that the servers the tests start inherit it.
_CACHE_DIR = None
if "PAGEDLLM_CACHE_DIR" not in os.environ:
    _CACHE_DIR = os.environ["PAGEDLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedllm-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch is not None and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model_type -> (checkpoint dir, HF reference model)."""
    from hf_models import save_tiny_model

    cache: dict = {}

    def get(model_type: str, **overrides):
        key = (model_type, repr(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(model_type))
            cache[key] = (path, save_tiny_model(path, model_type, **overrides))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def smol_llm():
    """The real default model (SmolLM2-135M-Instruct, GGUF), loaded once."""
    from pagedllm import LLM

    return LLM(max_model_len=2048, seed=0)
