"""Named input checks shared by every op. Each raises PagedAttentionError
naming the argument, what was expected and what came, before any launch."""
from __future__ import annotations

import math

import numpy as np

from . import _backend
from .errors import PagedAttentionError

U32_MAX = 0xFFFFFFFF


def dtype_name(dt) -> str:
    return "bfloat16" if str(dt) == "bfloat16" else np.dtype(dt).name


def _is_float_dtype(dt) -> bool:
    return str(dt) in ("float32", "float16", "bfloat16")


def dtype_token(dt) -> str:
    """The CP_DTYPE token of a float dtype (f32, f16, bf16)."""
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[str(dt)]


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def float_array(name: str, a, ndim: int) -> None:
    """A C-contiguous f32/f16/bf16 array of rank ``ndim``."""
    if _backend.array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise PagedAttentionError(f"{name}: expected a {ndim}-D array, got shape {shape_str(a.shape)} ({a.ndim}-D)")
    if not _is_float_dtype(a.dtype):
        raise PagedAttentionError(
            f"{name}: expected dtype float32, float16 or bfloat16, got {dtype_name(a.dtype)}")
    if not a.flags.c_contiguous:
        raise PagedAttentionError(f"{name}: expected a C-contiguous array, got strides {tuple(a.strides)}")
    u32_size(name, a.shape)


def same_dtype(ref_name: str, ref, **arrays) -> None:
    for name, a in arrays.items():
        if a is not None and str(a.dtype) != str(ref.dtype):
            raise PagedAttentionError(
                f"{name}: expected dtype {dtype_name(ref.dtype)} like {ref_name}, got {dtype_name(a.dtype)}")


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


def positive_scale(scale) -> float:
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise PagedAttentionError(f"scale: expected a finite float > 0, got {scale!r}") from None
    if not math.isfinite(s) or s <= 0:
        raise PagedAttentionError(f"scale: expected a finite float > 0, got {s}")
    return s


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
