"""Paged attention on the CUDA-core kernel (kernels_cu/attention/, through
DevicePlan.attention) against the float64 reference, on the CPU backend and,
unchanged, on a GPU: decode and chunked prefill, splits, outputs, device
metadata, NaN safety, capture, variant selection.

Every case comes from ``cupaged.testing.make_paged_case``: random page
permutations, lengths that are not multiples of the page size, NaN in every
unused cache slot and a huge sentinel in every unused page-table entry, so a
kernel that reads anything it should not produces NaN or crashes.
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import DTYPES, TC_PREFILL, _to_device, check, check_decode_guesses, run

import cupaged
from cupaged.layout import metadata_offsets
from cupaged.ops.attention import variants
from cupaged.ops.attention.kernels import decode_tc
from cupaged.testing import assert_close, make_paged_case, reference


@pytest.fixture(autouse=True)
def cuda_core_kernel(monkeypatch, kernels_used):
    """Every test here runs paged_attention: the one selection rule would give
    f16 / bf16 decodes at D 64 / 128 to paged_decode_tc (test_decode_tc.py),
    so its smallest group is moved out of reach for this file."""
    monkeypatch.setattr(decode_tc, "MIN_GROUP", 1 << 30)
    yield
    assert "paged_decode_tc" not in kernels_used


# ----------------------------------------------------------------- decode

# (page_size, head_dim, head_dim_v, q_heads, kv_heads): fast dims 64/128/256,
# runtime dims 80/96/5 and Dv != D, GQA ratios 1, 2, 3, 4, 8 and 16 (two tiles); 3 also at D 64.
DECODE_SHAPES = [
    (16, 64, None, 4, 4),
    (1, 128, None, 8, 2),
    (64, 96, None, 8, 1),
    (16, 80, None, 6, 2),
    (16, 5, 7, 4, 1),
    (16, 256, None, 2, 1),
    (3, 128, 64, 16, 1),
    (16, 64, None, 9, 3),  # a group of 3 on the fast path: GROUP_TILE 3
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "ps{}-d{}-dv{}-h{}x{}".format(*s))
def test_decode(xp_backend, dtype, shape):
    page_size, d, dv, hq, hkv = shape
    rng = np.random.default_rng([x or 0 for x in shape])
    case = make_paged_case(
        rng,
        sequences=3,
        max_kv_len=70,
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        head_dim_v=dv,
        dtype=dtype,
    )
    o, lse, _ = run(xp_backend, case, causal=True)
    check(case, o, lse, True, dtype, f"decode {shape}")


# (dtype, head_dim, head_dim_v, q_heads, kv_heads): two chunks per lane (f32 256),
# the largest capacities (512, 1024, with Dv != D), one element per row (1).
@pytest.mark.parametrize(
    "shape",
    [
        ("f32", 256, None, 8, 1),
        ("f16", 512, None, 4, 1),
        ("bf16", 1000, 1024, 4, 2),
        ("f32", 1, 1, 2, 1),
        ("f16", 24, 200, 5, 5),
    ],
    ids=lambda s: "{}-d{}-dv{}-h{}x{}".format(*s),
)
def test_large_and_odd_dims(xp_backend, shape):
    dtype, d, dv, hq, hkv = shape
    rng = np.random.default_rng(d)
    case = make_paged_case(
        rng,
        kv_lens=np.array([19, 33], np.int32),
        q_lens=np.array([1, 2]),
        page_size=8,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        head_dim_v=dv,
        dtype=dtype,
    )
    for causal in (True, False):
        o, lse, _ = run(xp_backend, case, causal)
        check(case, o, lse, causal, dtype, f"{shape} causal={causal}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_chunk_on_cached_tokens(xp_backend, dtype, causal):
    """Multi-token queries on top of cached tokens (chunked prefill), a
    sequence sitting the step out (q_len 0) and one that is all new."""
    rng = np.random.default_rng(11)
    kv_lens = np.array([37, 20, 9, 50], np.int32)
    q_lens = np.array([13, 0, 9, 1], np.int32)
    case = make_paged_case(
        rng, kv_lens=kv_lens, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype
    )
    o, lse, _ = run(xp_backend, case, causal=causal)
    check(case, o, lse, causal, dtype, f"prefill causal={causal}")


@pytest.mark.parametrize(
    "shape", [(1, 64, 4, 4), (16, 96, 8, 2), (64, 128, 8, 1)], ids=lambda s: "ps{}-d{}-h{}x{}".format(*s)
)
def test_multi_chunk_prefill(xp_backend, shape):
    """A prompt fed in three chunks; each chunk's output equals the reference
    for the whole prefix (the cache already holds earlier chunks)."""
    page_size, d, hq, hkv = shape
    rng = np.random.default_rng(5)
    total = np.array([45, 30], np.int32)
    for done in ([0, 0], [17, 11], [33, 24]):
        done = np.array(done, np.int32)
        kv_lens = np.minimum(total, done + 12)
        q_lens = kv_lens - done
        case = make_paged_case(
            rng,
            kv_lens=kv_lens,
            q_lens=q_lens,
            page_size=page_size,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype="f16",
        )
        o, lse, _ = run(xp_backend, case, causal=True)
        check(case, o, lse, True, "f16", f"chunk at {done.tolist()}")


# ----------------------------------------------------------------- splits


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_split_count(xp_backend, dtype):
    rng = np.random.default_rng(3)
    case = make_paged_case(
        rng,
        kv_lens=np.array([150, 61, 3, 97], np.int32),
        q_lens=np.array([1, 4, 2, 1]),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
    )
    plan = None
    for splits in range(1, 12):
        for causal in (True, False):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"splits={splits} causal={causal}")


def test_max_splits_tiny(xp_backend):
    """MAX_SPLITS on a tiny case: almost every split is empty (lse -inf)."""
    rng = np.random.default_rng(4)
    case = make_paged_case(
        rng, kv_lens=np.array([5, 40], np.int32), page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="f32"
    )
    for causal in (True, False):
        o, lse, _ = run(xp_backend, case, causal, splits=cupaged.MAX_SPLITS)
        check(case, o, lse, causal, "f32", f"MAX_SPLITS causal={causal}")


@pytest.mark.parametrize(
    "dtype, q_lens, heads, kernel",
    [
        ("f32", None, (2, 2), "paged_attention"),
        ("f16", [20, 16], (4, 2), TC_PREFILL),
    ],
    ids=["cuda-core", "tensor-core"],
)
def test_split_partials_follow_layout(xp_backend, kernels_used, dtype, q_lens, heads, kernel):
    """Each kernel's split partials are the layout's: split z of a query with
    L positions covers [z c, min(L, (z + 1) c)), c = ceil(L / splits) rounded
    up to SPLIT_TILE; compared with reference.split_attention_partials."""
    rng = np.random.default_rng(8)
    kv_lens = np.array([100, 33], np.int32)
    case = make_paged_case(
        rng,
        kv_lens=kv_lens,
        q_lens=None if q_lens is None else np.array(q_lens),
        page_size=16,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        dtype=dtype,
    )
    splits = 3
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(q)
    ws = cupaged.SplitWorkspace(plan.queries, heads[0], 64, splits, q)
    plan.attention(q, k, v, case.scale, False, workspace=ws)
    tile = variants.SPLIT_TILE
    size = [-(-(-(-int(n) // splits)) // tile) * tile for n in kv_lens]
    ref_out, ref_lse = reference.split_attention_partials(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        case.kv_lens,
        case.q_lens,
        case.scale,
        size,
        splits,
        causal=False,
    )
    assert_close(xp_backend.to_numpy(ws.partial_lse), ref_lse, dtype, "partial lse")
    assert_close(xp_backend.to_numpy(ws.partial_out), ref_out, dtype, "partial out")
    assert kernels_used[0] == kernel


# ----------------------------------------------------------------- outputs


def test_a_decode_step_guesses_its_pages_with_its_words(xp_backend, kernels_used):
    """paged_attention guesses its share as paged_decode_tc does (a decode
    step of the plan's longest length, kv_len_hint) and loads its first rows'
    page words beside the query's words: a decode step of equal lengths
    never takes the slow paths (marked cold); otherwise they run exactly
    where a guess was wrong (check_decode_guesses), and every output is the
    reference's."""
    if xp_backend.name != "cpu":
        pytest.skip("the markers count on the CPU backend")
    lengths = (([70] * 3, [1] * 3), ([70, 25, 41], [1] * 3), ([70, 25, 41], [2, 0, 1]))
    check_decode_guesses(
        xp_backend,
        "paged_attention",
        np.random.default_rng(24),
        lengths,
        (None, 3),
        "f32",
        page_size=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("return_lse", [True, False])
def test_out_and_lse_arguments(xp_backend, splits, return_lse):
    rng = np.random.default_rng(6)
    case = make_paged_case(rng, sequences=2, max_kv_len=40, num_q_heads=4, num_kv_heads=4, head_dim=64, dtype="f16")
    o, lse, _ = run(xp_backend, case, True, splits=splits, out=True, return_lse=return_lse)
    check(case, o, lse, True, "f16", f"out= splits={splits} lse={return_lse}")
    assert (lse is None) == (not return_lse)


def test_preallocated_lse_is_written(xp_backend):
    rng = np.random.default_rng(12)
    case = make_paged_case(rng, sequences=2, max_kv_len=30, num_q_heads=2, head_dim=64, dtype="f32")
    q, k, v = (xp_backend.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    lse = xp_backend.xp.full((plan.queries, 2), 5.0, dtype=np.float32)
    o, lse_out = plan.attention(q, k, v, case.scale, True, lse=lse)
    assert lse_out is lse
    check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), True, "f32")


def test_misaligned_arrays_use_element_loads(xp_backend):
    """Arrays that start 2 bytes past a 16-byte boundary still give the
    right answer (the launcher falls back to element loads)."""
    rng = np.random.default_rng(9)
    case = make_paged_case(rng, sequences=2, max_kv_len=40, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="f16")

    def shifted(a):
        buf = np.empty(a.size + 16, a.dtype)
        start = ((-(buf.ctypes.data % 16)) % 16) // a.itemsize + 1
        x = buf[start : start + a.size].reshape(a.shape)
        x[...] = a
        return x

    def shifted_device(a):
        if xp_backend.name == "cpu":
            return shifted(a)
        buf = xp_backend.xp.empty(a.size + 8, a.dtype)  # CuPy buffers start 256-byte aligned
        x = buf[1 : 1 + a.size].reshape(a.shape)
        x[...] = xp_backend.asarray(a)
        return x

    q, k, v = (shifted_device(a) for a in (case.q, case.k_cache, case.v_cache))
    assert int(q.ctypes.data if xp_backend.name == "cpu" else q.data.ptr) % 16 != 0
    assert variants.select_variant("f16", 64, 64, False, 2).vec_loads == 0
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True)
    check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), True, "f16", "misaligned")


