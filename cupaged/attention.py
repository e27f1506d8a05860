"""Paged attention launches (``kernels_cu/attention.cu``): decode and chunked
prefill over a paged K/V cache, optionally split over the visible history
with a merge. Layout, positions, metadata words and LSE: ``docs/layout.md``.

``launch_attention`` is the launch layer under ``DevicePlan.attention``: its
arguments are already checked; it picks a compiled variant and issues one
launch (two with a split workspace). It allocates nothing, never
synchronizes and never reads device data on the host: grid and arguments
depend only on shapes, the plan's static sizes and array addresses, so it
is safe inside stream capture and a captured graph replays with whatever
lengths the device metadata holds.

Kernel design (details in the ``.cu`` file): one 128-thread block per
(query, KV head, tile of query heads of that KV head's group, split); a
tile serves up to ``GROUP_TILE`` query heads, so every K/V row is read once
per group when the group fits one tile (``Hq / Hkv <= 8`` on the fast
paths). Each warp owns a slice of the tokens of every block step and loads
several K and V rows before using them (16-byte loads where the dims and
addresses allow), keeping an online softmax per row group in FP32.

Memory traffic per (query, KV head, tile): read the visible K and V rows,
``L * (D + Dv) * itemsize`` bytes; write ``G * Dv`` outputs. With a
workspace of ``S > 1`` splits the partials add ``S * G * (Dv + 1) * 4``
bytes written and read again by the merge.
"""
from __future__ import annotations

import numpy as np

from . import _backend, _checks, _registry
from .errors import PagedAttentionError

#: Most splits of the visible history (``SplitWorkspace.splits``).
MAX_SPLITS = 64
#: Split chunks are rounded up to a multiple of this many positions
#: (docs/layout.md, "the kernel's token tile").
SPLIT_TILE = 16
#: Threads per block of both kernels.
THREADS = 128
#: Query heads of one GQA group the merge kernel serves per block (one warp each).
MERGE_HEADS_PER_BLOCK = THREADS // 32

DTYPES = ("f32", "f16", "bf16")
#: Compile-time head dims (D == Dv) with 16-byte loads.
FAST_DIMS = (64, 128, 256)
#: Capacities of the runtime-dim variants (max(D, Dv) <= capacity).
DIM_CAPS = (64, 128, 256, 512, 1024)
#: Query heads per block a variant may be built for.
GROUP_TILES = (1, 2, 4, 8)
#: Capacities of the MLA rotary part P (q_rot / k_rot), HAS_ROT variants.
ROT_CAPS = (64, 256)
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
_VECTOR_BYTES = 16


def _elems_per_lane(cap: int, vec: int) -> int:
    """Row elements one lane holds (mirrors att::kElems in attention.cu)."""
    chunks = cap // vec
    return vec if chunks <= 32 else cap // 32


