"""Which kernel serves which queries (ops/attention/schedule.py): pass
counts, the tensor-core rule, segments of mixed steps, and their launches."""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import (
    DECODE_TC,
    MIXED_TC,
    Q_MIXED,
    TC_DTYPES,
    TC_PREFILL,
    _host,
    _to_device,
    check,
    check_capture_replay,
    run,
)

import cupaged
from cupaged._runtime import archs
from cupaged.layout import metadata_offsets
from cupaged.ops.attention import inputs, schedule, variants
from cupaged.ops.attention.kernels import prefill_tc
from cupaged.testing import assert_close, make_paged_case


def _prefill_qpb(group: int, head_dim: int) -> int:
    """Queries per paged_prefill_tc block: its tile's rows (the first tile of
    PREFILL_TILES) over min(G, rows)."""
    return variants.tc_queries_per_block(group, prefill_tc.PREFILL_TILES[head_dim][0].rows)


def test_block_passes():
    """Sequences meeting in a block of consecutive packed queries, from the
    host plan (sequences without queries do not count): (most, total)."""
    passes = schedule.block_passes
    assert variants.tc_queries_per_block(1) == 64 and variants.tc_queries_per_block(3) == 21
    assert variants.tc_queries_per_block(8) == 8 and variants.tc_queries_per_block(128) == 1
    assert passes(_host([1] * 20), 8) == (8, 20)  # decode, G = 8: 8, 8, 4 sequences
    assert passes(_host([1] * 20), 4) == (4, 20)
    assert passes(_host([100, 0, 1]), 8) == (2, 14)  # a prefill chunk and one decode
    assert passes(_host([30, 0, 0, 30]), 64) == (2, 2)
    assert passes(_host([16] * 4 + [1] * 30), 8) == (8, 38)
    assert passes(_host([8, 16, 16, 16, 8]), 64) == (5, 5)
    assert passes(_host([0, 0]), 8) == (0, 0)


def test_tc_schedule_rule():
    """Tensor cores when every block's passes are few and fill a warp on
    average: prefill chunks, MLA-like groups of 16+, a chunk with a few
    decodes; not decode steps of small groups nor many decodes mixed in."""
    ok = schedule.tc_schedule_ok
    assert ok(_host([80, 16, 0, 33]), 1) and ok(_host([80, 16, 33]), 8)
    assert ok(_host([8, 16, 16, 16, 8]), 1)  # 5 passes, 64 rows: the fewest rows allowed
    assert ok(_host([1] * 20), 16) and ok(_host([1] * 20), 128)  # MLA decode, 16 and 128 heads
    assert ok(_host([100, 0, 1]), 8)
    assert not ok(_host([1] * 20), 8)  # decode, G = 8: 8 passes a block
    assert not ok(_host([1, 1, 1]), 2)  # 3 passes of 2 rows
    assert not ok(_host([16] * 4 + [1] * 30), 8)
    assert not ok(_host([0, 0]), 8)


def _segs(q_lens, group):
    return schedule.tc_segments(_host(q_lens), group)


