"""The architecture table: per-arch launch limits (what the CUDA occupancy
rules and a launch check need) and the performance assumptions of the
model (``cupaged.tools.perf_model``), each with its source.

One table, shared by the NVRTC gate (``compile_check``: can a selected
variant launch on this arch?), the occupancy calculator
(``occupancy.py``) and the model. docs/performance.md lists the same
assumptions with the same sources; change both together.

The per-block launch limits (threads, shared memory with the opt-in,
registers) live in ``cupaged._runtime.archs.LIMITS``, which kernel selection
reads too (a variant a device cannot launch is not selected there); the
rows below take them from it, and ``launch_problems`` / ``launchable`` are
the runtime's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .._runtime import archs as _rt

KIB = 1024

#: Where the figures come from (keys used in ``Arch.sources`` and ``Figure.source``). "estimate" marks a
#: figure no published source gave; its range is wide on purpose.
SOURCES = {
    "cc": "CUDA C++ Programming Guide, 'Features and Technical Specifications', table "
    "'Technical Specifications per Compute Capability' (threads, warps, blocks, registers, shared memory "
    "per SM and per block)",
    "occ": "cuda_occupancy.h (CUDA toolkit): register allocation unit 256 per warp, 4 sub-partitions, shared "
    "memory allocation unit 128 bytes for compute capability 8.x/9.x, reservedSharedMemPerBlock (1 KiB "
    "from Ampere on), shared-memory carveout steps",
    "a100": "NVIDIA A100 datasheet / Ampere whitepaper: 108 SMs, 1.41 GHz boost, 312 TFLOP/s dense bf16, "
    "A100 80GB SXM 2,039 GB/s",
    "h200": "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 4.8 TB/s HBM3e, 1,979 TFLOP/s bf16 with "
    "sparsity (989 dense); 132 SMs (GH100 as in H100 SXM5)",
    "anchors": "/work/shared/design/anchors.md: H200 ~4.3 TB/s measured device-to-device copy (read + write), "
    "~790 TFLOP/s dense bf16 matrix product (the project's own anchors, not a publication)",
    "throughput": "CUDA C++ Programming Guide, 'Arithmetic Instructions' throughput table (results per clock per "
    "SM: fp32 add/mul/fma 64 on 8.0, 128 on 8.6/8.9/9.0; 32-bit integer 64; shuffle 32; "
    "exp2/log2/rcp (MUFU) 16; type conversions 16)",
    "issue": "Volta+ SM: 4 sub-partitions, each with one warp scheduler issuing at most one warp instruction per "
    "clock, and a warp at most one per clock on its scheduler (NVIDIA Volta/Ampere/Hopper whitepapers); "
    "shared memory 128 bytes per clock per SM (32 banks x 4 B)",
    "launch": "estimate: ~2 us per kernel node back to back in a CUDA graph (launch + drain of a small grid), "
    "3 us at the pessimistic end; to calibrate: python -m cupaged.tools.calibrate (launch gaps)",
    "pdl": "estimate: a programmatic dependent launch's blocks are resident and waiting when the grid before "
    "it ends (CUDA C++ Programming Guide, 'Programmatic Dependent Launch and Synchronization': the secondary's "
    "launch overlaps the primary); what is left is that grid's completion and memory flush before "
    "griddepcontrol.wait returns, taken as a half to a third of a graph launch's 2 - 3 us; sm_90 and later; "
    "to calibrate: python -m cupaged.tools.calibrate (launch gaps)",
    "l2cap": "L2 capacity: 50 MB (H100/H200) and 40 MB (A100), the datasheets",
}

#: The published figures the ranges below quote (each cited where it is used).
CITES = {
    "fa3": "FlashAttention-3 (Shah et al., arXiv 2407.08608): FP16 forward up to 740 TFLOP/s on H100 (75% of "
    "989); FlashAttention-2 reaches 35% of H100; section 2: mma.sync reaches only about 2/3 of Hopper's "
    "tensor peak (so 660 TFLOP/s is an upper bound for mma.sync, not a typical rate)",
    "flashmla": "FlashMLA README (github.com/deepseek-ai/FlashMLA): up to 3000 GB/s memory-bound and 580 "
    "(2025-02) / 660 (2025-04) TFLOP/s compute-bound on H800 SXM5 (3.35 TB/s, 989 TFLOP/s dense)",
    "h200nvl": "github.com/xzwgit/gpu-flops-bench README: H200 NVL (600 W) cuBLASLt dense BF16 853 TFLOP/s, measured",
    "luo": "Luo et al., 'Benchmarking and Dissecting the Nvidia Hopper GPU Architecture' (arXiv 2402.13499): "
    "wgmma reaches Hopper's tensor peak only with large N; its ~970 TFLOP/s H800 wgmma microbenchmark is "
    "quoted in NVIDIA/cutlass#2373 (a microbenchmark, not a sustained kernel)",
    "clock": "H100 SXM5: 1.83 GHz for low-precision tensor work, 1.98 GHz otherwise "
    "(glennklockwood.com/garden/processors/h100, from NVIDIA's Hopper whitepaper; 132 x 4096 FLOP/clk x "
    "1.83 GHz = 989.4 TFLOP/s, NVIDIA/cudnn-frontend#650); chips and cheese, 'Nvidia's H100: Funny L2, and "
    "Tons of Bandwidth' (2023): the power-limited H100 PCIe dropped to 1395 of its 1755 MHz (79%) under "
    "microbenchmarks, the A100 SXM held 1410 MHz",
    "memlat": "unloaded latencies from secondary pages: HBM ~400-800 cycles, L2 ~200-400, L1 ~30 "
    "(fridayswithfaraday.com, 'GPU Memory Hierarchy', H100 table); HBM ~600, L2 ~200 cycles "
    "(inferenceengineering.tech hardware cheat sheet)",
    "l2bw": "L2 bandwidth, secondary pages that disagree: ~12 TB/s (fridayswithfaraday.com, H100), ~7 TB/s "
    "(inferenceengineering.tech cheat sheet); no NVIDIA figure",
}


@dataclass(frozen=True)
class Figure:
    """One performance assumption as a range: ``opt`` (the end that makes
    a kernel faster) and ``pess`` (the end quoted), with where it comes
    from. ``exact``: a published figure both ends share."""

    opt: float
    pess: float
    unit: str
    source: str

    @property
    def exact(self) -> bool:
        return self.opt == self.pess

    def at(self, end: str) -> float:
        return self.opt if end == "opt" else self.pess

    def text(self, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
        a, b = fmt.format(self.opt / scale), fmt.format(self.pess / scale)
        return f"{a} {self.unit}" if a == b else f"{a} - {b} {self.unit}"


#: What each figure is called in reports ("what would move it").
FIGURE_NAMES = {
    "clock_ghz": "sustained SM clock",
    "latency_ns": "loaded DRAM latency",
    "l2_latency_ns": "loaded L2 latency",
    "dep_load_ns": "latency of a re-read word (L1 / L2 hit)",
    "l2_bw": "L2 bandwidth",
    "dram_eff_long": "DRAM efficiency, rows >= 1 KiB",
    "dram_eff_256": "DRAM efficiency, 256-byte rows",
    "mma_sync_flops": "mma.sync rate",
    "wgmma_flops": "wgmma rate",
    "warp_ipc": "one warp's achieved IPC",
    "sched_ipc": "a scheduler's achieved IPC",
    "bar_clk": "block barrier cost",
    "launch_us": "kernel launch in a graph",
    "pdl_release_us": "dependent launch: release after the grid before it",
}


@dataclass(frozen=True)
class Point:
    """The figures of one arch at one end of their ranges (``Arch.point``),
    in SI units."""

    name: str
    sms: int
    sub_partitions: int
    clock_hz: float
    copy_bw: float  # bytes/s reported against (not scaled)
    latency_s: float
    l2_latency_s: float
    dep_load_s: float
    l2_bw: float
    l2_bytes: int
    dram_eff_long: float
    dram_eff_256: float
    mma_sync_flops: float
    wgmma_flops: float | None
    warp_ipc: float
    sched_ipc: float
    bar_clk: float
    smem_bytes_per_clk: int
    lanes_per_clk: dict
    launch_s: float
    pdl_release_s: float | None = None  # a dependent launch's release (None: no programmatic dependent launch)

    def dram_eff(self, run_bytes: float | None) -> float:
        """DRAM efficiency (of the copy bandwidth) of a stream whose
        contiguous runs are ``run_bytes`` long: ``dram_eff_long`` from 1 KiB
        up, ``dram_eff_256`` at 256 bytes, linear in log2 of the run between
        (and beyond, below 256 bytes), at most 1; None: long runs."""
        if run_bytes is None or run_bytes >= 1024:
            return self.dram_eff_long
        x = (math.log2(max(run_bytes, 16)) - 8.0) / 2.0  # 0 at 256 B, 1 at 1 KiB
        return min(1.0, max(0.05, self.dram_eff_256 + x * (self.dram_eff_long - self.dram_eff_256)))

    def issue_per_clk(self, warps: int) -> float:
        """Warp instructions per clock an SM issues with ``warps`` warps
        ready to issue: each scheduler min(its achieved IPC, its warps x one
        warp's achieved IPC); warps spread evenly over the schedulers."""
        if warps <= 0:
            return 0.0
        q, r = divmod(int(warps), self.sub_partitions)
        return sum(min(self.sched_ipc, (q + (1 if s < r else 0)) * self.warp_ipc) for s in range(self.sub_partitions))

    def mma_fraction(self, warps: int) -> float:
        """Share of an SM's mma.sync rate ``warps`` warps can use: each
        sub-partition has its own tensor core."""
        return min(1.0, max(1, int(warps)) / self.sub_partitions)


@dataclass(frozen=True)
class Arch:
    """Limits and performance assumptions of one architecture (one
    representative device for the SM count and the rates)."""

    name: str  # "sm_90"
    device: str  # the device the SM count and rates describe
    sms: int
    # ---- launch / occupancy limits (per compute capability)
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers per warp, allocation granularity
    sub_partitions: int = 4
    smem_per_sm: int = 228 * KIB  # the largest carveout
    smem_optin_per_block: int = 227 * KIB
    smem_default_per_block: int = 48 * KIB
    smem_reserved_per_block: int = 1 * KIB
    smem_alloc_unit: int = 128
    static_smem_limit: int = 48 * KIB
    # ---- performance assumptions (empty where the arch is limits-only)
    hbm_nominal: float | None = None  # bytes/s, datasheet
    copy_bw: float | None = None  # bytes/s, achievable (read + write), the ceiling reported against
    tensor_ceiling: float | None = None  # dense bf16 FLOP/s figures are reported against
    l2_bytes: int | None = None
    smem_bytes_per_clk: int = 128  # per SM
    lanes_per_clk: dict = field(default_factory=dict)  # instruction class -> results per clock per SM
    figures: dict = field(default_factory=dict)  # name (FIGURE_NAMES) -> Figure
    sources: dict = field(default_factory=dict)

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32

    @property
    def modeled(self) -> bool:
        """Whether the performance assumptions exist (``perf_model --arch``)."""
        return bool(self.figures)

    @property
    def launch_us(self) -> float | None:
        """Per-kernel floor in a graph, the quoted (pessimistic) end."""
        f = self.figures.get("launch_us")
        return f.pess if f else None

    @property
    def wgmma(self) -> bool:
        return "wgmma_flops" in self.figures

    def point(self, end: str = "pess", flip: tuple = ()) -> Point:
        """Every figure at ``end`` ("opt" or "pess"), those named in ``flip``
        at the other end (the sensitivity of a modeled figure to one
        assumption)."""
        assert self.modeled and self.copy_bw is not None and self.l2_bytes is not None, f"{self.name}: not modeled"
        other = {"opt": "pess", "pess": "opt"}[end]

        def v(name: str) -> float:
            return self.figures[name].at(other if name in flip else end)

        return Point(
            name=self.name,
            sms=self.sms,
            sub_partitions=self.sub_partitions,
            clock_hz=v("clock_ghz") * 1e9,
            copy_bw=self.copy_bw,
            latency_s=v("latency_ns") * 1e-9,
            l2_latency_s=v("l2_latency_ns") * 1e-9,
            dep_load_s=v("dep_load_ns") * 1e-9,
            l2_bw=v("l2_bw"),
            l2_bytes=self.l2_bytes,
            dram_eff_long=v("dram_eff_long"),
            dram_eff_256=v("dram_eff_256"),
            mma_sync_flops=v("mma_sync_flops"),
            wgmma_flops=v("wgmma_flops") if self.wgmma else None,
            warp_ipc=v("warp_ipc"),
            sched_ipc=v("sched_ipc"),
            bar_clk=v("bar_clk"),
            smem_bytes_per_clk=self.smem_bytes_per_clk,
            lanes_per_clk=dict(self.lanes_per_clk),
            launch_s=v("launch_us") * 1e-6,
            pdl_release_s=v("pdl_release_us") * 1e-6 if "pdl_release_us" in self.figures else None,
        )

    def assumptions(self) -> list[tuple[str, str, str]]:
        """(figure, value, source) rows for docs and ``perf_model --assumptions``:
        ranges as "optimistic - pessimistic" (the pessimistic end is quoted)."""
        if not self.modeled:
            return []
        assert (
            self.hbm_nominal is not None
            and self.copy_bw is not None
            and self.l2_bytes is not None
            and self.tensor_ceiling is not None
        ), f"{self.name}: a modeled arch has every performance figure"
        rows = [
            ("SMs", f"{self.sms} ({self.device})", self.sources.get("sms", "")),
            ("HBM nominal", f"{self.hbm_nominal / 1e12:.2f} TB/s", self.sources.get("hbm", "")),
            (
                "HBM achievable (copy), reported against",
                f"{self.copy_bw / 1e12:.2f} TB/s",
                self.sources.get("copy", ""),
            ),
            ("L2 capacity", f"{self.l2_bytes >> 20} MiB", SOURCES["l2cap"]),
            ("shared memory bandwidth", f"{self.smem_bytes_per_clk} B/clk/SM", SOURCES["issue"]),
            ("issue limit", "1 warp instr/clk per scheduler (4 per SM), 1 per warp", SOURCES["issue"]),
            (
                "pipe rates (results/clk/SM)",
                ", ".join(f"{k} {v}" for k, v in self.lanes_per_clk.items()),
                SOURCES["throughput"],
            ),
        ]
        fmt = {
            "clock_ghz": (1.0, "{:.2f}"),
            "l2_bw": (1e12, "{:.1f}"),
            "mma_sync_flops": (1e12, "{:.0f}"),
            "wgmma_flops": (1e12, "{:.0f}"),
            "latency_ns": (1.0, "{:.0f}"),
            "l2_latency_ns": (1.0, "{:.0f}"),
            "dep_load_ns": (1.0, "{:.0f}"),
            "bar_clk": (1.0, "{:.0f}"),
            "launch_us": (1.0, "{:.1f}"),
            "pdl_release_us": (1.0, "{:.1f}"),
        }
        for name, fig in self.figures.items():
            scale, form = fmt.get(name, (1.0, "{:.2f}"))
            rows.append((FIGURE_NAMES.get(name, name), fig.text(scale, form), fig.source))
        if not self.wgmma:
            rows.append(("wgmma rate", "n/a (no wgmma)", "PTX ISA: wgmma.mma_async requires sm_90a"))
        rows += [
            (
                "tensor figure reported against",
                f"{self.tensor_ceiling / 1e12:.0f} TFLOP/s",
                self.sources.get("ceiling", ""),
            ),
            (
                "bytes in flight needed per SM",
                f"{self.little_bytes_per_sm('opt') / KIB:.1f} - {self.little_bytes_per_sm() / KIB:.1f} KiB",
                "copy bandwidth x loaded DRAM latency / SMs (Little's law)",
            ),
        ]
        return rows

    def little_bytes_per_sm(self, end: str = "pess") -> float:
        """Bytes each SM must keep in flight to sustain ``copy_bw`` at the
        loaded DRAM latency (Little's law)."""
        assert self.copy_bw is not None and self.modeled, f"{self.name}: not a modeled arch"
        return self.copy_bw * self.figures["latency_ns"].at(end) * 1e-9 / self.sms


_PIPES_80 = {"fp32": 64, "imad": 64, "alu": 64, "mufu": 16, "shfl": 32, "conv": 16, "lsu": 32}
_PIPES_90 = {"fp32": 128, "imad": 64, "alu": 64, "mufu": 16, "shfl": 32, "conv": 16, "lsu": 32}


def _common(clock: Figure, l2_bw: Figure, mma: Figure) -> dict:
    """The figures sm_80 and sm_90 share (estimates where no source was
    found), with the arch's own clock, L2 bandwidth and mma.sync rate."""
    memlat = CITES["memlat"]
    return {
        "clock_ghz": clock,
        "latency_ns": Figure(
            600.0,
            1000.0,
            "ns",
            "estimate: DRAM latency under a saturating stream, above the unloaded ~400-800 cycles "
            f"(220-440 ns at 1.83 GHz); {memlat}",
        ),
        "l2_latency_ns": Figure(
            200.0,
            400.0,
            "ns",
            f"estimate: a loaded L2 hit (far partition included), above the unloaded ~200-400 cycles; {memlat}",
        ),
        "dep_load_ns": Figure(
            20.0,
            400.0,
            "ns",
            "estimate: a word a warp loads and waits for inside a tile (a page-table word: one 128-byte line "
            f"serves 32 pages): an L1 hit (~30 cycles) to a loaded L2 hit; {memlat}",
        ),
        "l2_bw": l2_bw,
        "dram_eff_long": Figure(
            1.0,
            0.93,
            "x copy",
            f"{CITES['flashmla']}: its 3000 GB/s is 90% of the H800's nominal, as the H200's 4.3 TB/s copy is 90% "
            "of 4.8 (anchors.md): a paged stream of >= 1 KiB contiguous runs at about the copy bandwidth; the "
            "pessimistic 0.93 is an estimate",
        ),
        "dram_eff_256": Figure(
            0.95,
            0.85,
            "x copy",
            "estimate (no published figure found): 256-byte K / V rows of one KV head at a 2 KiB stride (NHD, 8 KV "
            "heads), the rows of the other heads read at other times by other blocks; shorter runs extrapolate "
            "(128-byte fp8 rows: 0.93 - 0.81)",
        ),
        "mma_sync_flops": mma,
        "warp_ipc": Figure(
            0.6,
            0.4,
            "instr/clk",
            "estimate: one warp's achieved issue rate in these loops (dependent address arithmetic, FMA / MUFU "
            "chains, waits on HMMA and LDS results); a warp issues at most 1 per clock (issue limit)",
        ),
        "sched_ipc": Figure(
            0.9,
            0.7,
            "instr/clk",
            "estimate: a scheduler's achieved issue rate with warps to choose from (issue-slot utilization of a "
            "well-fed kernel); at most 1 per clock (issue limit)",
        ),
        "bar_clk": Figure(
            20.0,
            80.0,
            "clk",
            "estimate: a block barrier whose warps arrive together, plus the skew of the slowest",
        ),
        "launch_us": Figure(2.0, 3.0, "us", SOURCES["launch"]),
    }


#: Every architecture cupaged knows. sm_86 / sm_89 carry limits only (the
#: gate's launch check); sm_80 and sm_90 also the model's assumptions.
ARCHS: dict[str, Arch] = {
    "sm_70": Arch(
        "sm_70",
        "V100 SXM2",
        80,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        smem_per_sm=96 * KIB,
        smem_optin_per_block=_rt.LIMITS["sm_70"].smem_optin_per_block,
        smem_reserved_per_block=0,
        smem_alloc_unit=256,
        sources={"limits": SOURCES["cc"] + "; " + SOURCES["occ"]},
    ),
    "sm_80": Arch(
        "sm_80",
        "A100 80GB SXM",
        108,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        smem_per_sm=164 * KIB,
        smem_optin_per_block=_rt.LIMITS["sm_80"].smem_optin_per_block,
        hbm_nominal=2.039e12,
        copy_bw=1.80e12,
        l2_bytes=40 << 20,
        lanes_per_clk=_PIPES_80,
        tensor_ceiling=312e12,
        figures=_common(
            Figure(1.41, 1.41, "GHz", f"{SOURCES['a100']}; {CITES['clock']}"),
            Figure(3.6e12, 2.8e12, "TB/s", "estimate (no published figure found): ~2x the copy bandwidth, and below"),
            Figure(
                290e12,
                250e12,
                "TFLOP/s",
                f"estimate: below the 312 TFLOP/s peak ({SOURCES['a100']}; mma.sync is Ampere's full-rate "
                "tensor instruction)",
            ),
        ),
        sources={
            "limits": SOURCES["cc"] + "; " + SOURCES["occ"],
            "sms": SOURCES["a100"],
            "hbm": SOURCES["a100"],
            "copy": "assumption: ~88% of nominal, as the H200's 4.3 of 4.8 TB/s (anchors.md); to calibrate",
            "ceiling": SOURCES["a100"],
        },
    ),
    "sm_86": Arch(
        "sm_86",
        "RTX A6000",
        84,
        max_threads_per_sm=1536,
        max_blocks_per_sm=16,
        smem_per_sm=100 * KIB,
        smem_optin_per_block=_rt.LIMITS["sm_86"].smem_optin_per_block,
        sources={"limits": SOURCES["cc"] + "; " + SOURCES["occ"]},
    ),
    "sm_89": Arch(
        "sm_89",
        "L40S",
        142,
        max_threads_per_sm=1536,
        max_blocks_per_sm=24,
        smem_per_sm=100 * KIB,
        smem_optin_per_block=_rt.LIMITS["sm_89"].smem_optin_per_block,
        sources={"limits": SOURCES["cc"] + "; " + SOURCES["occ"]},
    ),
    "sm_90": Arch(
        "sm_90",
        "H200 SXM",
        132,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        smem_per_sm=228 * KIB,
        smem_optin_per_block=_rt.LIMITS["sm_90"].smem_optin_per_block,
        hbm_nominal=4.8e12,
        copy_bw=4.3e12,
        l2_bytes=50 << 20,
        lanes_per_clk=_PIPES_90,
        tensor_ceiling=790e12,
        figures={
            **_common(
                Figure(
                    1.83,
                    1.60,
                    "GHz",
                    f"{CITES['clock']}. 1.83: the tensor clock the datasheet peak implies; 1.60: estimate of a "
                    "power-limited sustained clock under tensor load (87% of 1.83; the 700 W SXM has more room "
                    "than the 350 W PCIe card's 79%)",
                ),
                Figure(7.0e12, 5.0e12, "TB/s", f"{CITES['l2bw']}; 7.0 the lower of them, 5.0 an estimate"),
                Figure(
                    660e12,
                    527e12,
                    "TFLOP/s",
                    f"{CITES['fa3']}; 527: estimate, 2/3 of the 790 TFLOP/s a GEMM sustains here (anchors.md)",
                ),
            ),
            "wgmma_flops": Figure(
                853e12,
                790e12,
                "TFLOP/s",
                f"sustained dense bf16 GEMMs: 853 {CITES['h200nvl']}; 790 {SOURCES['anchors']}; not the 989 "
                f"datasheet peak ({CITES['luo']}; {CITES['fa3']})",
            ),
            "pdl_release_us": Figure(0.7, 1.0, "us", SOURCES["pdl"]),
        },
        sources={
            "limits": SOURCES["cc"] + "; " + SOURCES["occ"],
            "sms": SOURCES["h200"],
            "hbm": SOURCES["h200"],
            "copy": SOURCES["anchors"],
            "ceiling": SOURCES["anchors"],
        },
    ),
}

#: The archs the model has assumptions for (``perf_model --arch``).
MODELED = tuple(a for a, v in ARCHS.items() if v.modeled)
#: Archs the gate reports launchability for when it does not compile them.
WARN_ARCHS = ("sm_86", "sm_89")

_ARCH_RE = re.compile(r"^(?:sm|compute)_(\d+)[af]?$")


def get(arch: str) -> Arch:
    """The row of ``arch`` ("sm_90", "sm_90a", "compute_90" -> sm_90).
    KeyError naming the known archs otherwise."""
    m = _ARCH_RE.match(arch)
    key = f"sm_{m.group(1)}" if m else arch
    if key not in ARCHS:
        raise KeyError(f"arch {arch!r}: expected one of {', '.join(ARCHS)}")
    return ARCHS[key]


def known(arch: str) -> bool:
    try:
        get(arch)
        return True
    except KeyError:
        return False


def launch_problems(
    arch: str, static_smem: int, dynamic_smem: int, threads: int, registers: int | None = None
) -> list[str]:
    """Why a block cannot launch on ``arch`` (``cupaged._runtime.archs.launch_problems``:
    threads, static and opt-in shared memory, registers); KeyError for an
    arch this table does not know."""
    get(arch)
    return [
        p.replace(f"on {get(arch).name}", f"on {get(arch).name} ({get(arch).device})")
        for p in _rt.launch_problems(arch, static_smem, dynamic_smem, threads, registers)
    ]


def launchable(arch: str, static_smem: int, dynamic_smem: int, threads: int, registers: int | None = None) -> bool:
    """Whether such a block can launch on ``arch`` (see ``launch_problems``)."""
    return not launch_problems(arch, static_smem, dynamic_smem, threads, registers)
