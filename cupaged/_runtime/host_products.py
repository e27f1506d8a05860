"""The CPU backend's few-row products (``kernels_cu/host/products.cpp``): out [M, N] = x [M, K] @ w [N, K]^T (or
out +=) straight from the weight on the worker pool's threads, for the engine's decode-step projections, where
BLAS packs the whole weight first and runs on one thread. Part of the host library (``host.library``).

``product(x, w, out, accumulate, parts)`` makes the call once (the argument struct built here) and returns a
zero-argument callable that runs it: what a CPU stream records, so a replay builds nothing. ``fits`` says
whether the arrays have the layout the code reads (float32, unit stride along K and N, 4-byte aligned)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from ..errors import KernelError
from . import cpu as _cpu
from . import host as _host

#: At most this many rows go to these products (more: BLAS, compute-bound there and faster). Measured on 2 cores
#: (benchmarks/bench_host_products.py, SmolLM2-135M's projections at f32, both threads): 32 rows 60 ms vs BLAS's 82,
#: 48 rows 100 vs 93 (docs/performance.md).
MAX_ROWS = 32


class ProductArgs(ctypes.Structure):
    """products.cpp's ``Product``: the same fields, in the same order."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("ldx", ctypes.c_int64),
        ("ldw", ctypes.c_int64),
        ("ldo", ctypes.c_int64),
        ("m", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("accumulate", ctypes.c_int32),
    ]


@functools.cache
def library() -> ctypes.CDLL:
    """The host library with ``cupaged_host_product`` declared."""
    lib = _host.library()
    lib.cupaged_host_product.restype = ctypes.c_int
    lib.cupaged_host_product.argtypes = [ctypes.POINTER(ProductArgs), ctypes.c_uint]
    return lib


def _rows_ok(a: np.ndarray) -> bool:
    return a.ndim == 2 and a.dtype == np.float32 and a.strides[1] == 4 and a.strides[0] % 4 == 0 and a.strides[0] >= 0


def fits(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
    """Whether x [M, K], w [N, K] and out [M, N] are float32 rows this code reads: unit stride along the last
    dim, rows any whole number of floats apart, and the sizes within int32."""
    return (
        all(isinstance(a, np.ndarray) and _rows_ok(a) for a in (x, w, out))
        and 0 < x.shape[0] <= MAX_ROWS
        and max(x.shape[1], w.shape[0]) < 2**31
    )


def product(x: np.ndarray, w: np.ndarray, out: np.ndarray, accumulate: bool, parts: int):
    """A callable computing out = x @ w.T (``accumulate``: out += x @ w.T) on ``parts`` pool threads.
    x [M, K], w [N, K], out [M, N] as ``fits`` accepts them; the callable holds the arrays."""
    lib = library()
    args = ProductArgs(
        x.ctypes.data,
        w.ctypes.data,
        out.ctypes.data,
        x.strides[0] // 4,
        w.strides[0] // 4,
        out.strides[0] // 4,
        x.shape[0],
        x.shape[1],
        w.shape[0],
        int(bool(accumulate)),
    )
    ref = ctypes.byref(args)
    call, n = lib.cupaged_host_product, ctypes.c_uint(max(1, int(parts)))

    def run(keep=(x, w, out, args)) -> None:  # keep: what the pointers in args point into
        if call(ref, n) != 0:
            raise KernelError(f"host product: {_cpu.runtime().cupaged_rt_last_error().decode(errors='replace')}")

    return run
