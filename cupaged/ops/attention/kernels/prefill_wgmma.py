"""paged_prefill_wgmma (``kernels_cu/attention/prefill_wgmma.cu``): prefill
and chunked-prefill attention on wgmma.mma_async, sm_90a only: two
warpgroups per block of 128 (query, head) rows (64 each, one m64 wgmma tile),
K / V tiles of TILE_TOKENS tokens in 128-byte-swizzled column blocks through
a cp.async ring, the warpgroups taking turns on named barriers to issue
their products (and, for 16-bit caches at 3 stages, each tile's P V beside
the next tile's S); what paged_prefill_tc serves at the head dims of
WGMMA_TILES, preferred to it where the device's arch is TARGET's (sm_90;
tests/attention/test_prefill_wgmma.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .prefill_tc import PrefillTc, TcTile
from .spec import is_fp8, tc_pair

if TYPE_CHECKING:
    from ..variants import Variant

#: Threads per block (pwg::kThreads, the first ``__launch_bounds__``
#: argument): two warpgroups.
THREADS = 256
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 1
#: Tokens per K / V tile (pwg::kN): S [64 x TILE_TOKENS] per warpgroup.
TILE_TOKENS = 64
#: Bytes of alignment slack before the layout (1024-byte swizzle atoms).
ALIGN_BYTES = 1024
#: The compile target of every build (CP_TARGET).
TARGET = "sm_90a"
#: Tile buffers of the ring per head dim (TC_STAGES): three up to D = 128, two at D = 256
#: (the tiles' shared memory: smem_bytes).
STAGES = {64: 3, 128: 3, 256: 2}
#: The tile of each head dim's build (``Variant.tile``: rows 16 x 1 x warps = 128, the rows of
#: schedule.py's blocks); only ``stages`` is a define, the rest is GEOMETRY.
WGMMA_TILES: dict[int, TcTile] = {d: TcTile(THREADS // 32, 1, TILE_TOKENS, s, MIN_BLOCKS) for d, s in STAGES.items()}
#: Head dims (D == Dv).
DIMS = tuple(WGMMA_TILES)
#: The constants prefill_wgmma.cu shares with this spec (geometry.header: geom::prefill_wgmma).
GEOMETRY = {"kThreads": THREADS, "kMinBlocks": MIN_BLOCKS, "kN": TILE_TOKENS, "kAlignBytes": ALIGN_BYTES}


def smem_bytes(head_dim: int, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory (pwg::kSmemBytes): ALIGN_BYTES of alignment, Q
    [rows][D] and STAGES[D] tiles of K and of V [TILE_TOKENS][D], 16-bit. An
    fp8 cache (``kv_dtype`` e4m3 / e5m2): one 16-bit K and V tile, then
    STAGES[D] raw stages of K and V codes [TILE_TOKENS][D]."""
    t = WGMMA_TILES[head_dim]
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
                yield dict(head_dim=d, tile=WGMMA_TILES[d])

    def defines(self, v: Variant) -> dict[str, Any]:
        return dict(HEAD_DIM=v.head_dim, TC_STAGES=WGMMA_TILES[v.head_dim].stages)

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.head_dim, v.kv_dtype)

    def block_threads(self, v: Variant) -> int:
        return THREADS

    def resident_blocks(self, v: Variant) -> int:
        return MIN_BLOCKS

    def preference(self, v: Variant) -> int:
        return 0


PREFILL_WGMMA = PrefillWgmma()
