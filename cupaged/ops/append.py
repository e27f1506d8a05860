"""Writing new K/V rows into paged caches, and copying pages
(``kernels_cu/append.cu``).

``append(plan, new_k, new_v, k_cache, v_cache)`` writes each packed query's
new key/value row into the slot of its absolute position (one launch of
``paged_append``); ``copy_pages`` copies whole pages of both caches in every
layer (one launch of ``copy_pages``), for copy-on-write;
``launch_write_slots`` writes rows by an explicit slot mapping. The checked
engine-level forms of the last two are ``cupaged.ops.slots``. Layout:
``docs/layout.md``.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from .._runtime import address, checks, get_kernel, register
from ..errors import PagedAttentionError

#: Copy units the kernels are compiled for (bytes); the host picks the widest
#: that divides every row size and base address.
UNIT_BYTES = (16, 8, 4, 2)

register("append", [{"CP_VEC_BYTES": w} for w in UNIT_BYTES])

_BLOCK_THREADS = 256
_MAX_GRID_Y = 65535

# HostPlans whose writes were validated already (a plan is reused by every
# layer of a step; validate_writes sorts its slots, so do it once per plan).
_validated: weakref.WeakSet = weakref.WeakSet()


def unit_bytes(*values: int) -> int:
    """The widest copy unit in UNIT_BYTES dividing every value (row or page
    sizes in bytes, base addresses). Element sizes are >= 2, so 2 always fits
    arrays of our dtypes."""
    for w in UNIT_BYTES:
        if all(int(v) % w == 0 for v in values):
            return w
    raise PagedAttentionError(f"expected sizes and addresses that are multiples of 2 bytes, got {values}")


def check_append(plan, new_k, new_v, k_cache, v_cache) -> None:
    """Every input check of ``append`` (raises PagedAttentionError naming the
    argument; launches and writes nothing)."""
    if not (hasattr(plan, "host") and hasattr(plan, "words") and hasattr(plan, "stream")):
        raise PagedAttentionError(f"plan: expected a DevicePlan (HostPlan.upload), got {type(plan).__name__}")
    checks.plan_arrays(plan, new_k=new_k, new_v=new_v, k_cache=k_cache, v_cache=v_cache)
    checks.float_array("new_k", new_k, 3)
    checks.float_array("new_v", new_v, 3)
    checks.plan_cache(plan, "k_cache", k_cache)
    checks.plan_cache(plan, "v_cache", v_cache)
    checks.same_dtype("new_k", new_k, new_v=new_v, k_cache=k_cache, v_cache=v_cache)
    hkv, d, dv = int(k_cache.shape[2]), int(k_cache.shape[3]), int(v_cache.shape[3])
    checks.v_like_k(k_cache, v_cache)
    if hkv < 1 or d < 1 or dv < 1:
        raise PagedAttentionError(
            f"k_cache, v_cache: expected Hkv, D and Dv >= 1, got shapes {checks.shape_str(k_cache.shape)} and "
            f"{checks.shape_str(v_cache.shape)}")
    checks.shape_is("new_k", new_k, (plan.host.queries, hkv, d))
    checks.shape_is("new_v", new_v, (plan.host.queries, hkv, dv))
    checks.no_overlap("k_cache", k_cache, v_cache=v_cache)
    for name, a in (("new_k", new_k), ("new_v", new_v)):
        checks.no_overlap(name, a, k_cache=k_cache, v_cache=v_cache)


def append(plan, new_k, new_v, k_cache, v_cache) -> None:
    """Write new keys and values into the paged caches, in place.

    new_k [queries, Hkv, D], new_v [queries, Hkv, Dv]: one row per packed
    query of ``plan`` (all arrays one dtype: float32, float16 or bfloat16).
    k_cache [pages, page_size, Hkv, D], v_cache [pages, page_size, Hkv, Dv]:
    the row of the query at absolute position p of sequence s goes to page
    ``page_table[s, p // page_size]``, offset ``p % page_size``. MLA caches
    work the same way: Hkv = 1, k_cache = latent [pages, page_size, 1, R],
    v_cache = k_pos [pages, page_size, 1, P], new_k [queries, 1, R],
    new_v [queries, 1, P].

    Rows are copied bit for bit. One kernel launch on the plan's stream that
    reads positions and page ids from the plan's device words (so a captured
    graph replays with positions advanced on the device); no allocation and
    no synchronization. Rejects two queries writing one slot
    (``HostPlan.validate_writes``) and every bad input before launching.
    """
    check_append(plan, new_k, new_v, k_cache, v_cache)
    host = plan.host
    if host not in _validated:
        host.validate_writes()
        _validated.add(host)
    if host.queries == 0:
        return
    esize = k_cache.itemsize
    hkv, d, dv = int(k_cache.shape[2]), int(k_cache.shape[3]), int(v_cache.shape[3])
    row_k, row_v = hkv * d * esize, hkv * dv * esize
    w = unit_bytes(row_k, row_v, *(address(a) for a in (new_k, new_v, k_cache, v_cache)))
    units_k, units_v = row_k // w, row_v // w
    bx, by = row_block(units_k, units_v)
    kernel = get_kernel(new_k, "append", "paged_append", {"CP_VEC_BYTES": w})
    plan.stream.launch(kernel, (math.ceil(host.queries / by),), (bx, by),
                       (new_k, new_v, k_cache, v_cache, plan.words, np.uint32(host.queries),
                        np.uint32(host.sequences), np.uint32(host.table_width), np.uint32(host.page_size),
                        np.uint32(host.pages), np.uint32(units_k), np.uint32(units_v)))


def copy_pages(stream, k_cache, v_cache, pairs_dev, num_pairs: int) -> None:
    """One launch of ``copy_pages``: page ``pairs[i, 0]`` of both caches to
    page ``pairs[i, 1]``, in every layer. k_cache [pages, page_size, Hkv, D]
    or layer-major [layers, pages, page_size, Hkv, D] (v_cache alike, its own
    last dim); pairs_dev: uint32 [num_pairs, 2] on the caches' device, written
    in stream order. The checked public form is ``cupaged.copy_pages``. No
    allocation, no synchronization."""
    if num_pairs == 0:
        return
    layers, pages = (1, int(k_cache.shape[0])) if k_cache.ndim == 4 else (int(k_cache.shape[0]),
                                                                           int(k_cache.shape[1]))
    esize = k_cache.itemsize
    page_k = int(np.prod(k_cache.shape[-3:])) * esize
    page_v = int(np.prod(v_cache.shape[-3:])) * esize
    w = unit_bytes(page_k, page_v, address(k_cache), address(v_cache))
    units = (page_k + page_v) // w
    chunks = max(1, min(_MAX_GRID_Y, math.ceil(units / (2 * _BLOCK_THREADS))))
    kernel = get_kernel(k_cache, "append", "copy_pages", {"CP_VEC_BYTES": w})
    stream.launch(kernel, (num_pairs, chunks, min(layers, _MAX_GRID_Y)), (_BLOCK_THREADS,),
                  (k_cache, v_cache, pairs_dev, np.uint32(num_pairs), np.uint32(pages), np.uint32(layers),
                   np.uint32(page_k // w), np.uint32(page_v // w)))


def row_block(units_k: int, units_v: int) -> tuple[int, int]:
    """(bx, by) of a row-copy launch (paged_append, write_slots): enough lanes
    per row for two units each; rows per block fill 256 threads."""
    bx = min(128, max(32, 32 * math.ceil((units_k + units_v) / 64)))
    return bx, max(1, _BLOCK_THREADS // bx)


def launch_write_slots(stream, new_k, new_v, k_cache, v_cache, slots_dev, tokens: int) -> None:
    """One launch of ``write_slots`` (checked public form:
    ``cupaged.write_slots``): row t of new_k / new_v to slot slots_dev[t]
    (int64) of the [pages, page_size, Hkv, D] caches; slots outside
    0 .. pages * page_size - 1 are skipped on the device."""
    if tokens == 0:
        return
    esize = k_cache.itemsize
    row_k = int(np.prod(k_cache.shape[2:])) * esize
    row_v = int(np.prod(v_cache.shape[2:])) * esize
    w = unit_bytes(row_k, row_v, *(address(a) for a in (new_k, new_v, k_cache, v_cache)))
    units_k, units_v = row_k // w, row_v // w
    bx, by = row_block(units_k, units_v)
    kernel = get_kernel(new_k, "append", "write_slots", {"CP_VEC_BYTES": w})
    stream.launch(kernel, (math.ceil(tokens / by),), (bx, by),
                  (new_k, new_v, k_cache, v_cache, slots_dev, np.uint32(tokens),
                   np.uint64(int(k_cache.shape[0]) * int(k_cache.shape[1])), np.uint32(units_k),
                   np.uint32(units_v)))
