#!/usr/bin/env bash
# The GPU figures of the README's Performance table, in two parts that each fit a
# 10-minute device call. Writes JSON and logs under $OUT (default: ./gpu-out).
#   bash benchmarks/gpu_run.sh tests|throughput|baseline|serve|quant|tp
# throughput: gpu-7b with HF's compiled static cache at batch 256 in the same run, then
#   both workloads with async scheduling off (what overlap is worth);
# baseline: gpu-0.6b with its HF baseline (slow: HF needs about three minutes);
# serve: the server on gpu-7b's shape, 64 concurrent streaming clients;
# quant: W4A16 vs bf16 on the Llama-2-7B linear stack (32 layers) and the whole engine;
# tp (two GPUs): TP=2 vs TP=1 greedy tokens, gpu-7b throughput at TP=1 and TP=2.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
bench() { python3 -m pagedllm.entrypoints.bench "$@"; }
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
              f"ratio {r.get('ratio')}  roofline {r.get('roofline', {}).get('achieved_fraction')}")
    else:
        keys = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
        print(path, {k: res.get(k) for k in keys})
EOF
}

# serve_7b NAME CLIENTS PROMPTS [server flags...]: the server on gpu-7b's shape (random
# weights, a word-per-id tokenizer) and `bench serve` at CLIENTS concurrent streams.
serve_7b() {
    local name=$1 clients=$2 prompts=$3 dir server
    shift 3
    dir=$(mktemp -d)
    python3 - "$dir" <<'EOF'
import sys
from pagedllm.entrypoints.bench_workloads import LLAMA2_7B_CONFIG, write_arch_config, write_word_tokenizer
write_arch_config(LLAMA2_7B_CONFIG, sys.argv[1])
write_word_tokenizer(sys.argv[1], LLAMA2_7B_CONFIG["vocab_size"])
EOF
    python3 -m pagedllm.entrypoints.cli serve "$dir" --load-format dummy --dtype bfloat16 \
        --served-model-name llama-2-7b-shape --port 8011 --max-model-len 4096 \
        --log-level warning "$@" >"$OUT/server-$name.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" \
            2>/dev/null && break
        sleep 1
    done
    bench serve --base-url http://127.0.0.1:8011 --num-prompts "$prompts" --input-len 256 --output-len 256 \
        --max-concurrency "$clients" --prompt-vocab-size 32000 --warmup 4 --temperature 1.0 \
        --output-json "$OUT/gpu-7b-serve-$name.json" 2>&1 | tail -20
    kill -INT $server
    wait $server
    summary "$OUT/gpu-7b-serve-$name.json"
}

case "${1:-throughput}" in
tests)
    timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
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
tp)
    export NCCL_NVLS_ENABLE=0
    timeout 240 python3 benchmarks/tp_check.py --tp 2 --layers 8 2>&1 | tail -6
    bench throughput --workload gpu-7b --output-json "$OUT/gpu-7b-tp1.json" 2>&1 | tail -2
    bench throughput --workload gpu-7b --tensor-parallel-size 2 --output-json "$OUT/gpu-7b-tp2.json" 2>&1 | tail -2
    summary "$OUT"/gpu-7b-tp*.json
    serve_7b tp2-c1 1 16 --tensor-parallel-size 2
    serve_7b tp1-c1 1 16
    ;;
quant)
    timeout 200 python3 benchmarks/quant_decode.py --mode layers --layers 32 --batch 1 16 64 256 2048 2>&1 | tail -8
    timeout 300 python3 benchmarks/quant_decode.py --mode engine --batch 1 16 256 2>&1 | tail -8
    ;;
esac
