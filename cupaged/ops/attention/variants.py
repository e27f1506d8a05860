"""Every compile-time choice of the attention kernels: which variants are
built (registered for the NVRTC gate) and which one runs for given dtypes,
dims, alignment and GQA group. Kernels: ``kernels_cu/attention/``; launch
and scheduling: ``launch.py`` and ``schedule.py`` beside this file.
"""
from __future__ import annotations

from ... import dtypes, layout
from ..._runtime import register

#: Split chunks are rounded up to a multiple of this many positions (docs/layout.md).
SPLIT_TILE = layout.SPLIT_TILE
#: Threads per block of paged_attention and attention_split_merge.
THREADS = 128
#: Query heads of one GQA group the merge kernel serves per block (one warp each).
MERGE_HEADS_PER_BLOCK = THREADS // 32

DTYPES = dtypes.TOKENS
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
TC_DTYPES = dtypes.TC_TOKENS
#: Head dims (D == Dv) of the tensor-core prefill kernel.
TC_PREFILL_DIMS = (64, 128, 256)
#: (R, P) latent and rotary dims of the tensor-core MLA kernel.
TC_MLA_DIMS = ((512, 64),)
#: (query, head) rows per block of the tensor-core kernels (16 per warp of S).
TC_ROWS = 64
#: Threads per block of paged_prefill_tc and paged_mla_tc.
TC_PREFILL_THREADS = 128
TC_MLA_THREADS = 256
VECTOR_BYTES = 16


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
    return VECTOR_BYTES // dtypes.np_dtype(dtype).itemsize if vec_loads else 1


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
register("attention", VARIANTS)


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
    itemsize = dtypes.np_dtype(dtype).itemsize
    vec_ok = aligned and (head_dim * itemsize) % VECTOR_BYTES == 0 and (value_dim * itemsize) % VECTOR_BYTES == 0
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
