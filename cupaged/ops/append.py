"""Writing new K/V rows into paged caches, and copying pages
(``kernels_cu/append.cu``).

``append(plan, new_k, new_v, k_cache, v_cache)`` writes each packed query's
new key/value row into the slot of its absolute position (one launch of
``paged_append``); ``copy_pages`` copies whole pages of both caches in every
layer (one launch of ``copy_pages``), for copy-on-write;
``launch_write_slots`` writes rows by an explicit slot mapping. The checked
engine-level forms of the last two are ``cupaged.ops.slots``. Layout:
``docs/layout.md``.

Caches and new rows may be any views whose innermost dim is contiguous
(strides travel in ``AppendParams``). A cache of the new rows' dtype gets
the rows bit for bit; an fp8 cache (``kv_dtype`` e4m3 / e5m2, ml_dtypes
arrays or raw uint8 storage) gets each element quantized as
``code(x / scale)`` (nearest, ties to even, saturating; NaN stays NaN) with
``k_scale`` / ``v_scale`` (float32, one or one per KV head; 1 when absent).

``append(..., rope=Rotary(cos, sin, q))`` fuses rotary embedding into the
write (one launch in place of ``layers.rope`` + ``append``): each query's K
rows are rotated by its position on their way into the cache and its q rows
in place; V rows are written unchanged.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import dtypes
from .._runtime import Stream, address, backend_of, checks, get_kernel, register
from .._runtime.arrays import Array
from .._runtime.structs import Field, StructArg, c_struct, struct_dtype
from ..errors import PagedAttentionError
from .attention.inputs import layer_operands
from .attention.options import KVLayer

#: Copy units the raw kernels are compiled for (bytes); the host picks the
#: widest that divides every row size, stride and base address.
UNIT_BYTES = (16, 8, 4, 2, 1)
#: Elements per step of the quantizing kernels (CP_QVEC), widest first.
QUANT_VECS = (8, 4, 2, 1)

#: kernels_cu-relative path of the generated header.
HEADER_PATH = "append_params.cuh"
STRUCT = "AppendParams"
#: The argument of paged_append and write_slots. Strides count elements of
#: the pointer's type: copy units (raw builds) or elements (quantizing).
FIELDS: tuple[Field, ...] = (
    Field("new_k", "const void*", "[tokens, Hkv, D] rows"),
    Field("new_v", "const void*", "[tokens, Hkv, Dv] rows (unused when units_v == 0)"),
    Field("k_cache", "void*", "[pages, page_size, Hkv, D] rows"),
    Field("v_cache", "void*", "[pages, page_size, Hkv, Dv] rows"),
    Field("words", "const u32*", "paged_append: the plan's metadata"),
    Field("slots", "const long long*", "write_slots: slot of each token (-1: skip)"),
    Field("k_scale", "const float*", "quantizing: K scale, one or per KV head (null: 1)"),
    Field("v_scale", "const float*", "quantizing: V scale"),
    Field("rope_q", "void*", "rotary: q rows [tokens, Hq, D] rotated in place (null: none)"),
    Field("rope_cos", "const float*", "rotary: [rope_max_pos, D / 2] tables"),
    Field("rope_sin", "const float*", ""),
    Field("rope_q_norm", "const void*", "rotary: RMSNorm weight [Dr] of the q rows, before rotating (null: none)"),
    Field("rope_k_norm", "const void*", "rotary: RMSNorm weight [D] of the K rows (null: none)"),
    Field("rope_v_norm", "const void*", "rotary: RMSNorm weight [Dv] of the V rows (null: none)"),
    Field("rope_q_bias", "const void*", "rotary: bias [Hq, Dr] of the q rows, added first (null: none)"),
    Field("rope_k_bias", "const void*", "rotary: bias [Hkv, D] of the K rows"),
    Field("rope_v_bias", "const void*", "rotary: bias [Hkv, Dv] of the V rows"),
    Field("num_slots", "u64", "write_slots: pages * page_size"),
    Field("tokens", "u32", "rows to write (paged_append: the plan's queries)"),
    Field("sequences", "u32", "paged_append: the plan's static sizes"),
    Field("table_width", "u32", ""),
    Field("page_size", "u32", ""),
    Field("num_pages", "u32", ""),
    Field("heads", "u32", "Hkv (1 when all heads of a token are one contiguous row)"),
    Field("units_k", "u32", "units of a K row (of one head)"),
    Field("units_v", "u32", "units of a V row, 0: no V"),
    Field("src_tok_k", "u32", "new_k strides: token, head"),
    Field("src_head_k", "u32", ""),
    Field("src_tok_v", "u32", "new_v strides"),
    Field("src_head_v", "u32", ""),
    Field("dst_page_k", "u32", "k_cache strides: page, slot, head"),
    Field("dst_slot_k", "u32", ""),
    Field("dst_head_k", "u32", ""),
    Field("dst_page_v", "u32", "v_cache strides"),
    Field("dst_slot_v", "u32", ""),
    Field("dst_head_v", "u32", ""),
    Field("k_scale_stride", "u32", "1: a scale per KV head, 0: one"),
    Field("v_scale_stride", "u32", ""),
    Field("rope_max_pos", "u32", "rotary: rows of rope_cos / rope_sin"),
    Field("rope_v", "u32", "rotary: 1: the V rows rotated (MLA's rotary part), K copied"),
    Field("rope_eps", "float", "rotary: the norms' epsilon"),
    Field("q_heads", "u32", "rotary: Hq of rope_q"),
    Field("src_tok_q", "u32", "rope_q strides: token, head"),
    Field("src_head_q", "u32", ""),
)
DTYPE = struct_dtype(FIELDS)
NAMES = tuple(f.name for f in FIELDS)


def header() -> str:
    """The text of ``kernels_cu/append_params.cuh``."""
    return f"""\
