"""The GPU backend: NVRTC through CuPy's ``RawModule``, launches and stream
work through the CUDA driver API of cuda-python.

* ``load_module(text, variant, device)`` compiles an assembled source
  (``cupaged._runtime.source``) with ``cupaged._runtime.nvrtc.gpu_options()`` for the
  device's own architecture (CuPy picks ``-arch=sm_XX`` from the device).
  Cached in process per (device, variant, digest of the text); CuPy's disk
  cache (keyed by the text and the options) covers later processes. Our own
  headers are inlined into the text, so the text is a complete key. A
  read-only CuPy cache serves what it holds; new modules go to a per-user
  fallback (``_compile_cached``), as for the CPU backend.
* ``GpuFunction.launch`` calls ``cuLaunchKernel`` on an explicit stream
  handle (a dependent launch with ``CUPAGED_PDL=1`` on sm_90 and later:
  ``cuLaunchKernelEx`` with programmatic stream serialization); it
  allocates nothing on the device and never synchronizes.
* ``current_stream(like)`` wraps CuPy's current stream on ``like``'s device in
  a ``GpuStream`` (one object per (device, stream handle)), which implements
  ``cupaged.stream.Stream`` with ``cuMemsetD32Async``, ``cuMemcpyDtoDAsync``,
  ``cuMemcpyHtoDAsync``, ``cuStreamBeginCapture`` / ``cuStreamEndCapture`` /
  ``cuGraphInstantiate`` and ``cuGraphLaunch``.

Every driver call is checked; a failure raises RuntimeError naming the call
and the CUDA error. Driver calls run with the device's primary context (the
one CuPy uses) current, pushed only when another one is current.

CuPy and the driver are imported lazily: importing this module needs neither
(the CPU-only tests read its option and cache-key helpers).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import CompileError, PagedAttentionError, SetupError
from . import arrays as _backend
from . import cpu as _cpu
from . import nvrtc as _nvrtc
from . import progress as _progress
from . import source as _source
from .arrays import Array
from .stream import Graph, Stream, dependent_launches
from .structs import StructArg

# Shared memory (static + dynamic) a launch may use without opting in.
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024

_drv: Any = None
_drv_ready = False
_lock = threading.Lock()


# ---------------------------------------------------------------------------
# cuda-python driver access
# ---------------------------------------------------------------------------


def driver_module() -> Any:
    """``cuda.bindings.driver`` (cuda-python 12.6+ and 13.x), else the older
    ``cuda.cuda`` of early 12.x releases. Importing it needs no driver."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver
        except ImportError:  # cuda-python < 12.6, or none
            try:
                from cuda import cuda as driver
            except ImportError:
                raise PagedAttentionError(
                    f"the GPU backend (CuPy arrays) needs cuda-python for its driver streams and graphs, "
                    f"which is not installed: {_nvrtc.gpu_extra_hint()}"
                ) from None
        _drv = driver
    return _drv


def _driver():
    """The driver module, after ``cuInit`` (once)."""
    global _drv_ready
    drv = driver_module()
    if not _drv_ready:
        err = drv.cuInit(0)[0]
        if int(err) != 0:
            raise SetupError(
                f"cuInit failed: {_error_text(err)}; the GPU backend needs an NVIDIA driver (the CPU "
                f"backend runs on NumPy arrays without one)"
            )
        _drv_ready = True
    return drv


def _error_text(err) -> str:
    name = getattr(err, "name", None) or str(err)
    try:
        res, desc = driver_module().cuGetErrorString(err)
        if int(res) == 0 and desc:
            return f"{name}: {desc.decode() if isinstance(desc, bytes) else desc}"
    except Exception:  # no driver loaded: the enum name is enough
        pass
    return name


def _check(result, call: str):
    """Unpack a cuda-python driver result ``(CUresult, *values)``: raise
    RuntimeError naming ``call`` unless it is CUDA_SUCCESS; return None, the
    one value or a tuple of values."""
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{call} failed: {_error_text(err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else tuple(result[1:])


_primary: dict[int, object] = {}


def _primary_ctx(device: int):
    ctx = _primary.get(device)
    if ctx is None:
        drv = _driver()
        dev = _check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
        # Retained once for the life of the process, like CuPy's runtime does.
        ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device})")
        _primary[device] = ctx
    return ctx


