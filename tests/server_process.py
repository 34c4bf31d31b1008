"""Start the real server as `python -m pagedllm.entrypoints.openai.api_server` on a free
loopback port, wait for /health, and stop it afterwards: shared by the server test files."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass
class ServerProcess:
    url: str
    log: Path
    proc: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(log_dir: Path, flags: list[str], api_key: str | None = None,
                  graceful_stop: bool = True, https_ca: str | None = None,
                  cmd: list[str] | None = None) -> Iterator[ServerProcess]:
    """`graceful_stop=False` kills at the end instead of draining (for servers given a long
    --shutdown-timeout). `https_ca`: the server serves HTTPS (its flags name the key and
    certificate) and this certificate file verifies it. `cmd`: the command to run instead
    of the module's, given `--port PORT` appended (the README's own command)."""
    port = free_port()
    log = log_dir / "server.log"
    if cmd is None:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server",
               "--host", "127.0.0.1", "--log-level", "warning", *flags]
    cmd = [*cmd, "--port", str(port)]
    env = dict(os.environ)
    env["PAGEDLLM_GC_FREEZE"] = "1"  # a server freezes its startup heap (conftest turns it off here)
    if api_key is not None:
        env["PAGEDLLM_API_KEY"] = api_key
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"{'https' if https_ca else 'http'}://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=https_ca) if https_ca else True
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield ServerProcess(url, log, proc)
    finally:
        if proc.poll() is None:
            proc.terminate() if graceful_stop else proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def descendants(pid: int, depth: int | None = None) -> list[int]:
    """Every live process below `pid` (the server's engine core, and its workers), or
    those at most `depth` levels below."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().split(")")[-1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                pass
    found, frontier = [], [pid]
    while frontier and depth != 0:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
        depth = None if depth is None else depth - 1
    return found


def wait_idle(url: str, headers: dict | None = None, timeout: float = 30.0,
              poll: float = 0.1) -> dict:
    """Until the server's engine runs and queues nothing and every KV block is back in the
    pool; its last stats. Fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(f"{url}/v1/engine/stats", headers=headers, timeout=30).json()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
            return s
        assert time.monotonic() < deadline, f"the engine did not go idle: {s}"
        time.sleep(poll)
