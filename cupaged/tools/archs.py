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

import re
from dataclasses import dataclass, field

from .._runtime import archs as _rt

KIB = 1024

#: Where the figures come from (keys used in ``Arch.sources``).
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
    "~790 TFLOP/s dense bf16 matrix product",
    "fa3": "FlashAttention-3 (Shah et al., arXiv 2407.08608), section 2: without wgmma, mma.sync reaches about 2/3 "
    "of Hopper's tensor-core peak",
    "wgmma": "FlashAttention-3 (Shah et al., arXiv 2407.08608), section 2: wgmma is the instruction that reaches "
    "Hopper's dense tensor-core peak (modeled at the datasheet's peak; its shared-memory operand reads are "
    "counted at 128 B/clk like ldmatrix)",
    "throughput": "CUDA C++ Programming Guide, 'Arithmetic Instructions' throughput table (results per clock per "
    "SM: fp32 add/mul/fma 64 on 8.0, 128 on 8.6/8.9/9.0; 32-bit integer 64; shuffle 32; "
    "exp2/log2/rcp (MUFU) 16; conversions 16)",
    "issue": "Volta+ SM: 4 sub-partitions, each with one warp scheduler issuing one warp instruction per clock "
    "(NVIDIA Volta/Ampere/Hopper whitepapers); shared memory 128 bytes per clock per SM (32 banks x 4 B)",
    "latency": "issue #11 / perf review: ~700 ns loaded DRAM latency used for Little's law (an assumption to "
    "calibrate on the first GPU run)",
    "l2lat": "assumption: ~300 ns loaded L2 hit latency (far partition included); to calibrate",
    "l2": "assumption (no NVIDIA figure): L2 hit bandwidth ~2x HBM copy bandwidth on H100/H200 and A100, 50 MB "
    "(H100/H200) and 40 MB (A100) L2 capacity from the datasheets",
    "launch": "assumption: ~2 us per kernel node back to back in a CUDA graph (launch + drain of a small grid); "
    "calibrated by benchmarks/bench_decode.py",
    "clock": "derived: the clock at which SMs x 4096 (sm_90) or 2048 (sm_80) dense 16-bit FLOP per clock give "
    "the datasheet's dense tensor peak (H100/H200 SXM: 989.4 TFLOP/s -> 1.83 GHz; A100: 312 -> 1.41 GHz)",
}


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
    # ---- performance assumptions (None where the arch is limits-only)
    clock_ghz: float | None = None
    hbm_nominal: float | None = None  # bytes/s, datasheet
    copy_bw: float | None = None  # bytes/s, achievable (read + write), the ceiling reported against
    latency_ns: float | None = None  # loaded DRAM latency for Little's law
    l2_latency_ns: float | None = None  # L2 hit latency (the merge reads partials the split kernel left there)
    l2_bw: float | None = None  # bytes/s
    l2_bytes: int | None = None
    smem_bytes_per_clk: int = 128  # per SM
    issue_per_clk: int = 4  # warp instructions per clock per SM
    lanes_per_clk: dict = field(default_factory=dict)  # instruction class -> results per clock per SM
    mma_sync_flops: float | None = None  # dense 16-bit mma.sync, FLOP/s (the modeled tensor rate)
    wgmma_flops: float | None = None  # dense 16-bit wgmma.mma_async (sm_90a), FLOP/s
    tensor_ceiling: float | None = None  # dense bf16 FLOP/s figures are reported against
    launch_us: float | None = None  # per kernel in a graph
    sources: dict = field(default_factory=dict)

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32

    @property
    def modeled(self) -> bool:
        """Whether the performance assumptions exist (``perf_model --arch``)."""
        return self.clock_ghz is not None

    def assumptions(self) -> list[tuple[str, str, str]]:
        """(figure, value, source) rows for docs and ``perf_model --assumptions``."""
        if not self.modeled:
            return []
        assert (
            self.hbm_nominal is not None
            and self.copy_bw is not None
            and self.latency_ns is not None
            and self.l2_latency_ns is not None
            and self.l2_bw is not None
            and self.l2_bytes is not None
            and self.mma_sync_flops is not None
            and self.tensor_ceiling is not None
            and self.launch_us is not None
        ), f"{self.name}: a modeled arch has every performance figure"
        rows = [
            ("SMs", f"{self.sms} ({self.device})", self.sources.get("sms", "")),
            ("clock", f"{self.clock_ghz:.2f} GHz", SOURCES["clock"]),
            ("HBM nominal", f"{self.hbm_nominal / 1e12:.2f} TB/s", self.sources.get("hbm", "")),
            ("HBM achievable (copy)", f"{self.copy_bw / 1e12:.2f} TB/s", self.sources.get("copy", "")),
            ("DRAM latency (Little's law)", f"{self.latency_ns:.0f} ns", SOURCES["latency"]),
            ("L2 hit latency", f"{self.l2_latency_ns:.0f} ns", SOURCES["l2lat"]),
            (
                "bytes in flight needed per SM",
                f"{self.little_bytes_per_sm() / KIB:.1f} KiB",
                "copy bandwidth x latency / SMs",
            ),
            ("L2 bandwidth / capacity", f"{self.l2_bw / 1e12:.1f} TB/s / {self.l2_bytes >> 20} MiB", SOURCES["l2"]),
            ("shared memory bandwidth", f"{self.smem_bytes_per_clk} B/clk/SM", SOURCES["issue"]),
            ("issue", f"{self.issue_per_clk} warp instr/clk/SM", SOURCES["issue"]),
            (
                "pipe rates (results/clk/SM)",
                ", ".join(f"{k} {v}" for k, v in self.lanes_per_clk.items()),
                SOURCES["throughput"],
            ),
            (
                "tensor rate, mma.sync dense 16-bit",
                f"{self.mma_sync_flops / 1e12:.0f} TFLOP/s",
                self.sources.get("mma", ""),
            ),
            (
                "tensor rate, wgmma dense 16-bit (sm_90a)",
                f"{self.wgmma_flops / 1e12:.0f} TFLOP/s" if self.wgmma_flops else "n/a (no wgmma)",
                self.sources.get("wgmma", "PTX ISA: wgmma.mma_async requires sm_90a"),
            ),
            (
                "tensor figure reported against",
                f"{self.tensor_ceiling / 1e12:.0f} TFLOP/s",
                self.sources.get("ceiling", ""),
            ),
            ("kernel launch in a graph", f"{self.launch_us:.1f} us", SOURCES["launch"]),
        ]
        return rows

    def little_bytes_per_sm(self) -> float:
        """Bytes each SM must keep in flight to sustain ``copy_bw`` at
        ``latency_ns`` (Little's law)."""
        assert self.copy_bw is not None and self.latency_ns is not None, f"{self.name}: not a modeled arch"
        return self.copy_bw * self.latency_ns * 1e-9 / self.sms