def _push(device: int) -> bool:
    """Make ``device``'s primary context current; True when one was pushed
    (the caller pops it)."""
    drv = _driver()
    ctx = _primary_ctx(device)
    cur = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if cur is not None and int(cur) == int(ctx):
        return False
    _check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    return True


def _pop() -> None:
    _check(_driver().cuCtxPopCurrent(), "cuCtxPopCurrent")


class _OnDevice:
    """``with _OnDevice(dev):`` runs driver calls in ``dev``'s context."""

    __slots__ = ("device", "pushed")

    def __init__(self, device: int):
        self.device = device
        self.pushed = False

    def __enter__(self):
        self.pushed = _push(self.device)
        return self

    def __exit__(self, *exc):
        if self.pushed:
            _pop()
        return False


def multiprocessor_count(device: int) -> int:
    """SMs of GPU ``device`` (one attribute query; CuPy's Device.attributes reads them all)."""
    import cupy

    rt = cupy.cuda.runtime
    return int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, int(device)))


# ---------------------------------------------------------------------------
# Modules and functions
# ---------------------------------------------------------------------------


def module_options() -> tuple[str, ...]:
    """NVRTC options for ``RawModule`` (see ``cupaged._runtime.nvrtc``). Without a
    header folder of our own, CuPy's own search (cuda-pathfinder) is relied on."""
    try:
        return _nvrtc.gpu_options()
    except CompileError:
        return _nvrtc.BASE_OPTIONS


def module_key(source_text: str, variant: str, device: int) -> tuple:
    """In-process cache key of a compiled module."""
    return int(device), variant, _source.digest(source_text)


_modules: dict[tuple, GpuModule | TargetModule] = {}


def load_module(source_text: str, variant: str, device: int, target: str | None = None) -> GpuModule | TargetModule:
    """The module of ``source_text`` (an assembled variant) compiled by NVRTC
    for ``device``; raises CompileError with the NVRTC log on failure.
    ``target``: an arch-specific compile target (``sm_90a``, the variant's
    ``CP_TARGET``), which CuPy's RawModule cannot pass: such a module is
    compiled by NVRTC for that target here and loaded with cuModuleLoadData
    (``TargetModule``)."""
    key = module_key(source_text, variant, device) + ((target,) if target else ())
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = (
                    TargetModule(source_text, variant, int(device), target)
                    if target
                    else GpuModule(source_text, variant, int(device))
                )
                _modules[key] = mod
    return mod


CUPY_CACHE_ENV = "CUPY_CACHE_DIR"


def _compile_cached(raw, source_text: str, options: tuple[str, ...], arch: str) -> None:
    """``raw.compile()`` (a RawModule) through CuPy's disk cache. A read-only
    one (a pre-warmed image) still serves the modules it holds; a new module
    CuPy cannot save there (it fails after compiling) is compiled again with
    CuPy's cache in a per-user fallback (``cpu.writable_dir``, told once on
    stderr), where a marker sends later processes directly. Called under
    ``_lock`` (``load_module``): ``CUPY_CACHE_DIR`` is swapped meanwhile."""
    from cupy.cuda import compiler

    primary = Path(compiler.get_cache_dir())
    t0 = time.perf_counter()
    try:
        with _progress.building():
            _compile_in(raw, source_text, options, arch, primary)
    finally:
        if time.perf_counter() - t0 > COMPILE_NOTICE_SECONDS:  # a real compile, not CuPy's cache
            _progress.notice_once(
                "gpu-compile",
                f"compiling GPU kernels on first use (NVRTC, a second or more each; CuPy keeps them in {primary}, "
                f"later runs load them)",
            )


#: A module that took longer than this to load was compiled (CuPy's disk cache answers in milliseconds).
COMPILE_NOTICE_SECONDS = 0.5


