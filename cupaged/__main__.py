"""Command line: ``python -m cupaged demo`` and ``python -m cupaged check OP``.

demo: a tiny Llama-style decoder with seeded random weights prefills a batch
of prompts in chunks, then decodes greedily through the paged decode graph,
and checks every token against a float64 NumPy reference model. GPU when
CuPy sees one, else the CPU backend (the same CUDA C kernels through g++).

check: one kernel on random data against the float64 reference, with its
error and time: the standalone kernel test.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import HostPlan, SplitWorkspace, argmax_into, stream_for
from ._runtime import xp_of
from .demo import tiny
from .testing import as_dtype, make_mla_case, make_paged_case, reference, tolerance


def _like(force_cpu: bool):
    if not force_cpu:
        try:
            import cupy
            if cupy.cuda.is_available():
                # CUDA cannot capture the legacy default stream (the demo's decode graph):
                # make a stream of our own current for the rest of the process.
                cupy.cuda.Stream(non_blocking=True).use()
                return cupy.zeros(1, np.float32), "gpu"
        except Exception:  # no CuPy, no driver: the CPU backend
            pass
    return np.zeros(1, np.float32), "cpu"


def _sync(like):
    stream_for(like).synchronize()


def cmd_demo(args) -> int:
    like, backend = _like(args.cpu)
    cfg = tiny.TinyConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                          kv_heads=args.kv_heads, head_dim=args.head_dim, ffn=2 * args.hidden,
                          max_pos=max(1024, args.prompt_max + args.tokens + 8), mla=args.mla,
                          latent_dim=args.latent_dim, rope_dim=args.rope_dim, nope_dim=args.head_dim,
                          v_head_dim=args.head_dim)
    dtype = {"f32": np.float32}[args.dtype]
    weights = tiny.rounded(tiny.init_weights(cfg, seed=args.seed), dtype)
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(max(1, args.prompt_max // 3), args.prompt_max + 1, size=args.batch)
    prompts = [rng.integers(0, cfg.vocab, size=int(n)).tolist() for n in lens]
    pages = int(sum(-(-(int(n) + args.tokens) // args.page_size) for n in lens)) + 4
    attn = (f"MLA: {cfg.heads} heads, latent {cfg.latent_dim}, rotary {cfg.rope_dim}" if cfg.mla else
            f"GQA: {cfg.heads}/{cfg.kv_heads} heads x {cfg.head_dim}")
    print(f"cupaged demo on the {backend} backend: {cfg.layers} layers, hidden {cfg.hidden}, {attn}, "
          f"vocab {cfg.vocab}, {args.dtype}")
    print(f"batch {args.batch}, prompt lengths {lens.tolist()}, prefill chunk {args.chunk}, "
          f"{args.tokens} new tokens each, page size {args.page_size}, {pages} pages")
    model = tiny.TinyModel(cfg, weights, like, dtype=dtype, num_pages=pages, page_size=args.page_size,
                           max_rows=max(args.batch, args.batch * args.chunk))
    t0 = time.perf_counter()

    def progress(i):
        if args.tokens >= 32 and i % max(1, args.tokens // 8) == 0:
            print(f"  step {i}/{args.tokens - 1}", flush=True)

    tokens, loop = tiny.generate(model, prompts, args.tokens, chunk=args.chunk, graph=not args.eager,
                                 on_step=progress)
    _sync(like)
    total = time.perf_counter() - t0
    # time the decode steps alone (host + device), after the first run compiled everything
    t1 = time.perf_counter()
    steps = min(loop.steps_left, args.tokens)
    for _ in range(steps):
        loop.advance()
    _sync(like)
    per_step = (time.perf_counter() - t1) / max(steps, 1)
    exact, ok = tiny.check_tokens(cfg, weights, prompts, tokens)
    for s in range(args.batch):
        print(f"  seq {s}: {tokens[s].tolist()}")
    mode = "eager" if args.eager else "one graph launch per token"
    print(f"decode ({mode}): {per_step * 1e3:.2f} ms per step, {args.batch / per_step:.1f} tokens/s "
          f"(batch {args.batch}); whole run incl. compile and prefill {total:.1f} s")
    print(f"tokens matching the float64 reference argmax: {exact}/{tokens.size}; "
          f"all within a {1e-3} logit margin: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def cmd_check(args) -> int:
    like, backend = _like(args.cpu)
    xp = xp_of(like)
    rng = np.random.default_rng(args.seed)
    dt = as_dtype(args.dtype)
    if args.op == "argmax":
        logits = rng.standard_normal((args.batch, args.vocab)).astype(dt)
        out = xp.zeros(args.batch, np.int64)
        dev = xp.asarray(logits)
        t = _timed(like, lambda: argmax_into(dev, out), args.repeat)
        bad = int((_host(out) != reference.row_argmax(logits)).sum())
        print(f"argmax [{args.batch}, {args.vocab}] {args.dtype} on {backend}: {bad} mismatching rows, "
              f"{t * 1e3:.3f} ms")
        return int(bad != 0)
    case = make_paged_case(rng, sequences=args.batch, max_kv_len=args.context, page_size=args.page_size,
                                   num_q_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                   dtype=dt, q_lens=None if args.q_len == 1 else args.q_len)
    plan = HostPlan.build(case.page_table, case.kv_lens, case.q_lens, args.page_size, case.num_pages)
    dplan = plan.upload(like)
    q, k, v = (xp.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    scale = 1.0 / np.sqrt(args.head_dim)
    if args.op in ("attention", "merge"):
        splits = args.splits if args.op == "attention" else max(2, args.splits)
        ws = SplitWorkspace(plan.queries, args.heads, args.head_dim, splits, like) if splits > 1 else None
        out = xp.zeros(q.shape[:2] + (args.head_dim,), dt)
        lse = xp.zeros(q.shape[:2], np.float32)
        t = _timed(like, lambda: dplan.attention(q, k, v, scale, True, workspace=ws, out=out, lse=lse),
                   args.repeat)
        exp_out, exp_lse = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.page_table,
                                                     case.kv_lens, case.q_lens, scale, True)
        err, ok = _max_error(out, exp_out, dt)
        lerr = float(np.max(np.abs(_host(lse) - exp_lse))) if exp_lse.size else 0.0
        print(f"{args.op}: {plan.queries} queries x {args.heads}/{args.kv_heads} heads x d{args.head_dim}, "
              f"context <= {args.context}, page {args.page_size}, {args.dtype}, splits {splits}, on {backend}: "
              f"max |out - ref| {err:.2e}, max |lse - ref| {lerr:.2e} ({'ok' if ok else 'TOO LARGE'}), "
              f"{t * 1e3:.3f} ms")
        return 0 if ok else 1
    if args.op == "append":
        new_k = rng.standard_normal((plan.queries, args.kv_heads, args.head_dim)).astype(dt)
        new_v = rng.standard_normal((plan.queries, args.kv_heads, args.head_dim)).astype(dt)
        exp_k, exp_v = reference.paged_append(new_k, new_v, case.k_cache, case.v_cache, case.page_table,
                                              case.kv_lens, case.q_lens)
        nk, nv = xp.asarray(new_k), xp.asarray(new_v)
        t = _timed(like, lambda: dplan.append(nk, nv, k, v), args.repeat)
        same = np.array_equal(_host(k).astype(np.float64), exp_k, equal_nan=True) and \
            np.array_equal(_host(v).astype(np.float64), exp_v, equal_nan=True)
        print(f"append: {plan.queries} rows x {args.kv_heads} heads x d{args.head_dim} {args.dtype} on {backend}: "
              f"{'bit-exact' if same else 'MISMATCH'}, {t * 1e3:.3f} ms")
        return 0 if same else 1
    if args.op == "mla":
        mcase = make_mla_case(rng, sequences=args.batch, max_kv_len=args.context, page_size=args.page_size,
                                      num_heads=args.heads, latent_dim=args.head_dim, pos_dim=args.rope_dim, dtype=dt,
                                      q_lens=None if args.q_len == 1 else args.q_len)
        mplan = HostPlan.build(mcase.page_table, mcase.kv_lens, mcase.q_lens, args.page_size, mcase.num_pages)
        dm = mplan.upload(like)
        arrs = [xp.asarray(a) for a in (mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos)]
        scale = 1.0 / np.sqrt(192)
        out = xp.zeros(mcase.q.shape, dt)
        t = _timed(like, lambda: dm.mla(*arrs, scale, True, out=out), args.repeat)
        exp_out, _ = reference.paged_mla(mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos, mcase.page_table,
                                         mcase.kv_lens, mcase.q_lens, scale, True)
        err, ok = _max_error(out, exp_out, dt)
        print(f"mla: {mplan.queries} queries x {args.heads} heads, R {args.head_dim}, P {args.rope_dim}, "
              f"{args.dtype} on {backend}: max |out - ref| {err:.2e} ({'ok' if ok else 'TOO LARGE'}), "
              f"{t * 1e3:.3f} ms")
        return 0 if ok else 1
    raise SystemExit(f"unknown op {args.op}")


def _host(a):
    """A host (NumPy) copy of a result array of either backend."""
    return a if isinstance(a, np.ndarray) else sys.modules["cupy"].asnumpy(a)


def _max_error(got, expected, dt) -> tuple[float, bool]:
    """(max |got - expected|, within the dtype's tolerance)."""
    err = float(np.max(np.abs(_host(got).astype(np.float64) - expected))) if expected.size else 0.0
    atol, rtol = tolerance(dt)
    return err, err <= atol + rtol * float(np.max(np.abs(expected), initial=0))


def _timed(like, fn, repeat: int) -> float:
    fn()  # compile + warm up
    _sync(like)
    times = []
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        fn()
        _sync(like)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupaged", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="tiny decoder: chunked prefill + graph decode, checked against float64")
    d.add_argument("--batch", type=int, default=3, help="sequences (default 3)")
    d.add_argument("--tokens", type=int, default=16, help="new tokens per sequence (default 16)")
    d.add_argument("--prompt-max", type=int, default=24, help="longest prompt (default 24)")
    d.add_argument("--chunk", type=int, default=8, help="prefill chunk per sequence (default 8)")
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--hidden", type=int, default=64)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--kv-heads", type=int, default=2)
    d.add_argument("--head-dim", type=int, default=16)
    d.add_argument("--vocab", type=int, default=256)
    d.add_argument("--mla", action="store_true", help="DeepSeek-style MLA attention (absorbed latent cache)")
    d.add_argument("--latent-dim", type=int, default=32, help="MLA latent dim R (default 32)")
    d.add_argument("--rope-dim", type=int, default=8, help="MLA rotary dim P (default 8)")
    d.add_argument("--dtype", default="f32", choices=["f32"])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--eager", action="store_true", help="no graph: issue every kernel per step")
    d.add_argument("--cpu", action="store_true", help="use the CPU backend even when a GPU is present")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("check", help="run one kernel on random data against the float64 reference")
    c.add_argument("op", choices=["attention", "mla", "append", "merge", "argmax"])
    c.add_argument("--batch", type=int, default=4, help="sequences (or rows for argmax)")
    c.add_argument("--context", type=int, default=300, help="longest sequence")
    c.add_argument("--q-len", type=int, default=1, help="queries per sequence (1 = decode)")
    c.add_argument("--heads", type=int, default=8)
    c.add_argument("--kv-heads", type=int, default=2)
    c.add_argument("--head-dim", type=int, default=128, help="D (attention, append) or R (mla)")
    c.add_argument("--rope-dim", type=int, default=64, help="P (mla)")
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument("--splits", type=int, default=1)
    c.add_argument("--vocab", type=int, default=32000)
    c.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    c.add_argument("--repeat", type=int, default=5)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--cpu", action="store_true")
    c.set_defaults(fn=cmd_check)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
