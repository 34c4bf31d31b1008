#!/usr/bin/env bash
# One call for what no tree has measured yet. On an H200: trt-8b-2k with TensorRT-LLM's
# 3,000 requests (trt_full.sh; the card's first figure against the published 26,221), then
# trt-8b-1k with 3,000 requests if 250 s are left, else its 512-request wave; both at up to
# 768 running sequences (H200_SEQS), since the H200's pool holds about 800 of either shape
# where the H100's holds 466-507: schedule_replay.py with the H100's step costs and the
# attention term scaled to the H200's bandwidth prices 3,000 x (128 in, 2,048 out) at 24,491
# output tok/s capped at 768 against 22,308 at 512 and 23,144 at 1,024 (which preempts),
# and 3,000 x (1,000, 1,000) at 15,397 against 14,519 (a model that priced the H100's
# measured trt-8b-1k 7% low). On an H100:
# first the device's time inside and between launches over trt-8b-2k's 512-request wave
# (host_sync_check.py) with the startup heap thawed, then frozen (the default since
# pagedllm/heap.py: does the idle time between steps go?), then the same wave through the
# bench (its figure with the frozen heap), then, with 300 s or more left, trt-8b-2k with
# 3,000 requests. Results under $OUT.
set -u
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
start=$SECONDS
total=${BUDGET_S:-570}
left() { echo $((total - (SECONDS - start))); }
wave() {  # wave WORKLOAD TAG [bench flags...]: the 512-request wave, results $OUT/WORKLOAD-TAG.json
    local w=$1 tag=$2
    shift 2
    timeout "$(left)" python3 -m pagedllm.entrypoints.bench throughput --workload "$w" --num-prompts 512 \
        --max-num-seqs 512 --warmup 2 --swap-space 8 "$@" --output-json "$OUT/$w-$tag.json" 2>&1 | tail -3
}
if [[ $card == *H200* ]]; then
    seqs=${H200_SEQS:-768}
    TRT_FULL_SEQS=$seqs TRT_WORKLOADS=trt-8b-2k BUDGET_S=$(( $(left) - 120 )) bash benchmarks/trt_full.sh
    if (( $(left) >= 250 )); then
        TRT_FULL_SEQS=$seqs TRT_WORKLOADS=trt-8b-1k BUDGET_S=$(left) bash benchmarks/trt_full.sh
    elif (( $(left) >= 110 )); then
        wave trt-8b-1k n512-swap8
    fi
    exit 0
fi
timeout 220 python3 benchmarks/host_sync_check.py --workload trt-8b-2k --num-prompts 512 --max-num-seqs 512 \
    --input-len 128 --output-len 2048 --swap-space 8 --only-async --gc-modes thawed frozen 2>&1 \
    | grep -v "Warning" | tail -44 | tee "$OUT/host-gc-trt-8b-2k.txt"
(( $(left) >= 110 )) && wave trt-8b-2k n512-swap8
if (( $(left) >= 300 )); then
    TRT_WORKLOADS=trt-8b-2k BUDGET_S=$(left) bash benchmarks/trt_full.sh
else
    echo "trt-8b-2k with 3,000 requests skipped: $(left) s left"
fi
