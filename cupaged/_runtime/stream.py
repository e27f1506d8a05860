"""Streams: the one way cupaged issues work, on either backend.

A Stream offers kernel launch, ``memset_d32``, device-to-device and
host-to-device async copies, and capture into a graph plus replay.

* GPU: cuda-python driver calls on CuPy's current stream
  (``cuMemsetD32Async``, ``cuMemcpyDtoDAsync``, ``cuStreamBeginCapture`` ...),
  see ``cupaged._runtime.gpu``.
* CPU: every call runs at once, in order. While capturing, calls are recorded
  instead, with their arguments frozen at capture (array addresses, scalar
  values), and ``Graph.launch()`` re-runs them in order, exactly as a CUDA
  graph freezes kernel parameters. ``host_call(fn)`` issues a host callable
  (NumPy / BLAS work on preallocated arrays, ``ops.layers``' ``host=True``
  path) the same way: run at once, or recorded and re-run by every replay.

Arguments to ``launch`` follow ``cuLaunchKernel``: a tuple where an array
stands for its data pointer and a NumPy scalar (``np.int32``, ``np.uint32``,
``np.float32``, ``np.int64``, ``np.uint64``) for a value of that C type.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import PagedAttentionError
from . import arrays as _backend
from .arrays import Array

# Launch dimensions: an int or up to three ints (x, y, z).
Dims = int | Sequence[int]

#: ``CUPAGED_PDL=1``: a launch asked to be dependent (``Stream.launch``) is a
#: programmatic dependent launch on sm_90 and later; unset or anything else:
#: an ordinary launch. Off by default: the performance model finds no gain for
#: the split merge at its assumed release (docs/performance.md) until a GPU run
#: measures it (``python -m cupaged.tools.calibrate``, launch gaps).
PDL_ENV = "CUPAGED_PDL"


def dependent_launches() -> bool:
    """Whether ``CUPAGED_PDL=1`` asks for programmatic dependent launches."""
    return os.environ.get(PDL_ENV, "") == "1"


def _check_span(name: str, arr: Array, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > arr.nbytes:
        raise PagedAttentionError(
            f"{name}: expected bytes [{offset}, {offset + nbytes}) inside an array of {arr.nbytes} bytes"
        )
    if not arr.flags.c_contiguous:
        raise PagedAttentionError(f"{name}: expected a C-contiguous array")


class Graph:
    """A captured sequence of stream work; ``launch()`` replays it on the
    stream it was captured on. Keeps alive every array it touches."""

    def __init__(self, stream: Stream, ops: list, keep_alive: list, native: Any = None):
        self.stream = stream
        self._ops = ops
        self._keep_alive = keep_alive
        self._native = native

    def launch(self) -> None:
        self.stream._replay(self)

    @property
    def num_ops(self) -> int:
        return len(self._ops)


class Stream:
    """Base class; see the module docstring. ``backend`` is "cpu" or "gpu"."""

    backend: str = ""
    device: int = -1

    # What each backend implements (declared here for the type checker only).
    _launch: Callable[[Any, tuple[int, int, int], tuple[int, int, int], int, tuple, bool], None]
    _memset_d32: Callable[[Array, int, int, int], None]
    _copy: Callable[[Array, Array, int, int, int], None]
    _copy_from_host: Callable[[Array, np.ndarray, int], None]
    _begin_capture: Callable[[], None]
    _end_capture: Callable[[], Graph]
    _replay: Callable[[Graph], None]

    def __init__(self) -> None:
        self._capture: list | None = None
        self._capture_keep: list | None = None
        self._capture_thread: int | None = None  # the thread whose capture is open

    # -- public API -------------------------------------------------------
    @property
    def capturing(self) -> bool:
        """Whether the calling thread is capturing this stream. Capture is
        per thread, as CUDA's thread-local capture mode: another thread's
        work on the stream is not captured (CPU: it runs at once; GPU: it
        raises, since the driver would fold it into the graph)."""
        return self._capture is not None and self._capture_thread == threading.get_ident()

    def _foreign_capture(self) -> None:
        """Called before any stream work: another thread is capturing."""
        if self._capture is not None and self._capture_thread != threading.get_ident():
            self._work_during_foreign_capture()

    def _work_during_foreign_capture(self) -> None:
        raise PagedAttentionError(
            "stream: another thread is capturing this stream; use a stream of your own "
            "(work issued here would be folded into that thread's graph)"
        )

    def launch(
        self, kernel: Any, grid: Dims, block: Dims, args: Sequence[Any], shared_mem: int = 0, dependent: bool = False
    ) -> None:
        """Launch ``kernel`` (from ``cupaged._runtime.get_kernel``) with ``grid`` and
        ``block`` (3-tuples or ints) and ``shared_mem`` dynamic bytes.

        ``dependent``: the kernel calls ``ptx::grid_dependency_wait()``
        before its first global access (kernels_cu/ptx.cuh), so it may be a
        programmatic dependent launch, which starts while the kernel before
        it on the stream still runs: with ``CUPAGED_PDL=1`` on sm_90 and
        later. Elsewhere, and on the CPU, an ordinary launch."""
        grid, block = _dim3(grid), _dim3(block)
        self._foreign_capture()
        if 0 in grid:
            return
        self._launch(kernel, grid, block, int(shared_mem), tuple(args), bool(dependent))

    def memset_d32(self, dst: Array, value: int, count: int | None = None, offset_bytes: int = 0) -> None:
        """Set ``count`` 32-bit words of ``dst`` from ``offset_bytes`` to
        ``value`` (its low 32 bits), stream-ordered; no host pointer involved."""
        self._check(dst=dst)
        count = (dst.nbytes - offset_bytes) // 4 if count is None else int(count)
        _check_span("dst", dst, offset_bytes, 4 * count)
        if offset_bytes % 4:
            raise PagedAttentionError(f"offset_bytes: expected a multiple of 4, got {offset_bytes}")
        self._foreign_capture()
        self._memset_d32(dst, int(value) & 0xFFFFFFFF, count, int(offset_bytes))

    def copy(self, dst: Array, src: Array, nbytes: int | None = None, dst_offset: int = 0, src_offset: int = 0) -> None:
        """Stream-ordered device-to-device copy of ``nbytes`` bytes."""
        self._check(dst=dst, src=src)
        nbytes = src.nbytes - src_offset if nbytes is None else int(nbytes)
        _check_span("dst", dst, dst_offset, nbytes)
        _check_span("src", src, src_offset, nbytes)
        self._foreign_capture()
        if nbytes:
            self._copy(dst, src, nbytes, int(dst_offset), int(src_offset))

    def copy_from_host(self, dst: Array, host: np.ndarray, dst_offset: int = 0) -> None:
        """Stream-ordered host-to-device copy of all of ``host`` (a NumPy
        array). The stream keeps its own copy of the host bytes alive until
        the copy has run, so the caller may reuse ``host`` at once."""
        if _backend.array_backend(dst) is None:
            raise PagedAttentionError("dst: expected a NumPy or CuPy array")
        self._check(dst=dst)
        host = np.ascontiguousarray(host)
        _check_span("dst", dst, dst_offset, host.nbytes)
        self._foreign_capture()
        if host.nbytes:
            self._copy_from_host(dst, host.copy(), int(dst_offset))

    def host_call(self, fn: Callable[[], object], *keep: Any) -> None:
        """Stream-ordered host work (CPU backend only): ``fn()`` runs at once,
        or, while capturing, is recorded and runs again at every replay of the
        graph, which keeps ``keep`` (the arrays ``fn`` touches) alive. ``fn``
        must read and write only arrays that exist before capture (its
        addresses are frozen in it, as a kernel's arguments are) and must not
        synchronize or copy to another device."""
        if not callable(fn):
            raise PagedAttentionError(f"fn: expected a callable fn(), got {type(fn).__name__}")
        self._foreign_capture()
        self._host_call(fn, keep)

    def _host_call(self, fn: Callable[[], object], keep: tuple) -> None:
        raise PagedAttentionError(
            f"host_call: expected the CPU backend's stream (host callables are CPU stream work), got the "
            f"{self.backend} backend's"
        )

    def begin_capture(self) -> None:
        if self.capturing:
            raise PagedAttentionError("stream: already capturing; captures do not nest")
        if self._capture is not None:
            raise PagedAttentionError("stream: another thread is capturing this stream")
        self._begin_capture()
        self._capture_thread = threading.get_ident()

    def end_capture(self) -> Graph:
        if not self.capturing:
            raise PagedAttentionError("stream: end_capture without begin_capture")
        graph = self._end_capture()
        self._capture_thread = None
        return graph

    def synchronize(self) -> None:
        """Wait for all work issued so far (a no-op on the CPU backend)."""

    def read(self, src: Array) -> np.ndarray:
        """A host copy of ``src`` once all work issued so far has run: the one
        call that waits for the device (decode loops read their tokens back
        with it every k steps). Refused while capturing."""
        self._check(src=src)
        if self.capturing:
            raise PagedAttentionError("stream.read: a device-to-host read cannot be captured")
        self._foreign_capture()
        self.synchronize()
        return np.array(src) if isinstance(src, np.ndarray) else src.get()

    # -- helpers ----------------------------------------------------------
    def _check(self, **arrays: Array) -> None:
        backend = _backend.backend_of(**arrays)
        if backend != self.backend:
            name = next(iter(arrays))
            raise PagedAttentionError(
                f"{name}: expected an array of the {self.backend} backend, got one of the {backend} backend"
            )
        for name, a in arrays.items():
            if _backend.device_id(a) != self.device:
                raise PagedAttentionError(
                    f"{name}: expected an array on device {self.device}, got device {_backend.device_id(a)}"
                )

    def _keep(self, *objs: Any) -> None:
        if self.capturing:
            assert self._capture_keep is not None  # set with _capture
            self._capture_keep.extend(objs)


def _dim3(v: Dims) -> tuple[int, int, int]:
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    dims = tuple(int(x) for x in v) + (1,) * (3 - len(v))
    if len(dims) != 3 or any(x < 0 for x in dims):
        raise PagedAttentionError(f"launch dims: expected up to 3 non-negative ints, got {dims}")
    return dims


class CpuStream(Stream):
    """The CPU backend's one stream: work runs at once, or is recorded while
    capturing and replayed by ``Graph.launch()``."""

    backend = _backend.CPU
    device = -1

    def _run_or_record(self, op: Callable[[], object], *keep: Any) -> None:
        if self.capturing:
            assert self._capture is not None
            self._capture.append(op)
            self._keep(*keep)
        else:
            op()

    def _work_during_foreign_capture(self) -> None:
        """Another thread's capture records only its own thread's calls;
        this thread's work runs at once."""

    def _launch(self, kernel, grid, block, shared_mem, args, dependent) -> None:
        # bind() freezes argument values and array addresses now; launches run in order (dependent or not).
        bound = kernel.bind(grid, block, shared_mem, args)
        self._run_or_record(bound, bound, args)

    def _memset_d32(self, dst, value, count, offset_bytes) -> None:
        addr = _backend.address(dst) + offset_bytes

        def op():
            np.frombuffer((ctypes.c_uint32 * count).from_address(addr), dtype=np.uint32)[:] = value

        self._run_or_record(op, dst)

    def _copy(self, dst, src, nbytes, dst_offset, src_offset) -> None:
        d, s = _backend.address(dst) + dst_offset, _backend.address(src) + src_offset
        self._run_or_record(lambda: ctypes.memmove(d, s, nbytes), dst, src)

    def _copy_from_host(self, dst, host, dst_offset) -> None:
        d, s, n = _backend.address(dst) + dst_offset, _backend.address(host), host.nbytes
        self._run_or_record(lambda: ctypes.memmove(d, s, n), dst, host)

    def _host_call(self, fn, keep) -> None:
        self._run_or_record(fn, fn, *keep)

    def _begin_capture(self) -> None:
        self._capture, self._capture_keep = [], []

    def _end_capture(self) -> Graph:
        ops, keep = self._capture, self._capture_keep
        assert ops is not None and keep is not None  # end_capture checked that this thread is capturing
        self._capture = self._capture_keep = None
        return Graph(self, ops, keep)

    def _replay(self, graph: Graph) -> None:
        if graph.stream is not self:
            raise PagedAttentionError("graph: captured on another stream")
        if self.capturing:
            raise PagedAttentionError("graph: cannot launch a CPU graph while capturing")
        for op in graph._ops:
            op()


def check_not_capturing(stream: Stream, what: str) -> None:
    """Raise if ``stream`` is capturing: ``what`` would be allocated inside
    a graph, and its address could not be used safely outside it."""
    if stream.capturing:
        raise PagedAttentionError(
            f"{what}: allocation inside graph capture; allocate it before capture_graph and pass it in"
        )
