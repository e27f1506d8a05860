"""A performance model built from the real kernels; every figure it prints
is **modeled**, none is measured.

    python -m cupaged.tools.perf_model [--arch sm_90|sm_80] [--json | --markdown] [--shape NAME ...]
        [--assumptions] [--validate] [--no-cache] [--no-counters]

For each benchmark shape (``SHAPES``; the benchmarks in ``benchmarks/``
measure the same cases) it builds the HostPlan the benchmark builds, asks
``choose_splits`` and ``plan_launches`` what runs, compiles each launch's
variant with NVRTC for the arch (cached), reads ptxas (registers, spills,
static shared memory) and the SASS (hot loop, instructions per K/V byte,
what it serializes; needs nvdisasm or cuobjdump, see ``cupaged.tools.sass``),
runs one block of each kernel at a small shape on the CPU backend for the
mma / ldmatrix / cp.async counts, and models the launch
(``cupaged.tools.model``) at both ends of the assumptions' ranges: every
row prints a range (optimistic - pessimistic), quotes the pessimistic end,
and names what would move it (the assumptions whose optimistic end alone
shortens the quoted time most).

Assumptions (bandwidths, latencies, rates; each a range with its source)
are in ``cupaged.tools.archs`` and docs/performance.md; ``--assumptions``
prints them. ``--validate`` models a vectorized copy and an mma.sync loop
against the rates they should reproduce (docs/performance.md, "Validation").

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
from .._runtime import stream as _stream
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
    """One shape's modeled figures. ``time_s`` and the figures are the
    pessimistic end of the assumptions' ranges (the one quoted); ``opt``
    holds the optimistic end's; ``moves``: the assumptions that would move
    the quoted time most, each with the time's relative change when that one
    alone goes to its optimistic end."""

    shape: Shape
    arch: str
    status: str = "ok"  # "ok", "skipped", "error"
    reason: str = ""
    splits: int = 1
    launches: list = field(default_factory=list)  # LaunchModel, pessimistic end
    launches_opt: list = field(default_factory=list)  # LaunchModel, optimistic end
    time_s: float = 0.0
    must_bytes: float = 0.0
    design_bytes: float = 0.0
    flops: float = 0.0
    figure: str = ""  # the headline modeled figure, with its range
    pct: float | None = None  # % of copy bandwidth (bytes) or of the tensor ceiling (flops)
    gbps: float | None = None
    tflops: float | None = None
    tokens_per_s: float | None = None
    binding: str = ""
    opt: dict = field(default_factory=dict)  # time_s, pct, gbps, tflops, tokens_per_s, binding at the optimistic end
    moves: list = field(default_factory=list)  # [(figure name, relative change of the time)]
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
            "quoted_end": "pessimistic",
            "optimistic": {
                ("time_us" if k == "time_s" else k): (v * 1e6 if k == "time_s" else v) for k, v in self.opt.items()
            },
            "moves": [{"figure": f, "time_change": c} for f, c in self.moves],
            "notes": self.notes,
            "launches": [lm.as_dict() for lm in self.launches],
            "launches_optimistic": [lm.as_dict() for lm in self.launches_opt],
        }


def _kv_bpt(shape: Shape, itemsize: int) -> int:
    """K/V bytes per token of one KV head (latent + rotary for MLA)."""
    return (shape.d + shape.rot) * itemsize if shape.rot else (shape.d + shape.dv) * itemsize


def _run_bytes(shape: Shape, itemsize: int, pack: int = 1) -> int:
    """Contiguous bytes of one K (or latent) run in the cache that a block
    reads at once: a token's rows of the ``pack`` KV heads it serves (NHD:
    one after another), or with one KV head, the page's rows one after
    another."""
    row = shape.d * itemsize
    return row * shape.page if shape.hkv == 1 else row * pack


@dataclass
class LaunchInput:
    """What ``model_launch`` needs for one launch, computed once per shape
    (compiles, SASS, probes) and modeled at each end of the ranges."""

    facts: _model.KernelFacts
    desc: _kernels.KernelDesc
    kw: dict


def _launch_inputs(
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
    """Inputs of the launches of ``shape`` (q / out dtype ``token``, caches
    ``kv``: ``token`` itself, or an fp8 format)."""
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
        kw = dict(
            grid=L.grid(shape.hkv, splits),
            threads=L.threads,
            dynamic_smem=L.smem,
            blocks=blocks,
            kv_bytes_per_token=kv_bpt,
            probe=probe,
            fits_l2=fits,
            run_bytes=_run_bytes(shape, itemsize, L.pack),
            extra_notes=notes,
        )
        out.append(LaunchInput(facts, desc, kw))
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
        kw = dict(
            grid=(host.queries, -(-shape.hq // heads_pb), 1),
            threads=threads,
            dynamic_smem=0,
            blocks=blocks,
            kv_bytes_per_token=heads_pb * (shape.dv + 1) * 4,
            probe=None,
            latency="l2" if in_l2 else "dram",
            fits_l2=False,
            kv_in_l2=in_l2,
            extra_notes=[
                f"split partials {_model.fmt_bytes(part)} "
                + ("(L2-resident: read from L2)" if in_l2 else "(read from HBM)")
            ],
            dependent=_stream.dependent_launches(),  # the merge's launch: dependent with CUPAGED_PDL=1
        )
        out.append(LaunchInput(facts, desc, kw))
    return splits, out


def _models(inputs: list, arch: _archs.Arch, end: str = "pess", flip: tuple = (), quantum: float = 1e-3) -> list:
    return [_model.model_launch(arch, li.facts, li.desc, end=end, flip=flip, quantum=quantum, **li.kw) for li in inputs]


#: The coarser simulation the sensitivities run (``model.simulate``'s quantum): relative changes against a
#: baseline run the same way, to about a percent.
SENSITIVITY_QUANTUM = 2e-2


def binding_text(lm: _model.LaunchModel) -> str:
    """The binding bound of a launch, with the others that limited it for
    at least 15% of the time: "HBM 56%, chain 44%"."""
    share = sorted(lm.bound_share.items(), key=lambda kv: -kv[1])
    if not share:
        return lm.binding
    if share[0][1] > 0.85:
        return share[0][0]
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in share if v >= 0.15)


#: The resources each figure feeds (``model.simulate``'s names): relaxing a resource that never limited a block
#: cannot shorten a launch, so a figure feeding none that did is not simulated.
FEEDS = {
    "clock_ghz": ("issue", "pipe", "smem", "chain"),
    "latency_ns": ("chain", "startup"),
    "l2_latency_ns": ("chain", "startup"),
    "dep_load_ns": ("chain",),
    "l2_bw": ("L2",),
    "dram_eff_long": ("HBM",),
    "dram_eff_256": ("HBM",),
    "mma_sync_flops": ("tensor", "chain"),
    "wgmma_flops": ("tensor", "chain"),
    "warp_ipc": ("issue", "chain"),
    "sched_ipc": ("issue", "chain"),
    "bar_clk": ("chain",),
    "launch_us": ("launch",),
}


def _sensitivity(inputs: list, arch: _archs.Arch, launches: list) -> list:
    """[(figure name, relative change of the quoted time)] for the figures
    whose optimistic end alone shortens it by at least 1%, largest first
    (coarser simulations: ``SENSITIVITY_QUANTUM``; only figures feeding a
    resource that limited some launch of ``launches``, the pessimistic
    models, for at least half a percent of its time)."""
    bound = {k for lm in launches for k, v in lm.bound_share.items() if v >= 0.005}
    q = SENSITIVITY_QUANTUM
    t_pess = sum(lm.time_s for lm in _models(inputs, arch, "pess", quantum=q))
    out = []
    for name, fig in arch.figures.items():
        if fig.exact or not bound & set(FEEDS.get(name, bound)):
            continue
        t = sum(lm.time_s for lm in _models(inputs, arch, "pess", (name,), quantum=q))
        rel = t / t_pess - 1.0 if t_pess > 0 else 0.0
        if rel <= -0.01:
            out.append((_archs.FIGURE_NAMES.get(name, name), rel))
    return sorted(out, key=lambda x: x[1])


def _rng(opt: float, pess: float, fmt: str = "{:.0f}") -> str:
    a, b = fmt.format(opt), fmt.format(pess)
    return a if a == b else f"{a} - {b}"


def _attention_row(shape: Shape, arch: _archs.Arch, use_cache: bool, probes: bool, sensitivity: bool = True) -> Row:
    assert arch.copy_bw is not None and arch.tensor_ceiling is not None, f"{arch.name}: not a modeled arch"
    row = Row(shape, arch.name)
    token = shape.dtype
    kv = shape.kv_dtype or token
    host = _host(shape)
    try:
        row.splits, inputs = _launch_inputs(shape, arch, host, token, kv, use_cache=use_cache, probes=probes)
        row.launches = _models(inputs, arch, "pess")
        row.launches_opt = _models(inputs, arch, "opt")
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
    t_opt = sum(lm.time_s for lm in row.launches_opt)
    visible = float((np.asarray(host.q_pos) + 1).sum())
    per = shape.d + shape.rot + shape.dv
    row.flops = 2.0 * visible * shape.hq * per
    row.gbps = row.must_bytes / row.time_s / 1e9
    main = max(row.launches, key=lambda lm: lm.time_s)
    main_opt = max(row.launches_opt, key=lambda lm: lm.time_s)
    tag = f" ({main.kernel})" if len(row.launches) > 1 else ""
    row.binding = binding_text(main) + tag
    row.opt = {"time_s": t_opt, "gbps": row.must_bytes / t_opt / 1e9, "binding": binding_text(main_opt) + tag}
    copy_pct = 100 * row.gbps * 1e9 / arch.copy_bw
    copy_pct_opt = 100 * row.opt["gbps"] * 1e9 / arch.copy_bw
    if shape.metric == "flops":
        row.tflops = row.flops / row.time_s / 1e12
        row.pct = 100 * row.tflops * 1e12 / arch.tensor_ceiling
        row.opt["tflops"] = row.flops / t_opt / 1e12
        row.opt["pct"] = 100 * row.opt["tflops"] * 1e12 / arch.tensor_ceiling
        row.figure = (
            f"{row.tflops:.0f} TFLOP/s (range {_rng(row.opt['tflops'], row.tflops)}; {row.pct:.0f}% of "
            f"{arch.tensor_ceiling / 1e12:.0f}); {row.gbps:.0f} GB/s ({copy_pct:.0f}% of copy)"
        )
    else:
        row.pct = copy_pct
        row.opt["pct"] = copy_pct_opt
        row.figure = f"{row.gbps:.0f} GB/s, {row.pct:.0f}% of copy (range {_rng(copy_pct_opt, copy_pct)}%)"
    if sensitivity:
        row.moves = _sensitivity(inputs, arch, row.launches)
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
    assert arch.copy_bw is not None and arch.modeled, f"{arch.name}: not a modeled arch"
    row = _attention_row(shape, arch, use_cache, probes, sensitivity=False)
    if row.status != "ok":
        return row
    att, att_opt = row.time_s, row.opt["time_s"]
    try:
        layers = shape.layers
        ops, weights = _step_ops(shape.batch, shape.ctx, layers, shape.model_cfg)
    except Exception as e:  # noqa: BLE001 (reported in the row)
        row.status, row.reason = "error", f"decode-step capture failed: {type(e).__name__}: {e}"
        return row
    others = ops - layers * len(row.launches)
    floors = {end: arch.figures["launch_us"].at(end) * 1e-6 for end in ("opt", "pess")}

    copy_bw = arch.copy_bw

    def step(a: float, floor: float) -> float:
        return layers * max(a, floor) + max(others * floor, weights / copy_bw)

    t, t_opt = step(att, floors["pess"]), step(att_opt, floors["opt"])
    row.time_s = t
    row.tokens_per_s = shape.batch / t
    row.opt = {"time_s": t_opt, "tokens_per_s": shape.batch / t_opt, "binding": "launch"}
    row.must_bytes += weights
    row.design_bytes += weights
    row.binding = "launch" if others * floors["pess"] >= weights / arch.copy_bw else "HBM (weights)"
    rel = step(att, floors["opt"]) / t - 1.0
    row.moves = [(_archs.FIGURE_NAMES["launch_us"], rel)] if rel <= -0.01 else []
    row.figure = (
        f"{t * 1e6:.0f} us/step (range {_rng(t_opt * 1e6, t * 1e6)}), {row.tokens_per_s:.0f} tokens/s "
        f"({ops} stream ops/step, {layers} attention launches of {att * 1e6:.1f} us)"
    )
    row.notes.append(
        f"step = {layers} x attention + {others} other ops at >= {floors['opt'] * 1e6:.0f} - "
        f"{floors['pess'] * 1e6:.0f} us each (weights {_model.fmt_bytes(weights)} / copy bandwidth = "
        f"{weights / arch.copy_bw * 1e6:.1f} us)"
    )
    return row


def model_shape(
    shape: Shape, arch: str = "sm_90", *, use_cache: bool = True, probes: bool = True, sensitivity: bool = False
) -> Row:
    """The modeled row of any shape (the benchmarks model each case they
    measure through this); ``sensitivity``: also find what would move the
    quoted figure (``Row.moves``: a dozen more simulations)."""
    a = _archs.get(arch)
    if not a.modeled:
        raise KeyError(f"arch {arch}: no performance assumptions (modeled archs: {', '.join(_archs.MODELED)})")
    return (
        _loop_row(shape, a, use_cache, probes)
        if shape.metric == "step"
        else _attention_row(shape, a, use_cache, probes, sensitivity)
    )


def build_rows(
    arch: str = "sm_90", names: Container[str] | None = None, *, use_cache: bool = True, probes: bool = True
) -> list[Row]:
    """The rows of ``SHAPES`` (or those ``names``), what would move each included."""
    return [
        model_shape(s, arch, use_cache=use_cache, probes=probes, sensitivity=True)
        for s in SHAPES
        if not names or s.name in names
    ]


def moves_text(r: Row, top: int = 2) -> str:
    """The assumptions that would move a row's quoted figure most: "DRAM
    efficiency, 256-byte rows -10%; loaded DRAM latency -4%" (the time's
    change with that one at its optimistic end)."""
    if not r.moves:
        return "no single assumption moves it by 1%"
    return "; ".join(f"{name} {100 * rel:+.0f}%" for name, rel in r.moves[:top])


def arch_for(major: int, minor: int) -> tuple[str, str]:
    """(modeled arch, note) for a device of compute capability major.minor:
    its own row when modeled, else the closest modeled one, said so."""
    own = f"sm_{major}{minor}"
    if own in _archs.MODELED:
        return own, ""
    best = "sm_90" if major >= 9 else "sm_80"
    return best, f"no assumptions for {own}: modeled as {best} ({_archs.get(best).device})"


# ---------------------------------------------------------------------------
# Validation: the model's primitives on kernels whose speed is known
# ---------------------------------------------------------------------------

#: A vectorized copy: each thread moves four 16-byte elements per iteration of a grid-stride loop
#: (LDG.E.128 / STG.E.128), as a device-to-device copy does.
COPY_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256) copy16(const int4* __restrict__ src, int4* __restrict__ dst,
                                                         unsigned long long n) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}
"""

