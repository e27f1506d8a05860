"""Which kernel serves which queries of a step (segments) and the launches
that follow for given shapes, from host plan data only (cached per plan).
Rules in ``tc_segments``; docs/layout.md, "Which kernel serves which queries".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import numpy as np

from ... import dtypes
from .variants import KERNELS, TC_ROWS, select_tensor_core, select_variant, tc_queries_per_block

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

# ``host`` below: a ``cupaged.plan.HostPlan``, a layer above the ops (so Any to the type checker).

#: The tensor-core kernels (and, for f32, paged_prefill_simt: the same
#: row-packed blocks on CUDA cores) serve the sequences whose queries meet in one
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

_passes_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_segments_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _query_ranks(host: Any) -> np.ndarray:
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


def _ranges_passes(
    rank: np.ndarray, begins: np.ndarray, ends: np.ndarray, queries_per_block: int
) -> tuple[np.ndarray, np.ndarray]:
    """(most, total) passes of the blocks tiling each range
    ``[begins[i], ends[i])`` from its start (ranges not empty), at once."""
    nb = -(-(ends - begins) // queries_per_block)
    head = np.cumsum(nb) - nb  # first block of each range
    j = np.arange(int(nb.sum())) - np.repeat(head, nb)  # block index inside its range
    b0 = np.repeat(begins, nb) + j * queries_per_block
    b1 = np.minimum(b0 + queries_per_block, np.repeat(ends, nb))
    passes = rank[b1 - 1] - rank[b0] + 1
    return np.maximum.reduceat(passes, head), np.add.reduceat(passes, head)


def _passes_ok(rows: int, most: int, total: int) -> bool:
    """The tensor-core rule (TC_MAX_PASSES) for ``rows`` (query, head) rows
    whose blocks have ``most`` passes at most, ``total`` in all."""
    return 0 < most <= TC_MAX_PASSES and rows * TC_MAX_PASSES >= TC_ROWS * total


def block_passes(host: Any, queries_per_block: int) -> tuple[int, int]:
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


def tc_schedule_ok(host: Any, group: int) -> bool:
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
        self.done, self.most, self.total = begin, 0, 0  # complete blocks: [begin, done)

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


def _coalesce(segs: Iterable[list]) -> list:
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


def _segment(host: Any, group: int) -> tuple[tuple[bool, int, int], ...]:
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
            if run is not None and run.extend(e):  # (it keeps the rule: checked above)
                while i + 2 < len(segs) and run.extend(segs[i + 2][2]):
                    i += 2
                e = run.end
            else:
                on_tc = False
            merged.append([on_tc, b, e])
            i += 1
        segs = merged
    for seg in segs:  # too few rows to be worth a launch
        if seg[0] and (seg[2] - seg[1]) * heads < TC_SEGMENT_ROWS:
            seg[0] = False
    segs = _coalesce(segs)
    if len(segs) > MAX_SEGMENTS:
        _keep_largest(segs, queries)
        segs = _coalesce(segs)
    return tuple((on_tc, b, e - b) for on_tc, b, e in segs)


def tc_segments(host: Any, group: int) -> tuple[tuple[bool, int, int], ...]:
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


class Launch(NamedTuple):
    """One attention launch of a step (before the split merge).

    ``source`` (a ``kernels_cu`` stem: ``"attention/decode"``, ...) and
    ``kernel`` name it, ``defines`` its variant; ``threads`` per block (on the
    CPU backend ``cpu_threads``: ``KernelSpec.cpu_block_threads``) and
    ``smem`` dynamic shared bytes; the grid is ``(blocks, kv_heads / pack * tiles,
    splits)``, or with ``tiles_in_x`` ``(blocks * tiles, kv_heads, splits)``
    (the head tile the fastest block index: the MLA kernels, whose head
    tiles of one query then run side by side and share its latent rows in
    L2); it serves packed queries ``[q_begin, q_begin + q_count)``.
    ``min_blocks``: resident blocks per SM the kernel is designed for (its
    ``__launch_bounds__`` minimum; ``variants.resident_blocks``), 0 when the
    occupancy rules alone decide (paged_attention). ``pack``: KV heads per
    block (``KernelSpec.head_pack``; paged_decode_tc's blocks serve
    several): the grid's y is then ``kv_heads / pack * tiles``, and
    ``threads``, ``smem`` and ``min_blocks`` are the packed block's."""

    source: str
    kernel: str
    defines: dict
    threads: int
    smem: int
    blocks: int
    tiles: int
    q_begin: int
    q_count: int
    min_blocks: int = 0
    tiles_in_x: bool = False
    cpu_threads: int = 0
    pack: int = 1

    def block(self, backend: str) -> int:
        """Threads per block on ``backend`` ("cpu" or "gpu")."""
        return (self.cpu_threads or self.threads) if backend == "cpu" else self.threads

    def head_blocks(self, kv_heads: int) -> int:
        """Blocks per query block of the unsplit grid: ``kv_heads / pack`` x ``tiles``."""
        return kv_heads // self.pack * self.tiles

    def grid(self, kv_heads: int, splits: int) -> tuple[int, int, int]:
        """The launch grid for ``kv_heads`` KV heads and ``splits`` splits."""
        if self.tiles_in_x:
            return (self.blocks * self.tiles, kv_heads // self.pack, splits)
        return (self.blocks, self.head_blocks(kv_heads), splits)


_launches_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Storage(TypedDict):
    """The cache-storage keywords of ``select_tensor_core`` / ``select_variant``."""

    kv_dtype: str | None
    strided: bool
    latent: bool


def plan_launches(
    host: Any,
    dtype: str,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    rot_dim: int,
    aligned: bool,
    aligned_tc: bool,
    score: str = "plain",
    arch: str | None = None,
    features: tuple[str, ...] = (),
    *,
    kv_dtype: str | None = None,
    strided: bool = False,
    latent: bool = False,
) -> tuple[Launch, ...]:
    """The unsplit launches for these shapes, one per segment
    (``tc_segments``), each with its ``variants.Variant``'s source, kernel,
    defines, block and shared memory; ``score`` and ``features``
    (``variants.FEATURES`` names) are compile-time columns of every launch's
    variant and change no choice. ``arch``: the device's
    (``cupaged._runtime.device_arch``; inputs.record passes it): only
    builds that launch there are chosen (``select_tensor_core``); None
    checks no arch. ``kv_dtype``: the caches' format token (q's dtype when
    None; ``"e4m3"`` / ``"e5m2"``: an fp8 cache); ``strided``: a cache view
    that is not C-contiguous; ``latent``: V is the K cache (MLA)
    (``variants.Shape``). Host plan data only (static per schedule); cached
    per plan, shapes and arch, so the hot path is one lookup."""
    per_plan = _launches_cache.setdefault(host, {})
    kv = dtype if kv_dtype is None else kv_dtype
    key = (
        dtype,
        hq,
        hkv,
        d,
        dv,
        rot_dim,
        aligned,
        aligned_tc,
        score,
        arch,
        tuple(features),
        kv,
        bool(strided),
        bool(latent or rot_dim),
    )
    launches = per_plan.get(key)
    if launches is None:
        launches = per_plan[key] = _launches(host, *key)
    return launches


def _launches(
    host: Any,
    dtype: str,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    rot_dim: int,
    aligned: bool,
    aligned_tc: bool,
    score: str,
    arch: str | None,
    features: tuple[str, ...],
    kv_dtype: str,
    strided: bool,
    latent: bool,
) -> tuple[Launch, ...]:
    """plan_launches without the cache."""
    group = hq // hkv
    segs = tc_segments(host, group)
    storage = _Storage(kv_dtype=kv_dtype, strided=strided, latent=latent)
    tc = select_tensor_core(
        dtype,
        d,
        dv,
        aligned_tc,
        any(seg[0] for seg in segs),
        rot_dim,
        score=score,
        arch=arch,
        features=features,
        **storage,
    )
    if tc is None:
        segs = ((False, 0, host.queries),)
    launches = []
    for on_tc, begin, count in segs:
        if on_tc:
            # v.rows rows per block: qt queries x ht heads of one KV head's group.
            assert tc is not None  # without a tensor-core variant the step is one CUDA-core segment
            v, rows = tc, tc.rows
            tiles, blocks = -(-group // min(group, rows)), -(-count // tc_queries_per_block(group, rows))
        else:
            v = select_variant(dtype, d, dv, aligned, group, rot_dim, score=score, features=features, **storage)
            tiles, blocks = -(-group // v.group_tile), count
        pack = KERNELS[v.kernel].head_pack(v, hkv, arch)
        launches.append(
            Launch(
                v.source,
                v.kernel,
                v.defines(),
                pack * v.threads,
                pack * v.smem,
                blocks,
                tiles,
                begin,
                count,
                max(1, v.resident_blocks // pack) if v.resident_blocks else 0,
                bool(on_tc and v.latent_dim),  # MLA: head tiles in x
                pack * v.cpu_threads,
                pack,
            )
        )
    return tuple(launches)


def unsplit_blocks(
    host: Any,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    value_dim: int,
    dtype: DTypeLike,
    rot_dim: int = 0,
    *,
    kv_dtype: DTypeLike | None = None,
) -> int:
    """Blocks of the unsplit attention grids for a plan and these shapes
    (16-byte aligned arrays assumed; ``kv_dtype``: the caches' format, q's
    dtype by default), summed over the step's segments: what
    ``choose_splits`` fills the device with. The tensor-core kernels serve
    several queries per block, so this can be far below
    ``queries * kv_heads``."""
    token = dtypes.token(dtype)
    if host.queries == 0:
        return 0
    launches = plan_launches(
        host,
        token,
        q_heads,
        kv_heads,
        head_dim,
        value_dim,
        rot_dim,
        True,
        True,
        kv_dtype=None if kv_dtype is None else dtypes.token(kv_dtype),
    )
    return sum(launch.blocks * launch.head_blocks(kv_heads) for launch in launches)
