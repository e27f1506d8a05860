"""The tensor-core chunked-prefill kernel (paged_prefill_tc) against the
float64 reference: chunks, odd groups, outputs, device metadata, capture,
selection and fallbacks. On the CPU backend as sm_80 (the ``mma_sync_arch``
fixture): sm_90 selects paged_prefill_wgmma for these shapes
(test_prefill_wgmma.py).

paged_prefill_tc and paged_mla_tc (f16 / bf16, mma.sync; on the CPU backend
through the fragment-exact emulation of kernels_cu/ptx.cuh). P is rounded to
the storage type before O += P V, as in FlashAttention; the dtype tolerances
cover it."""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import TC_DTYPES, _to_device, check, check_capture_replay, run

import cupaged
from cupaged.layout import metadata_offsets
from cupaged.ops.attention import variants
from cupaged.testing import assert_close, make_paged_case, reference

pytestmark = pytest.mark.usefixtures("mma_sync_arch")

# (page_size, head_dim, q_heads, kv_heads): GQA 1 (64 queries a block, so
# blocks straddle sequences), 4 and 8, page sizes 1 / 16 / 64, D 64 / 128 / 256.
PREFILL_SHAPES = [
    (16, 64, 4, 4),
    (1, 128, 8, 2),
    (64, 128, 8, 1),
    (16, 256, 8, 2),
    (64, 64, 16, 2),
]


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "ps{}-d{}-h{}x{}".format(*s))
def test_tc_prefill_chunks(xp_backend, kernels_used, dtype, shape):
    """Prefill chunks of 16..80 queries on top of cached tokens (one sequence
    sitting the step out), causal and not, with and without splits."""
    page_size, d, hq, hkv = shape
    rng = np.random.default_rng(list(shape))
    kv_lens = np.array([95, 41, 30, 130], np.int32)
    q_lens = np.array([80, 16, 0, 33], np.int32)
    case = make_paged_case(
        rng,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"tc prefill {shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {"paged_prefill_tc", "attention_split_merge"}


@pytest.mark.parametrize(
    "shape", [("f16", 96, 1, [1, 2, 1]), ("bf16", 6, 2, [30, 17, 5])], ids=lambda s: "{}-h{}x{}".format(*s[:3])
)
def test_tc_odd_groups(xp_backend, kernels_used, shape):
    """A group of 96 heads (two head tiles of 64 and 32, one query a block:
    MQA decode runs on tensor cores) and a group of 3 (21 queries x 3 heads,
    one row of 64 unused)."""
    dtype, hq, hkv, q_lens = shape
    rng = np.random.default_rng(hq)
    case = make_paged_case(
        rng,
        kv_lens=np.array([50, 23, 70], np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=64,
        dtype=dtype,
    )
    plan = None
    for causal in (True, False):
        for splits in (None, 2):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"{shape} causal={causal} splits={splits}")
    assert "paged_prefill_tc" in kernels_used and "paged_attention" not in kernels_used


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tc_prefill_outputs_and_lse_arguments(xp_backend, kernels_used, dtype):
    """out= and return_lse=False on the tensor-core path, unsplit and split."""
    rng = np.random.default_rng(21)
    case = make_paged_case(
        rng,
        kv_lens=np.array([40, 57], np.int32),
        q_lens=np.array([17, 31]),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        dtype=dtype,
    )
    for splits in (None, 2):
        o, lse, _ = run(xp_backend, case, True, splits=splits, out=True, return_lse=False)
        check(case, o, lse, True, dtype, f"out= splits={splits}")
    assert "paged_prefill_tc" in kernels_used


def test_tc_lengths_read_from_device_words(xp_backend, kernels_used):
    """A prefill plan whose device words are advanced (lengths and positions
    5 further, same queries) gives the reference for the new lengths."""
    rng = np.random.default_rng(23)
    full = make_paged_case(
        rng,
        kv_lens=np.array([45, 30], np.int32),
        q_lens=np.array([20, 16]),
        page_size=8,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype="bf16",
    )
    q, k, v = (_to_device(xp_backend, a) for a in (full.q, full.k_cache, full.v_cache))
    shorter = np.array([40, 25], np.int32)
    plan = cupaged.HostPlan.build(full.page_table, shorter, full.q_lens, 8, full.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    o1 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref1, _ = reference.paged_attention(
        full.q, full.k_cache, full.v_cache, full.page_table, shorter, full.q_lens, full.scale, True
    )
    assert_close(o1, ref1, "bf16", "before")
    plan.words[off["kv_len"] : off["kv_len"] + 2] = xp_backend.asarray(np.array([45, 30], np.uint32))
    pos = np.asarray(xp_backend.to_numpy(plan.words[off["q_pos"] : off["kv_len"]])) + 5
    plan.words[off["q_pos"] : off["kv_len"]] = xp_backend.asarray(pos.astype(np.uint32))
    o2 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref2, _ = full.reference(True)
    assert_close(o2, ref2, "bf16", "after")
    assert set(kernels_used) == {"paged_prefill_tc"}


@pytest.mark.parametrize("dtype,kernel", [("f16", "paged_prefill_tc"), ("f32", "paged_prefill_simt")])
def test_tc_nothing_visible_and_bad_metadata(xp_backend, kernels_used, dtype, kernel):
    """Row-packed prefill (tensor cores for f16, paged_prefill_simt for f32)
    on padded and absurd device metadata: a sequence of length 0 and a query
    with a sequence index out of range get out 0 and lse -inf; garbage
    lengths, positions, page ids and sequence orders never make the kernel
    leave its arrays."""
    rng = np.random.default_rng(24)
    case = make_paged_case(
        rng,
        kv_lens=np.array([20, 30, 25], np.int32),
        q_lens=np.array([16, 16, 20]),
        page_size=4,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        dtype=dtype,
    )
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"]] = 0  # sequence 0: nothing visible
    words[off["q_seq"] + 20] = 0xFFFFFFFF  # query 20 (of sequence 1): bad index
    ref_out, ref_lse = case.reference(True)
    for splits in (None, 4):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 2, 64, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        dead = np.zeros(plan.queries, bool)
        dead[:16] = True
        dead[20] = True
        assert (o[dead] == 0).all() and (lse[dead] == -np.inf).all()
        assert_close(o[~dead], ref_out[~dead], dtype)
        assert_close(lse[~dead], ref_lse[~dead], dtype)
    words[off["kv_len"] : off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"] : off["kv_len"]] = 0xFFFFFFFF
    seqs = rng.integers(0, 3, size=plan.queries).astype(np.uint32)  # out of packing order
    words[off["q_seq"] : off["q_pos"]] = xp_backend.asarray(seqs)
    table = rng.integers(0, 2**32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"] :] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)  # must simply not crash
    assert set(kernels_used) == {kernel, "attention_split_merge"}


def test_tc_capture_and_replay(xp_backend, kernels_used):
    """A captured tensor-core launch (with its shared memory and the merge)
    replays with new q contents."""
    if xp_backend.name != "cpu":
        pytest.skip("GPU capture is covered by the graph tests")
    rng = np.random.default_rng(26)
    case = make_paged_case(
        rng,
        kv_lens=np.array([33, 50], np.int32),
        q_lens=np.array([16, 20]),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        dtype="bf16",
    )
    check_capture_replay(rng, case, "bf16", "replay")
    assert "paged_prefill_tc" in kernels_used


def test_tc_selection():
    """Which variant runs when the step's packing suits the tensor-core
    kernels: f16 / bf16 at a fast dim (the first tile of PREFILL_TILES), or
    MLA at 512 / 64."""
    tc = variants.select_tensor_core
    assert tc("bf16", 128, 128, True, True) == variants.Variant(
        "paged_prefill_tc", "bf16", "bf16", head_dim=128, tile=variants.PREFILL_TILES[128][0]
    )
    assert tc("f16", 64, 64, True, True).head_dim == 64
    assert tc("f16", 256, 256, True, True).head_dim == 256
    assert tc("f16", 128, 128, True, False) is None  # packing unsuited (tc_schedule_ok)
    assert tc("f32", 128, 128, True, True).kernel == "paged_prefill_simt"  # f32: row-packed on CUDA cores
    assert tc("f16", 96, 96, True, True) is None  # not a fast dim
    assert tc("f16", 128, 64, True, True) is None  # Dv != D
    assert tc("f16", 128, 128, False, True) is None  # misaligned
    mla = tc("bf16", 512, 512, True, True, rot_dim=64)
    assert (mla.kernel, mla.latent_dim, mla.rope_dim) == ("paged_mla_tc", 512, 64)
    assert tc("bf16", 512, 512, True, True, rot_dim=32) is None  # other rotary dim
    assert tc("bf16", 576, 576, True, True, rot_dim=64) is None
    registered = {tuple(sorted(v.defines().items())) for v in variants.VARIANTS}
    for dt in TC_DTYPES:
        for d in variants.TC_PREFILL_DIMS:
            assert tuple(sorted(tc(dt, d, d, True, True).defines().items())) in registered
        for r, p in variants.TC_MLA_DIMS:
            assert tuple(sorted(tc(dt, r, r, True, True, rot_dim=p, latent=True).defines().items())) in registered


def _poison(case, seq, positions, cache="v_cache", values=(np.inf, np.nan, -np.inf)):
    """Put Inf / NaN into one element of the value rows of ``seq``'s tokens
    at ``positions`` (all KV heads), in place."""
    arr = getattr(case, cache)
    ps = case.page_size
    for n, t in enumerate(positions):
        page = case.page_table[seq, t // ps]
        arr[page, t % ps, :, (7 * n) % arr.shape[3]] = values[n % len(values)]


def _sees(case, causal):
    """[queries, sequences, positions] is not needed: (q_seq, q_pos) of every packed query."""
    seq = np.repeat(np.arange(len(case.q_lens)), case.q_lens)
    pos = np.concatenate([np.arange(k - q, k) for k, q in zip(case.kv_lens, case.q_lens)])
    return seq, pos


def check_nonfinite(case, o, lse, causal, dtype, poisoned, what):
    """Rows that see no poisoned token: finite and close to the reference
    (out and lse); rows that see one: the reference's Inf / NaN pattern and
    values (out; their lse too when the reference's is finite)."""
    ref_out, ref_lse = case.reference(causal)
    seq, pos = _sees(case, causal)
    sees = np.zeros(len(seq), bool)
    for s, t in poisoned:
        sees |= (seq == s) & ((pos >= t) if causal else True)
    clean = ~sees
    assert np.isfinite(o[clean].astype(np.float64)).all(), f"{what}: a masked Inf/NaN reached a row"
    assert_close(o[clean], ref_out[clean], dtype, f"{what} clean out")
    assert not np.isfinite(ref_out[sees]).all() if sees.any() else True
    assert_close(o[sees], ref_out[sees], dtype, f"{what} seeing rows out")
    if lse is not None:
        keep = clean[:, None] | np.isfinite(ref_lse)
        assert_close(lse[keep], ref_lse[keep], dtype, f"{what} lse")


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize(
    "shape", [(16, 64, 4, 1), (8, 128, 8, 2), (4, 256, 2, 2)], ids=lambda s: "ps{}-d{}-h{}x{}".format(*s)
)
def test_tc_prefill_masked_nonfinite_values(xp_backend, kernels_used, dtype, shape):
    """Issue #12 item 7: Inf / NaN in the value rows of tokens later in a
    chunk never reach the earlier queries, which cannot see them (0 x Inf
    would be NaN in an mma), causal, with and without splits; blocks holding
    two sequences keep one's poison out of the other's rows; rows that see a
    poisoned token match the float64 reference (Inf where it has Inf, NaN
    where it has NaN). Non-causal, every row of the poisoned sequence sees
    them."""
    page_size, d, hq, hkv = shape
    rng = np.random.default_rng([7, *shape])
    kv_lens = np.array([70, 45, 38], np.int32)
    q_lens = np.array([40, 13, 30], np.int32)
    case = make_paged_case(
        rng,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )
    # Sequence 0: tokens past its first queries; sequence 2: its last token.
    poisoned = [(0, 45), (0, 52), (0, 69), (2, 37)]
    for s, t in poisoned:
        _poison(case, s, [t])
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check_nonfinite(case, o, lse, causal, dtype, poisoned, f"{shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {"paged_prefill_tc", "attention_split_merge"}


@pytest.mark.parametrize("what", ["decode", "f32", "dim96", "small-chunk"])
def test_tc_falls_back(xp_backend, kernels_used, what):
    """Shapes off the tensor-core prefill path still run, on another
    kernel: decode steps, f32, other dims, and a step mixing a chunk too
    small for a tensor-core segment (6 queries x 2 heads) with six decode
    queries of a small group (seven sequences in one block). f16 at D 64
    goes to the tensor-core decode kernel, D 96 to the CUDA-core one, an f32
    prefill to the row-packed CUDA-core prefill (test_prefill_simt.py)."""
    rng = np.random.default_rng(25)
    dtype = "f32" if what == "f32" else "f16"
    d = 96 if what == "dim96" else 64
    q_lens = {"decode": [1, 1, 1], "small-chunk": [6] + [1] * 6}.get(what, [20, 17, 16])
    kv_lens = np.array([30, 25, 40, 9, 17, 3, 21][: len(q_lens)], np.int32)
    case = make_paged_case(
        rng,
        kv_lens=kv_lens,
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    o, lse, _ = run(xp_backend, case, True)
    check(case, o, lse, True, dtype, what)
    assert kernels_used == [
        {"decode": "paged_decode_tc", "small-chunk": "paged_decode_tc", "f32": "paged_prefill_simt"}.get(
            what, "paged_attention"
        )
    ]
