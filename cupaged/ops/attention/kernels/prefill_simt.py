"""paged_prefill_simt (``kernels_cu/attention/prefill_simt.cu``): CUDA-core
attention over row-packed blocks of (query, head) rows (the rows and the
K/V tile ring of the tensor-core prefill, tc_common.cuh), each thread a
register micro-tile of scores and of outputs; f32 q over an f32 cache, D ==
Dv in DIMS. It serves the f32 steps whose packing suits the row-packed
kernels (schedule.py's tensor-core segments: prefill chunks), on every arch;
decode rows stay on paged_attention."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .spec import TC_ROWS, VECTOR_BYTES, TensorCoreSpec

if TYPE_CHECKING:
    from ..variants import Shape, Variant

#: Threads per block (simt::kThreads; the first ``__launch_bounds__`` argument).
THREADS = 128
#: Threads per block on the CPU backend (CPU_GEOMETRY; CUPAGED_CPU_GEOMETRY=gpu: THREADS there too): one warp,
#: two lanes a row group (ROWS / ROW_TILE groups), so a tile's collectives and meetings switch 32 fibers, not 128.
CPU_THREADS = 32
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 2
#: (query, head) rows per block: the row unit of the tensor-core segments (spec.TC_ROWS).
ROWS = TC_ROWS
#: Rows of a thread's score and output micro-tiles (simt::kRowTile): ROWS / ROW_TILE row groups, each of
#: THREADS * ROW_TILE / ROWS lanes of one warp sharing its rows.
ROW_TILE = 4
#: Tokens per K/V tile (simt::kN): ROW_TILE x ... each lane of a row group scores kN / lanes of its tokens.
KV_TILE = 32
#: Tile buffers of the cp.async ring (simt::kStages).
STAGES = 2
#: Floats added to a shared-memory row (K, V: D + PAD; Q^T and P: ROWS + PAD): 16 bytes, so rows stay
#: 16-byte aligned and a warp's 16-byte loads of K rows of different tokens hit different banks.
PAD = VECTOR_BYTES // 4
#: Head dims (D == Dv).
DIMS = (64, 128)
#: The constants prefill_simt.cu shares with this spec (geometry.header: geom::prefill_simt).
GEOMETRY = {
    "kThreads": THREADS,
    "kMinBlocks": MIN_BLOCKS,
    "kRowTile": ROW_TILE,
    "kN": KV_TILE,
    "kStages": STAGES,
    "kPad": PAD,
}
#: What the CPU backend's builds use instead (geometry.header: under CUPAGED_CPU, unless CUPAGED_GPU_GEOMETRY).
CPU_GEOMETRY = {"kThreads": CPU_THREADS}


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory (f32): Q^T [D][ROWS + PAD], then STAGES buffers
    of K and V [KV_TILE][D + PAD], then P [KV_TILE][ROWS + PAD]."""
    row_pitch = ROWS + PAD
    return 4 * (head_dim * row_pitch + 2 * STAGES * KV_TILE * (head_dim + PAD) + KV_TILE * row_pitch)


class PrefillSimt(TensorCoreSpec):
    """HEAD_DIM; f32 only, one build per dim. A row-packed kernel like the
    tensor-core ones (schedule.py's segments, cp.async-aligned arrays), on
    CUDA cores."""

    name = "paged_prefill_simt"
    source = "attention/prefill_simt"
    threads = THREADS
    cpu_threads = CPU_THREADS
    min_blocks = MIN_BLOCKS
    fields = ("head_dim",)
    fp8 = False

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        if dtype == kv_dtype == "f32":
            for d in DIMS:
                yield dict(head_dim=d)

    def serves_dims(self, v: Variant, s: Shape) -> bool:
        return not s.rot_dim and not s.latent and s.head_dim == s.value_dim == v.head_dim

    def smem(self, v: Variant) -> int:
        return smem_bytes(v.head_dim)


PREFILL_SIMT = PrefillSimt()
