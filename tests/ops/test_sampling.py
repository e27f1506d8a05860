"""row_argmax (kernels_cu/rowwise.cu) against reference.row_argmax on the CPU
backend (and the GPU when there is one): dtypes, odd vocab sizes, rows that
start off a 16-byte boundary, ties, NaN, -inf, every error message, and
capture + replay with logits that change between replays."""

import numpy as np
import pytest

from cupaged import PagedAttentionError, stream_for
from cupaged.ops import sampling as rowwise
from cupaged.testing import as_dtype, reference

DTYPES = ["f32", "f16", "bf16"]


def shifted(xp, x: np.ndarray, offset: int = 0):
    """A copy of host ``x`` in array module ``xp`` (numpy or cupy), C-contiguous
    and starting ``offset`` elements past a 16-byte boundary, so its rows start
    at varying alignments."""
    buf = xp.empty(x.size + 16, x.dtype)
    addr = buf.ctypes.data if xp is np else buf.data.ptr
    start = (-(addr % 16) // x.itemsize) % (16 // x.itemsize) + offset
    y = buf[start : start + x.size].reshape(x.shape)
    y[...] = xp.asarray(x)
    return y


def run_argmax(x: np.ndarray, backend, offset: int = 0) -> np.ndarray:
    """row_argmax of host logits x on ``backend`` (the conftest ``xp_backend``),
    the logits starting ``offset`` elements past a 16-byte boundary; out
    starts as a sentinel."""
    logits = shifted(backend.xp, x, offset)
    out = backend.asarray(np.full(x.shape[0], -7, np.int64))
    assert rowwise.argmax_into(logits, out) is out
    stream_for(logits).synchronize()
    return backend.to_numpy(out)


# ---------------------------------------------------------------- results


@pytest.mark.parametrize("vocab", [1, 7, 1000, 32003])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, vocab, xp_backend):
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((3, vocab)).astype(as_dtype(dtype))
    np.testing.assert_array_equal(run_argmax(x, xp_backend), reference.row_argmax(x))


