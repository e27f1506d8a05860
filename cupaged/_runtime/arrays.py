"""Which backend an array belongs to, its address and device, and
allocation on the backend of another array.

NumPy arrays run on the CPU backend (the kernels compiled by g++ through the
shim), CuPy arrays on the GPU (NVRTC through CuPy ``RawModule``). Mixing them
in one call is an error. CuPy is never imported here: a CuPy array is
recognized only when the ``cupy`` module is already loaded.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from ..errors import PagedAttentionError

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

CPU = "cpu"
GPU = "gpu"

# A NumPy or CuPy array in annotations. CuPy ships no type stubs, so its
# arrays are Any to the type checker; the backend is checked at run time.
Array: TypeAlias = Any
# An array shape as NumPy and CuPy take it (an int or a sequence of ints).
Shape: TypeAlias = int | tuple[int, ...] | list[int]


def array_backend(x: object) -> str | None:
    """``"cpu"`` for a NumPy array, ``"gpu"`` for a CuPy array, else None."""
    if isinstance(x, np.ndarray):
        return CPU
    cupy = sys.modules.get("cupy")
    nd = getattr(cupy, "ndarray", None)
    if isinstance(nd, type) and isinstance(x, nd):
        return GPU
    # Duck-typed fallback (array-likes whose class lives in the cupy package,
    # e.g. test stand-ins); "cupyx" objects such as sparse matrices, which
    # also have .data and .device, are not arrays of ours.
    mod = type(x).__module__
    if (mod == "cupy" or mod.startswith("cupy.")) and hasattr(x, "data") and hasattr(x, "device"):
        return GPU
    return None


def address(a: Array) -> int:
    """Address of the first byte of a NumPy or CuPy array's data."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def device_id(x: Array) -> int:
    """Device ordinal of an array (-1 for the CPU backend)."""
    return -1 if array_backend(x) == CPU else int(x.device.id)


def backend_of(**arrays: Array | None) -> str:
    """The one backend of the named arrays (None entries are skipped).

    Raises PagedAttentionError naming the argument that is not an array, or
    that lives on another backend or device than the first one.
    """
    first_name, backend, dev = None, None, None
    for name, a in arrays.items():
        if a is None:
            continue
        b = array_backend(a)
        if b is None:
            raise PagedAttentionError(
                f"{name}: expected a NumPy or CuPy array, got {type(a).__module__}.{type(a).__name__}"
            )
        if backend is None:
            first_name, backend, dev = name, b, device_id(a)
            continue
        if b != backend:
            raise PagedAttentionError(
                f"{name}: expected a {'NumPy' if backend == CPU else 'CuPy'} array like {first_name} "
                f"({backend} backend), got a {'NumPy' if b == CPU else 'CuPy'} array; arrays of one call "
                f"must share a backend"
            )
        if device_id(a) != dev:
            raise PagedAttentionError(
                f"{name}: expected an array on device {dev} like {first_name}, got device {device_id(a)}"
            )
    if backend is None:
        raise PagedAttentionError("expected at least one NumPy or CuPy array")
    return backend


def empty(like: Array, shape: Shape, dtype: DTypeLike) -> Array:
    """An uninitialized array on the backend and device of ``like``."""
    return _new("empty", like, shape, dtype)


def zeros(like: Array, shape: Shape, dtype: DTypeLike) -> Array:
    """A zeroed array on the backend and device of ``like``."""
    return _new("zeros", like, shape, dtype)


def _new(fn: str, like: Array, shape: Shape, dtype: DTypeLike) -> Array:
    xp = xp_of(like)
    if xp is np:
        return getattr(np, fn)(shape, dtype)
    with like.device:
        return getattr(xp, fn)(shape, dtype)


def xp_of(x: Array) -> ModuleType:
    """The array module (numpy or cupy) of ``x``."""
    if array_backend(x) == GPU:
        return sys.modules["cupy"]
    return np
