"""paged_mla_wgmma (``kernels_cu/attention/mla_wgmma.cu``): MLA on
wgmma.mma_async over fp8 caches, sm_90a only (16-bit caches:
paged_mla_seesaw): two warpgroups per block of TC_ROWS (query, head) rows,
K tiles of TILE_TOKENS tokens in 128-byte-swizzled column blocks; what
paged_mla_tc serves, preferred to it where the device's arch is TARGET's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .mla_tc import MlaTc
from .spec import TC_ROWS, is_fp8

if TYPE_CHECKING:
    from ..variants import Variant

#: Threads per block (mwg::kThreads, the first ``__launch_bounds__``
#: argument): two warpgroups.
THREADS = 256
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 1
#: Tokens per K tile (mwg::kN).
TILE_TOKENS = 64
#: Raw tiles of the ring (mwg::kS).
STAGES = 2
#: Bytes of alignment slack before the layout (1024-byte swizzle atoms).
ALIGN_BYTES = 1024
#: The compile target of every build (CP_TARGET).
TARGET = "sm_90a"
#: (R, P) latent and rotary dims.
DIMS = ((512, 64), (512, 0))
#: The constants mla_wgmma.cu shares with this spec (geometry.header: geom::mla_wgmma).
GEOMETRY = {"kThreads": THREADS, "kMinBlocks": MIN_BLOCKS, "kN": TILE_TOKENS, "kS": STAGES, "kAlignBytes": ALIGN_BYTES}


def smem_bytes(latent_dim: int, rope_dim: int) -> int:
    """Dynamic shared memory (mwg::kSmemBytes): ALIGN_BYTES of alignment, Q's
    latent part [TC_ROWS][R] and the one 16-bit tile [TILE_TOKENS][R + P] the
    codes are converted into, 16-bit, STAGES raw tiles of codes
    [TILE_TOKENS][R + P], P [TC_ROWS][TILE_TOKENS] (16-bit) and the row maxima
    [2][TC_ROWS] f32."""
    tile = TILE_TOKENS * (latent_dim + rope_dim)  # codes
    p_and_maxima = TC_ROWS * TILE_TOKENS * 2 + 2 * TC_ROWS * 4
    return ALIGN_BYTES + TC_ROWS * latent_dim * 2 + 2 * tile + STAGES * tile + p_and_maxima


class MlaWgmma(MlaTc):
    """paged_mla_tc's defines and shapes over fp8 caches (16-bit caches:
    paged_mla_seesaw), its own block and layout, built for TARGET."""

    name = "paged_mla_wgmma"
    source = "attention/mla_wgmma"
    threads = THREADS
    min_blocks = MIN_BLOCKS
    target = TARGET
    dims = DIMS

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        if is_fp8(kv_dtype):
            yield from super().builds(dtype, kv_dtype)

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.latent_dim, v.rope_dim)


MLA_WGMMA = MlaWgmma()
