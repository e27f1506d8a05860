"""The gate manifest: the NVRTC gate's committed record, one row per compile.

    python -m cupaged.tools.compile_check --update-manifest   # after a kernel change
    python -m cupaged.tools.compile_check --manifest [--sample N] [--seed S]

``gate_manifest.json`` beside this file holds, for every registered variant
and every arch of ``MANIFEST_ARCHS`` (an arch-specific build, ``CP_TARGET``:
its target alone), what its compile gave: each function's registers,
spills, stack frame and static shared memory, and the widest global load
per kernel. A row is keyed by ``unit_key``: a digest of the variant's
assembled source (every header inlined), the NVRTC options (the header
folder's path left out), the NVRTC version and the contents of the CUDA
headers NVRTC reads, so a row is taken for a compile only when every input
of that compile is the same as when the row was written.

``compile_check.check(..., manifest=m)`` compiles every unit whose key has no
row (a changed or new variant), takes the rest from their rows, and also
recompiles a random sample of those (``sample``), failing any whose fresh
compile differs from its row. The launch check then runs on the whole set
as it does after a full compile. A kernel change can therefore never pass
on a stale row: its key changes, so it compiles. ``--all`` (or no
``--manifest``) is the full gate, every unit compiled.

The test suite runs the manifest check and also fails when the manifest is
not current (rows missing for today's units, or rows no unit has): rerun
``--update-manifest`` and commit the file with the kernel change.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._runtime import nvrtc as _nvrtc
from .._runtime import source as _source

#: Every variant compiles for these (sm_86: the launch check of the archs
#: whose shared memory per block is smaller than sm_80's).
MANIFEST_ARCHS = ("sm_80", "sm_86", "sm_90")
#: Units recompiled and compared with their rows on every manifest check.
DEFAULT_SAMPLE = 24
PATH = Path(__file__).with_name("gate_manifest.json")
_VERSION = "gate-manifest-v1"


@functools.lru_cache(maxsize=None)
def _headers_digest(include_dir: str | None) -> str:
    """A digest of every file in the CUDA header folder (what ``-I`` gives NVRTC)."""
    if not include_dir:
        return ""
    h = hashlib.sha256()
    for p in sorted(Path(include_dir).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(include_dir)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:24]


def unit_key(text: str, opts: tuple, include_dir: str | None) -> str:
    """The row key of one compile: ``text`` (the assembled source) with
    ``opts`` (``nvrtc.gate_options``), the header folder named by its
    contents instead of its path (None: the folder ``nvrtc.gpu_options`` finds)."""
    include_dir = include_dir or _nvrtc.find_header_dir()
    portable = tuple("-I<cuda headers>" if include_dir and o == f"-I{include_dir}" else o for o in opts)
    return _source.digest(
        text, "\0".join(portable), repr(_nvrtc.nvrtc_version()), _headers_digest(include_dir), _VERSION
    )


def toolchain(include_dir: str | None = None) -> dict:
    """What every key also covers, said plainly: the NVRTC version and the
    CUDA headers' digest (a manifest written with another toolchain matches
    no unit: the gate extra pins both)."""
    include_dir = include_dir or _nvrtc.find_header_dir()
    major, minor = _nvrtc.nvrtc_version()
    return {"nvrtc": f"{major}.{minor}", "headers": _headers_digest(include_dir)}


def _report_row(rep) -> list:
    row = [int(rep.is_entry), rep.registers, rep.spill_stores, rep.spill_loads, rep.stack_frame, rep.smem]
    return row + [rep.wgmma_serialized] if rep.wgmma_serialized else row


def unit_row(variant: str, arch: str, ok: bool, reports: dict, wide: dict) -> dict:
    """One manifest row: ``reports`` (function -> ``nvrtc.FunctionReport``)
    as [entry, registers, spill stores, spill loads, stack, smem] lists (and, where ptxas serialized its
    wgmma, why)."""
    return {
        "variant": variant,
        "arch": arch,
        "ok": bool(ok),
        "functions": {fn: _report_row(r) for fn, r in sorted(reports.items())},
        "wide": {k: int(v) for k, v in sorted(wide.items())},
    }


def row_reports(row: dict) -> dict:
    """``nvrtc.FunctionReport`` per function, from a row."""
    out = {}
    for fn, (entry, regs, st, ld, stack, smem, *serial) in row["functions"].items():
        out[fn] = _nvrtc.FunctionReport(
            fn,
            is_entry=bool(entry),
            registers=regs,
            spill_stores=st,
            spill_loads=ld,
            stack_frame=stack,
            smem=smem,
            wgmma_serialized=serial[0] if serial else "",
        )
    return out


def differences(row: dict, fresh: dict) -> list[str]:
    """What a fresh compile's row says that the recorded row does not."""
    out = []
    if row["ok"] != fresh["ok"]:
        out.append(f"compiled {fresh['ok']}, recorded {row['ok']}")
    names = ("entry", "registers", "spill stores", "spill loads", "stack", "smem")
    for fn in sorted(set(row["functions"]) | set(fresh["functions"])):
        a, b = row["functions"].get(fn), fresh["functions"].get(fn)
        if a is None or b is None:
            out.append(f"{fn}: {'new' if a is None else 'gone'} in the fresh compile")
            continue
        out += [f"{fn}: {n} {y}, recorded {x}" for n, x, y in zip(names, a, b) if x != y]
    if row["wide"] != fresh["wide"]:
        out.append(f"widest loads {fresh['wide']}, recorded {row['wide']}")
    return out


