"""A plan's metadata words built on the device (``kernels_cu/plan_build.cu``)
from an engine's device metadata, with no host read of it: vLLM's
``query_start_loc``, ``seq_lens`` and block table, so a CUDA step needs no
device-to-host copy and a CUDA graph can replay the build.

``build_plan_words`` checks shapes, dtypes and sizes on the host
(PagedAttentionError naming the argument) and launches one kernel on the
stream of ``words``; the values are checked on the device (the kernel's
comment and docs/layout.md, "Plans built on the device": bad values give a
plan that reads nothing for them, and set bits of ``status``).
"""

from __future__ import annotations

import numpy as np

from .. import layout
from .._runtime import array_backend, backend_of, checks, get_kernel, register, stream_for
from ..errors import PagedAttentionError

__all__ = [
    "build_plan_words",
    "BAD_QUERY_START",
    "BAD_SEQ_LEN",
    "BAD_PAGE",
    "NEGATIVE_POSITION",
    "STATUS_BITS",
]

THREADS = 256
#: Words a thread writes about (the grid is sized to the words, at most MAX_BLOCKS blocks).
WORDS_PER_THREAD = 8
MAX_BLOCKS = 1024
#: Bits of the status word; the kernel gets them as its CP_BUILD_* defines (DEFINES).
BAD_QUERY_START, BAD_SEQ_LEN, BAD_PAGE, NEGATIVE_POSITION = 1, 2, 4, 8
DEFINES = {
    "CP_BUILD_BAD_QUERY_START": f"{BAD_QUERY_START}u",
    "CP_BUILD_BAD_SEQ_LEN": f"{BAD_SEQ_LEN}u",
    "CP_BUILD_BAD_PAGE": f"{BAD_PAGE}u",
    "CP_BUILD_NEGATIVE_POSITION": f"{NEGATIVE_POSITION}u",
}
#: What each bit means, for messages.
STATUS_BITS = {
    BAD_QUERY_START: "query_start_loc decreasing or spanning more than the plan's queries (the step was padded out)",
    BAD_SEQ_LEN: "a seq_lens value outside 0 .. table_width * page_size (that sequence read nothing)",
    BAD_PAGE: "a block id inside a sequence's length outside 0 .. num_pages - 1 (that page was skipped)",
    NEGATIVE_POSITION: "a sequence with more queries than keys (its first queries at negative positions)",
}
register("plan_build", [DEFINES])


def _int32(name: str, a, ndim: int) -> None:
    if array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if str(a.dtype) != "int32" or a.ndim != ndim:
        raise PagedAttentionError(f"{name}: expected a {ndim}-D int32 array, got {a.dtype} {checks.shape_str(a.shape)}")


def build_plan_words(
    words,
    status,
    query_start_loc,
    seq_lens,
    block_table,
    *,
    queries: int,
    sequences: int,
    table_width: int,
    page_size: int,
    num_pages: int,
) -> None:
    """Stream work (one launch): write into ``words`` (uint32 [>=
    metadata_words(queries, sequences, table_width)], contiguous) the plan
    of one step: query_start_loc int32 [num_seqs + 1], seq_lens int32
    [num_seqs] (kv lengths, this step's tokens included), block_table int32
    [num_seqs, cols] (rows may be strided, columns contiguous; cols <=
    table_width, missing columns no page), num_seqs < sequences. Rows
    num_seqs .. sequences - 1 are padding; the last holds the queries past
    the step's. ``status`` uint32 [1] gets the bits of what the device
    found wrong OR-ed in (``STATUS_BITS``). No allocation, no sync."""
    queries = checks.host_int("queries", queries, 0, layout.U32_MAX)
    sequences = checks.host_int("sequences", sequences, 1, layout.U32_MAX)
    table_width = checks.host_int("table_width", table_width, 1, layout.U32_MAX)
    page_size = checks.host_int("page_size", page_size, 1, layout.MAX_PAGE_SIZE)
    num_pages = checks.host_int("num_pages", num_pages, 1, layout.U32_MAX - 1)
    checks.u32_size("page_table", (sequences, table_width))
    n_words = layout.metadata_words(queries, sequences, table_width)
    checks.u32_size("metadata words", (n_words,))
    for name, a in (("words", words), ("status", status)):
        if array_backend(a) is None:
            raise PagedAttentionError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
        if str(a.dtype) != "uint32" or a.ndim != 1 or not a.flags.c_contiguous:
            raise PagedAttentionError(
                f"{name}: expected a contiguous 1-D uint32 array, got {a.dtype} {checks.shape_str(a.shape)}"
            )
    if words.shape[0] < n_words:
        raise PagedAttentionError(
            f"words: expected at least {n_words} words (queries {queries}, sequences {sequences}, table_width "
            f"{table_width}), got {words.shape[0]}"
        )
    if status.shape[0] < 1:
        raise PagedAttentionError("status: expected at least 1 word, got 0")
    _int32("query_start_loc", query_start_loc, 1)
    _int32("seq_lens", seq_lens, 1)
    _int32("block_table", block_table, 2)
    num_seqs = int(seq_lens.shape[0])
    if num_seqs >= sequences:
        raise PagedAttentionError(
            f"seq_lens: expected at most {sequences - 1} sequences (the plan's {sequences} rows keep the last for "
            f"padding), got {num_seqs}"
        )
    if query_start_loc.shape[0] != num_seqs + 1:
        raise PagedAttentionError(
            f"query_start_loc: expected shape [{num_seqs + 1}] (num_seqs + 1), got "
            f"{checks.shape_str(query_start_loc.shape)}"
        )
    for name, a in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not a.flags.c_contiguous:
            raise PagedAttentionError(f"{name}: expected a contiguous array, got strides {a.strides}")
    rows, cols = (int(x) for x in block_table.shape)
    if rows != num_seqs:
        raise PagedAttentionError(
            f"block_table: expected {num_seqs} rows (one per seq_lens value), got {checks.shape_str(block_table.shape)}"
        )
    if cols > table_width:
        raise PagedAttentionError(
            f"block_table: expected at most {table_width} columns (table_width), got "
            f"{checks.shape_str(block_table.shape)}"
        )
    item = block_table.itemsize
    row_stride = int(block_table.strides[0]) // item if rows > 1 else cols
    if (
        rows
        and cols
        and (
            (cols > 1 and block_table.strides[1] != item)
            or (rows > 1 and (block_table.strides[0] % item or row_stride < cols))
        )
    ):
        raise PagedAttentionError(
            f"block_table: expected contiguous rows (column stride {item} bytes), got strides {block_table.strides}"
        )
    backend_of(words=words, status=status, query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table)
    blocks = max(1, min(MAX_BLOCKS, -(-n_words // (THREADS * WORDS_PER_THREAD))))
    k = get_kernel(words, "plan_build", "plan_build", DEFINES)
    stream_for(words).launch(
        k,
        (blocks,),
        (THREADS,),
        (
            words,
            np.uint32(queries),
            np.uint32(sequences),
            np.uint32(table_width),
            np.uint32(page_size),
            np.uint32(num_pages),
            query_start_loc,
            seq_lens,
            block_table,
            np.uint32(num_seqs),
            np.uint32(cols),
            np.uint64(row_stride),
            status,
        ),
    )
