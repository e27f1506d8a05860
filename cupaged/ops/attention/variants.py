"""Every compile-time choice of the attention kernels, as ``Variant``
records: which are built (registered for the NVRTC gate) and which one runs
for given dtypes, dims, alignment and GQA group. Kernels:
``kernels_cu/attention/``; launch and scheduling: ``launch.py`` and
``schedule.py`` beside this file.

One rule serves both: ``_built()`` enumerates the table of built variants,
and selection picks from that table the cheapest variant that serves a shape
(``Variant.serves``, ``_cost``), so nothing can run that is not built and
registered. Score variants (``SCORES``) are a column of their own: every
built score is built for every shape variant; a score that is not built
(a test's) still runs, since either backend compiles a variant when a launch
first asks for it; it is only absent from the gate. The same holds for the
fp8-cache builds (FP8_PAIRS, kernels of FP8_KERNELS): all are in the table,
the gate registers the fast ones (FP8_GATE_FEATURES), the rest compile on
first launch. Cache views that are not C-contiguous go to STRIDED_KERNELS.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from ... import dtypes, layout
from ..._runtime import register
from ..._runtime.archs import base_arch, launchable

#: Split chunks are rounded up to a multiple of this many positions (docs/layout.md).
SPLIT_TILE = layout.SPLIT_TILE
#: Threads per block of paged_attention and attention_split_merge.
THREADS = 128
#: Query heads the split merge serves per block (merge.cu: one (query, head)
#: per block of THREADS threads, every split's loads in flight).
MERGE_HEADS_PER_BLOCK = 1

#: (q / out dtype, K/V cache dtype) pairs of an unscaled cache: the caches
#: have q's dtype.
SAME_DTYPE_PAIRS = tuple((d, d) for d in dtypes.QUERY_TOKENS if d in dtypes.KV_TOKENS)
#: (q / out dtype, fp8 cache dtype) pairs: 16-bit queries over an e4m3 / e5m2
#: cache (the codes decode exactly to the 16-bit type, the scales fold into
#: the score scale and the output; docs/layout.md, "Cache views and fp8
#: caches"). Built only for the kernels of FP8_KERNELS.
FP8_PAIRS = tuple((d, kv) for d in dtypes.QUERY_TOKENS if d in dtypes.TC_TOKENS for kv in dtypes.FP8_TOKENS)
#: Every (q / out dtype, K/V cache dtype) pair some kernel is built for.
DTYPE_PAIRS = SAME_DTYPE_PAIRS + FP8_PAIRS
DTYPES = tuple(q for q, _ in SAME_DTYPE_PAIRS)
#: Kernels whose fp8-cache builds exist (FP8_PAIRS): only these are built,
#: registered and selectable for an fp8 cache; any other kernel's fp8 shape
#: falls back to one of these.
FP8_KERNELS = frozenset({"paged_attention", "paged_decode_tc", "paged_prefill_tc", "paged_mla_tc",
                         "paged_mla_wgmma"})
#: Kernels that address K / V / k_rot rows through the cache strides of
#: AttentionParams (any view whose innermost dim is contiguous: HND, halves
#: of a combined KV tensor, column ranges of an MLA cache). Selection sends
#: a cache that is not C-contiguous (``Shape.strided``) only to these.
STRIDED_KERNELS = frozenset({"paged_attention", "paged_decode_tc", "paged_prefill_tc", "paged_mla_tc",
                             "paged_mla_wgmma"})
#: Compile-time head dims (D == Dv) with 16-byte loads.
FAST_DIMS = (64, 128, 256)
#: Capacities of the runtime-dim variants (max(D, Dv) <= capacity).
DIM_CAPS = (64, 128, 256, 512, 1024)
#: Query heads per block a variant may be built for.
GROUP_TILES = (1, 2, 4, 8)
#: Capacities of the MLA rotary part P (q_rot / k_rot), ROT_CAP variants.
#: One capacity: a 64 one gave the same GROUP_TILE at R = 512 (the
#: DeepSeek shape, and f16 / bf16 at 512 / 64 run on paged_mla_tc).
ROT_CAPS = (256,)
#: Storage types of the tensor-core kernels.
TC_DTYPES = dtypes.TC_TOKENS
#: Head dims (D == Dv) of the tensor-core prefill kernel.
TC_PREFILL_DIMS = (64, 128, 256)
#: (R, P) latent and rotary dims of the tensor-core MLA kernel (P = 0: no
#: rotary part, an MLA call with q_pos = k_pos = None).
TC_MLA_DIMS = ((512, 64), (512, 0))
#: (R, P) of the wgmma MLA kernel (sm_90a).
TC_MLA_WGMMA_DIMS = ((512, 64), (512, 0))
#: (query, head) rows per block of paged_mla_tc, and the row unit of the
#: tensor-core segment rules (schedule.py); paged_prefill_tc's blocks have
#: the rows of their tile (PREFILL_TILES).
TC_ROWS = 64
#: Threads per block of paged_mla_tc (paged_prefill_tc: its tile's warps).
TC_PREFILL_THREADS = 128
TC_MLA_THREADS = 256
#: Shared memory the tensor-core kernels declare statically (their rows'
#: spans, the page staging of the tile ring and paged_prefill_tc's staged
#: per-token row offsets: up to 5680 bytes) stays within this budget;
#: selection adds it to the dynamic bytes when it checks an arch's limit, and
#: the gate's launch check uses the real figure (tests/attention/test_arch_select.py
#: checks the budget against the compiled kernels).
TC_STATIC_SMEM_BUDGET = 6144


class TcTile(NamedTuple):
    """The tile of one paged_prefill_tc build: ``warps`` per block, each with
    ``mtiles`` m-tiles of 16 rows (rows per block: 16 x mtiles x warps), K/V
    tiles of ``kv_tile`` tokens through a ring of ``stages`` shared-memory
    buffers, and ``min_blocks`` resident blocks per SM it is designed for
    (its ``__launch_bounds__`` minimum: registers are capped so that many
    fit)."""

    warps: int
    mtiles: int
    kv_tile: int
    stages: int
    min_blocks: int

    @property
    def rows(self) -> int:
        return 16 * self.mtiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps


#: paged_prefill_tc tiles built per head dim, preferred first; selection
#: takes the first that can launch on the device's arch (the later ones
#: exist for archs with less shared memory per block: sm_86 / sm_89, 99 KiB).
#: D <= 128: 128 rows, two m-tiles per warp (each K / V fragment feeds two
#: mma), 3 stages; D = 256 holds 16 rows x 256 f32 accumulators per warp, so
#: one m-tile per warp.
PREFILL_TILES: dict[int, tuple[TcTile, ...]] = {
    64: (TcTile(4, 2, 64, 3, 2),),
    128: (TcTile(4, 2, 32, 3, 2),),
    256: (TcTile(8, 1, 32, 2, 1), TcTile(4, 1, 16, 3, 1)),
}
VECTOR_BYTES = 16
#: Head dims (D == Dv) of the tensor-core decode kernel paged_decode_tc.
DECODE_TC_DIMS = (64, 128)
#: Threads per block of paged_decode_tc (two warps, each with its own K/V ring).
DECODE_TC_THREADS = 64
#: Query heads per paged_decode_tc block: the 16 rows of one mma tile.
DECODE_TC_HEADS = 16
#: Smallest GQA group paged_decode_tc serves (below, paged_attention):
#: the selection rule for decode (one block per query) between the two. 1:
#: at group 1 the model (perf_model gqa_g1, sm_90) has both HBM-bound at the
#: copy bandwidth, paged_decode_tc with its issue (62 us) and latency (90 us)
#: bounds further below HBM's 250 us than paged_attention's (129 / 124 us),
#: so the tensor-core kernel serves every group it can.
DECODE_TC_MIN_GROUP = 1


# ---------------------------------------------------------------------------
# Kernels and score variants
# ---------------------------------------------------------------------------

class Kernel(NamedTuple):
    """An attention kernel: its ``kernels_cu`` source stem and block size."""

    name: str
    source: str
    threads: int


DECODE = Kernel("paged_attention", "attention/decode", THREADS)
PREFILL_TC = Kernel("paged_prefill_tc", "attention/prefill_tc", TC_PREFILL_THREADS)
MLA_TC = Kernel("paged_mla_tc", "attention/mla_tc", TC_MLA_THREADS)
#: MLA on wgmma.mma_async (sm_90a only; mla_wgmma.cu): two warpgroups.
MLA_WGMMA = Kernel("paged_mla_wgmma", "attention/mla_wgmma", 256)
#: Compile targets of arch-specific builds: the variant runs only on devices
#: of the arch it names without the suffix (sm_90a code on sm_90 devices).
TARGETS = ("sm_90a",)
DECODE_TC = Kernel("paged_decode_tc", "attention/decode_tc", DECODE_TC_THREADS)
KERNELS = {k.name: k for k in (DECODE, PREFILL_TC, MLA_TC, DECODE_TC, MLA_WGMMA)}
#: Kernels with one block per query (and KV head, head tile, split), any
#: packing of the step: selection picks among them for queries the
#: row-packed tensor-core kernels (prefill_tc, mla_tc) do not take.
PER_QUERY_KERNELS = (DECODE.name, DECODE_TC.name)


@dataclass(frozen=True)
class Score:
    """A score variant: ``name`` is ``AttentionOptions.score`` and the
    ``CP_SCORE`` define, which selects ``struct score_<name>`` in
    ``kernels_cu/attention/variant.cuh`` (the hook). ``built``: registered
    for the NVRTC gate with every shape variant (compiled for sm_80 / sm_90
    ahead of any launch)."""

    name: str
    built: bool
    doc: str


#: The score variants, by name (docs/layout.md, "Adding a score variant").
SCORES: dict[str, Score] = {
    "plain": Score("plain", True, "softmax(scale * q.k)"),
}

#: Score and visibility features (variant.cuh; docs/layout.md, "Score
#: variants and visibility"): each a compile-time flag of every kernel, off
#: by default (the variant then compiles to the code it had without it),
#: composed with any score above. ``Variant`` fields of these names; defines
#: CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI.
FEATURES = ("soft_cap", "window", "sinks", "alibi")
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
    kernel; ``defines()`` spells the ones that do (the name of the compiled
    variant is its cache key)."""

    kernel: str                  # paged_attention | paged_prefill_tc | paged_mla_tc
    dtype: str                   # CP_DTYPE: q and out
    kv_dtype: str                # CP_KV_DTYPE: the K/V caches
    score: str = "plain"         # CP_SCORE (SCORES)
    head_dim: int = 0            # HEAD_DIM: D == Dv (paged_attention's fast path; paged_prefill_tc)
    dim_cap: int = 0             # DIM_CAP: runtime D, Dv up to it (paged_attention)
    vec_loads: int = 0           # VEC_LOADS: 16-byte loads on the runtime-dim path
    group_tile: int = 0          # GROUP_TILE: query heads per block (paged_attention)
    rot_cap: int = 0             # ROT_CAP: MLA rotary capacity P (paged_attention)
    latent_dim: int = 0          # LATENT_DIM: R (paged_mla_tc)
    rope_dim: int = 0            # ROPE_DIM: P (paged_mla_tc)
    tile: TcTile | None = None   # TC_*: paged_prefill_tc's tile (PREFILL_TILES)
    target: str = ""             # CP_TARGET: the arch-specific compile target ("sm_90a"), "" for any arch
    soft_cap: bool = False       # CP_SOFT_CAP (FEATURES)
    window: bool = False         # CP_WINDOW
    sinks: bool = False          # CP_SINKS
    alibi: bool = False          # CP_ALIBI

    @property
    def source(self) -> str:
        """The ``kernels_cu`` stem of the kernel's file."""
        return KERNELS[self.kernel].source

    @property
    def threads(self) -> int:
        return self.tile.threads if self.tile else KERNELS[self.kernel].threads

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
        if self.kernel == PREFILL_TC.name:
            return prefill_smem_bytes(self.head_dim, self.tile, self.kv_dtype)
        if self.kernel == MLA_WGMMA.name:
            return mla_wgmma_smem_bytes(self.latent_dim, self.rope_dim, self.kv_dtype)
        if self.kernel == MLA_TC.name:
            return mla_smem_bytes(self.latent_dim, self.rope_dim, self.kv_dtype)
        if self.kernel == DECODE_TC.name:
            return decode_tc_smem_bytes(self.head_dim, self.kv_dtype)
        return 0

    def defines(self) -> dict:
        """The ``#define``s of this variant."""
        d = {"CP_DTYPE": self.dtype, "CP_KV_DTYPE": self.kv_dtype, "CP_SCORE": self.score}
        if self.kernel == DECODE.name:
            if self.head_dim:
                d.update(HEAD_DIM=self.head_dim, GROUP_TILE=self.group_tile)
            else:
                d.update(DIM_CAP=self.dim_cap, VEC_LOADS=self.vec_loads, GROUP_TILE=self.group_tile)
                if self.rot_cap:
                    d["ROT_CAP"] = self.rot_cap
        elif self.kernel == DECODE_TC.name:
            d["HEAD_DIM"] = self.head_dim
        elif self.kernel == PREFILL_TC.name:
            t = self.tile
            d.update(HEAD_DIM=self.head_dim, TC_WARPS=t.warps, TC_MTILES=t.mtiles, TC_KV_TILE=t.kv_tile,
                     TC_STAGES=t.stages, TC_MIN_BLOCKS=t.min_blocks)
        else:
            d.update(LATENT_DIM=self.latent_dim, ROPE_DIM=self.rope_dim)
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
        if s.strided and self.kernel not in STRIDED_KERNELS:
            return False
        if self.kernel == DECODE.name:
            if self.head_dim:     # fast path: compile-time dims, 16-byte loads
                return not s.rot_dim and s.vec_ok and s.head_dim == s.value_dim == self.head_dim
            if max(s.head_dim, s.value_dim) > self.dim_cap or self.vec_loads > s.vec_ok:
                return False
            return self.rot_cap >= s.rot_dim if s.rot_dim else not self.rot_cap
        if self.kernel == DECODE_TC.name:   # cp.async and 16-byte stores: vec_ok means aligned arrays
            return (not s.rot_dim and s.vec_ok and s.head_dim == s.value_dim == self.head_dim
                    and s.group >= DECODE_TC_MIN_GROUP)
        if not (s.aligned_tc and s.schedule_ok):
            return False
        if self.kernel == PREFILL_TC.name:
            return not s.rot_dim and s.head_dim == s.value_dim == self.head_dim
        # MLA: V is the latent (K) itself; without a rotary part only an MLA
        # call (``Shape.latent``) says so.
        return (s.value_dim == s.head_dim == self.latent_dim and s.rot_dim == self.rope_dim
                and bool(s.rot_dim or s.latent))

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
        static = TC_STATIC_SMEM_BUDGET if self.kernel not in PER_QUERY_KERNELS else 0
        return launchable(arch, static, self.smem, self.threads)


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
    """Order of preference among the variants that serve a shape: the
    tensor-core decode kernel wherever it serves (``Variant.serves``: f16 /
    bf16, D == Dv in DECODE_TC_DIMS, aligned, a group of at least
    DECODE_TC_MIN_GROUP); then the compile-time-dim path, the smallest
    capacities, 16-byte loads; then as few head tiles as possible (each
    re-reads the K/V rows), then the smallest tile covering
    ``ceil(group / tiles)`` heads."""
    tile = v.group_tile or 1
    return (v.kernel != DECODE_TC.name, not v.head_dim, v.dim_cap, -v.vec_loads, v.rot_cap, -(-group // tile),
            tile)


# ---------------------------------------------------------------------------
# What is built
# ---------------------------------------------------------------------------

def _elems_per_lane(cap: int, vec: int) -> int:
    """Row elements one lane holds (mirrors att::kElems in attention/decode.cu)."""
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
    return VECTOR_BYTES // dtypes.itemsize(dtype) if vec_loads else 1


def _built_tiles(top: int, vec_loads: bool) -> tuple[int, ...]:
    """GROUP_TILE values built below ``top``: all of GROUP_TILES with 16-byte
    loads; with element loads (misaligned arrays, dims that are not a
    multiple of 16 bytes: a fallback) only 1 and ``top``, a group between
    them running in tiles of ``top`` (the extra heads are masked)."""
    if vec_loads:
        return tuple(t for t in GROUP_TILES if t <= top)
    return tuple(sorted({1, top}))


def _built() -> list[Variant]:
    """Every shape variant built (score "plain"): the table selection picks from."""
    out = []
    for dt, kv in DTYPE_PAIRS:
        fp8 = kv in dtypes.FP8_TOKENS
        for d in FAST_DIMS if not fp8 or DECODE.name in FP8_KERNELS else ():
            for t in _built_tiles(max_group_tile(d, _vec(kv, True)), True):
                out.append(Variant(DECODE.name, dt, kv, head_dim=d, group_tile=t))
        for cap in DIM_CAPS if not fp8 or DECODE.name in FP8_KERNELS else ():
            for vec_loads in (0, 1):
                vec = _vec(kv, bool(vec_loads))
                for t in _built_tiles(max_group_tile(cap, vec), bool(vec_loads)):
                    out.append(Variant(DECODE.name, dt, kv, dim_cap=cap, vec_loads=vec_loads, group_tile=t))
                # MLA (rotary part): one shared KV head, so the group is every
                # query head and only the largest tile is worth building.
                for rot in ROT_CAPS:
                    out.append(Variant(DECODE.name, dt, kv, dim_cap=cap, vec_loads=vec_loads, rot_cap=rot,
                                       group_tile=max_group_tile(cap, vec, rot)))
        if dt in TC_DTYPES and (kv in TC_DTYPES or fp8):
            def has(k: Kernel) -> bool:   # an fp8 build only for the kernels of FP8_KERNELS
                return not fp8 or k.name in FP8_KERNELS
            for d in DECODE_TC_DIMS if has(DECODE_TC) else ():
                out.append(Variant(DECODE_TC.name, dt, kv, head_dim=d, group_tile=DECODE_TC_HEADS))
            for d in TC_PREFILL_DIMS if has(PREFILL_TC) else ():
                for t in PREFILL_TILES[d]:
                    out.append(Variant(PREFILL_TC.name, dt, kv, head_dim=d, tile=t))
            for r, p in TC_MLA_DIMS:
                if has(MLA_TC):
                    out.append(Variant(MLA_TC.name, dt, kv, latent_dim=r, rope_dim=p))
                if (r, p) in TC_MLA_WGMMA_DIMS and has(MLA_WGMMA):
                    out.append(Variant(MLA_WGMMA.name, dt, kv, latent_dim=r, rope_dim=p, target="sm_90a"))
    return out


_TABLE: dict[tuple[bool, str, str], list[Variant]] = {}
for _v in _built():
    _TABLE.setdefault((_v.kernel not in PER_QUERY_KERNELS, _v.dtype, _v.kv_dtype), []).append(_v)
del _v



def _gate_fast(v: Variant) -> bool:
    """A shape variant the gate builds with GATE_FEATURES: the fast dims of
    each kernel family (paged_attention's compile-time dims, every
    tensor-core build)."""
    return v.kernel != DECODE.name or bool(v.head_dim)


def with_features(v: Variant, features) -> Variant:
    """``v`` with exactly ``features`` (FEATURES names) on."""
    return replace(v, **{f: f in features for f in FEATURES})


#: Feature sets of the fp8-cache builds the gate compiles (FP8_PAIRS; at the
#: fast dims only): none and all four on. Other fp8 builds (each feature
#: alone, the runtime-dim paths) compile when a launch first asks for them.
FP8_GATE_FEATURES: tuple[tuple[str, ...], ...] = ((), FEATURES)


def _fp8(v: Variant) -> bool:
    return v.kv_dtype in dtypes.FP8_TOKENS


#: Every variant built: each shape variant with each built score, and the
#: fast ones (``_gate_fast``) with each of GATE_FEATURES too; of the
#: fp8-cache builds, the fast ones with FP8_GATE_FEATURES.
VARIANTS: tuple[Variant, ...] = tuple(
    [replace(v, score=s.name) for rows in _TABLE.values() for v in rows if not _fp8(v)
     for s in SCORES.values() if s.built]
    + [with_features(replace(v, score=s.name), fs) for rows in _TABLE.values() for v in rows
       if _gate_fast(v) and not _fp8(v) for s in SCORES.values() if s.built for fs in GATE_FEATURES]
    + [with_features(replace(v, score=s.name), fs) for rows in _TABLE.values() for v in rows
       if _gate_fast(v) and _fp8(v) for s in SCORES.values() if s.built for fs in FP8_GATE_FEATURES])
for _k in KERNELS.values():
    register(_k.source, [v.defines() for v in VARIANTS if v.kernel == _k.name])
del _k

#: The split merge (attention/merge.cu): a module of its own, one build per
#: q / out dtype and sink choice, whichever kernels wrote the partials.
MERGE = Kernel("attention_split_merge", "attention/merge", THREADS)


def merge_defines(dtype: str, sinks: bool) -> dict:
    """The ``#define``s of the split merge's build: ``dtype`` the output's
    (q's), CP_SINKS when it folds each head's sink in (the partials leave
    it out). The merge reads no cache; CP_KV_DTYPE names q's type only
    because variant.cuh declares AttentionParams."""
    return {"CP_DTYPE": dtype, "CP_KV_DTYPE": dtype, **({"CP_SINKS": 1} if sinks else {})}


register(MERGE.source, [merge_defines(d, s) for d in DTYPES for s in (False, True)])


def _tc_cost(v: Variant) -> tuple:
    """Order of preference among the tensor-core builds serving a shape: an
    arch-specific build (wgmma) first, then the tile order of PREFILL_TILES."""
    tiles = PREFILL_TILES.get(v.head_dim, ())
    return (not v.target, tiles.index(v.tile) if v.tile in tiles else 0)


def _pick(tensor_core: bool, shape: Shape, score: str, arch: str | None = None,
          features: tuple[str, ...] = ()) -> Variant | None:
    """The cheapest built variant (of one kernel kind) serving ``shape`` that
    runs on ``arch`` (``Variant.runs_on``), with ``score`` and ``features``
    (FEATURES names); None when none does."""
    rows = [v for v in _TABLE.get((tensor_core, shape.dtype, shape.kv_dtype), ())
            if v.serves(shape) and (not tensor_core or v.runs_on(arch))]
    if not rows:
        return None
    best = min(rows, key=(lambda v: _tc_cost(v)) if tensor_core else (lambda v: _cost(v, shape.group)))
    if score == best.score and not features:
        return best
    return with_features(replace(best, score=score), features)


# ---------------------------------------------------------------------------
# What runs
# ---------------------------------------------------------------------------

def prefill_q_in_registers(head_dim: int, tile: TcTile) -> bool:
    """Whether paged_prefill_tc keeps Q's fragments in registers (tcp::kQInRegs)."""
    return tile.mtiles * head_dim <= 128


def prefill_smem_bytes(head_dim: int, tile: TcTile | None = None, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory of paged_prefill_tc: ``stages`` buffers of K and
    V [kv_tile][D + 8], 16-bit, after Q [rows][D + 8], whose area the K/V
    buffers reuse when Q's fragments move to registers. An fp8 cache
    (``kv_dtype`` e4m3 / e5m2): one decoded 16-bit K / V tile in their place,
    then ``stages`` raw tiles of K and V codes [kv_tile][D] (prefill_tc.cu:
    tcp::kRawOff)."""
    t = tile or PREFILL_TILES[head_dim][0]
    fp8 = kv_dtype in dtypes.FP8_TOKENS
    pitch = (head_dim + 8) * 2
    kv = 2 * (1 if fp8 else t.stages) * t.kv_tile * pitch
    q = t.rows * pitch
    raw = t.stages * 2 * t.kv_tile * head_dim if fp8 else 0
    return (max(q, kv) if prefill_q_in_registers(head_dim, t) else q + kv) + raw


def decode_tc_smem_bytes(head_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory of paged_decode_tc: per warp, two stages of K
    and V [16][D + 8], 16-bit (decode_tc.cu: dtc::kWarpBytes). An fp8 cache
    (``kv_dtype`` e4m3 / e5m2): per warp one decoded 16-bit V tile
    [16][D + 8] and two raw stages of K codes [16][D + 32] and V codes
    [16][D]."""
    if kv_dtype in dtypes.FP8_TOKENS:
        return (DECODE_TC_THREADS // 32) * (16 * (head_dim + 8) * 2 + 2 * 16 * (2 * head_dim + 32))
    return (DECODE_TC_THREADS // 32) * 2 * 2 * 16 * (head_dim + 8) * 2


def mla_wgmma_smem_bytes(latent_dim: int, rope_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory of paged_mla_wgmma (mla_wgmma.cu, mwg::kSmemBytes):
    1024 bytes of alignment, Q's latent part [64][R], two tiles of
    [64][R + P] and P [64][64], 16-bit, and the row maxima [2][64] f32. An
    fp8 cache (``kv_dtype`` e4m3 / e5m2): one 16-bit tile and two raw tiles
    of codes [64][R + P] in place of the two tiles (the same bytes)."""
    tiles = 2 * 64 * (latent_dim + rope_dim) * 2
    if kv_dtype in dtypes.FP8_TOKENS:
        tiles = 64 * (latent_dim + rope_dim) * 2 + 2 * 64 * (latent_dim + rope_dim)
    return 1024 + TC_ROWS * latent_dim * 2 + tiles + TC_ROWS * 64 * 2 + 2 * TC_ROWS * 4


def mla_smem_bytes(latent_dim: int, rope_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory of paged_mla_tc: Q [64][R + P + 8], two K
    buffers [32][R + P + 8] and P [64][32 + 8], 16-bit. An fp8 cache
    (``kv_dtype`` e4m3 / e5m2): one 16-bit K buffer, then two raw tiles of
    codes [32][R + P] after P (mla_tc.cu: tcm::kTileBufs, sRaw)."""
    bufs, raw = 2, 0
    if kv_dtype in dtypes.FP8_TOKENS:
        bufs, raw = 1, 2 * 32 * (latent_dim + rope_dim)
    return (TC_ROWS + bufs * 32) * (latent_dim + rope_dim + 8) * 2 + TC_ROWS * (32 + 8) * 2 + raw


def vec_ok(dtype: str, head_dim: int, value_dim: int, aligned: bool) -> bool:
    """16-byte loads possible: the arrays aligned and both dims a multiple
    of 16 bytes."""
    itemsize = dtypes.itemsize(dtype)
    return aligned and (head_dim * itemsize) % VECTOR_BYTES == 0 and (value_dim * itemsize) % VECTOR_BYTES == 0


def select_variant(dtype: str, head_dim: int, value_dim: int, aligned: bool, group: int, rot_dim: int = 0,
                   *, kv_dtype: str | None = None, score: str = "plain", features: tuple[str, ...] = (),
                   strided: bool = False, latent: bool = False) -> Variant:
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
    shape = Shape(dtype, kv, head_dim, value_dim, rot_dim, group, vec_ok(kv, head_dim, value_dim, aligned),
                  strided=strided, latent=latent)
    v = _pick(False, shape, score, features=features)
    if v is None:
        raise ValueError(f"no per-query attention variant is built for {shape}")
    return v


def tc_queries_per_block(group: int, rows: int = TC_ROWS) -> int:
    """Queries a tensor-core block of ``rows`` rows serves (64 by default:
    paged_mla_tc and the segment rules): min(G, rows) heads each."""
    return rows // min(group, rows)


def resident_blocks(v: Variant) -> int:
    """Blocks per SM a variant is designed for: for the tensor-core kernels
    their ``__launch_bounds__`` minimum (RESIDENT_BLOCKS), which caps their
    registers so that many fit; shared memory may allow fewer on a small
    arch (sm_86 / sm_89). paged_attention: 2, a floor (its registers vary
    with the variant; most fit more). 0: not fixed by the kernel."""
    if v.kernel == PREFILL_TC.name:
        return v.tile.min_blocks
    return RESIDENT_BLOCKS.get(v.kernel, 0)


#: Resident blocks per SM of each tensor-core kernel by design (the second
#: ``__launch_bounds__`` argument; paged_prefill_tc: per tile, PREFILL_TILES),
#: for rules that size grids to the device (choose_splits: resident slots =
#: this x SMs). Read it through ``resident_blocks(variant)``.
RESIDENT_BLOCKS: dict[str, int] = {
    "paged_mla_tc": 1,
    "paged_mla_wgmma": 1,
    "paged_decode_tc": 6,
    "paged_attention": 2,
}


def select_tensor_core(dtype: str, head_dim: int, value_dim: int, aligned: bool, schedule_ok: bool,
                       rot_dim: int = 0, *, kv_dtype: str | None = None, score: str = "plain",
                       arch: str | None = None, features: tuple[str, ...] = (), strided: bool = False,
                       latent: bool = False) -> Variant | None:
    """The tensor-core variant that runs, or None for the per-query kernels
    (``select_variant``).

    ``schedule_ok``: ``tc_schedule_ok(host, group)``; ``aligned``: every
    array copied by cp.async (q, caches, q_rot, k_rot) and out start on a
    16-byte boundary. ``arch``: the device's (``cupaged._runtime.device_arch``):
    only a build that launches there (``Variant.runs_on``) is chosen, an
    arch-specific one first (paged_mla_wgmma on sm_90), then the first
    prefill tile that fits (PREFILL_TILES); None without an arch: no
    arch-specific build, no limit checked. ``strided`` / ``latent``: as in
    ``select_variant``.
    """
    kv = dtype if kv_dtype is None else kv_dtype
    return _pick(True, Shape(dtype, kv, head_dim, value_dim, rot_dim, 1, False, aligned, schedule_ok, strided,
                             latent), score, arch, features)
