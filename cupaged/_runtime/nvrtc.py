"""NVRTC without a GPU: header discovery, compile options, compile to PTX and
cubin, and reading what ptxas and the PTX say about each kernel.

Shared by the GPU backend (``cupaged._runtime.gpu``, which compiles through CuPy's
``RawModule``) and the NVRTC gate (``python -m cupaged.tools.compile_check``,
which calls ``cuda.bindings.nvrtc`` directly and needs no driver), so that the
gate sees exactly the code the GPU runs.

Options (``gpu_options``), and why:

* ``-std=c++17``: the language level the kernels are written in (CuPy 14
  defaults to it too; stating it keeps CuPy 13 and the gate identical).
* no ``--use_fast_math``: it would silently turn ``expf``/``logf``/division
  into approximations and change results between toolkit versions. Kernels
  that want the fast path say so in the source (``__expf``, ``exp2f``), where
  the CPU shim maps the same call, so both backends run what the text says.
  ``-prec-div``/``-prec-sqrt`` stay at their IEEE defaults and ``-fmad`` at its
  default (true, as nvcc).
* ``-ftz=true``: CuPy appends it to every NVRTC compile (last one wins), so
  the GPU runs flush-to-zero f32 code whatever we ask; saying it here keeps the
  gate's code identical to the GPU's and makes the choice visible.
* ``--generate-line-info``: maps SASS back to source lines in Nsight Compute
  and compute-sanitizer; it does not change the generated code.
* ``-I <dir with cuda_fp16.h and cuda_bf16.h>``: see ``find_header_dir``.

CuPy also appends ``--device-as-default-execution-space`` (and its own include
folders, which our sources do not use); the gate adds the former so that both
compile the same translation unit (``CUPY_APPENDED_OPTIONS``).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import CompileError

# Options every GPU compile gets (the -I folder is added by gpu_options()).
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-ftz=true", "--generate-line-info")
# What CuPy's RawModule appends on its own (besides -arch and include folders).
CUPY_APPENDED_OPTIONS: tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")
# Headers our kernels include in angle brackets.
REQUIRED_HEADERS: tuple[str, ...] = ("cuda_fp16.h", "cuda_bf16.h")
# Environment variable that names the header folder explicitly (checked first).
INCLUDE_ENV = "CUPAGED_CUDA_INCLUDE"


def gpu_extra_hint() -> str:
    """Which pip extra brings the GPU pieces: the one of CuPy's CUDA line
    when CuPy can tell, else both."""
    major = None
    try:
        import cupy

        major = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # no CuPy, or one that cannot reach its runtime
        pass
    if major in (12, 13):
        return f"pip install 'cupaged[cuda{major}]' (CuPy here is built for CUDA {major})"
    return "pip install 'cupaged[cuda12]' (CUDA 12) or 'cupaged[cuda13]' (CUDA 13)"


def nvrtc_module() -> ModuleType:
    """``cuda.bindings.nvrtc`` (cuda-python 12.6+ and 13.x), else the older
    ``cuda.nvrtc`` of early 12.x releases. Without cuda-python: CompileError
    naming the extra to install."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:  # cuda-python < 12.6, or none
        try:
            from cuda import nvrtc
        except ImportError:
            raise CompileError(
                f"NVRTC needs cuda-python, which is not installed: {gpu_extra_hint()}, or "
                f"pip install 'cupaged[gate]' for the NVRTC gate alone"
            ) from None
    return nvrtc


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that cuda-python loads."""
    nvrtc = nvrtc_module()
    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(nvrtc, err, "nvrtcVersion")
    return int(major), int(minor)


def _check_nvrtc(nvrtc: ModuleType, err: Any, call: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        try:
            _, msg = nvrtc.nvrtcGetErrorString(err)
            msg = msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:  # pragma: no cover - the name is only for the message
            msg = str(err)
        raise CompileError(f"{call} failed: {msg}")


# ---------------------------------------------------------------------------
# Header discovery
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HeaderDir:
    """A folder that holds ``cuda_fp16.h`` and ``cuda_bf16.h``."""

    path: str
    found_via: str  # "env", "wheel-cu13", "wheel-cu12", "pathfinder", "CUDA_PATH", ...
    cuda_major: int | None  # from CUDART_VERSION in cuda_runtime_api.h, when present


_CUDART_VERSION = re.compile(r"^\s*#\s*define\s+CUDART_VERSION\s+(\d+)", re.M)


def _cuda_major_of(include_dir: Path) -> int | None:
    try:
        text = (include_dir / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = _CUDART_VERSION.search(text)
    return int(m.group(1)) // 1000 if m else None


def _nvidia_roots() -> list[Path]:
    """Every ``site-packages/nvidia`` folder on the path (a namespace package
    spread over several site-packages when wheels land in different ones)."""
    roots: list[Path] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        roots += [Path(p) for p in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    for entry in sys.path:
        if entry:
            p = Path(entry) / "nvidia"
            if p.is_dir():
                roots.append(p)
    seen, out = set(), []
    for r in roots:
        key = str(r.resolve()) if r.exists() else str(r)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _pathfinder_dir() -> str | None:
    """cuda-pathfinder's answer for the cudart headers (wheels, conda,
    $CUDA_PATH, system installs), if that package is installed."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        return find_nvidia_header_directory("cudart")
    except Exception:
        return None


