"""The tensor-core decode kernel (paged_decode_tc, kernels_cu/attention/decode_tc.cu)
against the float64 reference, on the CPU backend (mma.sync, ldmatrix and
cp.async through the fragment-exact emulation of kernels_cu/ptx.cuh) and,
unchanged, on a GPU: GQA groups 1 to 24 (two head tiles), page sizes 1 to
64, D 64 / 128, f16 / bf16, causal and not, every split count, multi-query
sequences, mixed steps, lengths from the device words, padded and absurd
metadata, NaN-poisoned unused slots, Inf / NaN in rows only later queries
see, a NaN query, capture and replay; and which per-query kernel the one
selection rule picks.

P is rounded to the storage type before O += P V, as in FlashAttention; the
dtype tolerances cover it.
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import (
    DECODE_TC,
    TC_DTYPES,
    _to_device,
    check,
    check_capture_replay,
    check_decode_guesses,
    run,
)
from storage_helpers import FP8

import cupaged
from cupaged.layout import metadata_offsets
from cupaged.ops.attention import variants
from cupaged.ops.attention.kernels import decode, decode_tc
from cupaged.testing import assert_close, make_paged_case, reference


@pytest.fixture(autouse=True)
def per_query_only(monkeypatch):
    """Every query of these steps on the per-query kernel: sequences bringing
    16 or more (query, head) rows (a group of 20, a 3-query sequence at
    G = 8) would otherwise go to paged_prefill_tc by the segment rules
    (schedule.tc_segments), which test_schedule.py covers."""
    from cupaged.ops.attention import schedule

    monkeypatch.setattr(schedule, "select_tensor_core", lambda *a, **k: None)


# (page_size, head_dim, q_heads, kv_heads): GQA 4 (the benchmark's 32/8),
# 8, 1, 3, 12 and 20 (two head tiles, 16 + 4 heads), page sizes 1 / 3 / 5 / 8 /
# 16 / 64; blocks of 4 KV heads (8 and 4 KV heads), of 2 (2, and 6: three
# packs; two head tiles of each head of a pack) and of 1.
SHAPES = [
    (16, 128, 32, 8),
    (1, 64, 8, 1),
    (3, 128, 4, 4),
    (5, 64, 6, 2),
    (64, 64, 24, 2),
    (16, 128, 20, 1),
    (16, 64, 40, 2),
    (8, 128, 12, 6),
]


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "ps{}-d{}-h{}x{}".format(*s))
def test_decode_tc(xp_backend, kernels_used, dtype, shape):
    """Decode steps (one query per sequence) and a few short multi-query
    sequences (each query its own block), causal and not, with and without
    splits."""
    page_size, d, hq, hkv = shape
    rng = np.random.default_rng(list(shape))
    kv_lens = np.array([70, 1, 33, 150, 16], np.int32)
    q_lens = np.array([1, 1, 3, 1, 2], np.int32)
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
            check(case, o, lse, causal, dtype, f"decode_tc {shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {DECODE_TC, "attention_split_merge"}


@pytest.mark.parametrize("page_size, general", [(16, False), (32, False), (48, False), (8, True), (24, True)])
def test_page_walks(xp_backend, kernels_used, page_size, general):
    """Both page walks: page sizes that are multiples of 16 (a tile in one
    page: one page-table word a tile) and the others (a token per lane),
    lengths around the page and tile boundaries, split and not, against the
    reference; on the CPU, the general walk's cold-path marker counts
    exactly when that walk runs."""
    from cupaged._runtime import get_kernel
    from cupaged.ops.attention import inputs
    from cupaged.tools import counters

    rng = np.random.default_rng(page_size)
    case = make_paged_case(
        rng,
        kv_lens=np.array([97, 16, 47, 130, 1], np.int32),
        page_size=page_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype="bf16",
    )
    plan = None
    for causal in (True, False):
        for splits in (None, 3, 5):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, "bf16", f"page_size={page_size} causal={causal} splits={splits}")
    assert set(kernels_used) == {DECODE_TC, "attention_split_merge"}
    if xp_backend.name != "cpu":
        return
    (la,) = inputs.attention_call(plan, case.q, case.k_cache, case.v_cache, case.scale, True).launches
    module = get_kernel(case.q, la.source, la.kernel, la.defines).module
    counters.reset(module)
    run(xp_backend, case, True, plan=plan)
    marks = counters.read_all(module)["cold_path"]
    assert (marks > 0) == general, marks


def test_o_is_rescaled_only_where_a_max_rises(xp_backend, kernels_used):
    """A warp rescales its O tile only on the tiles where a row's running
    max rises (the edge-tile marker counts them on the CPU): scores that
    rise with the position rescale on every tile; equal scores on the first
    tile of each warp alone (the max leaves -inf there); both against the
    reference."""
    import dataclasses

    from cupaged._runtime import get_kernel
    from cupaged.ops.attention import inputs
    from cupaged.testing import as_dtype
    from cupaged.tools import counters

    if xp_backend.name != "cpu":
        pytest.skip("the markers count on the CPU backend")
    rng = np.random.default_rng(21)
    n = 160  # one query, one KV head: a block of two warps, five 16-token tiles each
    case = make_paged_case(
        rng, kv_lens=np.array([n], np.int32), page_size=16, num_q_heads=4, num_kv_heads=1, head_dim=64, dtype="bf16"
    )
    for rising, want in ((True, n // 16), (False, 2)):
        k = np.zeros(np.asarray(case.k_cache).shape)
        for t in range(n):  # token t's K row: a score rising with t, or the same for every token
            k[case.page_table[0, t // 16], t % 16] = (t / n if rising else 0.5) / 64
        bf16 = as_dtype("bf16")
        case = dataclasses.replace(case, q=np.ones(case.q.shape).astype(bf16), k_cache=k.astype(bf16))
        _, _, plan = run(xp_backend, case, True)
        (la,) = inputs.attention_call(plan, case.q, case.k_cache, case.v_cache, case.scale, True).launches
        assert la.kernel == DECODE_TC and la.pack == 1
        module = get_kernel(case.q, la.source, la.kernel, la.defines).module
        counters.reset(module)
        o, lse, _ = run(xp_backend, case, True, plan=plan)
        check(case, o, lse, True, "bf16", f"rising={rising}")
        assert counters.read_all(module)["edge_tile"] == want, rising


def test_a_decode_step_reads_its_words_in_one_round_trip(xp_backend, kernels_used):
    """A block loads its query's sequence word, its position and the length
    word of sequence qi together (att::query_words), and beside them the page
    word its share starts at if the query were a decode step of the plan's
    longest length in sequence qi (kv_len_hint). In a decode step of equal
    lengths both guesses hold and the slow paths (marked cold) never run;
    otherwise they run exactly where a guess was wrong
    (check_decode_guesses), and every output is the reference's."""
    if xp_backend.name != "cpu":
        pytest.skip("the markers count on the CPU backend")
    # q_lens [1, 0, 2, 1]: q_seq [0, 2, 2, 3], query 1's sequence is 2
    lengths = (([40] * 4, [1] * 4), ([40, 25, 33, 18], [1] * 4), ([40, 25, 33, 18], [1, 0, 2, 1]))
    check_decode_guesses(
        xp_backend,
        DECODE_TC,
        np.random.default_rng(22),
        lengths,
        (None, 2),
        "f16",
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )


