"""Decode attention alone over bf16 and fp8 pages (CUDA): what an FP8 KV cache saves per
step, and what reading it costs.

One decode step's attention for one layer (every sequence one query, `--ctx` cached keys,
pages scattered over the pool), timed with CUDA events, for the Llama-2-7B shape (32 query
and 32 KV heads: gpu-7b and gpu-7b-kv) and the Llama-3.1-8B shape (32 / 8), at bf16 pages
and at fp8 pages with the products in fp16 and in bf16 (TritonPagedAttention.FP8_COMPUTE),
over a few launch settings. Each fp8 row is checked against the torch reference on the
same quantized pages first. Prints microseconds and the KV bytes read per second.

    python benchmarks/attn_decode_bench.py [--batch 256] [--ctx 512 2048] [--json F]
        [--shapes llama3-8b] [--pages fp8] [--settings 128,4,2 256,4,2] [--flashinfer]
        [--page 16 32] [--layout nhd hnd] [--heads-first 0 1]

--page: tokens a page (the engine's block_size); --layout: the pages as the engine lays
them out (nhd: a page's token rows hold every KV head) or head-major (hnd: each KV head's
rows of a page contiguous; the kernel reads both through strides); --heads-first: the
decode grid as (sequences, KV heads) or (KV heads, sequences)
(TritonPagedAttention.DECODE_HEADS_FIRST).

--flashinfer adds FlashInfer's batch decode over the same pages (NHD, as the engine lays
them out), with and without its tensor-core kernel, checked against the same reference:
whether the engine's decodes should go there (flashinfer-python must be importable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_backend import TritonPagedAttention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import cuda_time  # noqa: E402

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
PAGE = 16
SETTINGS = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 3)]


def build(hq: int, hkv: int, dim: int, batch: int, ctx: int, fp8: bool, seed: int = 0,
          page: int = PAGE, layout: str = "nhd"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = -(-ctx // page)
    num_blocks = batch * nblk + 1
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if layout == "hnd":  # stored [blocks, heads, page, dim], seen as [blocks, page, heads, dim]
        shape = (num_blocks, hkv, page, dim)
        kc = torch.randn(shape, generator=g, device="cuda").to(cache_dtype).permute(0, 2, 1, 3)
        vc = torch.randn(shape, generator=g, device="cuda").to(cache_dtype).permute(0, 2, 1, 3)
    else:
        shape = (num_blocks, page, hkv, dim)
        kc = torch.randn(shape, generator=g, device="cuda").to(cache_dtype)
        vc = torch.randn(shape, generator=g, device="cuda").to(cache_dtype)
    perm = torch.randperm(batch * nblk, generator=g, device="cuda").to(torch.int32) + 1
    tables = perm.view(batch, nblk)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, device="cuda", dtype=torch.int64), num_decode=batch,
        block_tables=tables, q_start=rows, q_len=torch.ones(batch, device="cuda", dtype=torch.int32),
        ctx_len=torch.full((batch,), ctx, device="cuda", dtype=torch.int32))
    q = torch.randn(batch, hq, dim, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(batch, hkv, dim, generator=g, device="cuda").to(torch.bfloat16)
    return q, k, kc, vc, meta


def flashinfer_row(q, kc, vc, meta: AttentionMetadata, ctx: int, tensor_cores: bool, want, kv_bytes: int,
                   layout: str = "nhd") -> dict:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper over the same pages and tables."""
    what = {"compute": f"flashinfer{'-tc' if tensor_cores else ''}"}
    try:
        import flashinfer

        batch, nblk = meta.block_tables.shape
        page = kc.shape[1]  # the [blocks, page, heads, dim] view either way
        if layout == "hnd":  # FlashInfer takes the stored [blocks, heads, page, dim] tensors
            kc, vc = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout.upper(),
                                                                use_tensor_cores=tensor_cores)
        indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * nblk
        last = torch.full((batch,), ctx - (nblk - 1) * page, dtype=torch.int32, device="cuda")
        dim = q.shape[2]
        hkv = kc.shape[2] if layout == "nhd" else kc.shape[1]
        wrapper.plan(indptr, meta.block_tables.reshape(-1).contiguous(), last, q.shape[1], hkv, dim,
                     page, q_data_type=q.dtype, kv_data_type=kc.dtype, sm_scale=dim**-0.5)
        out = wrapper.run(q, (kc, vc))
        err = ((out.float() - want).norm() / want.norm()).item()
        ms = cuda_time(lambda: wrapper.run(q, (kc, vc)), iters=50)
    except Exception as e:  # not installed, or a variant it does not build
        return dict(what, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return dict(what, us=round(ms * 1e3, 2), kv_GBps=round(kv_bytes / ms / 1e6), rel_err_vs_fp32=err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--pages", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--settings", nargs="+", default=None, metavar="BN,WARPS,STAGES",
                    help="launch settings to sweep (default: the SETTINGS list)")
    ap.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's batch decode")
    ap.add_argument("--page", type=int, nargs="+", default=[PAGE], help="tokens a page")
    ap.add_argument("--layout", nargs="+", default=["nhd"], choices=["nhd", "hnd"])
    ap.add_argument("--heads-first", type=int, nargs="+", default=[0], choices=[0, 1])
    ap.add_argument("--computes", nargs="+", default=None, help="only these (fp16 bf16 rows)")
    args = ap.parse_args()
    settings = [tuple(int(v) for v in x.split(",")) for x in args.settings] if args.settings else SETTINGS
    backend = TritonPagedAttention
    defaults = (backend.DECODE_LAUNCH, backend.DECODE_LAUNCH_FP8, backend.DECODE_LAUNCH_FP8_GQA,
                backend.FP8_COMPUTE,
                backend.DECODE_ROWS, backend.DECODE_ROWS_LAUNCH, backend.DECODE_HEADS_FIRST)
    rows = []
    print(f"decode attention, batch {args.batch} ({torch.cuda.get_device_name()})")
    print(f"{'shape':10s} {'ctx':>5s} {'pages':6s} {'compute':7s} {'BN,w,s':9s} {'page/lay/hf':12s} "
          f"{'us':>8s} {'GB/s':>7s} {'err':>8s}")
    variants = [(pg, lay, hf) for pg in args.page for lay in args.layout for hf in args.heads_first]
    for name, ctx, (page, layout, hf) in ((n, c, v) for n in args.shapes for c in args.ctx for v in variants):
        hq, hkv, dim = SHAPES[name]
        backend.DECODE_HEADS_FIRST = bool(hf)
        tag = f"{page}/{layout}/{hf}"
        # "rows": _decode_rows_kernel (float32 sums on the CUDA cores; one query per KV head)
        rows_kernel = ("rows",) if hq == hkv else ()
        for pages, computes in (("bf16", ("bf16", *rows_kernel)), ("fp8", ("fp16", "bf16", *rows_kernel))):
            if pages not in args.pages:
                continue
            computes = [c for c in computes if args.computes is None or c in args.computes]
            q, k, kc, vc, meta = build(hq, hkv, dim, args.batch, ctx, pages == "fp8", page=page, layout=layout)
            kv_bytes = 2 * args.batch * ctx * hkv * dim * kc.element_size()
            want = None
            for compute in computes:
                backend.DECODE_ROWS = "rows" if compute == "rows" else "dot"
                backend.FP8_COMPUTE = "fp16" if compute == "rows" else compute
                for bn, warps, stages in settings:
                    launch = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                    backend.DECODE_LAUNCH = backend.DECODE_LAUNCH_FP8 = backend.DECODE_LAUNCH_FP8_GQA = launch
                    backend.DECODE_ROWS_LAUNCH = launch

                    def step(q=q, k=k, kc=kc, vc=vc, meta=meta, dim=dim):
                        return backend.forward(q, k, k, kc, vc, meta, dim**-0.5)

                    try:
                        out = step()
                    except Exception as e:  # a setting the compiler refuses
                        print(f"{name:10s} {ctx:5d} {pages:6s} {compute:7s} {bn},{warps},{stages}: {type(e).__name__}")
                        continue
                    if want is None:  # the first setting's output, in float32 math
                        want = TritonPagedAttention.forward(q.float(), k.float(), k.float(),
                                                            kc if pages == "fp8" else kc.float(),
                                                            vc if pages == "fp8" else vc.float(),
                                                            meta, dim**-0.5).float()
                    err = ((out.float() - want).norm() / want.norm()).item()
                    ms = cuda_time(step, iters=50)
                    gbs = kv_bytes / ms / 1e6
                    print(f"{name:10s} {ctx:5d} {pages:6s} {compute:7s} {bn},{warps},{stages:<5d} {tag:12s} "
                          f"{ms * 1e3:8.1f} {gbs:7.0f} {err:8.1e}")
                    rows.append({"shape": name, "ctx": ctx, "pages": pages, "compute": compute,
                                 "launch": [bn, warps, stages], "page": page, "layout": layout,
                                 "heads_first": hf, "us": round(ms * 1e3, 2),
                                 "kv_GBps": round(gbs), "rel_err_vs_fp32": err})
            if args.flashinfer and want is not None and hf == args.heads_first[0]:
                for tc in (False, True):
                    row = flashinfer_row(q, kc, vc, meta, ctx, tc, want, kv_bytes, layout)
                    row.update(shape=name, ctx=ctx, pages=pages, page=page, layout=layout)
                    print(f"{name:10s} {ctx:5d} {pages:6s} {row['compute']:18s} {tag:12s} "
                          f"{row.get('us', float('nan')):8.1f} {row.get('kv_GBps', 0):7.0f} "
                          f"{row.get('rel_err_vs_fp32', float('nan')):8.1e} {row.get('error', '')}")
                    rows.append(row)
            del q, k, kc, vc, meta
    (backend.DECODE_LAUNCH, backend.DECODE_LAUNCH_FP8, backend.DECODE_LAUNCH_FP8_GQA, backend.FP8_COMPUTE,
     backend.DECODE_ROWS, backend.DECODE_ROWS_LAUNCH, backend.DECODE_HEADS_FIRST) = defaults
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "attn_decode", "device": torch.cuda.get_device_name(),
                       "batch": args.batch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
