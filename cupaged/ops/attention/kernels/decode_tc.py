"""paged_decode_tc (``kernels_cu/attention/decode_tc.cu``): mma.sync decode,
one block per (query, KV head, 16-head tile, split) of WARPS warps, each
with its own K/V ring of STAGES stages in shared memory; f16 / bf16 q over a cache
of q's type or fp8, D == Dv in DIMS, 16-byte aligned arrays."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .spec import PITCH_PAD, KernelSpec, is_fp8, tc_pair

if TYPE_CHECKING:
    from ..variants import Shape, Variant

#: Warps per block (dtc::kWarps), each with its own K/V ring.
WARPS = 2
#: Threads per block (dtc::kThreads; the first ``__launch_bounds__`` argument).
THREADS = 32 * WARPS
#: Query heads per block: the 16 rows of one mma tile (dtc::kRows).
HEADS = 16
#: Tokens per warp tile (dtc::kN).
TILE_TOKENS = 16
#: Stages of each warp's ring (dtc::kStages; the kernel takes any value >= 2).
#: 2: at 3 the model (perf_model, sm_90; modeled, pessimistic end) has B64
#: ctx4k decode HBM-bound as at 2 (bf16 299 us, fp8 160 us: no gain), while
#: 51 KiB of shared memory a block at D = 128 (16-bit) leaves 4 resident
#: blocks of the 6 and long_g4 (5.8 blocks placed per SM) slows (602 vs 595 us).
STAGES = 2
#: Bytes added to a raw fp8 K row of a stage (dtc::kRawKPitch = D + RAW_K_PAD).
RAW_K_PAD = 32
#: Resident blocks per SM by design (dtc::kMinBlocks, the second
#: ``__launch_bounds__`` argument): registers are capped so that six fit.
MIN_BLOCKS = 6
#: Head dims (D == Dv).
DIMS = (64, 128)
#: Smallest GQA group served (below, paged_attention): the selection rule
#: for decode (one block per query) between the two. 1: at group 1 the
#: model (perf_model gqa_g1, sm_90) has both HBM-bound at the copy
#: bandwidth, paged_decode_tc with its issue (62 us) and latency (90 us)
#: bounds further below HBM's 250 us than paged_attention's (129 / 124 us),
#: so the tensor-core kernel serves every group it can.
MIN_GROUP = 1
#: The constants decode_tc.cu shares with this spec (geometry.header: geom::decode_tc).
GEOMETRY = {
    "kWarps": WARPS,
    "kThreads": THREADS,
    "kMinBlocks": MIN_BLOCKS,
    "kRows": HEADS,
    "kN": TILE_TOKENS,
    "kStages": STAGES,
    "kRawKPad": RAW_K_PAD,
}


def warp_bytes(head_dim: int, kv_dtype: str | None = None) -> int:
    """Shared memory of one warp's ring (dtc::kWarpBytes): STAGES stages of
    K and V [TILE_TOKENS][D + PITCH_PAD], 16-bit. An fp8 cache (``kv_dtype``
    e4m3 / e5m2): one decoded 16-bit V tile [TILE_TOKENS][D + PITCH_PAD],
    then STAGES raw stages of K codes [TILE_TOKENS][D + RAW_K_PAD] and V
    codes [TILE_TOKENS][D]."""
    pitch = head_dim + PITCH_PAD
    if is_fp8(kv_dtype):
        return TILE_TOKENS * pitch * 2 + STAGES * TILE_TOKENS * ((head_dim + RAW_K_PAD) + head_dim)
    return STAGES * TILE_TOKENS * 2 * pitch * 2


def smem_bytes(head_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory of a block: WARPS rings."""
    return WARPS * warp_bytes(head_dim, kv_dtype)


class DecodeTc(KernelSpec):
    """HEAD_DIM: D == Dv; every build serves HEADS heads per block (its
    ``group_tile``)."""

    name = "paged_decode_tc"
    source = "attention/decode_tc"
    threads = THREADS
    min_blocks = MIN_BLOCKS
    fields = ("head_dim",)
    per_query = True

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        if tc_pair(dtype, kv_dtype):
            for d in DIMS:
                yield dict(head_dim=d, group_tile=HEADS)

    def serves(self, v: Variant, s: Shape) -> bool:
        # cp.async and 16-byte stores: vec_ok means aligned arrays
        return not s.rot_dim and s.vec_ok and s.head_dim == s.value_dim == v.head_dim and s.group >= MIN_GROUP

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.head_dim, v.kv_dtype)


DECODE_TC = DecodeTc()
