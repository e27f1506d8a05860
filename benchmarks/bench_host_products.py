"""The CPU backend's few-row products (kernels_cu/host/products.cpp) against NumPy's BLAS on the same arrays,
side by side in one process: one decode step's projections of a model shape (every layer's q, k, v, o,
gate|up and down products, weights out of cache: each layer has its own), per row count M.

    python benchmarks/bench_host_products.py                       # SmolLM2-135M's shape, M 1 .. 64
    python benchmarks/bench_host_products.py --rows 1 8 --threads 1

Prints per M: ms per step for each, the weight stream in GB/s and as % of a measured host copy bandwidth
(np.copyto of 256 MiB: read + write counted), GFLOP/s, and BLAS time / ours (> 1: ours faster). The engine
uses ours up to cupaged._runtime.host_products.MAX_ROWS rows and BLAS above. CPU timings only (this is host
code); no modeled figure: there is no model of the host."""

from __future__ import annotations

import argparse
import os

import benchlib  # puts this source tree first on sys.path; its Cpu times host work
import numpy as np

SHAPES = {  # hidden, kv width (heads x dim), intermediate, layers
    "smollm2-135m": (576, 192, 1536, 30),
    "llama-1b": (2048, 512, 8192, 16),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    ap.add_argument("--threads", type=int, default=0, help="pool threads for ours (default: the CPU workers)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    from cupaged._runtime import cpu, host_products

    hidden, kv, inter, layers = SHAPES[args.shape]
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
    rng = np.random.default_rng(0)
    weights = [[rng.standard_normal((n, k), dtype=np.float32) for k, n in shapes] for _ in range(layers)]
    weight_bytes = sum(w.nbytes for ws in weights for w in ws)
    threads = args.threads or cpu.configured_workers()

    src = np.ones(64 << 20, np.float32)
    dst = np.empty_like(src)
    copy_s = _median(lambda: np.copyto(dst, src), 5)
    copy_gbs = 2 * src.nbytes / copy_s / 1e9
    print(
        f"{args.shape}: {layers} layers, {weight_bytes / 1e6:.0f} MB of weights a step; ours on {threads} threads, "
        f"BLAS with its own (OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}); "
        f"host copy {copy_gbs:.1f} GB/s"
    )
    print(
        f"{'M':>4} {'ours ms':>9} {'BLAS ms':>9} {'ours GB/s':>10} {'% copy':>7} {'ours GFLOP/s':>13} "
        f"{'BLAS GFLOP/s':>13} {'BLAS/ours':>10}"
    )
    for m in args.rows:
        xs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in {k for k, _ in shapes}}
        outs = [[np.empty((m, n), np.float32) for _, n in shapes] for _ in range(layers)]
        ours = [
            host_products.product(xs[k], weights[li][i], outs[li][i], False, threads)
            for li in range(layers)
            for i, (k, _) in enumerate(shapes)
        ]

        def run_ours():
            for f in ours:
                f()

        def run_blas():
            for li in range(layers):
                for i, (k, _) in enumerate(shapes):
                    np.matmul(xs[k], weights[li][i].T, out=outs[li][i])

        a, b = _median(run_ours, args.reps), _median(run_blas, args.reps)
        flop = 2 * m * weight_bytes / 4
        print(
            f"{m:>4} {a * 1e3:>9.1f} {b * 1e3:>9.1f} {weight_bytes / a / 1e9:>10.1f} "
            f"{100 * weight_bytes / a / 1e9 / copy_gbs:>6.0f}% {flop / a / 1e9:>13.1f} {flop / b / 1e9:>13.1f} "
            f"{b / a:>9.2f}x"
        )


def _median(fn, reps: int) -> float:
    return benchlib.Cpu().time(fn, reps, warmup=1)


if __name__ == "__main__":
    main()
