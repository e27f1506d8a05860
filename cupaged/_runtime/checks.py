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


def float_array(name: str, a, ndim: int, *, total: bool = True, view: bool = False) -> None:
    """A C-contiguous f32/f16/bf16 array of rank ``ndim``; every dim, and with
    ``total`` the element count, within 32-bit indexing. With ``view``, any
    view whose last dim is contiguous passes (``row_view``: a column slice
    of a fused projection), each element stride within 32 bits."""
    if _backend.array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise PagedAttentionError(f"{name}: expected a {ndim}-D array, got shape {shape_str(a.shape)} ({a.ndim}-D)")
    dtypes.row(name, a.dtype)
    if not a.flags.c_contiguous:
        if not view:
            raise PagedAttentionError(f"{name}: expected a C-contiguous array, got strides {tuple(a.strides)}")
        strides = row_view(name, a)
        if max(strides) > layout.U32_MAX:
            raise PagedAttentionError(
                f"{name}: expected outer strides of at most {layout.U32_MAX} elements (32-bit kernel arguments), "
                f"got strides {tuple(int(t) for t in a.strides)} bytes for shape {shape_str(a.shape)}"
            )
        u32_size(name, a.shape, total=False)
        reach = 1 + sum((int(n) - 1) * s for n, s in zip(a.shape, strides))
        if total and reach > layout.U32_MAX:
            raise PagedAttentionError(
                f"{name}: expected a view spanning at most {layout.U32_MAX} elements (32-bit indexing), got "
                f"{reach} (shape {shape_str(a.shape)}, strides {tuple(int(t) for t in a.strides)} bytes)"
            )
        return
    u32_size(name, a.shape, total=total)


def view_strides(name: str, a) -> tuple[int, ...]:
    """The element strides of a checked view (``float_array(view=True)``)
    but its last dim's: a C-contiguous array's without ``row_view``'s
    Python walk (the per-launch path)."""
    if a.flags.c_contiguous:
        shape = tuple(int(n) for n in a.shape)
        return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape) - 1))
    return row_view(name, a)[:-1]


