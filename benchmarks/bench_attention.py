"""Paged attention benchmark: decode bandwidth and chunked-prefill TFLOP/s.

    python benchmarks/bench_attention.py            # full grid on the GPU
    python benchmarks/bench_attention.py --quick    # the grid tools/device_check.sh runs
    python benchmarks/bench_attention.py --cpu      # tiny smoke run on the CPU backend

Decode: B sequences x context L, one query each, Hq/Hkv query/KV heads,
D = Dv = 128, bf16, page size 16 over a random page permutation, split-KV
chosen by ``cupaged.choose_splits``. Bytes = K and V rows read (B x L x Hkv x
(D + Dv) x 2) + q read + out written; GB/s = bytes / median time, and "% copy"
compares with a device-to-device copy measured in the same run (read + write
bytes per second). The naive baseline gathers the pages into dense padded
K/V, repeats them per query head and runs softmax(q K^T) V with CuPy (timed
with the gather); when torch with CUDA is installed, torch SDPA also runs on
the same data made dense beforehand (timed without the gather; its GB/s
counts the same bytes as ours).

Prefill: S sequences, N new queries each on top of C cached tokens, causal.
FLOPs = 2 x sum over queries of visible positions x Hq x (D + Dv).

``--kv-dtype e4m3`` (or e5m2): the decode cases read an fp8 cache (random
finite codes, per-KV-head scales) with bf16 / f16 q; bytes count one byte
per K / V element, so GB/s and "% copy" stay comparable with the 16-bit
run and the time should be about half of it where decode is memory-bound.
The naive baseline and SDPA are skipped (they have no fp8 path).
"""

from __future__ import annotations

import argparse
import math

import benchlib  # noqa: I001 (adds the source tree to sys.path)
import numpy as np

import cupaged
from cupaged import HostPlan, SplitWorkspace
from cupaged._runtime import device_arch
from cupaged.testing import random_page_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--cpu", action="store_true", help="tiny smoke run on the CPU backend")
    p.add_argument("--quick", action="store_true", help="the reduced grid of tools/device_check.sh")
    p.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=["e4m3", "e5m2"],
        help="decode over an fp8 K/V cache (q in --dtype: f16 or bf16)",
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    p.add_argument("--max-gb", type=float, default=40.0, help="skip decode cases whose K/V exceed this")
    p.add_argument("--no-model", action="store_true", help="skip the modeled columns (cupaged.tools.perf_model)")
    return p.parse_args(argv)


