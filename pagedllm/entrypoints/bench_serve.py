"""`pagedllm bench serve`: latency and throughput of a running server, the method of
`vllm bench serve`.

Every request streams (`stream_options.include_usage`), asks for exactly `--output-len`
tokens (`ignore_eos`) and is timed from just before it is sent:
- TTFT, time to first token: until the first event that carries text;
- ITL, inter-token latency: the gaps between such events;
- TPOT, time per output token: (latency - TTFT) / (output tokens - 1), per request;
- E2E latency: until the stream ends.
Each is reported as mean, median and p99 (ms); throughput is requests, output tokens and
all tokens per second of the whole run. Arrivals are all at once or Poisson at
`--request-rate`, and `--max-concurrency` caps the requests in flight. The clients
(`bench_client`) use aiohttp and, for many streams, several processes, so that they cost
the run little (a pure-Python client was measured to be the bound of earlier runs).

`--offline-json` names an offline `bench throughput` result of the same model shape on the
same card: the result then carries the offline output tok/s, the ratio served / offline and
that run's card, so one file shows what the HTTP path, streaming and the clients cost.

`--long-prompt-len N` adds the mixed workload: `--long-prompt-delay` seconds into the run,
one more request with an N-token prompt is sent beside the streams (it takes no concurrency
slot). The streams' figures above leave it out; `long_prompt` in the result holds its TTFT
and the streams' gaps that overlap its prefill (from its sending to its first token): what
a long prompt does to everyone else's inter-token latency.

Prompts are random token ids (seeded) drawn from the server's own tokenization of a fixed
text, so they are valid for any model and exactly `--input-len` tokens long on the
completions endpoint; the chat endpoint sends their text, and the chat template adds its
own tokens (the JSON reports the real counts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time

import numpy as np

from pagedllm.entrypoints.bench_client import (
    STREAMS_PER_PROCESS,
    TAG_KEY,
    RequestResult,
    default_processes,
    one,
    run_processes,
    run_share,
    session,
)
from pagedllm.entrypoints.bench_report import args_dict, environment, write_json

DEFAULT_NUM_PROMPTS = 64
DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 64
_SOURCE_TEXT = (
    "The paged key-value cache stores attention keys and values in fixed-size blocks, so "
    "that requests of any length share one pool without fragmentation. A scheduler admits "
    "waiting requests while blocks remain, runs decodes and chunked prefills in one batch "
    "each step, and preempts the newest request when memory runs out. Streaming returns "
    "tokens as they are produced; a benchmark measures the time to the first token, the "
    "time between tokens, and the throughput of the whole system under a given load. "
    "Numbers 0123456789, punctuation ;:!?()[]{} and words in other languages: bonjour, "
    "gracias, danke, arigato, grazie, obrigado, spasibo, shukran, xiexie, namaste."
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (default: http://127.0.0.1:8000)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (token-id prompts) or /v1/chat/completions")
    s.add_argument("--model", help="model name to request (default: the server's first)")
    s.add_argument("--api-key", help="bearer key (default: $PAGEDLLM_API_KEY, then "
                                     "$OPENAI_API_KEY)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                   help=f"timed requests (default {DEFAULT_NUM_PROMPTS})")
    w.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN,
                   help=f"prompt tokens (default {DEFAULT_INPUT_LEN})")
    w.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN,
                   help=f"output tokens per request (default {DEFAULT_OUTPUT_LEN})")
    w.add_argument("--prompt-vocab-size", type=int, metavar="N",
                   help="draw prompt ids uniformly from [0, N) instead of from the server's "
                        "tokenization of a text (random-weight models with a word tokenizer)")
    w.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")
    w.add_argument("--seed", type=int, default=0, help="prompt and arrival seed")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    w.add_argument("--max-concurrency", type=int,
                   help="at most this many requests in flight (default: no cap)")
    w.add_argument("--client-processes", type=int, metavar="P",
                   help="client processes sharing the requests (default: one per "
                        f"{STREAMS_PER_PROCESS} concurrent streams, at most half the CPUs)")
    w.add_argument("--warmup", type=int, default=2,
                   help="untimed requests before the run (other prompts; default 2)")
    w.add_argument("--long-prompt-len", type=int, default=0, metavar="N",
                   help="the mixed workload: one more request with an N-token prompt, sent "
                        "--long-prompt-delay seconds into the run beside the streams (default 0: none)")
    w.add_argument("--long-prompt-delay", type=float, default=2.0, metavar="S",
                   help="seconds after the run starts (default 2)")
    w.add_argument("--long-output-len", type=int, default=16,
                   help="output tokens of the long-prompt request (default 16)")
    p.add_argument("--offline-json", metavar="FILE",
                   help="an offline `bench throughput` result (same model shape and card): "
                        "records its output tok/s, served / offline and its card")
    p.add_argument("--output-json", help="write the result here")


def _stats_ms(name: str, values: list[float]) -> dict:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    a = np.asarray(values) * 1000.0
    return {f"mean_{name}_ms": round(float(a.mean()), 3),
            f"median_{name}_ms": round(float(np.median(a)), 3),
            f"p99_{name}_ms": round(float(np.percentile(a, 99)), 3)}


def long_prompt_figures(long: RequestResult, streams: list[RequestResult], start: float) -> dict:
    """The long prompt's TTFT, when it was sent, and the streams' gaps between tokens that
    overlap its prefill window [sent, first token]: how long the others waited meanwhile."""
    out = {"ok": long.ok, "error": long.error, "prompt_tokens": long.prompt_tokens,
           "sent_at_s": round(long.sent - start, 3)}
    if not long.ok:
        return out
    lo, hi = long.sent, long.sent + long.ttft
    before, during, after = [], [], []
    for r in streams:
        if not r.ok:
            continue
        t = r.sent + r.ttft  # the stream's first token
        for gap in r.itl:
            if t < hi and t + gap > lo:
                during.append(gap)
            else:
                (before if t + gap <= lo else after).append(gap)
            t += gap
    # The gaps outside the prefill too, by phase: where a run's p99 falls when the prefill
    # is short (before it: the streams' own prompts being admitted beside earlier streams).
    phases = {f"{name}_long_prompt": {"gaps": len(g), **_stats_ms("itl", g),
                                      "max_itl_ms": round(max(g) * 1000.0, 3)}
              for name, g in (("before", before), ("after", after)) if g}
    return {**out, "ttft_ms": round(long.ttft * 1000.0, 3), "gaps_during_prefill": len(during),
            **{k.replace("itl", "itl_during_prefill"): v for k, v in _stats_ms("itl", during).items()},
            "max_itl_during_prefill_ms": round(max(during) * 1000.0, 3) if during else None, **phases}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM's figures, under vLLM's names, from the per-request records, and the ITL's
    p99 / median: how much longer the worst gaps are than a typical one (a prefill or a
    stall between two tokens shows there, not in the mean). Tagged requests (the long
    prompt) are not counted among the streams."""
    results = [r for r in results if r.tag is None]
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = _stats_ms("itl", [x for r in done for x in r.itl])
    median, p99 = itl["median_itl_ms"], itl["p99_itl_ms"]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration, 4),
        "output_throughput": round(out_tokens / duration, 3),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 3),
        **_stats_ms("ttft", [r.ttft for r in done]),
        **_stats_ms("tpot", tpots),
        **itl,
        "itl_p99_over_median": round(p99 / median, 3) if median else None,
        **_stats_ms("e2el", [r.latency for r in done]),
    }