def rope_tables(cos, sin, half: int) -> None:
    """Rotary tables: cos and sin contiguous float32 [max_pos >= 1, half] of
    one shape (row p: position p)."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != np.float32 or t.ndim != 2 or t.shape[1] != half or not t.flags.c_contiguous or t.shape[0] < 1:
            raise PagedAttentionError(
                f"{name}: expected a contiguous float32 [max_pos, {half}] table, got {t.dtype} {shape_str(t.shape)}"
            )
    shape_is("sin", sin, cos.shape)
    u32_size("cos", cos.shape)


def same_dtype(ref_name: str, ref, **arrays) -> None:
    for name, a in arrays.items():
        if a is not None and a.dtype != ref.dtype:  # (not their str: NumPy's dtype.name is slow Python)
            raise PagedAttentionError(
                f"{name}: expected dtype {dtypes.dtype_name(ref.dtype)} like {ref_name}, got "
                f"{dtypes.dtype_name(a.dtype)}"
            )


def shape_is(name: str, a, expected) -> None:
    if tuple(int(s) for s in a.shape) != tuple(int(s) for s in expected):
        raise PagedAttentionError(f"{name}: expected shape {shape_str(expected)}, got {shape_str(a.shape)}")


def v_like_k(k_cache, v_cache) -> None:
    """v_cache [pages, page_size, Hkv, Dv] matches k_cache in all but the last dim."""
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise PagedAttentionError(
            f"v_cache: expected shape [{', '.join(str(x) for x in k_cache.shape[:3])}, Dv] like k_cache, got "
            f"{shape_str(v_cache.shape)}"
        )


def u32_size(name: str, shape, *, total: bool = True) -> None:
    """Every dim, and (``total``) the element count, fit uint32 indexing."""
    for d in shape:
        if int(d) > U32_MAX:
            raise PagedAttentionError(f"{name}: dimension {int(d)} exceeds 32-bit indexing (max {U32_MAX})")
    if total and math.prod(int(d) for d in shape) > U32_MAX:
        raise PagedAttentionError(
            f"{name}: {math.prod(int(d) for d in shape)} elements exceed 32-bit indexing (max {U32_MAX})"
        )


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
    """The bytes [lo, hi) an array's elements reach (its strides may be any,
    negative ones included)."""
    ptr = _backend.address(a)
    lo = ptr + sum((int(n) - 1) * int(s) for n, s in zip(a.shape, a.strides) if s < 0)
    hi = ptr + sum((int(n) - 1) * int(s) for n, s in zip(a.shape, a.strides) if s > 0) + int(a.itemsize)
    return lo, hi


def _lattice_hit(off: int, dims: list, lo: int, hi: int) -> bool:
    """Whether some ``d = sum(i_k * s_k)`` with ``-nb_k < i_k < na_k`` over
    ``dims`` ((stride, na, nb) triples, largest stride first) has
    ``lo < off - d < hi``: each level tries exactly the indices whose term
    can still land in range given the smaller strides' reach."""
    if not dims:
        return lo < off < hi
    (s, na, nb), rest = dims[0], dims[1:]
    reach = sum((max(ca, cb) - 1) * t for t, ca, cb in rest)
    # lo < off - i*s - d' < hi with |d'| <= reach  =>  (off - hi - reach) / s < i < (off - lo + reach) / s
    first = max(-nb + 1, (off - hi - reach) // s)
    last = min(na - 1, -((-(off - lo + reach)) // s))
    return any(_lattice_hit(off - i * s, rest, lo, hi) for i in range(first, last + 1))


def _overlap(a, b) -> bool:
    """Whether arrays ``a`` and ``b`` share a byte. Exact for arrays whose
    spans are disjoint, and for two views with one stride pattern (equal
    strides, rows contiguous and not overlapping themselves; the counts may
    differ: the latent and rotary columns of one MLA cache, the K and V
    halves of a combined KV tensor, the q and k head ranges of a fused QKV
    buffer); any other pair whose spans meet counts as overlapping."""
    lo, hi = _span(a)
    olo, ohi = _span(b)
    if not (lo < ohi and olo < hi):
        return False
    if (
        a.ndim != b.ndim
        or a.ndim == 0
        or (int(a.shape[-1]) > 1 and int(a.strides[-1]) != a.itemsize)
        or (int(b.shape[-1]) > 1 and int(b.strides[-1]) != b.itemsize)
    ):
        return True
    dims = []  # (stride, count in a, count in b); a dim of count 1 has no stride to match
    for na, nb, sa, sb in zip(a.shape[:-1], b.shape[:-1], a.strides[:-1], b.strides[:-1]):
        na, nb, sa, sb = int(na), int(nb), int(sa), int(sb)
        if na > 1 and nb > 1 and sa != sb:
            return True
        if max(na, nb) > 1:
            dims.append((sa if na > 1 else sb, na, nb))
    dims.sort(reverse=True)
    wa, wb = int(a.shape[-1]) * a.itemsize, int(b.shape[-1]) * b.itemsize
    ra, rb = wa, wb  # each array's rows must clear the reach of its smaller dims (else: counted as overlapping)
    for st, na, nb in reversed(dims):
        if (na > 1 and st < ra) or (nb > 1 and st < rb):
            return True
        ra += (na - 1) * st
        rb += (nb - 1) * st
    off = _backend.address(b) - _backend.address(a)
    # rows of a at x and of b at off + y meet when -wb < off - (x - y) < wa for some x, y
    return _lattice_hit(off, dims, -wb, wa)


def no_overlap(name: str, a, **others) -> None:
    """``a`` shares no byte with any of ``others`` (None entries skipped).
    Views of one layout are compared element-wise (``_overlap``)."""
    for oname, o in others.items():
        if o is None or o.nbytes == 0 or a.nbytes == 0:
            continue
        if _overlap(a, o):
            raise PagedAttentionError(f"{name}: expected memory disjoint from {oname}, but they overlap")


def host_int_array(name: str, a, ndim: int) -> np.ndarray:
    """Host integer data (NumPy array or nested sequence) as int64."""
    if _backend.array_backend(a) == _backend.GPU:
        raise PagedAttentionError(
            f"{name}: expected host data (a NumPy array or a sequence), got a CuPy array; plans are built on "
            f"the host so that no device-to-host copy is needed"
        )
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


def token_ids(name: str, tokens, vocab: int | None = None) -> np.ndarray:
    """Token ids, an int or host integer data [n], as int64 [n]: each in
    0 .. vocab - 1, or (vocab None) 0 .. 2**63 - 1 (an int64 >= 0)."""
    hi = (1 << 63) - 1 if vocab is None else int(vocab) - 1
    if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        return np.array([host_int(name, tokens, 0, hi)], np.int64)
    if isinstance(tokens, (list, tuple)):  # name a Python int past int64 before NumPy turns it to objects
        for i, t in enumerate(tokens):
            if isinstance(t, int) and not isinstance(t, bool) and not 0 <= t <= hi:
                raise PagedAttentionError(f"{name}[{i}]: expected a token id in 0..{hi}, got {t}")
    arr = host_int_array(name, tokens, 1)
    bad = (arr < 0) | (arr > hi)
    if bad.any():
        i = int(np.argmax(bad))
        raise PagedAttentionError(f"{name}[{i}]: expected a token id in 0..{hi}, got {int(arr[i])}")
    return arr


# -- arrays against a plan (any object with host, backend, device, stream) ----
def plan_arrays(plan, **arrays) -> None:
    """Every named array lives on the plan's backend and device, and (GPU)
    CuPy's current stream is the plan's stream."""
    backend = _backend.backend_of(**arrays)
    name = next(k for k, v in arrays.items() if v is not None)
    if backend != plan.backend:
        raise PagedAttentionError(
            f"{name}: expected an array of the plan's {plan.backend} backend, got the {backend} backend"
        )
    for n, a in arrays.items():
        if a is not None and _backend.device_id(a) != plan.device:
            raise PagedAttentionError(
                f"{n}: expected an array on the plan's device {plan.device}, got device {_backend.device_id(a)}"
            )
    if backend == _backend.GPU and stream_for(arrays[name]) is not plan.stream:
        raise PagedAttentionError(
            f"{name}: CuPy's current stream is not the stream this plan was uploaded on; "
            f"upload the plan on the stream you launch on"
        )


def plan_cache(plan, name: str, cache, kv_dtype=None):
    """``cache`` is a [plan.pages, plan.page_size, heads, D] K/V cache: any
    view whose innermost dim is contiguous (``cache_view``: HND, one half of
    a combined KV tensor, columns of an MLA cache), in a K/V format (fp8 as
    ml_dtypes arrays, or uint8 with ``kv_dtype``). A page's elements must
    fit 32-bit indexing; the whole cache need not (the kernels compute page
    offsets in 64 bits). Returns its format (a ``dtypes`` row) and its
    element strides (``row_view``)."""
    if getattr(cache, "ndim", 4) == 5:
        raise PagedAttentionError(
            f"{name}: expected a 4-D array [pages, page_size, heads, D], got shape {shape_str(cache.shape)} "
            f"(5-D: a PagedKVCache's layer-major cache; pass one layer: cache.layer(i), or cache.k[i])"
        )
    fmt, strides = cache_view(name, cache, kv_dtype=kv_dtype)
    exp = (plan.host.pages, plan.host.page_size)
    if tuple(int(x) for x in cache.shape[:2]) != exp:
        raise PagedAttentionError(
            f"{name}: expected shape [{exp[0]}, {exp[1]}, ...] (plan.pages, plan.page_size, ...), "
            f"got {shape_str(cache.shape)}"
        )
    return fmt, strides


# -- strided views (caches, new K/V rows) ------------------------------------
def row_view(name: str, a) -> tuple[int, ...]:
    """``a`` (any rank >= 1) has a contiguous innermost dim and non-negative
    strides, each a multiple of the item size, that keep its rows (innermost
    runs) apart; returns its strides in elements (0 for a dim of size 1).
    PagedAttentionError naming ``name`` otherwise."""
    item = int(a.itemsize)
    shape = tuple(int(n) for n in a.shape)
    strides = tuple(int(s) for s in a.strides)
    if 0 in shape:  # no element: any strides; report the C-contiguous ones
        return tuple(int(math.prod(shape[i + 1 :])) if shape[i] > 1 else 0 for i in range(len(shape) - 1)) + (1,)
    if shape[-1] > 1 and strides[-1] != item:
        raise PagedAttentionError(
            f"{name}: expected a contiguous innermost dim (stride {item} bytes), got strides {strides} for shape "
            f"{shape_str(shape)}; pass a view whose last dim is contiguous (e.g. .copy() this one)"
        )
    out = []
    for n, s in zip(shape[:-1], strides[:-1]):
        if n > 1 and (s < 0 or s % item):
            raise PagedAttentionError(
                f"{name}: expected non-negative strides that are multiples of the item size "
                f"{item}, got strides {strides}"
            )
        out.append(s // item if n > 1 else 0)
    reach = shape[-1]
    for s, n in sorted(((s, n) for s, n in zip(out, shape[:-1]) if n > 1)):
        if s < reach:
            raise PagedAttentionError(
                f"{name}: expected rows that do not overlap one another, got strides "
                f"{strides} for shape {shape_str(shape)}"
            )
        reach += (n - 1) * s
    return tuple(out) + (1,)


def cache_view(name: str, a, *, kv_dtype=None, ndim: int = 4):
    """A K/V cache argument: a NumPy or CuPy array of rank ``ndim`` whose
    innermost dim is contiguous (``row_view``: any strides otherwise, so HND
    views, halves of a combined KV tensor and column ranges of an MLA cache
    pass) and whose dtype is a K/V format (``dtypes.kv_storage``: fp8 as
    ml_dtypes arrays or uint8 with ``kv_dtype``); one page may span at most
    2^32 elements. Returns (the format's row, element strides)."""
    if _backend.array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise PagedAttentionError(f"{name}: expected a {ndim}-D array, got shape {shape_str(a.shape)} ({a.ndim}-D)")
    row = dtypes.kv_storage(name, a.dtype, kv_dtype)
    strides = row_view(name, a)
    u32_size(name, a.shape, total=False)
    page = sum((int(n) - 1) * s for n, s in zip(a.shape[1:], strides[1:])) + 1
    if page > U32_MAX or strides[0] > U32_MAX:
        raise PagedAttentionError(
            f"{name}: expected pages that span at most {U32_MAX} elements (32-bit "
            f"offsets inside a page), got strides {tuple(int(s) for s in a.strides)}"
        )
    return row, strides


def aligned(a, nbytes: int = 16) -> bool:
    """``a`` starts on an ``nbytes`` boundary and every stride of an outer
    dim (all but the innermost, whose elements are loaded together) longer
    than 1 is a multiple of it: each row starts on such a boundary."""
    return _backend.address(a) % nbytes == 0 and all(
        int(s) % nbytes == 0 for n, s in zip(a.shape[:-1], a.strides[:-1]) if int(n) > 1
    )


def scale_values(name: str, values) -> None:
    """Host scale values (NumPy, any shape): each a finite number > 0. A
    zero, negative, NaN or Inf fp8 scale makes every appended code saturate
    (or NaN) and every score alike; device values are never read back (that
    would synchronize)."""
    v = np.asarray(values)
    bad = ~(np.isfinite(v) & (v > 0))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        at = f"[{', '.join(map(str, idx))}]" if idx else ""
        raise PagedAttentionError(f"{name}{at}: expected a finite float > 0 (an fp8 scale), got {v[idx]!s}")


def kv_scale(name: str, s, kv_heads: int, like) -> int:
    """A dequantization scale of an fp8 cache (``k_scale`` / ``v_scale``): a
    float32 array on ``like``'s backend and device, one value (shape () or
    [1]: per tensor) or one per KV head ([kv_heads]), each finite and > 0
    (``scale_values``: checked where the array is host memory, NumPy; a CuPy
    array's values are not read). Returns its stride in the kernels'
    indexing (0: one scale, 1: per head)."""
    if _backend.array_backend(s) is None:
        raise PagedAttentionError(
            f"{name}: expected a float32 NumPy or CuPy array (one scale, or one per KV head), got {type(s).__name__}"
        )
    if _backend.array_backend(s) != _backend.array_backend(like) or _backend.device_id(s) != _backend.device_id(like):
        raise PagedAttentionError(
            f"{name}: expected an array on the caches' {_backend.array_backend(like)} backend, "
            f"device {_backend.device_id(like)}, got {_backend.array_backend(s)} backend, "
            f"device {_backend.device_id(s)}"
        )
    if str(s.dtype) != "float32":
        raise PagedAttentionError(f"{name}: expected dtype float32, got {dtypes.dtype_name(s.dtype)}")
    shape = tuple(int(n) for n in s.shape)
    if shape in ((), (1,)):
        stride = 0
    elif shape == (int(kv_heads),) and s.flags.c_contiguous:
        stride = 1
    else:
        raise PagedAttentionError(
            f"{name}: expected shape [] or [1] (per tensor) or [{int(kv_heads)}] (per KV "
            f"head, contiguous), got {shape_str(shape)}"
        )
    if _backend.array_backend(s) == _backend.CPU:
        scale_values(name, s)
    return stride


def dense_pages(name: str, a, inner: int = 3) -> None:
    """The last ``inner`` dims of ``a`` (one page) fill a contiguous block of
    memory in some order (any page and layer strides around it): pages can
    be copied as bytes."""
    dims = sorted((int(s), int(n)) for n, s in zip(a.shape[-inner:], a.strides[-inner:]) if int(n) > 1)
    step = int(a.itemsize)
    for s, n in dims:
        if s != step:
            raise PagedAttentionError(
                f"{name}: expected each page ({inner} last dims) to fill one contiguous "
                f"block, got strides {tuple(int(x) for x in a.strides)} for shape "
                f"{shape_str(a.shape)}"
            )
        step *= n
    for s, n in sorted((int(s), int(n)) for n, s in zip(a.shape[:-inner], a.strides[:-inner]) if int(n) > 1):
        if s < step or s % int(a.itemsize):
            raise PagedAttentionError(
                f"{name}: expected pages that do not overlap, got strides "
                f"{tuple(int(x) for x in a.strides)} for shape {shape_str(a.shape)}"
            )
        step += (n - 1) * s