@dataclass
class Manifest:
    """The rows (key -> row) and, after a check, what it found: ``used``
    (keys a unit took or wrote), ``missing`` (units with no row, compiled),
    ``sampled`` (keys recompiled and compared)."""

    rows: dict
    sample: int = DEFAULT_SAMPLE
    seed: int | None = None
    toolchain: dict | None = None  # the toolchain the rows were written with (``toolchain()``)

    def __post_init__(self) -> None:
        self.used: set = set()
        self.missing: list = []
        self.sampled: list = []
        self.fresh: dict = {}
        if self.seed is None:
            env = os.environ.get("CUPAGED_GATE_SEED")
            self.seed = int(env) if env else random.SystemRandom().randrange(1 << 30)

    def pick_sample(self, keys: list) -> set:
        """The keys among ``keys`` (units with a row) to recompile: ``sample``
        of them, drawn with ``seed`` (printed by the gate, so a failing draw
        can be repeated with ``CUPAGED_GATE_SEED``)."""
        keys = sorted(set(keys))
        return set(random.Random(self.seed).sample(keys, min(self.sample, len(keys))))

    def record(self, key: str, row: dict, sampled: bool) -> None:
        """A unit of the check: its key, and its row from a compile (or from
        its own row when it was not compiled)."""
        self.used.add(key)
        if key not in self.rows:
            self.missing.append(key)
            self.fresh[key] = row
        elif sampled:
            self.sampled.append(key)
            self.fresh[key] = row

    def rows_now(self) -> dict:
        """The rows of today's units: fresh compiles first, then the rows kept."""
        return {k: self.fresh.get(k, self.rows.get(k)) for k in self.used}

    def stale(self) -> list:
        """Rows no unit of the check used (a variant gone or changed)."""
        return sorted(k for k in self.rows if k not in self.used)

    def current(self) -> bool:
        return not self.missing and not self.stale()

    def status(self) -> str:
        return (
            f"gate manifest: {len(self.used) - len(self.missing)} compiles from their rows, "
            f"{len(self.missing)} without a row compiled, {len(self.sampled)} recompiled and compared "
            f"(seed {self.seed}: CUPAGED_GATE_SEED={self.seed} repeats the draw), {len(self.stale())} stale rows"
        )


def load(path: Path | None = None, **kw: Any) -> Manifest:
    """The committed manifest (``PATH``; no file: an empty one, every unit
    compiles). ``kw``: ``sample``, ``seed``."""
    try:
        data = json.loads(Path(path or PATH).read_text())
    except FileNotFoundError:
        data = {"version": _VERSION, "rows": {}}
    if data.get("version") != _VERSION:
        data = {"rows": {}}
    return Manifest(dict(data["rows"]), toolchain=data.get("toolchain"), **kw)


def write(rows: dict, path: Path | None = None) -> None:
    """Write ``rows`` (key -> row), one row a line, sorted by variant and arch
    (a kernel change shows as the rows it changed)."""
    items = sorted(rows.items(), key=lambda kv: (kv[1]["variant"], kv[1]["arch"], kv[0]))
    lines = [f"  {json.dumps(k)}: {json.dumps(r, sort_keys=True, separators=(',', ':'))}" for k, r in items]
    text = (
        "{\n"
        + f'"version": {json.dumps(_VERSION)},\n"toolchain": {json.dumps(toolchain())},\n"rows": {{\n'
        + ",\n".join(lines)
        + "\n}\n}\n"
    )
    path = Path(path or PATH)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
