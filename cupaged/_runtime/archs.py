"""Per-architecture launch limits, and the architecture a launch targets.

The one table of what a block may use on each compute capability (threads,
shared memory with the opt-in, registers): kernel selection
(``cupaged.ops.attention.variants``) does not pick a variant a device cannot
launch, and the tools (``cupaged.tools.archs``: the NVRTC gate's launch
check, the occupancy rules, the performance model) read the same figures.

``device_arch(like)`` is the arch of an array's device: ``sm_<major><minor>``
of a CuPy array's GPU, or for the CPU backend the arch it stands in for,
``CUPAGED_CPU_ARCH`` (default ``sm_90``, the H200 the project targets): the
CPU backend runs exactly the variants that arch would run (tests switch it
with ``cpu_arch(...)``).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import PagedAttentionError
from .arrays import GPU, Array, array_backend, device_id

KIB = 1024


@dataclass(frozen=True)
class BlockLimits:
    """What one block may use on an arch (CUDA C++ Programming Guide,
    'Technical Specifications per Compute Capability'; cuda_occupancy.h for
    the allocation units)."""

    max_threads_per_block: int = 1024
    smem_optin_per_block: int = 227 * KIB  # static + dynamic, with cudaFuncAttributeMaxDynamicSharedMemorySize
    static_smem_limit: int = 48 * KIB
    regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers per warp, allocation granularity
    sub_partitions: int = 4


#: Launch limits per arch ("sm_90a" code runs on sm_90 devices: same row).
LIMITS: dict[str, BlockLimits] = {
    "sm_70": BlockLimits(smem_optin_per_block=96 * KIB),
    "sm_80": BlockLimits(smem_optin_per_block=163 * KIB),
    "sm_86": BlockLimits(smem_optin_per_block=99 * KIB),
    "sm_89": BlockLimits(smem_optin_per_block=99 * KIB),
    "sm_90": BlockLimits(smem_optin_per_block=227 * KIB),
}

_ARCH_RE = re.compile(r"^(?:sm|compute)_(\d+)[af]?$")


def base_arch(arch: str) -> str:
    """``sm_90a`` / ``compute_90`` -> ``sm_90``; ValueError for a malformed name."""
    m = _ARCH_RE.match(arch)
    if not m:
        raise ValueError(f"arch: expected sm_XX, sm_XXa or compute_XX, got {arch!r}")
    return f"sm_{m.group(1)}"


def limits(arch: str) -> BlockLimits | None:
    """The row of ``arch`` (``sm_90a`` reads ``sm_90``), None when unknown."""
    return LIMITS.get(base_arch(arch))


def launch_problems(
    arch: str, static_smem: int, dynamic_smem: int, threads: int, registers: int | None = None
) -> list[str]:
    """Why a block of ``threads`` threads with ``static_smem`` +
    ``dynamic_smem`` bytes of shared memory (and ``registers`` per thread,
    when given) cannot launch on ``arch``; empty when it can (with the
    shared-memory opt-in, as cupaged's GPU backend sets it) or when the arch
    is not in the table."""
    a = limits(arch)
    if a is None:
        return []
    name = base_arch(arch)
    out = []
    if not 1 <= threads <= a.max_threads_per_block:
        out.append(f"{threads} threads per block: {name} allows 1..{a.max_threads_per_block}")
    if static_smem > a.static_smem_limit:
        out.append(f"static shared memory {static_smem} B > {a.static_smem_limit} B ({name})")
    total = static_smem + dynamic_smem
    if total > a.smem_optin_per_block:
        out.append(
            f"shared memory {static_smem} static + {dynamic_smem} dynamic = {total} B > "
            f"{a.smem_optin_per_block} B opt-in limit per block on {name}"
        )
    if registers is not None:
        warps = -(-threads // 32)
        per_warp = -(-registers * 32 // a.reg_alloc_unit) * a.reg_alloc_unit
        if registers > a.max_regs_per_thread:
            out.append(f"{registers} registers per thread > {a.max_regs_per_thread} ({name})")
        elif per_warp * (-(-warps // a.sub_partitions) * a.sub_partitions) > a.regs_per_block:
            out.append(
                f"{registers} registers x {threads} threads exceed {a.regs_per_block} registers per block ({name})"
            )
    return out


def launchable(
    arch: str | None, static_smem: int, dynamic_smem: int, threads: int, registers: int | None = None
) -> bool:
    """Whether such a block launches on ``arch`` (always, for ``None``)."""
    return arch is None or not launch_problems(arch, static_smem, dynamic_smem, threads, registers)


# ---------------------------------------------------------------------------
# The arch a launch targets
# ---------------------------------------------------------------------------

#: The arch the CPU backend stands in for unless CUPAGED_CPU_ARCH says otherwise.
DEFAULT_CPU_ARCH = "sm_90"
_override = threading.local()


def cpu_arch() -> str:
    """The arch whose variants the CPU backend runs: the innermost
    ``with cpu_arch_override(...)`` of this thread, else ``CUPAGED_CPU_ARCH``,
    else ``sm_90``."""
    arch = getattr(_override, "arch", None)
    if arch is None:
        arch = os.environ.get("CUPAGED_CPU_ARCH", "").strip() or DEFAULT_CPU_ARCH
        if base_arch_or_none(arch) not in LIMITS:
            raise PagedAttentionError(f"CUPAGED_CPU_ARCH: expected one of {', '.join(LIMITS)}, got {arch!r}")
    return base_arch(arch)


def base_arch_or_none(arch: str) -> str | None:
    try:
        return base_arch(arch)
    except ValueError:
        return None


@contextlib.contextmanager
def cpu_arch_override(arch: str) -> Iterator[None]:
    """Run the CPU backend as ``arch`` inside the block (this thread)."""
    if base_arch_or_none(arch) not in LIMITS:
        raise PagedAttentionError(f"arch: expected one of {', '.join(LIMITS)}, got {arch!r}")
    old = getattr(_override, "arch", None)
    _override.arch = base_arch(arch)
    try:
        yield
    finally:
        _override.arch = old


_gpu_arch: dict[int, str] = {}


def device_arch(like: Array) -> str:
    """``sm_<major><minor>`` of ``like``'s device: its GPU's compute
    capability (cached per device), or for a NumPy array ``cpu_arch()``."""
    if array_backend(like) != GPU:
        return cpu_arch()
    dev = device_id(like)
    arch = _gpu_arch.get(dev)
    if arch is None:
        import cupy

        cc = cupy.cuda.Device(dev).compute_capability  # "90"
        arch = _gpu_arch[dev] = f"sm_{cc}"
    return arch
