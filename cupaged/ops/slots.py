"""Engine-level cache kernels for engines that keep their own block tables
(``kernels_cu/append.cu``), with vLLM's semantics:

* ``write_slots(new_k, new_v, k_cache, v_cache, slot_mapping)``: vLLM's
  ``reshape_and_cache`` on cupaged's [pages, page_size, Hkv, D] layout
  (vLLM's ``reshape_and_cache_flash`` layout): token t's row goes to slot
  ``slot_mapping[t] = page * page_size + offset``; -1 skips the token.
* ``copy_pages(k_cache, v_cache, src, dst)``: vLLM's ``copy_blocks``: page
  ``src[i]`` to page ``dst[i]`` in K and V, every layer of layer-major 5-D
  caches in one launch.

Both run one launch on the caches' stream and check every input before
launching (PagedAttentionError naming the argument; nothing is written after
a failed check). ``copy_pages`` moves raw bytes (bit-exact for every dtype,
fp8 included); ``write_slots`` copies rows bit for bit into a cache of their
dtype and quantizes them into an fp8 one.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .._runtime import GPU, array_backend, backend_of, check_not_capturing, checks, empty, stream_for
from ..errors import PagedAttentionError
from .append import check_kv_write, launch_kv_write
from .append import copy_pages as launch_copy_pages


def _caches(k_cache, v_cache, ranks) -> None:
    """copy_pages' caches: NumPy or CuPy arrays of one K/V dtype (or raw
    uint8 fp8 storage), each page a contiguous block (any page and layer
    strides), all but the last dim alike."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if array_backend(c) is None:
            raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(c).__name__}")
        if c.ndim not in ranks:
            want = " or ".join(f"{r}-D" for r in ranks)
            raise PagedAttentionError(f"{name}: expected a {want} array, got shape {checks.shape_str(c.shape)}")
        if str(c.dtype) != "uint8":
            dtypes.kv_storage(name, c.dtype)
        checks.row_view(name, c)
        checks.dense_pages(name, c)
        checks.u32_size(name, c.shape[-3:])
    checks.same_dtype("k_cache", k_cache, v_cache=v_cache)
    if v_cache.ndim != k_cache.ndim or tuple(v_cache.shape[:-1]) != tuple(k_cache.shape[:-1]):
        raise PagedAttentionError(
            f"v_cache: expected shape [{', '.join(str(x) for x in k_cache.shape[:-1])}, Dv] like k_cache, got "
            f"{checks.shape_str(v_cache.shape)}"
        )
    checks.no_overlap("k_cache", k_cache, v_cache=v_cache)


def check_slot_mapping(slots: np.ndarray, num_slots: int, name: str = "slot_mapping") -> None:
    """Host slot values: each -1 (skip) or in 0 .. num_slots - 1, no slot twice."""
    bad = (slots < -1) | (slots >= num_slots)
    if bad.any():
        t = int(np.argmax(bad))
        raise PagedAttentionError(
            f"{name}[{t}]: expected -1 (skip) or a slot in 0..{num_slots - 1} (pages x page_size), got {int(slots[t])}"
        )
    used = slots[slots >= 0]
    uniq, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        slot = int(uniq[counts > 1][0])
        who = np.nonzero(slots == slot)[0][:2]
        raise PagedAttentionError(
            f"{name}: tokens {who[0]} and {who[1]} both write slot {slot}; expected each slot at most once"
        )


