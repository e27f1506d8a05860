"""Named input checks shared by every op. Each raises PagedAttentionError
naming the argument, what was expected and what came, before any launch."""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes, layout
from ..errors import PagedAttentionError
from . import arrays as _backend
from .dispatch import stream_for

U32_MAX = layout.U32_MAX


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def float_array(name: str, a, ndim: int, *, total: bool = True) -> None:
    """A C-contiguous f32/f16/bf16 array of rank ``ndim``; every dim, and with
    ``total`` the element count, within 32-bit indexing."""
    if _backend.array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise PagedAttentionError(f"{name}: expected a {ndim}-D array, got shape {shape_str(a.shape)} ({a.ndim}-D)")
    dtypes.row(name, a.dtype)
    if not a.flags.c_contiguous:
        raise PagedAttentionError(f"{name}: expected a C-contiguous array, got strides {tuple(a.strides)}")
    u32_size(name, a.shape, total=total)


def same_dtype(ref_name: str, ref, **arrays) -> None:
    for name, a in arrays.items():
        if a is not None and str(a.dtype) != str(ref.dtype):
            raise PagedAttentionError(
                f"{name}: expected dtype {dtypes.dtype_name(ref.dtype)} like {ref_name}, got "
                f"{dtypes.dtype_name(a.dtype)}")


def shape_is(name: str, a, expected) -> None:
    if tuple(int(s) for s in a.shape) != tuple(int(s) for s in expected):
        raise PagedAttentionError(f"{name}: expected shape {shape_str(expected)}, got {shape_str(a.shape)}")


def v_like_k(k_cache, v_cache) -> None:
    """v_cache [pages, page_size, Hkv, Dv] matches k_cache in all but the last dim."""
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise PagedAttentionError(
            f"v_cache: expected shape [{', '.join(str(x) for x in k_cache.shape[:3])}, Dv] like k_cache, got "
            f"{shape_str(v_cache.shape)}")


def u32_size(name: str, shape, *, total: bool = True) -> None:
    """Every dim, and (``total``) the element count, fit uint32 indexing."""
    for d in shape:
        if int(d) > U32_MAX:
            raise PagedAttentionError(f"{name}: dimension {int(d)} exceeds 32-bit indexing (max {U32_MAX})")
    if total and math.prod(int(d) for d in shape) > U32_MAX:
        raise PagedAttentionError(
            f"{name}: {math.prod(int(d) for d in shape)} elements exceed 32-bit indexing (max {U32_MAX})")


def positive_scale(scale, name: str = "scale") -> float:
    """A finite real number > 0."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise PagedAttentionError(f"{name}: expected a finite float > 0, got {type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise PagedAttentionError(f"{name}: expected a finite float > 0, got {s}")
    return s


def boolean(name: str, v) -> bool:
    """A Python or NumPy bool (not 0/1, a string or None)."""
    if not isinstance(v, (bool, np.bool_)):
        raise PagedAttentionError(f"{name}: expected True or False, got {type(v).__name__} {v!r}")
    return bool(v)


def _span(a) -> tuple[int, int]:
    ptr = _backend.address(a)
    return ptr, ptr + int(a.nbytes)


def no_overlap(name: str, a, **others) -> None:
    """``a`` shares no byte with any of ``others`` (None entries skipped)."""
    lo, hi = _span(a)
    for oname, o in others.items():
        if o is None or o.nbytes == 0 or a.nbytes == 0:
            continue
        olo, ohi = _span(o)
        if lo < ohi and olo < hi:
            raise PagedAttentionError(f"{name}: expected memory disjoint from {oname}, but they overlap")


def host_int_array(name: str, a, ndim: int) -> np.ndarray:
    """Host integer data (NumPy array or nested sequence) as int64."""
    if _backend.array_backend(a) == _backend.GPU:
        raise PagedAttentionError(
            f"{name}: expected host data (a NumPy array or a sequence), got a CuPy array; plans are built on "
            f"the host so that no device-to-host copy is needed")
    arr = np.asarray(a)
    if arr.dtype == bool or arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)
        else:
            raise PagedAttentionError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise PagedAttentionError(f"{name}: expected a {ndim}-D array, got shape {shape_str(arr.shape)}")
    u32_size(name, arr.shape)
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise PagedAttentionError(f"{name}: value {int(arr.max())} exceeds 32-bit indexing")
    return arr.astype(np.int64)


def host_int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise PagedAttentionError(f"{name}: expected an int in {lo}..{hi}, got {v!r}")
    v = int(v)
    if not lo <= v <= hi:
        raise PagedAttentionError(f"{name}: expected an int in {lo}..{hi}, got {v}")
    return v


# -- arrays against a plan (any object with host, backend, device, stream) ----
def plan_arrays(plan, **arrays) -> None:
    """Every named array lives on the plan's backend and device, and (GPU)
    CuPy's current stream is the plan's stream."""
    backend = _backend.backend_of(**arrays)
    name = next(k for k, v in arrays.items() if v is not None)
    if backend != plan.backend:
        raise PagedAttentionError(
            f"{name}: expected an array of the plan's {plan.backend} backend, got the {backend} backend")
    for n, a in arrays.items():
        if a is not None and _backend.device_id(a) != plan.device:
            raise PagedAttentionError(
                f"{n}: expected an array on the plan's device {plan.device}, got device {_backend.device_id(a)}")
    if backend == _backend.GPU and stream_for(arrays[name]) is not plan.stream:
        raise PagedAttentionError(
            f"{name}: CuPy's current stream is not the stream this plan was uploaded on; "
            f"upload the plan on the stream you launch on")


def plan_cache(plan, name: str, cache, heads: int | None = None) -> None:
    """``cache`` is a [plan.pages, plan.page_size, heads, D] float array.
    A page's elements must fit 32-bit indexing; the whole cache need not
    (the kernels compute page offsets in 64 bits)."""
    if getattr(cache, "ndim", 4) == 5:
        raise PagedAttentionError(
            f"{name}: expected a 4-D array [pages, page_size, heads, D], got shape {shape_str(cache.shape)} "
            f"(5-D: a PagedKVCache's layer-major cache; pass one layer, cache.k[layer])")
    float_array(name, cache, 4, total=False)
    u32_size(name, cache.shape[1:])
    exp = (plan.host.pages, plan.host.page_size)
    if tuple(cache.shape[:2]) != exp:
        raise PagedAttentionError(
            f"{name}: expected shape [{exp[0]}, {exp[1]}, ...] (plan.pages, plan.page_size, ...), "
            f"got {shape_str(cache.shape)}")
    if heads is not None and cache.shape[2] != heads:
        raise PagedAttentionError(f"{name}: expected {heads} head(s) in dim 2, got shape {shape_str(cache.shape)}")