#: An mma.sync loop: per iteration each warp loads one 16-byte element per lane and issues 32 independent
#: m16n8k16 bf16 products into 8 accumulators (the shape of a microbenchmark of the instruction's rate).
MMA_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256) mma_loop(const int4* __restrict__ src, float* __restrict__ out,
                                                           int iters) {
  unsigned a0 = threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 ^ 1u, b1 = a0 ^ 2u;
  float acc[8][4] = {};
  const int4* p = src + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int it = 0; it < iters; ++it) {
    int4 v = p[(size_t)it * gridDim.x * blockDim.x];
    a0 ^= (unsigned)v.x;
    a1 ^= (unsigned)v.z;
    b0 ^= (unsigned)v.y;
    b1 ^= (unsigned)v.w;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(acc[k][0]), "+f"(acc[k][1]), "+f"(acc[k][2]), "+f"(acc[k][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += acc[k][0] + acc[k][1] + acc[k][2] + acc[k][3];
  out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


@dataclass
class Check:
    """One validation case: what the model gives (both ends) beside the
    published (or derived) figure it should reproduce."""

    name: str
    what: str
    modeled_opt: float
    modeled_pess: float
    unit: str
    reference: str  # the figure and its source
    expect_lo: float  # the modeled pessimistic end should fall in [expect_lo, expect_hi]
    expect_hi: float
    kind: str  # "consistency" (the reference is one of the model's inputs) or "independent"
    binding: str = ""

    @property
    def ok(self) -> bool:
        return self.expect_lo <= self.modeled_pess <= self.expect_hi and self.modeled_pess <= self.modeled_opt * 1.0001


def _model_text(
    arch: _archs.Arch,
    text: str,
    kernel: str,
    threads: int,
    grid: int,
    tokens: float,
    bpt: float,
    out_bytes: float,
    use_cache: bool,
) -> list:
    """Both ends (optimistic, pessimistic) of a kernel of ``text`` whose
    blocks each visit ``tokens`` "tokens" of ``bpt`` bytes (the hot loop's
    loads) and write ``out_bytes``."""
    facts = _model.text_facts(text, kernel, arch.name, kernel, use_cache)
    if not facts.compiled or facts.hot is None:
        raise RuntimeError(f"{kernel}: {facts.sass_note or 'no hot loop'}")
    blocks = [_model.Block([(("v", b), tokens)], int(tokens), 0, 0, int(out_bytes)) for b in range(grid)]
    desc = _kernels.KernelDesc(role="validation", loads="ldg")
    return [
        _model.model_launch(
            arch,
            facts,
            desc,
            grid=(grid, 1, 1),
            threads=threads,
            dynamic_smem=0,
            blocks=blocks,
            kv_bytes_per_token=bpt,
            probe=None,
            fits_l2=False,
            end=end,
        )
        for end in ("opt", "pess")
    ]


def validate(arch: str = "sm_90", use_cache: bool = True) -> list[Check]:
    """The model's primitives on a vectorized copy and an mma.sync loop
    (NVRTC + SASS, no counters), beside the figures they should reproduce.
    Both are consistency checks: the copy bandwidth and the mma.sync rate
    are inputs of the model, so what these show is that its composition
    (in flight vs Little's law, issue, tail, serial chain) costs nothing a
    kernel that only copies, or only multiplies, does not pay."""
    a = _archs.get(arch)
    assert a.copy_bw is not None, f"{arch}: not a modeled arch"
    out = []
    # 1 GiB copied (read + written): 2^26 int4 elements over 8 blocks of 256 threads per SM
    n = 1 << 26
    grid = 8 * a.sms
    tokens = n / (grid * 256)  # one "token": one element per thread of a block
    lo, hi = _model_text(a, COPY_KERNEL, "copy16", 256, grid, tokens, 16 * 256, tokens * 16 * 256, use_cache)
    moved = 2.0 * n * 16
    eff = a.figures["dram_eff_long"]
    out.append(
        Check(
            "copy",
            f"vectorized copy, 1 GiB, {hi.blocks_per_sm:.0f} x 256 threads per SM, 4 x 16 B in flight per thread",
            moved / lo.time_s / 1e12,
            moved / hi.time_s / 1e12,
            "TB/s",
            f"{a.copy_bw / 1e12:.1f} TB/s device-to-device copy ({a.sources.get('copy', '')}), times the "
            f"DRAM efficiency of long runs ({eff.opt:.2f} - {eff.pess:.2f})",
            0.97 * eff.pess * a.copy_bw / 1e12,
            1.0001 * eff.pess * a.copy_bw / 1e12,
            "consistency",
            binding_text(hi),
        )
    )
    # mma.sync loop: 4096 iterations of 32 m16n8k16 per warp, 8 blocks of 8 warps per SM
    iters = 4096
    lo, hi = _model_text(a, MMA_KERNEL, "mma_loop", 256, grid, iters, 16 * 256, 4 * 256, use_cache)
    flop = float(grid) * 8 * iters * 32 * _counters.MMA_FLOP
    mma = a.figures["mma_sync_flops"]
    out.append(
        Check(
            "mma.sync loop",
            f"32 independent mma.sync m16n8k16 bf16 per warp and iteration, {8 * hi.blocks_per_sm:.0f} warps per SM",
            flop / lo.time_s / 1e12,
            flop / hi.time_s / 1e12,
            "TFLOP/s",
            f"the mma.sync rate the model takes, {mma.opt / 1e12:.0f} - {mma.pess / 1e12:.0f} TFLOP/s "
            f"({mma.source.split(';')[0]})",
            0.97 * mma.pess / 1e12,
            1.0001 * mma.pess / 1e12,
            "consistency",
            binding_text(hi),
        )
    )
    return out


def validation_text(checks: list[Check]) -> str:
    head = ("case", "kernel", "modeled (optimistic - pessimistic)", "binding", "should reproduce", "kind", "ok")
    body = [
        (
            c.name,
            c.what,
            f"{_rng(c.modeled_opt, c.modeled_pess, '{:.2f}')} {c.unit}",
            c.binding,
            c.reference,
            c.kind,
            "yes" if c.ok else "NO",
        )
        for c in checks
    ]
    return _table(head, body)


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
    head = (
        "shape",
        "modeled time (optimistic - pessimistic)",
        "modeled figure (pessimistic; range)",
        "binding (modeled)",
        "what would move it (time)",
        "splits",
        "HBM moved/must (modeled)",
    )
    body: list[tuple] = []
    for r in rows:
        if r.status != "ok":
            body.append((r.shape.name, "-", f"{r.status}: {r.reason}", "-", "-", "-", "-"))
            continue
        ratio = f"{_model.fmt_bytes(r.design_bytes)} / {_model.fmt_bytes(r.must_bytes)}"
        t = f"{_rng(r.opt['time_s'] * 1e6, r.time_s * 1e6, '{:.1f}')} us"
        body.append((r.shape.name, t, r.figure, r.binding, moves_text(r), r.splits, ratio))
    return _table(head, body)


def _iteration_text(lm: _model.LaunchModel) -> str:
    """One hot-loop iteration of one warp: "1159 = issue 759 + dep 400" (and
    the memory wait when the ring does not cover the latency)."""
    it = lm.iteration
    if not it:
        return "n/a"
    parts = [
        (k, it.get(k, 0.0))
        for k in ("issue", "tensor", "barriers", "dependent loads", "turn wait", "ping-pong wait", "memory wait")
        if it.get(k, 0.0) >= 0.5e-9
    ]
    short = {
        "dependent loads": "dep",
        "barriers": "bar",
        "turn wait": "turn",
        "ping-pong wait": "pp",
        "memory wait": "mem",
    }
    return f"{it['iteration'] * 1e9:.0f} = " + " + ".join(f"{short.get(k, k)} {v * 1e9:.0f}" for k, v in parts)


def launch_table(rows: list[Row]) -> str:
    head = (
        "shape",
        "kernel",
        "grid",
        "thr",
        "regs",
        "spill",
        "smem st+dyn",
        "blk/SM placed/limit",
        "waves",
        "tail",
        "in flight/SM vs need",
        "mma/64tok",
        "ldsm/64tok",
        "smem B/64tok",
        "SASS/KV B",
        "tile of one warp, ns (what it serializes)",
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
                    f"{lm.blocks_per_sm:.1f}/{occ['blocks_per_sm']} ({occ['limited_by'][:4]})",
                    f"{lm.waves:.2f}",
                    f"{100 * lm.tail_share:.0f}%",
                    inf,
                    f"{t['mma']:.0f}" if t else "n/a",
                    f"{t['ldmatrix']:.0f}" if t else "n/a",
                    _model.fmt_bytes(t["smem_bytes"]) if t else "n/a",
                    f"{lm.instr_per_kv_byte:.3f}" if lm.instr_per_kv_byte is not None else "n/a",
                    _iteration_text(lm),
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
        "per launch: the pessimistic end of the assumptions' ranges (the quoted one). bounds: each resource "
        "alone (HBM, L2, issue, pipe, tensor, smem, chain: what one block serializes, startup: its dependent "
        "round trips before the first tile); time: fluid simulation of the grid (cupaged/tools/model.py). "
        f"Assumptions and their sources: python -m cupaged.tools.perf_model --assumptions. {seconds:.1f} s",
    ]
    return "\n".join(out)


#: What a row's figure says when the SASS tools are missing (the bounds that read SASS are left out).
NO_SASS = "no SASS (issue and latency bounds left out: optimistic)"


def markdown(rows: list[Row], arch: str, sass: bool = True) -> str:
    """The summary as a Markdown table (docs/performance.md): every figure
    modeled, the pessimistic end quoted, with its range and what would
    move it. ``sass`` False (no nvdisasm / cuobjdump): every figure says
    ``NO_SASS``, since the rows then lack the bounds read from SASS."""
    a = _archs.get(arch)
    out = [
        f"| shape ({arch}, {a.device}) | modeled time (optimistic - pessimistic) | modeled figure (pessimistic; "
        f"range) | binding (modeled, pessimistic) | what would move it (time) | splits | launches: regs, "
        f"blocks/SM placed (limit), waves, tail | HBM moved / must (modeled) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.status != "ok":
            out.append(f"| {r.shape.title} | - | {r.status}: {r.reason} | - | - | - | - | - |")
            continue
        ls = "; ".join(
            f"{lm.kernel} {lm.registers} regs, {lm.blocks_per_sm:.1f} ({lm.occupancy['blocks_per_sm']})/SM, "
            f"{lm.waves:.2f} waves, tail {100 * lm.tail_share:.0f}%"
            for lm in r.launches
        )
        t = f"{_rng(r.opt['time_s'] * 1e6, r.time_s * 1e6, '{:.1f}')} us"
        fig = r.figure if sass else f"{NO_SASS}: {r.figure}"
        out.append(
            f"| {r.shape.title} | {t} | {fig} | {r.binding} | {moves_text(r)} | {r.splits} | {ls} | "
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
    p.add_argument(
        "--validate", action="store_true", help="model a vectorized copy and an mma.sync loop against known rates"
    )
    args = p.parse_args(argv)
    if args.assumptions:
        print(assumptions_text(args.arch))
        return 0
    if args.validate:
        print(validation_text(validate(args.arch, use_cache=not args.no_cache)))
        return 0
    t0 = time.perf_counter()
    rows = build_rows(args.arch, args.shape, use_cache=not args.no_cache, probes=not args.no_counters)
    secs = time.perf_counter() - t0
    if args.markdown:
        sass = _sass.available()
        if not sass:
            print("warning: " + _sass.missing_message(), file=sys.stderr)
        print(
            f"Modeled with `python -m cupaged.tools.perf_model --arch {args.arch}` on "
            f"{datetime.date.today().isoformat()}, commit {_git_commit()}; every figure is modeled, none measured."
            + (
                ""
                if sass
                else " **Without SASS (nvdisasm / cuobjdump not found) the issue and latency bounds are left out: "
                "every row below is optimistic; pip install -e '.[perf]' before quoting it.**"
            )
            + "\n"
        )
        print(markdown(rows, args.arch, sass))
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