# ----------------------------------------------------------------- metadata


def test_lengths_read_from_device_words(xp_backend):
    """A plan whose device words are rewritten (a decode loop advancing
    lengths on the device) gives the reference for the new lengths: nothing
    about lengths is baked into the launch."""
    rng = np.random.default_rng(10)
    full = make_paged_case(
        rng, kv_lens=np.array([40, 25], np.int32), page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="f32"
    )
    q, k, v = (xp_backend.asarray(a) for a in (full.q, full.k_cache, full.v_cache))
    shorter = np.array([33, 18], np.int32)
    # Plan built for the shorter lengths (tables hold every page of the full lengths).
    plan = cupaged.HostPlan.build(full.page_table, shorter, full.q_lens, 8, full.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    o1 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref1, _ = reference.paged_attention(
        full.q, full.k_cache, full.v_cache, full.page_table, shorter, full.q_lens, full.scale, True
    )
    assert_close(o1, ref1, "f32", "before")
    # Advance both sequences to their full length on the device.
    plan.words[off["kv_len"] : off["kv_len"] + 2] = xp_backend.asarray(np.array([40, 25], np.uint32))
    plan.words[off["q_pos"] : off["q_pos"] + 2] = xp_backend.asarray(np.array([39, 24], np.uint32))
    o2 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref2, _ = full.reference(True)
    assert_close(o2, ref2, "f32", "after")


def test_nothing_visible_and_bad_metadata(xp_backend):
    """Padded device metadata: a query whose sequence has length 0 gets out 0
    and lse -inf; a sequence index out of range likewise; absurd lengths,
    positions and page ids never make the kernel leave its arrays."""
    rng = np.random.default_rng(13)
    case = make_paged_case(
        rng,
        kv_lens=np.array([20, 30, 10], np.int32),
        page_size=4,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        dtype="f32",
    )
    q, k, v = (xp_backend.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"]] = 0  # sequence 0: nothing visible
    words[off["q_seq"] + 1] = 0xFFFFFFFF  # query 1: sequence out of range
    for splits in (None, 4):
        ws = None if splits is None else cupaged.SplitWorkspace(3, 2, 64, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        assert (o[:2] == 0).all() and (lse[:2] == -np.inf).all()
        ref_out, ref_lse = case.reference(True)
        assert_close(o[2], ref_out[2], "f32")
        assert_close(lse[2], ref_lse[2], "f32")
    # Absurd metadata: huge lengths and positions, garbage page ids everywhere.
    words[off["kv_len"] : off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"] : off["kv_len"]] = 0xFFFFFFFF
    words[off["q_seq"] : off["q_pos"]] = xp_backend.asarray(np.array([0, 1, 2], np.uint32))
    table = rng.integers(0, 2**32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"] :] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)  # must simply not crash


def test_nan_never_reaches_the_output(xp_backend):
    """Every unused slot is NaN (the tail of each last page, the extra pages),
    including slots inside pages a sequence owns, and page size 1 and 64."""
    for page_size in (1, 64):
        rng = np.random.default_rng(page_size)
        case = make_paged_case(
            rng,
            sequences=3,
            max_kv_len=70,
            page_size=page_size,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=128,
            dtype="bf16",
            extra_pages=3,
        )
        assert np.isnan(case.k_cache.astype(np.float32)).any()
        for causal in (True, False):
            o, lse, _ = run(xp_backend, case, causal)
            check(case, o, lse, causal, "bf16", f"page_size={page_size}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_query_propagates(xp_backend, kernels_used, dtype):
    """A NaN in one query row gives that row NaN output and lse, as the
    reference does; the kernel used to skip a row group whose scores were
    all NaN (fmaxf drops NaN) and return 0 with lse -inf (issue #12 item 9).
    Every other row is unchanged."""
    rng = np.random.default_rng(72)
    case = make_paged_case(
        rng, kv_lens=np.array([40, 70], np.int32), page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype
    )
    case.q[1, 5, 17] = np.nan
    ref_out, ref_lse = case.reference(True)
    assert np.isnan(ref_out[1, 5]).all() and np.isnan(ref_lse[1, 5])
    for splits in (None, 3):
        o, lse, _ = run(xp_backend, case, True, splits=splits)
        assert np.isnan(o[1, 5].astype(np.float32)).all() and np.isnan(lse[1, 5]), splits
        mask = np.ones(o.shape[:2], bool)
        mask[1, 5] = False
        assert_close(o[mask], ref_out[mask], dtype, f"other rows, splits={splits}")
        assert_close(lse[mask], ref_lse[mask], dtype)
    assert "paged_attention" in kernels_used


def test_capture_and_replay(xp_backend):
    """A captured launch replays with new q contents (grid and arguments
    frozen, data read at replay)."""
    if xp_backend.name != "cpu":
        pytest.skip("GPU capture is covered by the graph tests")
    rng = np.random.default_rng(14)
    case = make_paged_case(rng, sequences=2, max_kv_len=30, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="f32")
    q = case.q.copy()
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    out = np.zeros((plan.queries, 4, 64), np.float32)
    ws = cupaged.SplitWorkspace(plan.queries, 4, 64, 2, q)
    stream = cupaged.stream_for(q)
    stream.begin_capture()
    plan.attention(q, case.k_cache, case.v_cache, case.scale, True, out=out, workspace=ws)
    graph = stream.end_capture()
    assert (out == 0).all()
    q[...] = rng.standard_normal(q.shape).astype(np.float32)
    graph.launch()
    ref, _ = reference.paged_attention(
        q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, True
    )
    assert_close(out, ref, "f32", "replay")


# ----------------------------------------------------------------- dispatch


def test_variant_selection():
    sel = variants.select_variant
    assert sel("f16", 128, 128, True, 8).defines() == {
        "CP_DTYPE": "f16",
        "CP_KV_DTYPE": "f16",
        "CP_SCORE": "plain",
        "HEAD_DIM": 128,
        "GROUP_TILE": 8,
    }
    assert sel("bf16", 64, 64, True, 1).group_tile == 1
    assert sel("f32", 256, 256, True, 3).group_tile == 3  # one tile of 3: no padded head (SmolLM2's 9 / 3)
    assert sel("f16", 128, 128, True, 6).group_tile == 8  # one tile (fewest K/V re-reads) before two of 3
    # Group of 12 in two tiles of 6 -> tile 8; group of 16 in two tiles of 8.
    assert sel("f16", 128, 128, True, 12).group_tile == 8
    assert sel("f16", 128, 128, True, 16).group_tile == 8
    assert sel("f16", 96, 96, True, 4).defines() == {
        "CP_DTYPE": "f16",
        "CP_KV_DTYPE": "f16",
        "CP_SCORE": "plain",
        "DIM_CAP": 128,
        "VEC_LOADS": 1,
        "GROUP_TILE": 4,
    }
    assert sel("f16", 5, 7, True, 1).defines() == {
        "CP_DTYPE": "f16",
        "CP_KV_DTYPE": "f16",
        "CP_SCORE": "plain",
        "DIM_CAP": 64,
        "VEC_LOADS": 0,
        "GROUP_TILE": 1,
    }
    assert sel("f16", 128, 128, False, 1).vec_loads == 0
    assert sel("f32", 1024, 1000, True, 8).group_tile == 2
    # Every selectable variant is registered for the NVRTC gate.
    registered = {tuple(sorted(v.defines().items())) for v in variants.VARIANTS}
    for dt in DTYPES:
        for d in (1, 5, 63, 64, 80, 96, 128, 200, 256, 300, 512, 576, 1024):
            for dv in (d, 64, 1024):
                for g in (1, 2, 3, 4, 5, 8, 12, 16, 64):
                    for aligned in (True, False):
                        assert tuple(sorted(sel(dt, d, dv, aligned, g).defines().items())) in registered