def test_a_windowed_decode_step_guesses_its_share(xp_backend, kernels_used):
    """Under a window the guessed share (a decode step of the plan's longest
    length) starts where the window does, split by split: a decode step of
    equal lengths never takes the slow path, and matches the reference.
    (Windows that start on a 16-token tile, 300 - 108 = 192 and 256: one
    starting inside a tile walks token by token, on a path the same marker
    counts.)"""
    from cupaged._runtime import get_kernel
    from cupaged.ops.attention import inputs
    from cupaged.tools import counters

    if xp_backend.name != "cpu":
        pytest.skip("the markers count on the CPU backend")
    rng = np.random.default_rng(23)
    case = make_paged_case(
        rng,
        kv_lens=np.array([300, 300, 300], np.int32),
        q_lens=np.ones(3, np.int32),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype="f16",
    )
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(q)
    for window, splits in ((108, 2), (44, 3), (1000, 2)):
        ws = cupaged.SplitWorkspace(plan.queries, 8, 64, splits, q)
        la = inputs.attention_call(plan, q, k, v, case.scale, True, window=window, workspace=ws).launches[0]
        assert la.kernel == DECODE_TC
        module = get_kernel(q, la.source, la.kernel, la.defines).module
        counters.reset(module)
        o, lse = plan.attention(q, k, v, case.scale, True, workspace=ws, window=window, return_lse=True)
        assert counters.read_all(module)["cold_path"] == 0, (window, splits)
        ref_out, ref_lse = reference.scored_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            case.page_table,
            case.kv_lens,
            case.q_lens,
            case.scale,
            True,
            window=window,
        )
        assert_close(xp_backend.to_numpy(o), ref_out, "f16", f"window={window} out")
        assert_close(xp_backend.to_numpy(lse), ref_lse, "f16", f"window={window} lse")


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_every_split_count(xp_backend, kernels_used, dtype):
    """Split z of a query covers [z c, min(L, (z + 1) c)): counts 1 .. 12 and
    64 (most splits empty) on lengths around the tiles' 16 tokens."""
    rng = np.random.default_rng(3)
    case = make_paged_case(
        rng,
        kv_lens=np.array([150, 61, 3, 97, 32], np.int32),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
    )
    plan = None
    for splits in list(range(1, 13)) + [cupaged.MAX_SPLITS]:
        for causal in (True, False):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"splits={splits} causal={causal}")
    assert set(kernels_used) == {DECODE_TC, "attention_split_merge"}


