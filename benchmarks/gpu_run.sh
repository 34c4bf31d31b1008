#!/usr/bin/env bash
# The GPU figures of the README's Performance table, in two parts that each fit a
# 10-minute device call. Writes JSON and logs under $OUT (default: ./gpu-out).
#   bash benchmarks/gpu_run.sh tests|pending|followup|moe-b1|skinny|caps|kernels|prefill|profile|eager|attn|lora-profile|throughput|baseline|serve|serve-ratio|quant|tp|fp8|fp8-b1|fp8-check|fp8-fast|fp8-kv|trt|trt-probe|trt-pick|trt-last|long|long-fi|mixed|spec|lora|embed|models
# throughput: gpu-7b with HF's compiled static cache at batch 256 in the same run, then
#   both workloads with async scheduling off (what overlap is worth);
# baseline: gpu-0.6b with its HF baseline (slow: HF needs about three minutes);
# serve: the server on gpu-7b's shape, 64 concurrent streaming clients;
# serve-ratio: offline gpu-7b, then one server on its shape at 256 clients (512 prompts) and
#   at 64 (256 prompts), each result holding the offline tok/s and served / offline; the
#   table comes last;
# quant: W4A16 vs bf16 on the Llama-2-7B linear stack (32 layers) and the whole engine;
# tp (two GPUs): TP=2 vs TP=1 greedy tokens, gpu-7b throughput at TP=1 and TP=2;
# fp8: the FP8 GPU tests, the FP8 GEMM table, gpu-7b bf16 / FP8 weights / FP8 weights + KV;
# trt-probe: where a trt-8b decode step's time goes (see the part); trt-pick: the step's
#   timings per switch, then trt-8b-2k with the defaults and with the fastest (PICK_TESTS=1:
#   the opt-in pieces' GPU tests first);
# fp8-b1: FP8 weights at one sequence, the few-row weight-only kernel on and off, bf16 beside;
# fp8-check: the batch-one FP8 test, trt-8b-2k under host_sync_check (device time inside and between
#   launches), trt-8b-1k, gpu-7b bf16 / FP8 (not yet run on a device);
# fp8-fast: FP8 fast accumulation promoted vs fast on trt-8b-2k (same call), the step with its device time
# fp8-kv: the KV-bound gpu-7b-kv with bf16 and FP8 pages; trt: trt-8b-1k and trt-8b-2k (TRT_PROFILE=1: a profile first;
#   TRT_GRAPHS="256 512": each per cap on graph-replayed decode sizes; TRT_SAMPLER="0 1": each with
#   the fused sampler off / on; TRT_ATTN=1: an fp8 decode attention sweep);
# long: TTFT of a 32k prompt and gpu-long with HF in the same run, a 128k prompt; long-fi:
#   the same with prefills through FlashInfer (carry .whl-fi), after its GPU tests;
# spec: gpu-7b with and without n-gram speculation (the gate must turn it off);
# mixed: 64 streams on gpu-7b's shape with one 32k prompt sent among them (bench serve
#   --long-prompt-len), per cap on a step's prompt tokens (CAPS, default "512 256") and
#   with paced chunks (RATIOS, --prefill-step-ratio, default "1.5 2"; 1.5 met the target on an
#   H200), after the mixed and long-decode graph GPU tests; MIXED_GRAPHS=0 runs the
#   steps with decodes and a prompt chunk eagerly instead of from CUDA graphs;
# lora: the multi-LoRA GPU tests and benchmarks/lora_bench.py (gpu-7b, rank-16 adapters);
# lora-profile: the LoRA kernels per launch setting (benchmarks/lora_kernel_bench.py), then
#   gpu-7b's kernels without and with one adapter on every prompt.
# prefill: benchmarks/prefill_attn_bench.py (with FlashInfer where .whl-fi has it), 32k TTFT;
# profile: benchmarks/profile_kernels.py on gpu-long-ttft and on the embedding batch;
# kernels: the fused kernels' GPU tests, eager MoE host cost, a batch-1 gpu-moe profile;
# attn: benchmarks/attn_decode_bench.py (decode attention over bf16 / fp8 pages);
# eager: benchmarks/eager_host_cost.py (host microseconds per piece of an eager MoE step);
# pending: the split-decode tests, gpu-long (FlashInfer prefills; carry .whl-fi) with and
#   without flash-decoding, without and with the cap of 512 prompt tokens beside decodes;
# followup: the split-decode and mixed-graph GPU tests, gpu-moe batch 1 with / without splits;
# moe-b1: the MoE GPU tests, gpu-moe batch 1 with / without key splits and on .baseline's
#   earlier tree (if carried), a batch-1 profile with PDL off, decode attention at batch 1;
# skinny: the few-row product against cuBLAS, gpu-moe batch 1 with and without the MoE sum
#   kernel and on .baseline's tree, a batch-1 profile with PDL off;
# caps: gpu-7b and gpu-moe offline at no cap and at the default 512 (WORKLOADS);
# embed: benchmarks/embed_bench.py; models: gpu-oss-20b against HF (NUM_PROMPTS, default 64:
# HF generate needs minutes a batch on this shape), gpu-dsv2-lite.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
bench() { python3 -m pagedllm.entrypoints.bench "$@"; }
# flashinfer-python and its dependencies from the carried .whl-fi, on the path (its kernels
# build just in time with the card's nvcc, MAX_JOBS at a time); fails if they do not install.
install_flashinfer() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fi .whl-fi/*.whl \
        >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site-fi MAX_JOBS=${MAX_JOBS:-16}
}
moe_b1() {  # gpu-moe at batch 1 (128 in / 256 out, median of 3) per value of a switch:
    # moe_b1 VARIABLE TAG VALUE...; results gpu-moe-b1-TAGVALUE.json
    local var=$1 tag=$2 v
    shift 2
    for v in "$@"; do
        env "$var=$v" timeout "$(cap 150)" python3 -m pagedllm.entrypoints.bench throughput \
            --workload gpu-moe --num-prompts 1 --input-len 128 --output-len 256 --repeats 3 \
            --output-json "$OUT/gpu-moe-b1-$tag$v.json" 2>&1 | tail -2
    done
    summary "$OUT"/gpu-moe-b1-"$tag"*.json
}
b1_runs() {  # b1_runs Q...: one request (128 in, B1_OUT out, default 512) on the Llama-3.1-8B
    # shape per Q: bf16; fp8 with the few-row kernel (PAGEDLLM_SKINNY_FP8_MAX_ROWS=1); fp8-noskinny (=0)
    local q flags envs
    for q in "$@"; do
        flags=() envs=()
        [[ $q != bf16 ]] && flags+=(--quantization fp8)
        [[ $q == fp8 ]] && envs+=(PAGEDLLM_SKINNY_FP8_MAX_ROWS=1)
        [[ $q == fp8-noskinny ]] && envs+=(PAGEDLLM_SKINNY_FP8_MAX_ROWS=0)
        env "${envs[@]}" timeout "$(cap 120)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-long \
            --num-prompts 1 --input-len 128 --output-len "${B1_OUT:-512}" "${flags[@]}" \
            --output-json "$OUT/b1-8b-$q.json" 2>&1 | tail -2
    done
    summary "$OUT"/b1-8b-*.json
}
gpu7b_runs() {  # gpu7b_runs LIMIT NEED Q...: gpu-7b per Q (bf16; fp8: FP8 weights; fp8-kv8: and
    # FP8 pages), each run at most LIMIT s; with NEED > 0 a run is skipped under NEED s left
    local limit=$1 need=$2 q flags
    shift 2
    for q in "$@"; do
        (( need > 0 && DEADLINE - SECONDS < need )) && { echo "skipped gpu-7b $q: no time left"; continue; }
        flags=()
        [[ $q != bf16 ]] && flags+=(--quantization fp8)
        [[ $q == fp8-kv8 ]] && flags+=(--kv-cache-dtype fp8)
        timeout "$(cap "$limit")" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-7b \
            "${flags[@]}" --output-json "$OUT/gpu-7b-$q.json" 2>&1 | tail -3
    done
}
trt_step() {  # trt_step TAG [ENV=VALUE...]: a steady 512-sequence trt-8b decode step's wall time alone
    # (and the device's time inside its replays), with the card's SM clock, power and
    # temperature sampled every second meanwhile (smi-TAG.csv; the last samples printed)
    local tag=$1 smi
    shift
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader -l 1 \
        > "$OUT/smi-${tag:-defaults}.csv" 2>/dev/null &
    smi=$!
    env "$@" timeout "$(cap 90)" python3 benchmarks/decode_step_profile.py --workload trt-8b-2k \
        --num-prompts 512 --input-len 1024 --profile-steps 0 --json "$OUT/decode-step-trt-8b${tag:+-$tag}.json" 2>&1 | \
        grep -v "USDT\\|Warning" | tail -3 || true
    kill "$smi" 2>/dev/null
    echo "  smi (sm clock, power, temperature), last 3 s: $(tail -3 "$OUT/smi-${tag:-defaults}.csv" 2>/dev/null | tr '\n' ';')"
}
opt_in_tests() {  # the GPU tests of the opt-in pieces (head-major pages and the heads-first
    # grid, the swap space with pinned pages and the stream's order, the graphs with
    # compacted block tables against eager), with the compacted upload on
    PAGEDLLM_GRAPH_TABLE_UPLOAD=compact timeout "$(cap 100)" python3 -m pytest -q -p no:cacheprovider \
        tests/test_triton_attention.py::test_head_major_pages_match_token_major \
        tests/test_triton_attention.py::test_fp8_decode_launch_follows_group_and_splits \
        tests/test_swap_space.py tests/test_graph_inputs.py tests/test_page_pool_release.py \
        tests/test_gpu.py::test_cuda_graphs_match_eager tests/test_gpu.py::test_cuda_async_scheduling_matches_in_step \
        2>&1 | tail -3
}
summary() {  # one line per result file
    python3 - "$@" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as e:
        print(f"{path}: {e}")
        continue
    res = r.get("results", {})
    if "pagedllm" in res or "hf" in res:
        p, h = res.get("pagedllm", {}), res.get("hf", {})
        print(f"{path}: pagedllm {p.get('output_tokens_per_s')} tok/s  hf {h.get('output_tokens_per_s')}  "
              f"ratio {r.get('ratio')}  roofline {r.get('roofline', {}).get('achieved_fraction')}  "
              f"preemptions {p.get('num_preemptions')}")
    else:
        keys = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
        print(path, {k: res.get(k) for k in keys})
EOF
}

# The server on gpu-7b's shape (random weights, a word-per-id tokenizer) on a free loopback
# port (or $PORT). start_7b NAME [server flags...] returns 0 once /health answers, or 1 with
# the tail of the server's log if it exited or did not answer within $SERVER_WAIT_S (300).
SERVER_PID= SERVER_PORT=
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
start_7b() {
    local name=$1 dir log t0=$SECONDS wait_s=${SERVER_WAIT_S:-300}
    shift
    SERVER_PORT=${PORT:-$(free_port)}
    log=$OUT/server-$name.log
    dir=$(mktemp -d)
    python3 - "$dir" <<'EOF' || return 1
import os, sys
from pagedllm.entrypoints.bench_workloads import LLAMA2_7B_CONFIG, write_arch_config, write_word_tokenizer
# MAX_POS: more positions than Llama 2's 4096 (random weights: only the shapes matter)
config = {**LLAMA2_7B_CONFIG, "max_position_embeddings": int(os.environ.get("MAX_POS") or
                                                             LLAMA2_7B_CONFIG["max_position_embeddings"])}
write_arch_config(config, sys.argv[1])
write_word_tokenizer(sys.argv[1], LLAMA2_7B_CONFIG["vocab_size"])
EOF
    python3 -m pagedllm.entrypoints.cli serve "$dir" --load-format dummy --dtype bfloat16 \
        --served-model-name llama-2-7b-shape --host 127.0.0.1 --port "$SERVER_PORT" \
        --max-model-len 4096 --log-level warning "$@" >"$log" 2>&1 &
    SERVER_PID=$!
    while (( SECONDS - t0 < wait_s )); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            wait "$SERVER_PID"
            echo "server $name exited (status $?) before it answered; tail of $log:"
            tail -n 40 "$log"
            SERVER_PID=
            return 1
        fi
        if python3 -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)' \
                "http://127.0.0.1:$SERVER_PORT/health" 2>/dev/null; then
            echo "server $name up on port $SERVER_PORT after $((SECONDS - t0)) s"
            return 0
        fi
        sleep 1
    done
    echo "server $name did not answer /health within $wait_s s; tail of $log:"
    tail -n 40 "$log"
    stop_7b
    return 1
}
stop_7b() {  # SIGINT (a clean shutdown), SIGKILL after 30 s
    [[ -n ${SERVER_PID:-} ]] || return 0
    kill -INT "$SERVER_PID" 2>/dev/null
    for _ in $(seq 30); do
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=
}
trap stop_7b EXIT
# bench_7b NAME CLIENTS PROMPTS [bench serve flags...]: 256 in / 256 out at CLIENTS streams
# against the running server, within $BENCH_S seconds (600); later flags override these.
bench_7b() {
    local name=$1 clients=$2 prompts=$3
    shift 3
    timeout "${BENCH_S:-600}" python3 -m pagedllm.entrypoints.bench serve \
        --base-url "http://127.0.0.1:$SERVER_PORT" --num-prompts "$prompts" --input-len 256 \
        --output-len 256 --max-concurrency "$clients" --prompt-vocab-size 32000 --warmup 4 \
        --temperature 1.0 --output-json "$OUT/gpu-7b-serve-$name.json" "$@" 2>&1 | tail -20
}
# serve_7b NAME CLIENTS PROMPTS [server flags...]: one server, one `bench serve`.
serve_7b() {
    local name=$1 clients=$2 prompts=$3
    shift 3
    start_7b "$name" "$@" || return 1
    bench_7b "$name" "$clients" "$prompts"
    stop_7b
    summary "$OUT/gpu-7b-serve-$name.json"
}
# serve_ratio_summary OFFLINE SERVE...: offline and served output tok/s of one card, a table.
serve_ratio_summary() {
    python3 - "$@" <<'EOF'
import json, sys

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:
        print(f"{path}: {e}")
        return None

offline = load(sys.argv[1])
if offline:
    p, roof, c = offline["results"]["pagedllm"], offline.get("roofline", {}), offline.get("ceilings", {})
    print(f"\noffline gpu-7b on {offline['environment']['device_name']} (commit "
          f"{offline['environment']['git'].get('short')}): {p['output_tokens_per_s']} output tok/s; "
          f"roofline {roof.get('output_tokens_per_s')} at {c.get('bandwidth_TBps')} TB/s, "
          f"{c.get('matmul_TFLOPs')} TFLOP/s, achieved {roof.get('achieved_fraction')}")
rows = [("run", "clients", "prompts", "offline tok/s", "served tok/s", "served/offline",
         "TTFT med ms", "ITL med ms", "ITL p99 ms", "p99/med", "failed")]
for path in sys.argv[2:]:
    s = load(path)
    if not s:
        continue
    r, a = s["results"], s["args"]
    rows.append((path.rsplit("serve-", 1)[-1].removesuffix(".json"), a["max_concurrency"],
                 a["num_prompts"], r.get("offline_output_throughput"), r["output_throughput"],
                 r.get("offline_ratio"), r["median_ttft_ms"], r["median_itl_ms"], r["p99_itl_ms"],
                 r["itl_p99_over_median"], r["failed"]))
rows = [[str(x) for x in row] for row in rows]
widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
for row in rows:
    print("  ".join(x.rjust(w) for x, w in zip(row, widths)))
EOF
}
# cap N: N seconds, or fewer, so that a mode's steps end $BUDGET_S (580) s after the start
# less 20 s for stopping the server and printing the summary (a device call gets 600 s).
DEADLINE=$((SECONDS + ${BUDGET_S:-580}))
cap() {
    local left=$((DEADLINE - SECONDS - 20))
    (( left < 1 )) && left=1
    echo $(( left < $1 ? left : $1 ))
}

case "${1:-throughput}" in
fp8)
    # FP8 weights and KV on gpu-7b: the GPU tests of FP8, the per-shape GEMM table, then
    # bf16 / FP8 weights / FP8 weights + KV, one after the other on the same card.
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_fp8_kv.py \
        tests/test_triton_attention.py 2>&1 | tail -6
    timeout "$(cap 120)" python3 benchmarks/fp8_gemm_bench.py --rows 1 64 256 2048 \
        --json "$OUT/fp8-gemm.json" 2>&1 | tail -30
    gpu7b_runs 150 0 bf16 fp8 fp8-kv8
    summary "$OUT"/gpu-7b-*.json
    ;;
fp8-b1)
    # FP8 weights at one sequence (decode steps of one row): the GPU tests of the few-row
    # weight-only FP8 kernel, the kernel against torch._scaled_mm and bf16 cuBLAS on the 8B
    # shapes (B1_ROWS rows, default 1 2 4), then one request (128 in, B1_OUT out, default 512)
    # on the Llama-3.1-8B shape in bf16, in FP8 with the kernel (PAGEDLLM_SKINNY_FP8_MAX_ROWS=1)
    # and in FP8 without it (=0), on the same card.
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_skinny_gemm.py \
        tests/test_fp8.py tests/test_fp8_fused_quant.py -k "not interpreter" 2>&1 | tail -3
    timeout "$(cap 120)" python3 benchmarks/skinny_gemm_bench.py --fp8 --rows ${B1_ROWS:-1 2 4} \
        --json "$OUT/skinny-gemm-fp8.json" 2>&1 | grep -v Warning | tail -12
    b1_runs bf16 fp8 fp8-noskinny
    ;;
fp8-check)
    # The FP8 defaults (fast accumulation, the one-row kernel) once more, in one call: the
    # batch-one GPU test; trt-8b-2k (512 requests, --swap-space 8) under
    # benchmarks/host_sync_check.py, which reads the device's time inside and between
    # launches on CUDA events (where the stream runs dry); trt-8b-1k with the same settings;
    # then gpu-7b in bf16 and with FP8 weights (CHECK_7B=0 skips them).
    timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fp8.py \
        -k "batch_one or one_row or fast_accum" 2>&1 | tail -3
    timeout "$(cap 170)" python3 benchmarks/host_sync_check.py --workload trt-8b-2k --num-prompts 512 \
        --max-num-seqs 512 --input-len 128 --output-len 2048 --swap-space "${SWAP_GIB:-8}" --only-async 2>&1 | tail -24
    (( DEADLINE - SECONDS < ${RUN_NEEDS_S:-90} )) && { echo "skipped trt-8b-1k: no time left"; exit 0; }
    timeout "$(cap 150)" python3 -m pagedllm.entrypoints.bench throughput --workload trt-8b-1k \
        --num-prompts "${NUM_PROMPTS:-512}" --max-num-seqs 512 --warmup 2 --swap-space "${SWAP_GIB:-8}" \
        --output-json "$OUT/trt-8b-1k-swap${SWAP_GIB:-8}.json" 2>&1 | tail -2
    if [[ ${CHECK_7B:-1} != 0 ]]; then gpu7b_runs 120 60 bf16 fp8; fi
    summary "$OUT"/*.json
    ;;
fp8-fast)
    # FP8 fast accumulation (on by default since cb78706's product timings) in the engine:
    # the GPU tests it touches (and the replays' timing); the steady trt step with the
    # device's time inside its replays (the call's first process); trt-8b-2k with a swap
    # space promoted (PAGEDLLM_FP8_FAST_ACCUM=0) and fast, in the same call; the step again
    # in a later process (earlier calls' later processes ran ~40% slower); then one request
    # with the FP8 few-row kernel on and off (FAST_B1=0 skips them).
    timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fp8.py \
        tests/test_gpu.py -k "fast_accum or scaled_mm or generates_on_cuda or one_row or batch_one or graphs_match" \
        2>&1 | tail -3
    trt_step ""
    for fa in 0 1; do
        (( DEADLINE - SECONDS < ${RUN_NEEDS_S:-100} )) && { echo "skipped trt-8b-2k fa$fa: no time left"; continue; }
        PAGEDLLM_FP8_FAST_ACCUM=$fa timeout "$(cap 200)" python3 -m pagedllm.entrypoints.bench throughput \
            --workload trt-8b-2k --num-prompts "${NUM_PROMPTS:-512}" --max-num-seqs 512 --warmup 2 \
            --swap-space "${SWAP_GIB:-8}" --output-json "$OUT/trt-8b-2k-swap${SWAP_GIB:-8}-fa$fa.json" 2>&1 | tail -2
    done
    summary "$OUT"/trt-8b-2k*.json
    trt_step again
    if [[ ${FAST_B1:-1} != 0 ]]; then b1_runs fp8 fp8-noskinny; fi
    ;;
attn)
    # Decode attention alone over bf16 and fp8 pages (fp16 / bf16 products), launch settings.
    timeout "$(cap 300)" python3 benchmarks/attn_decode_bench.py --json "$OUT/attn-decode.json" 2>&1 \
        | grep -v Warning | tail -80
    ;;
fp8-kv)
    # The KV-bound workload: 512 x (2,048 in, 512 out) on the 7B shape, bf16 vs FP8 pages.
    for kv in auto fp8; do
        timeout "$(cap 290)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-7b-kv \
            --kv-cache-dtype "$kv" --warmup 2 --output-json "$OUT/gpu-7b-kv-$kv.json" 2>&1 | grep -i "kv pool\|blocks\|tok/s" | tail -4
    done
    summary "$OUT"/gpu-7b-kv-*.json
    ;;
trt)
    # TensorRT-LLM's two published Llama-3.1-8B FP8 rows (NUM_PROMPTS overrides 3,000;
    # TRT_WORKLOADS picks). TRT_PROFILE=1 first profiles trt-8b-2k's steady decode (512
    # requests at once, 128 in / 256 out, PDL off so that no kernel's time counts a wait).
    if [[ ${TRT_PROFILE:-0} != 0 ]]; then
        PAGEDLLM_PDL=0 timeout "$(cap 200)" python3 benchmarks/profile_kernels.py --workload trt-8b-2k \
            --num-prompts 512 --output-len 256 --max-num-seqs "${MAX_SEQS:-512}" \
            --json "$OUT/profile-trt-8b-2k-nopdl.json" 2>&1 | grep -v "USDT\|Warning" | tail -20
    fi
    # TRT_ATTN=1: decode attention over fp8 pages on the Llama-3.1-8B shape at 512 sequences
    # (1,024 and 2,048 keys) per launch setting, against the default (128, 4, 2)
    if [[ ${TRT_ATTN:-0} != 0 ]]; then
        timeout "$(cap 120)" python3 benchmarks/attn_decode_bench.py --batch 512 --ctx 1024 2048 \
            --shapes llama3-8b --pages fp8 --settings 128,4,2 128,4,3 128,4,4 256,4,2 256,8,2 256,8,3 \
            128,2,2 64,2,2 128,8,2 --json "$OUT/attn-decode-trt.json" 2>&1 | tail -40
    fi
    # TRT_ARGS: more bench flags for every run (e.g. "--swap-space 8")
    # TRT_GRAPHS="256 512": each workload per PAGEDLLM_MAX_GRAPH_BATCH (results WORKLOAD-gN.json);
    # TRT_SAMPLER="0 1": each per PAGEDLLM_FUSED_SAMPLER (WORKLOAD-sN.json), after the fused
    # sampler's GPU tests; TRT_FUSED_QUANT="0 1": each per PAGEDLLM_FP8_FUSED_QUANT
    # (WORKLOAD-qN.json); TRT_KV_LAYOUT="nhd hnd": each per PAGEDLLM_KV_LAYOUT (WORKLOAD-hnd.json)
    if [[ -n ${TRT_SAMPLER:-} ]]; then
        timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider tests/test_fused_sampler.py 2>&1 | tail -3
    fi
    # TRT_TESTS=1: the GPU tests of the FP8 path first (products, activations quantized by
    # the norm / SiLU kernels, the fused sampler)
    if [[ ${TRT_TESTS:-0} != 0 ]]; then
        timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_fused_quant.py \
            tests/test_fp8.py tests/test_fused_sampler.py 2>&1 | tail -3
    fi
    for w in ${TRT_WORKLOADS:-trt-8b-1k trt-8b-2k}; do
        for g in ${TRT_GRAPHS:-default}; do
            for f in ${TRT_SAMPLER:-default}; do
                for qf in ${TRT_FUSED_QUANT:-default}; do
                  for kl in ${TRT_KV_LAYOUT:-default}; do
                    tag=""
                    [[ $g != default ]] && tag="-g$g"
                    [[ $f != default ]] && tag="$tag-s$f"
                    [[ $qf != default ]] && tag="$tag-q$qf"
                    [[ $kl != default ]] && tag="$tag-$kl"
                    env ${TRT_GRAPHS:+PAGEDLLM_MAX_GRAPH_BATCH=$g} ${TRT_SAMPLER:+PAGEDLLM_FUSED_SAMPLER=$f} \
                        ${TRT_FUSED_QUANT:+PAGEDLLM_FP8_FUSED_QUANT=$qf} ${TRT_KV_LAYOUT:+PAGEDLLM_KV_LAYOUT=$kl} \
                        timeout "$(cap ${TRT_RUN_S:-290})" python3 -m pagedllm.entrypoints.bench \
                        throughput --workload "$w" ${NUM_PROMPTS:+--num-prompts $NUM_PROMPTS} \
                        --max-num-seqs "${MAX_SEQS:-512}" --warmup 2 ${TRT_ARGS:-} --output-json "$OUT/$w$tag.json" 2>&1 | tail -3
                  done
                done
            done
        done
    done
    summary "$OUT"/trt-8b-*.json
    # TRT_HOST=1: trt-8b-2k (512 x 128 in / 2,048 out) with the engine's host time per part
    # and the steps grouped by how many sequences they ran (where the preempted tail goes)
    if [[ ${TRT_HOST:-0} != 0 ]]; then
        timeout "$(cap 170)" python3 benchmarks/host_sync_check.py --workload trt-8b-2k --num-prompts 512 \
            --max-num-seqs 512 --input-len 128 --output-len 2048 --only-async 2>&1 | tail -18
    fi
    ;;
trt-last)
    # A short call: the GPU tests of this session's CPU-built pieces (head-major pages and the
    # heads-first grid, the swap space with pinned pages and the stream's order, the graphs
    # with compacted block tables against eager), then the steady trt-8b decode step's wall time
    # with token-major and with head-major pages.
    opt_in_tests
    trt_step default
    trt_step hnd PAGEDLLM_KV_LAYOUT=hnd
    ;;
trt-pick)
    # One call that decides and measures: (PICK_TESTS=1) the GPU tests of the opt-in pieces
    # first (as trt-last); the profiled steady decode step (defaults); its wall time per
    # variant (PICK_VARIANTS: page layout / grid as trt-probe, tcompact the graphs' block
    # tables uploaded compacted); then trt-8b-2k (NUM_PROMPTS, default 512) with the
    # defaults, with the fastest layout / grid variant (plus the compacted upload where its
    # step was faster than the defaults'), and with that and a swap space (SWAP_GIB, default
    # 8: preempted sequences' pages kept on the host), in the same call; last the step's
    # wall time with the activations quantized apart.
    [[ ${PICK_TESTS:-0} != 0 ]] && opt_in_tests
    if [[ ${PICK_PROFILE:-1} != 0 ]]; then
        timeout "$(cap 120)" python3 benchmarks/decode_step_profile.py --workload trt-8b-2k --num-prompts 512 \
            --input-len 1024 --json "$OUT/decode-step-trt-8b.json" 2>&1 | grep -v "USDT\\|Warning" | tail -45
    else  # PICK_PROFILE=0 (a short call): the defaults' step timed alone, as the variants are
        trt_step ""
    fi
    # PICK_VARIANTS: the step variants timed (a short call: fewer)
    for v in ${PICK_VARIANTS:-hnd hf1 hnd-hf1 tcompact fa1}; do
        case $v in
        hnd) trt_step hnd PAGEDLLM_KV_LAYOUT=hnd ;;
        hf1) trt_step hf1 PAGEDLLM_DECODE_HEADS_FIRST=1 ;;
        hnd-hf1) trt_step hnd-hf1 PAGEDLLM_KV_LAYOUT=hnd PAGEDLLM_DECODE_HEADS_FIRST=1 ;;
        tcompact) trt_step tcompact PAGEDLLM_GRAPH_TABLE_UPLOAD=compact ;;
        fa1) trt_step fa1 PAGEDLLM_FP8_FAST_ACCUM=1 ;;
        esac
    done
    # (fa1: the FP8 products in fast-accumulation mode)
    # the defaults' step again after the variants (PICK_AGAIN=0 skips it): a variant must
    # beat the faster of the two, so a card that drifts mid-call does not pick for it
    [[ ${PICK_AGAIN:-1} != 0 ]] && trt_step again
    best=$(python3 - "$OUT" <<'PICK'
import json, os, sys
env = {"": "", "hnd": "PAGEDLLM_KV_LAYOUT=hnd", "hf1": "PAGEDLLM_DECODE_HEADS_FIRST=1",
       "hnd-hf1": "PAGEDLLM_KV_LAYOUT=hnd PAGEDLLM_DECODE_HEADS_FIRST=1"}
# apart from the attention variants, each added to the pick where its step beat the defaults'
additive = {"tcompact": "PAGEDLLM_GRAPH_TABLE_UPLOAD=compact", "fa1": "PAGEDLLM_FP8_FAST_ACCUM=1"}
walls = {}
for tag in [*env, *additive, "again"]:
    path = os.path.join(sys.argv[1], f"decode-step-trt-8b{'-' + tag if tag else ''}.json")
    try:
        walls[tag] = json.load(open(path))["decode"]["wall_ms"]
    except Exception:
        pass
print("step ms: " + ", ".join(f"{t or 'defaults'} {w:.2f}" for t, w in walls.items()), file=sys.stderr)
if "" not in walls:
    print("|")
    sys.exit()
walls[""] = min(walls[""], walls.pop("again", walls[""]))
best = min((t for t in env if t in walls), key=walls.get)
tags, envs = [best] if best else [], [env[best]] if best else []
for tag, setting in additive.items():
    if walls.get(tag, walls[""]) < walls[""]:
        tags.append(tag)
        envs.append(setting)
print(f"{'-'.join(tags)}|{' '.join(envs)}")
PICK
)
    echo "decode step wall by variant -> best: ${best%%|*}"
    trt_run() {  # trt_run TAG [ENV=VALUE...] [-- BENCH ARGS]: trt-8b-2k once, if the call
        # has time left for a whole run (one cut short measures nothing)
        local tag=$1 envs=() extra=()
        shift
        (( DEADLINE - SECONDS < ${RUN_NEEDS_S:-100} )) && { echo "skipped trt-8b-2k$tag: no time left"; return; }
        while (( $# )) && [[ $1 != -- ]]; do envs+=("$1"); shift; done
        (( $# )) && { shift; extra=("$@"); }
        env "${envs[@]}" timeout "$(cap 200)" python3 -m pagedllm.entrypoints.bench throughput \
            --workload trt-8b-2k --num-prompts "${NUM_PROMPTS:-512}" --max-num-seqs 512 --warmup 2 \
            "${extra[@]}" --output-json "$OUT/trt-8b-2k$tag.json" 2>&1 | tail -2
    }
    vtag=${best%%|*}
    # shellcheck disable=SC2086
    trt_run ""
    [[ -n $vtag ]] && trt_run "-$vtag" ${best#*|}
    # shellcheck disable=SC2086
    trt_run "${vtag:+-$vtag}-swap${SWAP_GIB:-8}" ${best#*|} -- --swap-space "${SWAP_GIB:-8}"
    summary "$OUT"/trt-8b-2k*.json
    trt_step q0 PAGEDLLM_FP8_FUSED_QUANT=0
    ;;
trt-probe)
    # Where a trt-8b decode step's time goes, cheaply, most telling first: one steady
    # 512-sequence step at 1,024 keys profiled kernel by kernel (with the prefill's steps);
    # the same step's wall time with the activations quantized apart
    # (PAGEDLLM_FP8_FUSED_QUANT=0), over head-major pages (PAGEDLLM_KV_LAYOUT=hnd), on the
    # (KV heads, sequences) decode grid (PAGEDLLM_DECODE_HEADS_FIRST=1) and with the graphs'
    # block tables uploaded compacted (PAGEDLLM_GRAPH_TABLE_UPLOAD=compact); decode attention
    # alone over fp8 pages at 512 x 1,152 keys (trt-8b-2k's mean) per launch setting, page
    # size, layout and grid order; the FP8 products by scaling (row-wise against one scale
    # a tensor); FlashInfer's fp8 batch decode last (carry .whl-fi; its kernels build just
    # in time; TRT_FI=0 skips it).
    timeout "$(cap 150)" python3 benchmarks/decode_step_profile.py --workload trt-8b-2k --num-prompts 512 \
        --input-len 1024 --json "$OUT/decode-step-trt-8b.json" 2>&1 | grep -v "USDT\|Warning" | tail -60
    trt_step q0 PAGEDLLM_FP8_FUSED_QUANT=0
    trt_step hnd PAGEDLLM_KV_LAYOUT=hnd
    trt_step hf1 PAGEDLLM_DECODE_HEADS_FIRST=1
    trt_step hnd-hf1 PAGEDLLM_KV_LAYOUT=hnd PAGEDLLM_DECODE_HEADS_FIRST=1
    trt_step tcompact PAGEDLLM_GRAPH_TABLE_UPLOAD=compact
    timeout "$(cap 150)" python3 benchmarks/attn_decode_bench.py --batch 512 --ctx ${ATTN_CTX:-1152} \
        --shapes llama3-8b --pages fp8 --computes fp16 --settings ${ATTN_SETTINGS:-64,2,2 64,2,3 64,4,2 128,4,2 128,4,3 32,2,2} \
        --page ${ATTN_PAGES:-16 32} --layout nhd hnd --heads-first 0 1 --json "$OUT/attn-decode-trt-probe.json" 2>&1 | tail -52
    timeout "$(cap 60)" python3 benchmarks/fp8_scaling_bench.py --rows 48 512 8192 \
        --json "$OUT/fp8-scaling.json" 2>&1 | tail -14
    if [[ ${TRT_FI:-1} != 0 ]] && install_flashinfer; then
        timeout "$(cap 200)" python3 benchmarks/attn_decode_bench.py --batch 512 --ctx ${ATTN_CTX:-1152} \
            --shapes llama3-8b --pages fp8 --computes fp16 --settings 64,2,2 --layout nhd hnd --flashinfer \
            --json "$OUT/attn-decode-trt-fi.json" 2>&1 | grep -v Warning | tail -8 || true
    fi
    ;;
long|long-fi)
    # Long context on the Llama-3.1-8B shape: TTFT of one 32k prompt (median of 3, HF sdpa
    # in the same run), 16 x (32,000 in, 128 out) against HF generate, a 128k prompt.
    # long-fi: the same with prefills through FlashInfer (.whl-fi carried), after its GPU
    # tests (FI_K: a -k filter; each head dim builds kernels); a warm-up run builds its kernels. STEPS picks (default all): tests ttft
    # 128k many, attn (the attention tests), capN / hcapN (gpu-long at
    # --max-prefill-tokens-with-decodes N; hcap: HF in the same run), chunkN / pagedN (the
    # 32k TTFT at --max-num-batched-tokens N, pagedllm alone; paged: FlashInfer's ragged
    # prefill off, PAGEDLLM_FLASHINFER_RAGGED=0). LONG_ARGS: more engine arguments for the
    # ttft, 128k and many runs.
    warm=0 STEPS=${STEPS:-tests ttft 128k many}
    if [[ $1 == long-fi ]]; then
        install_flashinfer
        [[ $STEPS == *tests* ]] && timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/test_flashinfer_attention.py ${FI_K:+-k "$FI_K"} 2>&1 | tail -3
        export PAGEDLLM_ATTENTION_BACKEND=flashinfer
        warm=1
    fi
    [[ $STEPS == *ttft* ]] && timeout "$(cap 200)" python3 -m pagedllm.entrypoints.bench throughput \
        --workload gpu-long-ttft --backend both --repeats 3 --warmup $warm ${LONG_ARGS:-} \
        --output-json "$OUT/gpu-long-ttft.json" 2>&1 | tail -6
    [[ $STEPS == *128k* ]] && timeout "$(cap 180)" python3 -m pagedllm.entrypoints.bench throughput \
        --workload gpu-long-128k --warmup 0 ${LONG_ARGS:-} --output-json "$OUT/gpu-long-128k.json" 2>&1 | tail -4
    [[ $STEPS == *many* ]] && timeout "$(cap 400)" python3 -m pagedllm.entrypoints.bench throughput \
        --workload gpu-long --backend both --warmup $warm ${LONG_ARGS:-} --output-json "$OUT/gpu-long.json" 2>&1 | tail -6
    # capN: gpu-long (no warm-up run) per cap on a step's prompt tokens beside decodes;
    # hcapN: the same with HF generate in the run; attn: the attention kernels' tests first
    for c in $STEPS; do
        [[ $c == attn ]] && timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider \
            tests/test_triton_attention.py -m "gpu or not gpu" ${ATTN_K:+-k "$ATTN_K"} 2>&1 | tail -4
        [[ $c == cap* || $c == hcap* ]] && timeout "$(cap 300)" python3 -m pagedllm.entrypoints.bench \
            throughput --workload gpu-long --warmup 0 --max-prefill-tokens-with-decodes "${c#*cap}" \
            --backend "$([[ $c == h* ]] && echo both || echo pagedllm)" \
            --output-json "$OUT/gpu-long-$c.json" 2>&1 | tail -5
        [[ $c == chunk* || $c == paged* ]] && PAGEDLLM_FLASHINFER_RAGGED=$([[ $c == paged* ]] && echo 0 || echo 1) \
            timeout "$(cap 150)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-long-ttft \
            --repeats 3 --warmup $warm --max-num-batched-tokens "${c//[a-z]/}" \
            --output-json "$OUT/gpu-long-ttft-$c.json" 2>&1 | tail -3
    done
    summary "$OUT"/gpu-long*.json
    ;;
spec)
    # Speculation on at full load must cost nothing (the batch gate turns it off): gpu-7b
    # with and without n-gram drafts, one after the other on the same card.
    bench throughput --workload gpu-7b --output-json "$OUT/gpu-7b-nospec.json" 2>&1 | tail -2
    bench throughput --workload gpu-7b --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
        --output-json "$OUT/gpu-7b-ngram.json" 2>&1 | tail -2
    summary "$OUT"/gpu-7b-nospec.json "$OUT"/gpu-7b-ngram.json
    ;;
prefill)
    # Prefill attention alone (one 32k prompt in 8k chunks, one layer): the Triton kernel's
    # settings against SDPA flash and, where .whl-fi holds flashinfer-python and its
    # dependencies (carry it), FlashInfer's FA2 / FA3 paged prefill (compiled just in time
    # on first use: minutes), then the engine's 32k TTFT with HF in the same run.
    if compgen -G ".whl-fi/*.whl" >/dev/null; then
        install_flashinfer
    fi
    timeout "$(cap 420)" python3 benchmarks/prefill_attn_bench.py --json "$OUT/prefill-attn.json" 2>&1 \
        | grep -v Warning | tail -16
    timeout "$(cap 150)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-long-ttft \
        --backend both --repeats 3 --warmup 0 --output-json "$OUT/gpu-long-ttft.json" 2>&1 | tail -6
    ;;
profile)
    # Device time by kernel: one 32k prompt (what TTFT spends beside attention), then an
    # embedding batch of 2,048 x 256 (where the 3x against sentence-transformers goes).
    # PROFILE="gpu-long": the whole gpu-long run instead (where its last 6 s go; with
    # FlashInfer prefills when .whl-fi is carried).
    if [[ ${PROFILE:-} == gpu-long ]]; then
        install_flashinfer && export PAGEDLLM_ATTENTION_BACKEND=flashinfer
        timeout "$(cap 400)" python3 benchmarks/profile_kernels.py --workload gpu-long \
            --json "$OUT/profile-gpu-long.json" 2>&1 | grep -v "USDT\|Warning" | tail -30
        exit 0
    fi
    timeout "$(cap 200)" python3 benchmarks/profile_kernels.py --workload gpu-long-ttft \
        --json "$OUT/profile-long-ttft.json" 2>&1 | grep -v "USDT\|Warning" | tail -27
    timeout "$(cap 300)" python3 benchmarks/profile_kernels.py --embed \
        --json "$OUT/profile-embed.json" 2>&1 | grep -v "USDT\|Warning" | tail -27
    ;;
kernels)
    # The fused kernels' GPU tests (norms, rotary with the q/k norms, MoE routing, alignment
    # and experts, attention over bf16 / fp8 pages) and the CUDA parity tests, then the
    # eager MoE host cost and one sequence of gpu-moe under the profiler (batch-1 kernels).
    timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_fused_moe.py \
        tests/test_triton_attention.py tests/test_gpu.py tests/test_moe.py -m "gpu or not gpu" 2>&1 | tail -4
    timeout "$(cap 120)" python3 benchmarks/eager_host_cost.py --workload gpu-moe --layers 8 --batch 64 \
        --json "$OUT/eager-host-cost.json" 2>&1 | grep -v "Warning\|transformers" | tail -21
    timeout "$(cap 200)" python3 benchmarks/profile_kernels.py --workload gpu-moe --num-prompts 1 \
        --json "$OUT/profile-moe-b1.json" 2>&1 | grep -v "USDT\|Warning" | tail -22
    ;;
eager)
    # What an eager decode step costs the host, piece by piece (MoE at batch 64; LAYERS
    # layers, default 8; LAYERS=48 is the whole model, the issue's target shape), against
    # the eager and CUDA-graph steps of the same engine.
    # (past 24 layers one engine needs most of the card: 0.9 of it, one engine at a time)
    timeout "$(cap 300)" python3 benchmarks/eager_host_cost.py --workload gpu-moe --layers "${LAYERS:-8}" --batch 64 \
        --gpu-memory-utilization "$( (( ${LAYERS:-8} > 24 )) && echo 0.9 || echo 0.25)" \
        --json "$OUT/eager-host-cost.json" 2>&1 | grep -v "Warning\|transformers" | tail -24
    ;;
pending)
    # What the 2026-12-06 sessions built without a GPU, checked in one call: the
    # split-decode kernel tests (and the long-length ones), then gpu-long with FlashInfer
    # prefills (carry .whl-fi) and the pool sized without the profile's pages: with
    # flash-decoding (PAGEDLLM_DECODE_KV_SPLITS=16) and no cap on a step's prompt tokens
    # beside decodes (HF generate in the run), the same at the server's cap of 512, and
    # without flash-decoding at no cap.
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
        -m "gpu or not gpu" -k "split or long_lengths" 2>&1 | tail -4
    timeout "$(cap 60)" python3 -m pytest -q -p no:cacheprovider tests/test_long_context.py -m gpu \
        -k "pool" 2>&1 | tail -3
    install_flashinfer
    export PAGEDLLM_ATTENTION_BACKEND=flashinfer
    for run in "16 0 both" "16 512 pagedllm" "1 0 pagedllm"; do
        set -- $run
        PAGEDLLM_DECODE_KV_SPLITS=$1 timeout "$(cap 300)" python3 -m pagedllm.entrypoints.bench throughput \
            --workload gpu-long --warmup 0 --max-prefill-tokens-with-decodes "$2" --backend "$3" \
            --output-json "$OUT/gpu-long-split$1-cap$2.json" 2>&1 | tail -5
    done
    summary "$OUT"/gpu-long-*.json
    ;;
followup)
    # What the sixth 2026-12-06 session built after its GPU runs: the split-decode tests
    # (each split now reads at least 256 keys), the mixed-step graphs' GPU test, then
    # gpu-moe at batch 1 with flash-decoding (the default) and without it.
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
        -m "gpu or not gpu" -k "split or long_lengths" 2>&1 | tail -3
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mixed_graphs.py \
        tests/test_long_decode_graphs.py 2>&1 | tail -3
    moe_b1 PAGEDLLM_DECODE_KV_SPLITS split 16 1
    ;;
moe-b1)
    # Issue 33's batch-1 target: the MoE GPU tests (kernels and engine parity), then gpu-moe
    # at batch 1 (128 in / 256 out, median of 3) on this tree, on an earlier tree where
    # .baseline/pagedllm holds one (carry .baseline: the A/B of the same run and card), and
    # with decode keys unsplit (PAGEDLLM_DECODE_KV_SPLITS=1); then a batch-1 profile with
    # PDL off (PAGEDLLM_PDL=0: kernels placed early overlap the one before, and a
    # profile's per-kernel times then count the wait).
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_moe.py \
        tests/test_moe.py tests/test_fused_ops.py 2>&1 | tail -2
    moe_b1 PAGEDLLM_DECODE_KV_SPLITS splits 16 1
    if [[ -d .baseline/pagedllm ]]; then
        PYTHONPATH=$PWD/.baseline:$PYTHONPATH moe_b1 PAGEDLLM_DECODE_KV_SPLITS baseline-splits 16
    fi
    PAGEDLLM_PDL=0 timeout "$(cap 200)" python3 benchmarks/profile_kernels.py --workload gpu-moe --num-prompts 1 \
        --input-len 128 --json "$OUT/profile-moe-b1-nopdl.json" 2>&1 | grep -v "USDT\|Warning" | tail -30
    # decode attention alone at batch 1 and 4, per key-split setting (9.5 us a layer above)
    timeout "$(cap 120)" python3 benchmarks/attn_small_batch_bench.py --batch 1 4 --ctx 128 384 2048 \
        --json "$OUT/attn-small-batch.json" 2>&1 | tail -14
    ;;
skinny)
    # Issue 33's batch 1: the few-row product, the one-token experts, the k-row MoE sum and
    # the short contexts' key splits: their tests, the product's table against cuBLAS
    # (skinny_gemm_bench.py; SKINNY_BENCH=0 skips it), one MoE layer fused vs skinny_moe
    # (SKINNY_MOE_BENCH=0 skips it), then gpu-moe at batch 1 on this tree with and without
    # skinny_moe (SUMK=1: with and without the sum kernel too), and on .baseline's earlier
    # tree (carry .baseline: the A/B of one card), then a batch-1 profile with PDL off
    # (SKINNY_PROFILE=0 skips it).
    timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_skinny_gemm.py \
        tests/test_moe_sum_k.py tests/test_skinny_moe.py -k "not interpreter" 2>&1 | tail -2
    timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
        -m "gpu or not gpu" -k "split or long_lengths" 2>&1 | tail -2
    if [[ ${SKINNY_BENCH:-1} != 0 ]]; then
        timeout "$(cap 100)" python3 benchmarks/skinny_gemm_bench.py --rows ${SKINNY_ROWS:-1 4} \
            --shapes ${SKINNY_SHAPES:-moe-qkv moe-o moe-router 7b-qkv 7b-down} \
            --json "$OUT/skinny-gemm.json" 2>&1 | grep -v Warning | tail -12
    fi
    if [[ ${SKINNY_MOE_BENCH:-1} != 0 ]]; then  # one MoE layer at one token: fused vs skinny_moe
        timeout "$(cap 150)" python3 benchmarks/skinny_moe_bench.py --json "$OUT/skinny-moe.json" 2>&1 \
            | grep -v Warning | tail -4
    fi
    moe_b1 PAGEDLLM_MOE_SKINNY_TOKENS skinnymoe 1 0
    [[ ${SUMK:-0} != 0 ]] && moe_b1 PAGEDLLM_MOE_SUM_K_TOKENS sumk 64 0
    if [[ -d .baseline/pagedllm ]]; then
        PYTHONPATH=$PWD/.baseline:$PYTHONPATH moe_b1 PAGEDLLM_DECODE_KV_SPLITS baseline-splits 16
    fi
    if [[ ${SKINNY_PROFILE:-1} != 0 ]]; then
        PAGEDLLM_PDL=0 timeout "$(cap 120)" python3 benchmarks/profile_kernels.py --workload gpu-moe \
            --num-prompts 1 --input-len 128 --json "$OUT/profile-moe-b1-nopdl.json" 2>&1 \
            | grep -v "USDT\|Warning" | tail -16
    fi
    ;;
caps)
    # What the cap on a step's prompt tokens beside decodes (512 by default on GPU) costs
    # offline throughput: gpu-7b at no cap, the default, and no cap again (the card's drift),
    # then gpu-moe at the default and at no cap. WORKLOADS picks (default "gpu-7b gpu-moe").
    for w in ${WORKLOADS:-gpu-7b gpu-moe}; do
        runs="0 512"; [[ $w == gpu-7b ]] && runs="0 512 0"
        i=0
        for c in $runs; do
            i=$((i + 1))
            timeout "$(cap 200)" python3 -m pagedllm.entrypoints.bench throughput --workload "$w" \
                --max-prefill-tokens-with-decodes "$c" --output-json "$OUT/$w-cap$c-$i.json" 2>&1 | tail -2
        done
    done
    summary "$OUT"/gpu-*-cap*.json
    ;;
embed)
    # Embedding throughput against sentence-transformers in the same run (target 3x).
    timeout "$(cap 300)" python3 benchmarks/embed_bench.py --repeats 3 --output-json "$OUT/embed.json" 2>&1 | tail -6
    ;;
models)
    # gpt-oss-20b's shape with MXFP4 experts against HF generate (target 5x), then the
    # DeepSeek-V2-Lite shape (latent pages: what the pool holds against full K/V).
    timeout "$(cap 330)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-oss-20b \
        --backend both --num-prompts "${NUM_PROMPTS:-64}" --output-json "$OUT/gpu-oss-20b.json" 2>&1 | tail -6
    timeout "$(cap 240)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-dsv2-lite \
        --output-json "$OUT/gpu-dsv2-lite.json" 2>&1 | grep -i "kv\|pool\|tok/s" | tail -6
    summary "$OUT"/gpu-oss-20b.json "$OUT"/gpu-dsv2-lite.json
    ;;
tests)
    # (the server tests import the openai client, which the GPU image lacks: collected or not,
    # the rest run)
    timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider --continue-on-collection-errors 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
    ;;
throughput)
    bench throughput --workload gpu-7b --backend both --hf-static-cache --output-json "$OUT/gpu-7b.json" 2>&1 | tail -4
    bench throughput --workload gpu-7b --no-async-scheduling --output-json "$OUT/gpu-7b-sync.json" 2>&1 | tail -2
    bench throughput --workload gpu-0.6b --output-json "$OUT/gpu-0.6b-engine.json" 2>&1 | tail -2
    bench throughput --workload gpu-0.6b --no-async-scheduling --output-json "$OUT/gpu-0.6b-sync.json" 2>&1 | tail -2
    summary "$OUT"/gpu-7b*.json "$OUT"/gpu-0.6b*.json
    ;;
baseline)
    bench throughput --workload gpu-0.6b --backend both --hf-static-cache --output-json "$OUT/gpu-0.6b.json" 2>&1 | tail -4
    summary "$OUT/gpu-0.6b.json"
    ;;
serve)
    serve_7b c64 64 256
    ;;
serve-ratio)
    # One card: offline gpu-7b (pagedllm only), then one server on the same shape with
    # `bench serve` at 256 and at 64 clients, each given the offline result; 256 clients
    # again from one client process (what the client costs); a server with a smaller step
    # token budget at 64 clients (what prefill bursts do to ITL); offline at max_num_seqs 64
    # (the most 64 clients can get).
    offline=$OUT/gpu-7b-offline.json
    rm -f "$offline" "$OUT"/gpu-7b-serve-*.json "$OUT"/gpu-7b-offline-seqs64.json
    timeout "$(cap 240)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-7b \
        --output-json "$offline" 2>&1 | tail -10
    if [[ -f $offline ]] && SERVER_WAIT_S=$(cap 240) start_7b ratio; then
        BENCH_S=$(cap 150) bench_7b c256 256 512 --offline-json "$offline"
        BENCH_S=$(cap 150) bench_7b c64 64 256 --warmup 1 --offline-json "$offline"
        BENCH_S=$(cap 120) bench_7b c256-1client 256 512 --client-processes 1 \
            --offline-json "$offline"
        stop_7b
    fi
    if SERVER_WAIT_S=$(cap 200) start_7b budget1024 --max-num-batched-tokens 1024; then
        BENCH_S=$(cap 120) bench_7b c64-budget1024 64 256 --warmup 1 --offline-json "$offline"
        stop_7b
    fi
    timeout "$(cap 200)" python3 -m pagedllm.entrypoints.bench throughput --workload gpu-7b \
        --max-num-seqs 64 --output-json "$OUT/gpu-7b-offline-seqs64.json" 2>&1 | tail -3
    serve_ratio_summary "$offline" "$OUT"/gpu-7b-serve-*.json
    summary "$OUT/gpu-7b-offline-seqs64.json"
    ;;
mixed)
    # Issue 34's mixed workload: 64 streams on gpu-7b's shape (256 in, 512 out) and, 3 s in,
    # one 32,000-token prompt beside them; the streams' ITL p99 / median (target <= 2) and
    # their gaps while the prompt prefills, per cap on a step's prompt tokens (CAPS).
    # Steps with decodes and a prompt chunk replay CUDA graphs (their GPU test first);
    # MIXED_GRAPHS=0 runs them eagerly (PAGEDLLM_MIXED_GRAPHS=0), results named mixed-eager-*.
    tag=mixed
    if [[ ${MIXED_GRAPHS:-1} == 0 ]]; then
        export PAGEDLLM_MIXED_GRAPHS=0
        tag=mixed-eager
    elif [[ ${MIXED_TESTS:-1} != 0 ]]; then  # MIXED_TESTS=0 skips them
        timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mixed_graphs.py \
            tests/test_long_decode_graphs.py 2>&1 | tail -3
    fi
    for c in ${CAPS-512 256}; do  # CAPS="" runs none
        if MAX_POS=40960 SERVER_WAIT_S=$(cap 200) start_7b "$tag-cap$c" --max-model-len 40960 \
                --max-prefill-tokens-with-decodes "$c"; then
            BENCH_S=$(cap 150) bench_7b "$tag-cap$c" 64 64 --output-len 512 --warmup 1 \
                --long-prompt-len 32000 --long-prompt-delay 3
            stop_7b
        fi
    done
    for r in ${RATIOS-1.5 2}; do  # paced chunks (--prefill-step-ratio), within the 512 cap
        # the pacer's figures after each step, a JSON line each (core/prefill_pacer.py)
        if PAGEDLLM_PACER_TRACE="$OUT/pacer-$tag-ratio$r.jsonl" MAX_POS=40960 SERVER_WAIT_S=$(cap 200) \
                start_7b "$tag-ratio$r" --max-model-len 40960 --prefill-step-ratio "$r"; then
            BENCH_S=$(cap 150) bench_7b "$tag-ratio$r" 64 64 --output-len 512 --warmup 1 \
                --long-prompt-len 32000 --long-prompt-delay 3
            stop_7b
        fi
    done
    summary "$OUT"/gpu-7b-serve-mixed*.json
    ;;
tp)
    export NCCL_NVLS_ENABLE=0
    timeout 240 python3 benchmarks/tp_check.py --tp 2 --layers 8 2>&1 | tail -6
    bench throughput --workload gpu-7b --output-json "$OUT/gpu-7b-tp1.json" 2>&1 | tail -2
    bench throughput --workload gpu-7b --tensor-parallel-size 2 --output-json "$OUT/gpu-7b-tp2.json" 2>&1 | tail -2
    summary "$OUT"/gpu-7b-tp*.json
    serve_7b tp2-c1 1 16 --tensor-parallel-size 2
    serve_7b tp1-c1 1 16
    ;;
lora)
    # Multi-LoRA: its GPU tests (kernels, float32 parity vs PEFT through CUDA graphs, bf16),
    # then gpu-7b base vs 8 adapters over 4 slots vs 1 adapter (each engine in its own process).
    # LORA_TESTS=0 skips the tests; LORA_REPEATS timed runs per case (best of them).
    [[ ${LORA_TESTS:-1} == 1 ]] && timeout "$(cap 150)" python3 -m pytest -q -m gpu tests/test_lora.py \
        -p no:cacheprovider 2>&1 | tail -8
    timeout "$(cap 420)" python3 benchmarks/lora_bench.py --repeats "${LORA_REPEATS:-2}" \
        --output-json "$OUT/gpu-7b-lora.json" 2>&1 | tail -16
    ;;
lora-profile)
    # The LoRA kernels alone on one layer, per launch setting (a minute or two of compiles);
    # then gpu-7b under the profiler without and with one rank-16 adapter on every prompt
    # (lora1): which kernels the adapter's ~12% goes to.
    timeout "$(cap 240)" python3 benchmarks/lora_kernel_bench.py --json "$OUT/lora-kernels.json" 2>&1 \
        | grep -v Warning | tail -45
    timeout "$(cap 200)" python3 benchmarks/profile_kernels.py --workload gpu-7b --top 14 \
        --json "$OUT/profile-gpu-7b.json" 2>&1 | grep -v "USDT\|Warning" | tail -15
    timeout "$(cap 240)" python3 benchmarks/profile_kernels.py --workload gpu-7b --lora 16 --top 20 \
        --json "$OUT/profile-gpu-7b-lora1.json" 2>&1 | grep -v "USDT\|Warning" | tail -21
    ;;
quant)
    timeout 200 python3 benchmarks/quant_decode.py --mode layers --layers 32 --batch 1 16 64 256 2048 2>&1 | tail -8
    timeout 300 python3 benchmarks/quant_decode.py --mode engine --batch 1 16 256 2>&1 | tail -8
    ;;
esac
