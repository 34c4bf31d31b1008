"""Multi-LoRA: PEFT adapter folders (peft.py), the LoRA weight method and its per-token
slot index (layers.py), and the batched CUDA kernels (triton_ops.py)."""
