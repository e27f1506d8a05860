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

CUDA-core kernel ``paged_attention`` (details in the ``.cu`` file): one 128-thread block per
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

Tensor-core kernels (f16 / bf16, ``select_tensor_core``):

* ``paged_prefill_tc`` (D == Dv in ``TC_PREFILL_DIMS``, a step packed as
  ``tc_schedule_ok`` asks): one 128-thread block per 64 (query, head) rows
  (``64 // G`` queries x the ``G`` heads of one KV head's group) and split;
  K/V tiles go through shared memory by ``cp.async`` and S = Q K^T,
  O += P V run on ``mma.sync`` m16n8k16 (FlashAttention-2 style). K/V are
  read once per block instead of once per query: about
  ``ceil(q_len * G / 64) * L * (D + Dv) * itemsize`` bytes per sequence and
  KV head.
* ``paged_mla_tc`` (R, P in ``TC_MLA_DIMS``): one 256-thread block per 64
  (query, head) rows and split, the heads in the M dimension, so each
  latent row is read once per 64 heads (``L * (R + P) * itemsize`` bytes per
  block) where the CUDA-core kernel reads it once per ``GROUP_TILE`` heads.

Both take the same arguments as ``paged_attention``, write the same split
partials (so ``attention_split_merge`` serves them) and read lengths and
positions from the device words; their grids depend only on shapes.
"""
from __future__ import annotations

import weakref

import numpy as np

from . import _backend, _checks, _registry
from .errors import PagedAttentionError
from .plan import MAX_SPLITS  # noqa: F401 (defined once, in plan.py)

#: Most splits of the visible history (``SplitWorkspace.splits``).
#: Split chunks are rounded up to a multiple of this many positions
#: (docs/layout.md, "the kernel's token tile").
SPLIT_TILE = 16
#: Threads per block of paged_attention and attention_split_merge.
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
#: One capacity: a 64 one gave the same GROUP_TILE at R = 512 (the
#: DeepSeek shape, and f16 / bf16 at 512 / 64 run on paged_mla_tc).
ROT_CAPS = (256,)
#: Storage types of the tensor-core kernels.
TC_DTYPES = ("f16", "bf16")
#: Head dims (D == Dv) of the tensor-core prefill kernel.
TC_PREFILL_DIMS = (64, 128, 256)
#: (R, P) latent and rotary dims of the tensor-core MLA kernel.
TC_MLA_DIMS = ((512, 64),)
#: (query, head) rows per block of the tensor-core kernels (16 per warp of S).
TC_ROWS = 64
#: The tensor-core kernels serve the sequences whose queries meet in one
#: block one after the other (a pass each, reading that sequence's K/V
#: tiles for all the block's rows). They run when no block has more than
#: TC_MAX_PASSES passes and the passes average at least 64 / TC_MAX_PASSES
#: (query, head) rows (``tc_schedule_ok``). Every step whose sequences bring
#: at least 16 rows each (q_len * G, one warp's M tile) qualifies; decode
#: steps of small groups, and prefill chunks mixed with many such decodes,
#: keep the CUDA-core kernel, which gives each query its own block.
TC_MAX_PASSES = 5
#: Threads per block of paged_prefill_tc and paged_mla_tc.
TC_PREFILL_THREADS = 128
TC_MLA_THREADS = 256
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


def _built_tiles(top: int, vec_loads: bool) -> tuple[int, ...]:
    """GROUP_TILE values built below ``top``: all of GROUP_TILES with 16-byte
    loads; with element loads (misaligned arrays, dims that are not a
    multiple of 16 bytes: a fallback) only 1 and ``top``, a group between
    them running in tiles of ``top`` (the extra heads are masked)."""
    if vec_loads:
        return tuple(t for t in GROUP_TILES if t <= top)
    return tuple(sorted({1, top}))


def _all_variants() -> list[dict]:
    out = []
    for dt in DTYPES:
        for d in FAST_DIMS:
            for t in GROUP_TILES:
                if t <= max_group_tile(d, _vec(dt, True)):
                    out.append({"CP_DTYPE": dt, "HEAD_DIM": d, "GROUP_TILE": t})
        for cap in DIM_CAPS:
            for vec_loads in (0, 1):
                for t in _built_tiles(max_group_tile(cap, _vec(dt, bool(vec_loads))), bool(vec_loads)):
                    out.append({"CP_DTYPE": dt, "DIM_CAP": cap, "VEC_LOADS": vec_loads, "GROUP_TILE": t})
                # MLA (rotary part): one shared KV head, so the group is every
                # query head and only the largest tile is worth building.
                for rot in ROT_CAPS:
                    out.append({"CP_DTYPE": dt, "DIM_CAP": cap, "VEC_LOADS": vec_loads, "ROT_CAP": rot,
                                "GROUP_TILE": max_group_tile(cap, _vec(dt, bool(vec_loads)), rot)})
    return out


def _tc_variants() -> list[dict]:
    out = []
    for dt in TC_DTYPES:
        for d in TC_PREFILL_DIMS:
            out.append({"CP_DTYPE": dt, "TC_PREFILL": 1, "HEAD_DIM": d})
        for r, p in TC_MLA_DIMS:
            out.append({"CP_DTYPE": dt, "TC_MLA": 1, "LATENT_DIM": r, "ROPE_DIM": p})
    return out


def prefill_tile_tokens(head_dim: int) -> int:
    """K/V tokens per tile of paged_prefill_tc (tcp::kN)."""
    return 64 if head_dim <= 128 else 32


def prefill_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_prefill_tc: two buffers of K and V
    [kN][D + 8], 16-bit, and Q [64][D + 8] before them when Q stays in shared
    memory (D = 256; below, Q moves to registers and its staging area is
    reused by the K/V buffers)."""
    kv_rows = 4 * prefill_tile_tokens(head_dim)       # K and V, two buffers each
    rows = kv_rows if head_dim <= 128 else TC_ROWS + kv_rows
    return rows * (head_dim + 8) * 2


def mla_smem_bytes(latent_dim: int, rope_dim: int) -> int:
    """Dynamic shared memory of paged_mla_tc: Q [64][R + P + 8], two K
    buffers [32][R + P + 8] and P [64][32 + 8], 16-bit."""
    return (TC_ROWS + 2 * 32) * (latent_dim + rope_dim + 8) * 2 + TC_ROWS * (32 + 8) * 2


VARIANTS = _all_variants() + _tc_variants()
_registry.register("attention", VARIANTS)


def _addr(a) -> int:
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def _group_tile(group: int, top: int, vec_loads: bool = True) -> int:
    """Query heads per block for a GQA group of ``group`` heads when tiles of
    up to ``top`` heads are built: as few tiles as possible (each tile
    re-reads the K/V rows), then the smallest built tile that covers
    ``ceil(group / tiles)`` heads."""
    tiles = -(-group // top)
    need = -(-group // tiles)
    return min(t for t in _built_tiles(top, vec_loads) if t >= need)


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
            "GROUP_TILE": _group_tile(group, max_group_tile(cap, vec), vec_ok)}


def tc_queries_per_block(group: int) -> int:
    """Queries a tensor-core block serves: 64 rows of min(G, 64) heads each."""
    return TC_ROWS // min(group, TC_ROWS)


_passes_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def block_passes(host, queries_per_block: int) -> tuple[int, int]:
    """(most, total) passes of the blocks of ``queries_per_block``
    consecutive packed queries: the sequences whose queries meet in a block
    (host plan data, fixed per schedule; cached per plan)."""
    per_plan = _passes_cache.setdefault(host, {})
    if queries_per_block not in per_plan:
        if host.queries == 0:
            per_plan[queries_per_block] = (0, 0)
        else:
            ql = np.asarray(host.q_lens, dtype=np.int64)
            rank = np.cumsum(ql > 0)[np.asarray(host.q_seq)]     # active-sequence rank of each query
            first = rank[::queries_per_block]
            ends = np.minimum((np.arange(len(first)) + 1) * queries_per_block, host.queries)
            passes = rank[ends - 1] - first + 1
            per_plan[queries_per_block] = (int(passes.max()), int(passes.sum()))
    return per_plan[queries_per_block]


def tc_schedule_ok(host, group: int) -> bool:
    """Whether the step's packing suits the tensor-core kernels (see
    TC_MAX_PASSES): at most TC_MAX_PASSES passes in a block and at least
    64 / TC_MAX_PASSES rows a pass on average. ``group``: query heads per
    KV head (all H for MLA)."""
    most, total = block_passes(host, tc_queries_per_block(group))
    rows = host.queries * min(group, TC_ROWS)
    return 0 < most <= TC_MAX_PASSES and rows * TC_MAX_PASSES >= TC_ROWS * total


def select_tensor_core(dtype: str, head_dim: int, value_dim: int, aligned: bool, schedule_ok: bool,
                       rot_dim: int = 0) -> dict | None:
    """Defines of the tensor-core variant that runs, or None for the
    CUDA-core kernel (``select_variant``).

    ``schedule_ok``: ``tc_schedule_ok(host, group)``; ``aligned``: every
    array copied by cp.async (q, caches, q_rot, k_rot) and out start on a
    16-byte boundary.
    """
    if dtype not in TC_DTYPES or not aligned or not schedule_ok:
        return None
    if rot_dim:
        if (head_dim, rot_dim) in TC_MLA_DIMS and value_dim == head_dim:
            return {"CP_DTYPE": dtype, "TC_MLA": 1, "LATENT_DIM": head_dim, "ROPE_DIM": rot_dim}
        return None
    if head_dim == value_dim and head_dim in TC_PREFILL_DIMS:
        return {"CP_DTYPE": dtype, "TC_PREFILL": 1, "HEAD_DIM": head_dim}
    return None


def _schedule(host, dtype: str, hq: int, hkv: int, d: int, dv: int, rot_dim: int, aligned: bool,
              aligned_tc: bool) -> tuple[str, dict, int, int, int, int]:
    """(kernel, defines, threads, dynamic shared memory, blocks along x, head
    tiles per KV head) of the unsplit launch for these shapes. Host plan data
    only (static per schedule)."""
    queries = host.queries
    group = hq // hkv
    tc = select_tensor_core(dtype, d, dv, aligned_tc, tc_schedule_ok(host, group), rot_dim)
    if tc is not None:
        qt = tc_queries_per_block(group)
        # 64 rows per block: qt queries x ht heads of one KV head's group.
        tiles = -(-group // min(group, TC_ROWS))
        if "TC_MLA" in tc:
            name, threads, smem = "paged_mla_tc", TC_MLA_THREADS, mla_smem_bytes(d, rot_dim)
        else:
            name, threads, smem = "paged_prefill_tc", TC_PREFILL_THREADS, prefill_smem_bytes(d)
        defines, blocks = tc, -(-queries // qt)
    else:
        defines = select_variant(dtype, d, dv, aligned, group, rot_dim)
        tiles = -(-group // int(defines["GROUP_TILE"]))
        name, threads, smem, blocks = "paged_attention", THREADS, 0, queries
    return name, defines, threads, smem, blocks, tiles


def unsplit_blocks(host, q_heads: int, kv_heads: int, head_dim: int, value_dim: int, dtype, rot_dim: int = 0) -> int:
    """Blocks of the unsplit attention grid for a plan and these shapes
    (16-byte aligned arrays assumed): what ``choose_splits`` fills the
    device with. The tensor-core kernels serve several queries per block, so
    this can be far below ``queries * kv_heads``."""
    token = dtype if isinstance(dtype, str) and dtype in DTYPES else _checks.dtype_token(np.dtype(dtype))
    if host.queries == 0:
        return 0
    *_, blocks, tiles = _schedule(host, token, q_heads, kv_heads, head_dim, value_dim, rot_dim, True, True)
    return blocks * kv_heads * tiles


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
    dtype = _checks.dtype_token(q.dtype)
    aligned = all(_addr(a) % _VECTOR_BYTES == 0 for a in (q, k_cache, v_cache, out))
    aligned_tc = aligned and (not rot_dim or all(_addr(a) % _VECTOR_BYTES == 0 for a in (q_rot, k_rot)))
    name, defines, threads, smem, blocks, tiles = _schedule(host, dtype, hq, hkv, d, dv, rot_dim, aligned,
                                                            aligned_tc)
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

    kernel = _backend.get_kernel(q, "attention", name, defines)
    u32 = np.uint32
    stream.launch(kernel, (blocks, hkv * tiles, splits), (threads,), (
        q, k_cache, v_cache, q if q_rot is None else q_rot, k_cache if k_rot is None else k_rot, plan.words,
        out, lse_arg, part_out, part_lse,
        u32(host.queries), u32(host.sequences), u32(host.table_width), u32(host.page_size), u32(host.pages),
        u32(hq), u32(hkv), u32(d), u32(dv), u32(rot_dim), u32(splits), u32(bool(causal)),
        u32(lse is not None and not split), np.float32(scale)), shared_mem=smem)
    if split:
        merge = _backend.get_kernel(q, "attention", "attention_split_merge", defines)
        stream.launch(merge, (queries, -(-hq // MERGE_HEADS_PER_BLOCK)), (THREADS,), (
            workspace.partial_out, workspace.partial_lse, out, lse_arg,
            u32(queries), u32(hq), u32(dv), u32(splits), u32(lse is not None)))