def test_tc_segments_rule():
    """The segmentation of a step (host data): whole steps stay one launch,
    mixed ones split into runs of sequences, short tensor-core runs and the
    ones past MAX_SEGMENTS join the CUDA-core segments."""
    T, C = True, False
    assert _segs([1] * 20, 8) == ((C, 0, 20),)  # decode: CUDA cores
    assert _segs([80, 16, 0, 33], 4) == ((T, 0, 129),)  # prefill: tensor cores
    assert _segs([0, 0], 8) == ()
    # Few decodes around chunks pack well as a whole at G = 4 (one launch);
    # at G = 1 the decodes at the ends go to CUDA cores, the one between the
    # chunks rides along in their blocks.
    assert _segs([1, 1, 40, 1, 33, 1, 1], 4) == ((T, 0, 78),)
    assert _segs([1, 1, 40, 1, 33, 1, 1], 1) == ((C, 0, 2), (T, 2, 74), (C, 76, 2))
    assert _segs(Q_MIXED, 4) == tuple((n == TC_PREFILL, b, c) for n, b, c in MIXED_TC)
    assert _segs([40, 0, 24] + [1] * 8, 4) == ((T, 0, 64), (C, 64, 8))
    assert _segs([1, 1, 8, 1, 1], 4) == ((C, 0, 2), (T, 2, 8), (C, 10, 2))  # 32 rows: worth a launch
    assert _segs([1, 1, 4, 1], 4) == ((C, 0, 7),)  # 16 rows: fewer than TC_SEGMENT_ROWS
    assert schedule.TC_SEGMENT_ROWS == 32 and schedule.MAX_SEGMENTS == 4
    # C T C T C T C (chunks of 40, 33, 20): the most queries in four launches are the
    # chunks of 40 and 20 (the last run ends the step), the 33 joins the decodes around it.
    assert _segs(Q_MIXED + [1] * 6 + [20], 4) == ((C, 0, 6), (T, 6, 40), (C, 46, 45), (T, 91, 20))
    assert _segs(Q_MIXED + [1] * 6 + [20] + [1], 4) == ((C, 0, 6), (T, 6, 40), (C, 46, 66))
    # Twenty chunks of 40 between runs of six decodes (no bridging past 16 runs): the first two.
    assert _segs([40] + [1] * 6 + ([40] + [1] * 6) * 19, 4) == (
        (T, 0, 40),
        (C, 40, 6),
        (T, 46, 40),
        (C, 86, 20 * 46 - 86),
    )
    # Alternating runs all too small for a segment: the current single-kernel choice.
    assert _segs([1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 6], 4) == ((C, 0, 33),)
    # MLA: decode queries of 16+ heads are tensor-core rows already; nothing splits.
    assert _segs([1] * 20, 16) == ((T, 0, 20),)
    assert _segs([1, 1, 40, 1, 33, 1, 1], 16) == ((T, 0, 78),)
    assert _segs([1] * 6 + [24, 1], 8) == ((C, 0, 6), (T, 6, 24), (C, 30, 1))
    for q_lens, g in ((Q_MIXED + [1] * 6 + [20], 4), ([1, 1, 40, 1, 33, 1, 1], 1), (Q_MIXED, 2)):
        segs = _segs(q_lens, g)  # contiguous, covering, <= 4
        assert [b for _, b, _ in segs] == [0] + list(np.cumsum([c for _, _, c in segs]))[:-1]
        assert sum(c for _, _, c in segs) == sum(q_lens) and len(segs) <= schedule.MAX_SEGMENTS


def test_tc_segments_invariants():
    """Random steps: segments are contiguous, cover every query, number at
    most MAX_SEGMENTS, and every tensor-core one keeps the TC_MAX_PASSES
    rule on its own range (passes counted here block by block) with at
    least TC_SEGMENT_ROWS rows."""
    rng = np.random.default_rng(34)
    for _trial in range(300):
        n = int(rng.integers(1, 40))
        q_lens = np.where(rng.random(n) < 0.25, rng.integers(2, 90, n), rng.integers(0, 2, n))
        group = int(rng.choice([1, 2, 3, 4, 5, 8, 16, 64]))
        segs = _segs(q_lens, group)
        queries = int(q_lens.sum())
        if queries == 0:
            assert segs == ()
            continue
        assert 1 <= len(segs) <= schedule.MAX_SEGMENTS, (q_lens, group, segs)
        assert [b for _, b, _ in segs] == [0] + list(np.cumsum([c for _, _, c in segs]))[:-1]
        assert sum(c for _, _, c in segs) == queries
        assert all(segs[i][0] != segs[i + 1][0] for i in range(len(segs) - 1))
        seq = np.repeat(np.arange(n), q_lens)
        heads, qpb = min(group, 64), variants.tc_queries_per_block(group)
        for on_tc, b, c in segs:
            if not on_tc:
                continue
            passes = [len(set(seq[x : min(x + qpb, b + c)].tolist())) for x in range(b, b + c, qpb)]
            assert max(passes) <= schedule.TC_MAX_PASSES and c * heads * 5 >= 64 * sum(passes), (q_lens, group)
            assert c * heads >= schedule.TC_SEGMENT_ROWS or len(segs) == 1


