"""Sampling kernels over ``[batch, vocab]`` logits (``kernels_cu/sampling.cu``).

``argmax_into`` is greedy sampling for a decode step: checks, then one launch
of ``row_argmax`` on the stream of ``logits``. It allocates nothing and never
synchronises, so it is safe inside stream capture; a captured launch keeps
reading the same ``logits`` buffer and writing the same ``out`` on every replay.

Semantics (``cupaged.testing.reference.row_argmax``): the first index of the maximum;
NaN counts as larger than every number, so the first NaN of a row wins, as with
``numpy.argmax``; -0.0 ties with +0.0.

Memory traffic: read ``batch * vocab`` elements, write ``batch`` int64.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .._runtime import CPU, address, array_backend, backend_of, checks, get_kernel, register, stream_for, xp_of
from .._runtime import cpu as _cpu
from ..errors import PagedAttentionError

register("sampling", [{"CP_DTYPE": t} for t in dtypes.QUERY_TOKENS])

MAX_VOCAB = 2**31 - 1  # indices are 32-bit inside the kernel
MAX_BATCH = 2**31 - 1  # one block per row: the grid.x limit
_VECTOR_BYTES = 16
_MAX_THREADS = 1024
#: Threads per row on the CPU backend: one warp. A block's barriers and reductions switch every fiber (1024 for a
#: 49152-token vocab at float32 on a GPU's geometry); the work per row is the same in either. Measured (SmolLM2-135M
#: f32, batch 8, 2 cores, the engine's decode graph): sample_rows 3.1 ms a step with 1024 threads, 0.67 ms with 32.
CPU_THREADS = 32


def _check_logits(logits) -> None:
    if logits.ndim != 2:
        raise PagedAttentionError(
            f"logits: expected a 2-D array [batch, vocab], got shape {checks.shape_str(logits.shape)}"
        )
    checks.float_array("logits", logits, 2)
    batch, vocab = logits.shape
    if vocab < 1 or vocab > MAX_VOCAB:
        raise PagedAttentionError(
            f"logits: expected vocab in 1..{MAX_VOCAB}, got shape {checks.shape_str(logits.shape)}"
        )
    if batch > MAX_BATCH:
        raise PagedAttentionError(f"logits: expected batch <= {MAX_BATCH}, got shape {checks.shape_str(logits.shape)}")
    if address(logits) % logits.itemsize:
        raise PagedAttentionError(
            f"logits: expected an address aligned to its {logits.itemsize}-byte elements, got {address(logits):#x}"
        )


def _check_out(out, logits) -> None:
    if str(out.dtype) != "int64":
        raise PagedAttentionError(f"out: expected dtype int64, got {dtypes.dtype_name(out.dtype)}")
    checks.shape_is("out", out, logits.shape[:1])
    if not out.flags.c_contiguous:
        raise PagedAttentionError(f"out: expected a C-contiguous array, got strides {tuple(out.strides)}")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise PagedAttentionError("out: expected a writeable array, got a read-only one")
    checks.no_overlap("out", out, logits=logits)


def block_size(vocab: int, itemsize: int, like=None) -> int:
    """Threads per row: a power of two in 32..1024, the smallest giving each
    thread at most four 16-byte vectors of the row; on the CPU backend
    (``like`` a NumPy array) ``CPU_THREADS``, unless CUPAGED_CPU_GEOMETRY=gpu."""
    if like is not None and array_backend(like) == CPU and _cpu.geometry_mode() == "cpu":
        return CPU_THREADS
    vectors = -(-vocab * itemsize // _VECTOR_BYTES)
    threads = 32
    while threads < _MAX_THREADS and 4 * threads < vectors:
        threads *= 2
    return threads


def argmax_into(logits, out):
    """Write the argmax of each row of ``logits`` into ``out``.

    logits: [batch, vocab] float32, float16 or bfloat16, C-contiguous, vocab >= 1.
    out: [batch] int64, C-contiguous, preallocated, on the backend and device of
    ``logits`` and disjoint from it. batch == 0 launches nothing.
    Returns ``out``. Raises PagedAttentionError before launching on bad input.
    """
    backend_of(logits=logits, out=out)
    _check_logits(logits)
    _check_out(out, logits)
    batch, vocab = logits.shape
    if batch == 0:
        return out
    kernel = get_kernel(logits, "sampling", "row_argmax", {"CP_DTYPE": dtypes.token(logits.dtype)})
    stream_for(logits).launch(
        kernel, (batch,), (block_size(vocab, logits.itemsize, logits),), (logits, out, np.uint32(vocab))
    )
    return out


def argmax(logits):
    """``argmax_into`` with a freshly allocated ``out`` [batch] int64 (not for
    use inside stream capture on the GPU, which forbids allocation)."""
    backend_of(logits=logits)
    _check_logits(logits)
    out = xp_of(logits).empty(logits.shape[:1], dtype=np.int64)
    return argmax_into(logits, out)
