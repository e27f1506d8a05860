"""The performance model of one launch: compile facts (NVRTC, ptxas, SASS),
per-token work (SASS hot loop + CPU counters), per-block demands, and a
fluid simulation of the grid on the SMs, at one end of the assumptions'
ranges (``archs.Arch.point``: "opt" or "pess", the one quoted).

Everything here is **modeled**; nothing is measured on a GPU.

Per block, from the launch and the shape:

* K/V tokens it visits (its queries' visible positions inside its split,
  the farthest query of each sequence in the block), the bytes those are
  (``kv_bytes_per_token``: K and V rows of one KV head, or latent + rotary
  rows for MLA), the query rows it reads and the output (or FP32 split
  partial) rows it writes;
* HBM bytes: a K/V range another resident block of the same (sequence,
  KV head, split) already pulled comes from L2 (or anything already read,
  when the launch's K/V fits in half the L2); the rest from HBM, at the
  copy bandwidth times the DRAM efficiency of the access pattern (rows of
  ``run_bytes`` contiguous bytes);
* shared SM resources: issue (warp instructions of the hot loop per token,
  nested loops' trip counts solved from the counters and the bytes, see
  ``solve_rates``, plus the block's prologue and epilogue once; an SM
  issues ``Point.issue_per_clk(warps)``: each scheduler at most its
  achieved IPC, each warp at most its own), per-pipe rates (conversions
  16 / clk), tensor (mma.sync FLOP at the mma.sync rate, of which fewer
  than 4 warps get their sub-partitions' share; wgmma FLOP at the wgmma
  rate; from the counters, or the SASS without them), shared memory
  (ldmatrix / cp.async / wgmma operand bytes + LDS / STS);
* its chain, what one block serializes (``iteration_parts``): per hot-loop
  iteration the SASS segments (issue up to an HGMMA group, then the longer
  of the issue after it and the tensor time its ``WARPGROUP.DEPBAR``
  waits for), block barriers and the dependent word loads, all added;
  with a cp.async ring (from the SASS wait: ``HotLoop.latency_time``) an
  iteration takes the longer of that and latency / (N + 1), N + 1 tiles in
  flight during the wait, or (latency + that) / (N + 1) when the loop
  issues its next copies before the wait (they wait for the work after
  it); without one (loads used where issued) latency + that;
* its startup: the dependent round trips before its first tile is in hand
  (``HotLoop.startup_levels`` x the latency), during which it holds its
  slot and does nothing else.

The simulation dispatches blocks in launch order onto ``occupancy`` slots
per SM (round robin at first, then into the slot that frees). A block
waits out its startup, then progresses at the rate of its tightest
resource: the SM's issue, pipe, tensor and shared-memory capacity shared
equally by the working blocks on that SM, its own chain, and HBM and L2
bandwidth shared max-min fairly by all working blocks. What is in flight
together (blocks, warps, the ring's copies) overlaps; what one block
serializes adds. The modeled time is when the last block ends (at least
the per-launch floor); the binding bound is the resource that limited the
blocks for most of that time; the tail is the last partial wave's share of
it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .._runtime import nvrtc as _nvrtc
from .._runtime import source as _source
from ..ops.attention.schedule import Launch
from ..plan import HostPlan
from . import archs as _archs
from . import counters as _counters
from . import kernels as _kernels
from . import occupancy as _occupancy
from . import sass as _sass

CACHE_VERSION = "perf-v2"
RESOURCES = ("HBM", "L2", "issue", "pipe", "tensor", "smem", "chain", "startup")


def cache_dir() -> Path:
    """``$CUPAGED_CACHE_DIR/perf``, else ``$XDG_CACHE_HOME/cupaged/perf``,
    else ``~/.cache/cupaged/perf`` (cubins, SASS profiles, counter probes)."""
    return _counters._cache_dir()


def _write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        pass


# ---------------------------------------------------------------------------
# Compile facts
# ---------------------------------------------------------------------------


@dataclass
class KernelFacts:
    """What the NVRTC compile of one variant says about one kernel on one arch."""

    kernel: str
    variant: str
    arch: str
    compiled: bool
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0
    hot: _sass.HotLoop | None = None
    sass_note: str = ""
    log: str = field(default="", repr=False)


def compile_cached(text: str, arch: str, use_cache: bool = True) -> tuple[bool, str, bytes]:
    """(ok, ptxas log, cubin) of an NVRTC compile with the gate's options,
    cached on disk by the text, options, NVRTC version and header folder."""
    inc = _nvrtc.find_header_dir()
    opts = _nvrtc.gate_options(arch, inc)
    key = _source.digest(text, "\0".join(opts), repr(_nvrtc.nvrtc_version()), f"{inc}", CACHE_VERSION)
    meta, binp = cache_dir() / f"nvrtc-{key}.json", cache_dir() / f"nvrtc-{key}.cubin"
    if use_cache:
        try:
            m = json.loads(meta.read_text())
            return m["ok"], m["log"], binp.read_bytes() if m["ok"] else b""
        except (OSError, ValueError, KeyError):
            pass
    c = _nvrtc.compile_source(text, arch, options=opts)
    _write(binp, c.cubin)
    _write(meta, json.dumps({"ok": c.ok, "log": c.log}).encode())
    return c.ok, c.log, c.cubin


@functools.lru_cache(maxsize=None)
def _sass_code() -> str:
    """Digest of the SASS reader, so a change to it invalidates cached loops."""
    return _source.digest(Path(_sass.__file__).read_bytes())


def kernel_facts(source: str, defines: dict, kernel: str, arch: str, use_cache: bool = True) -> KernelFacts:
    """``text_facts`` of a kernel source of ``kernels_cu/`` with ``defines``."""
    text = _source.assemble(source, defines)
    variant = _source.variant_name(_source.stem_of(source), defines)
    return text_facts(text, kernel, arch, variant, use_cache)


def text_facts(text: str, kernel: str, arch: str, variant: str = "", use_cache: bool = True) -> KernelFacts:
    """Compile facts of ``kernel`` in the CUDA source ``text`` on ``arch``:
    ptxas registers, spills and static shared memory, and the SASS hot loop
    (cached on disk)."""
    ok, log, cubin = compile_cached(text, arch, use_cache)
    f = KernelFacts(kernel, variant, arch, ok, log=log)
    if not ok:
        f.sass_note = "compile error"
        return f
    rep = _nvrtc.parse_ptxas(log).get(kernel)
    if rep is not None:
        f.registers, f.spill_stores, f.spill_loads, f.static_smem = (
            rep.registers,
            rep.spill_stores,
            rep.spill_loads,
            rep.smem,
        )
    if not _sass.available():
        f.sass_note = "SASS n/a: " + _sass.missing_message()
        return f
    key = _source.digest(cubin, kernel, CACHE_VERSION, "sass", _sass_code())
    path = cache_dir() / f"sass-{key}.json"
    if use_cache:
        try:
            d = json.loads(path.read_text())
            f.hot = _sass.HotLoop.from_dict(d) if d else None
            f.sass_note = "" if d else "no loop with global loads in the SASS"
            return f
        except (OSError, ValueError, KeyError, TypeError):
            pass
    try:
        fns = _sass.parse(_sass.disassemble(cubin))
    except Exception as e:  # noqa: BLE001 (a tool failure is reported, not fatal)
        f.sass_note = f"SASS n/a: {e}"
        return f
    fn = fns.get(kernel)
    f.hot = _sass.hot_loop(fn) if fn is not None else None
    if f.hot is None:
        f.sass_note = "no loop with global loads in the SASS"
    _write(path, json.dumps(f.hot.as_dict() if f.hot else {}).encode())
    return f


# ---------------------------------------------------------------------------
# Per-token work of the hot loop
# ---------------------------------------------------------------------------


@dataclass
class Rates:
    """Dynamic work per K/V token per warp, from the hot loop's regions
    executed ``y[j]`` times per token (``y[0]``: hot-loop iterations)."""

    y: list
    instr: float  # warp instructions per token per warp
    classes: dict  # per class
    smem_bytes: float  # LDS / STS bytes per token per warp
    iter_bytes: float  # K/V bytes per hot-loop iteration per warp
    iter_instr: float  # warp instructions per hot-loop iteration per warp
    residual: float = 0.0  # relative misfit of the solve
    note: str = ""


def solve_rates(
    hot: _sass.HotLoop,
    bytes_per_token: float,
    mma_per_token: float | None,
    ldsm_per_token: float | None,
    cold_per_token: float | None = None,
    trips: float | None = None,
    edge_per_token: float | None = None,
) -> Rates:
    """Executions per token (per warp) of each region of the hot loop.

    Unknowns: ``y[j]`` for the hot loop's own region and each nested loop
    that holds a counted instruction (16-byte loads, HMMA / HGMMA, LDSM, the
    path markers PMTRIG); a nested loop with none runs once per
    iteration of its parent. Equations, per token per warp: K/V bytes
    loaded = ``bytes_per_token``; HMMA = the counters' mma (and wgmma);
    LDSM = the counters' ldmatrix; PMTRIG 0x80 = the counters' cold-path
    marks (``ptx::cold_path``: rare paths, never run by the probe); PMTRIG
    0x40 = the counters' per-token edge-tile marks (``ptx::edge_tile``: the
    tiles some row sees only part of, a number per block rather than per
    token: ``model_launch`` charges the counters' intercept per block);
    ``trips``: the loop's own iterations per token where nothing else tells
    (a consumer loop without counters: its producer's). Least squares;
    when the equations cannot tell two unknowns apart, the deeper one runs
    once per parent iteration."""
    R = hot.regions
    use_wide = any(r.wide_load_bytes for r in R)
    load = [r.wide_load_bytes if use_wide else r.global_load_bytes for r in R]
    # a loop that loads nothing (a warp-specialized kernel's consumers): its trip counts from the others
    eqs = [(load, bytes_per_token)] if any(load) else []
    if trips is not None and not eqs and (mma_per_token is None or not any(r.hmma for r in R)):
        eqs.append(([1.0] + [0.0] * (len(R) - 1), trips))
    if mma_per_token is not None and any(r.hmma for r in R):
        eqs.append(([r.hmma for r in R], mma_per_token))
    if ldsm_per_token is not None and any(r.ldsm for r in R):
        eqs.append(([r.ldsm for r in R], ldsm_per_token))
    # Marked paths (cold, edge tiles) the probe never ran per token (no mark counted): their regions, and
    # the loops nested in them, run 0 times per token (non-negative trip counts summing to 0); otherwise the
    # marks are one more equation.
    cold = set()
    marked = [(cold_per_token, [r.pmtrig for r in R]), (edge_per_token, [r.edges for r in R])]
    for per_tok, marks in marked:
        if per_tok is not None and per_tok <= 0:
            cold |= {j for j in range(len(R)) if marks[j] and j != 0}
        elif per_tok is not None and any(marks):
            eqs.append((marks, per_tok))
    grew = True
    while grew:
        new = {j for j in range(len(R)) if R[j].parent in cold and R[j].parent >= 0} - cold
        grew = bool(new)
        cold |= new
    counted = [
        j
        for j in range(len(R))
        if j not in cold
        and (j == 0 or load[j] or R[j].hmma or R[j].ldsm or any(per and marks[j] for per, marks in marked))
    ]

    def owner(j: int, free: list) -> int:
        while j not in free:
            j = R[j].parent if R[j].parent >= 0 else 0
        return j

    free = list(counted)
    note = ""
    while True:
        col = {j: k for k, j in enumerate(free)}
        A = np.zeros((len(eqs), len(free)))
        for e, (coef, _) in enumerate(eqs):
            for j, c in enumerate(coef):
                if j not in cold:
                    A[e, col[owner(j, free)]] += c
        b = np.array([rhs for _, rhs in eqs], float)
        if np.linalg.matrix_rank(A) >= len(free) or len(free) == 1:
            break
        drop = max(free[1:], key=lambda j: (R[j].depth, j))
        free.remove(drop)
        note = "some nested-loop trip counts assumed 1 per parent iteration"
    # each equation relative to its right side; one whose right side is 0 (a cold path the probe never
    # ran) relative to its coefficients, so that it weighs like the others
    scale = np.where(np.abs(b) > 0, np.abs(b), np.maximum(np.abs(A).max(axis=1), 1.0))
    sol, *_ = np.linalg.lstsq(A / scale[:, None], b / scale, rcond=None)
    sol = np.maximum(sol, 0.0)
    resid = float(np.max(np.abs(A @ sol - b) / scale)) if len(b) else 0.0
    y = [0.0 if j in cold else float(sol[col[owner(j, free)]]) for j in range(len(R))]
    classes: dict = defaultdict(float)
    for j, r in enumerate(R):
        for k, v in r.classes.items():
            classes[k] += y[j] * v
    instr = sum(y[j] * r.instructions for j, r in enumerate(R))
    smem = sum(y[j] * r.smem_bytes for j, r in enumerate(R))
    y0 = y[0] if y[0] > 0 else float("nan")
    if resid > 0.05:
        note = (note + "; " if note else "") + f"trip-count solve misfit {resid:.0%}"
    return Rates(y, instr, dict(classes), smem, bytes_per_token / y0, instr / y0, resid, note)


# ---------------------------------------------------------------------------
# Blocks of a launch
# ---------------------------------------------------------------------------


@dataclass
class Block:
    keys: list  # [(data key, tokens from the split start)]
    tokens: int  # K/V tokens it visits (all its passes)
    rows: int  # (query, head) rows it serves
    q_bytes: int
    out_bytes: int


def split_chunk(visible: int, splits: int, tile: int = 16) -> int:
    """Positions per split of a query with ``visible`` positions
    (docs/layout.md, "Split-KV workspace")."""
    c = -(-visible // splits)
    return -(-c // tile) * tile


def attention_blocks(
    launch: Launch,
    host: HostPlan,
    *,
    hkv: int,
    hq: int,
    d: int,
    dv: int,
    rot: int,
    itemsize: int,
    splits: int,
    causal: bool,
    x_reversed: bool,
) -> list[Block]:
    """Every block of ``launch`` in launch order (x fastest, then y, then z =
    split): x = query block and y = KV head pack x tiles + tile (a pack of
    ``launch.pack`` KV heads: paged_decode_tc), or with ``launch.tiles_in_x``
    x = query block x tiles + tile and y = KV head (the head tiles of one
    query block dispatched side by side)."""
    X, tiles = launch.blocks, launch.tiles
    pack = getattr(launch, "pack", 1)
    group = hq // hkv
    heads = -(-group // tiles)
    qpb = max(1, -(-launch.q_count // X))
    seq, pos, kvl = host.q_seq, host.q_pos, host.kv_lens
    xs = []
    for x in range(X):
        xi = X - 1 - x if x_reversed else x
        q0 = launch.q_begin + xi * qpb
        q1 = min(launch.q_begin + launch.q_count, q0 + qpb)
        qs = range(q0, q1)
        xs.append([(int(seq[q]), int(pos[q]) + 1 if causal else int(kvl[seq[q]])) for q in qs])
    out = []
    part = splits > 1
    if getattr(launch, "tiles_in_x", False):
        order = [(kvh, per_q) for kvh in range(hkv) for per_q in xs for _ in range(tiles)]
    else:
        order = [(y // tiles * pack, per_q) for y in range(hkv // pack * tiles) for per_q in xs]
    for z in range(splits):
        for kvh, per_q in order:
            most: dict = {}
            for s, vis in per_q:
                c = split_chunk(vis, splits) if part else vis
                t = max(0, min(vis, (z + 1) * c) - z * c) if part else vis
                most[s] = max(most.get(s, 0), t)
            rows = len(per_q) * heads * pack
            keys = [((s, kvh + j, z), t) for j in range(pack) for s, t in most.items()]
            ob = rows * (dv + 1) * 4 if part else rows * dv * itemsize
            out.append(Block(keys, pack * sum(most.values()), rows, rows * (d + rot) * itemsize, ob))
    return out


def merge_blocks(queries: int, hq: int, dv: int, itemsize: int, splits: int, heads_per_block: int) -> list[Block]:
    """Blocks of the split merge: grid (queries, ceil(hq / heads_per_block));
    a "token" is one split's partial rows of the block's heads."""
    out = []
    for y in range(-(-hq // heads_per_block)):
        h = min(heads_per_block, hq - y * heads_per_block)
        for q in range(queries):
            out.append(Block([(("part", q, y), splits)], splits, h, 0, h * dv * itemsize))
    return out


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------


@dataclass
class Sim:
    time: float
    bound_share: dict  # resource -> share of the time it limited the blocks
    tail_share: float
    waves: float
    hbm_bytes: float
    l2_bytes: float


def _waterfill(rho: np.ndarray, demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Limit rates ``rho`` so that sum(rho * demand) <= 1, max-min fairly in
    usage; returns (rates, mask of blocks it limited)."""
    use = rho * demand
    total = float(use.sum())
    if total <= 1.0 + 1e-12 or not np.isfinite(total):
        return rho, np.zeros(len(rho), bool)
    order = np.sort(use)
    n = len(order)
    csum = np.cumsum(order)
    lam = None
    for k in range(n):  # level lam with sum(min(use, lam)) == 1
        rest = n - k
        prev = csum[k - 1] if k else 0.0
        cand = (1.0 - prev) / rest
        if cand <= order[k]:
            lam = cand
            break
    if lam is None:
        lam = order[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(demand > 0, lam / demand, np.inf)
    limited = cap < rho
    return np.minimum(rho, cap), limited


def simulate(
    blocks: list[Block],
    demands: dict,
    pt: _archs.Point,
    per_sm: int,
    hbm_demand_fn: Callable[..., float],
    *,
    warps: int = 4,
    startup: np.ndarray | None = None,
    quantum: float = 1e-3,
) -> Sim:
    """Run the fluid model (module doc). ``demands``: resource -> array of
    seconds each block needs alone on an idle SM ("issue": at one warp
    instruction per clock, the SM's rate depending on the warps issuing;
    "mma": at the SM's whole mma.sync rate, of which a block set of fewer
    than 4 warps gets its sub-partitions' share; "wgmma", "pipe", "smem"),
    alone on the machine ("L2") or by itself ("chain": what its warps
    serialize); HBM bytes come from ``hbm_demand_fn(block index, active
    keys, loaded)`` at dispatch (L2 reuse) and move at ``pt.copy_bw`` x the
    DRAM efficiency in ``demands["dram_eff"]`` (a scalar). ``startup``:
    seconds after dispatch before a block can work (its dependent round
    trips), spent holding its slot and nothing else. ``quantum``: blocks
    that would end within this share of a block's median serial time of the
    next event end with it (fewer events; at most that share early)."""
    n = len(blocks)
    sms = pt.sms
    slots = max(1, per_sm) * sms
    if n == 0:
        return Sim(0.0, {}, 0.0, 0.0, 0.0, 0.0)
    bw = pt.copy_bw * float(demands.get("dram_eff", 1.0))
    zero = np.zeros(n)
    issue = demands.get("issue", zero)
    mma = demands.get("mma", zero)
    shared = [(r, demands[r]) for r in ("wgmma", "pipe", "smem") if r in demands]
    chain = demands.get("chain", zero)
    l2 = demands.get("L2", zero)
    wait0 = np.zeros(n) if startup is None else np.asarray(startup, float)
    hbm = np.zeros(n)
    dispatch_t = np.zeros(n)
    ready_t = np.zeros(n)
    act = np.zeros(n, bool)
    sm_of = np.zeros(n, np.int64)
    w = np.ones(n)
    key_active: dict = defaultdict(int)
    loaded: dict = defaultdict(int)
    hbm_bytes = 0.0
    max_w = int(max(1, per_sm) * warps) + 1
    cap_tab = np.array([pt.issue_per_clk(x) for x in range(max_w + 1)])

    def start(i: int, sm: int, t: float) -> None:
        nonlocal hbm_bytes
        b = blocks[i]
        by = hbm_demand_fn(i, key_active, loaded)
        hbm_bytes += by
        hbm[i] = by / bw
        for k, _ in b.keys:
            key_active[k] += 1
        sm_of[i] = sm
        dispatch_t[i] = t
        ready_t[i] = t + wait0[i]
        act[i] = True

    for i in range(min(n, slots)):
        start(i, i % sms, 0.0)
    nxt = min(n, slots)
    t = 0.0
    bound_time: dict = defaultdict(float)
    names = ["issue", "tensor"] + [("tensor" if r == "wgmma" else r) for r, _ in shared] + ["chain", "L2", "HBM"]
    n_names = len(names)
    i_l2, i_hbm = n_names - 2, n_names - 1
    col_idx = np.arange(slots)
    pos = chain[chain > 0]
    quantum = quantum * float(np.median(pos)) if pos.size else 0.0
    while act.any():
        a = np.flatnonzero(act)
        ready = ready_t[a] <= t * (1 + 1e-12) + 1e-15
        work, idle = a[ready], a[~ready]
        dt = np.inf
        if idle.size:
            dt = float((ready_t[idle] - t).min()) + quantum
        rho = np.zeros(0)
        which = np.zeros(0, np.int64)
        if work.size:
            sm_w = sm_of[work]
            cnt = np.bincount(sm_w, minlength=sms)
            c = cnt[sm_w]
            share = 1.0 / c
            wsm = np.minimum(c * warps, max_w)
            caps = cap_tab[wsm]
            frac = np.minimum(1.0, np.maximum(wsm, 1) / pt.sub_partitions)
            with np.errstate(divide="ignore", invalid="ignore"):
                cols = [
                    np.where(issue[work] > 0, share * caps / issue[work], np.inf),
                    np.where(mma[work] > 0, share * frac / mma[work], np.inf),
                ]
                cols += [np.where(d[work] > 0, share / d[work], np.inf) for _, d in shared]
                cols.append(np.where(chain[work] > 0, 1.0 / chain[work], np.inf))
            stack = np.vstack(cols)
            which = stack.argmin(axis=0)
            rho = stack[which, col_idx[: work.size]]
            rho, lim = _waterfill(rho, l2[work])
            which[lim] = i_l2
            rho, lim = _waterfill(rho, hbm[work])
            which[lim] = i_hbm
            rho = np.where(np.isfinite(rho), rho, 1e18)
            left = w[work] / rho
            dt = min(dt, float(left.min()))
        n_act = a.size
        if work.size:
            for k, m in enumerate(np.bincount(which, minlength=n_names).tolist()):
                if m:
                    bound_time[names[k]] += dt * m / n_act
            w[work] -= rho * dt
        if idle.size:
            bound_time["startup"] += dt * idle.size / n_act
        t += dt
        done = work[(w[work] <= 1e-9) | (left <= dt * (1 + 1e-6) + quantum)] if work.size else work
        act[done] = False
        for i in done.tolist():
            for k, _ in blocks[i].keys:
                key_active[k] -= 1
        for i in done.tolist():
            if nxt < n:
                start(nxt, int(sm_of[i]), t)
                nxt += 1
    full = n // slots
    if n % slots == 0:
        tail_start = t
    else:
        tail_start = float(dispatch_t[full * slots]) if full else 0.0
    total = sum(bound_time.values()) or 1.0
    return Sim(
        t,
        {k: v / total for k, v in bound_time.items()},
        (t - tail_start) / t if t > 0 else 0.0,
        n / slots,
        hbm_bytes,
        float(l2.sum() * pt.l2_bw),
    )


# ---------------------------------------------------------------------------
# One launch
# ---------------------------------------------------------------------------


@dataclass
class LaunchModel:
    """Everything printed for one launch (all **modeled**), at one end of
    the assumptions' ranges (``end``)."""

    kernel: str
    variant: str
    role: str
    end: str
    grid: tuple
    threads: int
    registers: int
    spills: tuple
    static_smem: int
    dynamic_smem: int
    occupancy: dict
    launchable: bool
    launch_problems: list
    blocks: int
    blocks_per_sm: float  # resident blocks per SM the grid places (at most the occupancy limit)
    waves: float
    tail_share: float
    time_s: float
    binding: str
    bound_share: dict
    bounds_s: dict  # each resource alone (no tail effects but its own), seconds
    hbm_bytes: float
    l2_bytes: float
    kv_bytes: float  # K/V (or partial) bytes the blocks read
    dram_eff: float  # of the copy bandwidth, for this launch's access pattern
    in_flight_per_sm: float | None
    little_per_sm: float
    cover: int  # hot-loop iterations a tile's copies have before they are waited for (0: none, "ldg")
    startup_s: float  # dependent round trips before a block's first tile
    iteration: dict  # one hot-loop iteration of one warp, seconds: what it serializes, and its total
    mma: float  # mma.sync m16n8k16 executed (counters)
    ldmatrix: float
    mma_per_tile: dict  # per 64 K/V tokens per block: mma, ldmatrix, smem bytes
    smem_bytes: float
    instr: float | None  # warp instructions (hot loop, prologue and epilogue, all blocks)
    instr_per_kv_byte: float | None
    hot_loop: dict
    notes: list

    def as_dict(self) -> dict:
        d = asdict(self)
        d["label"] = "modeled"
        return d


_PIPE_OF = {
    "fp32": "fp32",
    "imad": "imad",
    "alu": "alu",
    "mufu": "mufu",
    "shfl": "shfl",
    "conv": "conv",
    "ldg": "lsu",
    "ldgsts": "lsu",
    "lds": "lsu",
    "ldsm": "lsu",
    "sts": "lsu",
    "stg": "lsu",
    "local": "lsu",
    "atoms": "lsu",
}


def _region_time(r: _sass.Region, t: float, w: int, wg_sm: float, smem_bw: float, mma_sm: float) -> float:
    """One execution of region ``r`` by one warp (seconds) whose waits see
    the tensor work of ``w`` warps, at ``t`` seconds per instruction: the
    segments in order, each HGMMA commit group queued on the tensor cores
    behind those still in flight (from its first HGMMA's issue on, at the
    longer of its FLOP and its operand bytes); a segment's wait
    (``WARPGROUP.DEPBAR.LE gsb0, N``) returns when the issue is done and
    every group but the newest N has finished; those N stay in flight into
    what follows (and, when the region waits somewhere, around into its
    next execution: the steady state of a second pass). An mma.sync
    segment: the longer of its issue, its HMMA time and its shared-memory
    time. A region with no wait waits for its groups at its end."""
    segs = r.segments
    waits = r.waits if len(r.waits) == len(segs) else [0] * len(segs)
    groups = r.groups if len(r.groups) == len(segs) else [[[s[3], s[4]]] if s[3] else [] for s in segs]
    has_wait = any(s[6] for s in segs)

    def one_pass(carry: list) -> tuple:
        total = 0.0
        for k, (seg, n, gs) in enumerate(zip(segs, waits, groups)):
            pre, post, mmaf, _wgf, wgs, sm, closed = seg[:7]
            if not has_wait and k == len(segs) - 1:
                closed, n = 1, 0
            issue = (pre + post) * t
            done = max(issue, mmaf * w / mma_sm if mmaf else 0.0)
            fin = list(carry)  # finish times of the groups in flight, from this segment's start
            tail = max(fin, default=0.0)
            for f, b in gs:
                tail = max(tail, pre * t) + max(f * w / wg_sm, b * w / smem_bw)
                fin.append(tail)
            start = pre * t if gs else 0.0  # LDS / STS beside HGMMA: from the first HGMMA's issue on
            if closed:
                waited = fin[: len(fin) - n] if n else fin
                wgs_waited = sum(b for _, b in (gs[: len(gs) - n] if n else gs))
                done = max(done, max(waited, default=0.0), start + (wgs_waited + sm) * w / smem_bw)
                rest = fin[len(fin) - n :] if n else []
            else:
                done = max(done, start + sm * w / smem_bw)
                rest = fin
            carry = [x - done for x in rest if x > done]
            total += done
        return total, carry

    first, carry = one_pass([])
    if not has_wait or not carry:
        return first
    return one_pass(carry)[0]


def dependent_wait(r: _sass.Region, latency: float, t: float) -> float:
    """What one execution of region ``r`` waits for its dependent word loads
    (seconds): per round trip the load's ``latency`` less the issue of the
    instructions between the load and its first use (``Region.dep_gaps``,
    ``t`` seconds each), which in-order issue overlaps with it; a round trip
    without a known gap waits the whole latency, and one that shares the
    round trip of a 16-byte load issued beside it (``sass.SHARED``: the
    loop's memory wait charges that) nothing."""
    gaps = list(r.dep_gaps)[: r.dep_levels]
    gaps += [0] * (r.dep_levels - len(gaps))
    return sum(0.0 if g == _sass.SHARED else max(0.0, latency - g * t) for g in gaps)


def iteration_parts(
    hot: _sass.HotLoop,
    rates: Rates,
    pt: _archs.Point,
    warps: int,
    *,
    wgmma_rate: float | None = None,
    runners: int | None = None,
    beside: float = 0.0,
) -> dict:
    """One hot-loop iteration of one warp of a block alone on its SM, in
    seconds, as the SASS serializes it (``sass.Region``): each region's
    segments run once per its executions per iteration (``rates.y``); in a
    segment, the issue up to the first HGMMA, then the longer of the rest
    of the issue and the tensor / operand time its wait returns after, a
    wait that leaves its newest N groups in flight (``wait_group N``)
    overlapping them with what follows (``_region_time``; an mma.sync
    segment: the longer of its issue, its HMMA time and its shared-memory
    time, which overlap); block barriers and the dependent word loads add (a
    load its latency less the issue between it and its use: dependent_wait).
    The warp issues at ``max(1 / warp_ipc, k / sched_ipc)`` clocks per
    instruction, k of the block's warps sharing its scheduler; ``runners``:
    the warps that run this loop (a warp-specialized kernel's consumers or
    producer; default all), whose tensor, operand and issue work is the
    block's; ``beside``: seconds of other warps' issue per iteration on one
    scheduler (the producer's, beside the consumers).

    Warpgroups that take turns through named barriers
    (``HotLoop.pingpong``: G of them): a warp's waits see only its own
    warpgroup's tensor work (the others are in their softmax meanwhile)
    and it issues alone on its scheduler; the iteration is the longest of
    that chain, the block's tensor time (all G warpgroups' groups one
    after another), its shared-memory operand time and its issue (the
    instructions of the k warps of a scheduler). A block barrier in the
    loop (``BAR.SYNC 0``, not a named one) starts the warpgroups together
    every iteration: the last to take its turn waits for the others'
    products first (``turn wait``: G - 1 warpgroups' tensor time added to
    the chain). Without ping-pong the warps run in lockstep: every wait
    sees the whole block's tensor work.

    Keys: issue, tensor (what the waits for tensor work add), barriers,
    dependent loads, turn wait (ping-pong only), ping-pong wait (what the shared tensor cores or
    schedulers add beyond one warpgroup's chain), total; per_instruction,
    pingpong (G, 0 for none)."""
    clk = pt.clock_hz
    k = -(-warps // pt.sub_partitions)
    t_i = max(1.0 / pt.warp_ipc, k / pt.sched_ipc) / clk
    mma_sm = pt.mma_sync_flops / pt.sms * pt.mma_fraction(warps)
    wg_sm = (wgmma_rate or pt.wgmma_flops or pt.mma_sync_flops) / pt.sms
    smem_bw = pt.smem_bytes_per_clk * clk
    run = runners or warps
    groups = hot.pingpong(run)
    own = 4 if groups else run  # the warps whose tensor work one warp's waits see
    t_own = max(1.0 / pt.warp_ipc, 1.0 / pt.sched_ipc) / clk if groups else t_i
    y0 = rates.y[0] if rates.y and rates.y[0] > 0 else float("nan")
    parts = {"issue": 0.0, "tensor": 0.0, "barriers": 0.0, "dependent loads": 0.0}
    block = {"tensor": 0.0, "smem": 0.0, "issue": 0.0}  # the whole block's, per iteration
    own_tensor, realign = 0.0, False  # one warpgroup's tensor time; a block barrier in the loop
    for j, r in enumerate(hot.regions):
        per = rates.y[j] / y0 if j < len(rates.y) and np.isfinite(y0) else 0.0
        if per <= 0:
            continue
        n_issue = sum(seg[0] + seg[1] for seg in r.segments)
        seg_t = _region_time(r, t_own, own, wg_sm, smem_bw, mma_sm)
        parts["issue"] += per * n_issue * t_own
        parts["tensor"] += per * (seg_t - n_issue * t_own)
        parts["barriers"] += per * r.bars * pt.bar_clk / clk
        parts["dependent loads"] += per * dependent_wait(r, pt.dep_load_s, t_own)
        block["tensor"] += per * sum(seg[3] * run / wg_sm + seg[2] * run / mma_sm for seg in r.segments)
        block["smem"] += per * sum((seg[4] + seg[5]) * run / smem_bw for seg in r.segments)
        block["issue"] += per * n_issue * -(-run // pt.sub_partitions) / pt.sched_ipc / clk
        own_tensor += per * sum(seg[3] * own / wg_sm + seg[2] * own / mma_sm for seg in r.segments)
        realign = realign or r.bars > r.named_syncs
    block["issue"] += beside
    if groups and realign:
        # a block barrier in the loop starts the warpgroups together each iteration: the last to take its turn
        # queues behind the others' products (G - 1 warpgroups' tensor time) before its own
        parts["turn wait"] = (groups - 1) * own_tensor
    chain = sum(parts.values())
    total = max(chain, *block.values()) if groups else chain
    parts["ping-pong wait"] = total - chain
    parts["total"] = total
    parts["per_instruction"] = t_i
    parts["pingpong"] = groups
    return parts


def model_launch(
    arch: _archs.Arch,
    facts: KernelFacts,
    desc: _kernels.KernelDesc,
    *,
    grid: tuple,
    threads: int,
    dynamic_smem: int,
    blocks: list[Block],
    kv_bytes_per_token: float,
    probe: _counters.Probe | None,
    fits_l2: bool,
    kv_in_l2: bool = False,
    latency: str = "dram",
    run_bytes: float | None = None,
    end: str = "pess",
    flip: tuple = (),
    quantum: float = 1e-3,
    extra_notes: Iterable[str] = (),
    dependent: bool = False,
) -> LaunchModel:
    """Model one launch (module doc) with the arch's figures at ``end`` of
    their ranges (``flip``: those at the other end). ``fits_l2``: the
    launch's K/V fits in half the L2, so a range read once is an L2 hit
    afterwards; ``kv_in_l2``: the data is already in L2 (the merge's
    partials); ``latency``: what a tile load waits for, "dram" or "l2";
    ``run_bytes``: contiguous bytes of one K/V row run in memory (the DRAM
    efficiency of the access pattern; None: long runs); ``quantum``: see
    ``simulate``. ``dependent``: a programmatic dependent launch (the split
    merge): where the arch has one (``pdl_release_us``) its launch hides
    behind the launch before it and its time is the release after that one
    plus its own simulated time, with no per-launch floor; elsewhere an
    ordinary launch."""
    pt = arch.point(end, flip)
    notes = list(extra_notes)
    if not desc.known:
        notes.append(f"{facts.kernel} is not in cupaged/tools/kernels.py")
    warps = -(-threads // 32)
    occ = _occupancy.occupancy(arch.name, threads, facts.registers, facts.static_smem, dynamic_smem)
    problems = _archs.launch_problems(arch.name, facts.static_smem, dynamic_smem, threads, facts.registers)
    n = len(blocks)
    tokens = np.array([b.tokens for b in blocks], float)
    clk = pt.clock_hz
    lat = pt.l2_latency_s if latency == "l2" else pt.latency_s
    eff = 1.0 if kv_in_l2 else pt.dram_eff(run_bytes)
    placed = min(float(max(1, occ.blocks_per_sm)), n / pt.sms) if n else 0.0

    rates = None
    hot = facts.hot
    prod = hot.producer if hot is not None else None  # a warp-specialized kernel's loader loop
    wc = hot.consumer_warps(warps) if hot is not None else warps  # the warps running the hot loop
    wp = warps - wc  # ... and the producer's
    rates_p = None
    if hot is not None:
        # wgmma instructions (per warp part) are HGMMA in the SASS, which the solver counts with HMMA
        mma_t = (probe.slope.get("mma_16816", 0.0) + probe.slope.get("wgmma", 0.0)) / wc if probe else None
        ldsm_t = (probe.slope.get("ldmatrix_x4", 0) + probe.slope.get("ldmatrix_x4_trans", 0)) / wc if probe else None
        # cold-path marks per warp of the block (a split kernel's consumers and producer share the counter)
        cold_t = probe.slope.get("cold_path", 0.0) / warps if probe else None
        # edge-tile marks per consumer warp (the warps that mask scores) and token; per block: edge_fixed below
        edge_t = probe.slope.get("edge_tile", 0.0) / wc if probe else None
        if prod is not None:
            rates_p = solve_rates(prod, kv_bytes_per_token / wp, None, None, cold_t)
            if rates_p.note:
                notes.append(f"producer: {rates_p.note}")
            if mma_t is None:
                notes.append(f"{facts.kernel}: no counters: one consumer iteration per producer iteration")
        trips = rates_p.y[0] if rates_p is not None else None
        rates = solve_rates(hot, kv_bytes_per_token / wc, mma_t, ldsm_t, cold_t, trips, edge_t)
        if rates.note:
            notes.append(rates.note)
    else:
        notes.append(facts.sass_note or "no SASS")

    demands: dict = {"dram_eff": eff}
    startup = np.zeros(n)
    iteration: dict = {}
    cover = 0
    in_flight_block = None
    if rates is not None and hot is not None:
        per_tok = wc * tokens
        # The edge tiles of a block (the causal diagonal, a window's or split's edge: the counters' per-block
        # marks, per consumer warp) run their branch region (the largest, where the loop is unrolled) on top
        # of the loop's own iteration, whose unmasked branch they skip: counted anyway (pessimistic).
        edge_regions = [r.instructions for r in hot.regions if r.edges]
        edge_marks = max(0.0, probe.intercept.get("edge_tile", 0.0)) / wc if probe is not None else 0.0
        edge_fixed = edge_marks * max(edge_regions, default=0)
        if edge_fixed:
            notes.append(f"{edge_marks:.2g} edge tiles a block: {edge_fixed:.0f} instructions a consumer warp")
        fixed = wc * (hot.prologue + hot.epilogue + edge_fixed)
        instr_tok = wc * rates.instr + (wp * rates_p.instr if rates_p is not None else 0.0)
        if prod is not None:
            fixed = fixed + wp * (prod.prologue + prod.epilogue)
        demands["issue"] = (tokens * instr_tok + np.where(tokens > 0, fixed, 0.0)) / clk
        pipe: dict = defaultdict(float)
        for c, v in rates.classes.items():
            if c in _PIPE_OF:
                pipe[_PIPE_OF[c]] += v
        if rates_p is not None:  # per consumer warp, as the consumers' own
            for c, v in rates_p.classes.items():
                if c in _PIPE_OF:
                    pipe[_PIPE_OF[c]] += v * wp / wc
        pcyc = np.zeros(n)
        for p, v in pipe.items():
            lanes = pt.lanes_per_clk.get(p)
            if lanes:
                pcyc = np.maximum(pcyc, per_tok * v * 32 / lanes)
        demands["pipe"] = pcyc / clk
        wg_rate = pt.wgmma_flops
        if any(seg[3] for r in hot.regions for seg in r.segments) and not wg_rate:
            notes.append(f"{facts.kernel}: wgmma has no rate on {arch.name}; modeled at the mma.sync rate")
        if prod is None:
            iteration = iteration_parts(hot, rates, pt, warps, wgmma_rate=wg_rate)
            cover = hot.cover
            t_iter = hot.latency_time(lat, iteration["total"])
            iteration["memory wait"] = t_iter - iteration["total"]
        else:
            # Warp-specialized: the consumers wait for memory only through the producer, which waits for
            # its copies cover iterations after issuing them; a consumer iteration is the longer of its own
            # chain and the producer's for the same tokens (whose issue shares the schedulers: beside).
            assert rates_p is not None
            per_c = 1.0 / rates.y[0] if rates.y[0] > 0 else 0.0  # tokens per consumer iteration
            p_iters = rates_p.y[0] * per_c  # producer iterations per consumer iteration
            p_parts = iteration_parts(prod, rates_p, pt, warps, runners=wp)
            cover = prod.cover
            t_p = prod.latency_time(lat, p_parts["total"])
            beside = p_iters * rates_p.iter_instr * -(-wp // pt.sub_partitions) / pt.sched_ipc / clk
            iteration = iteration_parts(hot, rates, pt, warps, wgmma_rate=wg_rate, runners=wc, beside=beside)
            t_iter = max(iteration["total"], p_iters * t_p)
            iteration["producer"] = p_iters * t_p
            iteration["memory wait"] = t_iter - iteration["total"]
        iteration["iteration"] = t_iter
        iters = rates.y[0] * tokens
        demands["chain"] = np.where(
            tokens > 0, iters * t_iter + (hot.prologue + hot.epilogue + edge_fixed) * iteration["per_instruction"], 0.0
        )
        # a warp-specialized kernel's first tile waits for the producer's round trips, its bytes are its copies
        startup = np.where(tokens > 0, (prod or hot).startup_levels * lat, 0.0)
        if prod is not None and rates_p is not None:
            in_flight_block = rates_p.iter_bytes * wp * max(1, cover)
        else:
            in_flight_block = rates.iter_bytes * warps * max(1, cover)
        if desc.known and desc.loads == "ring" and cover == 0:
            notes.append(f"{facts.kernel}: no cp.async wait in the SASS hot loop; modeled as loads used in place")
    mma = np.zeros(n)
    smem = np.zeros(n)
    ldm = np.zeros(n)
    if probe is not None:
        mma = np.array([probe.per_block("mma_16816", t) for t in tokens])
        ldm = np.array([probe.per_block("ldmatrix_x4", t) + probe.per_block("ldmatrix_x4_trans", t) for t in tokens])
        smem = np.array([probe.smem_bytes(t) for t in tokens])
        wg_flop = np.array([probe.per_block("wgmma_flop", t) for t in tokens])
        if mma.any():
            demands["mma"] = mma * _counters.MMA_FLOP / (pt.mma_sync_flops / pt.sms)
        if wg_flop.any():
            demands["wgmma"] = wg_flop / ((pt.wgmma_flops or pt.mma_sync_flops) / pt.sms)
        mma = mma + wg_flop / _counters.MMA_FLOP  # reported in m16n8k16 equivalents
    elif rates is not None and hot is not None:
        # no counters: the tensor work from the SASS (each region's HMMA / HGMMA x its trip count)
        mma_tok = sum(y * sum(seg[2] for seg in r.segments) for y, r in zip(rates.y, hot.regions))
        wg_tok = sum(y * sum(seg[3] for seg in r.segments) for y, r in zip(rates.y, hot.regions))
        if mma_tok:
            mma = warps * tokens * mma_tok / _counters.MMA_FLOP
            demands["mma"] = warps * tokens * mma_tok / (pt.mma_sync_flops / pt.sms)
        if wg_tok:
            demands["wgmma"] = warps * tokens * wg_tok / ((pt.wgmma_flops or pt.mma_sync_flops) / pt.sms)
            mma = mma + warps * tokens * wg_tok / _counters.MMA_FLOP
    if rates is not None:
        smem = smem + wc * tokens * rates.smem_bytes
    if rates_p is not None:
        smem = smem + wp * tokens * rates_p.smem_bytes
    if smem.any():
        demands["smem"] = smem / (pt.smem_bytes_per_clk * clk)
    kvb = tokens * kv_bytes_per_token
    io = np.array([b.q_bytes + b.out_bytes for b in blocks], float)
    demands["L2"] = (kvb + io) / pt.l2_bw

    def hbm_of(i, key_active, loaded):
        b = blocks[i]
        by = 0.0
        for k, t in b.keys:
            if kv_in_l2:
                continue
            if key_active[k] > 0 or fits_l2:
                extra = max(0, t - loaded[k])
            else:
                extra = t
                loaded[k] = 0
            loaded[k] = max(loaded[k], t)
            by += extra * kv_bytes_per_token
        return by + b.q_bytes + b.out_bytes

    sim = simulate(blocks, demands, pt, occ.blocks_per_sm, hbm_of, warps=warps, startup=startup, quantum=quantum)
    time_s = sim.time
    if dependent and pt.pdl_release_s is not None:
        notes.append("a dependent launch: its launch hidden behind the launch before it, the release added")
        time_s += pt.pdl_release_s
        if sim.time < pt.pdl_release_s:
            sim.bound_share = {"launch": 1.0}
    elif time_s < pt.launch_s:
        notes.append("launch-bound: below the per-launch floor")
        sim.bound_share = {"launch": 1.0}
        time_s = pt.launch_s
    binding = max(sim.bound_share, key=lambda r: sim.bound_share[r]) if sim.bound_share else "-"
    slots = max(1, occ.blocks_per_sm) * pt.sms
    bounds = {"HBM": sim.hbm_bytes / (pt.copy_bw * eff), "L2": float((kvb + io).sum()) / pt.l2_bw}
    if "issue" in demands:
        wsm = max(1, int(round(placed * warps)))
        bounds["issue"] = float(demands["issue"].sum()) / pt.sms / pt.issue_per_clk(wsm)
        bounds["pipe"] = float(demands["pipe"].sum()) / pt.sms
    if "mma" in demands or "wgmma" in demands:
        frac = pt.mma_fraction(max(1, int(round(placed * warps))))
        bounds["tensor"] = (
            float(demands.get("mma", np.zeros(1)).sum()) / frac + float(demands.get("wgmma", np.zeros(1)).sum())
        ) / pt.sms
    if "smem" in demands:
        bounds["smem"] = float(demands["smem"].sum()) / pt.sms
    if "chain" in demands:
        bounds["chain"] = float(demands["chain"].sum()) / min(slots, max(1, n))
        bounds["startup"] = float(startup.max()) if n else 0.0
    instr = None
    if rates is not None and hot is not None:
        instr = float((wc * tokens * rates.instr).sum()) + float(np.count_nonzero(tokens)) * wc * (
            hot.prologue + hot.epilogue
        )
        if prod is not None and rates_p is not None:
            instr += float((wp * tokens * rates_p.instr).sum()) + float(np.count_nonzero(tokens)) * wp * (
                prod.prologue + prod.epilogue
            )
    per_tile = {}
    if probe is not None:
        per_tile = {
            "tokens": 64,
            "mma": 64 * (probe.slope.get("mma_16816", 0.0) + probe.slope.get("wgmma_flop", 0.0) / _counters.MMA_FLOP),
            "ldmatrix": 64 * (probe.slope.get("ldmatrix_x4", 0.0) + probe.slope.get("ldmatrix_x4_trans", 0.0)),
            "smem_bytes": 64
            * (
                sum(_counters.SMEM_BYTES[k] * probe.slope.get(k, 0.0) for k in _counters.SMEM_BYTES)
                + (warps * rates.smem_bytes if rates is not None else 0.0)
            ),
        }
    hot_d = {}
    if hot is not None and rates is not None:
        tot = hot.totals()
        hot_d = {
            "static_instructions": hot.instructions,
            "skipped_instructions": tot.skipped,
            "nested_loops": hot.nested,
            "classes_static": tot.classes,
            "trips_per_token": rates.y,
            "instr_per_iteration": rates.iter_instr,
            "kv_bytes_per_iteration_per_warp": rates.iter_bytes,
            "classes_per_kv_byte": {k: v / (kv_bytes_per_token / warps) for k, v in rates.classes.items()},
            "offsets": [hex(hot.first_offset), hex(hot.last_offset)],
            "prologue_instructions": hot.prologue,
            "epilogue_instructions": hot.epilogue,
            "startup_round_trips": hot.startup_levels,
            "barriers_per_iteration": tot.bars,
        }
    kv_total = float(kvb.sum())
    return LaunchModel(
        kernel=facts.kernel,
        variant=facts.variant,
        role=desc.role,
        end=end,
        grid=tuple(grid),
        threads=threads,
        registers=facts.registers,
        spills=(facts.spill_stores, facts.spill_loads),
        static_smem=facts.static_smem,
        dynamic_smem=dynamic_smem,
        occupancy=occ.as_dict(),
        launchable=not problems,
        launch_problems=problems,
        blocks=n,
        blocks_per_sm=placed,
        waves=sim.waves,
        tail_share=sim.tail_share,
        time_s=time_s,
        binding=binding,
        bound_share=sim.bound_share,
        bounds_s=bounds,
        hbm_bytes=sim.hbm_bytes,
        l2_bytes=float((kvb + io).sum()),
        kv_bytes=kv_total,
        dram_eff=eff,
        in_flight_per_sm=None if in_flight_block is None else in_flight_block * placed,
        little_per_sm=pt.copy_bw * eff * lat / pt.sms,
        cover=cover,
        startup_s=float(startup.max()) if n else 0.0,
        iteration=iteration,
        mma=float(mma.sum()),
        ldmatrix=float(ldm.sum()),
        mma_per_tile=per_tile,
        smem_bytes=float(smem.sum()),
        instr=instr,
        instr_per_kv_byte=(rates.instr / (kv_bytes_per_token / warps)) if rates is not None else None,
        hot_loop=hot_d,
        notes=notes,
    )


def fmt_bytes(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.1f} {unit}"
    return f"{x:.0f} B"