@pytest.mark.parametrize("offset", [0, 1, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_position_and_alignment(dtype, offset, xp_backend):
    # Row r holds its one maximum at index r, so the maximum visits the
    # scalar head, every lane of the vector body and the scalar tail, at
    # every row alignment (vocab 37: row starts step by 37 elements).
    vocab = 37
    x = np.random.default_rng(offset).uniform(-4, 4, (vocab, vocab))
    x[np.arange(vocab), np.arange(vocab)] = 8
    assert run_argmax(x.astype(as_dtype(dtype)), xp_backend, offset).tolist() == list(range(vocab))


@pytest.mark.parametrize("geometry", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_first_index_wins(dtype, geometry, xp_backend, monkeypatch):
    # in either geometry of the CPU backend: one warp a row, or the GPU's block (cross-warp ties)
    monkeypatch.setenv("CUPAGED_CPU_GEOMETRY", geometry)
    vocab = 32003
    itemsize = np.dtype(as_dtype(dtype)).itemsize
    gpu_block = rowwise.block_size(vocab, itemsize)
    want_block = rowwise.CPU_THREADS if geometry == "cpu" and xp_backend.name == "cpu" else gpu_block
    assert gpu_block > 32 and rowwise.block_size(vocab, itemsize, xp_backend.asarray(np.zeros(1))) == want_block
    x = np.zeros((5, vocab), as_dtype(dtype))
    x[1, [31000, 5000, 20000, 5001]] = 3  # far apart: different threads and warps
    x[2, [vocab - 1, vocab - 2]] = 1  # both in the tail
    x[3, :] = 2  # all equal
    x[4, :] = -1
    x[4, [9, 4000]] = -0.0  # -0.0 ties with the +0.0 after it
    x[4, 17] = 0.0
    got = run_argmax(x, xp_backend)
    assert got.tolist() == [0, 5000, vocab - 2, 0, 9]
    np.testing.assert_array_equal(got, reference.row_argmax(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf(dtype, xp_backend):
    nan, inf = np.nan, np.inf
    vocab = 1000
    x = np.full((7, vocab), -1.0)
    x[0, [700, 300, 999]] = nan  # first NaN wins
    x[1, [5, 6]] = [inf, nan]  # NaN beats +inf
    x[2, :] = -inf  # all -inf: index 0
    x[3, :] = -inf
    x[3, 998] = -5.0
    x[4, :] = nan  # all NaN: index 0
    x[5, [0, 2]] = [inf, inf]
    x[6, 1] = nan  # NaN in the scalar head
    x = x.astype(as_dtype(dtype))
    got = run_argmax(x, xp_backend)
    assert got.tolist() == [300, 6, 0, 998, 0, 0, 1]
    np.testing.assert_array_equal(got, reference.row_argmax(x))


# NaN bit patterns per dtype: the default quiet NaN, a negative NaN, a
# signalling NaN and the largest payload; every one counts as the maximum.
NAN_BITS = {
    "f32": (np.uint32, [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF]),
    "f16": (np.uint16, [0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0xFFFF]),
    "bf16": (np.uint16, [0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFFF]),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payloads_all_count_as_maximum(dtype, xp_backend):
    uint, patterns = NAN_BITS[dtype]
    vocab = 300
    x = np.full((len(patterns) ** 2, vocab), 1.0).astype(as_dtype(dtype))
    bits = x.view(uint)
    expect = []
    for r, (first, second) in enumerate((a, b) for a in patterns for b in patterns):
        bits[r, 40 + r] = first  # both NaN; the first one wins
        bits[r, 100 + r] = second  # whatever the sign or payload
        x[r, 250] = np.inf
        expect.append(40 + r)
    with np.errstate(invalid="ignore"):  # casting a signalling NaN
        assert np.isnan(x.astype(np.float64)[:, 40:].max(axis=1)).all()
    got = run_argmax(x, xp_backend)
    assert got.tolist() == expect
    np.testing.assert_array_equal(got, reference.row_argmax(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_with_many_ties_and_specials(dtype, xp_backend):
    rng = np.random.default_rng(17)
    for vocab in (2, 15, 33, 260, 4097):
        x = rng.integers(-2, 3, size=(16, vocab)).astype(np.float64)
        x[rng.random(x.shape) < 0.02] = np.nan
        x[rng.random(x.shape) < 0.05] = np.inf
        x[rng.random(x.shape) < 0.05] = -np.inf
        x[rng.random(x.shape) < 0.05] = -0.0
        x[:4] *= 1e-6  # tiny rows: subnormal in f16
        x[4:8] = np.where(x[4:8] > 0, -x[4:8], x[4:8])  # non-positive rows: -0.0 and +0.0 compete
        x = x.astype(as_dtype(dtype))
        got = run_argmax(x, xp_backend, int(rng.integers(0, 8)))
        np.testing.assert_array_equal(got, reference.row_argmax(x), err_msg=f"vocab {vocab}")


def test_batch_zero_launches_nothing():
    out = np.zeros(0, np.int64)
    assert rowwise.argmax_into(np.zeros((0, 5), np.float32), out) is out


def test_block_size():
    assert rowwise.block_size(1, 2) == 32
    assert rowwise.block_size(1000, 4) == 64  # 250 vectors: at most 4 per thread
    assert rowwise.block_size(32000, 2) == 1024
    assert rowwise.block_size(10**6, 2) == 1024


def test_argmax_allocating():
    x = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float16)
    got = rowwise.argmax(x)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, reference.row_argmax(x))


# ---------------------------------------------------------------- errors


def _bad(logits, out, message):
    before = None if not isinstance(out, np.ndarray) else out.copy()
    with pytest.raises(PagedAttentionError) as e:
        rowwise.argmax_into(logits, out)
    assert message in str(e.value), str(e.value)
    if before is not None:
        np.testing.assert_array_equal(out, before)  # nothing written before the check


def test_error_messages(monkeypatch):
    f32 = np.zeros((3, 8), np.float32)
    out = np.full(3, -7, np.int64)
    _bad([[1.0]], out, "logits: expected a NumPy or CuPy array, got builtins.list")
    _bad(f32, [0, 0, 0], "out: expected a NumPy or CuPy array, got builtins.list")
    _bad(np.zeros(3, np.float32), out, "logits: expected a 2-D array [batch, vocab], got shape [3]")
    _bad(np.zeros((3, 8), np.int32), out, "logits: expected dtype float32, float16 or bfloat16, got int32")
    _bad(np.zeros((3, 8), np.float64), out, "logits: expected dtype float32, float16 or bfloat16, got float64")
    _bad(np.zeros((3, 16), np.float32)[:, ::2], out, "logits: expected a C-contiguous array, got strides (64, 8)")
    _bad(np.zeros((3, 0), np.float32), out, "logits: expected vocab in 1..2147483647, got shape [3, 0]")
    unaligned = np.frombuffer(np.zeros(100, np.uint8), np.float32, count=24, offset=1).reshape(3, 8)
    _bad(unaligned, out, "logits: expected an address aligned to its 4-byte elements, got 0x")
    monkeypatch.setattr(rowwise, "MAX_BATCH", 2)
    _bad(f32, out, "logits: expected batch <= 2, got shape [3, 8]")
    monkeypatch.setattr(rowwise, "MAX_VOCAB", 7)
    _bad(f32, out, "logits: expected vocab in 1..7, got shape [3, 8]")
    monkeypatch.undo()
    _bad(f32, np.zeros(3, np.int32), "out: expected dtype int64, got int32")
    _bad(f32, np.zeros(3, np.uint64), "out: expected dtype int64, got uint64")
    _bad(f32, np.zeros(4, np.int64), "out: expected shape [3], got [4]")
    _bad(f32, np.zeros((3, 1), np.int64), "out: expected shape [3], got [3, 1]")
    _bad(f32, np.zeros(6, np.int64)[::2], "out: expected a C-contiguous array, got strides (16,)")
    read_only = np.zeros(3, np.int64)
    read_only.flags.writeable = False
    _bad(f32, read_only, "out: expected a writeable array, got a read-only one")
    shared = np.zeros(64, np.uint8)
    _bad(
        shared[:48].view(np.float32).reshape(3, 4),
        shared[16:40].view(np.int64),
        "out: expected memory disjoint from logits, but they overlap",
    )


# ---------------------------------------------------------------- capture and replay


def test_capture_replay_reads_new_logits_with_frozen_arguments():
    rng = np.random.default_rng(3)
    logits = shifted(np, rng.standard_normal((4, 1001)).astype(as_dtype("bf16")), 3)
    out = np.full(4, -7, np.int64)
    stream = stream_for(logits)
    stream.begin_capture()
    try:
        rowwise.argmax_into(logits, out)
        assert out.tolist() == [-7] * 4  # recorded, not run
    finally:
        graph = stream.end_capture()
    assert graph.num_ops == 1

    other = np.zeros((4, 1001), logits.dtype)  # eager work between replays
    other_out = np.full(4, -7, np.int64)
    for trial in range(4):
        new = rng.standard_normal(logits.shape)
        new[trial, 1000 - trial] = 100  # the maximum moves each time
        logits[...] = new  # in place: the captured buffer
        other[...] = rng.standard_normal(other.shape)
        rowwise.argmax_into(other, other_out)
        graph.launch()
        np.testing.assert_array_equal(out, reference.row_argmax(logits))
        assert out[trial] == 1000 - trial
        np.testing.assert_array_equal(other_out, reference.row_argmax(other))

    # A new array bound to the old name is not what the graph reads.
    before = out.copy()
    logits = np.full_like(logits, np.nan)
    graph.launch()
    np.testing.assert_array_equal(out, before)
