"""The adapters a worker holds: `max_loras` device slots, LRU over a CPU cache.

At start the model's LoRA-capable projections (q/k/v, o, gate/up, down; fused or not)
get a `LoRAMethod` around their weight method and a shared `LoRABatch`. Each step the
runner asks for the slots of the step's adapters (`slots_for`): an adapter already in a
slot stays; one that is not is taken from the CPU cache (or read from disk into it,
keeping at most `max_cpu_loras` there) and copied into a free slot, or into the least
recently used slot no request of this step needs. The scheduler never puts more than
`max_loras` adapters in one step, so a slot is always found.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.lora_request import LoRARequest
from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.lora.layers import LoRABatch, LoRAMethod
from pagedllm.model_executor.lora.peft import LORA_TARGETS, load_adapter

logger = logging.getLogger(__name__)

# Our fused layers (q/k/v, gate/up), adapted like the projections they hold.
_FUSED = ("qkv_proj", "gate_up_proj")


def lora_layers(model: torch.nn.Module):
    """(name, layer) of every linear layer adapters may target: the q/k/v/o and gate/up/down
    projections, fused or not."""
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(module, LinearBase) and (short in LORA_TARGETS or short in _FUSED):
            yield name, module


def lora_slot_bytes(model: torch.nn.Module, max_loras: int, max_rank: int, elem_bytes: int) -> int:
    """Device memory of the adapter slots (each target layer holds A [slots, shards x rank,
    in] and B [slots, out, shards x rank], as lora/layers.py allocates them): what
    `pagedllm plan` sets aside. Works on a meta-device model."""
    per_slot = sum(len(layer.layout.shards) * max_rank * (layer.layout.in_features + layer.layout.out_features)
                   for _, layer in lora_layers(model))
    return max_loras * per_slot * elem_bytes


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_tokens: int):
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu = max(config.max_cpu_loras or 0, self.max_loras)
        self.batch = LoRABatch(self.max_loras, max_tokens, device)
        self.model = model
        self.layers: dict[str, LinearBase] = {}
        for name, module in lora_layers(model):
            module.method = LoRAMethod(module.method, module, self.batch, self.max_rank, dtype, device)
            self.layers[name] = module
        if not self.layers:
            raise ValueError("this model has no layers LoRA can adapt")
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.cpu: OrderedDict[int, dict] = OrderedDict()  # adapter id -> layer -> (A, B)
        self.num_loads = 0  # adapters copied into a slot (a test and metric of swapping)

    def targets(self) -> list[str]:
        """The projections, in HF naming, that an adapter may target in this model (the
        front end refuses an adapter with any other)."""
        stacked = getattr(self.model, "stacked_params", {})  # ".q_proj." -> (".qkv_proj.", "q")
        hf_of = {(fused.strip("."), shard): frag.strip(".") for frag, (fused, shard) in stacked.items()}
        names = []
        for name, layer in self.layers.items():
            parent, short = name.rsplit(".", 1)
            for shard in layer.layout.parts:
                if shard is None:
                    names.append(name)
                elif (short, shard) in hf_of:
                    names.append(f"{parent}.{hf_of[short, shard]}")
        return names

    def _target(self, hf_module: str) -> tuple[str, str | None]:
        """(our layer, fused shard) of an adapted projection in HF naming."""
        for frag, (fused, shard) in getattr(self.model, "stacked_params", {}).items():
            name = hf_module + "."
            if frag in name:
                return name.replace(frag, fused)[:-1], shard
        return hf_module, None

    def _read(self, lora: LoRARequest) -> dict:
        """An adapter as the slots hold it: layer -> (A, B) on the CPU."""
        info, tensors = load_adapter(lora.lora_path, self.max_rank)
        by_layer: dict[str, dict] = {}
        for hf_name, (a, b) in tensors.items():
            layer, shard = self._target(hf_name)
            if layer not in self.layers:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: this model has no LoRA "
                                 f"layer for target module {hf_name}")
            lay = self.layers[layer].layout
            if shard not in lay.parts or a.shape[1] != lay.full_in or b.shape[0] != lay.parts[shard][0]:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: {hf_name} (A {tuple(a.shape)}, "
                                 f"B {tuple(b.shape)}) does not fit this model's {layer}")
            by_layer.setdefault(layer, {})[shard] = (a, b, info.modules[hf_name].scale)
        pin = self.batch.device.type == "cuda"
        return {name: self.layers[name].method.slot_tensors(self.layers[name], pieces, pin)
                for name, pieces in by_layer.items()}

    def _cpu_copy(self, lora: LoRARequest) -> dict:
        pieces = self.cpu.get(lora.lora_int_id)
        if pieces is None:
            pieces = self._read(lora)
            self.cpu[lora.lora_int_id] = pieces
            while len(self.cpu) > self.max_cpu:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(lora.lora_int_id)
        return pieces

    def prefetch(self, lora: LoRARequest) -> None:
        """Read an adapter into the CPU cache ahead of its first step; ValueError if it
        cannot be served (its folder changed since the front end checked it, or its
        tensors have the shapes of another model)."""
        if lora.lora_int_id not in self.slots:
            self._cpu_copy(lora)

    def slots_for(self, loras: list[LoRARequest | None]) -> list[int]:
        """Each entry's slot (-1: the base model), loading adapters as needed."""
        needed = {x.lora_int_id: x for x in loras if x is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step holds {len(needed)} adapters but there are {self.max_loras} slots")
        for lid, lora in needed.items():
            if lid in self.slots:
                continue
            pieces = self._cpu_copy(lora)
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter that this step does not need
                victim = next(v for v in self.slots if v not in needed)
                slot = self.slots.pop(victim)
            for name, layer in self.layers.items():
                layer.method.set_slot(layer, slot, pieces.get(name))
            self.slots[lid] = slot
            self.num_loads += 1
            logger.debug("LoRA adapter %r (id %d) -> slot %d", lora.lora_name, lid, slot)
        for lid in needed:
            self.slots.move_to_end(lid)
        return [-1 if x is None else self.slots[x.lora_int_id] for x in loras]

    def prepare(self, token_slots: np.ndarray, num_rows: int) -> None:
        """Each row's slot for the next step (`num_rows` >= len: padding rows use none)."""
        self.batch.set(token_slots, num_rows)
