"""Bit-identity check of every kernel family's CPU-backend output, across revisions.

    python tools/bitcheck.py                 # digests of this tree's outputs (JSON on stdout)
    python tools/bitcheck.py --against REV   # run the same cases on git revision REV too, compare

A fixed list of seeded cases runs through the public API only (plans,
attention, MLA, split-KV, mixed steps, append, copy-on-write, argmax, the
layer kernels, the demo's tokens), on the CPU backend. Each output's bytes
are hashed. ``--against`` checks REV out into a temporary git worktree, runs
this script there (the script text of this tree, with REV's package on the
path) and lists every case whose bytes differ. A refactor that must not
change results passes with "identical" for all; a kernel change shows which
families moved.

Exit status: 0 when every case matches (or without --against), 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def cases() -> dict:
    import cupaged
    from cupaged.testing import make_mla_case, make_paged_case

    out: dict[str, str] = {}

    def attention(name, case, causal=True, splits=None, lse=True):
        plan = cupaged.HostPlan.build(
            case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages
        ).upload(case.q)
        ws = None
        if splits:
            ws = cupaged.SplitWorkspace(plan.queries, case.q.shape[1], case.v_cache.shape[3], splits, like=case.q)
        o, l_ = plan.attention(case.q, case.k_cache, case.v_cache, case.scale, causal, workspace=ws, return_lse=True)
        out[name] = _digest(o, l_) if lse else _digest(o)

    def mla(name, case, causal=True, splits=None):
        plan = cupaged.HostPlan.build(
            case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages
        ).upload(case.q)
        ws = None
        if splits:
            ws = cupaged.SplitWorkspace(plan.queries, case.q.shape[1], case.q.shape[2], splits, like=case.q)
        o, l_ = plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, causal, workspace=ws, return_lse=True)
        out[name] = _digest(o, l_)

    for dt in ("f32", "f16", "bf16"):
        for d, hq, hkv in ((64, 8, 2), (128, 4, 4), (256, 8, 1), (96, 6, 3), (40, 4, 2)):
            rng = np.random.default_rng(zlib.crc32(f"{dt}/{d}/{hq}".encode()))
            c = make_paged_case(
                rng, sequences=4, max_kv_len=70, page_size=16, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dt
            )
            attention(f"decode/{dt}/d{d}/h{hq}x{hkv}", c)
            attention(f"decode-split3/{dt}/d{d}/h{hq}x{hkv}", c, splits=3)
        rng = np.random.default_rng(7)
        c = make_paged_case(
            rng,
            sequences=3,
            max_kv_len=90,
            page_size=8,
            num_q_heads=16,
            num_kv_heads=2,
            head_dim=64,
            head_dim_v=128,
            dtype=dt,
        )
        attention(f"decode-dv/{dt}", c, causal=False)
        for d in (64, 128, 256):
            rng = np.random.default_rng(11 + d)
            c = make_paged_case(
                rng,
                kv_lens=[70, 33, 90],
                q_lens=[40, 20, 33],
                page_size=16,
                num_q_heads=8,
                num_kv_heads=2,
                head_dim=d,
                dtype=dt,
            )
            attention(f"prefill/{dt}/d{d}", c)
            attention(f"prefill-noncausal-split2/{dt}/d{d}", c, causal=False, splits=2)
        rng = np.random.default_rng(5)
        c = make_paged_case(
            rng,
            kv_lens=[50, 3, 70, 9, 60, 4],
            q_lens=[1, 1, 40, 1, 33, 1],
            page_size=16,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            dtype=dt,
        )
        attention(f"mixed/{dt}", c)
        for h, r, p in ((16, 512, 64), (4, 64, 16), (128, 512, 64)):
            rng = np.random.default_rng(h + r)
            c = make_mla_case(
                rng,
                kv_lens=[40, 70],
                q_lens=[1, 20] if h < 128 else [1, 1],
                page_size=16,
                num_heads=h,
                latent_dim=r,
                pos_dim=p,
                dtype=dt,
            )
            mla(f"mla/{dt}/h{h}/r{r}/p{p}", c)
            mla(f"mla-split2/{dt}/h{h}/r{r}/p{p}", c, splits=2)

    # append and copy-on-write through the page manager
    rng = np.random.default_rng(3)
    for dt in ("f32", "f16", "bf16"):
        npdt = {"f32": np.float32, "f16": np.float16}.get(dt)
        if npdt is None:
            import ml_dtypes

            npdt = ml_dtypes.bfloat16
        cache = cupaged.PagedKVCache(
            num_pages=16, page_size=4, kv_heads=2, head_dim=24, dtype=dt, like=np.zeros(1, np.float32)
        )
        a = cache.add_sequence()
        plan, _ = cache.prepare([a], [7])
        kv = rng.standard_normal((7, 2, 24)).astype(npdt)
        cache.append(plan, kv, -kv)
        b = cache.fork(a)
        plan, _ = cache.prepare([a, b], [1, 2])
        kv = rng.standard_normal((3, 2, 24)).astype(npdt)
        cache.append(plan, kv, kv * 2)
        out[f"cache/{dt}"] = _digest(cache.k, cache.v)

    # argmax and layer kernels
    try:
        from cupaged.ops import layers
    except ImportError:
        from cupaged import layers
    for dt, npdt in (("f32", np.float32), ("f16", np.float16)):
        logits = rng.standard_normal((5, 1000)).astype(npdt)
        idx = np.zeros(5, np.int64)
        cupaged.argmax_into(logits, idx)
        x = rng.standard_normal((6, 64)).astype(npdt)
        w = rng.standard_normal((48, 64)).astype(npdt)
        o = np.zeros((6, 48), npdt)
        layers.linear(x, w, o)
        n = np.zeros_like(x)
        layers.rms_norm(x, rng.standard_normal(64).astype(npdt), n)
        q = rng.standard_normal((6, 2, 32)).astype(npdt)
        cos, sin = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2))
        layers.rope(q, np.arange(6, dtype=np.uint32), cos, sin)
        gu = rng.standard_normal((6, 40)).astype(npdt)
        act = np.zeros((6, 20), npdt)
        layers.silu_mul(gu, act)
        out[f"rowwise+layers/{dt}"] = _digest(idx, o, n, q, act)

    # the engine's host products (NumPy / BLAS on the CPU stream): a decode row, a panelled 8, a prefill-sized 40
    try:
        prods = []
        for m in (1, 8, 40):
            x = rng.standard_normal((m, 96)).astype(np.float32)
            w = rng.standard_normal((300, 96)).astype(np.float32)
            o = rng.standard_normal((m, 300)).astype(np.float32)
            layers.linear(x, w, o, accumulate=True, host=True)
            prods.append(o)
        out["host-products/f32"] = _digest(*prods)
    except TypeError:  # a revision without host products
        out["host-products/f32"] = "n/a"

    # the demo's tokens (graph decode on the CPU backend)
    for extra in ([], ["--mla"]):
        r = subprocess.run(
            [sys.executable, "-m", "cupaged", "demo", "--cpu", "--tokens", "12", *extra], capture_output=True, text=True
        )
        lines = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("seq ")]
        out["demo" + "".join(extra)] = (
            hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
            if r.returncode == 0
            else f"failed: {r.stderr[-200:]}"
        )
    return out


def _run_at(rev: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="cupaged-bitcheck-") as tmp:
        wt = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(wt), rev], check=True, capture_output=True
        )
        try:
            env = dict(os.environ, PYTHONPATH=str(wt), CUPAGED_BITCHECK_INNER="1")
            r = subprocess.run(
                [sys.executable, str(Path(__file__).resolve())], cwd=str(wt), env=env, capture_output=True, text=True
            )
            if r.returncode:
                raise SystemExit(f"bitcheck at {rev} failed:\n{r.stderr[-3000:]}")
            return json.loads(r.stdout)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(wt)], capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", metavar="REV", help="a git revision to compare with")
    args = p.parse_args(argv)
    if os.environ.get("CUPAGED_BITCHECK_INNER"):
        sys.path.insert(0, os.getcwd())
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    here = cases()
    if not args.against:
        print(json.dumps(here, indent=1, sort_keys=True))
        return 0
    there = _run_at(args.against)
    bad = 0
    for name in sorted(set(here) | set(there)):
        a, b = here.get(name), there.get(name)
        status = "identical" if a == b else ("missing" if a is None or b is None else "DIFFERENT")
        bad += status != "identical"
        print(f"{status:10s} {name}")
    print(f"{len(here)} cases, {bad} not identical (against {args.against})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
