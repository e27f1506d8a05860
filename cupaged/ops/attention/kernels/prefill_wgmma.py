"""paged_prefill_wgmma (``kernels_cu/attention/prefill_wgmma.cu``): prefill
and chunked-prefill attention on wgmma.mma_async, sm_90a only: two computing
warpgroups per block of 128 (query, head) rows (64 each, one m64 wgmma tile)
taking turns on named barriers to issue their products, K / V tiles of
TILE_TOKENS tokens in 128-byte-swizzled column blocks; the ``split`` builds
(16-bit caches at D <= 128) add a producer warpgroup that fills a ring of
STAGES buffers with cp.async and signals each tile (FlashAttention-3's warp
specialization, named barriers for its mbarriers), and run each tile's P V
beside the next tile's S; fp8 and D = 256 copy and compute in the same
warpgroups (tc::run_ring). What paged_prefill_tc serves at the head dims of
WGMMA_TILES, preferred to it where the device's arch is TARGET's (sm_90;
tests/attention/test_prefill_wgmma.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .prefill_tc import PrefillTc, TcTile
from .spec import is_fp8, tc_pair

if TYPE_CHECKING:
    from ..variants import Variant

#: Threads of the computing warpgroups (pwg::kThreads): two, of 64 rows each.
THREADS = 256
#: Threads of the producer warpgroup of the warp-specialized builds (``split``: 16-bit caches at the head
#: dims with 4 or more STAGES), which fill the ring for the computing ones (pwg::kProducer).
PRODUCER_THREADS = 128
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 1
#: Tokens per K / V tile (pwg::kN): S [64 x TILE_TOKENS] per warpgroup.
TILE_TOKENS = 64
#: Bytes of alignment slack before the layout (1024-byte swizzle atoms).
ALIGN_BYTES = 1024
#: The compile target of every build (CP_TARGET).
TARGET = "sm_90a"
#: Tile buffers of the ring per head dim (TC_STAGES), 16-bit caches: five up to D = 128 (split: the
#: consumers hold two, the tile computing and the one whose P V is deferred; the producer up to three more,
#: signalling each two tiles later), two at D = 256 (the tiles' shared memory: smem_bytes).
STAGES = {64: 5, 128: 5, 256: 2}
#: Raw stages of fp8 codes per head dim (one 16-bit K and V tile decoded from them; tc::run_ring).
FP8_STAGES = {64: 3, 128: 3, 256: 2}
#: The tile of each head dim's build (``Variant.tile``: rows 16 x 1 x warps = 128, the rows of
#: schedule.py's blocks); only ``stages`` is a define, the rest is GEOMETRY.
WGMMA_TILES: dict[int, TcTile] = {d: TcTile(THREADS // 32, 1, TILE_TOKENS, s, MIN_BLOCKS) for d, s in STAGES.items()}
#: Head dims (D == Dv).
DIMS = tuple(WGMMA_TILES)


def tile_of(head_dim: int, kv_dtype: str | None = None) -> TcTile:
    """The tile of a build: WGMMA_TILES[head_dim], with FP8_STAGES for an fp8 cache."""
    t = WGMMA_TILES[head_dim]
    return t._replace(stages=FP8_STAGES[head_dim]) if is_fp8(kv_dtype) else t


def split(head_dim: int, kv_dtype: str | None = None) -> bool:
    """Whether the build is warp-specialized (pwg::kSplit): a 16-bit cache and 4 or more stages."""
    return not is_fp8(kv_dtype) and tile_of(head_dim, kv_dtype).stages >= 4


#: The constants prefill_wgmma.cu shares with this spec (geometry.header: geom::prefill_wgmma).
GEOMETRY = {
    "kThreads": THREADS,
    "kMinBlocks": MIN_BLOCKS,
    "kN": TILE_TOKENS,
    "kAlignBytes": ALIGN_BYTES,
    "kProducerThreads": PRODUCER_THREADS,
}


def smem_bytes(head_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory (pwg::kSmemBytes): ALIGN_BYTES of alignment, Q
    [rows][D] and STAGES[D] tiles of K and of V [TILE_TOKENS][D], 16-bit. An
    fp8 cache (``kv_dtype`` e4m3 / e5m2): one 16-bit K and V tile, then
    FP8_STAGES[D] raw stages of K and V codes [TILE_TOKENS][D]."""
    t = tile_of(head_dim, kv_dtype)
    tile = TILE_TOKENS * head_dim * 2
    fp8 = is_fp8(kv_dtype)
    tiles = 2 * (1 if fp8 else t.stages) * tile
    raw = t.stages * 2 * TILE_TOKENS * head_dim if fp8 else 0
    return ALIGN_BYTES + t.rows * head_dim * 2 + tiles + raw


class PrefillWgmma(PrefillTc):
    """paged_prefill_tc's shapes at DIMS, its own block and layout, built for
    TARGET: defines HEAD_DIM and TC_STAGES."""

    name = "paged_prefill_wgmma"
    source = "attention/prefill_wgmma"
    threads = THREADS
    min_blocks = MIN_BLOCKS
    target = TARGET

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        if tc_pair(dtype, kv_dtype):
            for d in DIMS:
                yield dict(head_dim=d, tile=tile_of(d, kv_dtype))

    def defines(self, v: Variant) -> dict[str, Any]:
        return dict(HEAD_DIM=v.head_dim, TC_STAGES=tile_of(v.head_dim, v.kv_dtype).stages)

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.head_dim, v.kv_dtype)

    def block_threads(self, v: Variant) -> int:
        return THREADS + (PRODUCER_THREADS if split(v.head_dim, v.kv_dtype) else 0)

    def resident_blocks(self, v: Variant) -> int:
        return MIN_BLOCKS

    def preference(self, v: Variant) -> int:
        return 0


PREFILL_WGMMA = PrefillWgmma()