def write_slots(
    new_k, new_v, k_cache, v_cache, slot_mapping, *, validate: bool = False, kv_dtype=None, k_scale=None, v_scale=None
) -> None:
    """Write new_k [tokens, Hkv, D] and new_v [tokens, Hkv, Dv] into
    k_cache [pages, page_size, Hkv, D] and v_cache [pages, page_size, Hkv, Dv]
    (one layer, e.g. ``cache.k[layer]``) at ``slot_mapping`` int64 [tokens]:
    token t goes to page ``slot // page_size``, offset ``slot % page_size``;
    -1 skips it (a padded token). One launch.

    Caches of the new rows' dtype get them bit for bit; an fp8 cache (its
    dtype, or ``kv_dtype`` ``"e4m3"`` / ``"e5m2"`` for uint8 storage, as
    vLLM's ``kv_cache_dtype``) gets ``code(x / scale)`` with ``k_scale`` /
    ``v_scale`` (float32 on the caches' device, one or one per KV head; 1
    when None): nearest, ties to even, saturating; NaN stays NaN. Caches and
    new rows may be any views whose innermost dim is contiguous (HND, the
    K / V halves of a combined [pages, 2, page_size, Hkv, D] tensor, slices
    of a fused qkv output).

    A host ``slot_mapping`` (NumPy) is checked in full before the launch
    (every slot -1 or inside the cache, no slot twice) and, for CuPy caches,
    uploaded in stream order. A device ``slot_mapping`` (CuPy int64, e.g. a
    persistent buffer a captured graph reads) is used as is: only its dtype
    and shape are checked, and the kernel skips any slot outside the cache;
    ``validate=True`` reads it back (a synchronization) for the full checks.
    """
    if new_v is None or v_cache is None:
        raise PagedAttentionError("new_v, v_cache: expected arrays (write_slots writes K and V)")
    w = check_kv_write(
        new_k, new_v, k_cache, v_cache, None, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, ref="k_cache"
    )
    tokens = int(new_k.shape[0])
    num_slots = int(k_cache.shape[0]) * int(k_cache.shape[1])
    stream = stream_for(k_cache)
    device_map = array_backend(slot_mapping) == GPU
    if device_map:
        backend_of(k_cache=k_cache, slot_mapping=slot_mapping)
        if str(slot_mapping.dtype) != "int64" or slot_mapping.ndim != 1 or not slot_mapping.flags.c_contiguous:
            raise PagedAttentionError(
                f"slot_mapping: expected a contiguous int64 [tokens] array, got "
                f"{slot_mapping.dtype} {checks.shape_str(slot_mapping.shape)}"
            )
        checks.shape_is("slot_mapping", slot_mapping, (tokens,))
        if validate:
            check_slot_mapping(stream.read(slot_mapping), num_slots)
        slots_dev = slot_mapping
    else:
        host = checks.host_int_array("slot_mapping", slot_mapping, 1)
        checks.shape_is("slot_mapping", host, (tokens,))
        check_slot_mapping(host, num_slots)
        if array_backend(k_cache) == GPU:
            check_not_capturing(stream, "write_slots (a host slot_mapping is uploaded)")
            slots_dev = empty(k_cache, (tokens,), np.int64)
            stream.copy_from_host(slots_dev, host)
        else:
            slots_dev = np.ascontiguousarray(host, np.int64)
    if tokens:
        launch_kv_write(
            stream, "write_slots", w, tokens, slots=slots_dev, page_size=int(k_cache.shape[1]), num_slots=num_slots
        )


def copy_pages(k_cache, v_cache, src, dst) -> None:
    """Copy page ``src[i]`` to page ``dst[i]`` (host int sequences of one
    length) in k_cache and v_cache: [pages, page_size, Hkv, D] caches, or
    layer-major [layers, pages, page_size, Hkv, D] ones (``PagedKVCache.k`` /
    ``.v``), where every layer is copied in the same one launch. A source may
    go to several destinations; destinations must be distinct and none may be
    a source (one launch copies them all at once). Bit-exact; no
    synchronization."""
    _caches(k_cache, v_cache, (4, 5))
    pages = int(k_cache.shape[-4])
    s = checks.host_int_array("src", src, 1)
    d = checks.host_int_array("dst", dst, 1)
    checks.shape_is("dst", d, s.shape)
    for name, a in (("src", s), ("dst", d)):
        bad = (a < 0) | (a >= pages)
        if bad.any():
            i = int(np.argmax(bad))
            raise PagedAttentionError(f"{name}[{i}]: expected a page id in 0..{pages - 1}, got {int(a[i])}")
    uniq, counts = np.unique(d, return_counts=True)
    if (counts > 1).any():
        page = int(uniq[counts > 1][0])
        who = np.nonzero(d == page)[0][:2]
        raise PagedAttentionError(
            f"dst: entries {who[0]} and {who[1]} both name page {page}; expected distinct destinations"
        )
    both = np.isin(d, s)
    if both.any():
        i = int(np.argmax(both))
        raise PagedAttentionError(
            f"dst[{i}]: page {int(d[i])} is also a source; expected destinations "
            f"that are not copied from in the same call"
        )
    n = int(s.shape[0])
    if n == 0:
        return
    pairs = np.stack([s, d], axis=1).astype(np.uint32)
    stream = stream_for(k_cache)
    if array_backend(k_cache) == GPU:
        check_not_capturing(stream, "copy_pages (its page list is uploaded)")
        pairs_dev = empty(k_cache, pairs.shape, np.uint32)
        stream.copy_from_host(pairs_dev, pairs)
    else:
        pairs_dev = pairs
    launch_copy_pages(stream, k_cache, v_cache, pairs_dev, n)