def test_split_partials_follow_layout(xp_backend, kernels_used):
    """paged_decode_tc's partials are the layout's (reference.split_attention_partials)."""
    rng = np.random.default_rng(8)
    kv_lens = np.array([100, 33], np.int32)
    case = make_paged_case(
        rng, kv_lens=kv_lens, page_size=16, num_q_heads=4, num_kv_heads=1, head_dim=128, dtype="bf16"
    )
    splits, tile = 3, variants.SPLIT_TILE
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(q)
    ws = cupaged.SplitWorkspace(plan.queries, 4, 128, splits, q)
    plan.attention(q, k, v, case.scale, False, workspace=ws)
    size = [((int(n) + splits - 1) // splits + tile - 1) // tile * tile for n in kv_lens]
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
    assert_close(xp_backend.to_numpy(ws.partial_lse), ref_lse, "bf16", "partial lse")
    assert_close(xp_backend.to_numpy(ws.partial_out), ref_out, "bf16", "partial out")
    assert kernels_used[0] == DECODE_TC


def test_lengths_read_from_device_words(xp_backend, kernels_used):
    """Lengths and positions advanced on the device give the reference for
    the new lengths (nothing about lengths is baked into the launch)."""
    rng = np.random.default_rng(10)
    full = make_paged_case(
        rng, kv_lens=np.array([40, 25], np.int32), page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="f16"
    )
    q, k, v = (_to_device(xp_backend, a) for a in (full.q, full.k_cache, full.v_cache))
    shorter = np.array([33, 18], np.int32)
    plan = cupaged.HostPlan.build(full.page_table, shorter, full.q_lens, 8, full.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    o1 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref1, _ = reference.paged_attention(
        full.q, full.k_cache, full.v_cache, full.page_table, shorter, full.q_lens, full.scale, True
    )
    assert_close(o1, ref1, "f16", "before")
    plan.words[off["kv_len"] : off["kv_len"] + 2] = xp_backend.asarray(np.array([40, 25], np.uint32))
    plan.words[off["q_pos"] : off["q_pos"] + 2] = xp_backend.asarray(np.array([39, 24], np.uint32))
    o2 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    assert_close(o2, full.reference(True)[0], "f16", "after")
    assert set(kernels_used) == {DECODE_TC}


def test_nothing_visible_and_bad_metadata(xp_backend, kernels_used):
    """A sequence of length 0 and a sequence index out of range give out 0
    and lse -inf; absurd lengths, positions and page ids never make the
    kernel leave its arrays (the ASan sweep runs this kernel too)."""
    rng = np.random.default_rng(13)
    case = make_paged_case(
        rng,
        kv_lens=np.array([20, 30, 10], np.int32),
        page_size=4,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=128,
        dtype="bf16",
    )
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"]] = 0
    words[off["q_seq"] + 1] = 0xFFFFFFFF
    for splits in (None, 4):
        ws = None if splits is None else cupaged.SplitWorkspace(3, 4, 128, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        assert (o[:2] == 0).all() and (lse[:2] == -np.inf).all()
        ref_out, ref_lse = case.reference(True)
        assert_close(o[2], ref_out[2], "bf16")
        assert_close(lse[2], ref_lse[2], "bf16")
    words[off["kv_len"] : off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"] : off["kv_len"]] = 0xFFFFFFFF
    words[off["q_seq"] : off["q_pos"]] = xp_backend.asarray(np.array([0, 1, 2], np.uint32))
    table = rng.integers(0, 2**32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"] :] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)  # must simply not crash
    assert set(kernels_used) == {DECODE_TC, "attention_split_merge"}


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_nan_never_reaches_the_output(xp_backend, kernels_used, page_size):
    """Every unused slot is NaN (the tail of each last page, the extra pages)."""
    rng = np.random.default_rng(page_size)
    case = make_paged_case(
        rng,
        sequences=3,
        max_kv_len=70,
        page_size=page_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype="bf16",
        extra_pages=3,
    )
    assert np.isnan(case.k_cache.astype(np.float32)).any()
    for causal in (True, False):
        o, lse, _ = run(xp_backend, case, causal)
        check(case, o, lse, causal, "bf16", f"page_size={page_size}")
    assert set(kernels_used) == {DECODE_TC}


@pytest.mark.parametrize("splits", [None, 2])
def test_rows_only_later_queries_see(xp_backend, kernels_used, splits):
    """Inf in the V row and NaN in the K row of tokens only later queries of
    their sequence see (causal, in the same 16-token tile as tokens they do
    see): the earlier queries' outputs are exactly the reference's, finite."""
    rng = np.random.default_rng(71)
    kv_lens, q_lens = np.array([37, 20], np.int32), np.array([3, 2], np.int32)
    case = make_paged_case(
        rng, kv_lens=kv_lens, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="f16"
    )
    # Sequence 0: tokens 35 (seen by queries 1, 2) and 36 (query 2 only); sequence 1: token 19 (query 4 only).
    for s, t, what in ((0, 36, "v"), (0, 35, "k"), (1, 19, "v")):
        page, slot = case.page_table[s, t // 16], t % 16
        cache = case.v_cache if what == "v" else case.k_cache
        cache[page, slot] = np.inf if what == "v" else np.nan
    o, lse, _ = run(xp_backend, case, True, splits=splits)
    ref_out, ref_lse = case.reference(True)
    clean = np.array([True, False, False, True, False])
    assert np.isfinite(o[clean].astype(np.float64)).all()
    assert_close(o[clean], ref_out[clean], "f16", "earlier queries")
    assert_close(lse[clean], ref_lse[clean], "f16", "earlier queries' lse")
    assert not np.isfinite(o[~clean].astype(np.float64)).all()  # the later ones do see them
    assert DECODE_TC in kernels_used


def test_nan_query_propagates(xp_backend, kernels_used):
    """A NaN in one query row gives that row NaN output and lse, as the
    reference does (issue #12 item 9); every other row is unchanged."""
    rng = np.random.default_rng(72)
    case = make_paged_case(
        rng,
        kv_lens=np.array([40, 70], np.int32),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype="bf16",
    )
    case.q[1, 5, 17] = np.nan
    ref_out, ref_lse = case.reference(True)
    assert np.isnan(ref_out[1, 5]).all() and np.isnan(ref_lse[1, 5])
    for splits in (None, 3):
        o, lse, _ = run(xp_backend, case, True, splits=splits)
        assert np.isnan(o[1, 5].astype(np.float32)).all() and np.isnan(lse[1, 5]), splits
        mask = np.ones(o.shape[:2], bool)
        mask[1, 5] = False
        assert_close(o[mask], ref_out[mask], "bf16", f"other rows, splits={splits}")
        assert_close(lse[mask], ref_lse[mask], "bf16")
    assert DECODE_TC in kernels_used


def test_capture_and_replay(xp_backend, kernels_used):
    if xp_backend.name != "cpu":
        pytest.skip("GPU capture is covered by the graph tests")
    rng = np.random.default_rng(14)
    case = make_paged_case(rng, sequences=3, max_kv_len=60, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="f16")
    check_capture_replay(rng, case, "f16", "replay")
    assert DECODE_TC in kernels_used


def test_selection_rule():
    """One rule (variants.select_variant, _cost): paged_decode_tc for f16 /
    bf16 queries with D == Dv in decode_tc.DIMS, 16-byte aligned arrays and
    a group of at least decode_tc.MIN_GROUP; paged_attention otherwise. Every
    selectable variant is registered for the NVRTC gate."""
    sel = variants.select_variant
    for dt in TC_DTYPES:
        for d in decode_tc.DIMS:
            for g in (decode_tc.MIN_GROUP, 4, 8, 16, 20):
                v = sel(dt, d, d, True, g)
                assert v == variants.Variant(DECODE_TC, dt, dt, head_dim=d, group_tile=decode_tc.HEADS)
                assert v.defines() == {"CP_DTYPE": dt, "CP_KV_DTYPE": dt, "CP_SCORE": "plain", "HEAD_DIM": d}
                assert v.threads == decode_tc.THREADS and v.smem == decode_tc.smem_bytes(d)
    assert decode_tc.smem_bytes(128) == 34816 and decode_tc.smem_bytes(64) == 18432
    for args in (
        ("f32", 128, 128, True, 4),
        ("f16", 96, 96, True, 4),
        ("f16", 128, 128, False, 4),
        ("bf16", 256, 256, True, 4),
        ("f16", 128, 64, True, 4),
        ("bf16", 64, 64, True, 4, 16),
    ):
        assert sel(*args).kernel == "paged_attention", args
    # fp8 caches (e4m3 / e5m2 under f16 / bf16 q): the same kernel, its fp8 build (raw codes staged, decoded
    # in shared memory: less shared memory than the 16-bit ring at either dim).
    for dt in TC_DTYPES:
        for kv in FP8:
            for d in decode_tc.DIMS:
                v = sel(dt, d, d, True, 4, kv_dtype=kv)
                assert v == variants.Variant(DECODE_TC, dt, kv, head_dim=d, group_tile=decode_tc.HEADS)
                assert v.smem == decode_tc.smem_bytes(d, kv) < decode_tc.smem_bytes(d)
    assert decode_tc.smem_bytes(128, "e4m3") == 2 * (16 * 136 * 2 + 2 * 16 * (160 + 128))
    registered = {
        tuple(sorted(v.defines().items())) for v in variants.VARIANTS if v.kernel == DECODE_TC and not v.features
    }  # (each feature too: test_scores.py)
    assert registered == {
        tuple(sorted({"CP_DTYPE": dt, "CP_KV_DTYPE": kv, "CP_SCORE": "plain", "HEAD_DIM": d}.items()))
        for dt in TC_DTYPES
        for kv in (dt,) + tuple(FP8)
        for d in decode_tc.DIMS
    }
    assert variants.resident_blocks(sel("bf16", 128, 128, True, 4)) == variants.RESIDENT_BLOCKS[DECODE_TC] == 6


def test_head_packs():
    """A block serves the largest pack of KV heads (up to HEAD_PACK, a power
    of two) that divides the KV heads and launches on the device: the grid's
    y, the block, its shared memory and its resident blocks follow, and so do
    the unsplit block count and the split count choose_splits takes."""
    from cupaged.ops.attention import schedule, splits

    host = cupaged.HostPlan.build(
        np.arange(64 * 256, dtype=np.int32).reshape(64, 256),
        np.full(64, 4096, np.int32),
        np.ones(64, np.int32),
        16,
        64 * 256,
    )
    one = decode_tc.smem_bytes(128)
    # (KV heads, arch, pack): sm_86 / sm_89 opt in to 99 KiB a block: 4 heads' rings (136 KiB) do not fit there.
    for hkv, arch, pack in [
        (8, "sm_90", 4),
        (8, "sm_80", 4),
        (8, "sm_86", 2),
        (12, "sm_90", 4),
        (6, "sm_90", 2),
        (2, "sm_90", 2),
        (3, "sm_90", 1),
        (1, "sm_90", 1),
    ]:
        (L,) = schedule.plan_launches(host, "bf16", 4 * hkv, hkv, 128, 128, 0, True, True, arch=arch)
        assert L.kernel == DECODE_TC and L.pack == pack, (hkv, arch, L)
        assert (L.threads, L.smem) == (pack * decode_tc.THREADS, pack * one)
        assert L.min_blocks == decode_tc.MIN_BLOCKS // pack and L.grid(hkv, 5) == (64, hkv // pack, 5)
        if arch == "sm_90":  # (unsplit_blocks assumes no device limits: the largest pack that divides)
            assert schedule.unsplit_blocks(host, 4 * hkv, hkv, 128, 128, "bf16") == 64 * hkv // pack
    # At D = 64 four heads' rings fit sm_86's 99 KiB; an fp8 cache's at D = 128 do not (106 KiB)
    (L,) = schedule.plan_launches(host, "bf16", 32, 8, 64, 64, 0, True, True, arch="sm_86")
    assert L.pack == 4 and L.smem == 4 * decode_tc.smem_bytes(64) <= 99 * 1024
    (L,) = schedule.plan_launches(host, "bf16", 32, 8, 128, 128, 0, True, True, arch="sm_86", kv_dtype="e4m3")
    assert L.pack == 2 and 4 * decode_tc.smem_bytes(128, "e4m3") > 99 * 1024
    # B1 ctx32k, 8 KV heads on 132 SMs: 2 blocks of four heads, one resident a SM, so 64 splits (MAX_SPLITS)
    long = cupaged.HostPlan.build(np.arange(2048, dtype=np.int32)[None], [32768], [1], 16, 2048)
    n = splits.choose_splits(long, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype="bf16", arch="sm_90")
    assert n == min(splits.MAX_SPLITS, 132 // 2)
    # B16: 32 blocks, 132 slots: 4 splits (six one-head blocks a SM would have given 792 // 128 = 6)
    b16 = cupaged.HostPlan.build(
        np.arange(16 * 2048, dtype=np.int32).reshape(16, 2048), [32768] * 16, [1] * 16, 16, 16 * 2048
    )
    assert splits.choose_splits(b16, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype="bf16", arch="sm_90") == 4


def test_launch_bounds_match_the_table():
    """The resident blocks choose_splits counts on are the kernels' own
    __launch_bounds__ minimum."""
    from cupaged._runtime.source import kernel_dir

    # The kernels take both __launch_bounds__ arguments from geometry.cuh (the spec's GEOMETRY); that
    # the values agree is test_arch_select's test_specs_state_what_the_kernels_compile.
    text = (kernel_dir() / "attention" / "decode_tc.cu").read_text()
    assert "constexpr u32 kMinBlocks = geom::decode_tc::kMinBlocks;" in text
    # a block of up to kHeadPack KV heads, its registers capped as for kMinBlocks one-head blocks
    assert "__launch_bounds__(dtc::kBoundThreads, 1)" in text
    assert "constexpr u32 kBoundThreads = kThreads * kMinBlocks;" in text
    assert decode_tc.GEOMETRY["kMinBlocks"] == decode_tc.MIN_BLOCKS == variants.RESIDENT_BLOCKS[DECODE_TC]
    text = (kernel_dir() / "attention" / "decode.cu").read_text()
    assert "__launch_bounds__(att::kThreads, att::kMinBlocks) paged_attention" in text
    assert decode.GEOMETRY["kMinBlocks"] == decode.MIN_BLOCKS
    # The GPU backend reads kernel names from the raw text, launch bounds and all.
    from cupaged._runtime import source

    names = source.kernel_names(
        source.assemble("attention/decode_tc", {"CP_DTYPE": "bf16", "CP_KV_DTYPE": "bf16", "HEAD_DIM": 128})
    )
    assert names == ["paged_decode_tc"]  # the split merge is its own module (merge.cu)
