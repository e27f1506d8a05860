"""A performance model built from the real kernels; every figure it prints
is **modeled**, none is measured.

    python -m cupaged.tools.perf_model [--arch sm_90|sm_80] [--json | --markdown] [--shape NAME ...]
        [--assumptions] [--no-cache] [--no-counters]

For each benchmark shape (``SHAPES``; the benchmarks in ``benchmarks/``
measure the same cases) it builds the HostPlan the benchmark builds, asks
``choose_splits`` and ``plan_launches`` what runs, compiles each launch's
variant with NVRTC for the arch (cached), reads ptxas (registers, spills,
static shared memory) and the SASS (hot loop, instructions per K/V byte;
needs nvdisasm or cuobjdump, see ``cupaged.tools.sass``), runs one block of
each kernel at a small shape on the CPU backend for the mma / ldmatrix /
cp.async counts, and models the launch (``cupaged.tools.model``: occupancy,
waves and tail, HBM bytes moved against bytes that must move, bytes in
flight against Little's law, tensor and shared-memory work, issue; a fluid
simulation of the grid gives the time and the binding bound).

Assumptions (bandwidths, latency, rates) are in ``cupaged.tools.archs``
and docs/performance.md. ``--assumptions`` prints them.

Exit status 0 (a shape that cannot be modeled is reported in its row).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import dtypes
from ..demo import tiny
from ..errors import PagedAttentionError
from ..graph import capture_graph
from ..ops.advance import advance_plan
from ..ops.attention import plan_launches
from ..ops.attention.kernels.merge import MERGE, MERGE_HEADS_PER_BLOCK, merge_defines
from ..ops.sampling import argmax_into
from ..plan import HostPlan, choose_splits
from . import archs as _archs
from . import counters as _counters
from . import kernels as _kernels
from . import model as _model
from . import sass as _sass

LABEL = "modeled"


@dataclass(frozen=True)
class Shape:
    """One benchmark case. ``new`` queries per sequence on top of
    ``ctx - new`` cached tokens (decode: new = 1); causal."""

    name: str
    title: str
    batch: int
    ctx: int
    new: int
    hq: int
    hkv: int
    d: int
    dv: int
    rot: int = 0
    page: int = 16
    dtype: str = "bf16"
    kv_dtype: str | None = None  # K/V storage when it differs from q's: an fp8 cache, "e4m3" / "e5m2"
    metric: str = "bytes"  # "bytes" (% of copy), "flops" (TFLOP/s too), "step" (decode loop)
    bench: str = ""  # the benchmark that measures it
    layers: int = 0  # decode loop: model layers
    model_cfg: tuple = ()  # decode loop: TinyConfig fields ((name, value) pairs; default DECODE_LOOP_CFG)


#: The shapes of issue #11. ``bench`` names the measuring command and case.
SHAPES: tuple[Shape, ...] = (
    Shape(
        "gqa_g4",
        "GQA decode B64 ctx4096 32/8 D128 p16",
        64,
        4096,
        1,
        32,
        8,
        128,
        128,
        bench="bench_attention decode 32/8 B=64 L=4096",
    ),
    Shape(
        "gqa_g8",
        "GQA decode B64 ctx4096 64/8 D128 p16",
        64,
        4096,
        1,
        64,
        8,
        128,
        128,
        bench="bench_attention decode 64/8 B=64 L=4096",
    ),
    Shape(
        "gqa_g1",
        "GQA decode B64 ctx4096 8/8 D128 p16",
        64,
        4096,
        1,
        8,
        8,
        128,
        128,
        bench="bench_attention decode 8/8 B=64 L=4096 (not in --quick)",
    ),
    Shape(
        "split_b1",
        "split-KV decode B1 ctx32k 32/8 D128",
        1,
        32768,
        1,
        32,
        8,
        128,
        128,
        bench="bench_attention decode 32/8 B=1 L=32768",
    ),
    Shape(
        "mla_b64",
        "MLA H128 R512 P64 p64 B64 ctx4096",
        64,
        4096,
        1,
        128,
        1,
        512,
        512,
        rot=64,
        page=64,
        metric="flops",
        bench="bench_mla H=128 B=64 L=4096 (--quick has B=32, 128)",
    ),
    Shape(
        "mla_b128",
        "MLA H128 R512 P64 p64 B128 ctx4096",
        128,
        4096,
        1,
        128,
        1,
        512,
        512,
        rot=64,
        page=64,
        metric="flops",
        bench="bench_mla H=128 B=128 L=4096",
    ),
    Shape(
        "prefill_4k",
        "prefill causal 1x4096 32/8 D128",
        1,
        4096,
        4096,
        32,
        8,
        128,
        128,
        metric="flops",
        bench="bench_attention prefill S=1 N=4096 C=0 (full grid)",
    ),
    Shape(
        "chunk_4k",
        "chunked prefill causal 4x2048 on 2048 32/8 D128",
        4,
        4096,
        2048,
        32,
        8,
        128,
        128,
        metric="flops",
        bench="bench_attention prefill S=4 N=2048 C=2048",
    ),
    Shape(
        "fp8_g4",
        "GQA decode B64 ctx4096 32/8 D128 p16 e4m3 K/V",
        64,
        4096,
        1,
        32,
        8,
        128,
        128,
        kv_dtype="e4m3",
        bench="bench_attention --kv-dtype e4m3 decode 32/8 B=64 L=4096",
    ),
    Shape(
        "long_g4",
        "GQA decode B16 ctx32k 32/8 D128 p16",
        16,
        32768,
        1,
        32,
        8,
        128,
        128,
        bench="bench_attention decode 32/8 B=16 L=32768 (full grid: B=8 / 32)",
    ),
    Shape(
        "fp8_long",
        "GQA decode B16 ctx32k 32/8 D128 p16 e4m3 K/V",
        16,
        32768,
        1,
        32,
        8,
        128,
        128,
        kv_dtype="e4m3",
        bench="bench_attention --kv-dtype e4m3 decode 32/8 B=16 L=32768",
    ),
    Shape(
        "decode_loop",
        "decode-loop step, tiny model 16 layers B16 ctx~40 f32",
        16,
        40,
        1,
        8,
        2,
        32,
        32,
        dtype="f32",
        metric="step",
        layers=16,
        bench="bench_decode batch 16, graph",
    ),
)

#: The decode-loop model as benchmarks/bench_decode.py builds it.
DECODE_LOOP_CFG = dict(vocab=4096, hidden=256, layers=16, heads=8, kv_heads=2, head_dim=32, ffn=512, max_pos=4096)


def _host(shape: Shape):
    per = -(-shape.ctx // shape.page)
    pages = shape.batch * per
    table = np.arange(pages, dtype=np.int64).reshape(shape.batch, per)
    return HostPlan.build(table, [shape.ctx] * shape.batch, [shape.new] * shape.batch, shape.page, pages)


@dataclass
class Row:
    shape: Shape
    arch: str
    status: str = "ok"  # "ok", "skipped", "error"
    reason: str = ""
    splits: int = 1
    launches: list = field(default_factory=list)  # LaunchModel
    time_s: float = 0.0
    must_bytes: float = 0.0
    design_bytes: float = 0.0
    flops: float = 0.0
    figure: str = ""  # the headline modeled figure
    pct: float | None = None  # % of copy bandwidth (bytes) or of the tensor ceiling (flops)
    gbps: float | None = None
    tflops: float | None = None
    tokens_per_s: float | None = None
    binding: str = ""
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "label": LABEL,
            "shape": self.shape.name,
            "title": self.shape.title,
            "arch": self.arch,
            "status": self.status,
            "reason": self.reason,
            "splits": self.splits,
            "bench": self.shape.bench,
            "time_us": self.time_s * 1e6,
            "must_bytes": self.must_bytes,
            "design_bytes": self.design_bytes,
            "flops": self.flops,
            "figure": self.figure,
            "pct": self.pct,
            "GBps": self.gbps,
            "TFLOPs": self.tflops,
            "tokens_per_s": self.tokens_per_s,
            "binding": self.binding,
            "notes": self.notes,
            "launches": [lm.as_dict() for lm in self.launches],
        }


def _kv_bpt(shape: Shape, itemsize: int) -> int:
    """K/V bytes per token of one KV head (latent + rotary for MLA)."""
    return (shape.d + shape.rot) * itemsize if shape.rot else (shape.d + shape.dv) * itemsize


def _launch_models(
    shape: Shape,
    arch: _archs.Arch,
    host,
    token: str,
    kv: str,
    *,
    use_cache: bool,
    probes: bool,
    splits: int | None = None,
) -> tuple[int, list]:
    """Models of the launches of ``shape`` (q / out dtype ``token``, caches
    ``kv``: ``token`` itself, or an fp8 format)."""
    assert arch.latency_ns is not None and arch.l2_latency_ns is not None, f"{arch.name}: not a modeled arch"
    itemsize = dtypes.row("dtype", kv, kv=True).itemsize
    kv_arg = None if kv == token else kv
    if splits is None:
        splits = choose_splits(
            host,
            shape.hkv,
            multiprocessors=arch.sms,
            q_heads=shape.hq,
            head_dim=shape.d,
            value_dim=shape.dv,
            dtype=token,
            rot_dim=shape.rot,
            arch=arch.name,
            kv_dtype=kv_arg,
        )
    launches = plan_launches(
        host, token, shape.hq, shape.hkv, shape.d, shape.dv, shape.rot, True, True, arch=arch.name, kv_dtype=kv_arg
    )
    kv_bpt = _kv_bpt(shape, itemsize)
    unique_kv = float(np.asarray(host.kv_lens).sum()) * kv_bpt * (1 if shape.rot else shape.hkv)
    fits = unique_kv <= (arch.l2_bytes or 0) / 2
    out = []
    last = None
    for L in launches:
        # an arch-specific build (CP_TARGET=sm_90a) compiles for its target
        facts = _model.kernel_facts(
            L.source, L.defines, L.kernel, str(L.defines.get("CP_TARGET", arch.name)), use_cache
        )
        uses_cp = bool(facts.hot and any(r.ldgsts for r in facts.hot.regions))
        desc = _kernels.desc(L.kernel, uses_cp)
        notes, probe = [], None
        if probes:
            try:
                probe = _counters.probe(
                    L,
                    dtype=token,
                    hq=shape.hq,
                    hkv=shape.hkv,
                    d=shape.d,
                    dv=shape.dv,
                    rot=shape.rot,
                    page_size=shape.page,
                    use_cache=use_cache,
                    arch=arch.name,
                    kv_dtype=kv_arg,
                )
                if probe.note:
                    notes.append(probe.note)
            except Exception as e:  # noqa: BLE001 (no g++, a probe the plan cannot reproduce, ...: reported)
                notes.append(f"counters n/a ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        else:
            notes.append("counters not run (--no-counters)")
        blocks = _model.attention_blocks(
            L,
            host,
            hkv=shape.hkv,
            hq=shape.hq,
            d=shape.d,
            dv=shape.dv,
            rot=shape.rot,
            itemsize=itemsize,
            splits=splits,
            causal=True,
            x_reversed=desc.x_reversed,
        )
        lm = _model.model_launch(
            arch,
            facts,
            desc,
            grid=L.grid(shape.hkv, splits),
            threads=L.threads,
            dynamic_smem=L.smem,
            blocks=blocks,
            kv_bytes_per_token=kv_bpt,
            probe=probe,
            latency_ns=arch.latency_ns,
            fits_l2=fits,
            extra_notes=notes,
        )
        out.append(lm)
        last = L
    if splits > 1 and last is not None:
        heads_pb, threads = MERGE_HEADS_PER_BLOCK, MERGE.threads
        facts = _model.kernel_facts(
            MERGE.source, merge_defines(token, "CP_SINKS" in last.defines), MERGE.name, arch.name, use_cache
        )
        desc = _kernels.desc(MERGE.name)
        part = float(splits) * host.queries * shape.hq * (shape.dv + 1) * 4
        in_l2 = part <= (arch.l2_bytes or 0) / 2
        blocks = _model.merge_blocks(
            host.queries, shape.hq, shape.dv, dtypes.np_dtype(token).itemsize, splits, heads_pb
        )
        lm = _model.model_launch(
            arch,
            facts,
            desc,
            grid=(host.queries, -(-shape.hq // heads_pb), 1),
            threads=threads,
            dynamic_smem=0,
            blocks=blocks,
            kv_bytes_per_token=heads_pb * (shape.dv + 1) * 4,
            probe=None,
            latency_ns=arch.l2_latency_ns if in_l2 else arch.latency_ns,
            fits_l2=False,
            kv_in_l2=in_l2,
            extra_notes=[
                f"split partials {_model.fmt_bytes(part)} "
                + ("(L2-resident: read from L2)" if in_l2 else "(read from HBM)")
            ],
        )
        out.append(lm)
    return splits, out


def binding_text(lm: _model.LaunchModel) -> str:
    """The binding bound of a launch, with the others that limited it for
    at least 15% of the time: "HBM 56%, latency 44%"."""
    share = sorted(lm.bound_share.items(), key=lambda kv: -kv[1])
    if not share:
        return lm.binding
    if share[0][1] > 0.85:
        return share[0][0]
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in share if v >= 0.15)


def _attention_row(shape: Shape, arch: _archs.Arch, use_cache: bool, probes: bool) -> Row:
    assert arch.copy_bw is not None and arch.tensor_ceiling is not None, f"{arch.name}: not a modeled arch"
    row = Row(shape, arch.name)
    token = shape.dtype
    kv = shape.kv_dtype or token
    host = _host(shape)
    try:
        row.splits, row.launches = _launch_models(shape, arch, host, token, kv, use_cache=use_cache, probes=probes)
    except (TypeError, ValueError, PagedAttentionError, NotImplementedError, KeyError) as e:
        row.status, row.reason = ("skipped" if shape.kv_dtype else "error"), f"{type(e).__name__}: {e}"
        return row
    except Exception as e:  # noqa: BLE001 (no NVRTC, ...: the row says why, the others still print)
        row.status, row.reason = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    isz = dtypes.np_dtype(shape.dtype).itemsize
    kv_isz = dtypes.row("dtype", kv, kv=True).itemsize
    kv_bpt = _kv_bpt(shape, kv_isz)
    kvl = np.asarray(host.kv_lens, float)
    q = host.queries
    row.must_bytes = (
        float(kvl.sum()) * kv_bpt * (1 if shape.rot else shape.hkv)
        + q * shape.hq * (shape.d + shape.rot + shape.dv) * isz
    )
    row.design_bytes = sum(lm.hbm_bytes for lm in row.launches)
    row.time_s = sum(lm.time_s for lm in row.launches)
    visible = float((np.asarray(host.q_pos) + 1).sum())
    per = shape.d + shape.rot + shape.dv
    row.flops = 2.0 * visible * shape.hq * per
    row.gbps = row.must_bytes / row.time_s / 1e9
    main = max(row.launches, key=lambda lm: lm.time_s)
    row.binding = binding_text(main) + (f" ({main.kernel})" if len(row.launches) > 1 else "")
    if shape.metric == "flops":
        row.tflops = row.flops / row.time_s / 1e12
        row.pct = 100 * row.flops / row.time_s / arch.tensor_ceiling
        row.figure = (
            f"{row.tflops:.0f} TFLOP/s ({row.pct:.0f}% of {arch.tensor_ceiling / 1e12:.0f}); "
            f"{row.gbps:.0f} GB/s ({100 * row.gbps * 1e9 / arch.copy_bw:.0f}% of copy)"
        )
    else:
        row.pct = 100 * row.gbps * 1e9 / arch.copy_bw
        row.figure = f"{row.gbps:.0f} GB/s ({row.pct:.0f}% of copy)"
    for lm in row.launches:
        row.notes += [f"{lm.kernel}: {n}" for n in lm.notes]
        if not lm.launchable:
            row.notes.append(f"{lm.kernel} cannot launch on {arch.name}: {'; '.join(lm.launch_problems)}")
    return row


@functools.lru_cache(maxsize=None)
def _step_ops(batch: int, ctx: int, layers: int, model_cfg: tuple = ()) -> tuple[int, float]:
    """(stream ops of one decode step of the bench_decode model with
    ``layers`` layers at ``batch`` sequences of ``ctx`` tokens, weight bytes
    a step reads), from a capture on the CPU backend (records, runs
    nothing): the model's forward, the argmax and ``advance_plan``, as
    ``PagedDecodeLoop`` captures them."""
    cfg = tiny.TinyConfig(**{**(dict(model_cfg) or DECODE_LOOP_CFG), "layers": layers})
    w = tiny.init_weights(cfg, seed=0)
    like = np.zeros(1, np.float32)
    ps = 16
    per = -(-ctx // ps) + 1
    pages = batch * per
    model = tiny.TinyModel(cfg, w, like, dtype=np.float32, num_pages=pages, page_size=ps, max_rows=batch)
    # the decode step's plan from the model's own cache (its forward appends
    # through it): ctx - 1 tokens taken, then the step's one
    seqs = [model.cache.add_sequence() for _ in range(batch)]
    model.cache.prepare(seqs, ctx - 1)
    plan, _ = model.cache.prepare(seqs, 1)
    tokens = np.zeros(batch, np.int64)
    logits = np.zeros((batch, cfg.vocab), np.float32)
    nxt = np.zeros(batch, np.int64)
    with capture_graph(like) as g:
        model.forward(plan, tokens, logits)
        argmax_into(logits, nxt)
        advance_plan(plan)
    weights = sum(a.nbytes for k, a in model.w.items() if k != "layers") + sum(
        a.nbytes for lw in model.w["layers"] for a in lw.values()
    )
    assert g.graph is not None  # set when the capture ended
    return g.graph.num_ops, float(weights)


def _loop_row(shape: Shape, arch: _archs.Arch, use_cache: bool, probes: bool) -> Row:
    assert arch.copy_bw is not None and arch.launch_us is not None, f"{arch.name}: not a modeled arch"
    row = _attention_row(shape, arch, use_cache, probes)
    if row.status != "ok":
        return row
    att = row.time_s
    try:
        layers = shape.layers
        ops, weights = _step_ops(shape.batch, shape.ctx, layers, shape.model_cfg)
    except Exception as e:  # noqa: BLE001 (reported in the row)
        row.status, row.reason = "error", f"decode-step capture failed: {type(e).__name__}: {e}"
        return row
    floor = arch.launch_us * 1e-6
    others = ops - layers * len(row.launches)
    other_t = max(others * floor, weights / arch.copy_bw)
    step = layers * max(att, floor) + other_t
    row.time_s = step
    row.tokens_per_s = shape.batch / step
    row.must_bytes += weights
    row.design_bytes += weights
    row.binding = "launch" if others * floor >= weights / arch.copy_bw else "HBM (weights)"
    row.figure = (
        f"{step * 1e6:.0f} us/step, {row.tokens_per_s:.0f} tokens/s "
        f"({ops} stream ops/step, {layers} attention launches of {att * 1e6:.1f} us)"
    )
    row.notes.append(
        f"step = {layers} x attention + {others} other ops at >= {arch.launch_us} us each "
        f"(weights {_model.fmt_bytes(weights)} / copy bandwidth = {weights / arch.copy_bw * 1e6:.1f} us)"
    )
    return row


def model_shape(shape: Shape, arch: str = "sm_90", *, use_cache: bool = True, probes: bool = True) -> Row:
    """The modeled row of any shape (the benchmarks model each case they
    measure through this)."""
    a = _archs.get(arch)
    if not a.modeled:
        raise KeyError(f"arch {arch}: no performance assumptions (modeled archs: {', '.join(_archs.MODELED)})")
    return (
        _loop_row(shape, a, use_cache, probes)
        if shape.metric == "step"
        else _attention_row(shape, a, use_cache, probes)
    )


def build_rows(
    arch: str = "sm_90", names: Container[str] | None = None, *, use_cache: bool = True, probes: bool = True
) -> list[Row]:
    return [model_shape(s, arch, use_cache=use_cache, probes=probes) for s in SHAPES if not names or s.name in names]


def arch_for(major: int, minor: int) -> tuple[str, str]:
    """(modeled arch, note) for a device of compute capability major.minor:
    its own row when modeled, else the closest modeled one, said so."""
    own = f"sm_{major}{minor}"
    if own in _archs.MODELED:
        return own, ""
    best = "sm_90" if major >= 9 else "sm_80"
    return best, f"no assumptions for {own}: modeled as {best} ({_archs.get(best).device})"


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _table(head, rows) -> str:
    w = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(head)]
    lines = ["  ".join(str(h).ljust(w[i]) for i, h in enumerate(head)).rstrip(), "  ".join("-" * x for x in w)]
    lines += ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def summary_table(rows: list[Row]) -> str:
    head = ("shape", "modeled time", "modeled figure", "binding (modeled)", "splits", "HBM moved/must (modeled)")
    body: list[tuple] = []
    for r in rows:
        if r.status != "ok":
            body.append((r.shape.name, "-", f"{r.status}: {r.reason}", "-", "-", "-"))
            continue
        ratio = f"{_model.fmt_bytes(r.design_bytes)} / {_model.fmt_bytes(r.must_bytes)}"
        body.append((r.shape.name, f"{r.time_s * 1e6:.1f} us", r.figure, r.binding, r.splits, ratio))
    return _table(head, body)


def launch_table(rows: list[Row]) -> str:
    head = (
        "shape",
        "kernel",
        "grid",
        "thr",
        "regs",
        "spill",
        "smem st+dyn",
        "blk/SM (limit)",
        "waves",
        "tail",
        "in flight/SM vs need",
        "mma/64tok",
        "ldsm/64tok",
        "smem B/64tok",
        "SASS/KV B",
        "bounds us",
        "time us",
    )
    body = []
    for r in rows:
        for lm in r.launches:
            occ = lm.occupancy
            inf = (
                f"{_model.fmt_bytes(lm.in_flight_per_sm)} / {_model.fmt_bytes(lm.little_per_sm)}"
                if lm.in_flight_per_sm is not None
                else f"n/a / {_model.fmt_bytes(lm.little_per_sm)}"
            )
            t = lm.mma_per_tile
            bounds = " ".join(f"{k[:3]}:{v * 1e6:.0f}" for k, v in lm.bounds_s.items())
            body.append(
                (
                    r.shape.name,
                    lm.kernel,
                    "x".join(map(str, lm.grid)),
                    lm.threads,
                    lm.registers,
                    f"{lm.spills[0]}/{lm.spills[1]}",
                    f"{lm.static_smem}+{lm.dynamic_smem}",
                    f"{occ['blocks_per_sm']} ({occ['limited_by'][:4]})",
                    f"{lm.waves:.2f}",
                    f"{100 * lm.tail_share:.0f}%",
                    inf,
                    f"{t['mma']:.0f}" if t else "n/a",
                    f"{t['ldmatrix']:.0f}" if t else "n/a",
                    _model.fmt_bytes(t["smem_bytes"]) if t else "n/a",
                    f"{lm.instr_per_kv_byte:.3f}" if lm.instr_per_kv_byte is not None else "n/a",
                    bounds,
                    f"{lm.time_s * 1e6:.1f}",
                )
            )
    return _table(head, body)


_HOT_COLS = (
    ("fp32", ("fp32",)),
    ("HMMA", ("tensor",)),
    ("int", ("imad", "alu")),
    ("MUFU", ("mufu",)),
    ("SHFL", ("shfl",)),
    ("LDG", ("ldg",)),
    ("LDGSTS", ("ldgsts",)),
    ("LDSM", ("ldsm",)),
    ("LDS/STS", ("lds", "sts")),
    ("other", None),
)


def hot_loop_table(rows: list[Row]) -> str:
    """SASS hot loop of each distinct launched kernel: static size, and the
    modeled warp instructions per 4 KiB of K/V per warp, by class."""
    head = ("kernel", "variant", "hot loop (SASS)", "static instr", "nested loops", "instr/4KiB K/V per warp") + tuple(
        c for c, _ in _HOT_COLS
    )
    body, seen = [], set()
    for r in rows:
        for lm in r.launches:
            h = lm.hot_loop
            if not h or (lm.variant, lm.kernel) in seen:
                continue
            seen.add((lm.variant, lm.kernel))
            per = {k: 4096 * v for k, v in h["classes_per_kv_byte"].items()}
            named: set[str] = set()
            cells = []
            for _, cls in _HOT_COLS:
                if cls is None:
                    cells.append(f"{sum(v for k, v in per.items() if k not in named):.0f}")
                else:
                    named.update(cls)
                    cells.append(f"{sum(per.get(k, 0.0) for k in cls):.0f}")
            body.append(
                (
                    lm.kernel,
                    lm.variant,
                    "-".join(h["offsets"]),
                    h["static_instructions"],
                    h["nested_loops"],
                    f"{4096 * lm.instr_per_kv_byte:.0f}",
                )
                + tuple(cells)
            )
    return _table(head, body)


def assumptions_text(arch: str) -> str:
    a = _archs.get(arch)
    return _table(("figure", "value", "source"), a.assumptions())


def report(rows: list[Row], arch: str, seconds: float) -> str:
    a = _archs.get(arch)
    out = [
        f"cupaged performance model for {arch} ({a.device}); every figure below is MODELED, none is measured. "
        f"{datetime.date.today().isoformat()}, commit {_git_commit()}",
        f"SASS: {_sass.tool_version() if _sass.available() else 'n/a -- ' + _sass.missing_message()}",
        "",
        summary_table(rows),
        "",
        "per launch (modeled):",
        launch_table(rows),
        "",
        "hot loops (SASS; per 4 KiB of K/V a warp loads, modeled from the counters' trip counts):",
        hot_loop_table(rows),
    ]
    notes = [f"  {r.shape.name}: {n}" for r in rows for n in dict.fromkeys(r.notes)]
    if notes:
        out += ["", "notes:"] + notes
    out += [
        "",
        f"bounds: each resource alone (HBM, L2, issue, tensor, smem, latency); time: fluid simulation of the "
        f"grid (cupaged/tools/model.py). Assumptions: python -m cupaged.tools.perf_model --assumptions. "
        f"{seconds:.1f} s",
    ]
    return "\n".join(out)


def markdown(rows: list[Row], arch: str) -> str:
    """The summary as a Markdown table (docs/performance.md)."""
    a = _archs.get(arch)
    out = [
        f"| shape ({arch}, {a.device}) | modeled time | modeled figure | binding (modeled) | splits | launches: "
        f"regs, blocks/SM, waves, tail | HBM moved / must (modeled) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.status != "ok":
            out.append(f"| {r.shape.title} | - | {r.status}: {r.reason} | - | - | - | - |")
            continue
        ls = "; ".join(
            f"{lm.kernel} {lm.registers} regs, {lm.occupancy['blocks_per_sm']}/SM, {lm.waves:.2f} waves, "
            f"tail {100 * lm.tail_share:.0f}%"
            for lm in r.launches
        )
        out.append(
            f"| {r.shape.title} | {r.time_s * 1e6:.1f} us | {r.figure} | {r.binding} | {r.splits} | {ls} | "
            f"{_model.fmt_bytes(r.design_bytes)} / {_model.fmt_bytes(r.must_bytes)} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cupaged.tools.perf_model",
        description="Performance model of the cupaged kernels at the benchmark shapes; "
        "every figure is modeled (no GPU).",
    )
    p.add_argument("--arch", default="sm_90", choices=list(_archs.MODELED))
    p.add_argument("--json", action="store_true", help="print JSON (every row and launch labelled 'modeled')")
    p.add_argument("--shape", action="append", choices=[s.name for s in SHAPES], help="only these shapes")
    p.add_argument("--assumptions", action="store_true", help="print the arch's assumptions and their sources")
    p.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table")
    p.add_argument("--no-cache", action="store_true", help="recompile, disassemble and re-run the CPU probes")
    p.add_argument("--no-counters", action="store_true", help="skip the CPU-backend probes (no tensor/smem bounds)")
    args = p.parse_args(argv)
    if args.assumptions:
        print(assumptions_text(args.arch))
        return 0
    t0 = time.perf_counter()
    rows = build_rows(args.arch, args.shape, use_cache=not args.no_cache, probes=not args.no_counters)
    secs = time.perf_counter() - t0
    if args.markdown:
        print(
            f"Modeled with `python -m cupaged.tools.perf_model --arch {args.arch}` on "
            f"{datetime.date.today().isoformat()}, commit {_git_commit()}; every figure is modeled, none measured.\n"
        )
        print(markdown(rows, args.arch))
    elif args.json:
        print(
            json.dumps(
                {
                    "label": LABEL,
                    "arch": args.arch,
                    "date": datetime.date.today().isoformat(),
                    "commit": _git_commit(),
                    "sass": _sass.available(),
                    "seconds": secs,
                    "assumptions": [
                        dict(zip(("figure", "value", "source"), r)) for r in _archs.get(args.arch).assumptions()
                    ],
                    "rows": [r.as_dict() for r in rows],
                },
                indent=1,
                default=str,
            )
        )
    else:
        if not _sass.available():
            print("warning: " + _sass.missing_message(), file=sys.stderr)
        print(report(rows, args.arch, secs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
