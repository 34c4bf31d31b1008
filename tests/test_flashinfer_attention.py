"""The FlashInfer prefill backend (attention/flashinfer_backend.py).

On the CPU: the plan it gives FlashInfer (row and page offsets, the pages in order, each
last page's fill) against the batch's block tables read sequence by sequence, and its
prefill path end to end through stand-in wrappers that attend over exactly the pages the
plan names, or (ragged) exactly the K/V rows it is given (so a wrong page, row range or
reuse of a stale plan shows up as a mismatch with the torch reference backend). On a GPU with flashinfer-python installed
(marked gpu): FlashInfer itself against the torch reference, decodes and prefills mixed."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from paged_batch import paged_batch, paged_meta

from pagedllm.attention.flashinfer_backend import FlashInferPrefillAttention, flashinfer_available
from pagedllm.attention.torch_backend import TorchPagedAttention

SEQS = [(1, 9), (1, 40), (30, 30), (17, 50), (64, 64)]  # decodes first, then prefill chunks
FRESH = [(1, 9), (1, 40), (30, 30), (5, 5), (64, 64)]  # prompts with nothing cached before them


def test_plan_arrays_name_each_prefill_sequences_pages():
    page = 16
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(SEQS, 4, 2, 32, page, torch.float32)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
    meta.host_block_tables = tables
    qo, kv_indptr, kv_indices, last = FlashInferPrefillAttention.plan_arrays(meta, page)
    assert qo.tolist() == [0, 30, 47, 111]
    for j, i in enumerate(range(nd, len(SEQS))):
        n = -(-int(ctx[i]) // page)
        assert kv_indptr[j + 1] - kv_indptr[j] == n
        assert kv_indices[kv_indptr[j] : kv_indptr[j + 1]].tolist() == tables[i, :n].tolist()
        assert 1 <= last[j] <= page and (n - 1) * page + last[j] == ctx[i]


class _StandIn:
    """Plays BatchPrefillWithPagedKVCacheWrapper on the CPU: attends each planned sequence
    over the pages of its plan, causally aligned to the sequence's end."""

    def __init__(self):
        self.plans = 0

    def plan(self, qo, kv_indptr, kv_indices, last, hq, hkv, dim, page, causal, sm_scale,
             q_data_type, kv_data_type):
        assert causal and not qo.is_cuda and not kv_indptr.is_cuda  # host offsets: no sync
        self.args = (qo.numpy(), kv_indptr.numpy(), kv_indices.cpu().numpy(), last.numpy(), sm_scale)
        self.plans += 1

    def run(self, q, kv, out=None):
        qo, kv_indptr, kv_indices, last, scale = self.args
        kc, vc = kv
        res = torch.empty_like(q)
        for j in range(len(qo) - 1):
            pages = torch.as_tensor(kv_indices[kv_indptr[j] : kv_indptr[j + 1]])
            n = (len(pages) - 1) * kc.shape[1] + int(last[j])
            res[qo[j] : qo[j + 1]] = _attend(q[qo[j] : qo[j + 1]], kc[pages].flatten(0, 1)[:n],
                                             vc[pages].flatten(0, 1)[:n], scale, q.dtype)
        if out is None:
            return res
        out.copy_(res)
        return out


def _attend(rows, keys, vals, scale, dtype):
    """Causal attention of `rows` aligned to the end of `keys` (GQA heads repeated)."""
    group = rows.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
    s = torch.einsum("mhd,nhd->hmn", rows.float(), keys.float()) * scale
    m, n = rows.shape[0], keys.shape[0]
    mask = torch.arange(n)[None, :] > (n - m + torch.arange(m))[:, None]
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hmn,nhd->mhd", p, vals.float()).to(dtype)


