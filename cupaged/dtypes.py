"""The one dtype table: every storage type cupaged knows, by every name.

Each row says what a dtype is called (the kernels' token, the NumPy name,
aliases), its item size, the NumPy dtype (``ml_dtypes`` for bfloat16 and the
fp8 formats), the torch dtype's name, and where it may appear: as queries /
outputs (and every dense layer kernel), or as K/V cache storage. The kernels
see the token as ``CP_DTYPE`` (q, out) and ``CP_KV_DTYPE`` (caches);
``kernels_cu/common.cuh`` maps tokens to C types.

The two fp8 rows (``e4m3``: OCP E4M3FN, ``e5m2``: OCP E5M2) are K/V storage
only, with a float32 scale per tensor or per KV head (``scaled``): a stored
code c means ``c * scale``. Appends quantize ``x / scale`` to the nearest
code (ties to even), saturating to ``max_finite``; NaN stays NaN. On NumPy a
cache holds ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` elements; any cache
may also be raw ``uint8`` storage (CuPy has no fp8 dtype) with the format
named by the ops' ``kv_dtype=`` argument (``kv_storage``), as vLLM's
``kv_cache_dtype`` does.

Nothing here imports the rest of the package. ``ml_dtypes`` (~1 s to
import) is imported when a bfloat16 or fp8 row's NumPy dtype is first needed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import PagedAttentionError

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


@dataclass(frozen=True)
class DType:
    token: str  # CP_DTYPE / CP_KV_DTYPE value, and the short name users pass ("bf16")
    name: str  # NumPy's name of the dtype ("bfloat16")
    np_type: str  # "module.attribute" of the NumPy scalar type ("ml_dtypes.bfloat16")
    itemsize: int  # bytes per element (the format's, so no import is needed to know it)
    torch_name: str  # attribute of the torch module ("bfloat16")
    query: bool  # may be q / out / a dense layer's storage
    kv: bool  # may be K/V cache storage
    tensor_core: bool  # the tensor-core kernels take it (16-bit q, 16-bit or fp8 K/V)
    scaled: bool = False  # fp8: stored codes times a float32 scale (k_scale / v_scale)
    max_finite: float = 0.0  # fp8: the largest finite value (appends saturate to it)
    aliases: tuple = ()  # other names users pass ("fp8", vLLM's kv_cache_dtype names)

    @functools.cached_property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype (imports ``ml_dtypes`` for its rows)."""
        module, _, attr = self.np_type.rpartition(".")
        return np.dtype(getattr(importlib.import_module(module), attr))


TABLE: tuple[DType, ...] = (
    DType("f32", "float32", "numpy.float32", 4, "float32", query=True, kv=True, tensor_core=False),
    DType("f16", "float16", "numpy.float16", 2, "float16", query=True, kv=True, tensor_core=True),
    DType("bf16", "bfloat16", "ml_dtypes.bfloat16", 2, "bfloat16", query=True, kv=True, tensor_core=True),
    DType(
        "e4m3",
        "float8_e4m3fn",
        "ml_dtypes.float8_e4m3fn",
        1,
        "float8_e4m3fn",
        query=False,
        kv=True,
        tensor_core=True,
        scaled=True,
        max_finite=448.0,
        aliases=("fp8", "fp8_e4m3"),
    ),
    DType(
        "e5m2",
        "float8_e5m2",
        "ml_dtypes.float8_e5m2",
        1,
        "float8_e5m2",
        query=False,
        kv=True,
        tensor_core=True,
        scaled=True,
        max_finite=57344.0,
        aliases=("fp8_e5m2",),
    ),
)

_BY_NAME = {**{d.token: d for d in TABLE}, **{d.name: d for d in TABLE}, **{a: d for d in TABLE for a in d.aliases}}

#: Tokens of the dtypes kernels are built for, in table order.
TOKENS = tuple(d.token for d in TABLE)
#: Tokens of the query / output dtypes, and of the K/V cache dtypes.
QUERY_TOKENS = tuple(d.token for d in TABLE if d.query)
KV_TOKENS = tuple(d.token for d in TABLE if d.kv)
#: Tokens of the tensor-core kernels' dtypes (q: the 16-bit ones; K/V: those and fp8).
TC_TOKENS = tuple(d.token for d in TABLE if d.tensor_core)
#: Tokens of the scaled (fp8) K/V storage types.
FP8_TOKENS = tuple(d.token for d in TABLE if d.scaled)


#: lookup's answers for dtype objects and types already seen (NumPy's ``dtype.name`` is Python code, ~2 us, and
#: every op's input checks ask it several times).
_SEEN: dict = {}


