"""Decode loop benchmark: host time per step and tokens/s, eager against one
graph launch per token, for a small many-layer tiny decoder (cupaged.demo.tiny).

    python benchmarks/bench_decode.py            # GPU
    python benchmarks/bench_decode.py --cpu      # smoke run on the CPU backend

Host time per step: wall time of issuing one step of ``tiny.generate``'s
decode loop (``loop.advance()`` plus its one token-history copy) without
waiting for the device, median over the steps after two warm-up steps.
Tokens/s: batch x those steps / their wall time including the final
synchronize (the token readback). modeled_*: cupaged.tools.perf_model's
device time of one step (kernels at their modeled time, at least one launch
each), not measured.

Continuous batching (second table): a ``cupaged.DecodeBatch`` of B slots,
tokens read back every 8 launches; "fixed" keeps its B sequences, "changing"
replaces one sequence at every readback (leave + free, a new prefilled
sequence joins; its prefill is not timed). host_us_per_token: median wall
time of ``batch.advance()`` (one copy + one graph launch; the reservation
of the next 8 steps' pages falls into some of them), without waiting for the
device; join_leave_us: host time of one leave + join (stream-ordered slot
updates); launches_per_token and captures show that membership changes
replay the same graph (one capture per bucket, no recapture).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import benchlib  # noqa: I001
import numpy as np

import cupaged
from cupaged.demo import tiny


def run(be, cfg, batch, steps, graph):
    like = be.asarray(np.zeros(1, np.float32))
    w = tiny.rounded(tiny.init_weights(cfg, seed=0), np.float32)
    prompt = 8
    pages = batch * (-(-(prompt + steps + 8) // 16)) + 2
    model = tiny.TinyModel(cfg, w, like, dtype=np.float32, num_pages=pages, page_size=16, max_rows=batch * prompt)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab, prompt).tolist() for _ in range(batch)]
    # One generate of steps + 4 tokens: its page table has room for them all (a
    # loop made for fewer tokens cannot take more steps: its rows are full).
    # Steps 1-2 compile what eager mode first needs; timing starts after them.
    stamps = []
    tiny.generate(
        model, prompts, steps + 4, chunk=prompt, graph=graph, on_step=lambda i: stamps.append(time.perf_counter())
    )
    be.sync()
    end = time.perf_counter()
    steady = stamps[2:]  # steps + 1 stamps: steps intervals
    return float(np.median(np.diff(steady))), batch * (len(steady) - 1) / (end - steady[0])


def run_batch(be, cfg, batch, steps, changing):
    """(median advance seconds, mean leave+join seconds, launches per token,
    captures of the batch, captures in the process during the run)."""
    like = be.asarray(np.zeros(1, np.float32))
    w = tiny.rounded(tiny.init_weights(cfg, seed=0), np.float32)
    prompt, k = 8, 8
    per = -(-(prompt + steps + 2 * k) // 16)
    model = tiny.TinyModel(
        cfg, w, like, dtype=np.float32, num_pages=(batch + 2) * per + 2, page_size=16, max_rows=max(batch, prompt)
    )
    cache, xp = model.cache, model.xp
    tok, nxt = xp.zeros(batch, np.int64), xp.zeros(batch, np.int64)
    logits, best = xp.zeros((model.max_rows, cfg.vocab), np.float32), xp.zeros(model.max_rows, np.int64)

    def step(plan):
        model.forward(plan, tok, logits)
        return logits[: plan.sequences]

    dec = cupaged.DecodeBatch(
        cache,
        step,
        token_buf=tok,
        next_token=nxt,
        max_batch=batch,
        max_len=prompt + steps + 2 * k,
        readback_every=k,
        buckets=[batch],
    )
    rng = np.random.default_rng(0)

    def prefilled():
        p = rng.integers(0, cfg.vocab, prompt).tolist()
        s = cache.add_sequence(tokens=p)
        plan, _ = cache.prepare([s], [prompt])
        model.forward(plan, xp.asarray(np.asarray(p, np.int64)), logits)
        cupaged.argmax_into(logits[:prompt], best[:prompt])
        return s, best[prompt - 1 : prompt]

    for _ in range(batch):
        dec.join(*prefilled())
    captures0 = cupaged.capture_count()
    times, changes = [], []
    for i in range(steps + k):
        t0 = time.perf_counter()
        dec.advance()
        times.append(time.perf_counter() - t0)
        if (i + 1) % k == 0:
            dec.readback()
            if changing:
                s, first = prefilled()
                old = dec.members[0]
                t0 = time.perf_counter()
                dec.leave(old)
                dec.join(s, first)
                changes.append(time.perf_counter() - t0)
                cache.free(old)
    be.sync()
    steady = times[k:]  # the first round captures and compiles
    return (
        float(np.median(steady)),
        float(np.mean(changes)) if changes else 0.0,
        dec.launches / (steps + k),
        dec.captures,
        cupaged.capture_count() - captures0,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--no-model", action="store_true", help="skip the modeled columns (cupaged.tools.perf_model)")
    args = p.parse_args(argv)
    be = benchlib.backend(args.cpu)
    if args.cpu:
        cfg, batches, args.steps = tiny.TinyConfig(layers=2), [2], 4
    else:
        cfg = tiny.TinyConfig(
            vocab=4096, hidden=256, layers=args.layers, heads=8, kv_heads=2, head_dim=32, ffn=512, max_pos=4096
        )
        batches = [1, 16]
    print(f"device: {be.device}; tiny decoder {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, f32")
    modeler = benchlib.Modeler(be, not args.no_model)
    rows = []
    for b in batches:
        # the device work of one decode step at the middle of the run (prompt 8 + half the steps)
        modeled = modeler.shape(
            batch=b,
            ctx=8 + args.steps // 2,
            new=1,
            hq=cfg.heads,
            hkv=cfg.kv_heads,
            d=cfg.head_dim,
            dv=cfg.head_dim,
            dtype="f32",
            metric="step",
            layers=cfg.layers,
            model_cfg=tuple(sorted(dataclasses.asdict(cfg).items())),
        )
        for graph in (False, True):
            host, tps = run(be, cfg, b, args.steps, graph)
            rows.append(
                dict(
                    batch=b,
                    mode="graph" if graph else "eager",
                    host_us_per_step=f"{host * 1e6:.0f}",
                    tokens_per_s=f"{tps:.0f}",
                    **modeled,
                )
            )
            print(benchlib.table([rows[-1]], list(rows[-1])).splitlines()[-1], flush=True)
    print()
    print("continuous batching (DecodeBatch, readback every 8 launches; changing: one sequence replaced per readback)")
    brows = []
    for b in [2] if args.cpu else [4, 16]:
        for changing in (False, True):
            host, change, per_token, caps, new_caps = run_batch(be, cfg, b, 16 if args.cpu else args.steps, changing)
            brows.append(
                dict(
                    batch=b,
                    membership="changing" if changing else "fixed",
                    host_us_per_token=f"{host * 1e6:.0f}",
                    join_leave_us=f"{change * 1e6:.0f}",
                    launches_per_token=f"{per_token:.2f}",
                    captures=caps,
                    captures_in_run=new_caps,
                )
            )
            print(benchlib.table([brows[-1]], list(brows[-1])).splitlines()[-1], flush=True)
    print()
    print(benchlib.table(brows, list(brows[0])))
    print()
    print(
        benchlib.table(
            rows,
            [
                "batch",
                "mode",
                "host_us_per_step",
                "tokens_per_s",
                "modeled_ms",
                "modeled_tokens_per_s",
                "modeled_bound",
            ],
        )
    )
    print(modeler.legend() + " (device time of one step; eager mode adds host time the model leaves out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
