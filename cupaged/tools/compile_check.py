"""The NVRTC gate: compile every kernel variant for real GPUs, on any machine.

    python -m cupaged.tools.compile_check [--arch sm_80,sm_90] [--filter SUBSTR]
        [--jobs N] [--require-v4 KERNEL_SUBSTR ...] [--max-stack BYTES]
        [--json] [--keep-ptx DIR] [--no-cache] [--source PATH -D NAME=VAL ...]
        [--all | --manifest | --update-manifest] [--sample N] [--seed S]

Every variant the package registers (``cupaged._runtime.registry.all_variants()`` after importing ``cupaged.ops``) is
assembled exactly as the GPU backend assembles it (``cupaged._runtime.source``) and
compiled through ``cuda.bindings.nvrtc`` with the GPU backend's options
(``cupaged._runtime.nvrtc.gate_options``) to PTX and cubin for each architecture; no
GPU and no driver are needed. An arch-specific variant (``CP_TARGET=sm_90a``: the
wgmma MLA kernel) compiles for its target alone, in place of sm_90. For each kernel the table shows registers,
spill stores / loads, stack frame and static shared memory from the ptxas
report, and whether the PTX has a 128-bit global load (``ld.global[.nc].v4.*``
of 32-bit elements, ``.v2`` of 64-bit ones, or a 16-byte ``cp.async``);
"ms" is the NVRTC time of the whole variant for that architecture.

Results are cached on disk (``default_cache_dir()``), keyed by a digest of
the assembled source, the options, the NVRTC version and the header folder,
so a rerun only compiles what changed; ``--no-cache`` recompiles everything.

Launch check (``cupaged.tools.launchcheck``): a kernel of a variant that
``plan_launches`` would select fails on a compiled arch where it cannot
launch (static + dynamic shared memory over the arch's opt-in limit, too
many threads or registers; limits in ``cupaged.tools.archs``). For sm_86 and
sm_89, when not compiled, the same check is reported as a warning list
(static figures from the closest compiled arch); it does not fail the gate.

Exit status: 0 when everything compiled with no spills (also when no variant
is registered yet: a warning says so); 1 on a compile error, a spill, a
kernel whose wgmma ptxas serialized (its log's "Potential Performance
Loss"), a ``--require-v4`` kernel without 128-bit global loads, a ``--require-v4``
pattern that matches no kernel, a stack frame over ``--max-stack``, or a
selected variant that cannot launch on a compiled arch; 2 on a usage error.

``--source PATH`` (repeatable, with ``-D NAME=VAL`` defines for all of them)
compiles those files instead of the registered variants.

``--manifest`` checks the registered variants against the committed gate
manifest instead of compiling them all (``cupaged.tools.gate_manifest``:
units whose inputs changed compile, a random sample of the rest is
recompiled and compared, and a manifest that is not current fails);
``--update-manifest`` rewrites it. ``--all`` (the default) compiles every
unit. Without cuda-python, NVRTC or the CUDA headers the gate prints one
line naming the ``gate`` extra and exits 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import ops  # noqa: F401  (importing the op modules registers every variant)
from .._runtime import nvrtc as _nvrtc
from .._runtime import registry as _registry
from .._runtime import source as _source
from . import gate_manifest as _manifest
from . import launchcheck as _launchcheck

DEFAULT_ARCHS = ("sm_80", "sm_90")
_ARCH = re.compile(r"^(sm|compute)_\d+[af]?$")


@dataclass
class Result:
    """One kernel of one variant compiled for one architecture (or, with
    ``kernel == ""``, a variant that failed to compile)."""

    variant: str
    kernel: str
    arch: str
    compiled: bool
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    smem: int = 0
    wide_load_bits: int = 0  # widest global load per thread in the PTX
    is_entry: bool = True  # False for a device function ptxas kept out of line
    seconds: float = 0.0  # NVRTC time for the whole variant on this arch
    cached: bool = False  # read from the gate's disk cache (seconds: of the original run)
    problems: list = field(default_factory=list)
    source: str = ""
    defines: dict = field(default_factory=dict)
    log: str = field(default="", repr=False)
    ptx: str = field(default="", repr=False)

    @property
    def v4(self) -> bool:
        """The PTX has at least one 128-bit global load."""
        return self.wide_load_bits >= 128

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self, with_text: bool = False) -> dict:
        d = asdict(self)
        d["v4"] = self.v4
        d["ok"] = self.ok
        d.pop("ptx")
        if not with_text:
            d.pop("log")
        return d


def default_cache_dir() -> Path:
    """Where gate results are cached: ``$CUPAGED_CACHE_DIR/gate``, else
    ``$XDG_CACHE_HOME/cupaged/gate``, else ``~/.cache/cupaged/gate``."""
    base = os.environ.get("CUPAGED_CACHE_DIR")
    if base:
        return Path(base) / "gate"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cupaged" / "gate"


@dataclass
class _Unit:
    """What the gate keeps of one compile (all a Result needs but the PTX)."""

    ok: bool
    log: str
    wide: dict
    seconds: float
    ptx: str = ""
    cached: bool = False
    reports: dict | None = None  # from a manifest row (else parsed from the log)


def _cache_key(text: str, opts: tuple, include_dir: str | None) -> str:
    # The headers reached through -I are outside the text: key on the folder
    # and the CUDA version it declares, besides NVRTC's own version.
    inc = Path(include_dir) if include_dir else None
    hdr = f"{inc}:{_nvrtc._cuda_major_of(inc)}" if inc else ""
    return _source.digest(text, "\0".join(opts), repr(_nvrtc.nvrtc_version()), hdr, "gate-v1")


def _compile_unit(
    text: str, arch: str, name: str, include_dir: str | None, cache_dir: Path | None, want_ptx: bool
) -> _Unit:
    opts = _nvrtc.gate_options(arch, include_dir)
    path = None
    if cache_dir is not None:
        path = cache_dir / f"{_cache_key(text, opts, include_dir)}.json"
        if not want_ptx:
            try:
                d = json.loads(path.read_text())
                return _Unit(d["ok"], d["log"], d["wide"], d["seconds"], cached=True)
            except (OSError, ValueError, KeyError):
                pass
    c = _nvrtc.compile_source(text, arch, name=name, options=opts)
    u = _Unit(c.ok, c.log, _nvrtc.kernel_wide_loads(c.ptx) if c.ok else {}, c.seconds, c.ptx)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{id(u)}.tmp")
            tmp.write_text(json.dumps({"ok": u.ok, "log": u.log, "wide": u.wide, "seconds": u.seconds}))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: no cache, same answers
    return u


def _process_pool(jobs: int) -> ProcessPoolExecutor:
    """Worker processes, not threads: cuda-python releases the GIL around
    nvrtcCompileProgram, but compiles in threads of one process were measured
    to run one at a time (2 threads: no faster than 1; 2 processes: 2x).
    Fork when this process has a single thread (cheap start), else spawn."""
    method = "fork" if sys.platform.startswith("linux") and threading.active_count() == 1 else "spawn"
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method))


def check(
    variants: Iterable[tuple[str | Path, Mapping[str, object] | None]] | None = None,
    archs: Iterable[str] = DEFAULT_ARCHS,
    *,
    filter: str | None = None,
    jobs: int = 1,
    require_v4: Iterable[str] = (),
    max_stack: int | None = None,
    include_dir: str | None = None,
    cache_dir: Path | None = None,
    keep_ptx: bool = False,
    launches: Sequence[_launchcheck.Selected] | None = None,
    manifest: _manifest.Manifest | None = None,
) -> list[Result]:
    """Compile ``variants`` (``(stem or path, defines)`` pairs; default: every
    registered variant) for each of ``archs`` and return one Result per kernel
    (per variant and arch), sorted by kernel, variant, arch.

    ``filter`` keeps variants whose name, or kernels whose name, contains it.
    ``require_v4`` lists kernel-name substrings whose PTX must hold a 128-bit
    global load. ``max_stack`` fails a stack frame above that many bytes.
    A compile error gives one Result with ``kernel == ""`` and the log.

    ``cache_dir`` (default: none) caches each compile's log and load widths
    on disk, keyed by a digest of the source text, the options, the NVRTC
    version and the header folder; a cached Result has ``cached=True`` and
    the compile time of its original run, and no PTX. ``keep_ptx`` compiles
    anyway so that every Result carries its PTX.

    ``launches``: the selected launches for the launch check (default:
    ``launchcheck.selected_launches()`` when a package variant is compiled);
    a kernel row that is selected and cannot launch on its arch fails.

    ``manifest`` (``gate_manifest.Manifest``): compiles only the units with
    no row in it and a random sample of the others (compiled afresh, not
    from ``cache_dir``), takes the rest from their rows, and fails a sampled
    unit whose compile differs from its row; afterwards the manifest says
    which rows were used, missing or stale (``gate_manifest``).
    """
    if variants is None:
        variants = _registry.all_variants()
    archs = tuple(archs)
    for a in archs:
        if not _ARCH.match(a):
            raise ValueError(f"arch: expected sm_XX or compute_XX, got {a!r}")

    units = []  # (source, defines, variant name, text, kernels kept or None for all)
    for source, defines in variants:
        defines = dict(defines or {})
        name = _source.variant_name(_source.stem_of(source), defines)
        text = _source.assemble(source, defines)
        keep = None
        if filter and filter not in name:
            keep = {k for k in _source.kernel_names(text) if filter in k}
            if not keep:
                continue
        units.append((str(source), defines, name, text, keep))

    work = [(u, arch) for u in units for arch in _unit_archs(u[1], archs)]

    keys: list[str | None] = [None] * len(work)
    sampled: set[str] = set()
    if manifest is not None:
        keys = [
            _manifest.unit_key(text, _nvrtc.gate_options(arch, include_dir), include_dir)
            for (_s, _d, _n, text, _k), arch in work
        ]
        sampled = manifest.pick_sample([k for k in keys if k in manifest.rows])
    compiled: list = [None] * len(work)
    todo = []
    for i, (((_s, _d, name, text, _k), arch), key) in enumerate(zip(work, keys)):
        if manifest is not None and key is not None and key in manifest.rows and key not in sampled and not keep_ptx:
            row = manifest.rows[key]
            compiled[i] = _Unit(row["ok"], "", row["wide"], 0.0, cached=True, reports=_manifest.row_reports(row))
        else:
            recompile = key in sampled
            todo.append((i, (text, arch, f"{name}.cu", include_dir, None if recompile else cache_dir, keep_ptx)))
    calls = [c for _, c in todo]
    if jobs > 1 and len(calls) > 1:
        with _process_pool(min(jobs, len(calls))) as pool:
            done = list(pool.map(_compile_unit, *zip(*calls)))
    else:
        done = [_compile_unit(*c) for c in calls]
    for (i, _), c in zip(todo, done):
        compiled[i] = c

    req = tuple(require_v4)
    results: list[Result] = []
    for ((source, defines, name, _text, keep), arch), c, key in zip(work, compiled, keys):
        common = dict(
            variant=name,
            arch=arch,
            seconds=c.seconds,
            source=source,
            defines=defines,
            log=c.log,
            ptx=c.ptx,
            cached=c.cached,
        )
        reports = c.reports if c.reports is not None else (_nvrtc.parse_ptxas(c.log) if c.ok else {})
        unit_problems = []
        if manifest is not None:
            assert key is not None  # every unit has a key when there is a manifest
            fresh = _manifest.unit_row(name, arch, c.ok, reports, c.wide)
            manifest.record(key, fresh, sampled=key in sampled)
            if key in sampled:
                unit_problems = [
                    f"differs from its gate manifest row: {d}" for d in _manifest.differences(manifest.rows[key], fresh)
                ]
        if not c.ok:
            results.append(Result(kernel="", compiled=False, problems=["compile error"] + unit_problems, **common))
            continue
        if unit_problems:
            results.append(Result(kernel="(gate manifest)", compiled=True, problems=unit_problems, **common))
        wide = c.wide
        for fn in wide:  # a virtual arch (compute_XX) has PTX but no ptxas report
            if fn not in reports:
                reports[fn] = _nvrtc.FunctionReport(fn, is_entry=True)
        for fn, rep in reports.items():
            if keep is not None and fn not in keep and rep.is_entry:
                continue
            r = Result(
                kernel=fn,
                compiled=True,
                registers=rep.registers,
                spill_stores=rep.spill_stores,
                spill_loads=rep.spill_loads,
                stack_frame=rep.stack_frame,
                smem=rep.smem,
                wide_load_bits=wide.get(fn, 0),
                is_entry=rep.is_entry,
                **common,
            )
            if rep.spill_stores or rep.spill_loads:
                r.problems.append(f"spills {rep.spill_stores}/{rep.spill_loads} bytes (stores/loads)")
            if rep.wgmma_serialized:
                r.problems.append(f"ptxas serialized its wgmma ({rep.wgmma_serialized})")
            if max_stack is not None and rep.stack_frame > max_stack:
                r.problems.append(f"stack frame {rep.stack_frame} > {max_stack} bytes")
            if rep.is_entry and any(s in fn for s in req) and not r.v4:
                r.problems.append("no 128-bit global load in the PTX (--require-v4)")
            if not rep.is_entry and not (r.problems or rep.stack_frame):
                continue  # an out-of-line device function with nothing to say
            results.append(r)
    for r, problems in _launchcheck.arch_problems(results, archs, launches):
        r.problems.extend(problems)
    results.sort(key=lambda r: (r.kernel, r.variant, r.arch))
    return results


def _unit_archs(defines: dict, archs: tuple) -> tuple:
    """The archs one variant compiles for: all of ``archs``, or for an
    arch-specific build (``CP_TARGET``, e.g. sm_90a: wgmma) its target alone,
    when one of ``archs`` is that target's arch (sm_90 or sm_90a)."""
    target = str(defines.get("CP_TARGET", ""))
    if not target:
        return archs
    base = re.sub(r"[af]$", "", target)
    return (target,) if any(re.sub(r"[af]$", "", a) == base for a in archs) else ()


