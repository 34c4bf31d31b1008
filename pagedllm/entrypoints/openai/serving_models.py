"""The LoRA adapters a server offers as models of their own, beside the base model.

A request picks an adapter by its `model` field; /v1/models lists each adapter with its
base model as `parent`. Adapters come from `--lora-modules` at start and, with
`--allow-runtime-lora-updating`, from POST /v1/load_lora_adapter (and leave by
/v1/unload_lora_adapter). Each name gets a fresh integer id, never reused, so that the
engine's slots, CPU copies and prefix-cache pages of an unloaded adapter are never taken
for those of a later one of the same name.
"""

from __future__ import annotations

import itertools
import threading

from pagedllm.lora_request import LoRARequest


class ServedAdapters:
    def __init__(self, check) -> None:
        """`check(LoRARequest)` raises ValueError for an adapter the engine cannot run."""
        self._check = check
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def load(self, name: str, path: str, reserved: set[str]) -> LoRARequest:
        """Check and add an adapter; ValueError for a taken name or a bad adapter."""
        if not name or not path:
            raise ValueError("lora_name and lora_path are both required")
        with self._lock:
            if name in self._by_name or name in reserved:
                raise ValueError(f"the name {name!r} is already served")
            lora = LoRARequest(name, next(self._ids), path)
            self._check(lora)
            self._by_name[name] = lora
        return lora

    def unload(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)
