"""paged_mla_tc (``kernels_cu/attention/mla_tc.cu``): MLA on mma.sync, row-packed
blocks of TC_ROWS (query, head) rows, K tiles of TILE_TOKENS tokens through a
cp.async ring of STAGES buffers; f16 / bf16 q over a cache of q's type or fp8, the
(R, P) latent and rotary dims of DIMS, V the latent itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .spec import PITCH_PAD, TC_ROWS, TensorCoreSpec, is_fp8, tc_pair

if TYPE_CHECKING:
    from ..variants import Shape, Variant

#: Warps per block (tcm::kWarps).
WARPS = 8
#: Threads per block (tcm::kThreads; the first ``__launch_bounds__`` argument).
THREADS = 32 * WARPS
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 1
#: Tokens per K tile (tcm::kN).
TILE_TOKENS = 32
#: Tile buffers of the ring (tcm::kS): 16-bit K tiles, or with an fp8 cache
#: raw tiles of codes (then one 16-bit tile they are converted into).
STAGES = 2
#: (R, P) latent and rotary dims (P = 0: no rotary part, an MLA call with
#: q_pos = k_pos = None).
DIMS = ((512, 64), (512, 0))
#: The constants mla_tc.cu shares with this spec (geometry.header: geom::mla_tc).
GEOMETRY = {"kWarps": WARPS, "kThreads": THREADS, "kMinBlocks": MIN_BLOCKS, "kN": TILE_TOKENS, "kS": STAGES}


def smem_bytes(latent_dim: int, rope_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory: Q [TC_ROWS][R + P + PITCH_PAD], STAGES K
    buffers [TILE_TOKENS][R + P + PITCH_PAD] (tcm::kTileBufs) and P
    [TC_ROWS][TILE_TOKENS + PITCH_PAD], 16-bit. An fp8 cache (``kv_dtype``
    e4m3 / e5m2): one 16-bit K buffer, then STAGES raw tiles of codes
    [TILE_TOKENS][R + P] after P (sRaw)."""
    k = latent_dim + rope_dim
    bufs, raw = STAGES, 0
    if is_fp8(kv_dtype):
        bufs, raw = 1, STAGES * TILE_TOKENS * k
    return (TC_ROWS + bufs * TILE_TOKENS) * (k + PITCH_PAD) * 2 + TC_ROWS * (TILE_TOKENS + PITCH_PAD) * 2 + raw


class MlaTc(TensorCoreSpec):
    """LATENT_DIM, ROPE_DIM: R and P."""

    name = "paged_mla_tc"
    source = "attention/mla_tc"
    threads = THREADS
    min_blocks = MIN_BLOCKS
    fields = ("latent_dim", "rope_dim")
    dims: tuple[tuple[int, int], ...] = DIMS

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        if tc_pair(dtype, kv_dtype):
            for r, p in self.dims:
                yield dict(latent_dim=r, rope_dim=p)

    def serves_dims(self, v: Variant, s: Shape) -> bool:
        # V is the latent (K) itself; without a rotary part only an MLA call
        # (``Shape.latent``) says so.
        return s.value_dim == s.head_dim == v.latent_dim and s.rot_dim == v.rope_dim and bool(s.rot_dim or s.latent)

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.latent_dim, v.rope_dim, v.kv_dtype)


MLA_TC = MlaTc()
