"""The attention launch: one launch per segment of the step, then the split
merge. Arguments arrive checked (``checks.py``); nothing here allocates,
synchronizes or reads device data on the host.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ... import dtypes
from ..._runtime import address, device_arch, get_kernel
from ...errors import PagedAttentionError
from . import params
from ..._runtime import checks
from .checks import AttentionOptions, CacheRead
from .schedule import plan_launches
from .variants import MERGE, MERGE_HEADS_PER_BLOCK, ROT_CAPS, THREADS, VECTOR_BYTES, merge_defines

#: log2(e): the kernels' scores are in the log2 domain (softmax_state.cuh).
LOG2E = 1.0 / math.log(2.0)


def cache_strides(name: str, cache) -> dict:
    """The page / slot / head element strides of a [pages, page_size,
    heads, dim] cache view (``checks.row_view``: 0 for a dim of size 1), as
    AttentionParams fields ``{name}_stride_*``."""
    page, slot, head, _ = checks.row_view(name, cache)
    return {f"{name}_stride_page": page, f"{name}_stride_slot": slot, f"{name}_stride_head": head}


def contiguous(a) -> bool:
    """``a`` is laid out C-contiguously (dims of size 1 ignored)."""
    step = int(a.itemsize)
    for n, s in reversed(list(zip(a.shape, a.strides))):
        if int(n) > 1 and int(s) != step:
            return False
        step *= int(n)
    return True


def same_view(a, b) -> bool:
    """``a`` and ``b`` are one view (address, shape and strides)."""
    return (address(a) == address(b) and tuple(a.shape) == tuple(b.shape) and tuple(a.strides) == tuple(b.strides)
            and a.itemsize == b.itemsize)


def launches_for(plan, q, k_cache, v_cache, out, opts: AttentionOptions, *, q_rot=None, k_rot=None,
                 read: CacheRead | None = None):
    """The launches (``schedule.Launch``, one per segment) that
    ``launch_attention`` issues for these arrays: the variant is chosen from
    dtypes, dims, alignment (every base address and every stride of a dim
    longer than 1 a multiple of 16 bytes: 16-byte loads / cp.async), whether
    a cache view is strided (not C-contiguous: STRIDED_KERNELS only) and
    whether V is the K cache (MLA), for the device's arch."""
    hq, d = int(q.shape[1]), int(q.shape[2])
    hkv, dv = int(k_cache.shape[2]), int(v_cache.shape[3])
    rot_dim = 0 if q_rot is None else int(q_rot.shape[2])
    dtype = dtypes.token(q.dtype)
    kv_dtype = read.kv_dtype if read is not None else dtypes.token(k_cache.dtype)
    aligned = all(checks.aligned(a, VECTOR_BYTES) for a in (q, k_cache, v_cache, out))
    aligned_tc = aligned and (not rot_dim or all(checks.aligned(a, VECTOR_BYTES) for a in (q_rot, k_rot)))
    strided = not all(contiguous(a) for a in (k_cache, v_cache, k_rot) if a is not None)
    return plan_launches(plan.host, dtype, hq, hkv, d, dv, rot_dim, aligned, aligned_tc, opts.score,
                         arch=device_arch(q), features=opts.features, kv_dtype=kv_dtype, strided=strided,
                         latent=same_view(k_cache, v_cache))