// append_params.cuh: GENERATED by `python -m cupaged.tools.gen_headers` from cupaged/ops/append.py; do not edit.
// The one argument of paged_append and write_slots (append.cu). Strides count elements of the pointer's type.
#pragma once
#include "common.cuh"

{c_struct(STRUCT, FIELDS)}"""


#: The caches of the rotary builds: of the rows' dtype, or fp8 (quantizing).
_ROPE_CACHES: list[dict[str, object]] = [{}] + [{"CP_QUANT": 1, "CP_KV_DTYPE": kv} for kv in dtypes.FP8_TOKENS]

register(
    "append",
    [{"CP_VEC_BYTES": w} for w in UNIT_BYTES]
    + [
        {"CP_QUANT": 1, "CP_DTYPE": dt, "CP_KV_DTYPE": kv, "CP_QVEC": v}
        for dt in dtypes.QUERY_TOKENS
        for kv in dtypes.FP8_TOKENS
        for v in QUANT_VECS
    ]
    + [
        {"CP_ROPE": 1, "CP_DTYPE": dt, "CP_QVEC": v, **fp8}
        for dt in dtypes.QUERY_TOKENS
        for fp8 in _ROPE_CACHES
        for v in QUANT_VECS
    ],
)

_BLOCK_THREADS = 256
_MAX_GRID_Y = 65535

# HostPlans whose writes were validated already (a plan is reused by every
# layer of a step; validate_writes sorts its slots, so do it once per plan).
_validated: weakref.WeakSet = weakref.WeakSet()


def unit_bytes(*values: int) -> int:
    """The widest copy unit in UNIT_BYTES dividing every value (row or page
    sizes in bytes, strides, base addresses)."""
    for w in UNIT_BYTES:
        if all(int(v) % w == 0 for v in values):
            return w
    raise AssertionError("unreachable: 1 divides everything")


@dataclass(frozen=True)
class Rotary:
    """Rotary embedding fused into ``append`` (rotate-half, as
    ``layers.rope``): one launch rotates each query's K rows by its absolute
    position (the plan's device q_pos word, so a captured graph rotates by
    the current position on every replay) on their way into the cache, and
    ``q``'s rows in place; V rows are copied (with a bias or norm below:
    biased / normalized), new_k and new_v are left as they were.
    ``side="v"`` rotates the V rows instead and copies K (an MLA cache: new_k
    the latent, new_v the rotary part k_pos). A position past the tables is
    clamped to their last row.

    cos, sin: float32 [max_pos, Dr // 2], contiguous (row p: position p; Dr
    the rotated rows' head dim, even). q: [queries, Hq, Dr] of new_k's dtype,
    a view whose last dim is contiguous (the q heads of a fused QKV buffer),
    or None (the cache rows alone). A rotated value is rounded to new_k's
    dtype before an fp8 cache quantizes it, so the cache holds what
    ``layers.rope`` then ``append`` would write.

    q_norm [Dr], k_norm [D], v_norm [Dv]: RMSNorm weights of new_k's dtype
    for the q rows, the K rows and the V rows, applied (with ``eps``, rounded
    as ``layers.rms_norm`` writes them) before a row is rotated or copied:
    Qwen3's per-head q_norm / k_norm, or MLA's latent norm (``k_norm`` with
    ``side="v"``), fold their ``rms_norm`` launches into this one (None: no
    norm). q_bias [Hq, Dr], k_bias [Hkv, D], v_bias [Hkv, Dv] (contiguous, of
    new_k's dtype: Qwen2's q / k / v biases) are added to the rows first,
    rounded as ``layers.bias_add`` writes them."""

    cos: Array
    sin: Array
    q: Array | None = None
    side: str = "k"
    q_norm: Array | None = None
    k_norm: Array | None = None
    v_norm: Array | None = None
    eps: float = 1e-6
    q_bias: Array | None = None
    k_bias: Array | None = None
    v_bias: Array | None = None


@dataclass
class KvWrite:
    """A checked write of new K/V rows into caches: the cache format
    (``fmt``, a dtypes row), whether it quantizes, the arrays and their
    element strides, and the scales (None: 1) with their strides."""

    fmt: dtypes.DType
    quantize: bool
    new_k: Array
    new_v: Array | None
    k_cache: Array
    v_cache: Array | None
    src_k: tuple[int, ...] | None  # None: no new_k (a write that cannot launch)
    src_v: tuple[int, ...] | None  # None without v_cache (K only)
    dst_k: tuple[int, ...]
    dst_v: tuple[int, ...] | None
    k_scale: Array | None = None
    v_scale: Array | None = None
    k_scale_stride: int = 0
    v_scale_stride: int = 0
    rope: Rotary | None = None  # a rotary append (check_rotary)
    src_q: tuple[int, ...] = (0, 0, 1)  # rope.q's element strides


def check_kv_write(
    new_k: Array,
    new_v: Array | None,
    k_cache: Array,
    v_cache: Array | None,
    tokens: int | None,
    *,
    kv_dtype: object = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    lead: tuple[int, ...] = (),
    ref: str = "new_k",
) -> KvWrite:
    """Every check of writing new_k [tokens, Hkv, D] / new_v [tokens, Hkv,
    Dv] into k_cache [*lead, Hkv, D] / v_cache [*lead, Hkv, Dv] (4-D caches;
    ``lead`` the expected first two dims when given). new_v and v_cache may
    both be None (K only: MLA without a rotary part). The caches' format:
    their dtype, or ``kv_dtype`` for uint8 storage (dtypes.kv_storage); an
    fp8 cache takes new rows of any query dtype (quantized, with optional
    ``k_scale`` / ``v_scale``), any other cache new rows of its own dtype.
    Caches and new rows may be any views whose innermost dim is contiguous
    (checks.row_view). ``ref``: which side a dtype mismatch is reported
    against ("new_k": append's order; "k_cache": write_slots'). Raises
    PagedAttentionError naming the argument."""
    if (new_v is None) != (v_cache is None):
        raise PagedAttentionError("new_v, v_cache: expected both or neither (neither: write K only)")
    backend_of(new_k=new_k, new_v=new_v, k_cache=k_cache, v_cache=v_cache)
    for name, a in (("new_k", new_k), ("new_v", new_v)):
        if a is not None and a.ndim != 3:
            raise PagedAttentionError(
                f"{name}: expected a 3-D array, got shape {checks.shape_str(a.shape)} ({a.ndim}-D)"
            )
        if a is not None:
            checks.u32_size(name, a.shape)

    def rows_dtype():
        dtypes.row("new_k", new_k.dtype)
        if new_v is not None:
            checks.same_dtype("new_k", new_k, new_v=new_v)

    def cache(name, c):
        f, st = checks.cache_view(name, c, kv_dtype=kv_dtype)
        if lead and tuple(int(x) for x in c.shape[:2]) != tuple(lead):
            raise PagedAttentionError(
                f"{name}: expected shape [{lead[0]}, {lead[1]}, ...] (plan.pages, plan.page_size, ...), got "
                f"{checks.shape_str(c.shape)}"
            )
        return f, st

    if ref == "new_k":  # append: the new rows set the dtype
        rows_dtype()
        fmt, dst_k = cache("k_cache", k_cache)
        if not fmt.scaled:
            checks.same_dtype("new_k", new_k, k_cache=k_cache)
    else:  # write_slots: the caches do
        fmt, dst_k = cache("k_cache", k_cache)
        if fmt.scaled:
            rows_dtype()
        else:
            checks.same_dtype("k_cache", k_cache, new_k=new_k, new_v=new_v)
    dst_v = None
    if v_cache is not None:
        _, dst_v = cache("v_cache", v_cache)
        checks.same_dtype("k_cache", k_cache, v_cache=v_cache)
        checks.v_like_k(k_cache, v_cache)
    hkv, d = int(k_cache.shape[2]), int(k_cache.shape[3])
    dv = int(v_cache.shape[3]) if v_cache is not None else 0
    if hkv < 1 or d < 1 or (v_cache is not None and dv < 1):
        raise PagedAttentionError(
            f"k_cache, v_cache: expected Hkv, D and Dv >= 1, got shapes {checks.shape_str(k_cache.shape)}"
            + ("" if v_cache is None else f" and {checks.shape_str(v_cache.shape)}")
        )
    n = int(new_k.shape[0]) if tokens is None else tokens
    srcs: list[tuple[int, ...] | None] = []
    for name, a, dim in (("new_k", new_k, d), ("new_v", new_v, dv)):
        if a is None:
            srcs.append(None)
            continue
        checks.shape_is(name, a, (n, hkv, dim))
        srcs.append(checks.row_view(name, a))
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and not fmt.scaled:
            raise PagedAttentionError(
                f"{name}: expected None for a {fmt.name} cache (scales belong to fp8 caches: kv_dtype e4m3 / e5m2)"
            )
    if v_scale is not None and v_cache is None:
        raise PagedAttentionError("v_scale: expected None without v_cache")
    ks = checks.kv_scale("k_scale", k_scale, hkv, k_cache) if k_scale is not None else 0
    vs = checks.kv_scale("v_scale", v_scale, hkv, k_cache) if v_scale is not None else 0
    if v_cache is not None:
        checks.no_overlap("k_cache", k_cache, v_cache=v_cache)
    for name, a in (("new_k", new_k), ("new_v", new_v)):
        if a is not None:
            checks.no_overlap(name, a, k_cache=k_cache, v_cache=v_cache)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None:
            checks.no_overlap(name, s, k_cache=k_cache, v_cache=v_cache)
    return KvWrite(
        fmt, fmt.scaled, new_k, new_v, k_cache, v_cache, srcs[0], srcs[1], dst_k, dst_v, k_scale, v_scale, ks, vs
    )


def check_append(
    plan: Any,
    new_k: Array,
    new_v: Array,
    k_cache: Array,
    v_cache: Array,
    *,
    kv_dtype: object = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
) -> KvWrite:
    """Every input check of ``append`` (raises PagedAttentionError naming the
    argument; launches and writes nothing)."""
    if not (hasattr(plan, "host") and hasattr(plan, "words") and hasattr(plan, "stream")):
        raise PagedAttentionError(f"plan: expected a DevicePlan (HostPlan.upload), got {type(plan).__name__}")
    checks.plan_arrays(plan, new_k=new_k, new_v=new_v, k_cache=k_cache, v_cache=v_cache)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(c, "ndim", 4) == 5:
            raise PagedAttentionError(
                f"{name}: expected a 4-D array [pages, page_size, heads, D], got shape {checks.shape_str(c.shape)} "
                f"(5-D: a PagedKVCache's layer-major cache; pass one layer, cache.k[layer])"
            )
    return check_kv_write(
        new_k,
        new_v,
        k_cache,
        v_cache,
        plan.host.queries,
        kv_dtype=kv_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        lead=(plan.host.pages, plan.host.page_size),
    )


def check_rotary(plan: Any, w: KvWrite, rope: object) -> None:
    """The checks of ``append``'s ``rope`` (a Rotary) against a checked
    write of ``plan``'s queries (its arrays on the plan's device and stream
    too); sets ``w.rope`` and ``w.src_q``. PagedAttentionError naming the
    argument."""
    queries = plan.host.queries
    if not isinstance(rope, Rotary):
        raise PagedAttentionError(f"rope: expected a cupaged.Rotary (cos, sin, q) or None, got {type(rope).__name__}")
    if rope.side not in ("k", "v"):
        raise PagedAttentionError(f"rope.side: expected 'k' or 'v' (the rows rotated), got {rope.side!r}")
    cache = w.k_cache if rope.side == "k" else w.v_cache
    if cache is None:
        raise PagedAttentionError("rope.side: expected 'k' without new_v and v_cache (no V rows to rotate), got 'v'")
    d = int(cache.shape[3])
    if d % 2:
        raise PagedAttentionError(f"rope: expected an even {rope.side.upper()} head dim to rotate, got {d}")
    backend_of(new_k=w.new_k, cos=rope.cos, sin=rope.sin, q=rope.q)
    checks.rope_tables(rope.cos, rope.sin, d // 2)
    q = rope.q
    if q is not None:
        checks.float_array("rope.q", q, 3, view=True)
        checks.same_dtype("new_k", w.new_k, **{"rope.q": q})
        if int(q.shape[1]) < 1:
            raise PagedAttentionError(f"rope.q: expected Hq >= 1 heads, got shape {checks.shape_str(q.shape)}")
        checks.shape_is("rope.q", q, (queries, int(q.shape[1]), d))
        w.src_q = checks.view_strides("rope.q", q) + (1,)
    for name, x in (("rope.q_norm", rope.q_norm), ("rope.q_bias", rope.q_bias)):
        if x is not None and q is None:
            raise PagedAttentionError(f"{name}: expected None without rope.q (no q rows)")
    for name, x in (("rope.v_norm", rope.v_norm), ("rope.v_bias", rope.v_bias)):
        if x is not None and w.v_cache is None:
            raise PagedAttentionError(f"{name}: expected None without new_v and v_cache (no V rows)")
    hkv = int(w.k_cache.shape[2])
    dims = {"k": int(w.k_cache.shape[3]), "v": int(w.v_cache.shape[3]) if w.v_cache is not None else 0}
    norms = (
        ("rope.q_norm", rope.q_norm, d),
        ("rope.k_norm", rope.k_norm, dims["k"]),
        ("rope.v_norm", rope.v_norm, dims["v"]),
    )
    for name, wt, dim in norms:
        if wt is not None:
            checks.float_array(name, wt, 1)
            checks.same_dtype("new_k", w.new_k, **{name: wt})
            checks.shape_is(name, wt, (dim,))
    biases = (
        ("rope.q_bias", rope.q_bias, (int(q.shape[1]) if q is not None else 0, d)),
        ("rope.k_bias", rope.k_bias, (hkv, dims["k"])),
        ("rope.v_bias", rope.v_bias, (hkv, dims["v"])),
    )
    for name, b, shape in biases:
        if b is not None:
            checks.float_array(name, b, 2)
            checks.same_dtype("new_k", w.new_k, **{name: b})
            checks.shape_is(name, b, shape)
    if any(wt is not None for _, wt, _ in norms):
        eps = rope.eps
        if (
            isinstance(eps, (bool, np.bool_))
            or not isinstance(eps, (int, float, np.floating))
            or not 0 <= eps < math.inf
        ):
            raise PagedAttentionError(f"rope.eps: expected a finite float >= 0, got {eps!r}")
    tables = {"rope.cos": rope.cos, "rope.sin": rope.sin}
    tables.update({name: x for name, x, _ in norms + biases if x is not None})
    checks.plan_arrays(plan, **tables, **{"rope.q": q})  # backend, device and stream: before comparing addresses
    for name, x in tables.items():  # read while the caches are written
        checks.no_overlap(name, x, k_cache=w.k_cache, v_cache=w.v_cache)
    if q is not None:  # (written in place: disjoint from everything the launch reads)
        rows = {"new_k": w.new_k, "new_v": w.new_v, "k_cache": w.k_cache, "v_cache": w.v_cache}
        checks.no_overlap("rope.q", q, **rows, **tables)
    w.rope = rope


def append(
    plan: Any,
    new_k: Array,
    new_v: Array | None,
    k_cache: Array,
    v_cache: Array | None = None,
    *,
    kv_dtype: object = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    rope: Rotary | None = None,
) -> None:
    """Write new keys and values into the paged caches, in place.

    new_k [queries, Hkv, D], new_v [queries, Hkv, Dv]: one row per packed
    query of ``plan``. k_cache [pages, page_size, Hkv, D], v_cache
    [pages, page_size, Hkv, Dv]: the row of the query at absolute position p
    of sequence s goes to page ``page_table[s, p // page_size]``, offset
    ``p % page_size``. MLA caches work the same way: Hkv = 1, k_cache =
    latent [pages, page_size, 1, R], v_cache = k_pos [pages, page_size, 1, P],
    new_k [queries, 1, R], new_v [queries, 1, P]; without a rotary part,
    new_v and v_cache are None.

    Caches of the new rows' dtype (float32, float16 or bfloat16) get them bit
    for bit; an fp8 cache (its dtype, or ``kv_dtype`` for uint8 storage) gets
    them quantized with ``k_scale`` / ``v_scale`` (module docstring). Every
    array may be a view whose innermost dim is contiguous. ``k_cache`` may be
    a layer of the page manager, ``cache.layer(i)`` (its caches and storage
    options), v_cache then left out.

    ``rope`` (a ``Rotary``: cos, sin tables and optionally the queries q
    [queries, Hq, D]): RoPE fused into the same launch, K rotated by each
    query's position into the cache, q in place (``Rotary``).

    One kernel launch on the plan's stream that reads positions and page ids
    from the plan's device words (so a captured graph replays with positions
    advanced on the device); no allocation and no synchronization. Rejects
    two queries writing one slot (``HostPlan.validate_writes``) and every bad
    input before launching.
    """
    storage = dict(kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    if isinstance(k_cache, KVLayer):
        k_cache, v_cache, storage = layer_operands("k_cache", k_cache, v_cache, "v_cache", storage)
    w = check_append(plan, new_k, new_v, k_cache, v_cache, **storage)
    if rope is not None:
        check_rotary(plan, w, rope)
    host = plan.host
    if host not in _validated:
        host.validate_writes()
        _validated.add(host)
    if host.queries == 0:
        return
    launch_kv_write(
        plan.stream,
        "paged_append",
        w,
        host.queries,
        words=plan.words,
        sequences=host.sequences,
        table_width=host.table_width,
        page_size=host.page_size,
        num_pages=host.pages,
    )


def launch_kv_write(stream: Stream, kernel_name: str, w: KvWrite, tokens: int, **fields: Any) -> None:
    """One launch of ``paged_append`` or ``write_slots`` for a checked write."""
    nk, nv, kc, vc = w.new_k, w.new_v, w.k_cache, w.v_cache
    hkv, d = int(kc.shape[2]), int(kc.shape[3])
    dv = int(vc.shape[3]) if vc is not None else 0
    src_k, dst_k = w.src_k, w.dst_k
    assert src_k is not None, "new_k: a write needs the new rows"
    src_v: tuple[int, ...] = (0, 0, 1)
    dst_v: tuple[int, ...] = (0, 0, 0, 1)
    if vc is not None:
        assert w.src_v is not None and w.dst_v is not None  # check_kv_write: V's strides with v_cache
        src_v, dst_v = w.src_v, w.dst_v
    # All heads of a token one contiguous row in the new rows and the caches: one row of Hkv * D.
    heads = hkv
    rope, q = w.rope, (w.rope.q if w.rope is not None else None)
    if (
        hkv > 1
        and rope is None  # (rotation is per head)
        and src_k[1] == d
        and dst_k[2] == d
        and (vc is None or (src_v[1] == dv and dst_v[2] == dv))
        and not (w.k_scale_stride or w.v_scale_stride)
    ):
        heads, d, dv = 1, hkv * d, hkv * dv
    arrays = [a for a in (nk, nv, kc, vc, q) if a is not None]
    if w.quantize or rope is not None:  # element builds: strides count elements
        isz = nk.itemsize
        src_bytes = [s * isz for s in src_k[:2] + src_v[:2] + w.src_q[:2]] + [
            address(a) for a in (nk, nv, q) if a is not None
        ]
        # the cache's byte offsets of a unit: element strides (fp8: one byte each) and the bases
        dst_bytes = [s * kc.itemsize for s in dst_k[:3] + dst_v[:3]] + [address(a) for a in (kc, vc) if a is not None]
        dst_item = kc.itemsize
        vec = next(
            v
            for v in QUANT_VECS
            if d % v == 0
            and dv % v == 0
            and (rope is None or ((d if rope.side == "k" else dv) // 2) % v == 0)
            and all(x % min(v * isz, 16) == 0 for x in src_bytes)
            and all(x % min(v * dst_item, 16) == 0 for x in dst_bytes)
        )
        units_k, units_v = d // vec, dv // vec
        scale = 1
        defines: dict[str, object] = {"CP_DTYPE": dtypes.token(nk.dtype), "CP_QVEC": vec}
        if w.quantize:
            defines.update(CP_QUANT=1, CP_KV_DTYPE=w.fmt.token)
        if rope is not None:
            defines["CP_ROPE"] = 1
    else:
        esize = kc.itemsize
        unit = unit_bytes(
            d * esize,
            dv * esize,
            *(s * esize for s in src_k[:2] + src_v[:2] + dst_k[:3] + dst_v[:3]),
            *(address(a) for a in arrays),
        )
        scale = esize / unit
        units_k, units_v = int(d * scale), int(dv * scale)
        defines = {"CP_VEC_BYTES": unit}

    def st(x):
        return int(x * scale)

    values = dict(
        new_k=address(nk),
        new_v=address(nv if nv is not None else nk),
        k_cache=address(kc),
        v_cache=address(vc if vc is not None else kc),
        words=0,
        slots=0,
        k_scale=0 if w.k_scale is None else address(w.k_scale),
        v_scale=0 if w.v_scale is None else address(w.v_scale),
        num_slots=0,
        tokens=tokens,
        sequences=0,
        table_width=0,
        page_size=1,
        num_pages=0,
        heads=heads,
        units_k=units_k,
        units_v=units_v,
        src_tok_k=st(src_k[0]),
        src_head_k=st(src_k[1]),
        src_tok_v=st(src_v[0]),
        src_head_v=st(src_v[1]),
        dst_page_k=st(dst_k[0]),
        dst_slot_k=st(dst_k[1]),
        dst_head_k=st(dst_k[2]),
        dst_page_v=st(dst_v[0]),
        dst_slot_v=st(dst_v[1]),
        dst_head_v=st(dst_v[2]),
        k_scale_stride=w.k_scale_stride,
        v_scale_stride=w.v_scale_stride,
        rope_q=0 if q is None else address(q),
        rope_cos=0 if rope is None else address(rope.cos),
        rope_sin=0 if rope is None else address(rope.sin),
        rope_max_pos=0 if rope is None else int(rope.cos.shape[0]),
        rope_v=int(rope is not None and rope.side == "v"),
        rope_q_norm=0 if rope is None or rope.q_norm is None else address(rope.q_norm),
        rope_k_norm=0 if rope is None or rope.k_norm is None else address(rope.k_norm),
        rope_v_norm=0 if rope is None or rope.v_norm is None else address(rope.v_norm),
        rope_q_bias=0 if rope is None or rope.q_bias is None else address(rope.q_bias),
        rope_k_bias=0 if rope is None or rope.k_bias is None else address(rope.k_bias),
        rope_v_bias=0 if rope is None or rope.v_bias is None else address(rope.v_bias),
        rope_eps=0.0 if rope is None else float(rope.eps),
        q_heads=0 if q is None else int(q.shape[1]),
        src_tok_q=w.src_q[0],
        src_head_q=w.src_q[1],
    )
    refs = arrays + [a for a in (w.k_scale, w.v_scale) if a is not None]
    if rope is not None:
        extra = (rope.cos, rope.sin, rope.q_norm, rope.k_norm, rope.v_norm, rope.q_bias, rope.k_bias, rope.v_bias)
        refs += [a for a in extra if a is not None]
    for k, v in fields.items():
        if k in ("words", "slots"):
            refs.append(v)
            values[k] = address(v)
        else:
            values[k] = v
    arg = StructArg(np.array(tuple(values[n] for n in NAMES), dtype=DTYPE)[()], refs)
    if rope is not None:  # the lanes of a row stride over a token's work items (append.cu, rope_token)
        rot, cop = (units_k, units_v) if rope.side == "k" else (units_v, units_k)
        rot_norm, cop_norm = (rope.k_norm, rope.v_norm) if rope.side == "k" else (rope.v_norm, rope.k_norm)
        per = 1 if rope.q_norm is not None or rot_norm is not None else rot // 2  # items a rotated row
        cper = 1 if cop_norm is not None else cop  # items a copied row
        bx, by = row_block((int(q.shape[1]) if q is not None else 0) * per + hkv * (per + cper), 0)
    else:
        bx, by = row_block(units_k, units_v)
    kernel = get_kernel(kc, "append", kernel_name, defines)
    stream.launch(kernel, (math.ceil(tokens / by),), (bx, by), (arg,))


def copy_pages(stream: Stream, k_cache: Array, v_cache: Array, pairs_dev: Array, num_pairs: int) -> None:
    """One launch of ``copy_pages``: page ``pairs[i, 0]`` of both caches to
    page ``pairs[i, 1]``, in every layer. k_cache [pages, page_size, Hkv, D]
    or layer-major [layers, pages, page_size, Hkv, D] (v_cache alike, its own
    last dim), each page one contiguous block (``checks.dense_pages``); any
    dtype (bytes are copied). pairs_dev: uint32 [num_pairs, 2] on the caches'
    device, written in stream order. The checked public form is
    ``cupaged.copy_pages``. No allocation, no synchronization."""
    if num_pairs == 0:
        return
    layers, pages = (1, int(k_cache.shape[0])) if k_cache.ndim == 4 else (int(k_cache.shape[0]), int(k_cache.shape[1]))
    esize = k_cache.itemsize
    page_k = int(np.prod(k_cache.shape[-3:])) * esize
    page_v = int(np.prod(v_cache.shape[-3:])) * esize
    pstride = [int(c.strides[-4]) if int(c.shape[-4]) > 1 else 0 for c in (k_cache, v_cache)]
    lstride = [int(c.strides[0]) if c.ndim == 5 and int(c.shape[0]) > 1 else 0 for c in (k_cache, v_cache)]
    w = unit_bytes(page_k, page_v, address(k_cache), address(v_cache), *pstride, *lstride)
    units = (page_k + page_v) // w
    chunks = max(1, min(_MAX_GRID_Y, math.ceil(units / (2 * _BLOCK_THREADS))))
    kernel = get_kernel(k_cache, "append", "copy_pages", {"CP_VEC_BYTES": w})
    u64 = np.uint64
    stream.launch(
        kernel,
        (num_pairs, chunks, min(layers, _MAX_GRID_Y)),
        (_BLOCK_THREADS,),
        (
            k_cache,
            v_cache,
            pairs_dev,
            np.uint32(num_pairs),
            np.uint32(pages),
            np.uint32(layers),
            np.uint32(page_k // w),
            np.uint32(page_v // w),
            u64(pstride[0] // w),
            u64(pstride[1] // w),
            u64(lstride[0] // w),
            u64(lstride[1] // w),
        ),
    )


#: Units (K and V together) a lane of a row-copy launch copies at most, with 32 to 128 lanes a row: on the GPU
#: several loads in flight a lane; on the CPU backend fewer threads (each a fiber) for the same bytes. Measured on
#: 2 cores (one worker, SmolLM2's rows: 3 KV heads x 64 f32, 96 16-byte units a token), a 256-token append:
#: 2 units a lane (64 lanes) 0.62 ms, 4 (32 lanes) 0.39 ms.
ROW_UNITS_PER_LANE = 4


def row_block(units_k: int, units_v: int) -> tuple[int, int]:
    """(bx, by) of a row-copy launch (paged_append, write_slots): enough lanes
    per row for ROW_UNITS_PER_LANE units each; rows per block fill 256
    threads."""
    bx = min(128, max(32, 32 * math.ceil((units_k + units_v) / ROW_UNITS_PER_LANE / 32)))
    return bx, max(1, _BLOCK_THREADS // bx)


def launch_write_slots(
    stream: Stream,
    new_k: Array,
    new_v: Array | None,
    k_cache: Array,
    v_cache: Array | None,
    slots_dev: Array,
    tokens: int,
    *,
    kv_dtype: object = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
) -> None:
    """One launch of ``write_slots`` (checked public form:
    ``cupaged.write_slots``): row t of new_k / new_v to slot slots_dev[t]
    (int64) of the [pages, page_size, Hkv, D] caches; slots outside
    0 .. pages * page_size - 1 are skipped on the device."""
    if tokens == 0:
        return
    w = check_kv_write(
        new_k, new_v, k_cache, v_cache, None, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, ref="k_cache"
    )
    launch_kv_write(
        stream,
        "write_slots",
        w,
        tokens,
        slots=slots_dev,
        page_size=int(k_cache.shape[1]),
        num_slots=int(k_cache.shape[0]) * int(k_cache.shape[1]),
    )