class _RaggedStandIn:
    """Plays BatchPrefillWithRaggedKVCacheWrapper on the CPU: each planned sequence's rows
    attend causally to its own rows of the K/V given to run."""

    def __init__(self):
        self.plans = 0

    def plan(self, qo, kv_indptr, hq, hkv, dim, causal, sm_scale, q_data_type, kv_data_type):
        assert causal and not qo.is_cuda and not kv_indptr.is_cuda
        self.args = (qo.numpy(), kv_indptr.numpy(), sm_scale)
        self.plans += 1

    def run(self, q, k, v, out=None):
        qo, kv_indptr, scale = self.args
        assert k.shape[0] == v.shape[0] == kv_indptr[-1] and k.stride(-1) == v.stride(-1) == 1
        res = torch.empty_like(q)
        for j in range(len(qo) - 1):
            res[qo[j] : qo[j + 1]] = _attend(q[qo[j] : qo[j + 1]], k[kv_indptr[j] : kv_indptr[j + 1]],
                                             v[kv_indptr[j] : kv_indptr[j + 1]], scale, q.dtype)
        if out is None:
            return res
        out.copy_(res)
        return out


def _stand_ins(monkeypatch, device, ragged: bool):
    paged, rag = _StandIn(), _RaggedStandIn()
    monkeypatch.setattr(FlashInferPrefillAttention, "_plan", None)
    monkeypatch.setattr(FlashInferPrefillAttention, "_paged_built", set())
    monkeypatch.setattr(FlashInferPrefillAttention, "RAGGED", ragged)
    monkeypatch.setattr(FlashInferPrefillAttention, "usable", classmethod(lambda cls, *a: True))
    monkeypatch.setattr(FlashInferPrefillAttention, "_wrapper", classmethod(lambda cls, d: paged))
    monkeypatch.setattr(FlashInferPrefillAttention, "_ragged_wrapper", classmethod(lambda cls, d: rag))
    return paged, rag


def test_prefill_rows_attend_the_planned_pages(monkeypatch):
    """The backend's prefill path with the stand-in: the prefill rows equal the torch
    reference's, the decode rows are left to the decode kernel (untouched here), and one
    plan serves every layer of a step while a new step plans again."""
    page, hq, hkv, dim = 16, 4, 2, 32
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(SEQS, hq, hkv, dim, page, torch.float32)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
    meta.host_block_tables = tables
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = TorchPagedAttention.forward(q, k, v, kc_ref, vc_ref, meta, dim**-0.5)
    # The backend's caller wrote this step's K/V into the pages first; so does the reference.
    standin, ragged = _stand_ins(monkeypatch, q.device, ragged=True)  # SEQS have cached prefixes
    assert not FlashInferPrefillAttention.fresh_prompts(meta)
    first = int(q_start[nd])
    for _layer in range(3):  # three layers of one step
        out = torch.full_like(q, 7.0)
        FlashInferPrefillAttention._prefill(q, k, v, kc_ref, vc_ref, out, meta, dim**-0.5, (), {}, None, True)
        torch.testing.assert_close(out[first:], ref[first:], atol=1e-5, rtol=1e-5)
        assert torch.all(out[:first] == 7.0)
    assert standin.plans == 1 and ragged.plans == 0
    meta2 = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
    meta2.host_block_tables = tables
    FlashInferPrefillAttention._prefill(q, k, v, kc_ref, vc_ref, out, meta2, dim**-0.5, (), {}, None, True)
    assert standin.plans == 2


@pytest.mark.parametrize("ragged", [True, False])
def test_fresh_prompts_read_their_own_rows(monkeypatch, ragged):
    """Prefill sequences with nothing cached before their chunk go to the ragged wrapper,
    which gets the step's own K/V rows (not the pages: they are filled with noise here, so
    reading them would show), once planned per step; the paged kernel is planned once too,
    so that it is built before a chunk with a cached prefix needs it. With RAGGED off the
    same step reads the pages."""
    page, hq, hkv, dim = 16, 4, 2, 32
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(FRESH, hq, hkv, dim, page, torch.float32)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
    meta.host_block_tables = tables
    assert FlashInferPrefillAttention.fresh_prompts(meta)
    ref = TorchPagedAttention.forward(q, k, v, kc, vc, meta, dim**-0.5)  # writes k, v to the pages
    paged, rag = _stand_ins(monkeypatch, q.device, ragged)
    pages = (kc, vc) if not ragged else (torch.randn_like(kc), torch.randn_like(vc))
    first = int(q_start[nd])
    for _layer in range(2):
        out = torch.full_like(q, 7.0)
        FlashInferPrefillAttention._prefill(q, k, v, *pages, out, meta, dim**-0.5, (), {}, None, True)
        torch.testing.assert_close(out[first:], ref[first:], atol=1e-5, rtol=1e-5)
        assert torch.all(out[:first] == 7.0)
    assert (rag.plans, paged.plans) == ((1, 1) if ragged else (0, 1))
    if ragged:  # a one-page, one-token batch: only there to build the kernel
        assert paged.args[0].tolist() == [0, 1] and paged.args[3].tolist() == [1]


