"""The real server (SmolLM2-135M-Instruct on CPU, a subprocess on 127.0.0.1) under load, and
its graceful shutdown on SIGTERM.

Load: a few hundred clients at once, streaming and not, over both endpoints. Every request
either completes correctly or gets an explicit error; no request's tokens reach another
(each forced-token request sees only its own token; greedy requests equal the same prompt
run alone); afterwards every block is back in the pool and the memory near its baseline.
The last test sends SIGTERM to the same server: the drain lets a running stream finish,
refuses new requests, ends what outlives --shutdown-timeout, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_process import descendants, launch_server
from server_process import wait_idle as wait_until_idle

API_KEY = "load-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"
DRAIN_S = 8.0
NUM_CLIENTS = 300  # more than --max-num-seqs (256): some wait in the scheduler's queue
MAX_TOKENS = 6


@dataclass
class Server:
    url: str
    log: Path
    proc: subprocess.Popen

    def rss_bytes(self) -> tuple[int, int]:
        """(resident bytes outside the KV pool, resident bytes of the KV pool), over the
        server and its engine core process. On CPU the pool is one shared anonymous mapping
        ('/dev/zero (deleted)', 2 GiB by default) whose pages become resident as blocks are
        first used: the pool filling, not memory lost."""
        mappings: list[list] = []  # [name, size, rss]
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with open(f"/proc/{pid}/smaps") as f:
                for line in f:
                    head = line.split()
                    if not head[0].endswith(":"):  # a new mapping: address range, ..., path
                        mappings.append([" ".join(head[5:]), 0, 0])
                    elif head[0] in ("Size:", "Rss:"):
                        mappings[-1][1 if head[0] == "Size:" else 2] = int(head[1]) * 1024
        kv = max((m for m in mappings if m[0] == "/dev/zero (deleted)"), key=lambda m: m[1])
        return sum(m[2] for m in mappings) - kv[2], kv[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    flags = ["--max-model-len", "512", "--served-model-name", MODEL,
             "--shutdown-timeout", str(DRAIN_S)]
    with launch_server(tmp_path_factory.mktemp("reliability"), flags, api_key=API_KEY,
                       graceful_stop=False) as sp:
        yield Server(sp.url, sp.log, sp.proc)


def wait_idle(server: Server, timeout: float = 30.0) -> dict:
    return wait_until_idle(server.url, AUTH, timeout)


def metric(server: Server, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    want = {"model_name": MODEL, **labels}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == want:
                return s.value
    return 0.0


# ---------------------------------------------------------------------- the load
PROMPTS = [f"{subject} is" for subject in (
    "The sky", "Water", "A cat", "Paris", "The sun", "Music", "A tree", "Coffee", "The moon",
    "Winter", "A river", "Bread", "The ocean", "A library", "Fire", "A violin", "Snow",
    "The desert", "A bridge", "Honey")]
NUM_FORCED = NUM_CLIENTS // 2


@dataclass
class Outcome:
    kind: str
    key: object
    status: int
    text: str = ""
    finish: str | None = None
    error: dict | None = None


def completion_body(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def chat_body(prompt: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


async def call(c: httpx.AsyncClient, kind: str, key, path: str, body: dict) -> Outcome:
    """One request, streamed or not, reduced to its text and finish reason (or its error)."""
    if not body.get("stream"):
        r = await c.post(path, json=body)
        if r.status_code != 200:
            return Outcome(kind, key, r.status_code, error=r.json().get("error"))
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return Outcome(kind, key, 200, text, choice["finish_reason"])
    text, finish = "", None
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(kind, key, r.status_code, error=r.json().get("error"))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Outcome(kind, key, 200, text, finish, event["error"])
            for ch in event["choices"]:
                text += (ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
                finish = ch["finish_reason"] or finish
    return Outcome(kind, key, 200, text, finish)


async def leave_mid_stream(c: httpx.AsyncClient, i: int) -> Outcome:
    body = completion_body(f"Write a long story about number {i}.", max_tokens=400,
                           ignore_eos=True, stream=True)
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # and hang up
    return Outcome("leaver", i, r.status_code)


def test_hundreds_of_clients_nothing_lost_or_mixed(server: Server):
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 50, max_keepalive_connections=NUM_CLIENTS)

    async def alone() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120,
                                     limits=limits) as c:
            greedy, chat = {}, {}
            for p in PROMPTS:  # alone, with the margin of every greedy choice
                r = (await c.post("/v1/completions", json=completion_body(p, logprobs=2))).json()
                tops = [sorted(t.values(), reverse=True) for t in
                        r["choices"][0]["logprobs"]["top_logprobs"]]
                if min(t[0] - t[1] for t in tops) > 0.01:  # no near-tie a batch could flip
                    greedy[p] = r["choices"][0]["text"]
            for p in PROMPTS[:8]:
                r = (await c.post("/v1/chat/completions",
                                  json=chat_body(p, logprobs=True, top_logprobs=2))).json()
                tops = [[x["logprob"] for x in t["top_logprobs"]] for t in
                        r["choices"][0]["logprobs"]["content"]]
                if min(t[0] - t[1] for t in tops) > 0.01:
                    chat[p] = r["choices"][0]["message"]["content"]
            forced = {}  # token id -> its text, repeated: one token per client
            for t in range(2000, 40000, 37):
                text = (await c.post("/detokenize", json={"tokens": [t] * MAX_TOKENS})).json()
                if text["prompt"].strip() and "\ufffd" not in text["prompt"]:  # whole characters
                    forced[t] = text["prompt"]
                if len(forced) == NUM_FORCED:
                    break
            # A burst of the load's shape but smaller settles the allocator before the baseline.
            await asyncio.gather(*(call(c, "w", i, "/v1/completions",
                                        completion_body(f"Warm-up {i}", stream=i % 2 == 0))
                                   for i in range(64)))
            return greedy, chat, forced

    greedy_alone, chat_alone, forced_text = asyncio.run(alone())
    assert len(set(forced_text.values())) == NUM_FORCED
    assert len(greedy_alone) >= 10 and len(chat_alone) >= 3, (greedy_alone, chat_alone)
    greedy_prompts, chat_prompts = list(greedy_alone), list(chat_alone)
    before = wait_idle(server)
    rss = [server.rss_bytes()]

    async def load() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=180,
                                     limits=limits) as c:
            jobs = []
            for i, t in enumerate(forced_text):  # sampled (temperature 1), but only t can come
                body = completion_body(f"Client {i} says", temperature=1.0, ignore_eos=True,
                                       logit_bias={str(t): 100}, stream=i % 2 == 0)
                jobs.append(call(c, "forced", t, "/v1/completions", body))
            for i in range(NUM_CLIENTS - NUM_FORCED - 30):
                p = greedy_prompts[i % len(greedy_prompts)]
                jobs.append(call(c, "greedy", p, "/v1/completions",
                                 completion_body(p, stream=i % 2 == 1)))
            for i in range(10):
                p = chat_prompts[i % len(chat_prompts)]
                jobs.append(call(c, "chat", p, "/v1/chat/completions",
                                 chat_body(p, stream=i % 2 == 0)))
            for i in range(10):
                jobs.append(call(c, "invalid", i, "/v1/completions",
                                 completion_body("x", temperature=-1, stream=i % 2 == 0)))
            jobs += [leave_mid_stream(c, i) for i in range(10)]
            return await asyncio.gather(*jobs)

    for run in range(4):  # four times: what the first run left behind must not grow
        done_before = {r: metric(server, "pagedllm:request_success_total", finished_reason=r)
                       for r in ("stop", "length", "abort")}
        t0 = time.monotonic()
        outcomes = asyncio.run(load())
        elapsed = time.monotonic() - t0
        assert len(outcomes) == NUM_CLIENTS
        by_kind: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_kind.setdefault(o.kind, []).append(o)
        for o in by_kind["forced"]:  # only its own token, every time
            assert (o.status, o.error) == (200, None), o
            assert o.text == forced_text[o.key] and o.finish == "length", o
        for o in by_kind["greedy"]:
            assert (o.status, o.error) == (200, None), o
            assert o.text == greedy_alone[o.key], o
        for o in by_kind["chat"]:
            assert (o.status, o.error) == (200, None), o
            assert o.text == chat_alone[o.key], o
        for o in by_kind["invalid"]:
            assert o.status == 400 and o.error["param"] == "temperature", o
        assert all(o.status == 200 for o in by_kind["leaver"])

        after = wait_idle(server)
        assert after["num_free_blocks"] == before["num_free_blocks"] == after["num_blocks"]
        assert metric(server, "pagedllm:kv_cache_usage_perc") == 0
        assert metric(server, "pagedllm:num_requests_running") == 0
        assert metric(server, "pagedllm:num_requests_waiting") == 0
        done = {r: metric(server, "pagedllm:request_success_total", finished_reason=r)
                - done_before[r] for r in done_before}
        assert done["abort"] == 10  # the clients that hung up
        assert done["stop"] + done["length"] == NUM_CLIENTS - 20  # all the others, once each
        rss.append(server.rss_bytes())
        print(f"\nrun {run}: {NUM_CLIENTS} clients in {elapsed:.1f} s; resident MiB outside "
              f"the KV pool {rss[-2][0] >> 20} -> {rss[-1][0] >> 20}, KV pool pages "
              f"{rss[-2][1] >> 20} -> {rss[-1][1] >> 20}")
    # Near the baseline (allocators keep some of a burst's peak), and no growth per run. One
    # run's resident size moves by tens of MiB with the allocator's fragmentation alone (0 to
    # 100 MiB seen on identical code, in one run and not the next; CI once saw 13, 57 and
    # 100 MiB over three runs of a tree whose previous CI run passed), while a leak grows
    # every run: so the smallest growth of the three runs after the first must stay small.
    (base, _), (first, _) = rss[:2]
    assert first - base < max(256 * 2**20, base // 4), rss
    growth = sorted(rss[i + 1][0] - rss[i][0] for i in range(1, len(rss) - 1))
    assert len(growth) == 3 and growth[0] < 48 * 2**20, (growth, rss)
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---------------------------------------------------------------------- SIGTERM (runs last)
def test_sigterm_drains_then_exits_zero(server: Server):
    """A stream that ends within the drain time completes; one that would not is ended with
    an error at the deadline; new requests are refused meanwhile; the exit code is 0."""
    wait_idle(server)
    short = completion_body("Count to ten:", max_tokens=12, ignore_eos=True, stream=True)
    long = completion_body("Tell me everything.", max_tokens=480, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as a, \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as b, \
            a.stream("POST", "/v1/completions", json=short) as rs, \
            b.stream("POST", "/v1/completions", json=long) as rl:
        short_lines, long_lines = rs.iter_lines(), rl.iter_lines()
        assert next(short_lines).startswith("data: ") and next(long_lines).startswith("data: ")
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # New requests are refused (503 while the port is still open), and so is readiness;
        # liveness stays 200: the server is alive, finishing its requests.
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as c:
            r = c.post("/v1/completions", json=completion_body("Hi"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert r.headers["retry-after"] and r.headers["connection"] == "close"
            assert c.get("/ready").status_code == 503
            assert c.get("/health").status_code == 200
        events = [line[6:] for line in short_lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" not in events[-2]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        events = [line[6:] for line in long_lines if line.startswith("data: ")]
        ended = time.monotonic() - t0
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert DRAIN_S - 0.5 <= ended <= DRAIN_S + 5
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 <= DRAIN_S + 10
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
    log = server.log.read_text()
    assert "draining" in log and "Traceback" not in log
