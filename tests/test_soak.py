"""A bounded soak: ordinary streaming traffic, first alone, then beside every abusive
pattern the server must refuse cheaply (the real server, SmolLM2-135M-Instruct on CPU).

Ordinary clients stream short chat answers in a loop. The abusers, one loop each, send:
a request of many prompts x n (past one request's share of the queue), a response whose
logprobs would be huge, a 4 MB prompt, chat template arguments nested too deep, malformed
JSON, a body over the size limit, and streams dropped after their first event. Checked:
no ordinary request fails, every abusive one gets its 4xx (never a 5xx), the ordinary p99
TTFT stays within 3x of its value without the abuse, and the pool returns to empty.

PAGEDLLM_SOAK_S sets each phase's seconds (default 30: about a minute and a half in all, for CI; set
it to a few hundred for a longer soak on request).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from server_process import launch_server, wait_idle

PHASE_S = float(os.environ.get("PAGEDLLM_SOAK_S", "30"))
ORDINARY_CLIENTS = 3
MAX_WAITING = 64  # one request may hold 16 sequences
MAX_RESPONSE_LOGPROBS = 20_000
MAX_BODY = 2**20  # bytes
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "smol",
             "--max-waiting-requests", str(MAX_WAITING),
             "--max-response-logprobs", str(MAX_RESPONSE_LOGPROBS),
             "--max-request-body-bytes", str(MAX_BODY)]
    with launch_server(tmp_path_factory.mktemp("soak"), flags, graceful_stop=False) as sp:
        yield sp.url


async def ordinary(client: httpx.AsyncClient, stop_at: float, ttfts: list[float],
                   failures: list[str], seed: int) -> None:
    """Stream short answers until `stop_at`; TTFT is the time to the first text."""
    i = 0
    while time.monotonic() < stop_at:
        i += 1
        body = {"model": "smol", "messages": [{"role": "user", "content": f"Count to {seed + i}."}],
                "max_tokens": 8, "temperature": 0, "stream": True}
        start = time.perf_counter()
        first, text, finished = None, "", False
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        failures.append(f"error event: {event['error']}")
                        break
                    for c in event["choices"]:
                        piece = c["delta"].get("content")
                        if piece and first is None:
                            first = time.perf_counter() - start
                        text += piece or ""
                        finished = finished or c["finish_reason"] is not None
        except httpx.HTTPError as e:
            failures.append(f"{type(e).__name__}: {e}")
            continue
        if first is None or not finished:
            failures.append(f"incomplete answer: {text!r}")
        else:
            ttfts.append(first)


def _abuses() -> list[tuple[str, str, dict | bytes, int]]:
    """(name, path, body, the status it must get)."""
    deep: dict = {}
    node = deep
    for _ in range(50):
        node["x"] = {}
        node = node["x"]
    long_prompt = "word " * 400  # ~400 tokens: its echoed logprobs alone pass the bound
    return [
        ("prompts x n", "/v1/completions",
         {"model": "smol", "prompt": ["hi"] * 64, "n": 64, "max_tokens": 1}, 400),
        ("huge logprobs", "/v1/completions",
         {"model": "smol", "prompt": long_prompt, "echo": True, "logprobs": 20, "n": 8,
          "max_tokens": 64}, 400),
        ("4 MB prompt", "/v1/completions",
         {"model": "smol", "prompt": "x" * (4 * 2**20 - 100), "max_tokens": 1}, 413),
        ("prompt over the context", "/v1/completions",
         {"model": "smol", "prompt": "y" * (MAX_MODEL_LEN * 64 + 1), "max_tokens": 1}, 400),
        ("deep template arguments", "/v1/chat/completions",
         {"model": "smol", "messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": deep, "max_tokens": 1}, 400),
        ("malformed JSON", "/v1/chat/completions", b'{"model": "smol", "messages": [', 400),
    ]


async def abuser(client: httpx.AsyncClient, name: str, path: str, body, expect: int,
                 stop_at: float, wrong: list[str], counts: dict[str, int]) -> None:
    while time.monotonic() < stop_at:
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body}
        r = await client.post(path, **kw)
        counts[name] = counts.get(name, 0) + 1
        if r.status_code != expect or "error" not in r.json():
            wrong.append(f"{name}: HTTP {r.status_code} (expected {expect}): {r.text[:200]}")
            return
        await asyncio.sleep(0.05)


async def dropper(client: httpx.AsyncClient, stop_at: float, counts: dict[str, int]) -> None:
    """Streams of long answers, left after their first event."""
    body = {"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    while time.monotonic() < stop_at:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break
        counts["dropped streams"] = counts.get("dropped streams", 0) + 1
        await asyncio.sleep(0.2)


async def phase(url: str, seconds: float, abuse: bool) -> tuple[list[float], list[str], list[str],
                                                                 dict[str, int]]:
    ttfts: list[float] = []
    failures: list[str] = []
    wrong: list[str] = []
    counts: dict[str, int] = {}
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks = [ordinary(client, stop_at, ttfts, failures, 100 * k)
                 for k in range(ORDINARY_CLIENTS)]
        if abuse:
            tasks += [abuser(client, *a, stop_at, wrong, counts) for a in _abuses()]
            tasks.append(dropper(client, stop_at, counts))
        await asyncio.gather(*tasks)
    return ttfts, failures, wrong, counts


def test_ordinary_traffic_is_unharmed_by_abuse(url: str):
    quiet, quiet_failures, _, _ = asyncio.run(phase(url, PHASE_S, abuse=False))
    assert not quiet_failures, quiet_failures[:5]
    assert len(quiet) >= 10, "too few ordinary requests to measure"
    busy, failures, wrong, counts = asyncio.run(phase(url, PHASE_S, abuse=True))
    assert not failures, failures[:5]
    assert not wrong, wrong
    # Every pattern ran, many times over.
    assert set(counts) == {name for name, *_ in _abuses()} | {"dropped streams"}, counts
    assert min(counts.values()) >= 3, counts
    p99_quiet, p99_busy = np.percentile(quiet, 99), np.percentile(busy, 99)
    print(f"ordinary requests {len(quiet)} alone, {len(busy)} beside the abuse; p99 TTFT "
          f"{p99_quiet * 1000:.0f} ms alone, {p99_busy * 1000:.0f} ms beside; abuse {counts}")
    assert p99_busy <= 3 * p99_quiet, (
        f"ordinary p99 TTFT {p99_busy * 1000:.0f} ms beside the abuse, "
        f"{p99_quiet * 1000:.0f} ms alone; abusive requests: {counts}")
    wait_idle(url, timeout=60.0, poll=0.2)
