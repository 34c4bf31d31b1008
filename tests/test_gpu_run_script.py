"""benchmarks/gpu_run.sh, the script every device call runs: a typo in it costs a scarce
device call, so its parsing and its switches are checked here, on the CPU, with `python3`
stood in for by a stub that logs each call's switches and arguments instead of running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_run.sh"


def _dry_run(tmp_path: Path, part: str, **env: str) -> list[str]:
    """Run a part with a logging stub as python3; the stub's log lines (one per call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.log"
    stub = bin_dir / "python3"
    stub.write_text('#!/usr/bin/env bash\n'
                    # here-documents (the script's own helpers: summaries, picks) run for real
                    'if [ "$1" = "-" ]; then exec "$REAL_PYTHON" "$@"; fi\n'
                    'echo "graphs=${PAGEDLLM_MAX_GRAPH_BATCH-unset} sampler=${PAGEDLLM_FUSED_SAMPLER-unset} '
                    'ragged=${PAGEDLLM_FLASHINFER_RAGGED-unset} fq=${PAGEDLLM_FP8_FUSED_QUANT-unset} '
                    'backend=${PAGEDLLM_ATTENTION_BACKEND-unset} kvl=${PAGEDLLM_KV_LAYOUT-unset} '
                    'hf=${PAGEDLLM_DECODE_HEADS_FIRST-unset} tu=${PAGEDLLM_GRAPH_TABLE_UPLOAD-unset} '
                    'sk=${PAGEDLLM_SKINNY_FP8_MAX_ROWS-unset} fa=${PAGEDLLM_FP8_FAST_ACCUM-unset} $*" >> "$CALLS_LOG"\n'
                    'cat > /dev/null  # a here-document, if any\n')
    stub.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS_LOG": str(log), "REAL_PYTHON": sys.executable,
            "OUT": str(tmp_path / "out"), "BUDGET_S": "300", **env}
    res = subprocess.run(["bash", str(SCRIPT), part], env=full, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_script_parses_and_every_listed_part_has_a_branch():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    listed = re.search(r"#\s+bash benchmarks/gpu_run.sh (\S+)", text).group(1).split("|")
    labels = {p for line in re.findall(r"^([a-z0-9|-]+)\)$", text, re.M) for p in line.split("|")}
    assert len(listed) > 20 and not set(listed) - labels, set(listed) - labels


def test_trt_runs_each_workload_per_graph_cap(tmp_path):
    calls = _dry_run(tmp_path, "trt", TRT_WORKLOADS="trt-8b-2k", TRT_GRAPHS="256 512", TRT_ATTN="1",
                     NUM_PROMPTS="100")
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2, calls
    for cap, run in zip(("256", "512"), runs, strict=True):
        assert run.startswith(f"graphs={cap} ") and f"trt-8b-2k-g{cap}.json" in run
        assert "--workload trt-8b-2k" in run and "--num-prompts 100" in run
    attn = [c for c in calls if "attn_decode_bench.py" in c]
    assert len(attn) == 1 and "--batch 512" in attn[0] and "--pages fp8" in attn[0]
    # without TRT_GRAPHS: each workload once, the graph cap left to its default
    calls = _dry_run(tmp_path / "plain", "trt", TRT_WORKLOADS="trt-8b-1k")
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 1 and runs[0].startswith("graphs=unset sampler=unset ") and "out/trt-8b-1k.json" in runs[0]
    # TRT_SAMPLER: the fused sampler's GPU tests, then each workload with it off and on
    calls = _dry_run(tmp_path / "sampler", "trt", TRT_WORKLOADS="trt-8b-2k", TRT_SAMPLER="0 1")
    assert "tests/test_fused_sampler.py" in calls[0]
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2, calls
    for flag, run in zip(("0", "1"), runs, strict=True):
        assert run.startswith(f"graphs=unset sampler={flag} ") and f"trt-8b-2k-s{flag}.json" in run
    # TRT_FUSED_QUANT / TRT_TESTS / TRT_HOST: the FP8 GPU tests first, each workload with the
    # norm / SiLU kernels' quantization off and on, then the host table
    calls = _dry_run(tmp_path / "fq", "trt", TRT_WORKLOADS="trt-8b-1k", TRT_FUSED_QUANT="0 1", TRT_TESTS="1",
                     TRT_HOST="1")
    assert "-m gpu tests/test_fp8_fused_quant.py" in calls[0]
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2, calls
    for flag, run in zip(("0", "1"), runs, strict=True):
        assert f" fq={flag} " in run and f"trt-8b-1k-q{flag}.json" in run
    assert "host_sync_check.py --workload trt-8b-2k" in calls[-1]


def test_long_fi_steps_pick_ragged_or_paged(tmp_path):
    calls = _dry_run(tmp_path, "long-fi", STEPS="ttft chunk8192 paged32768",
                     LONG_ARGS="--max-num-batched-tokens 32768")
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 3, calls
    ttft, chunk, paged = runs
    assert "backend=flashinfer" in ttft and "--backend both" in ttft and "--max-num-batched-tokens 32768" in ttft
    assert "ragged=1" in chunk and "--max-num-batched-tokens 8192" in chunk
    assert "ragged=0" in paged and "--max-num-batched-tokens 32768" in paged
    assert not any("-m pytest" in c for c in calls)  # "tests" was not among the steps


def test_trt_probe_times_the_step_per_switch(tmp_path):
    """trt-probe: the profiled step first, then the step's wall time alone per switch
    (fused quantization off, head-major pages, the heads-first grid, both), then the
    microbenchmarks (FlashInfer's decode last, where its wheels install: the stub says they do)."""
    calls = _dry_run(tmp_path, "trt-probe")
    steps = [c for c in calls if "decode_step_profile.py" in c]
    assert len(steps) == 6, calls
    assert "--profile-steps 0" not in steps[0] and "decode-step-trt-8b.json" in steps[0]
    want = [("fq=0", "kvl=unset", "hf=unset", "-q0.json"), ("fq=unset", "kvl=hnd", "hf=unset", "-hnd.json"),
            ("fq=unset", "kvl=unset", "hf=1", "-hf1.json"), ("fq=unset", "kvl=hnd", "hf=1", "-hnd-hf1.json"),
            ("fq=unset", "kvl=unset", "hf=unset", "-tcompact.json")]
    for call, marks in zip(steps[1:], want, strict=True):
        assert "--profile-steps 0" in call and all(m in call for m in marks), (call, marks)
    attn = [c for c in calls if "attn_decode_bench.py" in c]
    assert len(attn) == 2 and "--heads-first 0 1" in attn[0] and "--flashinfer" in attn[1], attn
    assert all("--layout nhd hnd" in c for c in attn)
    assert any("fp8_scaling_bench.py" in c for c in calls)


def test_fp8_b1_runs_bf16_and_fp8_with_and_without_the_kernel(tmp_path):
    calls = _dry_run(tmp_path, "fp8-b1", B1_OUT="256")
    assert "-m pytest" in calls[0] and "tests/test_skinny_gemm.py" in calls[0]
    assert any("skinny_gemm_bench.py --fp8 --rows 1 2 4" in c for c in calls)
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 3, calls
    bf16, fp8, off = runs
    assert all("--num-prompts 1 --input-len 128 --output-len 256" in r for r in runs)
    assert "--quantization" not in bf16 and "b1-8b-bf16.json" in bf16
    assert "--quantization fp8" in fp8 and "b1-8b-fp8.json" in fp8
    assert "--quantization fp8" in off and "b1-8b-fp8-noskinny.json" in off
    assert "sk=unset" in bf16 and "sk=1" in fp8 and "sk=0" in off


def test_trt_kv_layout_switch(tmp_path):
    calls = _dry_run(tmp_path, "trt", TRT_WORKLOADS="trt-8b-2k", TRT_KV_LAYOUT="nhd hnd")
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2 and "kvl=nhd" in runs[0] and "trt-8b-2k-nhd.json" in runs[0], runs
    assert "kvl=hnd" in runs[1] and "trt-8b-2k-hnd.json" in runs[1]


def test_trt_pick_runs_the_defaults_and_the_fastest_variant(tmp_path):
    """trt-pick: the step timings per switch, then trt-8b-2k with the defaults, with the
    variant whose step was fastest (read from the step results; here laid out by the test)
    and with that one and a swap space."""
    out = tmp_path / "out"
    out.mkdir()
    for tag, wall in (("", 26.0), ("-hnd", 24.0), ("-hf1", 25.0), ("-hnd-hf1", 24.5)):
        (out / f"decode-step-trt-8b{tag}.json").write_text(json.dumps({"decode": {"wall_ms": wall}}))
    calls = _dry_run(tmp_path, "trt-pick")
    assert sum("decode_step_profile.py" in c for c in calls) == 8  # profile, 5 variants, again, q0
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 3 and all("--num-prompts 512" in r for r in runs), runs
    assert "kvl=unset" in runs[0] and "out/trt-8b-2k.json" in runs[0] and "--swap-space" not in runs[0]
    assert "kvl=hnd hf=unset" in runs[1] and "trt-8b-2k-hnd.json" in runs[1]
    assert "kvl=hnd" in runs[2] and "--swap-space 8" in runs[2] and "trt-8b-2k-hnd-swap8.json" in runs[2]
    # the defaults fastest: the defaults, then with a swap space
    (out / "decode-step-trt-8b.json").write_text(json.dumps({"decode": {"wall_ms": 20.0}}))
    calls = _dry_run(tmp_path / "again", "trt-pick", OUT=str(out))
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2 and "kvl=unset" in runs[1] and "trt-8b-2k-swap8.json" in runs[1], runs
    # the compacted upload faster than the defaults: added to the fastest layout / grid
    (out / "decode-step-trt-8b.json").write_text(json.dumps({"decode": {"wall_ms": 26.0}}))
    (out / "decode-step-trt-8b-tcompact.json").write_text(json.dumps({"decode": {"wall_ms": 25.5}}))
    calls = _dry_run(tmp_path / "compact", "trt-pick", OUT=str(out), PICK_TESTS="1")
    assert "-m pytest" in calls[0] and "tests/test_graph_inputs.py" in calls[0]
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 3 and "trt-8b-2k-hnd-tcompact.json" in runs[1] and "kvl=hnd" in runs[1], runs
    assert "tu=compact" in runs[1] and "tu=unset" in runs[0]
    assert "trt-8b-2k-hnd-tcompact-swap8.json" in runs[2]
    # the defaults timed again after the variants, faster than any: no variant is picked
    (out / "decode-step-trt-8b-again.json").write_text(json.dumps({"decode": {"wall_ms": 23.0}}))
    calls = _dry_run(tmp_path / "drift", "trt-pick", OUT=str(out))
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2 and "out/trt-8b-2k.json" in runs[0] and "trt-8b-2k-swap8.json" in runs[1], runs
    assert "kvl=unset" in runs[1] and "tu=unset" in runs[1]


def test_trt_pick_without_the_profile(tmp_path):
    """PICK_PROFILE=0: the defaults' step timed alone (no profiler), written where the pick
    reads the defaults' wall."""
    calls = _dry_run(tmp_path, "trt-pick", PICK_PROFILE="0", PICK_VARIANTS="hnd tcompact")
    steps = [c for c in calls if "decode_step_profile.py" in c]
    assert len(steps) == 5 and all("--profile-steps 0" in c for c in steps), steps  # defaults, hnd, tcompact, again, q0
    assert "out/decode-step-trt-8b.json" in steps[0] and "decode-step-trt-8b-hnd.json" in steps[1]
    assert "tu=compact" in steps[2] and "decode-step-trt-8b-tcompact.json" in steps[2]
    assert "decode-step-trt-8b-again.json" in steps[3] and "kvl=unset" in steps[3] and "tu=unset" in steps[3]


def test_trt_pick_adds_fast_accumulation_where_its_step_was_faster(tmp_path):
    """fa1 (the FP8 products in fast-accumulation mode) is timed as a variant of its own and,
    like the compacted upload, added to the fastest layout / grid where it beat the
    defaults (the faster of their two timings); not where it did not."""
    out = tmp_path / "out"
    out.mkdir()
    for tag, wall in (("", 24.0), ("-hnd", 30.0), ("-fa1", 23.0), ("-again", 24.2)):
        (out / f"decode-step-trt-8b{tag}.json").write_text(json.dumps({"decode": {"wall_ms": wall}}))
    calls = _dry_run(tmp_path / "a", "trt-pick", OUT=str(out), PICK_PROFILE="0", PICK_VARIANTS="hnd fa1")
    steps = [c for c in calls if "decode_step_profile.py" in c]
    assert "fa=1" in steps[2] and "decode-step-trt-8b-fa1.json" in steps[2] and "fa=unset" in steps[1], steps
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 3 and "fa=unset" in runs[0], runs
    assert "fa=1 " in runs[1] and "kvl=unset" in runs[1] and "trt-8b-2k-fa1.json" in runs[1]
    assert "fa=1 " in runs[2] and "trt-8b-2k-fa1-swap8.json" in runs[2]
    (out / "decode-step-trt-8b-fa1.json").write_text(json.dumps({"decode": {"wall_ms": 24.1}}))
    calls = _dry_run(tmp_path / "b", "trt-pick", OUT=str(out), PICK_PROFILE="0", PICK_VARIANTS="hnd fa1")
    runs = [c for c in calls if "bench throughput" in c]
    assert len(runs) == 2 and all("fa=unset" in r for r in runs), runs


def test_trt_pick_short_call(tmp_path):
    """PICK_VARIANTS narrows the step timings; a run that would not fit the call's budget
    is skipped rather than cut short."""
    calls = _dry_run(tmp_path, "trt-pick", PICK_VARIANTS="hnd")
    assert sum("decode_step_profile.py" in c for c in calls) == 4  # profile, hnd, again, q0
    calls = _dry_run(tmp_path / "short", "trt-pick", BUDGET_S="60")
    assert not [c for c in calls if "bench throughput" in c]


def test_fp8_fast_runs_both_accumulations_in_one_call(tmp_path):
    """fp8-fast: the GPU tests, the step (defaults, then again in a later process), trt-8b-2k
    with a swap space promoted and fast, and one request with the few-row kernel on and off."""
    calls = _dry_run(tmp_path, "fp8-fast")
    assert "-m pytest" in calls[0] and "fast_accum" in calls[0]
    steps = [c for c in calls if "decode_step_profile.py" in c]
    assert len(steps) == 2 and "decode-step-trt-8b.json" in steps[0] and "decode-step-trt-8b-again.json" in steps[1]
    runs = [c for c in calls if "--workload trt-8b-2k" in c and "bench throughput" in c]
    assert len(runs) == 2 and all("--swap-space 8" in r for r in runs), runs
    assert "fa=0 " in runs[0] and "trt-8b-2k-swap8-fa0.json" in runs[0]
    assert "fa=1 " in runs[1] and "trt-8b-2k-swap8-fa1.json" in runs[1]
    b1 = [c for c in calls if "--workload gpu-long" in c]
    assert len(b1) == 2 and "sk=1 " in b1[0] and "b1-8b-fp8.json" in b1[0] and "sk=0 " in b1[1], b1
    assert not [c for c in _dry_run(tmp_path / "no-b1", "fp8-fast", FAST_B1="0") if "gpu-long" in c]
