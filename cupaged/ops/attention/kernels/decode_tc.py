"""paged_decode_tc (``kernels_cu/attention/decode_tc.cu``): mma.sync decode,
one block per (query, pack of KV heads, 16-head tile, split) of WARPS warps
per KV head; the warps of one column (one per KV head of the pack) share a
K/V ring of STAGES stages in shared memory, each copy instruction reading
a token's rows of the pack's heads (one run of ``pack x D`` elements in an
NHD cache); f16 / bf16 q over a cache of q's type or fp8, D == Dv in DIMS,
16-byte aligned arrays."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...._runtime.archs import launchable
from .spec import PITCH_PAD, KernelSpec, is_fp8, tc_pair

if TYPE_CHECKING:
    from ..variants import Shape, Variant

#: Warps per KV head of a block (dtc::kWarps): its columns, taking tiles w, w + WARPS, ...
WARPS = 2
#: Threads per KV head of a block (dtc::kThreads): a block of ``pack`` KV heads has ``pack x THREADS``.
THREADS = 32 * WARPS
#: The most KV heads one block serves (dtc::kHeadPack): a launch takes the largest power of two up to it that
#: divides the KV heads and whose block launches on the device (``head_pack``). 4: a copy instruction of a 16-bit
#: D = 128 cache reads 512 contiguous bytes, the column's four warps a token's 1 KiB run of the four heads (NHD),
#: where one head's 256-byte rows at the cache's 2 KiB token stride (8 KV heads) are the pattern the model
#: (perf_model, sm_90; modeled, pessimistic end) rates at 0.85 of copy bandwidth against 0.93 for runs >= 1 KiB.
#: 8 would be a 512-thread block of 168-register threads: more registers than an SM holds.
HEAD_PACK = 4
#: Query heads per block: the 16 rows of one mma tile (dtc::kRows).
HEADS = 16
#: Tokens per warp tile (dtc::kN).
TILE_TOKENS = 16
#: Stages of each column's ring (dtc::kStages; the kernel takes any value >= 2).
#: 2: at 3 the model (perf_model, sm_90; modeled, pessimistic end; 2026-12-07,
#: blocks of four KV heads) has B64 ctx4k decode HBM-bound as at 2 (bf16
#: 273 us, fp8 154 us: no gain) with 1.5 x the shared memory (204 KiB a
#: block of four heads at D = 128, 16-bit, which sm_80 could hold only as
#: packs of two).
STAGES = 2
#: Bytes added to a raw fp8 K row of a stage (dtc::kRawKPitch = D + RAW_K_PAD).
RAW_K_PAD = 32
#: Resident blocks of one KV head (THREADS) per SM by design (dtc::kMinBlocks): registers are capped so that six
#: fit, ``__launch_bounds__(THREADS x MIN_BLOCKS, 1)`` (the cap of a 384-thread block: 168 registers), so a block of
#: ``pack`` KV heads has MIN_BLOCKS // pack resident (``resident_blocks``).
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
    "kHeadPack": HEAD_PACK,
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
    """Dynamic shared memory of a block of one KV head: WARPS rings (a
    block of ``pack`` KV heads: ``pack`` times this)."""
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

    def launch_bounds(self, v: Variant) -> tuple[int, int]:
        # the register cap of MIN_BLOCKS one-head blocks, for a block of up to HEAD_PACK heads
        return THREADS * MIN_BLOCKS, 1

    def head_pack(self, v: Variant, kv_heads: int, arch: str | None) -> int:
        p = HEAD_PACK
        while p > 1 and (kv_heads % p or not launchable(arch, self.static_smem_budget, p * self.smem(v), p * THREADS)):
            p //= 2
        return p


DECODE_TC = DecodeTc()
