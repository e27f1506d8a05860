"""Calibration microbenchmarks: measure on a GPU what the performance model
assumes (``cupaged/tools/archs.py``), figure by figure.

    python -m cupaged.tools.calibrate [--json PATH]     # a CUDA device through CuPy
    python -m cupaged.tools.calibrate --cpu             # the same code on the CPU backend, tiny sizes

Kernels: ``kernels_cu/bench/calibrate.cu`` (its opening comment gives each
kernel's grid, what it measures and the figure expected, with its source;
its compile-time constants are ``DEFINES`` here): mma.sync and wgmma rates,
the conversion rate (F2FP pack, e4m3 decode), DRAM and L2 latency by pointer
chase (idle, and with every SM streaming reads), and the bandwidth of the
decode kernels' paged NHD read beside a contiguous read, an L2-resident
read, a copy kernel and cudaMemcpy of the same bytes.

The table prints each figure MEASURED beside the model constant it
calibrates (MODELED: the row of ``archs.py`` for this device's arch, read,
never changed; a range "optimistic - pessimistic" where archs.py gives one),
the ratio measured / the quoted (pessimistic) end, and whether the
measurement falls in the range, above or below it. Every kernel's output is
also checked against a NumPy reference computed here (exact: small
integers, exact conversions, integer sums), so each figure comes from a
kernel that did its work; a failed check, or a measurement group that
raises (the others still run), makes the exit status 1. ``--json PATH``
writes every figure with its unit, constant, range and details.

Budget: under 60 s on an H200, compiles included (sized from the model's
rates, each launch a few milliseconds; not yet run on one). Without a
usable GPU (CuPy, cuda-python and a CUDA device) it prints one line and
exits 2. ``--cpu`` runs every kernel through the g++ shim on tiny sizes:
the checks are real there, the timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._runtime import dispatch
from .._runtime import stream as _stream
from . import archs as _archs

#: The kernel source (a ``kernels_cu`` stem).
STEM = "bench/calibrate"
#: The kernels' compile-time constants, defined here once and passed as defines (calibrate.cu reads them):
#: threads a block; resident blocks per SM of the throughput kernels (their __launch_bounds__ minimum and
#: their grid: one wave); independent mma.sync accumulators and conversion chains a thread; wgmma a group.
DEFINES = {"CAL_THREADS": 256, "CAL_BLOCKS_PER_SM": 2, "CAL_MMA_CHAINS": 8, "CAL_CVT_CHAINS": 8, "CAL_WG_PER_GROUP": 8}
#: The sm_90a build: the wgmma kernels alone.
WGMMA_DEFINES = {**DEFINES, "CAL_WGMMA": 1, "CP_TARGET": "sm_90a"}
THREADS = DEFINES["CAL_THREADS"]
MMA_CHAINS = DEFINES["CAL_MMA_CHAINS"]
CVT_CHAINS = DEFINES["CAL_CVT_CHAINS"]
WG_PER_GROUP = DEFINES["CAL_WG_PER_GROUP"]
MMA_FLOP = 2 * 16 * 8 * 16  # one mma.sync m16n8k16
WGMMA_N = {"cal_wgmma_bf16_n32": ("bf16", 32), "cal_wgmma_bf16_n64": ("bf16", 64)}
WGMMA_N.update({"cal_wgmma_bf16_n256": ("bf16", 256), "cal_wgmma_f16_n256": ("f16", 256)})
LINE_WORDS = 32  # chase: one hop a 128-byte line


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does (GPU: each launch runs ~1-10 ms
    on an H200; ``tiny``: the CPU backend's smoke run)."""

    mma_iters: int = 16384
    wgmma_flop: float = 1e12  # per launch (~1.3 ms at 790 TFLOP/s; sums stay below 2^21, exact in f32)
    cvt_iters: int = 8192
    chase_dram_bytes: int = 1 << 30
    chase_l2_bytes: int = 4 << 20
    chase_hops: int = 8192
    chase_warm: int = 256
    loaders_per_sm: int = 4
    chunk_vecs: int = 4096  # 64 KiB a loader round
    l2_read_bytes: int = 16 << 20
    l2_traffic_bytes: int = 1 << 30  # read per launch from the L2-resident prefix
    max_rounds: int = 16384
    seqs: int = 64
    tokens: int = 8192
    kv_heads: int = 8
    row_bytes: int = 256  # D = 128 bf16
    page_size: int = 16
    blocks_per_sm: int = DEFINES["CAL_BLOCKS_PER_SM"]
    reps: int = 5
    gap_spin_ns: int = 20000  # the first launch of a pair: long enough for the second to be launched meanwhile
    gap_reps: int = 50

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(
            mma_iters=3,
            wgmma_flop=1.0,
            cvt_iters=5,
            chase_dram_bytes=1 << 19,
            chase_l2_bytes=1 << 16,
            chase_hops=600,
            chase_warm=7,
            loaders_per_sm=1,
            chunk_vecs=512,
            l2_read_bytes=4096,
            l2_traffic_bytes=3 * 4096,
            max_rounds=3,
            seqs=3,
            tokens=48,
            kv_heads=2,
            row_bytes=64,
            page_size=8,
            blocks_per_sm=1,
            reps=1,
            gap_spin_ns=0,
            gap_reps=1,
        )