def _compile_in(raw, source_text: str, options: tuple[str, ...], arch: str, primary: Path) -> None:
    marker = f"cupaged-{_source.digest(source_text, ' '.join(options), arch)}.moved"
    for folder in _cpu.fallback_dirs(primary, "cupy"):
        if (folder / marker).is_file() and _cpu.unwritable(folder) is None:
            with _cupy_cache(folder):
                raw.compile()
            return
    try:
        raw.compile()
        return
    except OSError:
        if _cpu.unwritable(primary) is None:  # not the cache folder's fault
            raise
    folder = _cpu.writable_dir(primary, "cupy", "GPU kernels (CuPy's cache)", CUPY_CACHE_ENV)
    with _cupy_cache(folder):
        raw.compile()
    try:
        (folder / marker).touch()
    except OSError:  # only saves a compile in later processes
        pass


@contextlib.contextmanager
def _cupy_cache(folder: Path):
    old = os.environ.get(CUPY_CACHE_ENV)
    os.environ[CUPY_CACHE_ENV] = str(folder)
    try:
        yield
    finally:
        if old is None:
            del os.environ[CUPY_CACHE_ENV]
        else:
            os.environ[CUPY_CACHE_ENV] = old


class GpuModule:
    """One compiled variant on one device."""

    def __init__(self, source_text: str, variant: str, device: int):
        import cupy
        from cupy.cuda import compiler

        self.variant = variant
        self.device = device
        self.kernel_names = _source.kernel_names(source_text)
        self.options = module_options()
        self._functions: dict[str, GpuFunction] = {}
        with cupy.cuda.Device(device):
            self._raw = cupy.RawModule(code=source_text, options=self.options)
            try:
                _compile_cached(self._raw, source_text, self.options, cupy.cuda.Device(device).compute_capability)
            except compiler.CompileException as e:
                raise CompileError(f"NVRTC could not compile {variant} for device {device}:\n{e}") from e

    def get_function(self, name: str) -> "GpuFunction":
        fn = self._functions.get(name)
        if fn is None:
            if name not in self.kernel_names:
                raise KeyError(f"kernel {name!r} is not in {self.variant}; it has {self.kernel_names}")
            import cupy

            with cupy.cuda.Device(self.device):
                try:
                    raw_kernel = self._raw.get_function(name)
                    cufn = raw_kernel.kernel  # cupy.cuda.function.Function
                except cupy.cuda.driver.CUDADriverError as e:  # e.g. a kernel inside an #if not taken
                    raise KeyError(f"kernel {name!r} is not in the compiled {self.variant}: {e}") from None
                static_smem = int(raw_kernel.shared_size_bytes)
            fn = GpuFunction(name, int(cufn.ptr), self.device, self, static_smem=static_smem)
            fn._cupy_function = cufn  # holds its CUmodule, independently of CuPy's memo cache
            self._functions[name] = fn
        return fn


#: The first NVRTC compile of an arch-specific variant in a process says so.
TARGET_BUILD_NOTICE = (
    "compiling GPU kernels for an arch-specific target on first use (NVRTC, seconds each; kept in {folder}, "
    "later runs load them)"
)


def target_cubin(source_text: str, variant: str, target: str, options: tuple[str, ...]) -> bytes:
    """NVRTC's cubin of ``source_text`` for ``target`` (``sm_90a``), kept on
    disk beside the CPU libraries (``cpu.cache_dir()``, with its read-only
    and fallback rules and checksums) and keyed by the source, the options
    and the NVRTC version, so a process compiles only what no earlier one
    did. CompileError with NVRTC's log when it does not compile. Needs no GPU."""
    key = _source.digest(source_text, " ".join(options), target, ".".join(map(str, _nvrtc.nvrtc_version())))
    stem = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in variant)[:150] or "module"

    def build(path: Path) -> None:
        c = _nvrtc.compile_source(source_text, target, name=f"{variant}.cu", options=options)
        if not c.ok:
            raise CompileError(f"NVRTC could not compile {variant} for {target}:\n{c.log}")
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
            out = Path(tmp) / path.name
            out.write_bytes(c.cubin)
            _cpu._install(out, path)

    return _cpu._library(f"{stem}-{target}-{key}.cubin", build, TARGET_BUILD_NOTICE).read_bytes()