def launch_attention(stream, plan, q, k_cache, v_cache, out, opts: AttentionOptions, *,
                     q_rot=None, k_rot=None, lse=None, workspace=None, read: CacheRead | None = None) -> None:
    """Launch paged attention for ``plan`` (arguments already validated;
    ``opts``: scale, causal, score variant and its features (soft cap,
    window, sinks, ALiBi slopes), ``AttentionOptions.checked``).

    q [queries, Hq, D]; k_cache [pages, page_size, Hkv, D];
    v_cache [pages, page_size, Hkv, Dv]; out [queries, Hq, Dv] (q's dtype);
    lse float32 [queries, Hq] or None; workspace: None, or an object with
    ``splits``, ``partial_out`` float32 [splits, queries, Hq, Dv] and
    ``partial_lse`` float32 [splits, queries, Hq] (splits > 1 launches the
    split kernel, then the merge).

    q_rot [queries, Hq, P] and k_rot [pages, page_size, 1, P]: the MLA
    rotary parts (both or neither); score = scale * (q.k + q_rot.k_rot).
    With them the caches must be one array (the latent cache, Hkv = 1,
    v_cache is k_cache) and P <= 256.

    ``read``: the caches' format and dequantization scales
    (``checks.CacheRead``; None: the caches have q's dtype, no scales).
    Caches may be any views whose innermost dim is contiguous: their
    strides travel in AttentionParams. For MLA (v_cache is k_cache)
    ``read.k_scale`` scales the latent (K and V) and ``read.v_scale``
    k_rot.

    Every attention launch takes one ``AttentionParams`` struct
    (``params.py``); only its query range differs between the launches of a
    step.
    """
    host = plan.host
    queries, hq, d = (int(s) for s in q.shape)
    hkv, dv = int(k_cache.shape[2]), int(v_cache.shape[3])
    rot_dim = 0
    if q_rot is not None or k_rot is not None:
        if q_rot is None or k_rot is None:
            raise PagedAttentionError("q_rot, k_rot: expected both or neither")
        rot_dim = int(q_rot.shape[2])
        if rot_dim > ROT_CAPS[-1]:
            raise NotImplementedError(f"q_rot: rotary dims up to {ROT_CAPS[-1]} are built, got {rot_dim}")
        if hkv != 1 or dv != d or address(v_cache) != address(k_cache):
            raise NotImplementedError("paged attention with a rotary part needs one KV head and v_cache "
                                      "being the same array as k_cache (the MLA latent cache)")
    if queries == 0:
        return
    latent = same_view(k_cache, v_cache)
    launches = launches_for(plan, q, k_cache, v_cache, out, opts, q_rot=q_rot, k_rot=k_rot, read=read)
    splits = 1 if workspace is None else int(workspace.splits)
    split = splits > 1
    # Every grid of the step (attention launches and the merge) is checked
    # before the first launch: a merge that could not launch must not find
    # the split kernels' partials already written.
    tiles = max(launch.tiles for launch in launches)
    if hkv * tiles > 65535:
        raise PagedAttentionError(f"q: expected at most 65535 KV heads x head tiles in a launch, got "
                                  f"{hkv} x {tiles}")
    if queries > 2 ** 31 - 1:
        raise PagedAttentionError(f"q: expected at most {2 ** 31 - 1} queries in a launch, got {queries}")
    for launch in launches:
        gx, gy, _ = launch.grid(hkv, splits)
        if gx > 2 ** 31 - 1 or gy > 65535:
            raise PagedAttentionError(f"q: {launch.kernel}'s grid ({gx}, {gy}) exceeds (2^31 - 1, 65535) for "
                                      f"{queries} queries and {hq} query heads")
    if split and -(-hq // MERGE_HEADS_PER_BLOCK) > 65535:
        raise PagedAttentionError(f"q: expected at most {65535 * MERGE_HEADS_PER_BLOCK} query heads for the "
                                  f"split merge, got {hq}")
    k_scale = v_scale = None
    k_scale_stride = v_scale_stride = 0
    if read is not None:
        k_scale, k_scale_stride = read.k_scale, read.k_scale_stride
        v_scale, v_scale_stride = read.v_scale, read.v_scale_stride
        if latent and not rot_dim:   # MLA without a rotary part: V is the latent, scaled as K
            v_scale, v_scale_stride = k_scale, k_scale_stride
    rot_strides = (0, 0) if k_rot is None else checks.row_view("k_rot", k_rot)[:2]   # page, slot (one head)
    refs = [a for a in (q, k_cache, v_cache, q_rot, k_rot, plan.words, out, lse, opts.sinks, opts.alibi_slopes,
                        k_scale, v_scale) if a is not None]
    if split:
        refs += [workspace.partial_out, workspace.partial_lse]
    # Pointers a launch never reads are 0 (no rotary part, no lse, no split).
    values = dict(
        q=address(q), k_cache=address(k_cache), v_cache=address(v_cache),
        q_rot=0 if q_rot is None else address(q_rot), k_rot=0 if k_rot is None else address(k_rot),
        words=address(plan.words), out=address(out), lse=0 if lse is None else address(lse),
        part_out=address(workspace.partial_out) if split else 0,
        part_lse=address(workspace.partial_lse) if split else 0,
        queries=host.queries, q_begin=0, q_count=0, sequences=host.sequences, table_width=host.table_width,
        page_size=host.page_size, num_pages=host.pages, q_heads=hq, kv_heads=hkv, head_dim=d, value_dim=dv,
        rot_dim=rot_dim, splits=splits, causal=int(opts.causal), write_lse=int(lse is not None),
        scale=opts.scale,
        # the score group (variant.cuh): 0 where the feature is off
        soft_cap=0.0 if opts.soft_cap is None else opts.soft_cap * LOG2E,
        inv_soft_cap=0.0 if opts.soft_cap is None else 1.0 / (opts.soft_cap * LOG2E),
        window=0 if opts.window is None else opts.window,
        sinks=0 if opts.sinks is None else address(opts.sinks),
        alibi_slopes=0 if opts.alibi_slopes is None else address(opts.alibi_slopes),
        **cache_strides("k", k_cache), **cache_strides("v", v_cache),
        rot_stride_page=rot_strides[0], rot_stride_slot=rot_strides[1],
        k_scale=0 if k_scale is None else address(k_scale), v_scale=0 if v_scale is None else address(v_scale),
        k_scale_stride=k_scale_stride, v_scale_stride=v_scale_stride)

    kernels = [get_kernel(q, launch.source, launch.kernel, launch.defines) for launch in launches]
    merge = (get_kernel(q, MERGE.source, MERGE.name, merge_defines(dtypes.token(q.dtype), opts.sinks is not None))
             if split else None)
    # A workspace is held from the first split kernel to the merge: threads
    # sharing one run one step after the other (on the GPU, also in stream order).
    with workspace.lock if split else contextlib.nullcontext():
        for launch, kernel in zip(launches, kernels):
            values["q_begin"], values["q_count"] = launch.q_begin, launch.q_count
            args = params.pack(values, refs)
            stream.launch(kernel, launch.grid(hkv, splits), (launch.threads,), (args,), shared_mem=launch.smem)
        if split:
            u32 = np.uint32
            stream.launch(merge, (queries, -(-hq // MERGE_HEADS_PER_BLOCK)), (THREADS,), (
                workspace.partial_out, workspace.partial_lse, out, out if lse is None else lse,
                u32(queries), u32(hq), u32(dv), u32(splits), u32(lse is not None),
                opts.sinks if opts.sinks is not None else np.uint64(0)))
