"""The README's Quickstart runs as written: its blocks marked `<!-- test: server -->` (the
command that starts the server) and `<!-- test: run -->` (what a user runs against it) are
read from README.md here, so the documentation cannot drift from what works. One server,
the default model on CPU, on a free port in place of the README's 8000."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import launch_server

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- test: (\w+) -->\n```(\w+)\n(.*?)```", re.S)


def quickstart_blocks() -> list[tuple[str, str, str]]:
    """(mark, language, code) of each marked block of the Quickstart section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return BLOCK.findall(section)


def test_the_quickstart_marks_a_server_and_examples():
    marks = [(mark, lang) for mark, lang, _ in quickstart_blocks()]
    assert marks.count(("server", "bash")) == 1
    assert ("run", "bash") in marks and ("run", "python") in marks


def _command(code: str) -> str:
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return " ".join(ln.rstrip("\\").strip() for ln in lines)


def test_quickstart_runs_as_written(tmp_path, monkeypatch):
    blocks = quickstart_blocks()
    env_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    monkeypatch.setenv("PATH", env_path)  # `pagedllm` and `python` of this environment
    server_cmd = shlex.split(_command(next(c for m, _, c in blocks if m == "server")))
    assert server_cmd[0] == "pagedllm", server_cmd
    with launch_server(tmp_path, [], cmd=server_cmd) as sp:
        for mark, lang, code in blocks:
            if mark != "run":
                continue
            code = code.replace("http://localhost:8000", sp.url)
            if lang == "python":
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    exec(compile(code, "README.md", "exec"), {})
                assert out.getvalue().strip(), code
                continue
            if code.lstrip().startswith("curl") and shutil.which("curl") is None:
                pytest.skip("no curl command")
            proc = subprocess.run(["bash", "-c", code], capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, f"{code}\n{proc.stderr[-2000:]}"
            if code.lstrip().startswith("curl"):
                answer = json.loads(proc.stdout)
                assert answer["choices"][0]["message"]["content"].strip(), proc.stdout
                assert answer["choices"][0]["finish_reason"] in ("stop", "length")
            else:
                assert proc.stdout.strip(), f"{code}\nprinted nothing"
