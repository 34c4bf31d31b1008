"""Prefill attention alone: one long prompt read in chunks over the paged KV cache, the
Triton kernel at several launch settings against torch's flash attention (SDPA) over the
same keys and values laid out contiguously. What decides the kernel's tile sizes for long
prompts, and what the gap to FlashAttention is.

    python benchmarks/prefill_attn_bench.py --ctx 32768 --chunk 8192 [--json out.json]

Each row: the time of every chunk's attention for one layer (the KV write included for
the Triton kernel), and TFLOP/s over the causal products (4 * d * heads per visible
query-key pair). The last chunk's output is checked against SDPA's. FlashInfer's paged
prefill (FA2 and FA3 backends) gets rows too where flashinfer-python is installed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_backend import TritonPagedAttention


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _chunk_meta(table: torch.Tensor, page: int, start: int, end: int, tile_q: int) -> AttentionMetadata:
    dev = table.device
    ql = end - start
    pos = torch.arange(start, end, device=dev)
    slots = table[0, pos // page].long() * page + pos % page
    q0 = torch.arange(0, ql, tile_q, device=dev, dtype=torch.int32)
    tiles = torch.stack([torch.zeros_like(q0), q0])
    i32 = dict(dtype=torch.int32, device=dev)
    return AttentionMetadata(
        slot_mapping=slots, num_decode=0, block_tables=table, q_start=torch.zeros(1, **i32),
        q_len=torch.tensor([ql], **i32), ctx_len=torch.tensor([end], **i32), prefill_tiles=tiles,
        num_prefill_tiles=int(q0.numel()), prefill_tile_q=tile_q)


def _flashinfer_rows(add, q, kc, vc, table, page, chunks, hq, hkv, d, scale, ref, repeats) -> None:
    """FlashInfer's paged prefill over the same pages (NHD: [pages, page, kv heads, dim], our
    layout), its FA2 and FA3 (sm_90) backends, where flashinfer-python is installed. The
    plans (host work once per step, shared by every layer) are made before the timing."""
    try:
        import flashinfer
    except ImportError:
        print("flashinfer: not installed")
        return
    dev = q.device
    for backend in ("fa2", "fa3"):
        try:
            runs = []
            for s, e in chunks:
                pages = -(-e // page)
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD", backend=backend)
                i32 = dict(dtype=torch.int32, device=dev)
                w.plan(torch.tensor([0, e - s], **i32), torch.tensor([0, pages], **i32),
                       table[0, :pages].contiguous(), torch.tensor([e - (pages - 1) * page], **i32),
                       hq, hkv, d, page, causal=True, sm_scale=scale, q_data_type=q.dtype,
                       kv_data_type=kc.dtype)
                runs.append((w, s, e))

            def run(runs=runs) -> torch.Tensor:
                out = None
                for w, s, e in runs:
                    out = w.run(q[s:e], (kc, vc))
                return out

            out = run()
            err = None if ref is None else (out.float() - ref).abs().max().item()
            add(f"flashinfer {flashinfer.__version__} {backend}", _time(run, repeats), err)
        except Exception as e:  # a backend this card or build lacks
            print(f"flashinfer {backend}: {type(e).__name__}: {str(e)[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--best-out", default=None,
                    help="write the fastest Triton setting that matches SDPA as BLOCK_M,BLOCK_N,warps,stages "
                         "(the form PAGEDLLM_PREFILL_LAUNCH takes)")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    n, hq, hkv, d, page = args.ctx, args.hq, args.hkv, args.dim, args.page
    q = torch.randn(n, hq, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(n, hkv, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(n, hkv, d, device=dev, dtype=dt, generator=g)
    blocks = -(-n // page)
    perm = torch.randperm(blocks + 8, device=dev, generator=g)[:blocks].to(torch.int32)
    table = perm[None, :].contiguous()
    kc = torch.zeros(blocks + 8, page, hkv, d, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    scale = d ** -0.5
    pos = torch.arange(n, device=dev)
    TritonPagedAttention.write_kv(k, v, kc, vc, table[0, pos // page].long() * page + pos % page)
    chunks = [(s, min(s + args.chunk, n)) for s in range(0, n, args.chunk)]
    pairs = sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in chunks)
    flops = 4 * d * hq * pairs
    rows = []
    device_name = torch.cuda.get_device_name()

    def add(name: str, secs: float, err: float | None = None, setting=None) -> None:
        rows.append({"kernel": name, "setting": setting, "ms": round(secs * 1e3, 3), "TFLOPs": round(flops / secs / 1e12, 1),
                     "max_abs_err_vs_sdpa": None if err is None else round(err, 4)})
        print(f"{name:48s} {secs * 1e3:9.2f} ms  {flops / secs / 1e12:7.1f} TFLOP/s"
              + ("" if err is None else f"  max|err| {err:.4f}"), flush=True)

    # SDPA over contiguous K/V (heads repeated for the group, as HF's sdpa path does): the
    # chunk's queries against every key up to its end.
    qh = q.transpose(0, 1)[None]
    kh, vh = (x.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None] for x in (k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    def sdpa_chunks() -> torch.Tensor:
        out = None
        for s, e in chunks:
            if s == 0:
                out = F.scaled_dot_product_attention(qh[:, :, :e], kh[:, :, :e], vh[:, :, :e],
                                                     is_causal=True, scale=scale)
            else:
                out = F.scaled_dot_product_attention(qh[:, :, s:e], kh[:, :, :e], vh[:, :, :e],
                                                     attn_mask=causal_lower_right(e - s, e), scale=scale)
        return out

    ref = None
    impls = ["default"]
    try:
        from torch.nn import attention as att
        impls += [i for i in att.list_flash_attention_impls() if i]
    except Exception:  # older torch: only the built-in flash attention
        att = None
    for impl in impls:
        try:
            if impl != "default":
                att.activate_flash_attention_impl(impl)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = sdpa_chunks()
                if ref is None:
                    ref = out[0].transpose(0, 1).float()
                add(f"sdpa flash ({impl}) per chunk", _time(sdpa_chunks, args.repeats))
        except Exception as e:  # an implementation the machine lacks
            print(f"sdpa flash ({impl}): {type(e).__name__}: {str(e)[:160]}")
        finally:
            if impl != "default":
                try:
                    att.restore_flash_attention_impl()
                except Exception:
                    pass

    # The Triton kernel at launch settings (queries x heads per tile, keys per block, warps, stages).
    settings = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                (128, 128, 8, 2), (128, 32, 4, 3)]
    saved = (TritonPagedAttention.BLOCK_M_PREFILL, dict(TritonPagedAttention.PREFILL_LAUNCH))
    last = chunks[-1]
    for bm, bn, warps, stages in settings:
        TritonPagedAttention.BLOCK_M_PREFILL = bm
        TritonPagedAttention.PREFILL_LAUNCH = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        tq = TritonPagedAttention.tile_q(hq // hkv)
        metas = [_chunk_meta(table, page, s, e, tq) for s, e in chunks]

        def run(metas=metas) -> torch.Tensor:
            out = None
            for (s, e), meta in zip(chunks, metas, strict=True):
                out = TritonPagedAttention.forward(q[s:e], k[s:e], v[s:e], kc, vc, meta, scale)
            return out

        name = f"triton BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}"
        try:
            out = run()
            err = None
            if ref is not None:
                err = (out.float() - ref[: last[1] - last[0]]).abs().max().item()
            add(name, _time(run, args.repeats), err, [bm, bn, warps, stages])
        except Exception as e:  # too many registers / shared memory for this card
            print(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    TritonPagedAttention.BLOCK_M_PREFILL, TritonPagedAttention.PREFILL_LAUNCH = saved
    _flashinfer_rows(add, q, kc, vc, table, page, chunks, hq, hkv, d, scale,
                     None if ref is None else ref[: last[1] - last[0]], args.repeats)
    ok = [r for r in rows if r["setting"] and r["max_abs_err_vs_sdpa"] is not None and r["max_abs_err_vs_sdpa"] < 0.05]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        print(f"fastest matching Triton setting: {best['setting']} ({best['TFLOPs']} TFLOP/s)")
        if args.best_out:
            with open(args.best_out, "w") as f:
                f.write(",".join(str(x) for x in best["setting"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "prefill attention of one layer, one prompt read in chunks", "device": device_name,
                       "torch": torch.__version__, "shape": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
