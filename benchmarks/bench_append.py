"""Paged KV append and copy-on-write bandwidth, as a share of a plain
device-to-device copy of the same bytes measured in the same run.

    python benchmarks/bench_append.py                  # GPU (CuPy); exits with a message when none
    python benchmarks/bench_append.py --cpu            # smoke run of the same code on tiny NumPy shapes

Cases (bf16 by default, 8 KV heads x 128 dims, page size 16):
  decode B   B sequences x 1 new token (B in --batches), each on top of --context tokens
  prefill N  one sequence x N new tokens from position 0 (--prefill)
  cow B      copy-on-write step: B shared pages copied, both caches (copy_pages)
  rope B / rope prefill N
             the rotary append (``Rotary``: K rotated into the cache, --q-heads
             q heads in place, one launch) beside the two launches it replaces
             (layers.rope on q and k, then the plain append), same process

Bytes: an append reads its new rows and writes as many (2 x queries x Hkv x
(D + Dv) x itemsize); a page copy reads and writes each page (2 x pages x
page bytes). The baseline copies the same number of bytes with one
cudaMemcpyAsync (CuPy), so "% memcpy" compares like with like. Times are
medians of CUDA-event-timed single runs; the L2 cache is flushed before each
run unless --no-flush. GB/s = bytes / time.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from benchlib import Cpu, Gpu, Modeler, dtype_of  # noqa: E402 (also puts a source tree on sys.path)

from cupaged import HostPlan, Rotary, stream_for  # noqa: E402
from cupaged.layout import metadata_offsets  # noqa: E402
from cupaged.ops import layers  # noqa: E402
from cupaged.ops.append import append  # noqa: E402
from cupaged.ops.append import copy_pages as launch_copy_pages
from cupaged.testing import (
    random_page_table,  # noqa: E402
    reference,  # noqa: E402
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--cpu", action="store_true", help="smoke run on the CPU backend with tiny shapes")
    p.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32, help="query heads the rotary cases rotate")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batches", default="1,8,32,64,128,256", help="decode batch sizes, comma separated")
    p.add_argument("--context", type=int, default=512, help="tokens cached before each decode token")
    p.add_argument("--prefill", default="2048,16384", help="prefill chunk lengths, comma separated")
    p.add_argument("--reps", type=int, default=50, help="timed runs per case (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-flush", action="store_true", help="do not flush the L2 cache before each run")
    p.add_argument("--no-model", action="store_true", help="skip the modeled columns (cupaged.tools.perf_model)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# cases


def append_case(backend, rng, dt, kv_lens, q_lens, hkv, d, dv, ps, check: bool):
    """(run, bytes moved, checked) for one append over a random page permutation."""
    kv = np.asarray(kv_lens, np.int64)
    ql = np.asarray(q_lens, np.int64)
    pages = int((-(-kv // ps)).sum())
    table = random_page_table(rng, kv, ps, pages)
    queries = int(ql.sum())
    nk_h = rng.standard_normal((queries, hkv, d)).astype(dt)
    nv_h = rng.standard_normal((queries, hkv, dv)).astype(dt)
    k_h = np.zeros((pages, ps, hkv, d), dt)
    v_h = np.zeros((pages, ps, hkv, dv), dt)
    nk, nv, k, v = (backend.asarray(a) for a in (nk_h, nv_h, k_h, v_h))
    plan = HostPlan.build(table, kv, ql, ps, pages).upload(k)

    def run():
        append(plan, nk, nv, k, v)

    if check:
        run()
        ek, ev = reference.paged_append(nk_h, nv_h, k_h, v_h, table, kv, ql)
        assert np.array_equal(np.asarray(k).view(np.uint8), ek.view(np.uint8)), "append: K differs from reference"
        assert np.array_equal(np.asarray(v).view(np.uint8), ev.view(np.uint8)), "append: V differs from reference"
    return run, 2 * queries * hkv * (d + dv) * dt.itemsize


def rope_case(backend, rng, dt, kv_lens, q_lens, hq, hkv, d, ps, check: bool):
    """(fused run, two-launch run, bytes the fused one moves) for a rotary
    append of q [queries, hq, d] and k / v [queries, hkv, d], the head ranges
    of one fused qkv buffer, as the engine's."""
    kv = np.asarray(kv_lens, np.int64)
    ql = np.asarray(q_lens, np.int64)
    pages = int((-(-kv // ps)).sum())
    table = random_page_table(rng, kv, ps, pages)
    queries = int(ql.sum())
    qkv_h = rng.standard_normal((queries, hq + 2 * hkv, d)).astype(dt)
    cos64, sin64 = reference.rope_tables(np.arange(int(kv.max())), d)
    qkv, k, v = (
        backend.asarray(a) for a in (qkv_h.copy(), np.zeros((pages, ps, hkv, d), dt), np.zeros((pages, ps, hkv, d), dt))
    )
    cos, sin = backend.asarray(cos64.astype(np.float32)), backend.asarray(sin64.astype(np.float32))
    q, nk, nv = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    plan = HostPlan.build(table, kv, ql, ps, pages).upload(k)
    off = metadata_offsets(plan.host.queries, plan.host.sequences)["q_pos"]
    positions = plan.words[off : off + queries]
    rope = Rotary(cos, sin, q)

    def fused():
        append(plan, nk, nv, k, v, rope=rope)

    def separate():
        layers.rope(qkv[:, : hq + hkv], positions, cos, sin)
        append(plan, nk, nv, k, v)

    if check:
        fused()
        _, pos = reference.query_positions(kv, ql)
        eq = reference.apply_rope(qkv_h[:, :hq], cos64[pos], sin64[pos])
        ek = reference.apply_rope(qkv_h[:, hq : hq + hkv], cos64[pos], sin64[pos]).astype(dt)
        ek, ev = reference.paged_append(
            ek, qkv_h[:, hq + hkv :], np.zeros_like(np.asarray(k)), np.zeros_like(np.asarray(v)), table, kv, ql
        )
        tol = 2e-2 if dt.itemsize == 2 else 1e-5
        assert np.allclose(np.asarray(q).astype(np.float64), eq, atol=tol, rtol=tol), "rotary append: q differs"
        assert np.allclose(np.asarray(k).astype(np.float64), ek.astype(np.float64), atol=tol, rtol=tol), "K differs"
        assert np.array_equal(np.asarray(v).view(np.uint8), ev.view(np.uint8)), "rotary append: V differs"
    isz = dt.itemsize
    # bytes: the fused launch reads and writes q, k, v once; the rope launch reads and writes q, k; the append k, v
    return (
        fused,
        separate,
        2 * queries * (hq + 2 * hkv) * d * isz,
        (2 * queries * (hq + hkv) * d * isz, 4 * queries * hkv * d * isz),
    )


def cow_case(backend, rng, dt, copies, hkv, d, dv, ps, check: bool):
    pages = 2 * copies
    k_h = rng.standard_normal((pages, ps, hkv, d)).astype(dt)
    v_h = rng.standard_normal((pages, ps, hkv, dv)).astype(dt)
    perm = rng.permutation(pages)
    pairs_h = np.stack([perm[:copies], perm[copies:]], axis=1).astype(np.uint32)
    k, v, pairs = backend.asarray(k_h), backend.asarray(v_h), backend.asarray(pairs_h)
    stream = stream_for(k)

    def run():
        launch_copy_pages(stream, k, v, pairs, copies)

    if check:
        run()
        ek, ev = k_h.copy(), v_h.copy()
        ek[pairs_h[:, 1]] = k_h[pairs_h[:, 0]]
        ev[pairs_h[:, 1]] = v_h[pairs_h[:, 0]]
        assert np.array_equal(np.asarray(k).view(np.uint8), ek.view(np.uint8)), "copy_pages: K differs"
        assert np.array_equal(np.asarray(v).view(np.uint8), ev.view(np.uint8)), "copy_pages: V differs"
    page_bytes = ps * hkv * (d + dv) * dt.itemsize
    return run, 2 * copies * page_bytes


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        backend = Cpu()
        hkv, d, ps = 2, 16, 4
        batches, prefills, context, reps, warmup = [1, 8], [64], 13, 3, 1
    else:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as e:
            print(
                f"bench_append: no usable GPU ({type(e).__name__}: {e}). This benchmark times CuPy arrays on a "
                f"CUDA device; run it on a GPU machine, or use --cpu for a smoke run.",
                file=sys.stderr,
            )
            return 2
        backend = Gpu(flush=not args.no_flush)
        hkv, d, ps = args.kv_heads, args.head_dim, args.page_size
        batches = [int(x) for x in args.batches.split(",") if x]
        prefills = [int(x) for x in args.prefill.split(",") if x]
        context, reps, warmup = args.context, args.reps, args.warmup
    dv = d
    rng = np.random.default_rng(0)
    dt = dtype_of(args.dtype, backend)
    print(f"# cupaged append bandwidth on {backend.device}")
    print(
        f"# dtype {dt.name}, {hkv} kv heads x {d} dims, page size {ps}; median of {reps} runs"
        + ("" if backend.name == "cpu" or args.no_flush else ", L2 flushed before each")
    )
    cases = []
    for b in batches:
        cases.append(
            (f"decode B={b}", append_case(backend, rng, dt, [context + 1] * b, [1] * b, hkv, d, dv, ps, args.cpu))
        )
    for n in prefills:
        cases.append((f"prefill {n}", append_case(backend, rng, dt, [n], [n], hkv, d, dv, ps, args.cpu)))
    for b in batches:
        cases.append((f"cow B={b}", cow_case(backend, rng, dt, b, hkv, d, dv, ps, args.cpu)))
    hq = 4 if args.cpu else args.q_heads
    ropes = [
        (f"rope B={b}", rope_case(backend, rng, dt, [context + 1] * b, [1] * b, hq, hkv, d, ps, args.cpu))
        for b in batches
    ]
    ropes += [(f"rope prefill {n}", rope_case(backend, rng, dt, [n], [n], hq, hkv, d, ps, args.cpu)) for n in prefills]
    modeler = Modeler(backend, not args.no_model)
    head = (
        f"{'case':<16} {'bytes':>12} {'time us':>10} {'GB/s':>9} {'memcpy GB/s':>12} {'% memcpy':>9} "
        f"{'modeled us':>11} {'modeled GB/s':>13} {'modeled bound':>13}"
    )
    print(head)
    print("-" * len(head))
    for name, (run, nbytes) in cases:
        t = backend.time(run, reps, warmup)
        # the baseline copies nbytes / 2 bytes: it too reads and writes each byte once
        tm = backend.time(backend.memcpy(max(1, nbytes // 2)), reps, warmup)
        gbs, mgbs = nbytes / t / 1e9, nbytes / tm / 1e9
        m = modeler.copy(nbytes)
        mus = f"{1e3 * float(m['modeled_ms']):.1f}" if m.get("modeled_GBps") else "n/a"
        print(
            f"{name:<16} {nbytes:>12,d} {t * 1e6:>10.1f} {gbs:>9.1f} {mgbs:>12.1f} {100 * gbs / mgbs:>8.0f}% "
            f"{mus:>11} {m.get('modeled_GBps', 'n/a'):>13} {m.get('modeled_bound', 'n/a'):>13}"
        )
    print("# " + modeler.legend() + " (an append / page copy modeled as a copy of its bytes, at least one launch)")
    print(f"# the rotary append ({hq} q heads rotated in place) beside rope + append, the two launches it replaces")
    head = (
        f"{'case':<18} {'bytes':>12} {'fused us':>9} {'GB/s':>8} {'% memcpy':>9} {'rope+append us':>15} {'ratio':>6} "
        f"{'modeled us':>11} {'modeled rope+append us':>23} {'modeled ratio':>14}"
    )
    print(head)
    print("-" * len(head))

    def modeled_us(n):
        m = modeler.copy(n)
        return 1e3 * float(m["modeled_ms"]) if m.get("modeled_GBps") else None

    for name, (fused, separate, nbytes, parts) in ropes:
        t = backend.time(fused, reps, warmup)
        t2 = backend.time(separate, reps, warmup)
        tm = backend.time(backend.memcpy(max(1, nbytes // 2)), reps, warmup)
        gbs, mgbs = nbytes / t / 1e9, nbytes / tm / 1e9
        m1, m2 = modeled_us(nbytes), [modeled_us(n) for n in parts]
        ok = m1 is not None and None not in m2
        mtxt = f"{m1:>11.1f} {sum(m2):>23.1f} {sum(m2) / m1:>13.2f}x" if ok else f"{'n/a':>11} {'n/a':>23} {'n/a':>14}"
        print(
            f"{name:<18} {nbytes:>12,d} {t * 1e6:>9.1f} {gbs:>8.1f} {100 * gbs / mgbs:>8.0f}% "
            f"{t2 * 1e6:>15.1f} {t2 / t:>5.2f}x {mtxt}"
        )
    print("# modeled: each launch as a copy of its bytes (at least one launch), as above; the ratio is launches saved")
    if args.cpu:
        print(
            "# smoke run: every case matched reference.paged_append / a NumPy page copy bit for bit, the rotary "
            "cases reference.apply_rope at the dtype's tolerance"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