class TargetModule:
    """One variant compiled for an arch-specific target (``sm_90a``) on one
    device: NVRTC (``nvrtc.compile_source`` with the GPU options and the
    target) to a cubin, loaded through the driver. The device's arch must be
    the target's (sm_90a code runs on compute capability 9.0 only)."""

    def __init__(self, source_text: str, variant: str, device: int, target: str):
        import cupy

        self.variant = variant
        self.device = device
        self.kernel_names = _source.kernel_names(source_text)
        self._functions: dict[str, GpuFunction] = {}
        cc = cupy.cuda.Device(device).compute_capability
        if f"sm_{cc}" != target.rstrip("af"):
            raise CompileError(f"{variant} is built for {target} only; device {device} is sm_{cc}")
        opts = module_options() + _nvrtc.CUPY_APPENDED_OPTIONS + (f"--gpu-architecture={target}",)
        cubin = target_cubin(source_text, variant, target, opts)
        drv = _driver()
        with _OnDevice(device):
            self._module = _check(drv.cuModuleLoadData(cubin), f"cuModuleLoadData({variant})")

    def get_function(self, name: str) -> "GpuFunction":
        fn = self._functions.get(name)
        if fn is None:
            if name not in self.kernel_names:
                raise KeyError(f"kernel {name!r} is not in {self.variant}; it has {self.kernel_names}")
            drv = _driver()
            with _OnDevice(self.device):
                cufn = _check(drv.cuModuleGetFunction(self._module, name.encode()), f"cuModuleGetFunction({name})")
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
                static_smem = int(_check(drv.cuFuncGetAttribute(attr, cufn), f"cuFuncGetAttribute({name})"))
            fn = GpuFunction(name, int(cufn), self.device, self, static_smem=static_smem)
            self._functions[name] = fn
        return fn


def pack_args(args: tuple, kernel: str = "kernel") -> tuple[ctypes.Array[ctypes.c_void_p], list] | tuple[None, None]:
    """``cuLaunchKernel`` parameters for ``args``: a ctypes ``void*`` array
    (one pointer per argument, to its value) and the objects holding the
    values, which must live until the launch call returns. A CuPy array
    stands for its data pointer, a NumPy scalar for its C value (a
    structured scalar, or a ``StructArg``'s, for a struct passed by value),
    None for a null pointer. Returns (None, None) when there are no
    arguments."""
    n = len(args)
    if n == 0:
        return None, None
    slots = (ctypes.c_void_p * n)()
    holders: list = []
    for i, a in enumerate(args):
        if type(a) is StructArg:
            a = a.value  # its arrays are kept alive by the caller's reference to the StructArg
        if isinstance(a, np.generic):
            value = np.array(a)  # 0-d copy with its own storage, C layout of the dtype
            slots[i] = value.ctypes.data
            holders.append(value)
            continue
        if a is None:
            v = ctypes.c_uint64(0)
        elif _backend.array_backend(a) == _backend.GPU:
            v = ctypes.c_uint64(int(a.data.ptr))
        elif isinstance(a, np.ndarray):
            raise PagedAttentionError(f"args[{i}] of {kernel}: expected a CuPy array, got a NumPy array")
        else:
            raise PagedAttentionError(
                f"args[{i}] of {kernel}: expected a CuPy array, a NumPy scalar (np.int32, np.float32, ...), "
                f"a StructArg or None, got {type(a).__name__}"
            )
        slots[i] = ctypes.addressof(v)
        holders.append(v)
    return slots, holders


