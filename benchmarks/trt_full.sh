#!/usr/bin/env bash
# TensorRT-LLM's protocol for its published Llama-3.1-8B FP8 rows: 3,000 requests fed at once
# (NUM_PROMPTS overrides), FP8 weights and pages, with a swap space for preempted sequences.
# On an H100: trt-8b-2k at 512 sequences (about 330 s). On an H200 (faster memory): trt-8b-1k
# then trt-8b-2k, at 512 sequences, each only with 150 s or more left. TRT_FULL_SEQS="512 1024" runs each cap in turn (graphs
# captured up to a cap over 512). Results: $OUT/s<max_num_seqs>/<workload>.json. Run from the
# repository root on the device.
set -u
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
seqs=${TRT_FULL_SEQS:-512}
workloads=${TRT_WORKLOADS:-trt-8b-2k}
[[ $card == *H200* && -z ${TRT_WORKLOADS:-} ]] && workloads="trt-8b-1k trt-8b-2k"
start=$SECONDS
total=${BUDGET_S:-570}
for s in $seqs; do
  for w in $workloads; do
    left=$((total - (SECONDS - start)))
    (( left < 150 )) && { echo "skipped $w at $s sequences: ${left} s left"; continue; }
    mkdir -p "$OUT/s$s"
    graphs=512
    (( s > 512 )) && graphs=$s
    PAGEDLLM_MAX_GRAPH_BATCH=$graphs BUDGET_S=$left NUM_PROMPTS=${NUM_PROMPTS:-3000} MAX_SEQS=$s \
        TRT_WORKLOADS="$w" TRT_RUN_S=$left TRT_ARGS="--swap-space ${SWAP_GIB:-8}" \
        OUT="$OUT/s$s" bash benchmarks/gpu_run.sh trt
  done
done
