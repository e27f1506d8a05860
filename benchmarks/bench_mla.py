"""MLA decode benchmark at DeepSeek-V3 shapes: H = 16 and 128 query heads,
latent R = 512, rotary P = 64, page size 64, bf16.

    python benchmarks/bench_mla.py            # GPU
    python benchmarks/bench_mla.py --quick    # the grid tools/device_check.sh runs
    python benchmarks/bench_mla.py --cpu      # tiny smoke run on the CPU backend

Bytes = latent + rotary rows read once (B x L x (R + P) x 2) + q, q_pos read
+ out written; GB/s = bytes / median CUDA-event time; "% copy" against a
device-to-device copy measured in the same run (read + write bytes/s).
TFLOP/s: 2 x B x L x H x (2R + P) (scores and values). The modeled_*
columns are cupaged.tools.perf_model's model of the same case (not measured).
"""

from __future__ import annotations

import argparse

import benchlib  # noqa: I001
import numpy as np
from bench_attention import fill_cache

import cupaged
from cupaged import HostPlan, SplitWorkspace
from cupaged._runtime import device_arch
from cupaged.testing import random_page_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    p.add_argument("--no-model", action="store_true", help="skip the modeled columns (cupaged.tools.perf_model)")
    args = p.parse_args(argv)
    be = benchlib.backend(args.cpu)
    dt = benchlib.dtype_of(args.dtype, be)
    R, P, ps = 512, 64, 64
    if args.cpu:
        R, P, ps, grid, heads, args.reps = 64, 16, 16, [(2, 40)], [16], 2
    elif args.quick:
        grid, heads = [(1, 16384), (32, 4096), (128, 4096), (128, 16384)], [16, 128]
    else:
        grid, heads = [(b, l) for b in (1, 16, 64, 128, 256) for l in (1024, 4096, 16384)], [16, 128]
    modeler = benchlib.Modeler(be, not args.no_model)
    copy_bw = benchlib.copy_bandwidth(be, (1 << 30) if be.name == "gpu" else (1 << 24))
    print(f"device: {be.device}; dtype {dt.name}; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    rng = np.random.default_rng(0)
    rows = []
    for h in heads:
        for B, L in grid:
            need = -(-L // ps)
            pages = B * need
            table = random_page_table(rng, [L] * B, ps, pages)
            plan = HostPlan.build(table, [L] * B, [1] * B, ps, pages)
            latent = fill_cache(be, (pages, ps, 1, R), dt, 1)
            k_pos = fill_cache(be, (pages, ps, 1, P), dt, 2)
            q, q_pos = be.random((B, h, R), dt, 3), be.random((B, h, P), dt, 4)
            dplan = plan.upload(q)
            splits = cupaged.choose_splits(
                plan, 1, multiprocessors=be.sms, q_heads=h, head_dim=R, dtype=dt, rot_dim=P, arch=device_arch(q)
            )
            ws = SplitWorkspace(B, h, R, splits, q) if splits > 1 else None
            out = be.empty((B, h, R), dt)
            scale = (128 + 64) ** -0.5
            t = be.time(lambda: dplan.mla(q, q_pos, latent, k_pos, scale, True, workspace=ws, out=out), args.reps, 3)
            nbytes = (B * L * (R + P) + B * h * (2 * R + P)) * dt.itemsize
            row = dict(
                H=h,
                B=B,
                L=L,
                splits=splits,
                ms=f"{t * 1e3:.3f}",
                GBps=f"{nbytes / t / 1e9:.0f}",
                pct_copy=f"{100 * nbytes / t / copy_bw:.0f}%",
            )
            visible = B * L
            row["TFLOPs"] = f"{2 * visible * h * (2 * R + P) / t / 1e12:.1f}"
            row.update(
                modeler.shape(
                    batch=B, ctx=L, new=1, hq=h, hkv=1, d=R, dv=R, rot=P, page=ps, dtype=args.dtype, metric="flops"
                )
            )
            rows.append(row)
            print(benchlib.table([row], list(row)).splitlines()[-1], flush=True)
    print()
    print(
        benchlib.table(
            rows,
            [
                "H",
                "B",
                "L",
                "splits",
                "ms",
                "GBps",
                "pct_copy",
                "TFLOPs",
                "modeled_ms",
                "modeled_GBps",
                "modeled_pct_copy",
                "modeled_TFLOPs",
                "modeled_bound",
            ],
        )
    )
    print(modeler.legend())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
