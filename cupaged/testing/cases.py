"""Random paged cases and per-dtype tolerances, for tests and kernel scripts.

``make_paged_case`` / ``make_mla_case`` build the inputs every kernel test
starts from, the way the leading libraries test: a random permutation of page
ids, lengths that are not multiples of the page size, every unused cache slot
(tail of a last page, pages no sequence owns) poisoned with NaN, and a huge
sentinel in every page-table entry past a sequence's length. A kernel that
reads anything it should not reads NaN or an out-of-range page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import dtypes
from . import reference

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

PAGE_SENTINEL = 2**30
"""Default value of page-table entries past a sequence's length."""


# (atol, rtol) for kernel outputs of order 1 against the float64 reference.
# float32: float32 accumulation and exp; float16 / bfloat16: a few roundings
# of the output and of intermediates to the storage type (unit roundoff
# 2**-11 and 2**-8).
_TOLERANCE = {
    "float64": (1e-12, 1e-12),
    "float32": (5e-5, 5e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}


def as_dtype(dtype: DTypeLike) -> np.dtype:
    """A NumPy dtype from a dtype, a type or a name ("f32", "bfloat16", ...)."""
    if isinstance(dtype, str):
        if dtype in ("f64", "float64"):
            return np.dtype(np.float64)
        row = dtypes.lookup(dtype)
        if row is None:
            names = sorted([d.token for d in dtypes.TABLE] + [d.name for d in dtypes.TABLE] + ["f64", "float64"])
            raise ValueError(f"dtype: expected one of {names}, got {dtype!r}")
        return row.np_dtype
    return np.dtype(dtype)


#: (atol, rtol) of an fp8 round trip, x against dequantize(quantize(x)), for
#: |x / scale| within the format's range: half a unit in the last place of
#: 3 (e4m3) / 2 (e5m2) mantissa bits relative, half the smallest subnormal
#: (2^-10 / 2^-17, times the scale) absolute. Attention over an fp8 cache is
#: compared with the float64 reference on the dequantized cache
#: (reference.dequantize_fp8) at the query dtype's tolerance: decoding is
#: exact and the scales apply in f32, so the kernels' error budget is that
#: of their f16 / bf16 operands (tolerance(q.dtype)).
FP8_ROUND_TRIP = {
    "float8_e4m3fn": (2.0**-10, 2.0**-4),
    "float8_e5m2": (2.0**-17, 2.0**-3),
}


def tolerance(dtype: DTypeLike) -> tuple[float, float]:
    """(atol, rtol) for comparing a kernel result computed from ``dtype``
    inputs (and stored in ``dtype``) with the float64 reference; for an fp8
    format, the round trip of a value through it (FP8_ROUND_TRIP, atol for a
    scale of 1)."""
    name = as_dtype(dtype).name
    if name in FP8_ROUND_TRIP:
        return FP8_ROUND_TRIP[name]
    if name not in _TOLERANCE:
        raise ValueError(f"dtype: no tolerance for {name}")
    return _TOLERANCE[name]


def assert_close(actual: ArrayLike, expected: ArrayLike, dtype: DTypeLike, what: str = "") -> None:
    """``np.testing.assert_allclose`` with ``tolerance(dtype)``; infinities
    must match exactly, NaN must match NaN."""
    atol, rtol = tolerance(dtype)
    got = np.asarray(actual).astype(np.float64)
    np.testing.assert_allclose(
        got, np.asarray(expected, dtype=np.float64), atol=atol, rtol=rtol, equal_nan=True, err_msg=what
    )


def random_lengths(
    rng: np.random.Generator, sequences: int, max_len: int, page_size: int, min_len: int = 1
) -> np.ndarray:
    """``sequences`` lengths in [min_len, max_len], none a multiple of
    ``page_size`` (when page_size > 1 and the range allows), int32."""
    lens = rng.integers(min_len, max_len + 1, size=sequences)
    for i, n in enumerate(lens):
        if page_size > 1 and n > 0 and n % page_size == 0:
            lens[i] = n - 1 if n - 1 >= max(min_len, 1) else min(n + 1, max_len)
    return lens.astype(np.int32)


def _q_lens(kv_lens: np.ndarray, q_lens: int | ArrayLike | None) -> np.ndarray:
    if q_lens is None:  # decode: one new token per non-empty sequence
        q_lens = np.minimum(kv_lens, 1)
    elif np.isscalar(q_lens):
        q_lens = np.minimum(kv_lens, int(q_lens))  # type: ignore[arg-type]  # int() raises for a scalar it cannot take
    q_lens = np.asarray(q_lens, dtype=np.int32)
    if q_lens.shape != kv_lens.shape or np.any(q_lens < 0):  # q_lens > kv_lens: a non-causal-only case
        raise ValueError(f"q_lens: expected {kv_lens.shape} values >= 0, got {q_lens.tolist()}")
    return q_lens


_Layout = TypeVar("_Layout", bound="PagedLayout")


@dataclasses.dataclass
class PagedLayout:
    """Where every token lives.

    page_table: int32 [sequences, table_width]; kv_lens, q_lens: int32
    [sequences]; slot_used: bool [pages, page_size], True where a token of
    some sequence lives; page_size and num_pages.
    """

    page_table: np.ndarray
    kv_lens: np.ndarray
    q_lens: np.ndarray
    slot_used: np.ndarray
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.slot_used.shape[0]

    @property
    def num_queries(self) -> int:
        return int(self.q_lens.sum())

    def map(self: _Layout, fn: Callable[[np.ndarray], Any]) -> _Layout:
        """A copy with ``fn`` applied to every array field (e.g. ``cupy.asarray``)."""
        return dataclasses.replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)
            },
        )


