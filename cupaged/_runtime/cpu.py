"""The CPU backend: cupaged's CUDA C kernels compiled by g++ and run on fibers.

The assembled source of a kernel variant (``_source.assemble``) is compiled by
g++ with ``kernels_cu/shim/cupaged_shim.h`` force-included into a shared
library, cached on disk, loaded with ctypes and launched with a
``cuLaunchKernel``-style ``void**`` argument array. The kernels run on the
runtime of ``kernels_cu/shim/cupaged_rt.cpp``: every CUDA thread is a fiber,
one worker runs all fibers of a block, blocks spread over the workers (one
per core; ``CUPAGED_CPU_WORKERS`` overrides): the thread that launches is one
of them, the others a persistent pool of threads, woken only by a launch of
more than one block.

Barriers and warp collectives that cannot complete (a deadlock, lanes in
different collectives, a mask naming a lane that exited), ``__trap()`` and
``assert`` raise :class:`~cupaged.errors.KernelError` naming the kernel, the
block, and the source lines where threads wait; the pool stays usable. A
fiber stack overflow (64 KiB per CUDA thread) aborts the process with a
message naming the kernel, as a GPU would fault.

Environment:

* ``CUPAGED_CACHE_DIR``: where built libraries go (default ``~/.cache/cupaged/cpu``).
  A read-only one (a pre-warmed deployment image) serves the libraries it
  holds; the others are built in a per-user folder (``build_dir``), told once
  per process on stderr.
* ``CUPAGED_CXX``: the C++ compiler (default ``g++``; GCC 12 or later, checked).
* ``CUPAGED_CPU_WORKERS``: number of workers (the launching thread and
  ``n - 1`` pool threads), 1 to 1024 (default: the CPUs this process may run
  on); parsed once, by ``configured_workers``.
* ``CUPAGED_CPU_SPIN_US``: how long an idle worker thread polls for the next
  launch or host product before it sleeps (default ``SPIN_US``, 1000; 0 never:
  the test suite, whose other processes keep the cores busy). Parsed once, by
  ``spin_us``.
* ``CUPAGED_CPU_CXXFLAGS``: extra flags for kernel modules (e.g. ``-g -O0``).
* ``CUPAGED_CPU_FIBERS=ucontext``: the portable (slower) context switch.
* ``CUPAGED_BLAS_ONE_THREAD_ROWS``: host products (the engine's dense layers) of at
  most this many rows run on one thread (default 0: BLAS's own thread count, and
  every worker for the few-row products of ``host_products``); for a machine
  whose other cores are busy (the test suite sets 32: one pytest worker per CPU).
  Parsed once, by ``blas_one_thread_rows``.
* ``OPENBLAS_THREAD_TIMEOUT`` (OpenBLAS's own): when unset, the first host product
  shortens OpenBLAS's idle spin to 2**``BLAS_SPIN_LOG2`` cycles
  (``settle_blas_spin``); when set, OpenBLAS keeps it.
* ``CUPAGED_CPU_CP_ASYNC=eager``: ``cp.async`` copies (``kernels_cu/ptx.cuh``)
  land at issue, the earliest point a GPU allows, instead of at the
  ``cp.async.wait_group`` that covers them (``late``, the default, the latest
  point): a pipeline that refills a shared-memory stage still being read
  gives wrong results in one mode or the other. A per-process choice (part
  of the module flags, so of the cache key).
* ``CUPAGED_CPU_GEOMETRY=gpu``: kernels with a CPU geometry (an attention spec's
  ``CPU_GEOMETRY``: paged_attention and paged_prefill_simt run one warp a block
  here, where each fiber's fixed work costs what a GPU hides, and paged_attention
  at most 8 lanes a K/V row; ``ops.sampling.CPU_THREADS``: the sampling kernels one
  warp a row) are built and launched with their GPU geometry instead, so the
  GPU's block shape runs here too (``cpu``, the default: the CPU one). A
  per-process choice (a module flag, so part of the cache key).
* ``CUPAGED_CPU_ASAN=1``: build runtime and kernels with AddressSanitizer, so
  that a kernel reading or writing outside a NumPy array stops with a report
  naming the kernel's source line. Python itself is not built with ASan, so
  libasan must be loaded first: ``LD_PRELOAD=$(g++ -print-file-name=libasan.so)
  ASAN_OPTIONS=detect_leaks=0 python ...``.

Rules for kernel sources, so that they run here as on a GPU: declare dynamic
shared memory with ``CUPAGED_DYNAMIC_SHARED(T, name)``; include no system
headers besides ``<cuda_fp16.h>``/``<cuda_bf16.h>``; never spin-wait on
another thread or block (fibers are not pre-empted); use ``__syncwarp`` or
``*_sync`` collectives between dependent warp lanes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..errors import CompileError, KernelError, PagedAttentionError, SetupError
from . import progress as _progress
from . import source as _source
from .structs import StructArg

MAX_THREADS_PER_BLOCK = 1024
_INTERRUPTED = 2  # cupaged_rt_launch's return code when SIGINT stopped the launch
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
MAX_SHARED_MEM = 227 * 1024

# Flags of kernel modules (part of the cache key; emulator.md explains each).
MODULE_FLAGS = (
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-fno-extern-tls-init",
    "-ftls-model=global-dynamic",
    "-fvisibility=hidden",
    "-fno-math-errno",
    "-ffp-contract=off",  # a*b+c stays two roundings (as written); only fmaf / __fmaf_rn fuse
    "-fstack-clash-protection",
    "-DCUPAGED_CPU",
)
RUNTIME_FLAGS = (
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
    "-DCUPAGED_CPU",
)
_SHIM_SUFFIXES = (".h", ".hpp", ".cpp")

_lock = threading.RLock()
_runtime: ctypes.CDLL | None = None
_modules: dict[str, "CpuModule"] = {}


# ---- configuration -----------------------------------------------------------
MIN_GCC = 12  # the oldest g++ the shim is written for (C++20 std::source_location, -fno-extern-tls-init)
_FIX_CXX = f"install g++ {MIN_GCC} or later (apt-get install g++) or set CUPAGED_CXX to its path"


def cache_dir() -> Path:
    """Folder of built libraries: ``$CUPAGED_CACHE_DIR`` or ``~/.cache/cupaged/cpu``.
    Libraries are looked up there first, without writing to it: it may be a
    read-only pre-warmed cache (a deployment image). Those it lacks are built
    in ``build_dir()``."""
    d = os.environ.get("CUPAGED_CACHE_DIR")
    return Path(d).expanduser() if d else _user_cache() / "cupaged" / "cpu"


def _user_cache() -> Path:
    return Path.home() / ".cache"


def fallback_dirs(primary: Path, sub: str) -> list[Path]:
    """Per-user folders for new files when ``primary`` is not writable:
    ``$XDG_CACHE_HOME/cupaged/<sub>``, ``~/.cache/cupaged/<sub>``, then
    ``_private_tmp() / sub``."""
    out = []
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        out.append(Path(xdg) / "cupaged" / sub)
    try:
        out.append(_user_cache() / "cupaged" / sub)
    except RuntimeError:  # no home folder
        pass
    out.append(_private_tmp() / sub)
    return list(dict.fromkeys(p for p in out if p != primary))


def _private_tmp() -> Path:
    """``$TMPDIR/cupaged-<uid>`` (or the system temp folder's)."""
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"cupaged-{os.geteuid()}"


def unwritable(folder: Path) -> str | None:
    """None when files can be created in ``folder`` (made if missing), else
    why not. Tried, not read from mode bits, which root, ACLs and read-only
    mounts make unreliable. The folder under a shared temp folder must be
    ours alone: libraries found there are loaded into this process."""
    private = _private_tmp()
    try:
        if folder.parent == private:
            private.mkdir(mode=0o700, exist_ok=True)
            st = private.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return f"{private} is not a folder of this user alone"
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


_noticed: set[Path] = set()


def build_dir() -> Path:
    """The folder new CPU libraries are built in (``writable_dir`` of ``cache_dir()``)."""
    return writable_dir(cache_dir(), "cpu", "CPU kernels", "CUPAGED_CACHE_DIR")


def writable_dir(primary: Path, sub: str, what: str, variable: str) -> Path:
    """``primary`` when files can be made there, else the first writable
    per-user fallback (``fallback_dirs(primary, sub)``), told once per
    process in one line on stderr (``what`` is built there). SetupError,
    naming the environment variable ``variable`` that sets ``primary``,
    when none is writable."""
    why = unwritable(primary)
    if why is None:
        return primary
    tried = []
    for folder in fallback_dirs(primary, sub):
        other = unwritable(folder)
        if other is None:
            with _lock:
                if primary not in _noticed:
                    _noticed.add(primary)
                    print(
                        f"cupaged: kernel cache {primary} is not writable ({why}); building new {what} in "
                        f"{folder} (set {variable} to choose the folder)",
                        file=sys.stderr,
                        flush=True,
                    )
            return folder
        tried.append(f"{folder} ({other})")
    raise SetupError(
        f"kernel cache {primary} is not writable ({why}), nor are the fallbacks {', '.join(tried)}: "
        f"set {variable} to a writable folder"
    )


#: What the first build of a process says (``_building``), per kind of file built.
CPU_BUILD_NOTICE = (
    "compiling CPU kernels on first use (g++, several seconds each; kept in {folder}, later runs load them)"
)


def _library(name: str, build, notice: str = CPU_BUILD_NOTICE) -> Path:
    """The intact library file ``name``: the one in ``cache_dir()`` (nothing
    written), else the one in ``build_dir()``, built there by ``build(path)``
    when missing or damaged."""
    path = cache_dir() / name
    if _intact(path):
        return path
    folder = build_dir()
    if folder != path.parent:
        path = folder / name
        if _intact(path):
            return path
    _building(folder, build, path, notice)
    return path


def _building(folder: Path, build, path: Path, notice: str = CPU_BUILD_NOTICE) -> None:
    """``build(path)``, with a file system failure in ``folder`` (a full disk,
    a folder made read-only meanwhile) as one SetupError line. The first
    build of each kind (``notice``, formatted with the folder) says so on
    stderr, once per process (``progress.notice_once``)."""
    _progress.notice_once(notice, notice.format(folder=folder))
    try:
        with _progress.building():
            build(path)
    except OSError as e:
        raise SetupError(
            f"kernel cache {folder}: cannot write {path.name} ({e.strerror or e}): set "
            f"CUPAGED_CACHE_DIR to a writable folder with free space"
        ) from None


#: AddressSanitizer builds (CUPAGED_CPU_ASAN=1), after the -O2 of the module and runtime flags: -O1 (ASan's own
#: advice) and -g1 (line tables only: reports still name file and line) build a kernel module in about half the time
#: of -O2 -g (measured: a decode module 1.85 -> 1.01 s, a tensor-core prefill one 3.05 -> 1.36 s).
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g1")


def _asan() -> bool:
    return os.environ.get("CUPAGED_CPU_ASAN", "").strip() not in ("", "0")


def cp_async_mode() -> str:
    """``CUPAGED_CPU_CP_ASYNC``: ``"late"`` (default) or ``"eager"``."""
    mode = os.environ.get("CUPAGED_CPU_CP_ASYNC", "").strip().lower() or "late"
    if mode not in ("late", "eager"):
        raise PagedAttentionError(f"CUPAGED_CPU_CP_ASYNC: expected 'late' or 'eager', got {mode!r}")
    return mode


#: x86-64 ISA extensions the kernel modules use where the CPU has them (its /proc/cpuinfo flags), with the g++
#: flags each adds, in order: FMA (fmaf one instruction, not a libm call), AVX2 (the shim's exp2f four at once),
#: AVX-512 F/VL/DQ (32 vector registers for the micro-tiles, 256-bit vectors kept: no wider ones by default).
_X86_ISA = (
    (("fma",), ("-mfma",)),
    (("avx2",), ("-mavx2",)),
    (("avx512f", "avx512vl", "avx512dq"), ("-mavx512f", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=256")),
)


@functools.cache
def _host_isa_flags(machine: str | None = None, cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The g++ flags of ``_X86_ISA`` whose extensions this x86-64 CPU has (each only after the ones before it:
    no AVX2 without FMA). None changes a result's bits: ``-ffp-contract=off`` keeps g++ from fusing anything
    but fmaf, which rounds once either way, and the shim's vector exp2f computes what its scalar one does.
    Part of the flags, so of the cache key: a cache shared with a machine without them builds its own."""
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return ()
    have: set[str] = set()
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[-1].split())
                    break
    except OSError:
        pass
    flags: list[str] = []
    for needs, adds in _X86_ISA:
        if not have.issuperset(needs):
            break
        flags += adds
    return tuple(flags)


def geometry_mode() -> str:
    """``CUPAGED_CPU_GEOMETRY``: ``"cpu"`` (default) or ``"gpu"``."""
    mode = os.environ.get("CUPAGED_CPU_GEOMETRY", "").strip().lower() or "cpu"
    if mode not in ("cpu", "gpu"):
        raise PagedAttentionError(f"CUPAGED_CPU_GEOMETRY: expected 'cpu' or 'gpu', got {mode!r}")
    return mode


def _module_flags() -> tuple[str, ...]:
    extra = tuple(shlex.split(os.environ.get("CUPAGED_CPU_CXXFLAGS", "")))
    eager = ("-DCUPAGED_CP_ASYNC_EAGER=1",) if cp_async_mode() == "eager" else ()
    gpu_geometry = ("-DCUPAGED_GPU_GEOMETRY=1",) if geometry_mode() == "gpu" else ()
    return MODULE_FLAGS + _host_isa_flags() + (ASAN_FLAGS if _asan() else ()) + eager + gpu_geometry + extra


def _runtime_flags() -> tuple[str, ...]:
    fibers = os.environ.get("CUPAGED_CPU_FIBERS", "").strip().lower()
    if fibers not in ("", "asm", "ucontext"):
        raise PagedAttentionError(f"CUPAGED_CPU_FIBERS: expected 'asm' or 'ucontext', got {fibers!r}")
    return (
        RUNTIME_FLAGS
        + (("-DCUPAGED_FIBER_UCONTEXT",) if fibers == "ucontext" else ())
        + (ASAN_FLAGS if _asan() else ())
    )


def _check_asan_loaded() -> None:
    if _asan() and not hasattr(ctypes.CDLL(None), "__asan_init"):
        raise PagedAttentionError(
            "CUPAGED_CPU_ASAN=1: expected libasan to be loaded before Python starts, it is not; run with "
            "LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0"
        )


@functools.lru_cache(maxsize=None)
def _shim_blob() -> bytes:
    """Every byte of the shim folder (names and contents), read once per
    process so that modules and the loaded runtime always agree."""
    parts = []
    for p in sorted(_source.shim_dir().iterdir()):
        if p.suffix in _SHIM_SUFFIXES and p.is_file():
            parts += [p.name.encode(), b"\0", p.read_bytes(), b"\0"]
    return b"".join(parts)


@functools.lru_cache(maxsize=None)
def _compiler() -> tuple[str, str]:
    """(path, ``--version`` text) of the compiler: ``$CUPAGED_CXX`` or
    ``g++``, found on PATH; a missing one, one whose ``--version`` fails and
    a g++ older than ``MIN_GCC`` are one SetupError line each. The version
    text is cached on disk by the binary's path, size and mtime, so that a
    warm cache never runs the compiler at all."""
    cxx = os.environ.get("CUPAGED_CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        named = f"CUPAGED_CXX={cxx!r}" if os.environ.get("CUPAGED_CXX") else "g++"
        raise SetupError(f"CPU backend: {named} not found (not on PATH, or not an executable file); {_FIX_CXX}")
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = f"compiler-{_source.digest(path, real, str(st.st_size), str(st.st_mtime_ns))}.txt"
    try:
        out = (cache_dir() / stamp).read_text()
    except OSError:
        out = None
    if out is None:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise SetupError(f"CPU backend: `{path} --version` failed ({e}); {_FIX_CXX}") from None
        try:  # only saves running --version in later processes: a read-only cache goes without
            cache_dir().mkdir(parents=True, exist_ok=True)
            _write_atomic(cache_dir() / stamp, out.encode())
        except OSError:
            pass
    _check_version(path, out)
    return path, out


# "g++ (Debian 12.2.0-14) 12.2.0", "g++ (GCC) 11.4.1 20231218 (Red Hat 11.4.1-3)": the version follows the ")"
_GCC_VERSION = re.compile(r"\)\s+(\d+)\.(\d+)")
_ANY_VERSION = re.compile(r"(\d+)\.(\d+)")


def _is_clang(version: str) -> bool:
    """Whether ``version`` (a compiler's ``--version`` text) is clang's."""
    first = version.strip().splitlines()[0] if version.strip() else ""
    return "clang" in first.lower()


def _check_version(path: str, text: str) -> None:
    """SetupError unless ``text`` (``--version`` of ``path``) is g++
    ``MIN_GCC`` or later. Clang, named by CUPAGED_CXX, is used as it is."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if _is_clang(text):
        return
    m = _GCC_VERSION.search(first) or (_ANY_VERSION.findall(first) or [None])[-1]
    if m is None:
        raise SetupError(
            f"CPU backend: cannot read the version of {path} (`--version` printed {first!r}): "
            f"expected g++ {MIN_GCC} or later; {_FIX_CXX}"
        )
    major, minor = (int(x) for x in (m.groups() if isinstance(m, re.Match) else m))
    if major < MIN_GCC:
        raise SetupError(
            f"CPU backend: g++ {major}.{minor} ({path}) is too old: expected g++ {MIN_GCC} or later "
            f"(C++20); install it (apt-get install g++-{MIN_GCC}) and set CUPAGED_CXX=g++-{MIN_GCC}"
        )


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a part of it:
    a temporary file in the same folder, flushed to disk, renamed over."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- built libraries on disk ------------------------------------------------------
# A library is installed as <name>.so plus <name>.so.sum ("<size> <sha256>\n"),
# written after the library is renamed into place. A library is loaded only
# when its sum file matches its bytes: dlopen of a truncated library (a crash
# or a full disk during a write) dies with SIGBUS, which no later run could
# recover from. Anything that does not match is rebuilt.


def _sum_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sum")


def _digest_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _install(built: Path, lib: Path) -> None:
    """Move a freshly built library into place and record its sum."""
    with open(built, "rb+") as f:
        os.fsync(f.fileno())
    size, digest = built.stat().st_size, _digest_file(built)
    _sum_path(lib).unlink(missing_ok=True)  # a crash before the new sum is written leaves no stale one
    os.replace(built, lib)
    _fsync_dir(lib.parent)
    _write_atomic(_sum_path(lib), f"{size} {digest}\n".encode())


def _intact(lib: Path) -> bool:
    """Whether ``lib`` exists and matches its recorded size and checksum."""
    try:
        size, digest = _sum_path(lib).read_text().split()
        return lib.stat().st_size == int(size) and _digest_file(lib) == digest
    except (OSError, ValueError):
        return False


def _run_compiler(args: list[str], what: str) -> str:
    try:
        r = subprocess.run(args, capture_output=True, text=True)
    except OSError as e:
        raise CompileError(f"cannot run {args[0]} for {what}: {e}") from None
    if r.returncode != 0:
        raise CompileError(
            f"g++ failed to compile {what} (exit {r.returncode}):\n{r.stderr.strip()}\ncommand: {shlex.join(args)}"
        )
    return r.stdout


# ---- runtime -----------------------------------------------------------------------
def _build_runtime(cxx: str, flags: tuple[str, ...], path: Path) -> None:
    shim = _source.shim_dir()
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        out = Path(tmp) / path.name
        _run_compiler(
            [cxx, *flags, "-I", str(shim), str(shim / "cupaged_rt.cpp"), "-o", str(out)],
            "the CPU backend runtime (kernels_cu/shim/cupaged_rt.cpp)",
        )
        _install(out, path)


def runtime() -> ctypes.CDLL:
    """The runtime library (fibers, worker pool), built once and loaded with
    RTLD_GLOBAL so that every kernel module links against it."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        _check_asan_loaded()
        cxx, version = _compiler()
        flags = _runtime_flags()
        key = _source.digest("runtime", _shim_blob(), " ".join(flags), version)
        path = _library(f"cupaged_rt-{key}.so", functools.partial(_build_runtime, cxx, flags))
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        lib.cupaged_rt_last_error.restype = ctypes.c_char_p
        lib.cupaged_rt_last_error.argtypes = []
        lib.cupaged_rt_num_workers.restype = ctypes.c_int
        lib.cupaged_rt_num_workers.argtypes = []
        lib.cupaged_rt_thread_wakes.restype = ctypes.c_ulonglong
        lib.cupaged_rt_thread_wakes.argtypes = []
        lib.cupaged_rt_set_workers.restype = None
        lib.cupaged_rt_set_workers.argtypes = [ctypes.c_uint]
        lib.cupaged_rt_set_workers(configured_workers())
        lib.cupaged_rt_set_spin.restype = None
        lib.cupaged_rt_set_spin.argtypes = [ctypes.c_uint]
        lib.cupaged_rt_set_spin(spin_us())
        _runtime = lib
        return lib


MAX_WORKERS = 1024


def configured_workers() -> int:
    """Worker threads the CPU backend runs (or will run) with:
    ``CUPAGED_CPU_WORKERS`` when set (an integer from 1 to 1024; anything
    else is a PagedAttentionError naming it), else the CPUs this process may
    run on. The one parser of that variable: the runtime gets the result."""
    raw = os.environ.get("CUPAGED_CPU_WORKERS")
    if raw is None or raw.strip() == "":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return os.cpu_count() or 1
    try:
        n = int(raw.strip())
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_WORKERS:
        raise PagedAttentionError(f"CUPAGED_CPU_WORKERS: expected an integer from 1 to {MAX_WORKERS}, got {raw!r}")
    return n


#: CUPAGED_CPU_SPIN_US's default: how long an idle pool thread polls for the next job before it sleeps. Measured
#: (SmolLM2-135M f32 decode, batch 8, 2 idle cores): a futex wake per multi-block launch or split product costs
#: 10 - 60 us on this VM, ~370 a step.
SPIN_US = 1000
MAX_SPIN_US = 1_000_000


def spin_us() -> int:
    """``CUPAGED_CPU_SPIN_US``: microseconds an idle worker thread polls for the next job before it sleeps (0 to
    MAX_SPIN_US; default SPIN_US; 0 where other processes keep the cores busy: the test suite). The one parser
    of that variable: the runtime gets the result."""
    raw = os.environ.get("CUPAGED_CPU_SPIN_US", "").strip()
    if not raw:
        return SPIN_US
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_SPIN_US:
        raise PagedAttentionError(f"CUPAGED_CPU_SPIN_US: expected an integer from 0 to {MAX_SPIN_US}, got {raw!r}")
    return n


def num_workers() -> int:
    """Worker threads of the CPU backend (starts the pool)."""
    return int(runtime().cupaged_rt_num_workers())


# ---- BLAS threads of host work --------------------------------------------------
@functools.cache
def blas_one_thread_rows() -> int:
    """``CUPAGED_BLAS_ONE_THREAD_ROWS`` (default 0): host products of at most this many rows run on one thread
    (BLAS's, and the few-row products of host_products: the pool's threads otherwise).
    On idle cores BLAS's own threads are faster even for one row (measured, SmolLM2-135M f32 decode at batch 1
    on 2 idle cores: 30.8 tokens/s with two BLAS threads, 19.8 with one); on cores other processes keep busy,
    handing a small product to a second BLAS thread costs far more than it saves (0.1 ms alone vs 15-30 ms
    with two threads for a [1, 576] x [576, 3072] product), so the test suite sets 32 (a decode step's rows)."""
    raw = os.environ.get("CUPAGED_BLAS_ONE_THREAD_ROWS", "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise PagedAttentionError(f"CUPAGED_BLAS_ONE_THREAD_ROWS: expected an integer >= 0, got {raw!r}")
    return n


@functools.cache
def _openblas():
    """The OpenBLAS library NumPy loaded (ctypes, not loaded anew), or None
    (another BLAS, no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.openblas_set_num_threads_local  # noqa: B018 (OpenBLAS 0.3.27 or later)
        except (OSError, AttributeError):
            continue
        return lib
    return None


@functools.cache
def _blas_thread_setter():
    """OpenBLAS's ``openblas_set_num_threads_local`` (the calling thread's
    BLAS thread count; 0 restores the global one; returns the previous), or
    None (another BLAS, an older OpenBLAS, no /proc)."""
    lib = _openblas()
    if lib is None:
        return None
    fn = lib.openblas_set_num_threads_local
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


#: How long an idle OpenBLAS thread spins before it sleeps, as OpenBLAS's ``OPENBLAS_THREAD_TIMEOUT``: 2**N cycles of
#: the time-stamp counter (~0.35 ms at 3 GHz; OpenBLAS's own default is 2**28, ~90 ms). A BLAS thread spinning after
#: a product competes for the cores with the kernel workers and the host products' threads that run next:
#: profiled on 2 cores, a 256-token SmolLM2 prefill spent 27% of its CPU time in OpenBLAS's idle loop. Measured there
#: (SmolLM2-135M f32, 2 cores), N 28 / 22 / 20 / 18: prefill 2.22 / 1.51-1.59 / 1.48-1.50 s; decode batch 8
#: - / 63-69 / 92-93 / 92 tok/s; batch 1 30.5 / 30.1-30.3 / 29.0-29.6 / 26.2 (its threads fall asleep between a
#: step's products). 20 is the best of the three.
BLAS_SPIN_LOG2 = 20
_SPIN_VARIABLES = ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")
_spin_lock = threading.Lock()
_spin_settled = False


def settle_blas_spin(lib=None) -> bool:
    """Once per process, before the first host product: OpenBLAS's idle
    threads spin 2**BLAS_SPIN_LOG2 cycles, not 2**28, unless the user set
    OPENBLAS_THREAD_TIMEOUT / GOTO_THREAD_TIMEOUT. OpenBLAS reads the timeout
    when it starts its threads, so its environment is read again
    (``openblas_read_env``; the variable is set only for that call) and its
    threads stopped (``blas_thread_shutdown_``, what its fork handler does);
    its next threaded call starts them anew with the shorter spin. Runs on
    the stream's thread, between host products (no BLAS call of ours in
    flight). Returns whether it changed anything. ``lib``: the OpenBLAS
    library (tests); default the one NumPy loaded."""
    global _spin_settled
    with _spin_lock:
        if _spin_settled:
            return False
        _spin_settled = True
        if any(os.environ.get(v, "").strip() for v in _SPIN_VARIABLES):
            return False
        lib = lib if lib is not None else _openblas()
        try:
            read_env, shutdown = lib.openblas_read_env, lib.blas_thread_shutdown_
        except AttributeError:  # None, or an OpenBLAS without them
            return False
        os.environ[_SPIN_VARIABLES[0]] = str(BLAS_SPIN_LOG2)
        try:
            read_env()
        finally:
            del os.environ[_SPIN_VARIABLES[0]]
        shutdown()
        return True


def blas_one_thread(op, rows: int):
    """``op`` (host work calling BLAS on ``rows`` rows) wrapped to run BLAS on
    one thread of its own when rows <= blas_one_thread_rows() (the thread's
    previous setting is restored after it); else ``op`` itself. Until the
    process's BLAS spin is settled, ``op`` settles it first (``settle_blas_spin``)."""
    setter = _blas_thread_setter() if rows <= blas_one_thread_rows() else None
    if not _spin_settled:
        op = _settling(op)
    if setter is None:
        return op

    def one_thread():
        prev = setter(1)
        try:
            op()
        finally:
            setter(prev)

    return one_thread


def _settling(op):
    """``op`` preceded by ``settle_blas_spin`` (a recording made before the
    spin is settled; after it, a no-op check)."""

    def settled():
        settle_blas_spin()
        op()

    return settled


# ---- modules --------------------------------------------------------------------
def _export_block(names: list[str]) -> str:
    lines = ['#line 1 "<cupaged exports>"']
    lines += [f"CUPAGED_EXPORT_KERNEL({n})" for n in names]
    lines.append(
        'extern "C" __attribute__((visibility("default"))) const char* cupaged_kernel_names() '
        f'{{ return "{",".join(names)}"; }}'
    )
    return "\n" + "\n".join(lines) + "\n"


_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.M)


def _build_shim_pch(cxx: str, flags: tuple[str, ...], gch: Path) -> None:
    """The shim precompiled for ``flags`` at ``gch`` and, beside it, the header it stands for: a wrapper that
    includes the shim (what g++ reads instead where the precompiled one does not fit)."""
    shim = _source.shim_dir()
    wrapper = gch.with_suffix("")
    with tempfile.TemporaryDirectory(dir=gch.parent, prefix=".build-") as tmp:
        text = f'#include "{shim / "cupaged_shim.h"}"\n'.encode()
        src = Path(tmp) / wrapper.name
        src.write_bytes(text)
        out = Path(tmp) / gch.name
        _run_compiler(
            [cxx, *flags, "-I", str(shim), "-x", "c++-header", str(src), "-o", str(out)],
            "the CPU shim's precompiled header (kernels_cu/shim/cupaged_shim.h)",
        )
        _write_atomic(wrapper, text)
        _install(out, gch)


def _shim_include(flags: tuple[str, ...]) -> Path:
    """``_shim_found`` for ``flags`` and the cache folder of now; found again when its files are gone (a cache
    folder removed while the process runs)."""
    path = _shim_found(flags, str(cache_dir()))
    if path == _source.shim_dir() / "cupaged_shim.h" or (path.is_file() and Path(f"{path}.gch").is_file()):
        return path
    _shim_found.cache_clear()
    return _shim_found(flags, str(cache_dir()))


@functools.lru_cache(maxsize=None)
def _shim_found(flags: tuple[str, ...], cache: str) -> Path:
    """The header every module of ``flags`` is built with first (``-include``; ``cache``: the cache folder it
    was found for): with g++, a wrapper of the shim whose precompiled form (``.gch``, built for these flags on
    first use and kept in the cache beside the libraries) g++ reads instead of parsing the shim again, ~0.2 s of
    each module's build (measured: a decode module 0.70 -> 0.48 s, an append one 0.44 -> 0.22); the shim itself
    with clang, or where the precompiled header cannot be built. Part of nothing's cache key: a module's bits
    are the same either way."""
    shim = _source.shim_dir()
    cxx, version = _compiler()
    if _is_clang(version):
        return shim / "cupaged_shim.h"
    key = _source.digest("shim pch", str(shim), _shim_blob(), " ".join(flags), version)
    name = f"cupaged_shim-{key}.h.gch"
    try:
        gch = _library(name, functools.partial(_build_shim_pch, cxx, flags))
    except CompileError:
        return shim / "cupaged_shim.h"
    wrapper = gch.with_suffix("")
    if not wrapper.is_file():  # a cache holding the .gch without its wrapper: build both where we may write
        gch = build_dir() / name
        _build_shim_pch(cxx, flags, gch)
    return gch.with_suffix("")


def _build_module(source_text: str, variant: str, path: Path, flags: tuple[str, ...]) -> None:
    cxx, _ = _compiler()
    shim = _source.shim_dir()
    scan = ["-include", str(shim / "cupaged_shim.h"), "-I", str(shim)]
    common = ["-include", str(_shim_include(flags)), "-I", str(shim)]
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        src = Path(tmp) / (path.stem + ".cu")
        # Headers are inlined once each: their "#pragma once" only draws a warning.
        source_text = _PRAGMA_ONCE.sub("", source_text)
        src.write_text(source_text)
        # The kernels as the compiler sees them, after #if and macros.
        pre = _run_compiler(
            [cxx, *flags, "-E", "-P", "-DCUPAGED_KERNEL_SCAN", *scan, "-x", "c++", str(src)],
            f"CPU kernel module {variant}",
        )
        names = _source.kernel_names(pre)
        src.write_text(source_text + _export_block(names))
        out = Path(tmp) / path.name
        _run_compiler([cxx, *flags, *common, "-x", "c++", str(src), "-o", str(out)], f"CPU kernel module {variant}")
        os.replace(src, path.with_suffix(".cu"))  # kept beside the library, for debuggers
        _install(out, path)


def load_module(source_text: str, variant: str) -> "CpuModule":
    """Compile (cached on disk) and load the assembled source ``source_text``;
    cached in process by digest. ``variant`` names the file."""
    rt = runtime()
    cxx, version = _compiler()
    flags = _module_flags()
    key = _source.digest(source_text, _shim_blob(), " ".join(flags), version)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        stem = re.sub(r"[^A-Za-z0-9_]", "_", variant)[:150] or "module"
        build = functools.partial(_build_module, source_text, variant, flags=flags)
        path = _library(f"{stem}-{key}.so", build)
        try:
            lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError:
            # A library left by another build (other machine, damaged file): build again, where we may write.
            folder = build_dir()
            path = folder / path.name
            path.unlink(missing_ok=True)
            _building(folder, build, path)
            lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        mod = CpuModule(lib, rt, path, variant, key)
        _modules[key] = mod
        return mod


class CpuModule:
    """A loaded kernel module. ``kernel_names`` lists its kernels."""

    def __init__(self, lib: ctypes.CDLL, rt: ctypes.CDLL, path: Path, variant: str, digest: str):
        self._lib = lib
        self._rt = rt
        self.path = path
        self.variant = variant
        self.digest = digest
        lib.cupaged_kernel_names.restype = ctypes.c_char_p
        names = lib.cupaged_kernel_names().decode()
        self.kernel_names: tuple[str, ...] = tuple(n for n in names.split(",") if n)
        self._functions: dict[str, CpuFunction] = {}

    def get_function(self, name: str) -> "CpuFunction":
        fn = self._functions.get(name)
        if fn is None:
            if name not in self.kernel_names:
                raise PagedAttentionError(
                    f"kernel: expected one of {', '.join(self.kernel_names) or '(none)'} in module "
                    f"{self.variant}, got {name!r}"
                )
            fn = self._functions[name] = CpuFunction(self, name)
        return fn

    def __repr__(self) -> str:
        return f"<CpuModule {self.variant} {self.path}>"


_PRETTY_T = re.compile(r"\[with T = (.*)\]$")

# numpy scalar (kind, itemsize) -> ctypes type
_SCALAR_CTYPES = {
    ("i", 1): ctypes.c_int8,
    ("i", 2): ctypes.c_int16,
    ("i", 4): ctypes.c_int32,
    ("i", 8): ctypes.c_int64,
    ("u", 1): ctypes.c_uint8,
    ("u", 2): ctypes.c_uint16,
    ("u", 4): ctypes.c_uint32,
    ("u", 8): ctypes.c_uint64,
    ("f", 4): ctypes.c_float,
    ("f", 8): ctypes.c_double,
    ("b", 1): ctypes.c_bool,
}


def _scalar_ctype(dt: np.dtype, code: str):
    """The ctypes type passing a NumPy scalar of dtype ``dt`` to a parameter
    of kind ``code`` (see param_code in cupaged_shim.h), or None if they do
    not match: same class (integer of either sign, float, bool) and size."""
    kinds = {"i": "iu", "u": "iu", "f": "f", "b": "b"}.get(code[:1])
    if kinds is None or dt.kind not in kinds or str(dt.itemsize) != code[1:]:
        return None
    return _SCALAR_CTYPES.get((dt.kind, dt.itemsize))


# (numpy scalar type, parameter code) -> converter, for the fast path of bind
_SCALAR_CONVERT = {}
for _t in (
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float32,
    np.float64,
    np.bool_,
    np.longlong,
    np.ulonglong,
):
    for _code in ("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f4", "f8", "b1"):
        _ct = _scalar_ctype(np.dtype(_t), _code)
        if _ct is not None:
            _SCALAR_CONVERT[(_t, _code)] = (lambda ct: lambda a: ct(a.item()))(_ct)
del _t, _code, _ct


class CpuFunction:
    """One kernel of a module: ``bind(grid, block, shared_mem, args)`` checks
    and freezes a launch; calling the result runs it."""

    def __init__(self, module: CpuModule, name: str):
        lib = module._lib
        self.name = name
        self.module = module
        self._rt = module._rt
        self._launch = getattr(lib, f"cupaged_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        nparams = getattr(lib, f"cupaged_nparams_{name}")
        nparams.restype = ctypes.c_int
        info = getattr(lib, f"cupaged_param_{name}")
        info.restype = ctypes.c_char_p
        info.argtypes = [ctypes.c_int, ctypes.c_int]
        n = nparams()
        self.param_codes: tuple[str, ...] = tuple(info(i, 0).decode() for i in range(n))
        types = []
        for i in range(n):
            m = _PRETTY_T.search(info(i, 1).decode())
            types.append(m.group(1) if m else "?")
        self.param_types: tuple[str, ...] = tuple(types)

    @property
    def num_params(self) -> int:
        return len(self.param_codes)

    def bind(self, grid: object, block: object, shared_mem: int, args: tuple) -> "BoundLaunch":
        grid = _check_dims("grid", grid, MAX_GRID_DIM, self.name, lo=0)
        block = _check_dims("block", block, MAX_BLOCK_DIM, self.name, lo=1)
        nthreads = block[0] * block[1] * block[2]
        if nthreads > MAX_THREADS_PER_BLOCK:
            raise PagedAttentionError(
                f"block: expected at most {MAX_THREADS_PER_BLOCK} threads per block for kernel "
                f"{self.name}, got {block} = {nthreads} threads"
            )
        if (
            isinstance(shared_mem, (bool, np.bool_))
            or not isinstance(shared_mem, (int, np.integer))
            or not 0 <= int(shared_mem) <= MAX_SHARED_MEM
        ):
            raise PagedAttentionError(
                f"shared_mem: expected 0 to {MAX_SHARED_MEM} bytes of dynamic shared memory "
                f"for kernel {self.name}, got {shared_mem!r}"
            )
        args = tuple(args)
        if len(args) != self.num_params:
            raise PagedAttentionError(
                f"args: kernel {self.name} takes {self.num_params} arguments ({', '.join(self.param_types)}), "
                f"got {len(args)}"
            )
        values, keep = [], []
        for i, (a, code) in enumerate(zip(args, self.param_codes)):
            if code == "p" and type(a) is np.ndarray:
                keep.append(a)
                values.append(ctypes.c_void_p(a.__array_interface__["data"][0]))
                continue
            if type(a) is StructArg:
                values.append(self._struct(i, a.value, code))
                keep.extend(a.refs)
                continue
            ctor = _SCALAR_CONVERT.get((type(a), code))
            values.append(ctor(a) if ctor is not None else self._convert(i, a, code, keep))
        return BoundLaunch(self, grid, block, int(shared_mem), values, keep)

    def _convert(self, i: int, a, code: str, keep: list):
        """Argument ``a`` for parameter ``i`` outside the fast paths of bind:
        array subclasses, raw addresses, and every error."""
        where = f"argument {i} of kernel {self.name} ({self.param_types[i]})"
        if isinstance(a, np.ndarray):
            if code != "p":
                raise PagedAttentionError(f"{where}: expected a NumPy scalar of that type, got a NumPy array")
            keep.append(a)
            return ctypes.c_void_p(a.__array_interface__["data"][0])
        if isinstance(a, np.generic):
            dt = a.dtype
            if code[0] == "x":
                return self._struct(i, a, code)
            if code == "p":
                if dt.kind in "iu" and dt.itemsize == 8:
                    return ctypes.c_void_p(int(a) & 0xFFFFFFFFFFFFFFFF)
                raise PagedAttentionError(
                    f"{where}: expected a NumPy array (or an np.uint64 address), got numpy.{type(a).__name__}"
                )
            ctype = _scalar_ctype(dt, code)
            if ctype is not None:
                return ctype(a.item())
            kind = {"i": "integer", "u": "integer", "b": "bool", "f": "floating-point"}.get(code[0])
            if kind is None:
                raise PagedAttentionError(f"{where}: this parameter type cannot be passed by the CPU launcher")
            raise PagedAttentionError(
                f"{where}: expected a {code[1:]}-byte {kind} NumPy scalar "
                f"(e.g. {_example(code)}), got numpy.{type(a).__name__}"
            )
        if isinstance(a, (bool, int, float)):
            want = (
                "a NumPy array (or an np.uint64 address)" if code == "p" else f"a NumPy scalar such as {_example(code)}"
            )
            raise PagedAttentionError(
                f"{where}: expected {want}, got Python {type(a).__name__} {a!r} (its C type would be ambiguous)"
            )
        raise PagedAttentionError(
            f"{where}: expected a NumPy array or NumPy scalar, got {type(a).__module__}.{type(a).__name__}"
        )

    def _struct(self, i: int, a, code: str):
        """The bytes of structured scalar ``a`` for the struct parameter
        ``i`` (code ``x<N>``): copied now (frozen, as every argument is at
        bind) into an 8-byte aligned buffer of N bytes."""
        where = f"argument {i} of kernel {self.name} ({self.param_types[i]})"
        if code[0] != "x":
            raise PagedAttentionError(f"{where}: expected {_example(code)}, got a struct (StructArg)")
        n = int(code[1:])
        if not isinstance(a, np.void) or a.dtype.names is None:
            raise PagedAttentionError(
                f"{where}: expected a structured NumPy scalar (np.void) of {n} bytes, got numpy.{type(a).__name__}"
            )
        if a.dtype.itemsize != n:
            raise PagedAttentionError(
                f"{where}: expected a structured NumPy scalar of {n} bytes (the struct's "
                f"size), got {a.dtype.itemsize} bytes"
            )
        buf = (ctypes.c_uint64 * ((n + 7) // 8))()
        ctypes.memmove(buf, a.tobytes(), n)
        return buf

    def __repr__(self) -> str:
        return f"<CpuFunction {self.name}({', '.join(self.param_types)})>"


def _example(code: str) -> str:
    return {
        "p": "a NumPy array",
        "i4": "np.int32(...)",
        "u4": "np.uint32(...)",
        "i8": "np.int64(...)",
        "u8": "np.uint64(...)",
        "f4": "np.float32(...)",
        "f8": "np.float64(...)",
        "b1": "np.bool_(...)",
        "i2": "np.int16(...)",
        "u2": "np.uint16(...)",
        "i1": "np.int8(...)",
        "u1": "np.uint8(...)",
    }.get(code, "a NumPy scalar")


def _check_dims(name: str, v, limits, kernel: str, lo: int) -> tuple[int, int, int]:
    if (
        type(v) is tuple
        and len(v) == 3
        and all(type(x) is int for x in v)
        and lo <= v[0] <= limits[0]
        and lo <= v[1] <= limits[1]
        and lo <= v[2] <= limits[2]
    ):
        return v
    try:
        t = tuple(v)
    except TypeError:
        t = None
    if (
        t is None
        or len(t) != 3
        or any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) for x in t)
    ):
        raise PagedAttentionError(f"{name}: expected 3 ints for kernel {kernel}, got {v!r}")
    t = tuple(int(x) for x in t)
    for axis, x, top in zip("xyz", t, limits):
        if not lo <= x <= top:
            raise PagedAttentionError(f"{name}: expected {name}.{axis} from {lo} to {top} for kernel {kernel}, got {t}")
    return t


class BoundLaunch:
    """A launch with its arguments frozen (array addresses and scalar values
    as at ``bind``); keeps the arrays alive. Calling it runs the whole grid."""

    __slots__ = ("function", "grid", "block", "shared_mem", "_grid", "_block", "_values", "_argv", "_keep")

    def __init__(
        self,
        function: CpuFunction,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        values: list,
        keep: list,
    ):
        self.function = function
        self.grid = grid
        self.block = block
        self.shared_mem = shared_mem
        self._grid = (ctypes.c_uint * 3)(*grid)
        self._block = (ctypes.c_uint * 3)(*block)
        self._values = values
        self._argv = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        self._keep = keep

    def __call__(self) -> None:
        if 0 in self.grid:
            return
        rc = self.function._launch(self._grid, self._block, self.shared_mem, self._argv)
        if rc == _INTERRUPTED:  # SIGINT (Ctrl-C) stopped the launch; the pool is usable again
            raise KeyboardInterrupt(self.function._rt.cupaged_rt_last_error().decode(errors="replace"))
        if rc:
            msg = self.function._rt.cupaged_rt_last_error()
            raise KernelError((msg or b"kernel failed").decode(errors="replace"))

    def __repr__(self) -> str:
        return f"<BoundLaunch {self.function.name} grid={self.grid} block={self.block} smem={self.shared_mem}>"