def header_dir_candidates(
    *,
    env: Mapping[str, str] | None = None,
    nvidia_roots: Iterable[str | Path] | None = None,
    use_pathfinder: bool = True,
) -> list[HeaderDir]:
    """Folders that hold both ``cuda_fp16.h`` and ``cuda_bf16.h``, best first.

    Looked for, in this order:

    1. ``$CUPAGED_CUDA_INCLUDE`` (an explicit choice always wins);
    2. the pip wheels: ``site-packages/nvidia/cu13/include`` (CUDA 13 wheels,
       one folder for the whole toolkit) and
       ``site-packages/nvidia/cuda_runtime/include`` (``nvidia-cuda-runtime-cu12``);
    3. cuda-pathfinder's answer for ``cudart`` (conda, system toolkits), only
       when 1-2 found nothing;
    4. ``$CUDA_PATH/include``, ``$CUDA_HOME/include``,
       ``$CONDA_PREFIX/targets/<arch>-linux/include``, ``$CONDA_PREFIX/include``,
       ``/usr/local/cuda/include``.

    Then, apart from 1, folders whose CUDA major version (from
    ``cuda_runtime_api.h``) matches the NVRTC library's come first: CUDA 13
    headers given to a CUDA 12 NVRTC (or the reverse) may use builtins the
    compiler does not know. ``env`` and ``nvidia_roots`` are for tests.
    """
    if env is None:
        env = os.environ
    raw: list[tuple[Path, str]] = []
    if env.get(INCLUDE_ENV):
        raw.append((Path(env[INCLUDE_ENV]), "env"))
    for root in _nvidia_roots() if nvidia_roots is None else [Path(r) for r in nvidia_roots]:
        raw.append((root / "cu13" / "include", "wheel-cu13"))
        raw.append((root / "cuda_runtime" / "include", "wheel-cu12"))
    tail: list[tuple[Path, str]] = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if env.get(var):
            tail.append((Path(env[var]) / "include", var))
    if env.get("CONDA_PREFIX"):
        import platform

        tail.append((Path(env["CONDA_PREFIX"]) / "targets" / f"{platform.machine()}-linux" / "include", "conda"))
        tail.append((Path(env["CONDA_PREFIX"]) / "include", "conda"))
    tail.append((Path("/usr/local/cuda/include"), "/usr/local/cuda"))

    def usable(p: Path) -> bool:
        return all((p / h).is_file() for h in REQUIRED_HEADERS)

    found: list[HeaderDir] = []
    seen: set[str] = set()

    def add(p: Path, via: str) -> None:
        if not usable(p):
            return
        key = str(p.resolve())
        if key in seen:
            return
        seen.add(key)
        found.append(HeaderDir(str(p.resolve()), via, _cuda_major_of(p)))

    for p, via in raw:
        add(p, via)
    if use_pathfinder and not found:
        pf = _pathfinder_dir()
        if pf:
            add(Path(pf), "pathfinder")
    for p, via in tail:
        add(p, via)

    try:
        want = nvrtc_version()[0]
    except Exception:
        want = None
    if want is not None:
        # stable sort: explicit env first, then matching major, then the rest
        found.sort(key=lambda h: (h.found_via != "env", h.cuda_major not in (want, None)))
    return found


def searched_locations() -> list[str]:
    """Human-readable list of where ``find_header_dir`` looks (for errors)."""
    locs = [f"${INCLUDE_ENV}"]
    for root in _nvidia_roots() or [Path("<site-packages>/nvidia")]:
        locs += [str(root / "cu13" / "include"), str(root / "cuda_runtime" / "include")]
    locs += [
        "cuda-pathfinder find_nvidia_header_directory('cudart')",
        "$CUDA_PATH/include",
        "$CUDA_HOME/include",
        "$CONDA_PREFIX/include",
        "/usr/local/cuda/include",
    ]
    return locs


@functools.lru_cache(maxsize=None)
def find_header_dir() -> str:
    """The folder passed to NVRTC with ``-I`` for ``cuda_fp16.h`` and
    ``cuda_bf16.h`` (first of ``header_dir_candidates``). Raises CompileError
    listing the places searched when there is none."""
    found = header_dir_candidates()
    if not found:
        raise CompileError(
            f"cuda_fp16.h / cuda_bf16.h not found: {gpu_extra_hint()} (they bring nvidia-cuda-runtime-cu12 / "
            f"nvidia-cuda-runtime), or set ${INCLUDE_ENV}. Searched: " + "; ".join(searched_locations())
        )
    return found[0].path