class GpuFunction:
    """A kernel of a GpuModule on one device."""

    def __init__(self, name: str, handle: int, device: int, module: GpuModule | TargetModule, static_smem: int = 0):
        self.name = name
        self.device = device
        self.handle = handle
        self._module = module  # keeps the CUmodule loaded
        self._cupy_function: Any = None  # CuPy's Function object, which also holds the CUmodule
        self._cufunc = driver_module().CUfunction(handle)
        # Without opting in, static + dynamic shared memory may total 48 KiB:
        # the driver rejects dynamic bytes above 48 KiB - static.
        self.static_smem = int(static_smem)
        self._smem_optin = DEFAULT_MAX_DYNAMIC_SHARED - self.static_smem
        self._pdl_attrs: list | None = None  # the programmatic dependent launch attribute, made once

    def __repr__(self):
        return f"GpuFunction({self.name!r}, device={self.device}, variant={self._module.variant!r})"

    def launch(
        self, stream_ptr: int, grid: tuple, block: tuple, shared_mem: int, args: tuple, dependent: bool = False
    ) -> None:
        """``cuLaunchKernel`` on the stream handle ``stream_ptr``. ``args``:
        CuPy arrays (their pointers) and NumPy scalars (their C values).
        Above 48 KiB of shared memory in all (dynamic + the kernel's static)
        the kernel is opted in first (``cuFuncSetAttribute``, once per larger
        size). ``dependent``: ``cuLaunchKernelEx`` with programmatic stream
        serialization allowed (a programmatic dependent launch; captured
        into a graph as a programmatic edge)."""
        drv = _driver()
        slots, holders = pack_args(args, self.name)
        shared_mem = int(shared_mem)
        with _OnDevice(self.device):
            if shared_mem > self._smem_optin:
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(
                    drv.cuFuncSetAttribute(self._cufunc, attr, shared_mem),
                    f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_mem}) for {self.name}",
                )
                self._smem_optin = shared_mem
            if dependent:
                _check(
                    drv.cuLaunchKernelEx(
                        self._dependent_config(drv, grid, block, shared_mem, stream_ptr),
                        self._cufunc,
                        None if slots is None else ctypes.addressof(slots),
                        0,
                    ),
                    f"cuLaunchKernelEx({self.name}, grid={tuple(grid)}, block={tuple(block)}, "
                    f"shared_mem={shared_mem}, programmatic stream serialization)",
                )
            else:
                _check(
                    drv.cuLaunchKernel(
                        self._cufunc,
                        grid[0],
                        grid[1],
                        grid[2],
                        block[0],
                        block[1],
                        block[2],
                        shared_mem,
                        int(stream_ptr),
                        None if slots is None else ctypes.addressof(slots),
                        0,
                    ),
                    f"cuLaunchKernel({self.name}, grid={tuple(grid)}, block={tuple(block)}, shared_mem={shared_mem})",
                )
        del holders  # the driver has copied the parameter values

    def _dependent_config(self, drv: Any, grid: tuple, block: tuple, shared_mem: int, stream_ptr: int) -> Any:
        """The ``CUlaunchConfig`` of a programmatic dependent launch: the
        dimensions, shared memory and stream, and one attribute,
        ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` = 1."""
        if self._pdl_attrs is None:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._pdl_attrs = [attr]
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(x) for x in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(x) for x in block)
        cfg.sharedMemBytes = int(shared_mem)
        cfg.hStream = drv.CUstream(int(stream_ptr))
        cfg.attrs = self._pdl_attrs
        cfg.numAttrs = 1
        return cfg


# ---------------------------------------------------------------------------
# Streams and graphs
# ---------------------------------------------------------------------------


class _NativeGraph(tuple):
    """``(CUgraph, CUgraphExec)``; destroys both when the Graph goes. An exec
    destroyed while a launch is in flight is freed when that launch completes."""

    def __new__(cls, graph, graph_exec):
        return super().__new__(cls, (graph, graph_exec))

    def __del__(self):
        try:
            drv = driver_module()
            drv.cuGraphExecDestroy(self[1])
            drv.cuGraphDestroy(self[0])
        except Exception:  # interpreter shutdown or driver gone
            pass


# Host copies whose stream object went away before they were known complete.
_orphans: deque = deque()


def _reap(q: deque, free_events: list | None) -> None:
    """Drop the (event, pinned buffer) pairs at the head of ``q`` whose copy
    has completed; stop at the first one still running. Never waits."""
    drv = _driver()
    not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
    while q:
        event, _buf = q[0]
        (err,) = drv.cuEventQuery(event)
        if err == not_ready:
            return
        _check((err,), "cuEventQuery")
        q.popleft()
        if free_events is not None:
            free_events.append(event)
        else:
            drv.cuEventDestroy(event)


