"""Triton paged-attention kernels against the torch reference backend, on random inputs:
decodes, prefills with and without a cached prefix, GQA group sizes, head sizes, and
padding rows (slot -1) as CUDA-graph batches have them.

Runs on CUDA; with TRITON_INTERPRET=1 and Triton installed it also runs on the CPU."""

from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch, paged_meta
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.attention.triton_backend import TritonPagedAttention

CASES = [
    # (hq, hkv, dim, page, seqs)
    (8, 8, 64, 16, [(1, 1), (1, 17), (1, 300)]),
    (8, 2, 64, 16, [(1, 5), (1, 64), (40, 40), (7, 100)]),
    (9, 3, 64, 16, [(1, 33), (20, 20), (5, 70)]),  # SmolLM2's group of 3
    (16, 8, 128, 16, [(130, 130), (64, 200), (1, 129)][::-1]),
    (4, 1, 32, 8, [(3, 3), (17, 50)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_torch(case, dtype):
    hq, hkv, dim, page, seqs = case
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, dim, page, dtype)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    kc2, vc2 = kc.clone(), vc.clone()
    scale = dim**-0.5
    tile_q = TritonPagedAttention.tile_q(hq // hkv)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, tile_q, DEV)
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, scale)
    out = TritonPagedAttention.forward(q, k, v, kc2, vc2, meta, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # The cache write landed where the reference put it.
    kc_ref = kc.clone()
    TorchPagedAttention.write_kv(k, v, kc_ref, vc.clone(), torch.as_tensor(slots, device=DEV))
    torch.testing.assert_close(kc2, kc_ref)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("fp8", [False, True], ids=["pages", "fp8-pages"])
def test_decode_rows_kernel_matches_torch(monkeypatch, fp8, window):
    """DECODE_ROWS "rows": decodes with one query per KV head run in _decode_rows_kernel
    (float32 sums on the CUDA cores), prefill rows of the same launch in the general
    kernel; both as the torch reference computes them, over plain and fp8 pages."""
    monkeypatch.setattr(TritonPagedAttention, "DECODE_ROWS", "rows")
    monkeypatch.setattr(TritonPagedAttention, "DECODE_ROWS_LAUNCH", {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2})
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    seqs = [(1, 1), (1, 17), (1, 300), (1, 64), (9, 40)]
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, 4, 4, 64, 16, dtype, seed=7)
    q, k, v = (x.to(DEV) for x in (q, k, v))
    kc, vc = kc.to(DEV), vc.to(DEV)
    kw = {}
    if fp8:
        fp8_t = torch.float8_e4m3fn
        k = k.float().to(fp8_t).float().to(dtype)  # values e4m3 holds exactly (see above)
        v = v.float().to(fp8_t).float().to(dtype)
        kc, vc = (kc * 0.7).to(fp8_t), (vc * 0.7).to(fp8_t)
        kw = {"k_scale": 0.5, "v_scale": 2.0}
        k, v = k * 0.5, v * 2.0
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(1), DEV)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), ref_k if fp8 else ref_k.float(),
                                      ref_v if fp8 else ref_v.float(), meta, 0.125, sliding_window=window, **kw)
    out = TritonPagedAttention.forward(q, k, v, kc, vc, meta, 0.125, sliding_window=window, **kw)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_padding_rows_write_nothing():
    kc = torch.zeros(4, 8, 2, 32, device=DEV)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 2, 32, device=DEV)
    slots = torch.tensor([5, -1, 9], device=DEV, dtype=torch.int32)
    TritonPagedAttention.write_kv(k, k, kc, vc, slots)
    flat = kc.view(-1, 2, 32)
    assert flat[5].eq(1).all() and flat[9].eq(1).all()
    assert flat.sum() == 2 * 64


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 2.0)])
def test_triton_over_fp8_pages_matches_torch(k_scale, v_scale, invariant):
    """fp8 (e4m3) pages: the write kernel stores x / scale saturated, the attention kernel
    reads them back, both as the torch reference does."""
    from pagedllm.attention.triton_backend import TritonInvariantAttention

    backend = TritonInvariantAttention if invariant else TritonPagedAttention
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    seqs = [(1, 5), (1, 64), (40, 40), (7, 100)]
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, 8, 2, 64, 16, dtype, seed=4)
    fp8 = torch.float8_e4m3fn
    # New keys and values that e4m3 holds exactly (times a power-of-two scale): Triton's
    # interpreter converts to e4m3 without rounding to nearest, the GPU rounds as torch does.
    k = (k.float() / k_scale).to(fp8).float().mul(k_scale).to(dtype)
    v = (v.float() / v_scale).to(fp8).float().mul(v_scale).to(dtype)
    q, k, v = (x.to(DEV) for x in (q, k, v))
    kc8, vc8 = (kc * 0.7).to(fp8).to(DEV), (vc * 0.7).to(fp8).to(DEV)  # cached pages
    tile_q = backend.tile_q(4)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, tile_q, DEV)
    ref_k, ref_v = kc8.clone(), vc8.clone()
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), ref_k, ref_v, meta, 0.125,
                                      k_scale=k_scale, v_scale=v_scale)
    out = backend.forward(q, k, v, kc8, vc8, meta, 0.125, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(kc8.view(torch.uint8), ref_k.view(torch.uint8))  # same bytes written
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(DEV != "cuda", reason="the interpreter's e4m3 conversion does not round to nearest")
def test_fp8_write_rounds_as_torch():
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(64, 2, 64, generator=g) * 3).to(DEV, torch.bfloat16)
    v = (torch.randn(64, 2, 64, generator=g) * 500).to(DEV, torch.bfloat16)  # some saturate
    slots = torch.randperm(64 * 4, generator=g)[:64].to(DEV)
    caches = [torch.zeros(16, 16, 2, 64, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(4)]
    TritonPagedAttention.write_kv(k, v, caches[0], caches[1], slots, 0.5, 2.0)
    TorchPagedAttention.write_kv(k, v, caches[2], caches[3], slots.long(), 0.5, 2.0)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [
    [(1, 65536), (2048, 65536)],  # a decode and the last chunk of a 64k prompt
    [(1, 1), (3000, 33001)],  # a chunk not aligned to pages after a long cached prefix
    [(4097, 4097), (1, 70), (17, 40000)][::-1],
], ids=["64k", "33k-unaligned", "mixed"])
def test_triton_matches_torch_at_long_lengths(seqs):
    """Lengths 1..65,536 with chunks ending anywhere in a page, in bf16 against the float32
    reference (GQA 4, head 128, pages of 16)."""
    if DEV != "cuda":
        pytest.skip("long sequences need the GPU")
    hq, hkv, dim, page = 16, 4, 128, 16
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, dim, page,
                                                                       torch.bfloat16)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    scale = dim**-0.5
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(hq // hkv), DEV)
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, scale)
    out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "sliding-window"])