def test_wrappers_share_one_workspace_per_device(monkeypatch):
    """The paged and the ragged wrapper are made once per device, NHD, over one workspace
    (what the start-up profile counts once)."""
    made = []

    class Wrapper:
        def __init__(self, workspace, layout, backend):
            made.append((type(self).__name__, workspace, layout, backend))

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=type("Paged", (Wrapper,), {}),
                                 BatchPrefillWithRaggedKVCacheWrapper=type("Ragged", (Wrapper,), {}))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    for name in ("_workspaces", "_wrappers", "_ragged_wrappers"):
        monkeypatch.setattr(FlashInferPrefillAttention, name, {})
    monkeypatch.setattr(FlashInferPrefillAttention, "WORKSPACE_BYTES", 64)
    dev = torch.device("cpu")
    paged, ragged = FlashInferPrefillAttention._wrapper(dev), FlashInferPrefillAttention._ragged_wrapper(dev)
    assert FlashInferPrefillAttention._wrapper(dev) is paged
    assert FlashInferPrefillAttention._ragged_wrapper(dev) is ragged
    assert [m[0] for m in made] == ["Paged", "Ragged"]
    assert made[0][1] is made[1][1] and made[0][1].numel() == 64
    assert all(m[2:] == ("NHD", "auto") for m in made)


def test_unusable_launches_take_the_triton_prefill():
    """No host tables (a captured graph's metadata), fp8 pages, a window or soft-cap
    (plain False), float32: not FlashInfer's."""
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(SEQS, 4, 2, 32, 16, torch.float32)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
    assert not FlashInferPrefillAttention.usable(q, kc, meta, True)  # CPU, float32, no host tables
    meta.host_block_tables = tables
    assert not FlashInferPrefillAttention.usable(q, kc, meta, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not flashinfer_available(),
                    reason="needs CUDA and flashinfer-python")
@pytest.mark.parametrize("hq, hkv, dim", [(32, 8, 128), (8, 8, 64), (16, 2, 256)])
@pytest.mark.parametrize("seqs", [[(1, 1), (1, 300), (130, 130), (64, 200), (500, 1500)],  # paged
                                  [(1, 1), (1, 300), (130, 130), (1500, 1500)]],  # ragged
                         ids=["prefixes", "fresh"])
def test_flashinfer_matches_torch(hq, hkv, dim, seqs):
    dev, page = "cuda", 16
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, dim, page, torch.bfloat16)
    q, k, v, kc, vc = (x.to(dev) for x in (q, k, v, kc, vc))
    # as the model hands them over: views of one fused qkv row, strided by all three
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q, k, v = (t.view(-1, t.shape[1] // dim, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1))
    assert not q.is_contiguous() and not k.is_contiguous()
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, FlashInferPrefillAttention.tile_q(hq // hkv), dev)
    meta.host_block_tables = tables
    kc2, vc2 = kc.clone(), vc.clone()
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, dim**-0.5)
    FlashInferPrefillAttention._plan = None
    out = FlashInferPrefillAttention.forward(q, k, v, kc2, vc2, meta, dim**-0.5)
    plan = FlashInferPrefillAttention._plan
    assert plan is not None and plan.meta is meta
    assert plan.ragged == (FlashInferPrefillAttention.RAGGED and all(a == b for a, b in seqs[2:]))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert np.isfinite(out.float().cpu().numpy()).all()
