"""Paged attention launches (``kernels_cu/attention.cu``): decode and chunked
prefill over a paged K/V cache, optionally split over the visible history
with a merge. Layout, positions, metadata words and LSE: ``docs/layout.md``.

``launch_attention`` is the launch layer under ``DevicePlan.attention``: its
arguments are already checked; it picks the kernel of each segment of the
step (``tc_segments``) and issues one launch per segment (at most
MAX_SEGMENTS), then the split merge with a workspace. It allocates nothing, never
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

Segments (``tc_segments``): a launch covers the packed queries
``[q_begin, q_begin + q_count)`` (kernel arguments). A step the tensor-core
kernels suit as a whole (``tc_schedule_ok``) is one tensor-core launch; one
with no sequence that suits them, one CUDA-core launch. A mixed step (prefill
chunks among decodes of a small group) runs as up to MAX_SEGMENTS launches
over contiguous runs of sequences, each on its kernel: every launch writes
outputs and partials at global query indices, so one merge follows them all.
The segmentation is host plan data (cached per plan), so grids and arguments
still depend only on shapes and the plan's static sizes.
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
#: steps of small groups keep the CUDA-core kernel, which gives each query
#: its own block. Prefill chunks mixed with many such decodes run as
#: segments (``tc_segments``).
TC_MAX_PASSES = 5
#: Most launches of one step's attention before the split merge (segments).
MAX_SEGMENTS = 4
#: Rows (q_len x min(G, 64)) a sequence brings at least to be a tensor-core
#: candidate in a mixed step: one warp's M tile.
TC_SEQ_ROWS = 16
#: Rows a tensor-core segment of a mixed step serves at least (two warps'
#: M tiles, half a block) to be worth its launch; a shorter run of
#: candidates stays in the CUDA-core segment around it.
TC_SEGMENT_ROWS = 32
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
_segments_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _query_ranks(host) -> np.ndarray:
    """Active-sequence rank of each packed query (sequences without queries
    do not count), int64 [queries]."""
    ql = np.asarray(host.q_lens, dtype=np.int64)
    return np.cumsum(ql > 0)[np.asarray(host.q_seq)]


def _range_passes(rank: np.ndarray, begin: int, end: int, queries_per_block: int) -> np.ndarray:
    """Passes of each block of ``queries_per_block`` consecutive queries
    tiling ``[begin, end)`` from ``begin`` (end > begin)."""
    r = rank[begin:end]
    first = r[::queries_per_block]
    last = r[np.minimum((np.arange(len(first)) + 1) * queries_per_block, end - begin) - 1]
    return last - first + 1


def _ranges_passes(rank: np.ndarray, begins: np.ndarray, ends: np.ndarray,
                   queries_per_block: int) -> tuple[np.ndarray, np.ndarray]:
    """(most, total) passes of the blocks tiling each range
    ``[begins[i], ends[i])`` from its start (ranges not empty), at once."""
    nb = -(-(ends - begins) // queries_per_block)
    head = np.cumsum(nb) - nb                               # first block of each range
    j = np.arange(int(nb.sum())) - np.repeat(head, nb)      # block index inside its range
    b0 = np.repeat(begins, nb) + j * queries_per_block
    b1 = np.minimum(b0 + queries_per_block, np.repeat(ends, nb))
    passes = rank[b1 - 1] - rank[b0] + 1
    return np.maximum.reduceat(passes, head), np.add.reduceat(passes, head)


def _passes_ok(rows: int, most: int, total: int) -> bool:
    """The tensor-core rule (TC_MAX_PASSES) for ``rows`` (query, head) rows
    whose blocks have ``most`` passes at most, ``total`` in all."""
    return 0 < most <= TC_MAX_PASSES and rows * TC_MAX_PASSES >= TC_ROWS * total


def block_passes(host, queries_per_block: int) -> tuple[int, int]:
    """(most, total) passes of the blocks of ``queries_per_block``
    consecutive packed queries: the sequences whose queries meet in a block
    (host plan data, fixed per schedule; cached per plan)."""
    per_plan = _passes_cache.setdefault(host, {})
    if queries_per_block not in per_plan:
        if host.queries == 0:
            per_plan[queries_per_block] = (0, 0)
        else:
            passes = _range_passes(_query_ranks(host), 0, host.queries, queries_per_block)
            per_plan[queries_per_block] = (int(passes.max()), int(passes.sum()))
    return per_plan[queries_per_block]


def tc_schedule_ok(host, group: int) -> bool:
    """Whether the step's packing suits the tensor-core kernels (see
    TC_MAX_PASSES): at most TC_MAX_PASSES passes in a block and at least
    64 / TC_MAX_PASSES rows a pass on average. ``group``: query heads per
    KV head (all H for MLA)."""
    most, total = block_passes(host, tc_queries_per_block(group))
    return _passes_ok(host.queries * min(group, TC_ROWS), most, total)


class _TcRun:
    """A growing tensor-core segment from query ``begin``: the pass
    statistics of its complete blocks, so that trying a longer end costs
    only the queries past them."""

    def __init__(self, rank: np.ndarray, begin: int, group: int):
        self.rank, self.begin, self.end = rank, begin, begin
        self.heads = min(group, TC_ROWS)
        self.qpb = tc_queries_per_block(group)
        self.done, self.most, self.total = begin, 0, 0     # complete blocks: [begin, done)

    def extend(self, end: int) -> bool:
        """Grow to ``[begin, end)`` if the whole range keeps the tensor-core
        rule (``_passes_ok``, blocks tiling it from ``begin``); False (and
        unchanged) otherwise."""
        passes = _range_passes(self.rank, self.done, end, self.qpb)
        most, total = max(self.most, int(passes.max())), self.total + int(passes.sum())
        if not _passes_ok((end - self.begin) * self.heads, most, total):
            return False
        full = (end - self.done) // self.qpb
        if full:
            self.most = max(self.most, int(passes[:full].max()))
            self.total += int(passes[:full].sum())
            self.done += full * self.qpb
        self.end = end
        return True


def _coalesce(segs: list) -> list:
    """Adjacent segments of one kind as one."""
    out: list = []
    for seg in segs:
        if out and out[-1][0] == seg[0]:
            out[-1][2] = seg[2]
        else:
            out.append(list(seg))
    return out


def _keep_largest(segs: list, queries: int) -> None:
    """Turn tensor-core segments to CUDA-core ones until at most MAX_SEGMENTS
    remain once coalesced, keeping the ones with the most queries: taken
    largest first while the count allows (k kept segments, never adjacent,
    make 2k - 1 launches plus one for each end of the step they leave to
    the CUDA-core kernel; for MAX_SEGMENTS = 4 this keeps the best pair)."""
    order = sorted((i for i, seg in enumerate(segs) if seg[0]), key=lambda i: (segs[i][1] - segs[i][2], i))
    kept: list = []
    for i in order:
        if 2 * (len(kept) + 1) - 1 > MAX_SEGMENTS:
            break
        trial = sorted(kept + [i])
        ends = (segs[trial[0]][1] != 0) + (segs[trial[-1]][2] != queries)
        if 2 * len(trial) - 1 + ends <= MAX_SEGMENTS:
            kept = trial
    for i, seg in enumerate(segs):
        seg[0] = seg[0] and i in kept


#: Bridging (tc_segments) is tried when a step has at most this many runs of
#: candidates (it costs a few NumPy calls per run); past it, each run alone.
_BRIDGE_RUNS = 16


def _segment(host, group: int) -> tuple[tuple[bool, int, int], ...]:
    """tc_segments without the cache. Host cost: O(queries / block + sequences)
    NumPy work plus O(runs) Python steps."""
    queries = host.queries
    if queries == 0:
        return ()
    if tc_schedule_ok(host, group):
        return ((True, 0, queries),)
    heads, qpb = min(group, TC_ROWS), tc_queries_per_block(group)
    ql = np.asarray(host.q_lens, dtype=np.int64)
    active = np.nonzero(ql > 0)[0]
    starts = np.zeros(len(ql) + 1, np.int64)
    np.cumsum(ql, out=starts[1:])
    cand = ql[active] * heads >= TC_SEQ_ROWS
    if not cand.any():
        return ((False, 0, queries),)
    # Maximal runs of candidates and of the other sequences, as query ranges;
    # a run of candidates whose range breaks the rule joins the others.
    cut = np.nonzero(np.diff(cand.astype(np.int8)))[0] + 1
    first = np.concatenate(([0], cut))
    begins = starts[active[first]]
    ends = starts[active[np.concatenate((cut, [len(active)])) - 1] + 1]
    kind = cand[first]
    rank = _query_ranks(host)
    tc = np.nonzero(kind)[0]
    most, total = _ranges_passes(rank, begins[tc], ends[tc], qpb)
    kind[tc] = (most <= TC_MAX_PASSES) & ((ends - begins)[tc] * heads * TC_MAX_PASSES >= TC_ROWS * total)
    segs = _coalesce([kind_, b, e] for kind_, b, e in zip(kind.tolist(), begins.tolist(), ends.tolist()))
    # Bridging: a tensor-core run grows over the run after it and the next
    # tensor-core run while the merged range keeps the rule (a few decodes
    # between two chunks ride along in the chunks' blocks).
    if sum(seg[0] for seg in segs) <= _BRIDGE_RUNS:
        merged: list = []
        i = 0
        while i < len(segs):
            on_tc, b, e = segs[i]
            run = _TcRun(rank, b, group) if on_tc else None
            if run is not None and run.extend(e):      # (it keeps the rule: checked above)
                while i + 2 < len(segs) and run.extend(segs[i + 2][2]):
                    i += 2
                e = run.end
            else:
                on_tc = False
            merged.append([on_tc, b, e])
            i += 1
        segs = merged
    for seg in segs:                    # too few rows to be worth a launch
        if seg[0] and (seg[2] - seg[1]) * heads < TC_SEGMENT_ROWS:
            seg[0] = False
    segs = _coalesce(segs)
    if len(segs) > MAX_SEGMENTS:
        _keep_largest(segs, queries)
        segs = _coalesce(segs)
    return tuple((on_tc, b, e - b) for on_tc, b, e in segs)


def tc_segments(host, group: int) -> tuple[tuple[bool, int, int], ...]:
    """The step's launches as ``(tensor_core, q_begin, q_count)``: contiguous
    ranges of packed queries, in order, covering every query (empty without
    queries). Host plan data only (``q_lens``: fixed per schedule; cached per
    plan). ``group``: query heads per KV head (all H for MLA).

    Rule: the whole step is one tensor-core segment when ``tc_schedule_ok``.
    Otherwise the sequences bringing at least TC_SEQ_ROWS rows
    (``q_len * min(G, 64)``) are candidates; a maximal run of them is a
    tensor-core segment if its range keeps the TC_MAX_PASSES rule (blocks
    tiling it from its first query). Left to right, a tensor-core segment
    grows over the run of other sequences after it plus the next
    tensor-core segment while the merged range still keeps the rule (when
    the step has at most 16 such segments). A tensor-core segment of fewer
    than TC_SEGMENT_ROWS rows goes to the CUDA-core kernel; adjacent
    CUDA-core ranges are one segment. Past MAX_SEGMENTS segments, the
    tensor-core segments kept are the largest (most queries) that fit in
    MAX_SEGMENTS launches; the others join the CUDA-core segments around
    them. With no candidate (or none left), one CUDA-core segment.

    Whether tensor cores serve the step at all is ``select_tensor_core``'s
    call (dtype, dims, alignment); when they cannot, the step is one
    CUDA-core launch whatever the segments.
    """
    per_plan = _segments_cache.setdefault(host, {})
    segs = per_plan.get(group)
    if segs is None:
        segs = per_plan[group] = _segment(host, group)
    return segs


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


_launches_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _schedule(host, dtype: str, hq: int, hkv: int, d: int, dv: int, rot_dim: int, aligned: bool,
              aligned_tc: bool) -> tuple[tuple[str, dict, int, int, int, int, int, int], ...]:
    """The unsplit launches for these shapes, one per segment
    (``tc_segments``): (kernel, defines, threads, dynamic shared memory,
    blocks along x, head tiles per KV head, q_begin, q_count). Host plan data
    only (static per schedule); cached per plan and shapes, so the hot path
    is one lookup."""
    per_plan = _launches_cache.setdefault(host, {})
    key = (dtype, hq, hkv, d, dv, rot_dim, aligned, aligned_tc)
    launches = per_plan.get(key)
    if launches is None:
        launches = per_plan[key] = _plan_launches(host, *key)
    return launches


def _plan_launches(host, dtype: str, hq: int, hkv: int, d: int, dv: int, rot_dim: int, aligned: bool,
                   aligned_tc: bool) -> tuple:
    """_schedule without the cache."""
    group = hq // hkv
    segs = tc_segments(host, group)
    tc = select_tensor_core(dtype, d, dv, aligned_tc, any(seg[0] for seg in segs), rot_dim)
    if tc is None:
        segs = ((False, 0, host.queries),)
    launches = []
    for on_tc, begin, count in segs:
        if on_tc:
            # 64 rows per block: qt queries x ht heads of one KV head's group.
            tiles = -(-group // min(group, TC_ROWS))
            if "TC_MLA" in tc:
                name, threads, smem = "paged_mla_tc", TC_MLA_THREADS, mla_smem_bytes(d, rot_dim)
            else:
                name, threads, smem = "paged_prefill_tc", TC_PREFILL_THREADS, prefill_smem_bytes(d)
            defines, blocks = tc, -(-count // tc_queries_per_block(group))
        else:
            defines = select_variant(dtype, d, dv, aligned, group, rot_dim)
            tiles = -(-group // int(defines["GROUP_TILE"]))
            name, threads, smem, blocks = "paged_attention", THREADS, 0, count
        launches.append((name, defines, threads, smem, blocks, tiles, begin, count))
    return tuple(launches)


def unsplit_blocks(host, q_heads: int, kv_heads: int, head_dim: int, value_dim: int, dtype, rot_dim: int = 0) -> int:
    """Blocks of the unsplit attention grids for a plan and these shapes
    (16-byte aligned arrays assumed), summed over the step's segments: what
    ``choose_splits`` fills the device with. The tensor-core kernels serve
    several queries per block, so this can be far below
    ``queries * kv_heads``."""
    token = dtype if isinstance(dtype, str) and dtype in DTYPES else _checks.dtype_token(np.dtype(dtype))
    if host.queries == 0:
        return 0
    launches = _schedule(host, token, q_heads, kv_heads, head_dim, value_dim, rot_dim, True, True)
    return sum(blocks * kv_heads * tiles for _, _, _, _, blocks, tiles, _, _ in launches)


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
        if hkv != 1 or dv != d or _backend.address(v_cache) != _backend.address(k_cache):
            raise NotImplementedError("paged attention with a rotary part needs one KV head and v_cache "
                                      "being the same array as k_cache (the MLA latent cache)")
    if queries == 0:
        return
    dtype = _checks.dtype_token(q.dtype)
    aligned = all(_backend.address(a) % _VECTOR_BYTES == 0 for a in (q, k_cache, v_cache, out))
    aligned_tc = aligned and (not rot_dim or all(_backend.address(a) % _VECTOR_BYTES == 0 for a in (q_rot, k_rot)))
    launches = _schedule(host, dtype, hq, hkv, d, dv, rot_dim, aligned, aligned_tc)
    tiles = max(launch[5] for launch in launches)
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

    u32 = np.uint32
    for name, defines, threads, smem, blocks, tiles, begin, count in launches:
        kernel = _backend.get_kernel(q, "attention", name, defines)
        stream.launch(kernel, (blocks, hkv * tiles, splits), (threads,), (
            q, k_cache, v_cache, q if q_rot is None else q_rot, k_cache if k_rot is None else k_rot, plan.words,
            out, lse_arg, part_out, part_lse,
            u32(host.queries), u32(begin), u32(count), u32(host.sequences), u32(host.table_width),
            u32(host.page_size), u32(host.pages),
            u32(hq), u32(hkv), u32(d), u32(dv), u32(rot_dim), u32(splits), u32(bool(causal)),
            u32(lse is not None and not split), np.float32(scale)), shared_mem=smem)
    if split:   # every variant compiles the merge: the last launch's module serves it
        merge = _backend.get_kernel(q, "attention", "attention_split_merge", defines)
        stream.launch(merge, (queries, -(-hq // MERGE_HEADS_PER_BLOCK)), (THREADS,), (
            workspace.partial_out, workspace.partial_lse, out, lse_arg,
            u32(queries), u32(hq), u32(dv), u32(splits), u32(lse is not None)))