def load_offline(path: str) -> dict:
    """The figures of an offline `bench throughput` result that a serve result sets beside
    its own; read before the run, so that a wrong file fails before minutes of load."""
    with open(path) as f:
        saved = json.load(f)
    engine = saved.get("results", {}).get("pagedllm") if isinstance(saved, dict) else None
    if not engine or saved.get("benchmark") != "throughput":
        raise SystemExit(f"{path}: not a `bench throughput` result with a pagedllm figure")
    env, workload = saved.get("environment", {}), saved.get("workload", {})
    return {
        "path": path,
        "output_throughput": engine["output_tokens_per_s"],
        "device_name": env.get("device_name"),
        "date": env.get("date"),
        "commit": (env.get("git") or {}).get("short"),
        "workload": {k: workload.get(k) for k in ("name", "num_prompts", "input_len_range",
                                                   "output_len_range")},
    }


def compare_offline(figures: dict, offline: dict) -> dict:
    """Served output tok/s over offline: 1.0 would mean the HTTP server, streaming and the
    clients cost nothing. `server_device` is the offline run's card: the server itself does
    not report one, and the ratio means something only when both ran on the same card."""
    return {
        "offline_output_throughput": offline["output_throughput"],
        "offline_ratio": round(figures["output_throughput"] / offline["output_throughput"], 4),
        "server_device": offline["device_name"],
    }


