"""Which fine-tune a request runs with: a PEFT LoRA adapter on disk, as vLLM names it.

Plain data (a msgspec struct) so it travels unchanged from the front end to the engine
core (over the server's channel) and on to the workers, where the adapter is loaded.
`lora_int_id` identifies the adapter everywhere below the front end: its GPU slot, its
CPU copy and the prefix-cache keys of its KV pages; two requests with the same id run the
same adapter. Id 0 is reserved for the base model.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), "
                             f"got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