def lookup(dtype: DTypeLike) -> DType | None:
    """The row of ``dtype`` (a token, a NumPy name, a NumPy dtype or type),
    or None when cupaged has no such storage type."""
    if isinstance(dtype, str):
        return _BY_NAME.get(dtype)
    try:
        return _SEEN[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable
        pass
    try:
        d = _BY_NAME.get(np.dtype(dtype).name)
    except TypeError:
        return None
    try:
        _SEEN[dtype] = d
    except TypeError:
        pass
    return d


def names(rows: Iterable[DType] = TABLE) -> str:
    """``"float32, float16 or bfloat16"`` for error messages."""
    ns = [d.name for d in rows]
    return ns[0] if len(ns) == 1 else ", ".join(ns[:-1]) + " or " + ns[-1]


def kv_storage(name: str, dtype: DTypeLike, kv_dtype: DTypeLike | None = None) -> DType:
    """The K/V format of a cache array of dtype ``dtype`` (its ``name`` for
    messages), given the ops' ``kv_dtype`` argument: None takes the array's
    own dtype (a K/V row: float32, float16, bfloat16, or on NumPy an
    ``ml_dtypes`` fp8 dtype); a name (``"e4m3"``, ``"fp8_e5m2"``,
    ``"float8_e4m3fn"``, ...) says which format the array holds, which must
    be that dtype itself or, for fp8, raw ``uint8`` storage (CuPy caches).
    PagedAttentionError naming the argument otherwise."""
    if kv_dtype is not None:
        d = lookup(kv_dtype) if isinstance(kv_dtype, str) else lookup(kv_dtype)
        kv_rows = tuple(r for r in TABLE if r.kv)
        if d is None or not d.kv:
            raise PagedAttentionError(
                f"kv_dtype: expected one of {', '.join(repr(r.token) for r in kv_rows)} "
                f"(or aliases {', '.join(repr(a) for r in kv_rows for a in r.aliases)}), "
                f"got {kv_dtype!r}"
            )
        got = np.dtype(dtype) if not isinstance(dtype, str) else None
        if got is not None and (got == d.np_dtype or (d.scaled and got == np.dtype(np.uint8))):
            return d
        want = f"{d.name}" + (" or uint8 (raw fp8 storage)" if d.scaled else "")
        raise PagedAttentionError(f"{name}: expected dtype {want} for kv_dtype={kv_dtype!r}, got {dtype_name(dtype)}")
    d = lookup(dtype)
    if d is None or not d.kv:
        if not isinstance(dtype, str) and _is_uint8(dtype):
            raise PagedAttentionError(
                f"{name}: uint8 is raw fp8 storage: name its format with kv_dtype='e4m3' or kv_dtype='e5m2'"
            )
        raise PagedAttentionError(
            f"{name}: expected dtype {names(tuple(r for r in TABLE if r.kv))} (or uint8 "
            f"with kv_dtype=), got {dtype_name(dtype)}"
        )
    return d


def _is_uint8(dtype: DTypeLike) -> bool:
    try:
        return np.dtype(dtype) == np.dtype(np.uint8)
    except TypeError:
        return False


def row(name: str, dtype: DTypeLike, *, kv: bool = False) -> DType:
    """The row of ``dtype`` (an array's dtype, or a dtype argument when
    ``name`` is "dtype"), which must be a query dtype (or, with ``kv``, a
    cache dtype); PagedAttentionError naming ``name`` otherwise."""
    d = lookup(dtype)
    if d is None or not (d.kv if kv else d.query):
        allowed = tuple(r for r in TABLE if (r.kv if kv else r.query))
        if name == "dtype":  # the argument itself: "dtype: expected float32, ..., got 'int8'"
            raise PagedAttentionError(f"dtype: expected {names(allowed)}, got {dtype!r}")
        raise PagedAttentionError(f"{name}: expected dtype {names(allowed)}, got {dtype_name(dtype)}")
    return d


def dtype_name(dtype: DTypeLike) -> str:
    """A readable name of any dtype-like (for messages)."""
    if isinstance(dtype, str):
        d = lookup(dtype)
        return repr(dtype) if d is None else d.name
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)


def token(dtype: DTypeLike) -> str:
    """The kernels' token of a known dtype (``"bf16"``); KeyError otherwise."""
    d = lookup(dtype)
    if d is None:
        raise KeyError(str(dtype))
    return d.token


def np_dtype(dtype: DTypeLike) -> np.dtype:
    """The NumPy dtype of a known dtype name or dtype; KeyError otherwise."""
    d = lookup(dtype)
    if d is None:
        raise KeyError(str(dtype))
    return d.np_dtype


def itemsize(dtype: DTypeLike) -> int:
    """Bytes per element of a known dtype name or dtype; KeyError otherwise."""
    d = lookup(dtype)
    if d is None:
        raise KeyError(str(dtype))
    return d.itemsize
