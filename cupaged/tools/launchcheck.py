"""Can every variant the package would select launch on each arch?

The NVRTC gate (``compile_check``) knows each kernel's static shared memory
and registers per arch, but not the dynamic shared memory or the block size
of a launch: those come from the launch the code makes. ``selected_launches``
asks ``plan_launches`` for a grid of small probe steps (every registered
dtype and head dim, decode and prefill, GQA groups 1 / 4 / 8, MLA at 16 and
128 heads) and collects the (variant, kernel, threads, dynamic shared
memory) it would launch; ``arch_problems`` checks those against
``archs.launch_problems`` with the static figures of the gate's compile.

Selection is arch-aware (``plan_launches(..., arch=)``): each arch's rows
are checked against what that arch selects (a smaller prefill tile or the
CUDA-core MLA kernel on sm_86 / sm_89, the wgmma MLA build on sm_90).
"""

from __future__ import annotations

import inspect
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes
from .._runtime import registry as _registry
from .._runtime import source as _source
from ..ops.attention import plan_launches
from ..plan import HostPlan
from . import archs as _archs

if TYPE_CHECKING:  # compile_check imports this module
    from .compile_check import Result


@dataclass(frozen=True)
class Selected:
    source: str
    defines: tuple  # sorted (name, value) pairs
    kernel: str
    threads: int
    dynamic_smem: int
    example: str  # a probe step that selects it

    @property
    def variant(self) -> str:
        return _source.variant_name(_source.stem_of(self.source), dict(self.defines))


def _probe_dims():
    dims, mla, dts = {64, 128, 256}, {(512, 64)}, set(dtypes.QUERY_TOKENS)
    for _stem, d in _registry.all_variants():
        if "HEAD_DIM" in d:
            dims.add(int(d["HEAD_DIM"]))
        if "DIM_CAP" in d and int(d["DIM_CAP"]) <= 512:
            dims.add(int(d["DIM_CAP"]))
        if "LATENT_DIM" in d and "ROPE_DIM" in d:
            mla.add((int(d["LATENT_DIM"]), int(d["ROPE_DIM"])))
        if "CP_DTYPE" in d and dtypes.lookup(str(d["CP_DTYPE"])) is not None:
            dts.add(str(d["CP_DTYPE"]))
    return sorted(dims), sorted(mla), sorted(dts)


def _host(batch: int, kv: int, q: int, page: int = 16):
    per = -(-kv // page)
    table = np.arange(batch * per, dtype=np.int64).reshape(batch, per)
    return HostPlan.build(table, [kv] * batch, [q] * batch, page, batch * per)


def selected_launches(arch: str | None = None) -> list[Selected]:
    """Every distinct launch ``plan_launches`` selects over the probe grid
    (the largest dynamic shared memory and block seen per variant and
    kernel). ``arch`` is passed on when ``plan_launches`` takes it."""
    takes_arch = "arch" in inspect.signature(plan_launches).parameters
    kw: dict[str, Any] = {"arch": arch} if (takes_arch and arch) else {}
    dims, mla, dts = _probe_dims()
    steps = [("decode", _host(4, 64, 1)), ("prefill", _host(1, 128, 64))]
    probes = []
    for dt in dts:
        for d in dims:
            for g in (1, 4, 8):
                for kind, host in steps:
                    probes.append((f"{dt} {kind} D={d} group {g}", host, dt, 2 * g, 2, d, d, 0))
        for r, p in mla:
            for h in (16, 128):
                for kind, host in steps:
                    probes.append((f"{dt} MLA {kind} H={h} R={r} P={p}", host, dt, h, 1, r, r, p))
    found: dict = {}
    for label, host, dt, hq, hkv, d, dv, rot in probes:
        try:
            launches = plan_launches(host, dt, hq, hkv, d, dv, rot, True, True, **kw)
        except (ValueError, KeyError, NotImplementedError, StopIteration, TypeError):
            continue
        except Exception as e:  # noqa: BLE001 (a PagedAttentionError for an unsupported probe)
            if type(e).__name__ in ("PagedAttentionError",):
                continue
            raise
        for L in launches:
            key = (L.source, tuple(sorted((k, str(v)) for k, v in L.defines.items())), L.kernel)
            old = found.get(key)
            if old is None or (L.smem, L.threads) > (old.dynamic_smem, old.threads):
                found[key] = Selected(L.source, tuple(sorted(L.defines.items())), L.kernel, L.threads, L.smem, label)
    return sorted(found.values(), key=lambda s: (s.kernel, s.variant))


def arch_problems(
    results: Sequence[Result], archs: Iterable[str], selected: Iterable[Selected] | None = None
) -> list[tuple[Result, list[str]]]:
    """``(result, problems)`` for every compiled kernel row of the gate
    (``results``) that is a selected launch (``selected``: default
    ``selected_launches()``) and cannot launch on its arch."""
    rows = [r for r in results if r.compiled and r.is_entry and r.kernel]
    if not rows:
        return []
    if selected is None and all(str(r.source).endswith(".cu") for r in rows):
        return []  # --source files: nothing the package selects
    per_arch: dict = {}

    def by_arch(arch: str) -> dict:
        if arch not in per_arch:
            sel = selected if selected is not None else selected_launches(arch)
            per_arch[arch] = {(s.variant, s.kernel): s for s in sel}
        return per_arch[arch]

    out = []
    for r in rows:
        s = by_arch(r.arch).get((r.variant, r.kernel))
        if s is None or not r.arch.startswith("sm_") or not _archs.known(r.arch):
            continue
        probs = _archs.launch_problems(r.arch, r.smem, s.dynamic_smem, s.threads, r.registers)
        if probs:
            out.append((r, [f"selected ({s.example}) but cannot launch on {r.arch}: " + "; ".join(probs)]))
    return out


def arch_warnings(
    results: Sequence[Result],
    compiled_archs: Container[str],
    warn_archs: Iterable[str] = _archs.WARN_ARCHS,
    selected: Iterable[Selected] | None = None,
) -> list[str]:
    """For archs the gate did not compile (sm_86 / sm_89 by default): the
    selected launches that could not launch there, judged with the static
    shared memory and registers of the closest compiled arch (sm_80 first)."""
    todo = [a for a in warn_archs if a not in compiled_archs]
    rows = [r for r in results if r.compiled and r.is_entry and r.kernel and r.arch.startswith("sm_")]
    if not todo or not rows:
        return []
    if selected is None and all(str(r.source).endswith(".cu") for r in rows):
        return []
    ref: dict = {}
    for r in sorted(rows, key=lambda r: (r.arch != "sm_80", r.arch)):
        ref.setdefault((r.variant, r.kernel), r)
    out = []
    for arch in todo:
        by = {(s.variant, s.kernel): s for s in (selected if selected is not None else selected_launches(arch))}
        for (variant, kernel), r in sorted(ref.items()):
            s = by.get((variant, kernel))
            if s is None:
                continue
            probs = _archs.launch_problems(arch, r.smem, s.dynamic_smem, s.threads, r.registers)
            if probs:
                out.append(
                    f"{arch}: {variant} {kernel} ({s.example}) would not launch: {'; '.join(probs)} "
                    f"[static figures from {r.arch}]"
                )
    return out