def gpu_options(include_dir: str | None = None) -> tuple[str, ...]:
    """Options cupaged passes to CuPy's RawModule (CuPy adds ``-arch`` for
    the device and the options in ``CUPY_APPENDED_OPTIONS``)."""
    inc = find_header_dir() if include_dir is None else include_dir
    return BASE_OPTIONS + (f"-I{inc}",)


def gate_options(arch: str, include_dir: str | None = None) -> tuple[str, ...]:
    """Options the gate compiles with for ``arch`` (``sm_90``, ``compute_90``):
    the GPU options, what CuPy appends, the architecture and the ptxas report."""
    opts = gpu_options(include_dir) + CUPY_APPENDED_OPTIONS + (f"--gpu-architecture={arch}",)
    if arch.startswith("sm_"):
        opts += ("--ptxas-options=-v",)
    return opts


# ---------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------


@dataclass
class Compiled:
    """What one NVRTC compile of one source for one architecture gave."""

    ok: bool
    arch: str
    log: str
    ptx: str = field(default="", repr=False)
    cubin: bytes = field(default=b"", repr=False)
    seconds: float = 0.0
    options: tuple[str, ...] = ()


def _get_bytes(nvrtc: ModuleType, prog: Any, size_fn: Any, get_fn: Any, call: str) -> bytes:
    err, n = size_fn(prog)
    _check_nvrtc(nvrtc, err, call + "Size")
    # NVRTC writes into this buffer: it must be a fresh object. ``b" " * 1``
    # is CPython's shared one-byte b" " (and ``b" " * 0`` the shared b""): an
    # empty log (size 1) once overwrote every b" " in the process with NUL.
    buf = b" " * (n + 2)
    (err,) = get_fn(prog, buf)
    _check_nvrtc(nvrtc, err, call)
    return buf[:n]


def compile_source(text: str, arch: str, *, name: str = "cupaged.cu", options: Iterable[str] | None = None) -> Compiled:
    """Compile ``text`` with NVRTC for ``arch`` (``sm_XX`` gives PTX and
    cubin plus the ptxas report in the log; ``compute_XX`` gives PTX only).
    ``options`` defaults to ``gate_options(arch)``. Needs no GPU and no driver.
    A compile error is returned (``ok=False`` with the log), not raised."""
    nvrtc = nvrtc_module()
    opts = gate_options(arch) if options is None else tuple(options)
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    _check_nvrtc(nvrtc, err, "nvrtcCreateProgram")
    try:
        t0 = time.perf_counter()
        enc = [o.encode() for o in opts]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        seconds = time.perf_counter() - t0
        raw_log = _get_bytes(nvrtc, prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, "nvrtcGetProgramLog")
        log = raw_log.rstrip(b"\0").decode(errors="replace").strip()
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            if res != nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION:
                _, msg = nvrtc.nvrtcGetErrorString(res)
                log = f"{msg.decode() if isinstance(msg, bytes) else msg}\n{log}"
            return Compiled(False, arch, log, seconds=seconds, options=opts)
        raw_ptx = _get_bytes(nvrtc, prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, "nvrtcGetPTX")
        ptx = raw_ptx.rstrip(b"\0").decode(errors="replace")
        cubin = b""
        if arch.startswith("sm_"):
            cubin = _get_bytes(nvrtc, prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, "nvrtcGetCUBIN")
        return Compiled(True, arch, log, ptx, cubin, seconds, opts)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---------------------------------------------------------------------------
# Reading the ptxas report and the PTX
# ---------------------------------------------------------------------------


@dataclass
class FunctionReport:
    """ptxas figures for one function (an entry point or a device function
    that was not inlined)."""

    name: str
    is_entry: bool = False
    registers: int = 0
    barriers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0  # static shared memory, bytes
    cmem: int = 0  # constant bank 0, bytes
    cumulative_stack: int = 0
    # ptxas serialized its wgmma.mma_async instructions (a wait after each: "Potential Performance Loss",
    # C7510 - C7520), for a reason the log names
    wgmma_serialized: str = ""


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_BARRIERS = re.compile(r"used (\d+) barriers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")
_RE_CUMSTACK = re.compile(r"(\d+) bytes cumulative stack size")
_RE_WGMMA_SERIAL = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized due to (.*?)"
    r" in the function '([\w$]+)'"
)


