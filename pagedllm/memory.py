"""KV-cache sizing rules, shared by the engine and `pagedllm plan` so both give one answer.
What one token costs is the model's to say (attention/page_spec.py); these only count blocks."""

from __future__ import annotations

from pagedllm.config import DEFAULT_KV_CACHE_MEMORY


def blocks_for_bytes(budget: int, bytes_per_block: int) -> int:
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise RuntimeError(
            "no memory left for the KV cache: raise the memory for it or lower the token budget"
        )
    return int(blocks)


def cpu_num_blocks(kv_cache_memory_bytes: int | None, bytes_per_block: int, max_num_seqs: int,
                   max_model_len: int, block_size: int) -> int:
    """CPU pool: the memory the user gave; when unset, at most DEFAULT_KV_CACHE_MEMORY and
    never more than every sequence at full length needs."""
    if kv_cache_memory_bytes is not None:
        return blocks_for_bytes(kv_cache_memory_bytes, bytes_per_block)
    per_seq = -(-max_model_len // block_size)
    return max(1, min(DEFAULT_KV_CACHE_MEMORY // bytes_per_block, max_num_seqs * per_seq))


def gpu_num_blocks(total_bytes: int, utilization: float, peak_bytes: int, bytes_per_block: int) -> int:
    """GPU pool: what is left of `utilization` of the device after the profiled peak."""
    return blocks_for_bytes(int(total_bytes * utilization - peak_bytes), bytes_per_block)


def full_length_sequences(pool_tokens: int, max_model_len: int) -> str:
    """How many sequences of max_model_len tokens the KV pool holds, in words: the figure
    a long-context deployment is sized by (`pagedllm plan`, the server's start-up banner,
    the engine's start-up log). Below one, the longest requests are refused."""
    n = pool_tokens / max_model_len
    count = f"{n:.2f}".rstrip("0").rstrip(".") if n >= 0.01 else f"{n:.2g}"
    noun = "sequence" if count == "1" else "sequences"
    text = f"the KV pool holds {count} {noun} of {max_model_len} tokens (max_model_len)"
    if n < 1:
        text += f"; a request needing more than its {pool_tokens} tokens is refused"
    return text
