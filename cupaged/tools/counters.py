"""Tensor-core work counted by running a kernel on the CPU backend.

The CPU versions of the ``kernels_cu/ptx.cuh`` helpers count what they
execute (one count per warp-wide ``mma.sync`` m16n8k16 and ``ldmatrix.x4``
(plain / ``.trans``), one per thread's 16-byte ``cp.async``, valid or
zero-fill), in the kernel module's ``cupaged_ptx_counters()``. ``read`` /
``reset`` reach them through ctypes; ``probe`` runs one attention launch
at a small shape through the public API (``DevicePlan.attention`` /
``.mla`` on NumPy arrays), at two context lengths, and returns the counts
per block as ``intercept + slope * tokens``: the per-token slope is the
work of the K/V loop, whatever the kernel's tile size.

Which launch runs is ``plan_launches``' answer for the probe's plan, so a
kernel rewrite needs nothing here; ``probe`` checks that the probe plan
selects the same kernel and defines as the modeled launch and says so
when it does not.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .. import dtypes
from .._runtime import cpu_arch, cpu_arch_override, get_kernel
from .._runtime import source as _source
from .._runtime.cpu import CpuModule
from ..ops.attention import plan_launches
from ..ops.attention.schedule import Launch
from ..plan import HostPlan

NAMES_FALLBACK = ("mma_16816", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async_16", "cp_async_16_zero")
#: Bytes of shared memory one counted operation reads or writes (per warp
#: for ldmatrix.x4: four 8x8 tiles of 16-bit; per thread for cp.async; the
#: wgmma counter counts its operand bytes itself, see ptx.cuh).
SMEM_BYTES = {
    "ldmatrix_x4": 512,
    "ldmatrix_x4_trans": 512,
    "cp_async_16": 16,
    "cp_async_16_zero": 16,
    "wgmma_smem_bytes": 1,
}
#: FLOP of one m16n8k16 product.
MMA_FLOP = 2 * 16 * 8 * 16
#: The wgmma counters (ptx.cuh's sm_90a block, cupaged_wgmma_counters()):
#: warp-part instructions, their FLOP, their shared-memory operand bytes.
WGMMA_NAMES = ("wgmma", "wgmma_flop", "wgmma_smem_bytes")


def _lib(module: CpuModule) -> ctypes.CDLL:
    # The module's own handle (dlopen of the same path returns it).
    return ctypes.CDLL(str(module.path), mode=os.RTLD_NOW | os.RTLD_LOCAL)


def names(module: CpuModule, which: str = "ptx") -> tuple[str, ...] | None:
    """Counter names of a CPU module (``which``: "ptx", the mma / ldmatrix /
    cp.async block; "wgmma"; "marker", the cold-path marker), or None when
    it has no such counters."""
    lib = _lib(module)
    try:
        fn = getattr(lib, f"cupaged_{which}_counter_names")
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return tuple(fn().decode().split(","))


def _arrays(module: CpuModule):
    lib = _lib(module)
    out = []
    for which in ("ptx", "wgmma", "marker"):
        n = names(module, which)
        if n is None:
            continue
        fn = getattr(lib, f"cupaged_{which}_counters")
        fn.restype = ctypes.POINTER(ctypes.c_ulonglong * len(n))
        out.append((n, fn().contents))
    return out


def read(module: CpuModule) -> dict | None:
    """``{name: count}`` of a CPU module's mma / ldmatrix / cp.async
    counters (ptx.cuh), None without them."""
    arrays = _arrays(module)
    if not arrays or arrays[0][0] != names(module, "ptx"):
        return None
    n, arr = arrays[0]
    return {k: int(v) for k, v in zip(n, arr)}


def read_all(module: CpuModule) -> dict | None:
    """``read`` plus the wgmma and cold-path marker counters of ptx.cuh's
    sm_90a and marker blocks, None without any."""
    arrays = _arrays(module)
    if not arrays:
        return None
    return {k: int(v) for n, arr in arrays for k, v in zip(n, arr)}


def reset(module: CpuModule) -> None:
    """Zero a CPU module's counters and turn its counting on (off until
    then: a module that is never reset counts nothing, ptx.cuh)."""
    for n, arr in _arrays(module):
        for i in range(len(n)):
            arr[i] = 0
    lib = _lib(module)
    if hasattr(lib, "cupaged_ptx_counting"):
        lib.cupaged_ptx_counting.restype = None
        lib.cupaged_ptx_counting.argtypes = [ctypes.c_int]
        lib.cupaged_ptx_counting(1)


# ---------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------


@dataclass
class Probe:
    """Per-block counts of one launch as ``intercept + slope * tokens``
    (tokens a block visits), from runs at ``lengths`` context tokens."""

    kernel: str
    defines: dict
    blocks: int  # blocks of each probe run (counts are divided by it)
    queries_per_block: int
    lengths: tuple
    intercept: dict
    slope: dict
    note: str = ""

    def per_block(self, name: str, tokens: float) -> float:
        return self.intercept.get(name, 0.0) + self.slope.get(name, 0.0) * tokens

    def smem_bytes(self, tokens: float) -> float:
        return sum(SMEM_BYTES[k] * self.per_block(k, tokens) for k in SMEM_BYTES)

    def as_dict(self) -> dict:
        return asdict(self)


def _cache_dir() -> Path:
    base = os.environ.get("CUPAGED_CACHE_DIR")
    if base:
        return Path(base) / "perf"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cupaged" / "perf"


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _plan_for(tokens: int, q_len: int, page_size: int):
    pages = -(-tokens // page_size)
    table = np.arange(pages, dtype=np.int64).reshape(1, pages)
    return HostPlan.build(table, [tokens], [q_len], page_size, pages)


def _launches(
    host, dtype: str, hq: int, hkv: int, d: int, dv: int, rot: int, arch: str | None = None, kv_dtype: str | None = None
):
    return plan_launches(host, dtype, hq, hkv, d, dv, rot, True, True, arch=arch, kv_dtype=kv_dtype)


def _run(host, np_dtype, hq, hkv, d, dv, rot, seed=0, kv_dtype: str | None = None, causal: bool = True) -> None:
    """One probe launch; ``kv_dtype``: an fp8 cache format (random codes of
    standard normal values, scales 1), else the caches have q's dtype."""
    rng = np.random.default_rng(seed)
    kv_np = np_dtype if kv_dtype is None else dtypes.np_dtype(kv_dtype)
    ps, pages, q = host.page_size, host.pages, host.queries
    plan = host.upload(np.zeros(1, np.float32))
    if rot:
        latent = _rand(rng, (pages, ps, 1, d), np_dtype)
        k_pos = _rand(rng, (pages, ps, 1, rot), np_dtype)
        plan.mla(_rand(rng, (q, hq, d), np_dtype), _rand(rng, (q, hq, rot), np_dtype), latent, k_pos, d**-0.5, causal)
    else:
        k = _rand(rng, (pages, ps, hkv, d), kv_np)
        v = _rand(rng, (pages, ps, hkv, dv), kv_np)
        plan.attention(
            _rand(rng, (q, hq, d), np_dtype),
            k,
            v,
            d**-0.5,
            causal,
            **({} if kv_dtype is None else {"kv_dtype": kv_dtype}),
        )