def test_triton_sinks_match_torch(window, invariant):
    """Attention sinks (gpt-oss): one logit per head in each softmax's denominator, with and
    without a sliding window, for decodes and prefills with a cached prefix; and the sinks
    change the result (the same call without them does not pass)."""
    from pagedllm.attention.triton_backend import TritonInvariantAttention

    backend = TritonInvariantAttention if invariant else TritonPagedAttention
    seqs = [(1, 5), (1, 64), (40, 40), (7, 100)]
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, 8, 2, 64, 16, torch.float32, seed=6)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    sinks = (torch.randn(8, generator=torch.Generator().manual_seed(1)) * 3).to(DEV)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, backend.tile_q(4), DEV)
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125,
                                      sliding_window=window, sinks=sinks)
    out = backend.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    plain = backend.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125, sliding_window=window)
    assert not torch.allclose(plain, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("feature", ["plain", "alibi", "softcap", "sinks", "fp8-pages", "mixed-step"])
def test_split_decodes_match_torch(monkeypatch, feature):
    """Flash-decoding: decodes whose keys are split over programs (16 splits here, forced by
    making the launch look small), from 1 key to many key blocks, some splits left idle;
    the combined outputs equal the torch reference with ALiBi, soft-capping, sinks, over
    fp8 pages, and beside prefill rows in the same step. And the split launch really ran:
    the same decodes unsplit give the same result."""
    from pagedllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "MAX_KV_SPLITS", 16)
    monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", 64)
    assert triton_backend.kv_splits(4, 2, torch.device(DEV)) == 16
    # 256 keys fill split 0 alone (SPLIT_MIN_KEYS: it writes the output, no combine), 257
    # spill one key into split 1, 1100 use five splits of 256 and leave eleven idle
    seqs = [(1, 1), (1, 70), (1, 256), (1, 257), (1, 300), (1, 1100)]
    if feature == "mixed-step":
        seqs += [(40, 40), (7, 500)]
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, 8, 2, 64, 16, torch.float32, seed=11)
    kw, ref_kw = {}, {}
    if feature == "alibi":
        kw["alibi_slopes"] = torch.tensor([2 ** -(i + 1) for i in range(8)], device=DEV)
    elif feature == "softcap":
        kw["logits_soft_cap"] = 5.0
    elif feature == "sinks":
        kw["sinks"] = (torch.randn(8, generator=torch.Generator().manual_seed(1)) * 3).to(DEV)
    if feature == "fp8-pages":
        fp8 = torch.float8_e4m3fn
        k = k.float().to(fp8).float()  # values e4m3 holds exactly (see the fp8 test)
        v = (v.float() / 2.0).to(fp8).float() * 2.0
        kc, vc = (kc * 0.7).to(fp8), (vc * 0.7).to(fp8)
        kw.update(k_scale=1.0, v_scale=2.0)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    ref_kw = dict(kw)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(4), DEV)
    ref = TorchPagedAttention.forward(q, k, v, kc.clone() if feature == "fp8-pages" else kc.clone().float(),
                                      vc.clone() if feature == "fp8-pages" else vc.clone().float(), meta,
                                      0.125, **ref_kw)
    out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125, **kw)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", 0)
    assert triton_backend.kv_splits(4, 2, torch.device(DEV)) == 1
    whole = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125, **kw)
    torch.testing.assert_close(out, whole, atol=2e-3, rtol=2e-3)


