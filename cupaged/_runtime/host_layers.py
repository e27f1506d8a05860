"""The CPU backend's row-wise layers at float32 (``kernels_cu/host/layers.cpp``, part of the host library):
RMSNorm, SwiGLU and the rotate-half rotary embedding, each row read once and written once, on the calling
thread. The ``host=True`` paths of ``ops.layers`` on the CPU backend call them (float32 arrays, checked there:
C-contiguous, or for rms_norm's x and out and rope's x any view with a contiguous last dim whose rows do not
overlap, passed with its element strides).

Each function builds its argument struct once and returns a zero-argument callable that runs the layer: what a
CPU stream records, so a replay builds nothing and reads the arrays' contents (positions too) at every run.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import host as _host


class RowArgs(ctypes.Structure):
    """layers.cpp's ``RowWork``: the same fields, in the same order."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("pos", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("lda", ctypes.c_int64),
        ("ldo", ctypes.c_int64),
        ("hda", ctypes.c_int64),
        ("hdo", ctypes.c_int64),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("stride", ctypes.c_int32),
        ("max_pos", ctypes.c_int32),
        ("eps", ctypes.c_float),
    ]


_NAMES = ("cupaged_host_rms_norm", "cupaged_host_silu_mul", "cupaged_host_rope")


@functools.cache
def library() -> ctypes.CDLL:
    """The host library with the layers' entry points declared."""
    lib = _host.library()
    for name in _NAMES:
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.POINTER(RowArgs)]
    return lib


def _pitch(a: np.ndarray) -> int:
    return a.strides[0] // 4


def _call(name: str, args: RowArgs, keep: tuple):
    fn, ref = getattr(library(), name), ctypes.byref(args)

    def run(keep=(keep, args)) -> None:  # keep: what the pointers in args point into
        fn(ref)

    return run


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray,
    out: np.ndarray,
    eps: float,
    *,
    x_strides: tuple[int, ...],
    out_strides: tuple[int, ...],
    x_at: int,
    out_at: int,
):
    """A callable computing out = x / sqrt(mean(x^2) + eps) * weight over the last dim, row by row: x, out
    [rows, dim] or [tokens, heads, dim], weight [dim]. ``x_strides`` / ``out_strides``: their outer element
    strides ([row] or [row, head]; the last dim contiguous), ``x_at`` / ``out_at`` their addresses (the caller
    has them from its overlap check)."""
    shape = x.shape
    args = RowArgs(a=x_at, b=weight.ctypes.data, out=out_at, lda=x_strides[0], ldo=out_strides[0])
    if len(shape) == 3:
        args.hda, args.hdo, args.heads = x_strides[1], out_strides[1], shape[1]
    else:
        args.heads = 1
    args.rows, args.cols, args.eps = shape[0], shape[-1], eps
    return _call("cupaged_host_rms_norm", args, (x, weight, out))


def silu_mul(gate_up: np.ndarray, out: np.ndarray):
    """A callable computing out = silu(gate) * up: gate_up [rows, 2F] = (gate | up), out [rows, F]."""
    args = RowArgs(a=gate_up.ctypes.data, out=out.ctypes.data, lda=_pitch(gate_up), ldo=_pitch(out))
    args.rows, args.cols = out.shape
    return _call("cupaged_host_silu_mul", args, (gate_up, out))


def rope(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, stride: int, x_strides: tuple[int, ...]
):
    """A callable rotating x [rows, heads, dim] in place (rotate-half) by row r's position
    positions[r * stride] (uint32 words, read at every run), clamped to the tables' last row; cos, sin
    [max_pos, dim // 2]. ``x_strides``: x's row and head strides in elements (its last dim contiguous)."""
    rows, heads, dim = x.shape
    args = RowArgs(a=x.ctypes.data, b=cos.ctypes.data, c=sin.ctypes.data, pos=positions.ctypes.data)
    args.lda, args.hda = x_strides
    args.rows, args.cols, args.heads, args.stride, args.max_pos = rows, dim, heads, stride, cos.shape[0]
    return _call("cupaged_host_rope", args, (x, positions, cos, sin))