class GpuStream(Stream):
    """A CuPy stream as a ``cupaged.stream.Stream`` (see the module docstring)."""

    backend = _backend.GPU

    def __init__(self, device: int, cupy_stream: Any):
        super().__init__()
        self.device = int(device)
        self.ptr = int(cupy_stream.ptr)
        self._stream_ref = weakref.ref(cupy_stream)
        self._inflight: deque = deque()  # (CUevent, pinned buffer) of host copies, oldest first
        self._free_events: list = []
        self._pdl: bool | None = None  # programmatic dependent launches (known at the first dependent one)

    def __repr__(self):
        return f"GpuStream(device={self.device}, ptr={self.ptr:#x})"

    # -- launches ---------------------------------------------------------
    def _launch(self, kernel, grid, block, shared_mem, args, dependent) -> None:
        if not isinstance(kernel, GpuFunction):
            raise PagedAttentionError(
                f"kernel: expected a GPU kernel (from get_kernel with a CuPy array), got {type(kernel).__name__}"
            )
        if kernel.device != self.device:
            raise PagedAttentionError(
                f"kernel: expected a kernel loaded on device {self.device}, got one for device {kernel.device}"
            )
        for i, a in enumerate(args):
            if _backend.array_backend(a) == _backend.GPU and int(a.device.id) != self.device:
                raise PagedAttentionError(
                    f"args[{i}]: expected an array on device {self.device}, got device {a.device.id}"
                )
        kernel.launch(self.ptr, grid, block, shared_mem, args, dependent=dependent and self._dependent_launches())
        self._keep(kernel, *(a for a in args if not isinstance(a, np.generic)))

    def _dependent_launches(self) -> bool:
        """Whether a dependent launch here is a programmatic dependent one:
        ``CUPAGED_PDL=1`` (``stream.dependent_launches``) and compute
        capability 9.0 or later."""
        if self._pdl is None:
            import cupy

            cc = int(cupy.cuda.Device(self.device).compute_capability)
            self._pdl = cc >= 90 and dependent_launches()
        return self._pdl

    # -- memory -----------------------------------------------------------
    def _memset_d32(self, dst, value, count, offset_bytes) -> None:
        addr = int(dst.data.ptr) + offset_bytes
        if addr % 4:
            raise PagedAttentionError(f"dst: expected a 4-byte aligned address for memset_d32, got {addr:#x}")
        if count:
            drv = _driver()
            with _OnDevice(self.device):
                _check(drv.cuMemsetD32Async(addr, value, count, self.ptr), "cuMemsetD32Async")
        self._keep(dst)

    def _copy(self, dst, src, nbytes, dst_offset, src_offset) -> None:
        drv = _driver()
        with _OnDevice(self.device):
            _check(
                drv.cuMemcpyDtoDAsync(int(dst.data.ptr) + dst_offset, int(src.data.ptr) + src_offset, nbytes, self.ptr),
                "cuMemcpyDtoDAsync",
            )
        self._keep(dst, src)

    def _copy_from_host(self, dst, host, dst_offset) -> None:
        """Stage ``host`` in pinned memory and copy it asynchronously. The
        pinned buffer lives until an event recorded after the copy reports
        completion (checked lazily at the next host copy or synchronize), or,
        under capture, as long as the graph (a replay copies it again)."""
        import cupy

        drv = _driver()
        n = host.nbytes
        capturing = self.capturing
        if not capturing:
            _reap(self._inflight, self._free_events)
            if _orphans:
                _reap(_orphans, None)
        buf = cupy.cuda.alloc_pinned_memory(n)
        ctypes.memmove(int(buf.ptr), host.ctypes.data, n)
        with _OnDevice(self.device):
            _check(
                drv.cuMemcpyHtoDAsync(int(dst.data.ptr) + dst_offset, int(buf.ptr), n, self.ptr), "cuMemcpyHtoDAsync"
            )
            if capturing:
                self._keep(dst, buf)
                return
            event = (
                self._free_events.pop()
                if self._free_events
                else _check(drv.cuEventCreate(int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
            )
            _check(drv.cuEventRecord(event, self.ptr), "cuEventRecord")
        self._inflight.append((event, buf))

    # -- capture ----------------------------------------------------------
    def _begin_capture(self) -> None:
        """Relaxed mode, as CuPy's own ``Stream.begin_capture``: CuPy's memory
        pool (and our pinned staging of host copies) may allocate while a
        capture is open, and the thread-local / global modes turn those calls
        into capture errors, although captured work never depends on them."""
        if self.ptr in (0, 1):
            raise PagedAttentionError(
                "stream: CUDA cannot capture the legacy default stream; make a non-default stream current "
                "first, e.g. `with cupy.cuda.Stream(non_blocking=True):`"
            )
        drv = _driver()
        with _OnDevice(self.device):
            _check(
                drv.cuStreamBeginCapture(self.ptr, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                "cuStreamBeginCapture",
            )
        self._capture, self._capture_keep = [], []

    def _end_capture(self) -> Graph:
        keep = self._capture_keep
        assert keep is not None  # end_capture checked that this thread is capturing
        self._capture = self._capture_keep = None
        drv = _driver()
        with _OnDevice(self.device):
            graph = _check(drv.cuStreamEndCapture(self.ptr), "cuStreamEndCapture")
            try:
                graph_exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            except BaseException:
                drv.cuGraphDestroy(graph)
                raise
        return Graph(self, ops=[], keep_alive=keep, native=_NativeGraph(graph, graph_exec))

    def _replay(self, graph: Graph) -> None:
        if graph.stream is not self or graph._native is None:
            raise PagedAttentionError("graph: captured on another stream")
        drv = _driver()
        with _OnDevice(self.device):
            _check(drv.cuGraphLaunch(graph._native[1], self.ptr), "cuGraphLaunch")

    def synchronize(self) -> None:
        """Wait for all work issued so far on this stream."""
        drv = _driver()
        with _OnDevice(self.device):
            _check(drv.cuStreamSynchronize(self.ptr), "cuStreamSynchronize")
        while self._inflight:  # all complete now
            event, _ = self._inflight.popleft()
            self._free_events.append(event)


_streams: dict[tuple, GpuStream] = {}


def _retire(key: tuple, stream: GpuStream, streams: dict | None = None, orphans: deque | None = None, drv=None) -> None:
    """The CuPy stream of ``stream`` was destroyed: forget it, keeping its
    unfinished host copies' buffers alive until they complete. ``streams``,
    ``orphans`` and ``drv``: the registry, orphan queue and driver the
    stream was made with (a finalizer runs whenever the CuPy stream is
    collected; it must not hand its events to another driver's queue)."""
    streams = _streams if streams is None else streams
    orphans = _orphans if orphans is None else orphans
    if streams.get(key) is stream:
        del streams[key]
    orphans.extend(stream._inflight)
    stream._inflight.clear()
    for ev in stream._free_events:
        try:
            (driver_module() if drv is None else drv).cuEventDestroy(ev)
        except Exception:
            pass
    stream._free_events.clear()


def current_stream(like: Array) -> GpuStream:
    """The GpuStream of CuPy's current stream on ``like``'s device (one object
    per (device, stream handle) for as long as the CuPy stream lives)."""
    cupy: ModuleType | None = sys.modules.get("cupy")
    if cupy is None:
        cupy = importlib.import_module("cupy")
    dev = int(like.device.id)
    cs = cupy.cuda.get_current_stream(dev)
    key = (dev, int(cs.ptr))
    s = _streams.get(key)
    if s is not None and s._stream_ref() is cs:
        return s
    with _lock:
        s = _streams.get(key)
        if s is not None and s._stream_ref() is cs:
            return s
        if s is not None:  # handle reused by a new stream object
            _retire(key, s)
        s = GpuStream(dev, cs)
        _streams[key] = s
        fin = weakref.finalize(cs, _retire, key, s, _streams, _orphans, driver_module())
        fin.atexit = False  # nothing to release at exit
    return s
