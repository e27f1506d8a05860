"""paged_prefill_tc (``kernels_cu/attention/prefill_tc.cu``): mma.sync
attention over row-packed blocks of (query, head) rows, K/V tiles through a
cp.async ring; f16 / bf16 q over a cache of q's type or fp8, D == Dv in
DIMS. Each build has its tile (PREFILL_TILES), passed as its defines."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from .spec import PITCH_PAD, TensorCoreSpec, is_fp8, tc_pair

if TYPE_CHECKING:
    from ..variants import Shape, Variant


class TcTile(NamedTuple):
    """The tile of one paged_prefill_tc build: ``warps`` per block, each with
    ``mtiles`` m-tiles of 16 rows (rows per block: 16 x mtiles x warps), K/V
    tiles of ``kv_tile`` tokens through a ring of ``stages`` shared-memory
    buffers, and ``min_blocks`` resident blocks per SM it is designed for
    (its ``__launch_bounds__`` minimum: registers are capped so that many
    fit). Defines TC_WARPS, TC_MTILES, TC_KV_TILE, TC_STAGES, TC_MIN_BLOCKS."""

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


#: Tiles built per head dim, preferred first; selection takes the first
#: that can launch on the device's arch (the later ones exist for archs with
#: less shared memory per block: sm_86 / sm_89, 99 KiB). D <= 128: 128 rows,
#: two m-tiles per warp (each K / V fragment feeds two mma), 3 stages;
#: D = 256 holds 16 rows x 256 f32 accumulators per warp, so one m-tile per
#: warp.
PREFILL_TILES: dict[int, tuple[TcTile, ...]] = {
    64: (TcTile(4, 2, 64, 3, 2),),
    128: (TcTile(4, 2, 32, 3, 2),),
    256: (TcTile(8, 1, 32, 2, 1), TcTile(4, 1, 16, 3, 1)),
}
#: Head dims (D == Dv).
DIMS = tuple(PREFILL_TILES)
#: Q's fragments stay in registers up to mtiles x D of this (tcp::kQInRegs).
Q_REGS_MAX_ELEMS = 128
#: The constants prefill_tc.cu shares with this spec beyond its defines
#: (the tile's: TC_*) (geometry.header: geom::prefill_tc).
GEOMETRY = {"kQRegsMaxElems": Q_REGS_MAX_ELEMS}


def q_in_registers(head_dim: int, tile: TcTile) -> bool:
    """Whether Q's fragments stay in registers (tcp::kQInRegs): then the K/V
    buffers reuse Q's staging area."""
    return tile.mtiles * head_dim <= Q_REGS_MAX_ELEMS


def smem_bytes(head_dim: int, tile: TcTile | None = None, kv_dtype: str | None = None) -> int:
    """Dynamic shared memory: ``stages`` buffers of K and V [kv_tile][D +
    PITCH_PAD], 16-bit, after Q [rows][D + PITCH_PAD], whose area the K/V buffers reuse when Q's
    fragments move to registers (that much: tcp::kRawOff, in elements). An
    fp8 cache (``kv_dtype`` e4m3 / e5m2): one decoded 16-bit K / V tile in
    their place, then ``stages`` raw tiles of K and V codes [kv_tile][D]
    (tcp::kRawStage bytes each). ``tile``: the first of PREFILL_TILES by
    default."""
    t = tile or PREFILL_TILES[head_dim][0]
    fp8 = is_fp8(kv_dtype)
    pitch = (head_dim + PITCH_PAD) * 2
    kv = 2 * (1 if fp8 else t.stages) * t.kv_tile * pitch
    q = t.rows * pitch
    raw = t.stages * 2 * t.kv_tile * head_dim if fp8 else 0
    return (max(q, kv) if q_in_registers(head_dim, t) else q + kv) + raw


def _tile(v: Variant) -> TcTile:
    """``v``'s tile (the first of PREFILL_TILES for a variant without one)."""
    return v.tile or PREFILL_TILES[v.head_dim][0]


class PrefillTc(TensorCoreSpec):
    """HEAD_DIM and the tile's five defines; threads, rows and resident
    blocks are the tile's."""

    name = "paged_prefill_tc"
    source = "attention/prefill_tc"
    fields = ("head_dim", "tile")

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        if tc_pair(dtype, kv_dtype):
            for d in DIMS:
                for t in PREFILL_TILES[d]:
                    yield dict(head_dim=d, tile=t)

    def defines(self, v: Variant) -> dict[str, Any]:
        t = _tile(v)
        return dict(
            HEAD_DIM=v.head_dim,
            TC_WARPS=t.warps,
            TC_MTILES=t.mtiles,
            TC_KV_TILE=t.kv_tile,
            TC_STAGES=t.stages,
            TC_MIN_BLOCKS=t.min_blocks,
        )

    def serves_dims(self, v: Variant, s: Shape) -> bool:
        return not s.rot_dim and s.head_dim == s.value_dim == v.head_dim

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.head_dim, v.tile, v.kv_dtype)

    def block_threads(self, v: Variant) -> int:
        return _tile(v).threads

    def resident_blocks(self, v: Variant) -> int:
        return _tile(v).min_blocks

    def preference(self, v: Variant) -> int:
        tiles = PREFILL_TILES.get(v.head_dim, ())
        return tiles.index(v.tile) if v.tile in tiles else 0


PREFILL_TC = PrefillTc()