Range = tuple[float, float]  # (optimistic, pessimistic) end of a model constant


def model_range(arch: _archs.Arch, name: str, scale: float = 1.0) -> Range | None:
    """The model's value of constant ``name`` of ``arch`` over ``scale``:
    (optimistic, pessimistic) of an entry of ``Arch.figures`` (a range), or
    an ``Arch`` field (one value, both ends); None when the arch has none."""
    figs = getattr(arch, "figures", None)
    if isinstance(figs, dict) and name in figs:
        f = figs[name]
        return f.opt / scale, f.pess / scale
    v = getattr(arch, name, None)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v:
        return v / scale, v / scale
    return None


def _times(a: Range | None, b: Range | None, scale: float = 1.0) -> Range | None:
    return (a[0] * b[0] / scale, a[1] * b[1] / scale) if a and b else None


@dataclass
class Measured:
    """One measured figure beside the model constant it calibrates."""

    key: str
    what: str
    measured: float
    unit: str
    constant: str = ""  # the archs.py constant (or an expression of them) it calibrates; "" if none
    model: Range | None = None  # that constant in ``unit``: (optimistic, pessimistic)
    checked: bool = True  # the kernel's output matched its NumPy reference
    detail: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """Measured over the model's quoted (pessimistic) end."""
        return self.measured / self.model[1] if self.model and self.model[1] else None

    @property
    def place(self) -> str:
        """Where the measurement falls: "in" the model's range, "above" or "below" it."""
        if not self.model or self.measured != self.measured:
            return ""
        lo, hi = min(self.model), max(self.model)
        return "in" if lo <= self.measured <= hi else ("above" if self.measured > hi else "below")


