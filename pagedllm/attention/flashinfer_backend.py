"""Prefill attention through FlashInfer's paged prefill; decodes through the Triton kernels.

On an H100 FlashInfer's FA3 (Hopper) prefill reads a 32k prompt's pages at 588 TFLOP/s
where the Triton prefill kernel reaches 369 (benchmarks/prefill_attn_bench.py, one
Llama-3.1-8B layer, 8k chunks): about 0.29 s of a 32k prompt's time to first token. Decode
steps stay on the Triton kernels, which CUDA graphs capture.

FlashInfer plans a batch on the host (work split, from the sequences' lengths and pages) and
then runs it once per layer: the plan is made at the step's first layer and kept while the
same step's metadata comes back. Its pages are ours as they are (NHD: [pages, page size,
KV heads, head dim], K and V apart), so nothing is copied.

Used only where the Triton prefill would compute the same thing: causal, no ALiBi, sliding
window, soft-cap or sinks, bf16/fp16 pages (not fp8), head dims FlashInfer builds (64, 128,
256), outside CUDA-graph capture and with the host lengths at hand. Anything else takes the
Triton prefill. flashinfer-python is optional (`pip install flashinfer-python`); it builds
its kernels on first use (a minute or so, cached under ~/.cache/flashinfer). The first use
is the engine's memory-profiling step at start-up, a full-budget prefill: the kernels are
built before the first request, and the workspace (WORKSPACE_BYTES) is part of the peak the
KV pool is sized from.

A step whose prefill sequences have no cached tokens before their chunk (a prompt read in
one step, or the first chunk of a longer one) has its keys and values at hand in the step's
own rows: those go to FlashInfer's ragged prefill over the contiguous rows (dense loads,
no page gathers) instead of the paged one. PAGEDLLM_FLASHINFER_RAGGED=0 keeps every
prefill on the paged kernel (the A/B of benchmarks/gpu_run.sh long-fi).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_backend import TritonPagedAttention


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a build that cannot load on this machine
        return False
    return True


def _ragged_enabled() -> bool:
    raw = os.environ.get("PAGEDLLM_FLASHINFER_RAGGED", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"PAGEDLLM_FLASHINFER_RAGGED={raw!r}: expected 0 or 1")
    return raw == "1"


class _Plan:
    """One step's FlashInfer prefill plan: the wrapper, planned for that step's prefill
    sequences, the rows they occupy, and whether it reads the rows' own K/V (ragged)."""

    def __init__(self, wrapper, key: tuple, meta: AttentionMetadata, rows: tuple[int, int],
                 ragged: bool = False):
        self.wrapper, self.key, self.meta, self.rows, self.ragged = wrapper, key, meta, rows, ragged


