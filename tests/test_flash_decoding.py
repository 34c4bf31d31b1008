"""Flash-decoding (decode launches that split each sequence's keys over programs) on the
CPU, in Triton's interpreter: the kernel cases of test_triton_attention.py that force
splits (and those over head-major pages), and a whole engine on the Triton attention backend with the default settings (splits on),
whose greedy tokens must equal HF transformers', and PAGEDLLM_DECODE_KV_SPLITS=1 turning
them off; and the decode graphs' second set, for one long context among short ones. In
subprocesses: TRITON_INTERPRET and PAGEDLLM_DECODE_KV_SPLITS are read when
the modules are imported."""

from __future__ import annotations

import pytest
from interpreted import run_interpreted

ENGINE_CASE = """
import random, sys
sys.path.insert(0, "tests")
from hf_models import hf_greedy, save_tiny_model
from pagedllm import LLM, SamplingParams
from pagedllm.attention.triton_backend import TritonPagedAttention

hf = save_tiny_model(sys.argv[1], "llama")
splits = []  # each decode launch's split count
launch = TritonPagedAttention._split_launch
def spy(*a):
    if a[12]:  # direct: a decode launch
        splits.append(a[9])
    return launch(*a)
TritonPagedAttention._split_launch = staticmethod(spy)
llm = LLM(model=sys.argv[1], device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=256)
random.seed(0)
prompts = [[random.randrange(5, 100) for _ in range(n)] for n in (150, 90)]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
for p, o in zip(prompts, outs):
    assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 6)[0], (o.outputs[0].token_ids, p[:5])
want_split = sys.argv[2] == "on"
assert splits and all((n > 1) == want_split for n in splits), splits  # every decode launch
kc = llm.engine.executor.runner.kv_caches[0][0]  # [blocks, page, kv heads, dim] either way
head_major = kc.stride(2) == kc.shape[1] * kc.shape[3]
assert head_major == (sys.argv[3] == "hnd"), (kc.shape, kc.stride())
print("ok", splits[:3])
"""


def test_split_kernel_cases_interpreted():
    pytest.importorskip("triton")
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_attention.py",
                           "-k", "split or head_major"], 600)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
    assert "skipped" not in res.stdout.splitlines()[-1], res.stdout[-500:]


@pytest.mark.parametrize("splits,layout", [("default", "nhd"), ("1", "nhd"), ("default", "hnd")])
def test_engine_with_split_decodes_matches_hf(tmp_path, splits, layout):
    """Also with head-major pages (PAGEDLLM_KV_LAYOUT=hnd): the pool's layout changes, the
    tokens do not."""
    pytest.importorskip("triton")
    res = run_interpreted(["-c", ENGINE_CASE, str(tmp_path), "on" if splits == "default" else "off", layout],
                          600, PAGEDLLM_ATTENTION_BACKEND="triton", PAGEDLLM_KV_LAYOUT=layout,
                          PAGEDLLM_DECODE_KV_SPLITS=None if splits == "default" else splits)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1].startswith("ok"), \
        res.stdout[-2000:] + res.stderr[-3000:]


def test_long_decode_graphs_interpreted():
    """tests/test_long_decode_graphs.py in Triton's interpreter: DecodeGraphs' second set
    (stand-in graphs) replayed for one long context among short ones."""
    pytest.importorskip("triton")
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_long_decode_graphs.py",
                           "-k", "interpreted"], 600)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