class Backend:
    """Where the kernels run: a GPU (CuPy arrays, CUDA-event timing) or the
    CPU backend (NumPy arrays, host timing: meaningless)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        if gpu:
            import cupy

            self.xp: Any = cupy
            dev = cupy.cuda.Device()
            props = cupy.cuda.runtime.getDeviceProperties(dev.id)
            self.device = f"{props['name'].decode()} (device {dev.id})"
            self.cc = (int(dev.compute_capability[:-1]), int(dev.compute_capability[-1]))
        else:
            self.xp = np
            self.device = "CPU backend (g++ shim; timings say nothing about a GPU)"
            self.cc = (9, 0)  # the target the CPU backend stands in for
        self.like = self.xp.zeros(1, np.uint32)
        self.stream = dispatch.stream_for(self.like)
        self.sms = int(dispatch.multiprocessor_count(self.like))

    @property
    def wgmma(self) -> bool:
        """Whether the wgmma kernels (sm_90a) run here."""
        return self.cc == (9, 0)

    def launch(
        self, name: str, grid, block, args: tuple, shared_mem: int = 0, dependent: bool = False, stream: Any = None
    ) -> None:
        defines = WGMMA_DEFINES if name.startswith("cal_wgmma") else DEFINES
        kernel = dispatch.get_kernel(self.like, STEM, name, defines)
        (stream or self.stream).launch(kernel, grid, block, args, shared_mem, dependent=dependent)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[Any]:
        """A stream work may be captured on (GPU: a new non-blocking CuPy stream,
        current inside the block, since the legacy default stream refuses
        capture; CPU: the CPU stream)."""
        if not self.gpu:
            yield self.stream
            return
        with self.xp.cuda.Stream(non_blocking=True):
            yield dispatch.stream_for(self.like)

    def asarray(self, a: np.ndarray):
        return self.xp.asarray(a)

    def zeros(self, n: int, dtype) -> Any:
        return self.xp.zeros(n, dtype)

    def get(self, a) -> np.ndarray:
        self.sync()
        return a.get() if self.gpu else np.array(a)

    def sync(self) -> None:
        self.stream.synchronize()

    def time(self, fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
        """Median seconds of ``fn`` over ``reps`` single timed runs."""
        for _ in range(warmup):
            fn()
        times = []
        if self.gpu:
            start, end = self.xp.cuda.Event(), self.xp.cuda.Event()
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(self.xp.cuda.get_elapsed_time(start, end) * 1e-3)
        else:
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def _u32(x: int) -> np.uint32:
    return np.uint32(x)


def _clock_ghz(clk: np.ndarray) -> float:
    """The SM clock the blocks ran at: median of each block's cycles over its
    nanoseconds (clk [blocks][2])."""
    c = clk.reshape(-1, 2).astype(np.float64)
    ok = c[:, 1] > 0
    return float(np.median(c[ok, 0] / c[ok, 1])) if ok.any() else float("nan")


def _bits16(values: np.ndarray, dt: str) -> np.ndarray:
    """Small integers as f16 / bf16 bit patterns (uint16)."""
    import ml_dtypes

    return np.asarray(values, np.float16 if dt == "f16" else ml_dtypes.bfloat16).view(np.uint16)


def _pack(h: np.ndarray) -> np.ndarray:
    """[..., 2] uint16 -> [...] uint32, element 0 in the low half."""
    return h[..., 0].astype(np.uint32) | h[..., 1].astype(np.uint32) << 16


# ---------------------------------------------------------------- (a) mma.sync


def mma_reference(vals: np.ndarray) -> np.ndarray:
    """vals [32 lanes][6][2] (the A (4) and B (2) registers' values) -> each
    lane's C fragment [32][4] of one m16n8k16 product A B (float64), by the
    fragment tables of the PTX ISA (ptx.cuh's opening comment)."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for h in range(2):
            a[g, 2 * t + h], a[g + 8, 2 * t + h] = vals[lane, 0, h], vals[lane, 1, h]
            a[g, 2 * t + 8 + h], a[g + 8, 2 * t + 8 + h] = vals[lane, 2, h], vals[lane, 3, h]
            b[2 * t + h, g], b[2 * t + 8 + h, g] = vals[lane, 4, h], vals[lane, 5, h]
    c = a @ b
    out = np.zeros((32, 4))
    for lane in range(32):
        g, t = divmod(lane, 4)
        out[lane] = c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]
    return out


def measure_mma(be: Backend, sz: Sizes, arch: _archs.Arch) -> list[Measured]:
    rng = np.random.default_rng(1)
    blocks = sz.blocks_per_sm * be.sms
    threads = blocks * THREADS
    figs = []
    clock = float("nan")
    for dt in ("f16", "bf16"):
        vals = rng.integers(-1, 2, size=(32, 6, 2))
        seed = be.asarray(_pack(_bits16(vals, dt)).reshape(-1))
        out = be.zeros(threads * MMA_CHAINS * 4, np.float32)
        clk = be.zeros(2 * blocks, np.uint64)
        name = f"cal_mma_{dt}"

        def launch(name=name, seed=seed, out=out, clk=clk):
            be.launch(name, blocks, THREADS, (seed, _u32(sz.mma_iters), out, clk))

        t = be.time(launch, sz.reps)
        want = sz.mma_iters * mma_reference(vals)  # [32][4], every chain and warp alike
        got = be.get(out).reshape(blocks, THREADS // 32, 32, MMA_CHAINS, 4)
        ok = bool(np.array_equal(got, np.broadcast_to(want[None, None, :, None, :], got.shape)))
        flops = threads // 32 * MMA_CHAINS * MMA_FLOP * sz.mma_iters / t
        clock = _clock_ghz(be.get(clk))
        figs.append(
            Measured(
                f"mma_sync_{dt}",
                f"mma.sync m16n8k16 {dt} -> f32, registers only",
                flops / 1e12,
                "TFLOP/s",
                "mma_sync_flops",
                model_range(arch, "mma_sync_flops", 1e12),
                ok,
                {
                    "seconds": t,
                    "clock_ghz": clock,
                    "blocks": blocks,
                    "FLOP_per_clk_per_SM": flops / (clock * 1e9 * be.sms),
                },
            )
        )
    figs.append(
        Measured(
            "mma_sync_per_clk",
            "  bf16, per clock per SM at that clock",
            figs[-1].detail["FLOP_per_clk_per_SM"],
            "FLOP/clk/SM",
            checked=figs[-1].checked,
        )
    )
    figs.insert(
        0,
        Measured(
            "clock_tensor",
            "SM clock during the mma.sync run (cycles / %globaltimer)",
            clock,
            "GHz",
            "clock_ghz",
            model_range(arch, "clock_ghz"),
        ),
    )
    return figs


# ---------------------------------------------------------------- (b) wgmma


def wgmma_reference(words: np.ndarray, n: int, dt: str) -> np.ndarray:
    """One product D [64 x N] = A B^T (float64) of calibrate.cu's shared-memory
    image (words [64] u32 repeating; A [64 x 16] at byte 0, B [N x 16] at
    2048, both K-major without swizzle: element (mn, k) at (mn % 8) 16 +
    (mn / 8) 256 + (k % 8) 2 + (k / 8) 128 bytes: PTX ISA, canonical layouts)."""
    import ml_dtypes

    halves = np.tile(words, (2048 + 32 * n) // 256).view(np.uint16)
    vals = halves.view(np.float16 if dt == "f16" else ml_dtypes.bfloat16).astype(np.float64)

    def operand(base: int, rows: int) -> np.ndarray:
        mn, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
        off = base + (mn % 8) * 16 + (mn // 8) * 256 + (k % 8) * 2 + (k // 8) * 128
        return vals[off // 2]

    return operand(0, 64) @ operand(2048, n).T


def wgmma_fragment(d: np.ndarray) -> np.ndarray:
    """D [64 x N] as each thread's accumulators [256][N / 2] (two warpgroups
    alike): warp w4 of a warpgroup rows 16 w4 .., lane 4g + t, register 4j + i
    at row g + 8 (i >> 1), column 8j + 2t + (i & 1) (ptx.cuh)."""
    n = d.shape[1]
    tid = np.arange(THREADS)[:, None] % 128
    j = np.arange(n // 2)[None, :]
    w4, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    return d[16 * w4 + g + 8 * ((j % 4) >> 1), 8 * (j // 4) + 2 * t + (j % 2)]


def measure_wgmma(be: Backend, sz: Sizes, arch: _archs.Arch) -> list[Measured]:
    if not be.wgmma:
        return []
    rng = np.random.default_rng(2)
    blocks = be.sms
    wgs = THREADS // 128
    figs = []
    for name, (dt, n) in WGMMA_N.items():
        words = _pack(_bits16(rng.integers(-1, 2, size=(64, 2)), dt))
        seed, out = be.asarray(words), be.zeros(blocks * THREADS * n // 2, np.float32)
        clk = be.zeros(2 * blocks, np.uint64)
        flop_group = wgs * WG_PER_GROUP * 2 * 64 * n * 16  # a block's loop iteration: one group a warpgroup
        iters = max(1, int(sz.wgmma_flop / (flop_group * blocks)))
        smem = 1024 + 2048 + 32 * n

        def launch(name=name, seed=seed, out=out, clk=clk, iters=iters, smem=smem):
            be.launch(name, blocks, THREADS, (seed, _u32(iters), out, clk), smem)

        t = be.time(launch, sz.reps)
        want = wgmma_fragment(iters * WG_PER_GROUP * wgmma_reference(words, n, dt))
        got = be.get(out).reshape(blocks, THREADS, n // 2)
        ok = bool(np.array_equal(got, np.broadcast_to(want, got.shape)))
        clock = _clock_ghz(be.get(clk))
        flops = flop_group * blocks * iters / t
        per_clk = 1.0 / (t * clock * 1e9 * be.sms)
        smem_bpc = blocks * wgs * WG_PER_GROUP * iters * (2048 + 32 * n) * per_clk
        figs.append(
            Measured(
                name.removeprefix("cal_"),
                f"wgmma m64n{n}k16 {dt} -> f32, A and B from shared memory",
                flops / 1e12,
                "TFLOP/s",
                "wgmma_flops",
                model_range(arch, "wgmma_flops", 1e12),
                ok,
                {"seconds": t, "clock_ghz": clock, "iters": iters, "FLOP_per_clk_per_SM": flops * t * per_clk},
            )
        )
        if dt == "bf16" and n == max(n for d, n in WGMMA_N.values() if d == dt):
            figs.append(
                Measured(
                    f"wgmma_n{n}_per_clk",
                    "  per clock per SM at that clock",
                    flops * t * per_clk,
                    "FLOP/clk/SM",
                    checked=ok,
                )
            )
        if dt == "bf16":
            figs.append(
                Measured(
                    f"wgmma_n{n}_smem",
                    "  its operand reads from shared memory (2048 + 32 N bytes a product)",
                    smem_bpc,
                    "B/clk/SM",
                    "smem_bytes_per_clk",
                    model_range(arch, "smem_bytes_per_clk"),
                    ok,
                )
            )
    return figs


# ---------------------------------------------------------------- (c) conversions


def cvt_reference(op: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step of calibrate.cu's conversion chains (uint32 arrays):
    f16 / bf16: x' = pack(rn(x), rn(y)), y' = pack(rn(y), rn(x)), x and y read
    as float32; e4m3: x' = the f16 pair of x's two low bytes (OCP e4m3fn codes)."""
    import ml_dtypes

    if op == "e4m3":

        def dec(v: np.ndarray) -> np.ndarray:
            codes = np.stack([v & 0xFF, (v >> 8) & 0xFF], -1).astype(np.uint8)
            return _pack(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16))

        return dec(x), dec(y)
    t = np.float16 if op == "f16" else ml_dtypes.bfloat16
    xs, ys = x.view(np.float32).astype(t).view(np.uint16), y.view(np.float32).astype(t).view(np.uint16)
    return _pack(np.stack([xs, ys], -1)), _pack(np.stack([ys, xs], -1))


def cvt_inputs(op: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n uint32 inputs: finite float32 of magnitude 2^-8 .. 2^8 (no f16 / bf16
    subnormal, no overflow), or for e4m3 words whose two low bytes are
    non-NaN codes (every later step's are too: an e4m3 value's f16 has a low
    byte of 0x00 / 0x80 and a finite exponent)."""
    if op == "e4m3":
        codes = rng.integers(0, 0x7F, size=(n, 2))  # 0x00 .. 0x7e, then a random sign
        codes |= rng.integers(0, 2, size=(n, 2)) << 7
        return (codes[:, 0] | codes[:, 1] << 8 | rng.integers(0, 1 << 16, size=n) << 16).astype(np.uint32)
    mag = np.exp2(rng.uniform(-8, 8, size=n)) * rng.choice([-1.0, 1.0], size=n)
    return mag.astype(np.float32).view(np.uint32)


def measure_cvt(be: Backend, sz: Sizes, arch: _archs.Arch) -> list[Measured]:
    from . import sass as _sass

    rng = np.random.default_rng(3)
    blocks = sz.blocks_per_sm * be.sms
    n = blocks * THREADS * CVT_CHAINS * 2
    cls = next((c for c, ops in _sass.CLASSES.items() if "F2FP" in ops), "conv")
    lanes = float(arch.lanes_per_clk.get(cls, 0))
    figs = []
    ops = (
        ("f16", "cvt.rn.f16x2.f32 (F2FP pack)"),
        ("bf16", "cvt.rn.bf16x2.f32 (F2FP pack)"),
        ("e4m3", "e4m3x2 -> f16x2 (fp8.cuh decode)"),
    )
    for op, what in ops:
        host = cvt_inputs(op, n, rng)
        src, out, clk = be.asarray(host), be.zeros(n, np.uint32), be.zeros(2 * blocks, np.uint64)
        name = f"cal_cvt_{op}"
        be.launch(name, blocks, THREADS, (src, _u32(1), out, clk))
        wx, wy = cvt_reference(op, host[0::2], host[1::2])
        got = be.get(out)
        ok = bool(np.array_equal(got[0::2], wx) and np.array_equal(got[1::2], wy))

        def launch(name=name, src=src, out=out, clk=clk):
            be.launch(name, blocks, THREADS, (src, _u32(sz.cvt_iters), out, clk))

        t = be.time(launch, sz.reps)
        clock = _clock_ghz(be.get(clk))
        figs.append(
            Measured(
                f"cvt_{op}",
                f"{what}, one instruction = 2 values",
                n * sz.cvt_iters / (t * clock * 1e9 * be.sms),
                "instr/clk/SM",
                f"lanes_per_clk['{cls}'] (F2FP's sass class)",
                (lanes, lanes) if lanes else None,
                ok,
                {"seconds": t, "clock_ghz": clock},
            )
        )
    return figs


# ---------------------------------------------------------------- (d) latency


@dataclass
class Chase:
    """A single cycle over ``lines`` random 128-byte lines of ``next``."""

    next: Any  # u32 [lines x LINE_WORDS] (device)
    perm: np.ndarray  # the cycle's lines in order (host)

    @classmethod
    def build(cls, be: Backend, nbytes: int, rng: np.random.Generator) -> Chase:
        lines = nbytes // (4 * LINE_WORDS)
        perm = rng.permutation(lines).astype(np.uint32)
        p = be.asarray(perm)
        nxt = be.zeros(lines * LINE_WORDS, np.uint32)
        nxt[p * LINE_WORDS] = be.xp.roll(p, -1) * LINE_WORDS
        return cls(nxt, perm)

    def expected(self, warm: int, hops: int) -> tuple[int, int]:
        """(last index, sum of the indices visited) of ``hops`` hops after ``warm``."""
        idx = (np.arange(hops, dtype=np.int64) + warm + 1) % len(self.perm)
        last = int(self.perm[(warm + hops) % len(self.perm)]) * LINE_WORDS
        return last, int(self.perm[idx].astype(np.uint64).sum()) * LINE_WORDS % (1 << 64)


def measure_latency(be: Backend, sz: Sizes, arch: _archs.Arch, load_src: Any) -> list[Measured]:
    rng = np.random.default_rng(4)
    dram = Chase.build(be, sz.chase_dram_bytes, rng)
    l2 = Chase.build(be, sz.chase_l2_bytes, rng)
    result, done = be.zeros(4, np.uint64), be.zeros(1, np.uint32)
    loaders = sz.loaders_per_sm * be.sms
    load_out = be.zeros(2 * loaders, np.uint32)
    chunks = int(load_src.size) // (4 * sz.chunk_vecs)
    assert chunks >= 1, f"the loaders' source holds {load_src.nbytes} bytes, less than a chunk"

    def chase(c: Chase, warm: int, hops: int, loaded: bool) -> tuple[float, bool, float]:
        """Median ns a hop over reps, whether every run visited what it should,
        and the loaders' read rate (bytes/s; 0 idle)."""
        ns, rate, ok = [], [], True
        for _ in range(sz.reps):
            done.fill(0)
            grid, block = (1 + loaders, THREADS) if loaded else (1, 32)
            start = _u32(int(c.perm[0]) * LINE_WORDS)
            args = (c.next, start, _u32(warm), _u32(hops), result, done, load_src, _u32(chunks))
            be.launch("cal_chase", grid, block, args + (_u32(sz.chunk_vecs), _u32(sz.max_rounds), load_out))
            r = be.get(result)
            ok &= (int(r[0]), int(r[1])) == c.expected(warm, hops)
            ns.append(float(r[2]) / hops)
            if loaded:
                rounds = float(be.get(load_out)[1::2].astype(np.float64).sum())
                rate.append(rounds * sz.chunk_vecs * 16 / max(float(r[2]), 1.0) * 1e9)
        return statistics.median(ns), ok, statistics.median(rate) if rate else 0.0

    idle, ok_idle, _ = chase(dram, sz.chase_warm, sz.chase_hops, False)
    loaded, ok_loaded, load_bw = chase(dram, sz.chase_warm, sz.chase_hops, True)
    l2_lines = len(l2.perm)
    l2_ns, ok_l2, _ = chase(l2, l2_lines, min(2 * sz.chase_hops, l2_lines), False)
    lat = model_range(arch, "latency_ns")
    return [
        Measured(
            "dram_latency_idle",
            f"DRAM latency, one warp alone, random lines of {_size(sz.chase_dram_bytes)}",
            idle,
            "ns",
            "latency_ns (loaded)",
            lat,
            ok_idle,
        ),
        Measured(
            "dram_latency_loaded",
            f"DRAM latency, every SM streaming reads ({load_bw / 1e12:.2f} TB/s)",
            loaded,
            "ns",
            "latency_ns",
            lat,
            ok_loaded,
            {"load_read_Bps": load_bw, "loaders": loaders},
        ),
        Measured(
            "l2_latency",
            f"L2 hit latency, one warp alone, random lines of {_size(sz.chase_l2_bytes)}",
            l2_ns,
            "ns",
            "l2_latency_ns (loaded)",
            model_range(arch, "l2_latency_ns"),
            ok_l2,
        ),
    ]


# ---------------------------------------------------------------- (e) bandwidth


def measure_bandwidth(be: Backend, sz: Sizes, arch: _archs.Arch, cache: Any) -> list[Measured]:
    """cache: u32 words of seqs x tokens x kv_heads rows of row_bytes."""
    rng = np.random.default_rng(5)
    pps = sz.tokens // sz.page_size
    table = be.asarray(rng.permutation(sz.seqs * pps).astype(np.uint32))
    nbytes = int(cache.nbytes)
    vecs = nbytes // 16
    total = int(be.get(cache.sum(dtype=np.uint64))) % (1 << 32)
    per_page = cache.reshape(sz.seqs * pps, sz.page_size, sz.kv_heads, -1).sum(axis=(1, 3), dtype=np.uint64)
    want_paged = be.get(per_page[table.reshape(sz.seqs, pps)].sum(axis=1) % (1 << 32))  # [seqs][kv_heads]
    sums = be.zeros(sz.seqs * sz.kv_heads, np.uint32)
    grid = 4 * be.sms
    part = be.zeros(grid, np.uint32)
    dst = be.zeros(cache.size, np.uint32)
    row_log2, page_log2 = (sz.row_bytes // 16).bit_length() - 1, sz.page_size.bit_length() - 1
    paged_args = (cache, table, _u32(pps), _u32(sz.tokens), _u32(sz.kv_heads), _u32(row_log2), _u32(page_log2), sums)
    l2_vecs = min(vecs, sz.l2_read_bytes // 16)
    l2_passes = max(1, sz.l2_traffic_bytes // (16 * l2_vecs))  # one launch long beside its start-up
    l2_total = l2_passes * int(be.get(cache[: 4 * l2_vecs].sum(dtype=np.uint64))) % (1 << 32)

    def paged():
        be.launch("cal_paged_read", (sz.seqs, sz.kv_heads), THREADS, paged_args)

    def read():
        be.launch("cal_read", grid, THREADS, (cache, np.uint64(vecs), _u32(1), part))

    def read_l2():
        be.launch("cal_read", grid, THREADS, (cache, np.uint64(l2_vecs), _u32(l2_passes), part))

    def copy():
        be.launch("cal_copy", grid, THREADS, (cache, dst, np.uint64(vecs)))

    if be.gpu:
        stream = be.xp.cuda.get_current_stream()

        def memcpy():
            dst.data.copy_from_device_async(cache.data, nbytes, stream)
    else:

        def memcpy():
            np.copyto(dst, cache)

    def part_sum() -> int:
        return int(be.get(part).astype(np.uint64).sum()) % (1 << 32)

    reps = 2 * sz.reps
    t_paged = be.time(paged, reps)
    ok_paged = bool(np.array_equal(be.get(sums).reshape(sz.seqs, sz.kv_heads), want_paged))
    t_read = be.time(read, reps)
    ok_read = part_sum() == total
    t_l2 = be.time(read_l2, reps)
    ok_l2 = part_sum() == l2_total
    dst.fill(0)
    t_copy = be.time(copy, reps)
    ok_copy = bool(be.xp.array_equal(dst, cache))
    t_memcpy = be.time(memcpy, reps)
    memcpy_bw = 2 * nbytes / t_memcpy / 1e12
    copy_bw = model_range(arch, "copy_bw", 1e12)
    eff_256, eff_long = model_range(arch, "dram_eff_256"), model_range(arch, "dram_eff_long")
    shape = f"{sz.seqs} x {sz.tokens} tokens x {sz.kv_heads} heads, {sz.row_bytes} B rows, page {sz.page_size}"
    paged_bw, read_bw = nbytes / t_paged / 1e12, nbytes / t_read / 1e12
    return [
        Measured(
            "paged_read",
            f"paged NHD read, {_size(nbytes)} ({shape}, pages permuted)",
            paged_bw,
            "TB/s",
            "copy_bw x dram_eff_256",
            _times(copy_bw, eff_256),
            ok_paged,
            {"seconds": t_paged, "bytes": nbytes},
        ),
        Measured(
            "paged_read_eff",
            "  the same, over the measured cudaMemcpy rate",
            paged_bw / memcpy_bw,
            "x copy",
            "dram_eff_256",
            eff_256,
            ok_paged,
        ),
        Measured(
            "contiguous_read",
            "contiguous read of the same bytes",
            read_bw,
            "TB/s",
            "copy_bw x dram_eff_long",
            _times(copy_bw, eff_long),
            ok_read,
            {"seconds": t_read},
        ),
        Measured(
            "contiguous_read_eff",
            "  the same, over the measured cudaMemcpy rate",
            read_bw / memcpy_bw,
            "x copy",
            "dram_eff_long",
            eff_long,
            ok_read,
        ),
        Measured(
            "copy_kernel",
            "16-byte copy kernel of the same bytes, read + write",
            2 * nbytes / t_copy / 1e12,
            "TB/s",
            "copy_bw",
            copy_bw,
            ok_copy,
            {"seconds": t_copy},
        ),
        Measured(
            "memcpy",
            "cudaMemcpy device to device, read + write" if be.gpu else "host copy (CPU backend)",
            memcpy_bw,
            "TB/s",
            "copy_bw",
            copy_bw,
            True,
            {"seconds": t_memcpy},
        ),
        Measured(
            "l2_read",
            f"L2-resident read: {_size(16 * l2_vecs)} read {l2_passes} times in one launch",
            l2_passes * l2_vecs * 16 / t_l2 / 1e12,
            "TB/s",
            "l2_bw",
            model_range(arch, "l2_bw", 1e12),
            ok_l2,
            {"seconds": t_l2},
        ),
    ]


# ---------------------------------------------------------------- (f) launch gaps


def measure_launch_gaps(be: Backend, sz: Sizes, arch: _archs.Arch) -> list[Measured]:
    """What a small launch costs after a longer one on the stream: (first +
    second) - first alone, each timed as a whole by events, eagerly and
    replayed as a captured graph; the second ordinary, and on sm_90 a
    programmatic dependent launch (this process turns CUPAGED_PDL on). The
    check: every block of the second summed the marks the first wrote."""
    blocks = be.sms
    want = blocks * (blocks + 1) // 2
    pdl = be.cc >= (9, 0)
    if pdl and be.gpu:
        os.environ[_stream.PDL_ENV] = "1"  # the dependent launch is what is measured (the CPU runs in order)
    figs = []
    with be.side_stream() as st:
        marks, ends = be.zeros(blocks, np.uint32), be.zeros(blocks, np.uint64)
        out = be.zeros(3 * blocks, np.uint64)

        def pair(second: bool, dependent: bool = False) -> None:
            st.memset_d32(marks, 0)
            be.launch("cal_gap_first", blocks, THREADS, (np.uint64(sz.gap_spin_ns), marks, ends), stream=st)
            if second:
                be.launch("cal_gap_second", blocks, THREADS, (marks, _u32(blocks), out), dependent=dependent, stream=st)

        def graph_of(fn: Callable[[], None]) -> Callable[[], None]:
            st.begin_capture()
            fn()
            g = st.end_capture()
            return g.launch

        def checked() -> bool:
            st.synchronize()
            got = be.get(out).reshape(blocks, 3)
            return bool((got[:, 2] == want).all())

        cases = [("stream", False), ("graph", False)] + ([("graph", True)] if pdl else [])
        alone = {
            "stream": be.time(lambda: pair(False), sz.gap_reps),
            "graph": be.time(graph_of(lambda: pair(False)), sz.gap_reps),
        }
        for how, dependent in cases:
            run_pair: Callable[[], None] = functools.partial(pair, True, dependent)
            if how == "graph":
                run_pair = graph_of(run_pair)
            out.fill(0)
            t = be.time(run_pair, sz.gap_reps)
            ok = checked()
            stamps = be.get(out).reshape(blocks, 3).astype(np.int64)
            last_end = int(be.get(ends).astype(np.int64).max())
            detail = {
                "seconds_pair": t,
                "seconds_first": alone[how],
                "second_start_minus_first_end_us": (int(stamps[:, 0].min()) - last_end) / 1e3,
                "second_after_wait_minus_first_end_us": (int(stamps[:, 1].min()) - last_end) / 1e3,
            }
            if dependent:
                key, what, constant = (
                    "launch_dependent_graph",
                    "a dependent launch after the one before it, in a graph (its release and its small grid)",
                    "pdl_release_us",
                )
            else:
                where = "in a graph" if how == "graph" else "eagerly"
                key, what, constant = (
                    f"launch_gap_{how}",
                    f"a small launch after the one before it, {where}",
                    "launch_us",
                )
            cost_us = (t - alone[how]) * 1e6
            figs.append(Measured(key, what, cost_us, "us", constant, model_range(arch, constant), ok, detail))
    return figs


# ---------------------------------------------------------------- the run


def run(be: Backend, sz: Sizes, arch: _archs.Arch, errors: list[str] | None = None) -> list[Measured]:
    """Every measurement, in order (the paged cache doubles as the loaders'
    source), a progress line on stdout after each group. ``errors``: a group
    that raises is told there (its traceback on stderr) and the others still
    run; None: the exception propagates."""
    words = sz.seqs * sz.tokens * sz.kv_heads * sz.row_bytes // 4
    cache = be.xp.arange(words, dtype=np.uint32)  # hashed word indices (Knuth's multiplier, then a shift-xor)
    cache *= np.uint32(2654435761)
    cache ^= cache >> np.uint32(15)
    groups: list[tuple[str, Callable[[], list[Measured]]]] = [
        ("mma.sync", lambda: measure_mma(be, sz, arch)),
        ("wgmma", lambda: measure_wgmma(be, sz, arch)),
        ("conversions", lambda: measure_cvt(be, sz, arch)),
        ("latency", lambda: measure_latency(be, sz, arch, cache)),
        ("bandwidth", lambda: measure_bandwidth(be, sz, arch, cache)),
        ("launch gaps", lambda: measure_launch_gaps(be, sz, arch)),
    ]
    figs: list[Measured] = []
    for name, measure in groups:
        t0 = time.perf_counter()
        try:
            got = measure()
        except Exception as e:
            if errors is None:
                raise
            traceback.print_exc()
            errors.append(f"{name}: {type(e).__name__}: {e}".splitlines()[0])
            print(f"# {name}: FAILED ({errors[-1]})", flush=True)
            continue
        figs += got
        print(f"# {name}: {len(got)} figures in {time.perf_counter() - t0:.1f} s", flush=True)
    by = {f.key: f for f in figs}
    if "dram_latency_loaded" in by and "memcpy" in by:
        lat, copy = by["dram_latency_loaded"].measured, by["memcpy"].measured
        figs.append(
            Measured(
                "little_bytes_per_sm",
                "bytes in flight an SM needs (Little's law): cudaMemcpy rate x loaded latency / SMs",
                copy * 1e12 * lat * 1e-9 / be.sms / 1024,
                "KiB",
                "copy_bw x latency_ns / sms",
                _times(model_range(arch, "copy_bw"), model_range(arch, "latency_ns"), 1e9 * arch.sms * 1024),
            )
        )
    return figs


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v != v:  # NaN
        return "nan"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _fmt_range(r: Range | None) -> str:
    if r is None:
        return "n/a"
    a, b = _fmt(r[0]), _fmt(r[1])
    return a if a == b else f"{a} - {b}"


def _measured_text(f: Measured) -> str:
    return f"{_fmt(f.measured)} {f.unit}"


def _model_text(f: Measured) -> str:
    return f"{f.constant} = {_fmt_range(f.model)}" if f.constant else ""


def table(figs: Sequence[Measured], be: Backend, arch: _archs.Arch, note: str = "") -> str:
    """The report: figure | measured | model constant | ratio (to the quoted end) and where it falls."""
    w = max([len("figure")] + [len(f.what) for f in figs])
    wv = max(len(_measured_text(f)) for f in figs)
    mhead = "model constant: optimistic - pessimistic (quoted)"
    wm = max([len(mhead)] + [len(_model_text(f)) for f in figs])
    head = f"{'figure':<{w}} {'measured':>{wv}} | {mhead:<{wm}} | ratio range"
    lines = [
        f"# cupaged calibration on {be.device}, {be.sms} SMs. 'measured': MEASURED here. 'model constant': "
        f"MODELED, cupaged/tools/archs.py {arch.name} ({arch.device}), read, not changed"
        + (f"; {note}" if note else ""),
        "# ratio: measured / the model's quoted (pessimistic) end; range: where the measurement falls",
        head,
        "-" * len(head),
    ]
    for f in figs:
        ratio = f"{f.ratio:.2f}" if f.ratio is not None and f.ratio == f.ratio else "n/a"
        flag = "" if f.checked else "  CHECK FAILED"
        lines.append(
            f"{f.what:<{w}} {_measured_text(f):>{wv}} | {_model_text(f):<{wm}} | {ratio:>5} {f.place:<5}{flag}".rstrip()
        )
    return "\n".join(lines)


def _finite(d: dict) -> dict:
    """``d`` with NaN / Inf numbers (nested dicts too) as None, for strict JSON."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _finite(v)
        elif isinstance(v, float) and not np.isfinite(v):
            v = None
        out[k] = v
    return out


def _no_gpu() -> str | None:
    """Why the GPU run cannot start, or None when it can."""
    try:
        import cupy

        from .._runtime import gpu

        gpu.driver_module()
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 (any failure means: no usable GPU)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cupaged.tools.calibrate",
        description="Measure on a GPU the constants the performance model assumes (cupaged/tools/archs.py).",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    p.add_argument("--cpu", action="store_true", help="run on the CPU backend with tiny sizes (checks only)")
    args = p.parse_args(argv)
    if not args.cpu:
        why = _no_gpu()
        if why is not None:
            print(
                f"calibrate: no usable GPU ({why}); the calibration runs on a CUDA device through CuPy", file=sys.stderr
            )
            return 2
    t0 = time.perf_counter()
    be = Backend(gpu=not args.cpu)
    from . import perf_model

    arch_name, note = perf_model.arch_for(*be.cc)
    arch = _archs.get(arch_name)
    errors: list[str] = []
    figs = run(be, Sizes.tiny() if args.cpu else Sizes(), arch, errors)
    secs = time.perf_counter() - t0
    print(table(figs, be, arch, note))
    failed = [f.key for f in figs if not f.checked]
    verdict = f"CHECK FAILED: {', '.join(failed)}" if failed else "every kernel's output matched its NumPy reference"
    print(f"# {len(figs)} figures in {secs:.1f} s; {verdict}" + "".join(f"; FAILED {e}" for e in errors))
    if args.json:
        doc = {
            "tool": "cupaged.tools.calibrate",
            "label": "measured (model constants: modeled, cupaged/tools/archs.py)",
            "device": be.device,
            "backend": "gpu" if be.gpu else "cpu",
            "arch": arch.name,
            "arch_note": note,
            "sms": be.sms,
            "date": datetime.date.today().isoformat(),
            "seconds": secs,
            "figures": [_finite(dict(asdict(f), ratio=f.ratio, range=f.place)) for f in figs],
            "failed_checks": failed,
            "errors": errors,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
