"""paged_mla_seesaw (``kernels_cu/attention/mla_seesaw.cu``): MLA on
wgmma.mma_async, sm_90a only, FlashMLA's "seesaw" schedule: a producer
warpgroup fills a ring of STAGES tiles of TILE_TOKENS tokens, two consumer
warpgroups each own half of the output's value columns and take the tiles in
turn (S and the softmax of its own tiles, P V of every tile on its half).
Serves 16-bit caches (kv dtype q's); an fp8 cache stays with
paged_mla_wgmma."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .mla_tc import MlaTc
from .spec import TC_ROWS

if TYPE_CHECKING:
    from ..variants import Variant

#: Threads of the two consumer warpgroups (mss::kThreads).
CONSUMER_THREADS = 256
#: Threads of the producer warpgroup before them (mss::kProducer).
PRODUCER_THREADS = 128
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 1
#: Tokens per tile (mss::kN): a warpgroup's S is [64 x TILE_TOKENS].
TILE_TOKENS = 32
#: Tile buffers of the ring (mss::kS).
STAGES = 4
#: Bytes of alignment slack before the layout (1024-byte swizzle atoms).
ALIGN_BYTES = 1024
#: Static shared memory selection counts for it (its rows' spans and the ring's per-tile words: 1344
#: bytes with every score feature), below the tensor-core kernels' TC_STATIC_SMEM_BUDGET: with the
#: 230,912 dynamic bytes of R 512 / P 64 it is the 227 KiB a block may hold on sm_90.
STATIC_SMEM_BUDGET = 1536
#: The compile target of every build (CP_TARGET).
TARGET = "sm_90a"
#: (R, P) latent and rotary dims.
DIMS = ((512, 64), (512, 0))
#: The constants mla_seesaw.cu shares with this spec (geometry.header: geom::mla_seesaw).
GEOMETRY = {
    "kConsumerThreads": CONSUMER_THREADS,
    "kProducerThreads": PRODUCER_THREADS,
    "kMinBlocks": MIN_BLOCKS,
    "kN": TILE_TOKENS,
    "kS": STAGES,
    "kAlignBytes": ALIGN_BYTES,
}


def smem_bytes(latent_dim: int, rope_dim: int) -> int:
    """Dynamic shared memory (mss::kSmemBytes): ALIGN_BYTES of alignment, Q
    [TC_ROWS][R + P], STAGES tiles [TILE_TOKENS][R + P], each consumer
    warpgroup's P [TC_ROWS][TILE_TOKENS], 16-bit, and each one's published
    row maxima [2][TC_ROWS] f32."""
    row = (latent_dim + rope_dim) * 2
    return ALIGN_BYTES + TC_ROWS * row + STAGES * TILE_TOKENS * row + 2 * TC_ROWS * TILE_TOKENS * 2 + 2 * TC_ROWS * 4


class MlaSeesaw(MlaTc):
    """paged_mla_tc's defines and shapes over 16-bit caches, its own block
    and layout, built for TARGET."""

    name = "paged_mla_seesaw"
    source = "attention/mla_seesaw"
    threads = CONSUMER_THREADS + PRODUCER_THREADS
    min_blocks = MIN_BLOCKS
    target = TARGET
    dims = DIMS
    fp8 = False
    static_smem_budget = STATIC_SMEM_BUDGET

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.latent_dim, v.rope_dim)


MLA_SEESAW = MlaSeesaw()