class _CountLaunches:
    """Stands in for a jitted kernel: counts its launches and passes them on."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("feature", ["plain", "alibi", "softcap", "sinks", "fp8-pages", "bidirectional",
                                     "gqa-1", "graph-layout"])
def test_split_prefill_tiles_match_torch(monkeypatch, feature):
    """Prompt chunks after long cached prefixes (the chunks a long prompt is read in beside
    running streams): with few tiles the prefill launch splits each tile's keys over
    programs and a combine adds them. Chunks of 1..70 rows at contexts from 40 to 2,568
    keys, not aligned to pages or tiles; the outputs equal the torch reference with each
    feature, the combine really ran, and (plain) the unsplit launch agrees."""
    from pagedllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "MAX_KV_SPLITS", 8)
    monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", 64)
    hq, hkv = (4, 4) if feature == "gqa-1" else (8, 2)
    # (2,568 keys: the earlier tiles' splits are a key block shorter than the last tile's)
    seqs = [(1, 600), (40, 40), (7, 500), (70, 1100), (70, 2568), (33, 289)]
    if feature == "bidirectional":
        seqs = [(300, 300), (9, 9)]
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, 64, 16, torch.float32,
                                                                       seed=5)
    kw = {}
    if feature == "alibi":
        kw["alibi_slopes"] = torch.tensor([2 ** -(i + 1) for i in range(hq)], device=DEV)
    elif feature == "softcap":
        kw["logits_soft_cap"] = 5.0
    elif feature == "sinks":
        kw["sinks"] = (torch.randn(hq, generator=torch.Generator().manual_seed(1)) * 3).to(DEV)
    elif feature == "bidirectional":
        kw["causal"] = False
    if feature == "fp8-pages":
        fp8 = torch.float8_e4m3fn
        k = k.float().to(fp8).float()
        v = (v.float() / 2.0).to(fp8).float() * 2.0
        kc, vc = (kc * 0.7).to(fp8), (vc * 0.7).to(fp8)
        kw.update(k_scale=1.0, v_scale=2.0)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    tile_q = TritonPagedAttention.tile_q(hq // hkv)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, tile_q, DEV)
    fp8_pages = feature == "fp8-pages"
    ref = TorchPagedAttention.forward(q, k, v, kc.clone() if fp8_pages else kc.clone().float(),
                                      vc.clone() if fp8_pages else vc.clone().float(), meta, 0.125, **kw)
    if feature == "graph-layout":  # as a captured launch has it: no host lengths, a split
        # count sized by the busy tiles, and spare tiles past the last query
        meta.host_ctx_len = None
        meta.prefill_busy_tiles = meta.num_prefill_tiles
        spare = torch.tensor([[len(seqs) - 1] * 3, [int(ql[-1]) + tile_q] * 3], dtype=torch.int32, device=DEV)
        meta.prefill_tiles = torch.cat([meta.prefill_tiles, spare], dim=1)
        meta.num_prefill_tiles += 3
    combine = _CountLaunches(triton_backend._combine_splits_kernel)
    monkeypatch.setattr(triton_backend, "_combine_splits_kernel", combine)
    out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125, **kw)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    prefill_combines = [g for g in combine.grids if g[0] == meta.num_prefill_tiles]
    assert prefill_combines, "the prefill launch did not split"
    if feature == "plain":  # (the other features: the reference alone, for the suite's time)
        monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", 0)
        whole = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125, **kw)
        torch.testing.assert_close(out, whole, atol=2e-3, rtol=2e-3)


def test_prefill_splits_follow_the_keys(monkeypatch):
    """An eager prefill launch splits no further than its longest context fills splits of
    SPLIT_MIN_KEYS, and not at all where the launch has tiles enough; a sliding window
    keeps one split."""
    from pagedllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "MAX_KV_SPLITS", 8)
    monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", 64)
    attention = _CountLaunches(triton_backend._paged_attention_kernel)
    grids = attention.grids
    monkeypatch.setattr(triton_backend, "_paged_attention_kernel", attention)

    def prefill_splits(seqs, **kw):
        q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, 8, 2, 64, 16, torch.float32)
        q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
        meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(4), DEV)
        grids.clear()
        TritonPagedAttention.forward(q, k, v, kc, vc, meta, 0.125, **kw)
        return grids[-1][2]

    assert prefill_splits([(20, 20)]) == 1  # 20 keys: one split holds them
    assert prefill_splits([(20, 600)]) == 4  # 600 keys: a short context's four (of 192)
    assert prefill_splits([(20, 1100)]) == 5  # past 1,024 keys: one a 256
    assert prefill_splits([(20, 5000)]) == 8  # capped by MAX_KV_SPLITS
    assert prefill_splits([(20, 600)], sliding_window=64) == 1
    monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", 0)
    assert prefill_splits([(20, 5000)]) == 1  # enough tiles for the device


@pytest.mark.parametrize("layout", ["eager", "graph", "rows-kernel"])
def test_a_long_decode_among_short_ones_splits_its_keys(monkeypatch, layout):
    """Decodes where one context dwarfs the rest (attention.long_decode): the launch splits
    keys though the batch alone would not (eagerly as far as the longest context fills
    splits; in a captured graph's layout, no host lengths and `decode_long` set, over
    MAX_KV_SPLITS), also where one query per KV head would take the unsplit rows kernel;
    the outputs equal the torch reference. Without the long context nothing splits."""
    from pagedllm.attention import metadata, triton_backend

    monkeypatch.setattr(metadata, "LONG_DECODE_KEYS", 1024)
    # a card's many SMs would split this small batch by occupancy alone (kv_splits: 11 on
    # an H100); two SMs keep "the batch alone" unsplit on any device
    monkeypatch.setattr(triton_backend, "num_sms", lambda device: 2)
    if layout == "rows-kernel":
        monkeypatch.setattr(TritonPagedAttention, "DECODE_ROWS", "rows")
    attention = _CountLaunches(triton_backend._paged_attention_kernel)
    monkeypatch.setattr(triton_backend, "_paged_attention_kernel", attention)
    combine = _CountLaunches(triton_backend._combine_splits_kernel)
    monkeypatch.setattr(triton_backend, "_combine_splits_kernel", combine)

    def run(seqs, long: bool):
        q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, 4, 4, 64, 16, torch.float32,
                                                                           seed=3)
        q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
        meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(1), DEV)
        ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
        if layout != "eager":
            meta.host_ctx_len = None
            meta.decode_long = long
        attention.grids.clear()
        combine.grids.clear()
        out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
        return [g[2] if len(g) > 2 else 1 for g in attention.grids], len(combine.grids)

    short = [(1, 20), (1, 40), (1, 70), (1, 30), (1, 50)]
    assert triton_backend.kv_splits(6, 4, torch.device(DEV)) == 1  # the batch alone: no split
    splits, combines = run(short + [(1, 1500)], True)
    assert splits == [6 if layout == "eager" else triton_backend.MAX_KV_SPLITS] and combines == 1
    splits, combines = run(short + [(1, 1000)], False)  # under LONG_DECODE_KEYS
    assert splits in ([1], []) and combines == 0  # ([]: the rows kernel took them)


@pytest.mark.parametrize("heads_first", [False, True], ids=["seq-grid", "heads-grid"])
@pytest.mark.parametrize("hkv,waves,want", [(2, 0, "gqa"), (2, 64, "fp8"), (8, 0, "fp8")],
                         ids=["gqa-unsplit", "gqa-split", "mha-unsplit"])
def test_fp8_decode_launch_follows_group_and_splits(monkeypatch, hkv, waves, want, heads_first):
    """Over fp8 pages, grouped-query decodes whose keys are not split take
    DECODE_LAUNCH_FP8_GQA; split launches and one query head a KV head keep DECODE_LAUNCH_FP8
    (each measured fastest there); the output matches the torch reference either way."""
    from pagedllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "MAX_KV_SPLITS", 8)
    monkeypatch.setattr(triton_backend, "KV_SPLIT_WAVES", waves)
    # the (KV heads, sequences) grid must give the same output, split or not (the split
    # partial sums are indexed by sequence and head whatever the grid's order)
    monkeypatch.setattr(TritonPagedAttention, "DECODE_HEADS_FIRST", heads_first)
    seen = []
    split_launch = TritonPagedAttention._split_launch

    def spy(*args):
        seen.append((args[6], args[9]))  # the launch setting, the key splits
        return split_launch(*args)

    monkeypatch.setattr(TritonPagedAttention, "_split_launch", staticmethod(spy))
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch([(1, 40), (1, 300)], 8, hkv, 64, 16,
                                                                      dtype, seed=5)
    fp8 = torch.float8_e4m3fn
    k, v = (x.float().to(fp8).float().to(dtype) for x in (k, v))  # exact in e4m3
    q, k, v = (x.to(DEV) for x in (q, k, v))
    kc8, vc8 = (kc * 0.7).to(fp8).to(DEV), (vc * 0.7).to(fp8).to(DEV)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(8 // hkv), DEV)
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), kc8.clone(), vc8.clone(), meta, 0.125)
    out = TritonPagedAttention.forward(q, k, v, kc8, vc8, meta, 0.125)
    (launch, splits), = seen
    assert (splits > 1) == (waves > 0)
    expect = TritonPagedAttention.DECODE_LAUNCH_FP8_GQA if want == "gqa" else TritonPagedAttention.DECODE_LAUNCH_FP8
    assert launch is expect
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same pages stored head-major ([blocks, kv_heads, page, dim]), seen as
    [blocks, page, kv_heads, dim] (what PageSpec.layer_views gives the kernels)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("fp8", [False, True], ids=["cache-dtype", "fp8"])
@pytest.mark.parametrize("heads_first", [False, True], ids=["seq-grid", "heads-grid"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["gqa4", "gqa2-d128"])
def test_head_major_pages_match_token_major(monkeypatch, case, heads_first, fp8):
    """Head-major pages (PAGEDLLM_KV_LAYOUT=hnd): the write kernel puts every new key and
    value where the token-major run puts it (compared element by element through the
    views), and decodes and prefills over them give the token-major output exactly."""
    hq, hkv, dim, page, seqs = case
    monkeypatch.setattr(TritonPagedAttention, "DECODE_HEADS_FIRST", heads_first)
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, dim, page, dtype, seed=3)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(hq // hkv), DEV)
    kc_t, vc_t = kc.clone(), vc.clone()
    kc_h, vc_h = _head_major(kc), _head_major(vc)
    assert kc_h.stride(2) == page * dim and not kc_h.is_contiguous()
    want = TritonPagedAttention.forward(q, k, v, kc_t, vc_t, meta, dim**-0.5, k_scale=0.5, v_scale=0.7)
    got = TritonPagedAttention.forward(q, k, v, kc_h, vc_h, meta, dim**-0.5, k_scale=0.5, v_scale=0.7)
    assert torch.equal(kc_h.view(torch.uint8) if fp8 else kc_h, kc_t.view(torch.uint8) if fp8 else kc_t)
    assert torch.equal(vc_h.view(torch.uint8) if fp8 else vc_h, vc_t.view(torch.uint8) if fp8 else vc_t)
    assert not torch.equal(kc_t.float(), kc.float())  # the step wrote its keys
    torch.testing.assert_close(got, want, atol=0, rtol=0)