_PIPES_80 = {"fp32": 64, "imad": 64, "alu": 64, "mufu": 16, "shfl": 32, "conv": 16, "lsu": 32}
_PIPES_90 = {"fp32": 128, "imad": 64, "alu": 64, "mufu": 16, "shfl": 32, "conv": 16, "lsu": 32}

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
        clock_ghz=1.41,
        hbm_nominal=2.039e12,
        copy_bw=1.80e12,
        latency_ns=700.0,
        l2_latency_ns=300.0,
        l2_bw=3.6e12,
        l2_bytes=40 << 20,
        lanes_per_clk=_PIPES_80,
        mma_sync_flops=312e12,
        tensor_ceiling=312e12,
        launch_us=2.0,
        sources={
            "limits": SOURCES["cc"] + "; " + SOURCES["occ"],
            "sms": SOURCES["a100"],
            "hbm": SOURCES["a100"],
            "copy": "assumption: ~88% of nominal, as the H200's 4.3 of 4.8 TB/s (anchors.md); to calibrate",
            "mma": SOURCES["a100"] + " (mma.sync is Ampere's full-rate tensor instruction)",
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
        clock_ghz=1.83,
        hbm_nominal=4.8e12,
        copy_bw=4.3e12,
        latency_ns=700.0,
        l2_latency_ns=300.0,
        l2_bw=8.6e12,
        l2_bytes=50 << 20,
        lanes_per_clk=_PIPES_90,
        mma_sync_flops=989.4e12 * 2 / 3,
        wgmma_flops=989.4e12,
        tensor_ceiling=790e12,
        launch_us=2.0,
        sources={
            "limits": SOURCES["cc"] + "; " + SOURCES["occ"],
            "sms": SOURCES["h200"],
            "hbm": SOURCES["h200"],
            "copy": SOURCES["anchors"],
            "mma": SOURCES["fa3"] + "; of " + SOURCES["h200"],
            "wgmma": SOURCES["wgmma"] + "; " + SOURCES["h200"],
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