def _rot_elems_per_lane(cap: int, vec: int, rot_cap: int) -> int:
    """Rotary elements one lane holds (mirrors att::kRotElems)."""
    lanes = min(32, cap // vec)
    return -(-rot_cap // lanes) if rot_cap else 0


def max_group_tile(cap: int, vec: int, rot_cap: int = 0) -> int:
    """Largest GROUP_TILE built for a row capacity, chunk width and rotary
    capacity. Bounds the per-lane registers that grow with the tile (tile x
    (row + rotary elements per lane) <= 64, for q and again for the
    accumulator) and the shared memory of the final merge (4 warps x tile x
    cap floats <= 32 KiB)."""
    per_head = _elems_per_lane(cap, vec) + _rot_elems_per_lane(cap, vec, rot_cap)
    limit = min(64 // per_head, 2048 // cap, GROUP_TILES[-1])
    return max([1] + [t for t in GROUP_TILES if t <= limit])


def _vec(dtype: str, vec_loads: bool) -> int:
    return _VECTOR_BYTES // _ITEMSIZE[dtype] if vec_loads else 1


def _all_variants() -> list[dict]:
    out = []
    for dt in DTYPES:
        for d in FAST_DIMS:
            for t in GROUP_TILES:
                if t <= max_group_tile(d, _vec(dt, True)):
                    out.append({"CP_DTYPE": dt, "HEAD_DIM": d, "GROUP_TILE": t})
        for cap in DIM_CAPS:
            for vec_loads in (0, 1):
                for t in GROUP_TILES:
                    if t <= max_group_tile(cap, _vec(dt, bool(vec_loads))):
                        out.append({"CP_DTYPE": dt, "DIM_CAP": cap, "VEC_LOADS": vec_loads, "GROUP_TILE": t})
                # MLA (rotary part): one shared KV head, so the group is every
                # query head and only the largest tile is worth building.
                for rot in ROT_CAPS:
                    out.append({"CP_DTYPE": dt, "DIM_CAP": cap, "VEC_LOADS": vec_loads, "ROT_CAP": rot,
                                "GROUP_TILE": max_group_tile(cap, _vec(dt, bool(vec_loads)), rot)})
    return out


VARIANTS = _all_variants()
_registry.register("attention", VARIANTS)


def _addr(a) -> int:
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def _group_tile(group: int, top: int) -> int:
    """Query heads per block for a GQA group of ``group`` heads when tiles of
    up to ``top`` heads are built: as few tiles as possible (each tile
    re-reads the K/V rows), then the smallest built tile that covers
    ``ceil(group / tiles)`` heads."""
    tiles = -(-group // top)
    need = -(-group // tiles)
    return min(t for t in GROUP_TILES if t >= need and t <= top)


def select_variant(dtype: str, head_dim: int, value_dim: int, aligned: bool, group: int,
                   rot_dim: int = 0) -> dict:
    """Defines of the variant that runs (dtype, D, Dv, GQA group size, rotary dim P).

    ``aligned``: every array the kernel reads or writes with 16-byte loads
    (q, k_cache, v_cache, out) starts on a 16-byte boundary.
    """
    itemsize = _ITEMSIZE[dtype]
    vec_ok = aligned and (head_dim * itemsize) % _VECTOR_BYTES == 0 and (value_dim * itemsize) % _VECTOR_BYTES == 0
    if not rot_dim and vec_ok and head_dim == value_dim and head_dim in FAST_DIMS:
        top = max_group_tile(head_dim, _vec(dtype, True))
        return {"CP_DTYPE": dtype, "HEAD_DIM": head_dim, "GROUP_TILE": _group_tile(group, top)}
    cap = next(c for c in DIM_CAPS if c >= max(head_dim, value_dim))
    vec = _vec(dtype, vec_ok)
    if rot_dim:
        rot = next(r for r in ROT_CAPS if r >= rot_dim)
        return {"CP_DTYPE": dtype, "DIM_CAP": cap, "VEC_LOADS": int(vec_ok), "ROT_CAP": rot,
                "GROUP_TILE": max_group_tile(cap, vec, rot)}
    return {"CP_DTYPE": dtype, "DIM_CAP": cap, "VEC_LOADS": int(vec_ok),
            "GROUP_TILE": _group_tile(group, max_group_tile(cap, vec))}


def launch_attention(stream, plan, q, k_cache, v_cache, out, scale: float, causal: bool, *,
                     q_rot=None, k_rot=None, lse=None, workspace=None) -> None:
    """Launch paged attention for ``plan`` (arguments already validated).

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
        if hkv != 1 or dv != d or _addr(v_cache) != _addr(k_cache):
            raise NotImplementedError("paged attention with a rotary part needs one KV head and v_cache "
                                      "being the same array as k_cache (the MLA latent cache)")
    if queries == 0:
        return
    group = hq // hkv
    dtype = _checks.dtype_token(q.dtype)
    aligned = all(_addr(a) % _VECTOR_BYTES == 0 for a in (q, k_cache, v_cache, out))
    defines = select_variant(dtype, d, dv, aligned, group, rot_dim)
    tiles = -(-group // int(defines["GROUP_TILE"]))
    if hkv * tiles > 65535:
        raise PagedAttentionError(f"q: expected at most 65535 KV heads x head tiles in a launch, got "
                                  f"{hkv} x {tiles}")
    if queries > 2 ** 31 - 1:
        raise PagedAttentionError(f"q: expected at most {2 ** 31 - 1} queries in a launch, got {queries}")

    splits = 1 if workspace is None else int(workspace.splits)
    split = splits > 1
    part_out = workspace.partial_out if split else out     # dummy pointers are never touched
    part_lse = workspace.partial_lse if split else out
    lse_arg = lse if lse is not None else out

    kernel = _backend.get_kernel(q, "attention", "paged_attention", defines)
    u32 = np.uint32
    stream.launch(kernel, (queries, hkv * tiles, splits), (THREADS,), (
        q, k_cache, v_cache, q if q_rot is None else q_rot, k_cache if k_rot is None else k_rot, plan.words,
        out, lse_arg, part_out, part_lse,
        u32(host.queries), u32(host.sequences), u32(host.table_width), u32(host.page_size), u32(host.pages),
        u32(hq), u32(hkv), u32(d), u32(dv), u32(rot_dim), u32(splits), u32(bool(causal)),
        u32(lse is not None and not split), np.float32(scale)))
    if split:
        merge = _backend.get_kernel(q, "attention", "attention_split_merge", defines)
        stream.launch(merge, (queries, -(-hq // MERGE_HEADS_PER_BLOCK)), (THREADS,), (
            workspace.partial_out, workspace.partial_lse, out, lse_arg,
            u32(queries), u32(hq), u32(dv), u32(splits), u32(lse is not None)))
