"""Every compile-time choice of the attention kernels, as ``Variant``
records: which are built (registered for the NVRTC gate) and which one runs
for given dtypes, dims, alignment and GQA group. What each kernel builds,
serves and needs (defines, block, shared memory, resident blocks) is its
spec in ``kernels/`` (one module per ``kernels_cu/attention/<stem>.cu``);
launch and scheduling: ``launch.py`` and ``schedule.py`` beside this file.

One rule serves both: ``_built()`` enumerates the table of built variants
(every spec's builds for every dtype pair), and selection picks from that
table the cheapest variant that serves a shape (``Variant.serves``,
``_cost``), so nothing can run that is not built and registered. Score
variants (``SCORES``) are a column of their own: every built score is built
for every shape variant; a score that is not built (a test's) still runs,
since either backend compiles a variant when a launch first asks for it; it
is only absent from the gate. The same holds for the fp8-cache builds
(FP8_PAIRS, kernels whose spec has ``fp8``): all are in the table, the gate
registers the fast ones (FP8_GATE_FEATURES), the rest compile on first
launch. Cache views that are not C-contiguous go to the kernels whose spec
has ``strided``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from ... import dtypes, layout
from ..._runtime import register
from ..._runtime.archs import base_arch, launchable
from .kernels import MERGE, SPECS, mla_tc, prefill_tc
from .kernels.decode import ROT_CAPS as ROT_CAPS
from .kernels.merge import MERGE_HEADS_PER_BLOCK as MERGE_HEADS_PER_BLOCK
from .kernels.prefill_tc import PREFILL_TILES as PREFILL_TILES
from .kernels.prefill_tc import TcTile
from .kernels.spec import TC_ROWS, VECTOR_BYTES, is_fp8
from .kernels.spec import TC_STATIC_SMEM_BUDGET as TC_STATIC_SMEM_BUDGET

#: Split chunks are rounded up to a multiple of this many positions (docs/layout.md).
SPLIT_TILE = layout.SPLIT_TILE

#: (q / out dtype, K/V cache dtype) pairs of an unscaled cache: the caches
#: have q's dtype.
SAME_DTYPE_PAIRS = tuple((d, d) for d in dtypes.QUERY_TOKENS if d in dtypes.KV_TOKENS)
#: (q / out dtype, fp8 cache dtype) pairs: 16-bit queries over an e4m3 / e5m2
#: cache (the codes decode exactly to the 16-bit type, the scales fold into
#: the score scale and the output; docs/layout.md, "Cache views and fp8
#: caches"). Built only for the kernels whose spec has ``fp8``.
FP8_PAIRS = tuple((d, kv) for d in dtypes.QUERY_TOKENS if d in dtypes.TC_TOKENS for kv in dtypes.FP8_TOKENS)
#: Every (q / out dtype, K/V cache dtype) pair some kernel is built for.
DTYPE_PAIRS = SAME_DTYPE_PAIRS + FP8_PAIRS
DTYPES = tuple(q for q, _ in SAME_DTYPE_PAIRS)


# ---------------------------------------------------------------------------
# Kernels and score variants
# ---------------------------------------------------------------------------

#: The attention kernels' specs by name (kernels/: SPECS).
KERNELS = {k.name: k for k in SPECS}
#: Kernels with fp8-cache builds (FP8_PAIRS): only these are built,
#: registered and selectable for an fp8 cache; any other kernel's fp8 shape
#: falls back to one of these.
FP8_KERNELS = frozenset(k.name for k in SPECS if k.fp8)
#: Kernels that address K / V / k_rot rows through the cache strides of
#: AttentionParams (any view whose innermost dim is contiguous: HND, halves
#: of a combined KV tensor, column ranges of an MLA cache). Selection sends
#: a cache that is not C-contiguous (``Shape.strided``) only to these.
STRIDED_KERNELS = frozenset(k.name for k in SPECS if k.strided)
#: Resident blocks per SM of each kernel by design (the second
#: ``__launch_bounds__`` argument, the specs' ``min_blocks``; paged_prefill_tc:
#: per tile, PREFILL_TILES), for rules that size grids to the device
#: (choose_splits: resident slots = this x SMs). Read it through
#: ``resident_blocks(variant)``.
RESIDENT_BLOCKS: dict[str, int] = {k.name: k.min_blocks for k in SPECS if k.min_blocks}
#: Head dims (D == Dv) of paged_prefill_tc, (R, P) of paged_mla_tc (the specs').
TC_PREFILL_DIMS = prefill_tc.DIMS
TC_MLA_DIMS = mla_tc.DIMS


#: The score variants (``Score`` rows, by name) and the score and visibility
#: features (variant.cuh; docs/layout.md, "Score variants and visibility"):
#: each feature a compile-time flag of every kernel, off by default (the
#: variant then compiles to the code it had without it), composed with any
#: score. Both come from the option rows of ``options.py``; ``Variant``
#: fields of the features' names, defines CP_SOFT_CAP, CP_WINDOW, CP_SINKS,
#: CP_ALIBI.
from .options import FEATURES, SCORES, Score  # noqa: E402, F401 (Score: variants.Score, as before)

#: Feature sets the NVRTC gate builds besides none: each alone and all on,
#: for every kernel family and dtype at the fast dims (the compile-time-dim
#: paged_attention builds, every tensor-core build); other combinations and
#: the runtime-dim builds compile when a launch first asks for them.
GATE_FEATURES: tuple[tuple[str, ...], ...] = tuple((f,) for f in FEATURES) + (FEATURES,)


# ---------------------------------------------------------------------------
# Variant: every compile-time choice of one build
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One build of an attention kernel. Fields left 0 do not apply to the
    kernel; its spec's ``defines`` spells the ones that do (``defines()``:
    with the dtypes, score, target and features; the name of the compiled
    variant is its cache key)."""

    kernel: str  # a name of KERNELS
    dtype: str  # CP_DTYPE: q and out
    kv_dtype: str  # CP_KV_DTYPE: the K/V caches
    score: str = "plain"  # CP_SCORE (SCORES)
    head_dim: int = 0  # HEAD_DIM: D == Dv (paged_attention's fast path; the tensor-core kernels)
    dim_cap: int = 0  # DIM_CAP: runtime D, Dv up to it (paged_attention)
    vec_loads: int = 0  # VEC_LOADS: 16-byte loads on the runtime-dim path
    group_tile: int = 0  # GROUP_TILE: query heads per block (paged_attention; paged_decode_tc's 16)
    rot_cap: int = 0  # ROT_CAP: MLA rotary capacity P (paged_attention)
    latent_dim: int = 0  # LATENT_DIM: R (paged_mla_tc, paged_mla_wgmma, paged_mla_seesaw)
    rope_dim: int = 0  # ROPE_DIM: P (paged_mla_tc, paged_mla_wgmma, paged_mla_seesaw)
    tile: TcTile | None = None  # TC_*: paged_prefill_tc's tile (PREFILL_TILES)
    target: str = ""  # CP_TARGET: the spec's arch-specific compile target, "" for any arch
    soft_cap: bool = False  # CP_SOFT_CAP (FEATURES)
    window: bool = False  # CP_WINDOW
    sinks: bool = False  # CP_SINKS
    alibi: bool = False  # CP_ALIBI

    @property
    def source(self) -> str:
        """The ``kernels_cu`` stem of the kernel's file."""
        return KERNELS[self.kernel].source

    @property
    def threads(self) -> int:
        return KERNELS[self.kernel].block_threads(self)

    @property
    def cpu_threads(self) -> int:
        """Threads per block on the CPU backend (``KernelSpec.cpu_block_threads``)."""
        return KERNELS[self.kernel].cpu_block_threads(self)

    @property
    def features(self) -> tuple[str, ...]:
        """The FEATURES that are on."""
        return tuple(f for f in FEATURES if getattr(self, f))

    @property
    def rows(self) -> int:
        """(query, head) rows per block of a tensor-core variant."""
        return self.tile.rows if self.tile else TC_ROWS

    @property
    def resident_blocks(self) -> int:
        """Blocks per SM the variant is designed for (its ``__launch_bounds__``
        minimum; ``RESIDENT_BLOCKS``)."""
        return resident_blocks(self)

    @property
    def smem(self) -> int:
        """Dynamic shared memory bytes of a launch."""
        return KERNELS[self.kernel].smem(self)

    def defines(self) -> dict[str, Any]:
        """The ``#define``s of this variant."""
        d: dict[str, Any] = {"CP_DTYPE": self.dtype, "CP_KV_DTYPE": self.kv_dtype, "CP_SCORE": self.score}
        d.update(KERNELS[self.kernel].defines(self))
        if self.target:
            d["CP_TARGET"] = self.target
        for f in self.features:
            d[f"CP_{f.upper()}"] = 1
        return d

    def serves(self, s: "Shape") -> bool:
        """Whether this variant computes attention for shape ``s`` (any
        score and features: those columns are set after selection)."""
        if (self.dtype, self.kv_dtype) != (s.dtype, s.kv_dtype):
            return False
        spec = KERNELS[self.kernel]
        if s.strided and not spec.strided:
            return False
        return spec.serves(self, s)

    def runs_on(self, arch: str | None) -> bool:
        """Whether this build can launch on a device of ``arch`` (None: no
        device limits known, and no arch-specific build): its target's arch,
        and its block and shared memory within the arch's limits (the static
        shared memory of the tensor-core kernels counted at
        TC_STATIC_SMEM_BUDGET)."""
        if arch is None:
            return not self.target
        if self.target and base_arch(self.target) != base_arch(arch):
            return False
        return launchable(arch, KERNELS[self.kernel].static_smem_budget, self.smem, self.threads)