def random_page_table(
    rng: np.random.Generator,
    lengths: ArrayLike,
    page_size: int,
    num_pages: int,
    *,
    extra_cols: int = 0,
    unused_entry: int = -1,
    dtype: DTypeLike = np.int64,
) -> np.ndarray:
    """A page table [len(lengths), max pages + extra_cols] giving each
    sequence ceil(length / page_size) distinct pages, taken in order from a
    random permutation of 0..num_pages-1; ``unused_entry`` everywhere else."""
    need = -(-np.asarray(lengths, dtype=np.int64) // page_size)  # pages per sequence
    if int(need.sum()) > num_pages:
        raise ValueError(f"num_pages: {num_pages} pages cannot hold {int(need.sum())} pages of sequences")
    width = int(need.max(initial=0)) + extra_cols
    perm = rng.permutation(num_pages)
    table = np.full((len(need), max(width, 1)), unused_entry, dtype=dtype)
    start = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[start : start + n]
        start += n
    return table


def make_layout(
    rng: np.random.Generator,
    kv_lens: ArrayLike,
    q_lens: int | ArrayLike | None = None,
    page_size: int = 16,
    extra_pages: int = 2,
    extra_table_cols: int = 1,
    unused_entry: int = PAGE_SENTINEL,
) -> PagedLayout:
    """A random paged layout for ``kv_lens``.

    Pages are a random permutation of ``sum(ceil(kv_lens / page_size)) +
    extra_pages`` ids; the extra pages belong to nobody. The table is
    ``extra_table_cols`` wider than needed and every entry past a sequence's
    length holds ``unused_entry``. ``q_lens``: None (one query per non-empty
    sequence), an int (capped at kv_lens) or [sequences].
    """
    kv = np.asarray(kv_lens, dtype=np.int32)
    q = _q_lens(kv, q_lens)
    pages = int((-(-kv.astype(np.int64) // page_size)).sum()) + extra_pages
    table = random_page_table(
        rng, kv, page_size, pages, extra_cols=extra_table_cols, unused_entry=unused_entry, dtype=np.int32
    )
    used = np.zeros((pages, page_size), dtype=bool)
    for s in range(len(kv)):
        t = np.arange(kv[s])
        used[table[s, t // page_size], t % page_size] = True
    return PagedLayout(table, kv, q, used, page_size)


def _poisoned_cache(rng, layout: PagedLayout, heads: int, dim: int, dtype) -> np.ndarray:
    """[pages, page_size, heads, dim] in ``dtype``: standard normal where a
    token lives, NaN everywhere else."""
    cache = rng.standard_normal((layout.num_pages, layout.page_size, heads, dim))
    cache[~layout.slot_used] = np.nan
    return cache.astype(as_dtype(dtype))


@dataclasses.dataclass
class PagedCase(PagedLayout):
    """A paged attention case: the layout plus

    q: [queries, Hq, D]; k_cache: [pages, page_size, Hkv, D];
    v_cache: [pages, page_size, Hkv, Dv] (NaN in every unused slot); scale.
    """

    # Set by make_paged_case; the None defaults only let them follow the layout's fields.
    q: np.ndarray = None  # type: ignore[assignment]
    k_cache: np.ndarray = None  # type: ignore[assignment]
    v_cache: np.ndarray = None  # type: ignore[assignment]
    scale: float = 1.0

    def reference(self, causal: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(out [queries, Hq, Dv], lse [queries, Hq]) from ``reference.paged_attention``."""
        return reference.paged_attention(
            self.q, self.k_cache, self.v_cache, self.page_table, self.kv_lens, self.q_lens, self.scale, causal
        )


@dataclasses.dataclass
class MlaCase(PagedLayout):
    """A paged MLA case: the layout plus

    q: [queries, H, R]; q_pos: [queries, H, P]; latent: [pages, page_size, 1, R];
    k_pos: [pages, page_size, 1, P] (NaN in every unused slot); scale.
    """

    # Set by make_mla_case; the None defaults only let them follow the layout's fields.
    q: np.ndarray = None  # type: ignore[assignment]
    q_pos: np.ndarray = None  # type: ignore[assignment]
    latent: np.ndarray = None  # type: ignore[assignment]
    k_pos: np.ndarray = None  # type: ignore[assignment]
    scale: float = 1.0

    def reference(self, causal: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(out [queries, H, R], lse [queries, H]) from ``reference.paged_mla``."""
        return reference.paged_mla(
            self.q, self.q_pos, self.latent, self.k_pos, self.page_table, self.kv_lens, self.q_lens, self.scale, causal
        )


def _layout_args(rng, kv_lens, sequences, max_kv_len, page_size):
    if kv_lens is None:
        kv_lens = random_lengths(rng, sequences, max_kv_len, page_size)
    return kv_lens


def make_paged_case(
    rng: np.random.Generator,
    *,
    kv_lens: ArrayLike | None = None,
    q_lens: int | ArrayLike | None = None,
    sequences: int = 3,
    max_kv_len: int = 48,
    page_size: int = 16,
    num_q_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    dtype: DTypeLike = "f16",
    scale: float | None = None,
    extra_pages: int = 2,
    extra_table_cols: int = 1,
    unused_entry: int = PAGE_SENTINEL,
) -> PagedCase:
    """A random paged attention case (see the module docstring).

    kv_lens: [sequences] or None for ``random_lengths(rng, sequences,
    max_kv_len, page_size)``; q_lens as in ``make_layout``. num_kv_heads
    defaults to num_q_heads, head_dim_v to head_dim, scale to
    1/sqrt(head_dim). Arrays are float ``dtype`` ("f32", "f16", "bf16" or a
    dtype); lengths and the page table int32.
    """
    layout = make_layout(
        rng,
        _layout_args(rng, kv_lens, sequences, max_kv_len, page_size),
        q_lens,
        page_size,
        extra_pages,
        extra_table_cols,
        unused_entry,
    )
    hkv = num_q_heads if num_kv_heads is None else num_kv_heads
    dv = head_dim if head_dim_v is None else head_dim_v
    q = rng.standard_normal((layout.num_queries, num_q_heads, head_dim)).astype(as_dtype(dtype))
    return PagedCase(
        **dataclasses.asdict(layout),
        q=q,
        k_cache=_poisoned_cache(rng, layout, hkv, head_dim, dtype),
        v_cache=_poisoned_cache(rng, layout, hkv, dv, dtype),
        scale=float(head_dim**-0.5 if scale is None else scale),
    )


def make_mla_case(
    rng: np.random.Generator,
    *,
    kv_lens: ArrayLike | None = None,
    q_lens: int | ArrayLike | None = None,
    sequences: int = 3,
    max_kv_len: int = 48,
    page_size: int = 16,
    num_heads: int = 4,
    latent_dim: int = 64,
    pos_dim: int = 16,
    dtype: DTypeLike = "bf16",
    scale: float | None = None,
    extra_pages: int = 2,
    extra_table_cols: int = 1,
    unused_entry: int = PAGE_SENTINEL,
) -> MlaCase:
    """A random paged MLA case; arguments as in ``make_paged_case``. scale
    defaults to 1/sqrt(latent_dim + pos_dim)."""
    layout = make_layout(
        rng,
        _layout_args(rng, kv_lens, sequences, max_kv_len, page_size),
        q_lens,
        page_size,
        extra_pages,
        extra_table_cols,
        unused_entry,
    )
    n, dt = layout.num_queries, as_dtype(dtype)
    return MlaCase(
        **dataclasses.asdict(layout),
        q=rng.standard_normal((n, num_heads, latent_dim)).astype(dt),
        q_pos=rng.standard_normal((n, num_heads, pos_dim)).astype(dt),
        latent=_poisoned_cache(rng, layout, 1, latent_dim, dtype),
        k_pos=_poisoned_cache(rng, layout, 1, pos_dim, dtype),
        scale=float((latent_dim + pos_dim) ** -0.5 if scale is None else scale),
    )