class _Server:
    """The few calls a benchmark needs besides the timed ones."""

    def __init__(self, client):
        self.client = client

    async def get(self, path: str) -> dict:
        async with self.client.get(path.lstrip("/")) as r:
            r.raise_for_status()
            return await r.json()

    async def post(self, path: str, body: dict) -> dict:
        async with self.client.post(path.lstrip("/"), json=body) as r:
            if r.status != 200:
                raise SystemExit(f"{path}: HTTP {r.status}: {(await r.text())[:300]}")
            return await r.json()


def _prompts(pool: list[int], n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


async def _prepare(args: argparse.Namespace, headers: dict) -> tuple[dict, list[dict], str]:
    """Ask the server its model and version, build the bodies, and run the warm-up."""
    async with session(args.base_url, headers, args.timeout, 4) as client:
        server = _Server(client)
        models = await server.get("/v1/models")
        model = args.model or models["data"][0]["id"]
        version = (await server.get("/version")).get("version")
        if args.prompt_vocab_size:
            pool = list(range(args.prompt_vocab_size))
        else:
            pool = (await server.post("/tokenize", {"prompt": _SOURCE_TEXT,
                                                    "add_special_tokens": False}))["tokens"]
        rng = random.Random(args.seed)
        prompts = _prompts(pool, args.num_prompts + args.warmup, args.input_len, rng)
        chat = args.endpoint == "chat"
        path = "/v1/chat/completions" if chat else "/v1/completions"

        async def body(ids: list[int]) -> dict:
            b = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if chat:
                text = (await server.post("/detokenize", {"tokens": ids}))["prompt"]
                return {**b, "messages": [{"role": "user", "content": text}]}
            return {**b, "prompt": ids}

        bodies = [await body(ids) for ids in prompts]
        for b in bodies[: args.warmup]:
            warm = await one(client, path, b)
            if not warm.ok:
                raise SystemExit(f"warm-up request failed: {warm.error}")
        long_body = None
        if args.long_prompt_len:
            long_body = {**await body(_prompts(pool, 1, args.long_prompt_len, rng)[0]),
                         "max_tokens": args.long_output_len, TAG_KEY: "long_prompt"}
    server_info = {"base_url": args.base_url, "model": model, "version": version,
                   "endpoint": path}
    return server_info, bodies[args.warmup:], path, long_body


def _run(args: argparse.Namespace, offline: dict | None = None) -> dict:
    try:
        import aiohttp  # noqa: F401
    except ImportError:  # a client-side tool: the server itself does not need aiohttp
        raise SystemExit("pagedllm bench serve needs aiohttp: pip install aiohttp") from None
    key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    concurrency = args.max_concurrency or args.num_prompts
    server_info, timed, path, long_body = asyncio.run(_prepare(args, headers))
    arrivals = random.Random(args.seed + 1)
    offsets, t = [], 0.0
    for _ in timed:  # request i is sent `offsets[i]` seconds after the start (Poisson)
        offsets.append(t)
        if math.isfinite(args.request_rate):
            t += arrivals.expovariate(args.request_rate)
    items = list(zip(offsets, timed, strict=True))
    if long_body is not None:
        items.append((args.long_prompt_delay, long_body))
    processes = args.client_processes or default_processes(concurrency, os.cpu_count() or 2)
    load_before = os.getloadavg()
    if processes == 1:
        results, end = asyncio.run(run_share(args.base_url, headers, args.timeout, path, items,
                                             concurrency, start := time.perf_counter()))
        duration = end - start
    else:
        results, duration = run_processes(args.base_url, headers, args.timeout, path, items,
                                          concurrency, processes)
    figures = summarize(results, duration)
    long = [r for r in results if r.tag == "long_prompt"]
    if long:
        figures["long_prompt"] = long_prompt_figures(long[0], [r for r in results if r.tag is None],
                                                     min(r.sent for r in results if r.sent))
    # On a shared machine the load around the run says how far to trust it.
    figures["load_average_1m"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    figures["client_processes"] = processes
    errors = sorted({r.error for r in results if r.error})[:5]
    settings = args_dict(args)
    if not math.isfinite(args.request_rate):
        settings["request_rate"] = "inf"  # JSON has no Infinity
    import torch

    result = {"benchmark": "serve", "environment": environment(torch.device("cpu")),
              "server": server_info, "args": settings, "results": figures, "errors": errors}
    if offline is not None:
        figures.update(compare_offline(figures, offline))
        result["offline"] = offline
    return result


def _print(result: dict) -> None:
    r, a = result["results"], result["args"]
    print(f"serve benchmark: {result['server']['model']} at {result['server']['base_url']}"
          f"{result['server']['endpoint']}; {a['num_prompts']} requests, "
          f"{a['input_len']} in / {a['output_len']} out, concurrency "
          f"{a['max_concurrency'] or 'unbounded'}, rate {a['request_rate']}")
    print(f"  completed {r['completed']}, failed {r['failed']}, {r['duration_s']} s")
    print(f"  throughput  {r['request_throughput']} req/s, {r['output_throughput']} output tok/s, "
          f"{r['total_token_throughput']} total tok/s")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        print(f"  {label:<5} ms   mean {r[f'mean_{name}_ms']}, median {r[f'median_{name}_ms']}, "
              f"p99 {r[f'p99_{name}_ms']}")
    print(f"  ITL p99 / median {r['itl_p99_over_median']}")
    if "long_prompt" in r:
        lp = r["long_prompt"]
        if lp["ok"]:
            print(f"  long prompt ({lp['prompt_tokens']} tokens, sent at {lp['sent_at_s']} s): TTFT "
                  f"{lp['ttft_ms']} ms; the streams' gaps meanwhile: {lp['gaps_during_prefill']}, "
                  f"median {lp['median_itl_during_prefill_ms']} ms, p99 "
                  f"{lp['p99_itl_during_prefill_ms']} ms, max {lp['max_itl_during_prefill_ms']} ms")
            for phase in ("before", "after"):
                ph = lp.get(f"{phase}_long_prompt")
                if ph:
                    print(f"  gaps {phase} it: {ph['gaps']}, median {ph['median_itl_ms']} ms, "
                          f"p99 {ph['p99_itl_ms']} ms, max {ph['max_itl_ms']} ms")
        else:
            print(f"  long prompt failed: {lp['error']}")
    if "offline" in result:
        o = result["offline"]
        print(f"  offline (bench throughput on {o['device_name']}, {o['commit']}): "
              f"{r['offline_output_throughput']} output tok/s; served / offline "
              f"{r['offline_ratio']}")
        w = o["workload"]
        if (w["input_len_range"], w["output_len_range"]) != ([a["input_len"]] * 2,
                                                            [a["output_len"]] * 2):
            print(f"  note: the offline run's lengths ({w['input_len_range']} in, "
                  f"{w['output_len_range']} out) differ from this run's")
    for e in result["errors"]:
        print(f"  error: {e}")


def run_serve(args: argparse.Namespace) -> dict:
    offline = load_offline(args.offline_json) if args.offline_json else None
    result = _run(args, offline)
    _print(result)
    if args.output_json:
        write_json(args.output_json, result)
        print(f"wrote {args.output_json}")
    return result
