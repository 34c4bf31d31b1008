"""The clients of `pagedllm bench serve`: streaming requests timed token by token, in this
process or spread over several.

A benchmark client must cost far less per token than the server it measures, or it
measures itself. It uses aiohttp (its HTTP parser is compiled; a pure-Python client spent
several times the server's CPU per streamed token), and above a few hundred streams it
runs in several processes, each with its own event loop and share of the requests, so
that no client process is near a full core. This module imports neither torch nor the
engine: each client process starts in well under a second.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

# Streams one client process serves; more concurrency gets more processes.
STREAMS_PER_PROCESS = 128


# A body carrying this key is sent without it and its result tagged with its value; a tagged
# request does not wait for a concurrency slot (bench serve's long prompt among the streams).
TAG_KEY = "_bench_tag"


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    sent: float = 0.0  # perf_counter when it was sent (the system's monotonic clock)
    tag: str | None = None
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def default_processes(concurrency: int, cpus: int) -> int:
    """One process per STREAMS_PER_PROCESS streams, leaving half the CPUs to the server."""
    return max(1, min(math.ceil(concurrency / STREAMS_PER_PROCESS), cpus // 2))


def session(base_url: str, headers: dict, timeout: float, connections: int):
    import aiohttp

    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/") + "/", headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=connections + 4))


async def one(client, path: str, body: dict) -> RequestResult:
    """One streamed request: TTFT to the first event with text, ITL between such events."""
    res = RequestResult()
    start = res.sent = time.perf_counter()
    last = None
    try:
        async with client.post(path.lstrip("/"), json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    res.error = event["error"].get("message", "error event")
                    return res
                if event.get("usage"):
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                    res.output_tokens = event["usage"]["completion_tokens"]
                text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                               for c in event.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = last is not None
        if not res.ok:
            res.error = "the stream carried no text"
    except Exception as e:  # a benchmark reports failures rather than stopping at one
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_share(base_url: str, headers: dict, timeout: float, path: str,
                    items: list[tuple[float, dict]], concurrency: int, start: float
                    ) -> tuple[list[RequestResult], float]:
    """Send `items` (arrival offset in seconds after `start`, a perf_counter time; body)
    with at most `concurrency` in flight; the results and the time the last one ended."""
    gate = asyncio.Semaphore(concurrency)
    async with session(base_url, headers, timeout, concurrency) as client:
        async def timed(offset: float, body: dict) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if TAG_KEY in body:
                body = dict(body)
                tag = body.pop(TAG_KEY)
                res = await one(client, path, body)
                res.tag = tag
                return res
            async with gate:
                return await one(client, path, body)

        results = await asyncio.gather(*(timed(o, b) for o, b in items))
    return list(results), time.perf_counter()


def client_process(base_url: str, headers: dict, timeout: float, path: str,
                   items: list[tuple[float, dict]], concurrency: int, barrier, results) -> None:
    """One client process: wait until all are ready, then run its share from the same
    start. perf_counter is the system's monotonic clock, the same in every process."""
    try:
        barrier.wait(timeout=120)
        start = time.perf_counter()
        out = asyncio.run(run_share(base_url, headers, timeout, path, items, concurrency, start))
        results.put((start, *out))
    except BaseException as e:
        results.put(e)
        raise


def run_processes(base_url: str, headers: dict, timeout: float, path: str,
                  items: list[tuple[float, dict]], concurrency: int, processes: int
                  ) -> tuple[list[RequestResult], float]:
    """Run `items` over `processes` client processes (request i goes to process i mod P;
    the concurrency cap is split between them); the results (in no particular order) and
    the seconds from the common start to the end of the last request."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    processes = max(1, min(processes, len(items), concurrency))
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = []
    for p in range(processes):
        share = concurrency // processes + (1 if p < concurrency % processes else 0)
        proc = ctx.Process(target=client_process, name=f"bench-client-{p}", daemon=True,
                           args=(base_url, headers, timeout, path, items[p::processes], share,
                                 barrier, results))
        proc.start()
        procs.append(proc)
    outs = []
    try:
        for _ in procs:
            out = results.get(timeout=timeout + 180)
            if isinstance(out, BaseException):
                raise RuntimeError(f"a client process failed: {out!r}")
            outs.append(out)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    # Each process took its start as it passed the barrier: within microseconds of the others.
    start = min(o[0] for o in outs)
    end = max(o[2] for o in outs)
    return [r for o in outs for r in o[1]], end - start
