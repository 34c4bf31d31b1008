#!/usr/bin/env bash
# One call for the published row not yet measured on this tree: trt-8b-1k with TensorRT-LLM's
# 3,000 requests (trt_full.sh), then, with the time left, on an H200 trt-8b-2k's 512-request
# wave (its first figure on that card), on an H100 that wave under host_sync_check.py (the
# device's time inside and between launches).
set -u
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
start=$SECONDS
total=${BUDGET_S:-570}
TRT_WORKLOADS=trt-8b-1k BUDGET_S=$total bash benchmarks/trt_full.sh
left=$((total - (SECONDS - start)))
(( left < 110 )) && { echo "nothing more: ${left} s left"; exit 0; }
if [[ $card == *H200* ]]; then
    timeout "$left" python3 -m pagedllm.entrypoints.bench throughput --workload trt-8b-2k --num-prompts 512 \
        --max-num-seqs 512 --warmup 2 --swap-space 8 --output-json "$OUT/trt-8b-2k-n512-swap8.json" 2>&1 | tail -3
else
    timeout "$left" python3 benchmarks/host_sync_check.py --workload trt-8b-2k --num-prompts 512 \
        --max-num-seqs 512 --input-len 128 --output-len 2048 --swap-space 8 --only-async 2>&1 | tail -24
fi