def probe(
    launch: Launch,
    *,
    dtype: str,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    rot: int,
    page_size: int,
    lengths: Sequence[int] = (256, 512),
    use_cache: bool = True,
    arch: str | None = None,
    kv_dtype: str | None = None,
    causal: bool = True,
) -> Probe:
    """Counts per block of ``launch`` (a ``plan_launches`` record of the
    modeled shape, for ``arch``): one sequence with the launch's queries per
    block (its last positions), one KV head with its whole group (``hq //
    hkv`` query heads), ``causal`` as the modeled shapes are (so the edge
    tiles of the causal diagonal are counted, per block: the intercept), at
    each of ``lengths`` tokens (caches of ``kv_dtype``, an
    fp8 format, when given, else of ``dtype``), on the CPU backend standing
    in for ``arch`` (so it runs the build that arch selects; None: the arch
    the CPU backend stands in for, ``cpu_arch()``); cached on disk by the
    kernel source and the probe shape. ProbeError when the CPU module has no
    counters or the probe plan selects another kernel."""
    arch = arch or cpu_arch()  # the plan below and the run are for the arch the CPU runs as
    group = hq // hkv
    qpb = max(1, -(-launch.q_count // launch.blocks))
    text = _source.assemble(launch.source, launch.defines)
    key = _source.digest(
        text,
        json.dumps([launch.kernel, dtype, kv_dtype, group, d, dv, rot, page_size, qpb, list(lengths), causal]),
        "counters-v3",
    )
    path = _cache_dir() / f"counters-{key}.json"
    if use_cache:
        try:
            return Probe(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass

    np_dtype = dtypes.np_dtype(dtype)
    counts, blocks = [], 1
    for tokens in lengths:
        host = _plan_for(tokens, qpb, page_size)
        ls = _launches(host, dtype, group, 1, d, dv, rot, arch, kv_dtype)
        if len(ls) != 1 or ls[0].kernel != launch.kernel or ls[0].defines != launch.defines:
            got = "; ".join(f"{x.kernel} {x.defines}" for x in ls)
            raise ProbeError(f"the probe plan selects {got}, not {launch.kernel} {launch.defines}")
        blocks = ls[0].blocks * ls[0].tiles
        mod = get_kernel(np.zeros(1, np.float32), launch.source, launch.kernel, launch.defines).module
        if read(mod) is None:
            # ptx.cuh (the one file with inline PTX) is not in this module: no
            # mma, ldmatrix or cp.async to count, nothing to run.
            zero = dict.fromkeys(NAMES_FALLBACK, 0.0)
            result = Probe(
                launch.kernel,
                dict(launch.defines),
                blocks,
                qpb,
                tuple(lengths),
                zero,
                dict(zero),
                "no ptx.cuh helpers in this kernel's module",
            )
            break
        reset(mod)
        with cpu_arch_override(arch):
            _run(host, np_dtype, group, 1, d, dv, rot, kv_dtype=kv_dtype, causal=causal)
        found = read_all(mod)
        assert found is not None  # read(mod) found its counters
        counts.append(found)
    else:
        result = None
    if result is None:
        (l0, c0), (l1, c1) = (lengths[0], counts[0]), (lengths[-1], counts[-1])
        slope = {k: (c1[k] - c0[k]) / blocks / (l1 - l0) for k in c0}
        intercept = {k: c0[k] / blocks - slope[k] * l0 for k in c0}
        result = Probe(launch.kernel, dict(launch.defines), blocks, qpb, tuple(lengths), intercept, slope)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.as_dict()))
        os.replace(tmp, path)
    except OSError:
        pass
    return result


class ProbeError(RuntimeError):
    """The probe could not reproduce the launch (the message says why)."""