def unmatched(patterns: Iterable[str], results: list[Result]) -> list[str]:
    """The ``--require-v4`` patterns that match no compiled kernel."""
    kernels = {r.kernel for r in results if r.compiled and r.is_entry}
    return [p for p in patterns if not any(p in k for k in kernels)]


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    head = ("variant", "kernel", "arch", "regs", "spill st", "spill ld", "stack", "smem", "v4", "ms", "status")
    rows: list[tuple[str, ...] | None] = []
    prev = None
    for r in results:
        if prev is not None and r.kernel != prev:
            rows.append(None)  # blank line between kernels
        prev = r.kernel
        kernel = r.kernel if r.is_entry else f"{r.kernel} (device fn)"
        if not r.compiled:
            rows.append(
                (r.variant, "-", r.arch, "-", "-", "-", "-", "-", "-", f"{1e3 * r.seconds:.0f}", "COMPILE ERROR")
            )
            continue
        rows.append(
            (
                r.variant,
                kernel,
                r.arch,
                str(r.registers),
                str(r.spill_stores),
                str(r.spill_loads),
                str(r.stack_frame),
                str(r.smem),
                "yes" if r.v4 else "no",
                f"{1e3 * r.seconds:.0f}",
                "ok" if r.ok else "FAIL: " + "; ".join(r.problems),
            )
        )
    widths = [max([len(h)] + [len(row[i]) for row in rows if row]) for i, h in enumerate(head)]
    numeric = {3, 4, 5, 6, 7, 9}

    def fmt(row):
        return "  ".join(
            (c.rjust(w) if i in numeric else c.ljust(w)) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    lines = [fmt(head), fmt(tuple("-" * w for w in widths))]
    lines += ["" if row is None else fmt(row) for row in rows]
    return "\n".join(lines)


def summarize(results: list[Result], wall: float, jobs: int) -> dict:
    units = {(r.variant, r.arch): r.seconds for r in results}
    cached = {(r.variant, r.arch) for r in results if r.cached}
    per_variant: dict[str, float] = {}
    for (v, _), s in units.items():
        per_variant[v] = per_variant.get(v, 0.0) + s
    times = sorted(units.values())
    return {
        "variants": len(per_variant),
        "compiles": len(units),
        "cached": len(cached),
        "kernel_rows": sum(1 for r in results if r.compiled),
        "failures": sum(1 for r in results if not r.ok),
        "wall_seconds": round(wall, 3),
        "jobs": jobs,
        "compile_ms_mean": round(1e3 * sum(times) / len(times), 1) if times else 0.0,
        "compile_ms_max": round(1e3 * times[-1], 1) if times else 0.0,
        "variant_ms": {v: round(1e3 * s, 1) for v, s in sorted(per_variant.items())},
    }


def _write_ptx(results: list[Result], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    done = set()
    for r in results:
        if r.compiled and (r.variant, r.arch) not in done:
            done.add((r.variant, r.arch))
            (folder / f"{r.variant}.{r.arch}.ptx").write_text(r.ptx)


def _parse_define(s: str) -> tuple[str, str]:
    name, _, val = s.partition("=")
    if not re.match(r"^[A-Za-z_]\w*$", name):
        raise argparse.ArgumentTypeError(f"-D: expected NAME or NAME=VALUE, got {s!r}")
    return name, (val if _ else "1")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cupaged.tools.compile_check",
        description="Compile every cupaged kernel variant with NVRTC (no GPU needed); "
        "fail on compile errors and register spills.",
    )
    p.add_argument("--arch", action="append", help="comma-separated targets (default sm_80,sm_90)")
    p.add_argument("--filter", help="only variants or kernels whose name contains this")
    p.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="compiles in parallel (worker processes; default: CPUs, at most 8)",
    )
    p.add_argument(
        "--require-v4",
        action="append",
        default=[],
        metavar="KERNEL_SUBSTR",
        help="fail if a matching kernel's PTX has no 128-bit global load (repeatable)",
    )
    p.add_argument("--max-stack", type=int, help="fail on a stack frame above this many bytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--keep-ptx", type=Path, metavar="DIR", help="write each variant's PTX to DIR")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="compile this .cu file instead of the registered variants (repeatable)",
    )
    p.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        type=_parse_define,
        metavar="NAME=VAL",
        help="a define for every --source file (repeatable)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print the NVRTC log of every failure in full")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help=f"compile everything again (default: reuse results cached in {default_cache_dir()})",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--all", action="store_true", help="the full gate: compile every unit (the default)")
    mode.add_argument(
        "--manifest",
        action="store_true",
        help="check against the committed gate manifest (cupaged/tools/gate_manifest.json): compile "
        "the units whose inputs changed and a random sample of the rest; fail when it is not "
        "current (default archs: " + ",".join(_manifest.MANIFEST_ARCHS) + ")",
    )
    mode.add_argument(
        "--update-manifest",
        action="store_true",
        help="as --manifest, then write the manifest for today's units (commit it with the change)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=_manifest.DEFAULT_SAMPLE,
        help=f"with --manifest: units recompiled and compared with their rows (default {_manifest.DEFAULT_SAMPLE})",
    )
    p.add_argument("--seed", type=int, help="with --manifest: the sample's seed (default: random, printed)")
    args = p.parse_args(argv)
    use_manifest = args.manifest or args.update_manifest
    if use_manifest and (args.source or args.filter):
        p.error("--manifest / --update-manifest cover every registered variant: no --source or --filter")
    if args.sample < 0:
        p.error("--sample: expected 0 or more")

    default_archs = _manifest.MANIFEST_ARCHS if use_manifest else DEFAULT_ARCHS
    archs = tuple(a.strip() for spec in (args.arch or [",".join(default_archs)]) for a in spec.split(",") if a.strip())
    bad = [a for a in archs if not _ARCH.match(a)]
    if bad:
        p.error(f"--arch: expected sm_XX or compute_XX, got {', '.join(bad)}")
    if args.jobs < 1:
        p.error("--jobs: expected at least 1")
    if args.defines and not args.source:
        p.error("-D applies to --source files; none given")
    for s in args.source:
        if not s.is_file():
            p.error(f"--source: no such file {s}")

    variants = None
    if args.source:
        defines = dict(args.defines)
        variants = [(s.resolve(), defines) for s in args.source]
    else:
        variants = _registry.all_variants()
        if not variants:
            print(
                "warning: no kernel variants are registered (cupaged._runtime.registry.all_variants() is empty); "
                "nothing to compile",
                file=sys.stderr,
            )
            if args.json:
                print(json.dumps({"results": [], "summary": summarize([], 0.0, args.jobs)}, indent=1))
            return 0

    try:
        _nvrtc.nvrtc_version()
        include_dir = _nvrtc.find_header_dir()
    except Exception as e:  # no cuda-python, no NVRTC library, no headers: one line naming the fix
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"error: the NVRTC gate cannot run: {msg} (pip install 'cupaged[gate]' brings cuda-python, "
            f"NVRTC and the CUDA headers)",
            file=sys.stderr,
        )
        return 2
    manifest = _manifest.load(sample=args.sample, seed=args.seed) if use_manifest else None
    t0 = time.perf_counter()
    results = check(
        variants,
        archs,
        filter=args.filter,
        jobs=args.jobs,
        require_v4=args.require_v4,
        max_stack=args.max_stack,
        include_dir=include_dir,
        cache_dir=None if args.no_cache else default_cache_dir(),
        keep_ptx=bool(args.keep_ptx),
        manifest=manifest,
    )
    wall = time.perf_counter() - t0
    if args.update_manifest:
        assert manifest is not None  # --update-manifest uses the manifest
        _manifest.write(manifest.rows_now())
    summary = summarize(results, wall, args.jobs)
    missing = unmatched(args.require_v4, results)
    warnings = _launchcheck.arch_warnings(results, archs)
    if args.keep_ptx:
        _write_ptx(results, args.keep_ptx)

    if args.json:
        print(
            json.dumps(
                {
                    "results": [r.as_dict(with_text=not r.ok) for r in results],
                    "summary": summary,
                    "unmatched_require_v4": missing,
                    "archs": list(archs),
                    "launch_warnings": warnings,
                    "nvrtc": list(_nvrtc.nvrtc_version()),
                    "include_dir": include_dir,
                },
                indent=1,
            )
        )
    else:
        v = _nvrtc.nvrtc_version()
        print(f"NVRTC {v[0]}.{v[1]}, headers from {include_dir}")
        if results:
            print(format_table(results))
        else:
            print("(nothing matched)")
        for r in results:
            if not r.compiled:
                log = r.log.splitlines()
                if not args.verbose and len(log) > 40:
                    log = log[:40] + [f"... ({len(log) - 40} more lines; --verbose shows all)"]
                print(f"\n--- {r.variant} for {r.arch}: NVRTC log ---")
                print("\n".join(log))
        print(
            f"\n{summary['variants']} variants x {len(archs)} archs = {summary['compiles']} compiles in "
            f"{summary['wall_seconds']:.2f} s (jobs {args.jobs}); per compile mean "
            f"{summary['compile_ms_mean']:.0f} ms, max {summary['compile_ms_max']:.0f} ms"
            + (f"; {summary['cached']} results from the cache (--no-cache recompiles)" if summary["cached"] else "")
        )
        if warnings:
            print(
                f"\nwarning: {len(warnings)} selected launch(es) could not launch on archs not compiled here "
                f"(limits in cupaged/_runtime/archs.py):"
            )
            for w in warnings:
                print(f"  {w}")
        for pat in missing:
            print(f"FAIL: --require-v4 {pat!r} matches no compiled kernel")
        if summary["failures"]:
            print(f"FAIL: {summary['failures']} row(s) failed")
    stale = False
    if manifest is not None:
        print(manifest.status(), file=sys.stderr if args.json else sys.stdout)
        if args.update_manifest:
            print(f"wrote {_manifest.PATH} ({len(manifest.used)} rows)", file=sys.stderr if args.json else sys.stdout)
        elif not manifest.current():
            stale = True
            print(
                "FAIL: the gate manifest is not current: python -m cupaged.tools.compile_check --update-manifest, "
                "then commit cupaged/tools/gate_manifest.json",
                file=sys.stderr if args.json else sys.stdout,
            )
    return 1 if (summary["failures"] or missing or stale) else 0


if __name__ == "__main__":
    sys.exit(main())