def parse_ptxas(log: str) -> dict[str, FunctionReport]:
    """Per-function figures from a ``--ptxas-options=-v`` log, by name.

    The report looks like::

        ptxas info    : Compiling entry function 'k' for 'sm_90'
        ptxas info    : Function properties for k
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 32 registers, used 1 barriers, 1024 bytes smem, 368 bytes cmem[0]

    Device functions that were not inlined get a "Function properties" block
    (stack and spills) without "Compiling entry function" or "Used".
    """
    out: dict[str, FunctionReport] = {}
    entry: str | None = None
    props: str | None = None

    def get(name: str) -> FunctionReport:
        if name not in out:
            out[name] = FunctionReport(name)
        return out[name]

    for line in log.splitlines():
        m = _RE_WGMMA_SERIAL.search(line)
        if m:
            get(m.group(3)).wgmma_serialized = f"{m.group(1)}: {' '.join(m.group(2).split())}"
            continue
        m = _RE_ENTRY.search(line)
        if m:
            entry = m.group(1)
            get(entry).is_entry = True
            props = None
            continue
        m = _RE_PROPS.search(line)
        if m:
            props = m.group(1)
            get(props)
            continue
        m = _RE_FRAME.search(line)
        if m and props is not None:
            r = get(props)
            r.stack_frame, r.spill_stores, r.spill_loads = (int(g) for g in m.groups())
            continue
        m = _RE_USED.search(line)
        if m and entry is not None:
            r = get(entry)
            r.registers = int(m.group(1))
            for rx, attr in (
                (_RE_BARRIERS, "barriers"),
                (_RE_SMEM, "smem"),
                (_RE_CMEM, "cmem"),
                (_RE_CUMSTACK, "cumulative_stack"),
            ):
                mm = rx.search(line)
                if mm:
                    setattr(r, attr, int(mm.group(1)))
    return out


_RE_PTX_FUNC = re.compile(
    r"^[ \t]*(?:\.(?:visible|weak|extern)[ \t]+)*\.(entry|func)\b[ \t]*(?:\([^)]*\)[ \t]*)?([\w$]+)", re.M
)
_RE_LD_GLOBAL = re.compile(r"\bld\.global((?:\.[\w:]+)*)")
_RE_CP_ASYNC = re.compile(
    r"\bcp\.async(?:\.[\w:]+)*\.shared(?:::\w+)?\.global(?:\.[\w:]+)*\s+\[[^\]]*\]\s*,"
    r"\s*\[[^\]]*\]\s*,\s*(\d+)"
)
_RE_CP_BULK = re.compile(r"\bcp\.async\.bulk\b")
_RE_TYPE = re.compile(r"^(?:[bsuf](8|16|32|64)|f16x2|bf16x2|bf16|e4m3x2|e5m2x2)$")


def _type_bits(tok: str) -> int | None:
    m = _RE_TYPE.match(tok)
    if not m:
        return None
    if m.group(1):
        return int(m.group(1))
    return 32 if tok.endswith("x2") else 16


def ld_global_bits(suffix: str) -> int:
    """Bits moved per thread by one ``ld.global<suffix>`` instruction
    (``.nc.v4.f32`` -> 128, ``.v2.u64`` -> 128, ``.u32`` -> 32)."""
    vec, bits = 1, None
    for tok in suffix.split("."):
        if tok in ("v2", "v4", "v8"):
            vec = int(tok[1:])
        else:
            b = _type_bits(tok)
            if b is not None:
                bits = b
    return vec * (bits or 0)


def ptx_functions(ptx: str) -> dict[str, tuple[str, str]]:
    """``{name: (kind, body)}`` for each ``.entry`` and ``.func`` of a PTX text."""
    heads = list(_RE_PTX_FUNC.finditer(ptx))
    out: dict[str, tuple[str, str]] = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(ptx)
        kind, name = m.group(1), m.group(2)
        body = ptx[m.start() : end]
        if name in out:
            body = out[name][1] + body  # a prototype and then the definition
        out[name] = (kind, body)
    return out


def widest_global_load(body: str) -> int:
    """Widest global-memory load in a PTX function body, in bits per thread:
    ``ld.global[.nc][...].vN.T`` and ``cp.async ... [shared], [global], 16``
    (a 16-byte copy counts as 128 bits); a TMA bulk copy counts as 128."""
    best = 0
    for m in _RE_LD_GLOBAL.finditer(body):
        best = max(best, ld_global_bits(m.group(1)))
    for m in _RE_CP_ASYNC.finditer(body):
        best = max(best, 8 * int(m.group(1)))
    if _RE_CP_BULK.search(body):
        best = max(best, 128)
    return best


def kernel_wide_loads(ptx: str) -> dict[str, int]:
    """``{entry name: widest global load in bits}`` for every kernel in ``ptx``."""
    return {name: widest_global_load(body) for name, (kind, body) in ptx_functions(ptx).items() if kind == "entry"}