class Shape(NamedTuple):
    """What selection looks at: dtypes, dims, the GQA group (query heads per
    KV head; all H for MLA), 16-byte vector loads possible (``vec_ok``: dims
    a multiple of 16 bytes and the arrays aligned), arrays aligned for the
    tensor-core kernels' cp.async, and whether the step's packing suits them
    (``schedule.tc_schedule_ok``). ``strided``: a cache (K, V or k_rot) is
    a view that is not C-contiguous (served by STRIDED_KERNELS only);
    ``latent``: V is the K cache itself (an MLA call; with a rotary part
    always)."""

    dtype: str
    kv_dtype: str
    head_dim: int
    value_dim: int
    rot_dim: int
    group: int
    vec_ok: bool
    aligned_tc: bool = False
    schedule_ok: bool = False
    strided: bool = False
    latent: bool = False


def _cost(v: Variant, group: int) -> tuple:
    """Order of preference among the per-query variants that serve a shape:
    the kernel's ``rank`` first (paged_decode_tc wherever it serves: f16 /
    bf16, D == Dv in its dims, aligned, a group of at least its MIN_GROUP);
    then the compile-time-dim path, the smallest capacities, 16-byte loads;
    then as few head tiles as possible (each re-reads the K/V rows), then
    the smallest tile covering ``ceil(group / tiles)`` heads."""
    tile = v.group_tile or 1
    return (KERNELS[v.kernel].rank, not v.head_dim, v.dim_cap, -v.vec_loads, v.rot_cap, -(-group // tile), tile)


def _tc_cost(v: Variant) -> tuple:
    """Order of preference among the tensor-core builds serving a shape: an
    arch-specific build (wgmma) first, then the kernel's own order (the tile
    order of PREFILL_TILES)."""
    return (not v.target, KERNELS[v.kernel].preference(v))


# ---------------------------------------------------------------------------
# What is built
# ---------------------------------------------------------------------------


def _built() -> list[Variant]:
    """Every shape variant built (score "plain"): the table selection picks
    from, each spec's builds for each dtype pair (an fp8 cache only for the
    kernels with ``fp8``)."""
    return [
        Variant(k.name, dt, kv, target=k.target, **fields)
        for dt, kv in DTYPE_PAIRS
        for k in SPECS
        if k.fp8 or not is_fp8(kv)
        for fields in k.builds(dt, kv)
    ]


_TABLE: dict[tuple[bool, str, str], list[Variant]] = {}
for _v in _built():
    _TABLE.setdefault((not KERNELS[_v.kernel].per_query, _v.dtype, _v.kv_dtype), []).append(_v)
del _v


def _gate_fast(v: Variant) -> bool:
    """A shape variant the gate builds with GATE_FEATURES: the fast dims of
    each kernel family (paged_attention's compile-time dims, every
    tensor-core build; the spec's ``gate_fast``)."""
    return KERNELS[v.kernel].gate_fast(v)


def with_features(v: Variant, features) -> Variant:
    """``v`` with exactly ``features`` (FEATURES names) on."""
    flags: dict[str, Any] = {f: f in features for f in FEATURES}
    return replace(v, **flags)


#: Feature sets of the fp8-cache builds the gate compiles (FP8_PAIRS; at the
#: fast dims only): none and all four on. Other fp8 builds (each feature
#: alone, the runtime-dim paths) compile when a launch first asks for them.
FP8_GATE_FEATURES: tuple[tuple[str, ...], ...] = ((), FEATURES)


def _fp8(v: Variant) -> bool:
    return is_fp8(v.kv_dtype)


#: Every variant built: each shape variant with each built score, and the
#: fast ones (``_gate_fast``) with each of GATE_FEATURES too; of the
#: fp8-cache builds, the fast ones with FP8_GATE_FEATURES.
VARIANTS: tuple[Variant, ...] = tuple(
    [
        replace(v, score=s.name)
        for rows in _TABLE.values()
        for v in rows
        if not _fp8(v)
        for s in SCORES.values()
        if s.built
    ]
    + [
        with_features(replace(v, score=s.name), fs)
        for rows in _TABLE.values()
        for v in rows
        if _gate_fast(v) and not _fp8(v)
        for s in SCORES.values()
        if s.built
        for fs in GATE_FEATURES
    ]
    + [
        with_features(replace(v, score=s.name), fs)
        for rows in _TABLE.values()
        for v in rows
        if _gate_fast(v) and _fp8(v)
        for s in SCORES.values()
        if s.built
        for fs in FP8_GATE_FEATURES
    ]
)
for _k in SPECS:
    register(_k.source, [v.defines() for v in VARIANTS if v.kernel == _k.name])
del _k

# The split merge: one build per q / out dtype and sink choice, whichever
# kernels wrote the partials.
register(MERGE.source, [MERGE.defines(d, s) for d in DTYPES for s in (False, True)])


def _pick(
    tensor_core: bool, shape: Shape, score: str, arch: str | None = None, features: tuple[str, ...] = ()
) -> Variant | None:
    """The cheapest built variant (of one kernel kind) serving ``shape`` that
    runs on ``arch`` (``Variant.runs_on``), with ``score`` and ``features``
    (FEATURES names); None when none does."""
    rows = [
        v
        for v in _TABLE.get((tensor_core, shape.dtype, shape.kv_dtype), ())
        if v.serves(shape) and (not tensor_core or v.runs_on(arch))
    ]
    if not rows:
        return None
    best = min(rows, key=(lambda v: _tc_cost(v)) if tensor_core else (lambda v: _cost(v, shape.group)))
    if score == best.score and not features:
        return best
    return with_features(replace(best, score=score), features)


# ---------------------------------------------------------------------------
# What runs
# ---------------------------------------------------------------------------


def vec_ok(dtype: str, head_dim: int, value_dim: int, aligned: bool) -> bool:
    """16-byte loads possible: the arrays aligned and both dims a multiple
    of 16 bytes."""
    itemsize = dtypes.itemsize(dtype)
    return aligned and (head_dim * itemsize) % VECTOR_BYTES == 0 and (value_dim * itemsize) % VECTOR_BYTES == 0


def select_variant(
    dtype: str,
    head_dim: int,
    value_dim: int,
    aligned: bool,
    group: int,
    rot_dim: int = 0,
    *,
    kv_dtype: str | None = None,
    score: str = "plain",
    features: tuple[str, ...] = (),
    strided: bool = False,
    latent: bool = False,
) -> Variant:
    """The per-query variant that runs (dtype, D, Dv, GQA group size,
    rotary dim P; the caches' dtype, q's unless given; the score variant and
    its features): paged_decode_tc where it serves, else paged_attention
    (``_cost``).

    ``aligned``: every array the kernel reads or writes with 16-byte loads
    (q, k_cache, v_cache, out) starts on a 16-byte boundary and has strides
    that are multiples of 16 bytes (``checks.aligned``). ``strided``: a
    cache is a view that is not C-contiguous (STRIDED_KERNELS only);
    ``latent``: V is the K cache (MLA).
    """
    kv = dtype if kv_dtype is None else kv_dtype
    shape = Shape(
        dtype,
        kv,
        head_dim,
        value_dim,
        rot_dim,
        group,
        vec_ok(kv, head_dim, value_dim, aligned),
        strided=strided,
        latent=latent,
    )
    v = _pick(False, shape, score, features=features)
    if v is None:
        raise ValueError(f"no per-query attention variant is built for {shape}")
    return v


def tc_queries_per_block(group: int, rows: int = TC_ROWS) -> int:
    """Queries a tensor-core block of ``rows`` rows serves (64 by default:
    paged_mla_tc and the segment rules): min(G, rows) heads each."""
    return rows // min(group, rows)


def resident_blocks(v: Variant) -> int:
    """Blocks per SM a variant is designed for: its kernel's
    ``__launch_bounds__`` minimum (RESIDENT_BLOCKS; paged_prefill_tc: its
    tile's), which caps the tensor-core kernels' registers so that many fit;
    shared memory may allow fewer on a small arch (sm_86 / sm_89).
    paged_attention: 2, a floor (its registers vary with the variant; most
    fit more). 0: not fixed by the kernel."""
    return KERNELS[v.kernel].resident_blocks(v)


def select_tensor_core(
    dtype: str,
    head_dim: int,
    value_dim: int,
    aligned: bool,
    schedule_ok: bool,
    rot_dim: int = 0,
    *,
    kv_dtype: str | None = None,
    score: str = "plain",
    arch: str | None = None,
    features: tuple[str, ...] = (),
    strided: bool = False,
    latent: bool = False,
) -> Variant | None:
    """The row-packed variant that runs (the tensor-core kernels for f16 /
    bf16; paged_prefill_simt, on CUDA cores, for f32), or None for the
    per-query kernels (``select_variant``).

    ``schedule_ok``: ``tc_schedule_ok(host, group)``; ``aligned``: every
    array copied by cp.async (q, caches, q_rot, k_rot) and out start on a
    16-byte boundary. ``arch``: the device's (``cupaged._runtime.device_arch``):
    only a build that launches there (``Variant.runs_on``) is chosen, an
    arch-specific one first (paged_prefill_wgmma, paged_mla_seesaw and paged_mla_wgmma on sm_90), then the first
    prefill tile that fits (PREFILL_TILES); None without an arch: no
    arch-specific build, no limit checked. ``strided`` / ``latent``: as in
    ``select_variant``.
    """
    kv = dtype if kv_dtype is None else kv_dtype
    return _pick(
        True,
        Shape(dtype, kv, head_dim, value_dim, rot_dim, 1, False, aligned, schedule_ok, strided, latent),
        score,
        arch,
        features,
    )
