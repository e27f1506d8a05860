"""The one dtype table: every storage type cupaged knows, by every name.

Each row says what a dtype is called (the kernels' token, the NumPy name,
aliases), its item size, the NumPy dtype (``ml_dtypes`` for bfloat16), the
torch dtype's name, and where it may appear: as queries / outputs (and every
dense layer kernel), or as K/V cache storage. The kernels see the token as
``CP_DTYPE`` (q, out) and ``CP_KV_DTYPE`` (caches); ``kernels_cu/common.cuh``
maps tokens to C types.

Nothing here imports the rest of the package.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import PagedAttentionError


@dataclass(frozen=True)
class DType:
    token: str            # CP_DTYPE / CP_KV_DTYPE value, and the short name users pass ("bf16")
    name: str             # NumPy's name of the dtype ("bfloat16")
    np_dtype: np.dtype
    torch_name: str       # attribute of the torch module ("bfloat16")
    query: bool           # may be q / out / a dense layer's storage
    kv: bool              # may be K/V cache storage
    tensor_core: bool     # the tensor-core kernels take it (16-bit)

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize


TABLE: tuple[DType, ...] = (
    DType("f32", "float32", np.dtype(np.float32), "float32", query=True, kv=True, tensor_core=False),
    DType("f16", "float16", np.dtype(np.float16), "float16", query=True, kv=True, tensor_core=True),
    DType("bf16", "bfloat16", np.dtype(ml_dtypes.bfloat16), "bfloat16", query=True, kv=True, tensor_core=True),
)

_BY_NAME = {**{d.token: d for d in TABLE}, **{d.name: d for d in TABLE}}

#: Tokens of the dtypes kernels are built for, in table order.
TOKENS = tuple(d.token for d in TABLE)
#: Tokens of the query / output dtypes, and of the K/V cache dtypes.
QUERY_TOKENS = tuple(d.token for d in TABLE if d.query)
KV_TOKENS = tuple(d.token for d in TABLE if d.kv)
#: Tokens of the tensor-core kernels' dtypes.
TC_TOKENS = tuple(d.token for d in TABLE if d.tensor_core)


def lookup(dtype) -> DType | None:
    """The row of ``dtype`` (a token, a NumPy name, a NumPy dtype or type),
    or None when cupaged has no such storage type."""
    if isinstance(dtype, str):
        return _BY_NAME.get(dtype)
    try:
        return _BY_NAME.get(np.dtype(dtype).name)
    except TypeError:
        return None


def names(rows=TABLE) -> str:
    """``"float32, float16 or bfloat16"`` for error messages."""
    ns = [d.name for d in rows]
    return ns[0] if len(ns) == 1 else ", ".join(ns[:-1]) + " or " + ns[-1]


def row(name: str, dtype, *, kv: bool = False) -> DType:
    """The row of ``dtype`` (an array's dtype, or a dtype argument when
    ``name`` is "dtype"), which must be a query dtype (or, with ``kv``, a
    cache dtype); PagedAttentionError naming ``name`` otherwise."""
    d = lookup(dtype)
    allowed = tuple(r for r in TABLE if (r.kv if kv else r.query))
    if d is None or d not in allowed:
        if name == "dtype":   # the argument itself: "dtype: expected float32, ..., got 'int8'"
            raise PagedAttentionError(f"dtype: expected {names(allowed)}, got {dtype!r}")
        raise PagedAttentionError(f"{name}: expected dtype {names(allowed)}, got {dtype_name(dtype)}")
    return d


def dtype_name(dtype) -> str:
    """A readable name of any dtype-like (for messages)."""
    if isinstance(dtype, str):
        return repr(dtype) if lookup(dtype) is None else lookup(dtype).name
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)


def token(dtype) -> str:
    """The kernels' token of a known dtype (``"bf16"``); KeyError otherwise."""
    d = lookup(dtype)
    if d is None:
        raise KeyError(str(dtype))
    return d.token


def np_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a known dtype name or dtype; KeyError otherwise."""
    d = lookup(dtype)
    if d is None:
        raise KeyError(str(dtype))
    return d.np_dtype
