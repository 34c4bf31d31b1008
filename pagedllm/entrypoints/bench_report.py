"""What every benchmark result carries so that a figure means something later: the machine,
the software, the commit, the date and the arguments (as the project's benchmark notes ask)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess

import torch


def _git(*cmd: str) -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> dict:
    """The checkout's commit and whether tracked files differ from it (None outside git)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "short": commit[:7], "dirty": bool(status)}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    import transformers

    from pagedllm import __version__

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": device_name(device),
        "device_count": torch.cuda.device_count() if device.type == "cuda" else 1,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pagedllm": __version__,
        "python": platform.python_version(),
        "git": git_commit(),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def args_dict(args: argparse.Namespace) -> dict:
    """The parsed arguments as JSON (callables such as the dispatch hook left out)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