class FlashInferPrefillAttention(TritonPagedAttention):
    name = "flashinfer"
    HEAD_MAJOR_PAGES = False  # its wrappers are planned for token-major (NHD) pages
    WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (its split-KV partial sums)
    HEAD_DIMS = (64, 128, 256)
    RAGGED = _ragged_enabled()
    _workspaces: dict[torch.device, torch.Tensor] = {}
    _wrappers: dict[torch.device, object] = {}
    _ragged_wrappers: dict[torch.device, object] = {}
    _paged_built: set[tuple] = set()  # plan keys the paged kernel has been built for
    _plan: _Plan | None = None

    @classmethod
    def _workspace(cls, device: torch.device) -> torch.Tensor:
        """The float workspace the paged and the ragged wrapper share: one step runs one
        of them, and each plans again before it runs."""
        w = cls._workspaces.get(device)
        if w is None:
            w = cls._workspaces[device] = torch.empty(cls.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return w

    @classmethod
    def _made(cls, wrappers: dict, kind: str, device: torch.device):
        """The device's FlashInfer wrapper of class `kind` (made on first use; backend
        "auto": FA3 on Hopper, FA2 elsewhere)."""
        w = wrappers.get(device)
        if w is None:
            import flashinfer

            w = wrappers[device] = getattr(flashinfer, kind)(cls._workspace(device), "NHD", backend="auto")
        return w

    @classmethod
    def _wrapper(cls, device: torch.device):
        return cls._made(cls._wrappers, "BatchPrefillWithPagedKVCacheWrapper", device)

    @classmethod
    def _ragged_wrapper(cls, device: torch.device):
        return cls._made(cls._ragged_wrappers, "BatchPrefillWithRaggedKVCacheWrapper", device)

    @staticmethod
    def fresh_prompts(meta: AttentionMetadata) -> bool:
        """Whether every prefill sequence of the step has no cached tokens before its chunk
        (its keys are exactly its rows this step)."""
        nd = meta.num_decode
        return bool(np.array_equal(np.asarray(meta.host_q_len[nd:]), np.asarray(meta.host_ctx_len[nd:])))

    @classmethod
    def usable(cls, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, plain: bool) -> bool:
        """Whether this launch's prefill rows can go to FlashInfer (see the module docstring)."""
        return (plain and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
                and k_cache.dtype == q.dtype and q.shape[2] in cls.HEAD_DIMS
                and meta.host_q_len is not None and meta.host_ctx_len is not None
                and meta.host_block_tables is not None
                and not torch.cuda.is_current_stream_capturing())

    @staticmethod
    def plan_arrays(meta: AttentionMetadata, page: int) -> tuple[np.ndarray, ...]:
        """FlashInfer's plan inputs for the prefill sequences of a step (those after its
        decodes): query row offsets, page offsets, the pages themselves in order, and how
        many tokens each sequence's last page holds."""
        nd = meta.num_decode
        q_len = np.asarray(meta.host_q_len[nd:], dtype=np.int64)
        ctx = np.asarray(meta.host_ctx_len[nd:], dtype=np.int64)
        pages = -(-ctx // page)
        qo_indptr = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
        kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        seq = np.repeat(np.arange(nd, nd + len(pages)), pages)
        within = np.arange(int(pages.sum())) - np.repeat(kv_indptr[:-1].astype(np.int64), pages)
        kv_indices = np.asarray(meta.host_block_tables)[seq, within].astype(np.int32)
        last_page_len = (ctx - (pages - 1) * page).astype(np.int32)
        return qo_indptr, kv_indptr, kv_indices, last_page_len

    @classmethod
    def _planned(cls, q, k_cache, meta: AttentionMetadata, scale: float) -> _Plan:
        key = (q.device, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], float(scale), q.dtype)
        plan = cls._plan
        if plan is not None and plan.meta is meta and plan.key == key:
            return plan
        qo, kv_indptr, kv_indices, last = cls.plan_arrays(meta, k_cache.shape[1])
        first = int(meta.host_q_start[meta.num_decode])
        rows = (first, first + int(qo[-1]))
        if cls.RAGGED and cls.fresh_prompts(meta):  # keys = the rows: qo offsets serve both
            wrapper = cls._ragged_wrapper(q.device)
            wrapper.plan(torch.from_numpy(qo), torch.from_numpy(qo), q.shape[1], k_cache.shape[2], q.shape[2],
                         causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=q.dtype)
            cls._plan = plan = _Plan(wrapper, key, meta, rows, ragged=True)
            if key not in cls._paged_built:
                # The start-up profiling step reads fresh prompts only: plan a one-page
                # batch on the paged wrapper too, so that its kernel is built now and not
                # in the middle of serving, at the first chunk after a cached prefix.
                one = np.array([0, 1], dtype=np.int32)
                cls._plan_paged(q, k_cache, scale, key, one, one, np.zeros(1, dtype=np.int32),
                                np.ones(1, dtype=np.int32))
            return plan
        wrapper = cls._plan_paged(q, k_cache, scale, key, qo, kv_indptr, kv_indices, last)
        cls._plan = plan = _Plan(wrapper, key, meta, rows)
        return plan

    @classmethod
    def _plan_paged(cls, q, k_cache, scale: float, key: tuple, qo, kv_indptr, kv_indices, last):
        wrapper = cls._wrapper(q.device)
        wrapper.plan(torch.from_numpy(qo), torch.from_numpy(kv_indptr),
                     torch.from_numpy(kv_indices).to(q.device, non_blocking=True), torch.from_numpy(last),
                     q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], causal=True,
                     sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        cls._paged_built.add(key)
        return wrapper

    @classmethod
    def _prefill(cls, q, k, v, k_cache, v_cache, out, meta: AttentionMetadata, scale: float, args: tuple,
                 common: dict, slopes, plain: bool) -> None:
        if not cls.usable(q, k_cache, meta, plain):
            return super()._prefill(q, k, v, k_cache, v_cache, out, meta, scale, args, common, slopes, plain)
        plan = cls._planned(q, k_cache, meta, scale)
        lo, hi = plan.rows
        # q, k and v are views of the fused qkv output (rows strided by q + k + v): FlashInfer
        # reads rows and heads through their strides, so they go as they are (copying them
        # cost 13 ms of a 32k prompt's 1.13 s on an H100); only a strided last dimension is
        # copied.
        def rows_of(t: torch.Tensor) -> torch.Tensor:
            t = t[lo:hi]
            return t if t.stride(-1) == 1 else t.contiguous()

        kv = ((rows_of(k), rows_of(v)) if plan.ragged else ((k_cache, v_cache),))
        rows = out[lo:hi]
        if rows.is_contiguous():
            plan.wrapper.run(rows_of(q), *kv, out=rows)
        else:
            rows.copy_(plan.wrapper.run(rows_of(q), *kv))
