"""paged_attention (``kernels_cu/attention/decode.cu``): CUDA cores, one block
of WARPS warps per (query, KV head, head tile, split); any dtype, D and Dv
(compile-time dims with 16-byte loads, or runtime dims up to a capacity),
the MLA rotary part, any alignment (element loads). The fallback of every
shape no other kernel serves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .... import dtypes
from .spec import VECTOR_BYTES, KernelSpec

if TYPE_CHECKING:
    from ..variants import Shape, Variant

#: Warps per block (att::kWarps).
WARPS = 4
#: Threads per block (att::kThreads; the first ``__launch_bounds__`` argument).
THREADS = 32 * WARPS
#: Warps per block on the CPU backend (CPU_GEOMETRY; CUPAGED_CPU_GEOMETRY=gpu: WARPS there too). A fiber's fixed
#: work (q rows, the softmax states, the merges at the end) is paid per thread on the CPU and hidden on a GPU: one
#: warp a block ran SmolLM2-135M's decode attention (8 sequences, 9 / 3 heads, D 64, contexts 16 - 48) in 342 us a
#: layer against 662 with four (2 cores, in the engine's decode graph), the same tokens in 4x the steps.
CPU_WARPS = 1
#: Lanes a K / V row is spread over at most (att::kLanes: fewer when the row has fewer 16-byte chunks). On the CPU
#: backend (CPU_GEOMETRY) fewer: every lane of a row group computes the row's scores' exponentials again, and a
#: lane's loop over its share of the row is short. SmolLM2-135M's decode attention (8 sequences, 9 / 3 heads, D 64
#: f32, contexts 32 / 48; 2 cores, graph replay): 16 lanes a row 276 / 416 us, 8 lanes 248 / 313, 4 295 / 349,
#: 1 407 / 502.
ROW_LANES = 32
CPU_ROW_LANES = 8
#: Resident blocks per SM the kernel is built for (the second
#: ``__launch_bounds__`` argument): a floor, its registers vary with the
#: variant and most fit more.
MIN_BLOCKS = 2
#: Compile-time head dims (D == Dv) with 16-byte loads.
FAST_DIMS = (64, 128, 256)
#: Capacities of the runtime-dim variants (max(D, Dv) <= capacity).
DIM_CAPS = (64, 128, 256, 512, 1024)
#: Query heads per block a variant may be built for.
GROUP_TILES = (1, 2, 3, 4, 8)
#: Capacities of the MLA rotary part P (q_rot / k_rot), ROT_CAP variants.
#: One capacity: a 64 one gave the same GROUP_TILE at R = 512 (the
#: DeepSeek shape, and f16 / bf16 at 512 / 64 run on paged_mla_tc).
ROT_CAPS = (256,)
#: Row and rotary floats a lane may hold per head of the tile (for q, and
#: again for the accumulator): bounds the registers that grow with GROUP_TILE.
LANE_FLOATS = 64
#: Shared memory of the final merge of the warps' accumulators
#: (s_acc [WARPS][GROUP_TILE][cap] floats) a build may use.
MERGE_SMEM_BYTES = 32 * 1024
#: The constants decode.cu shares with this spec (geometry.header: geom::decode).
GEOMETRY = {
    "kWarps": WARPS,
    "kThreads": THREADS,
    "kMinBlocks": MIN_BLOCKS,
    "kRowLanes": ROW_LANES,
    "kLaneFloats": LANE_FLOATS,
    "kMergeSmemBytes": MERGE_SMEM_BYTES,
}
#: What the CPU backend's builds use instead (geometry.header: under CUPAGED_CPU, unless CUPAGED_GPU_GEOMETRY).
CPU_GEOMETRY = {"kWarps": CPU_WARPS, "kThreads": 32 * CPU_WARPS, "kRowLanes": CPU_ROW_LANES}


def elems_per_lane(cap: int, vec: int) -> int:
    """Row elements one lane holds (att::kElems) for a row capacity ``cap``
    in chunks of ``vec`` elements (att::kVec) in the GPU geometry, whose
    registers this bounds: a row is spread over up to ROW_LANES lanes, one
    chunk each, then more chunks per lane."""
    chunks = cap // vec
    return vec if chunks <= ROW_LANES else cap // ROW_LANES


def rot_elems_per_lane(cap: int, vec: int, rot_cap: int) -> int:
    """Rotary elements one lane holds (att::kRotElems; 0 without a rotary
    part): the rotary capacity over the lanes of a row."""
    lanes = min(ROW_LANES, cap // vec)
    return -(-rot_cap // lanes) if rot_cap else 0


def max_group_tile(cap: int, vec: int, rot_cap: int = 0) -> int:
    """Largest GROUP_TILE built for a row capacity, chunk width and rotary
    capacity: tile x (row + rotary elements per lane) <= LANE_FLOATS, and the
    final merge's WARPS x tile x cap floats within MERGE_SMEM_BYTES."""
    per_head = elems_per_lane(cap, vec) + rot_elems_per_lane(cap, vec, rot_cap)
    limit = min(LANE_FLOATS // per_head, MERGE_SMEM_BYTES // (WARPS * 4 * cap), GROUP_TILES[-1])
    return max([1] + [t for t in GROUP_TILES if t <= limit])


def _vec(kv_dtype: str, vec_loads: bool) -> int:
    """Elements per chunk (att::kVec): 16 bytes of the cache type, or one."""
    return VECTOR_BYTES // dtypes.itemsize(kv_dtype) if vec_loads else 1


def _built_tiles(top: int, vec_loads: bool) -> tuple[int, ...]:
    """GROUP_TILE values built below ``top``: all of GROUP_TILES with 16-byte
    loads; with element loads (misaligned arrays, dims that are not a
    multiple of 16 bytes: a fallback) only 1 and ``top``, a group between
    them running in tiles of ``top`` (the extra heads are masked)."""
    if vec_loads:
        return tuple(t for t in GROUP_TILES if t <= top)
    return tuple(sorted({1, top}))


class Decode(KernelSpec):
    """HEAD_DIM (fast path: D == Dv, 16-byte loads) or DIM_CAP / VEC_LOADS
    (runtime D, Dv up to the capacity; VEC_LOADS 0: element loads), with
    GROUP_TILE query heads per block and ROT_CAP (the MLA rotary part) on the
    runtime-dim path."""

    name = "paged_attention"
    source = "attention/decode"
    threads = THREADS
    cpu_threads = CPU_GEOMETRY["kThreads"]
    min_blocks = MIN_BLOCKS
    fields = ("head_dim", "dim_cap", "vec_loads", "group_tile", "rot_cap")
    per_query = True
    rank = 1  # paged_decode_tc first wherever it serves

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        for d in FAST_DIMS:
            for t in _built_tiles(max_group_tile(d, _vec(kv_dtype, True)), True):
                yield dict(head_dim=d, group_tile=t)
        for cap in DIM_CAPS:
            for vec_loads in (0, 1):
                vec = _vec(kv_dtype, bool(vec_loads))
                for t in _built_tiles(max_group_tile(cap, vec), bool(vec_loads)):
                    yield dict(dim_cap=cap, vec_loads=vec_loads, group_tile=t)
                # MLA (rotary part): one shared KV head, so the group is every
                # query head and only the largest tile is worth building.
                for rot in ROT_CAPS:
                    yield dict(dim_cap=cap, vec_loads=vec_loads, rot_cap=rot, group_tile=max_group_tile(cap, vec, rot))

    def defines(self, v: Variant) -> dict[str, Any]:
        if v.head_dim:
            return {"HEAD_DIM": v.head_dim, "GROUP_TILE": v.group_tile}
        d = {"DIM_CAP": v.dim_cap, "VEC_LOADS": v.vec_loads, "GROUP_TILE": v.group_tile}
        if v.rot_cap:
            d["ROT_CAP"] = v.rot_cap
        return d

    def serves(self, v: Variant, s: Shape) -> bool:
        if v.head_dim:  # fast path: compile-time dims, 16-byte loads
            return not s.rot_dim and s.vec_ok and s.head_dim == s.value_dim == v.head_dim
        if max(s.head_dim, s.value_dim) > v.dim_cap or v.vec_loads > s.vec_ok:
            return False
        return v.rot_cap >= s.rot_dim if s.rot_dim else not v.rot_cap

    def gate_fast(self, v: Variant) -> bool:
        return bool(v.head_dim)  # the runtime-dim builds compile when a launch first asks


DECODE = Decode()