def fill_cache(be, shape, dt, seed):
    cache = be.empty(shape, dt)
    step = max(1, (1 << 26) // max(1, math.prod(shape[1:])))
    for i in range(0, shape[0], step):
        cache[i : i + step] = be.random((min(step, shape[0] - i),) + tuple(shape[1:]), dt, seed + i)
    return cache


def fill_codes(be, shape, seed):
    """Random finite fp8 codes (uint8; & 0xB7 keeps e4m3's and e5m2's
    exponents below their NaN / Inf ones)."""
    xp = be.cp if be.name == "gpu" else np
    cache = xp.empty(shape, xp.uint8)
    step = max(1, (1 << 26) // max(1, math.prod(shape[1:])))
    for i in range(0, shape[0], step):
        n = min(step, shape[0] - i)
        bits = be.random((n,) + tuple(shape[1:]), np.float32, seed + i).view(np.uint32)
        cache[i : i + step] = (bits & 0xB7).astype(np.uint8)
    return cache


def paged(be, rng, kv_lens, q_lens, hq, hkv, d, dt, ps, kv_dtype=None):
    kv = np.asarray(kv_lens, np.int64)
    pages = int((-(-kv // ps)).sum())
    table = random_page_table(rng, kv, ps, pages)
    plan = HostPlan.build(table, kv, q_lens, ps, pages)
    if kv_dtype is None:
        k = fill_cache(be, (pages, ps, hkv, d), dt, 1)
        v = fill_cache(be, (pages, ps, hkv, d), dt, 2)
    else:
        k = fill_codes(be, (pages, ps, hkv, d), 1)
        v = fill_codes(be, (pages, ps, hkv, d), 2)
    q = be.random((plan.queries, hq, d), dt, 3)
    return plan, table, q, k, v


def naive_decode(be, table, kv_lens, q, k, v, hq, hkv, scale):
    """Dense padded gather + per-head repeat + softmax(qK^T)V (what cupaged avoids)."""
    xp = be.cp if be.name == "gpu" else np
    tab = xp.asarray(table)
    B, L = table.shape[0], int(max(kv_lens))
    lens = xp.asarray(np.asarray(kv_lens))
    g = hq // hkv

    def run():
        kd = k[tab].reshape(B, -1, hkv, k.shape[-1])[:, :L]  # [B, L, Hkv, D] padded gather
        vd = v[tab].reshape(B, -1, hkv, v.shape[-1])[:, :L]
        kd = xp.repeat(kd, g, axis=2).transpose(0, 2, 1, 3)  # [B, Hq, L, D]
        vd = xp.repeat(vd, g, axis=2).transpose(0, 2, 1, 3)
        s = (q.reshape(B, hq, 1, -1).astype(xp.float32) @ kd.astype(xp.float32).transpose(0, 1, 3, 2)) * scale
        mask = xp.arange(L)[None, None, None, :] >= lens[:, None, None, None]
        s = xp.where(mask, -xp.inf, s)
        p = xp.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return (p @ vd.astype(xp.float32)).astype(q.dtype)

    return run


def torch_sdpa(be, table, kv_lens, q, k, v, hq, hkv, scale, new=1):
    """torch.nn.functional.scaled_dot_product_attention on the same data made
    dense ([B, H, L, D], gathered and padded once, outside the timing), or
    None when torch with CUDA is not installed. All lengths equal L here, so
    no mask is needed."""
    if be.name != "gpu":
        return None
    try:
        import torch
        import torch.nn.functional as F

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    cp = be.cp
    tab = cp.asarray(table)
    B, L = table.shape[0], int(max(kv_lens))
    kd = cp.ascontiguousarray(k[tab].reshape(B, -1, hkv, k.shape[-1])[:, :L].transpose(0, 2, 1, 3))
    vd = cp.ascontiguousarray(v[tab].reshape(B, -1, hkv, v.shape[-1])[:, :L].transpose(0, 2, 1, 3))
    qd = cp.ascontiguousarray(q.reshape(B, new, hq, -1).transpose(0, 2, 1, 3))  # [B, Hq, new, D]

    def t(a):  # bf16 goes through its int16 view
        if str(a.dtype) == "bfloat16":
            return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)

    tq, tk, tv = t(qd), t(kd), t(vd)
    stream = torch.cuda.ExternalStream(cp.cuda.get_current_stream().ptr)
    # causal by absolute position: query i of a chunk of `new` on top of L - new cached sees 0 .. L - new + i
    mask = None if new == 1 else torch.ones(new, L, dtype=torch.bool, device=tq.device).tril(L - new)

    def run():
        with torch.cuda.stream(stream):
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    be = benchlib.backend(args.cpu)
    dt = benchlib.dtype_of(args.dtype, be)
    rng = np.random.default_rng(0)
    d, ps = 128, 16
    if args.cpu:
        d, grid, heads, prefill = 64, [(2, 64)], [(8, 2)], [(2, 16, 16)]
        args.reps = 2
    elif args.quick:
        grid = [(1, 32768), (16, 4096), (64, 4096), (64, 32768), (256, 512), (256, 8192), (256, 32768)]
        heads, prefill = [(32, 8), (64, 8)], [(4, 2048, 2048)]
    else:
        grid = [(b, l) for b in (1, 8, 32, 64, 128, 256) for l in (512, 2048, 8192, 32768)]
        heads, prefill = [(32, 8), (64, 8)], [(1, 4096, 0), (4, 2048, 2048), (16, 512, 8192)]
    modeler = benchlib.Modeler(be, not args.no_model)
    copy_bw = benchlib.copy_bandwidth(be, (1 << 30) if be.name == "gpu" else (1 << 24))
    fp8 = args.kv_dtype
    kv_itemsize = 1 if fp8 else dt.itemsize
    xp = be.cp if be.name == "gpu" else np
    kv_args = {}
    if fp8:
        if args.dtype == "f32":
            raise SystemExit("--kv-dtype needs --dtype f16 or bf16")
        args.no_naive = True  # no fp8 path in the baselines
    print(
        f"device: {be.device}; dtype {dt.name}"
        + (f", K/V {fp8}" if fp8 else "")
        + f"; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)"
    )
    rows = []
    for hq, hkv in heads:
        for B, L in grid:
            kv_bytes = B * L * hkv * 2 * d * kv_itemsize
            if kv_bytes > args.max_gb * 1e9:
                continue
            plan, table, q, k, v = paged(be, rng, [L] * B, [1] * B, hq, hkv, d, dt, ps, fp8)
            if fp8:
                scales = xp.asarray(np.linspace(0.01, 0.02, hkv, dtype=np.float32))
                kv_args = dict(kv_dtype=fp8, k_scale=scales, v_scale=scales)
            dplan = plan.upload(q)
            splits = cupaged.choose_splits(
                plan, hkv, multiprocessors=be.sms, q_heads=hq, head_dim=d, dtype=dt, arch=device_arch(q), kv_dtype=fp8
            )
            ws = SplitWorkspace(plan.queries, hq, d, splits, q) if splits > 1 else None
            out = be.empty((plan.queries, hq, d), dt)
            scale = d**-0.5
            t = be.time(lambda: dplan.attention(q, k, v, scale, True, workspace=ws, out=out, **kv_args), args.reps, 3)
            nbytes = kv_bytes + 2 * B * hq * d * dt.itemsize
            row = dict(
                case="decode" + (f" {fp8}" if fp8 else ""),
                heads=f"{hq}/{hkv}",
                B=B,
                L=L,
                splits=splits,
                ms=f"{t * 1e3:.3f}",
                GBps=f"{nbytes / t / 1e9:.0f}",
                pct_copy=f"{100 * nbytes / t / copy_bw:.0f}%",
            )
            if not args.no_naive and kv_bytes * hq / hkv <= 4e9:
                try:
                    tn = be.time(naive_decode(be, table, [L] * B, q, k, v, hq, hkv, scale), max(3, args.reps // 4), 1)
                    row.update(naive_ms=f"{tn * 1e3:.3f}", speedup=f"{tn / t:.1f}x")
                except Exception as e:  # noqa: BLE001 (out of memory etc.)
                    row.update(naive_ms=type(e).__name__)
            if not args.no_naive and kv_bytes <= 8e9:
                try:
                    sdpa = torch_sdpa(be, table, [L] * B, q, k, v, hq, hkv, scale)
                    if sdpa is not None:
                        ts = be.time(sdpa, args.reps, 3)
                        row.update(sdpa_dense_ms=f"{ts * 1e3:.3f}", sdpa_GBps=f"{nbytes / ts / 1e9:.0f}")
                except Exception as e:  # noqa: BLE001
                    row.update(sdpa_dense_ms=type(e).__name__)
            row.update(
                modeler.shape(batch=B, ctx=L, new=1, hq=hq, hkv=hkv, d=d, dv=d, page=ps, dtype=args.dtype, kv_dtype=fp8)
            )
            rows.append(row)
            print(benchlib.table([row], list(row)).splitlines()[-1], flush=True)
            k = v = q = out = ws = dplan = None  # free the caches before the next case
    print()
    print(
        benchlib.table(
            rows,
            [
                "case",
                "heads",
                "B",
                "L",
                "splits",
                "ms",
                "GBps",
                "pct_copy",
                "modeled_ms",
                "modeled_GBps",
                "modeled_pct_copy",
                "modeled_bound",
                "naive_ms",
                "speedup",
                "sdpa_dense_ms",
                "sdpa_GBps",
            ],
        )
    )
    print(modeler.legend())
    if fp8:
        return 0  # the prefill cases run on 16-bit caches (python benchmarks/bench_attention.py)
    prow = []
    for S, N, C in prefill:
        hq, hkv = heads[0]
        plan, table, q, k, v = paged(be, rng, [C + N] * S, [N] * S, hq, hkv, d, dt, ps)
        dplan = plan.upload(q)
        out = be.empty((plan.queries, hq, d), dt)
        t = be.time(lambda: dplan.attention(q, k, v, d**-0.5, True, out=out), max(3, args.reps // 2), 2)
        visible = S * sum(C + i + 1 for i in range(N))
        flops = 2 * visible * hq * (d + d)
        row = dict(
            case="prefill",
            heads=f"{hq}/{hkv}",
            seqs=S,
            new=N,
            cached=C,
            ms=f"{t * 1e3:.3f}",
            TFLOPs=f"{flops / t / 1e12:.1f}",
        )
        if not args.no_naive:
            try:
                sdpa = torch_sdpa(be, table, [C + N] * S, q, k, v, hq, hkv, d**-0.5, new=N)
                if sdpa is not None:
                    ts = be.time(sdpa, max(3, args.reps // 2), 2)
                    row.update(sdpa_dense_ms=f"{ts * 1e3:.3f}", sdpa_TFLOPs=f"{flops / ts / 1e12:.1f}")
            except Exception as e:  # noqa: BLE001
                row.update(sdpa_dense_ms=type(e).__name__)
        row.update(
            modeler.shape(
                batch=S, ctx=C + N, new=N, hq=hq, hkv=hkv, d=d, dv=d, page=ps, dtype=args.dtype, metric="flops"
            )
        )
        prow.append(row)
    print()
    print(
        benchlib.table(
            prow,
            [
                "case",
                "heads",
                "seqs",
                "new",
                "cached",
                "ms",
                "TFLOPs",
                "modeled_ms",
                "modeled_TFLOPs",
                "modeled_bound",
                "sdpa_dense_ms",
                "sdpa_TFLOPs",
            ],
        )
    )
    print(modeler.legend())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
