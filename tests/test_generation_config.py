"""`LLM(generation_config=...)` and `get_default_sampling_params()`, as vLLM's: the
checkpoint's generation_config.json gives the defaults used when no SamplingParams are
passed; "vllm" ignores the file."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from hf_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-gen")
    save_tiny_model(str(path), "llama")
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.5, "top_k": 5, "max_new_tokens": 4, "eos_token_id": 2}))
    return str(path)


def test_auto_takes_the_checkpoints_defaults_and_generate_uses_them(checkpoint, monkeypatch):
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=64)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.max_tokens) == (0.5, 5, 4)
    assert (default.top_p, default.min_p) == (1.0, 0.0)  # not in the file: SamplingParams'
    seen: list[SamplingParams] = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request",
                        lambda rid, text, ids, p, *rest: (seen.append(p), add(rid, text, ids, p, *rest))[1])
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}])  # no params: the defaults
    assert seen[0].max_tokens == 4 and seen[0].temperature == 0.5
    assert 1 <= len(out[0].outputs[0].token_ids) <= 4
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    assert seen[1].max_tokens == 2 and seen[1].temperature == 1.0  # given params win


def test_vllm_ignores_the_file(checkpoint):
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=64,
              generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_folder_without_the_file_is_refused_before_loading(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json in"):
        LLM(model=checkpoint, generation_config=str(tmp_path))