def test_segments_are_cached_and_sum_the_grids(monkeypatch):
    """The segmentation is host work done once per plan and group; the
    unsplit grid (choose_splits) sums the segments' grids."""
    calls = []
    real = schedule._segment
    monkeypatch.setattr(schedule, "_segment", lambda host, group: calls.append(group) or real(host, group))
    host = _host(Q_MIXED)
    assert schedule.tc_segments(host, 4) is schedule.tc_segments(host, 4)
    # bf16, D 128, 8 x 2 heads: 12 decode blocks (paged_decode_tc: one per query for both KV heads, a pack of
    # two, each with its 4 heads in one tile) and ceil(40 / 16) + ceil(33 / 16) tensor-core prefill blocks per
    # KV head.
    qpb = _prefill_qpb(4, 128)  # queries of G = 4 in one block of the D = 128 prefill tile
    assert schedule.unsplit_blocks(host, 8, 2, 128, 128, "bf16") == 12 + (-(-40 // qpb) + -(-33 // qpb)) * 2
    # f32: the same segments, the chunks on paged_prefill_simt (64 rows a block: 16 queries of G = 4) and
    # the decodes on paged_attention; at D 96 (no row-packed build) one CUDA-core launch.
    simt_qpb = variants.tc_queries_per_block(4)
    assert (
        schedule.unsplit_blocks(host, 8, 2, 128, 128, np.float32) == (12 + -(-40 // simt_qpb) + -(-33 // simt_qpb)) * 2
    )
    assert schedule.unsplit_blocks(host, 8, 2, 96, 96, np.float32) == 85 * 2
    assert calls == [4]


@pytest.mark.parametrize("q_lens", [[1] * 5, [40, 0, 33], [1, 1, 40, 1, 33, 1, 1]], ids=["decode", "prefill", "few"])
def test_whole_steps_are_one_launch(xp_backend, launches, q_lens):
    """Decode-only and prefill-only steps, and chunks with a few decodes that
    pack well as a whole (G = 4), stay one launch over all queries."""
    rng = np.random.default_rng(len(q_lens))
    q_lens = np.array(q_lens, np.int32)
    case = make_paged_case(
        rng, kv_lens=q_lens + 6, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="f16"
    )
    o, lse, plan = run(xp_backend, case, True)
    check(case, o, lse, True, "f16", f"whole step {q_lens.tolist()}")
    n = plan.queries
    expect = [(DECODE_TC, 0, n, n)] if n == 5 else [(TC_PREFILL, 0, n, -(-n // _prefill_qpb(4, 64)))]
    assert launches == expect


# (page_size, head_dim, q_heads, kv_heads, q_lens, launches (kernel, q_begin, q_count))
MIXED_SHAPES = [
    (16, 64, 8, 2, Q_MIXED, MIXED_TC),
    (8, 128, 8, 2, Q_MIXED, MIXED_TC),
    (16, 64, 4, 4, [1, 1, 40, 1, 33, 1, 1], [(DECODE_TC, 0, 2), (TC_PREFILL, 2, 74), (DECODE_TC, 76, 2)]),
    (4, 128, 4, 1, [40, 0, 24] + [1] * 8, [(TC_PREFILL, 0, 64), (DECODE_TC, 64, 8)]),
]


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("shape", MIXED_SHAPES, ids=lambda s: "ps{}-d{}-h{}x{}-q{}".format(*s[:4], len(s[4])))
def test_mixed_steps(xp_backend, launches, dtype, shape):
    """Decode queries on the per-query kernel and prefill chunks on tensor
    cores in one step: each segment's launch covers its own queries, every
    query matches the float64 reference (out and lse, causal and not, with
    and without splits: one merge over all queries)."""
    page_size, d, hq, hkv, q_lens, expect = shape
    rng = np.random.default_rng([page_size, d, hq, len(q_lens)])
    q_lens = np.array(q_lens, np.int32)
    kv_lens = (q_lens + rng.integers(1, 70, q_lens.size)).astype(np.int32)
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
    qpb = _prefill_qpb(hq // hkv, d)
    grids = [(n, b, c, -(-c // qpb) if n == TC_PREFILL else c) for n, b, c in expect]
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            launches.clear()
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"mixed {shape[:4]} causal={causal} splits={splits}")
            merge = [("attention_split_merge", None, None, plan.queries)] if splits else []
            assert launches == grids + merge


def test_mixed_step_outputs_and_capture(xp_backend, launches):
    """A mixed step with out= and return_lse=False, and captured (four
    segments and the merge) then replayed with new q contents."""
    rng = np.random.default_rng(31)
    q_lens = np.array(Q_MIXED, np.int32)
    case = make_paged_case(
        rng, kv_lens=q_lens + 9, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="f16"
    )
    o, lse, _ = run(xp_backend, case, True, out=True, return_lse=False)
    check(case, o, lse, True, "f16", "mixed out=")
    assert [n for n, *_ in launches] == [n for n, _, _ in MIXED_TC]
    if xp_backend.name != "cpu":
        return  # GPU capture: the graph tests
    check_capture_replay(rng, case, "f16", "mixed replay")


def test_mixed_step_bad_metadata(xp_backend, kernels_used):
    """Padded and absurd device metadata on a segmented step: a decode whose
    sequence has length 0 and a chunk query with a bad sequence index get
    out 0 and lse -inf; garbage everywhere (sequence indices pointing across
    segments included) never makes a segment leave its arrays."""
    rng = np.random.default_rng(32)
    q_lens = np.array(Q_MIXED, np.int32)
    case = make_paged_case(
        rng, kv_lens=q_lens + 7, q_lens=q_lens, page_size=4, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="bf16"
    )
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"] + 2] = 0  # decode query 2 (per-query segment): nothing visible
    words[off["q_seq"] + 60] = 0xFFFFFFFF  # query 60 (chunk of 33, tensor cores): bad index
    ref_out, ref_lse = case.reference(True)
    dead = np.zeros(plan.queries, bool)
    dead[[2, 60]] = True
    for splits in (None, 3):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 8, 64, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        assert (o[dead] == 0).all() and (lse[dead] == -np.inf).all()
        assert_close(o[~dead], ref_out[~dead], "bf16")
        assert_close(lse[~dead], ref_lse[~dead], "bf16")
    words[off["kv_len"] : off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"] : off["kv_len"]] = 0xFFFFFFFF
    seqs = rng.integers(0, plan.sequences + 2, size=plan.queries).astype(np.uint32)
    words[off["q_seq"] : off["q_pos"]] = xp_backend.asarray(seqs)
    table = rng.integers(0, 2**32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"] :] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)  # must simply not crash
    assert {DECODE_TC, TC_PREFILL} <= set(kernels_used)


@pytest.mark.parametrize("kernel", ["paged_attention", DECODE_TC, TC_PREFILL])
def test_launch_range_is_clamped(xp_backend, monkeypatch, kernel):
    """q_begin / q_count are host arguments, clamped anyway: a range running
    past the plan's queries (or starting past them, or wrapping 32 bits) with
    a grid larger than it writes only the plan's queries inside it."""
    rng = np.random.default_rng(33)
    q_lens = np.array([20, 17], np.int32)
    case = make_paged_case(
        rng, kv_lens=q_lens + 5, q_lens=q_lens, page_size=16, num_q_heads=4, num_kv_heads=1, head_dim=64, dtype="f16"
    )
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    n = plan.queries
    ref_out, ref_lse = case.reference(True)
    if kernel == TC_PREFILL:
        first = schedule.plan_launches(plan.host, "f16", 4, 1, 64, 64, 0, True, True, arch=archs.device_arch(q))[0]
        assert first.kernel == kernel
    else:
        var = (
            variants.select_variant("f16", 64, 64, True, 4)
            if kernel == DECODE_TC
            else variants.Variant(kernel, "f16", "f16", head_dim=64, group_tile=4)
        )
        assert var.kernel == kernel
        first = schedule.Launch(
            var.source, kernel, var.defines(), var.threads, var.smem, 0, 0, 0, 0, cpu_threads=var.cpu_threads
        )
    for begin, count, blocks in ((n - 5, 2**32 - 1, 9), (n + 3, 4, 2), (2**32 - 2, 5, 3), (3, 6, 20)):
        # One launch of `blocks` blocks along x over [begin, begin + count) (one head tile: G = 4).
        one = first._replace(blocks=blocks, tiles=1, q_begin=begin, q_count=count)
        monkeypatch.setattr(inputs, "plan_launches", lambda *a, one=one, **k: [one])
        out = xp_backend.xp.full((n, 4, 64), 7, dtype=q.dtype)
        lse = xp_backend.xp.full((n, 4), 5.0, dtype=np.float32)
        plan.attention(q, k, v, case.scale, True, out=out, lse=lse)
        o, l = xp_backend.to_numpy(out), xp_backend.to_numpy(lse)
        per_block = _prefill_qpb(4, 64) if kernel == TC_PREFILL else 1
        hit = np.zeros(n, bool)
        if begin < n:
            hit[begin : min(n, begin + count, begin + blocks * per_block)] = True
        assert (o[~hit] == 7).all() and (l[~hit] == 5.0).all(), (begin, count)
        assert_close(o[hit], ref_out[hit], "f16", f"range {begin} {count}")
        assert_close(l[hit], ref_lse[hit], "f16", f"range {begin} {count}")
