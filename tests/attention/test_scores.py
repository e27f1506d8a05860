"""Score variants and visibility (issue #14, its score half): soft cap,
sliding window, attention sinks and ALiBi, alone and together, through every
kernel family the shapes select, against the float64 reference
``reference.scored_attention``: causal and not, unsplit, split and split
into many, decode, chunked prefill and mixed steps, MLA on both tensor-core
builds and the CUDA-core kernel; queries that outnumber their keys
(non-causal) and sequences without keys; the pages outside a window never
read (window_pages.py, in a subprocess); bad inputs. The ports of the peers'
cases (FlashInfer, vLLM) are in test_scores_peers.py."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from attention_helpers import TC_PREFILL

import cupaged
from cupaged import PagedAttentionError
from cupaged._runtime import cpu_arch_override
from cupaged.layout import MAX_SPLITS, metadata_offsets
from cupaged.ops.attention import launch, variants
from cupaged.testing import assert_close, make_mla_case, make_paged_case, reference

HERE = Path(__file__).resolve().parent


def score_features(names, heads, rng) -> dict:
    """Keyword arguments of ``names`` (a FEATURES subset) for ``heads``
    query heads: a cap low enough to bend the logits, a window shorter than
    the chunks, sinks near the logits' size, BLOOM's slopes."""
    f = {}
    if "soft_cap" in names:
        f["soft_cap"] = 2.0
    if "window" in names:
        f["window"] = 11
    if "sinks" in names:
        f["sinks"] = (rng.standard_normal(heads) + 1.0).astype(np.float32)
    if "alibi" in names:
        f["alibi_slopes"] = (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)
    return f


FEATURE_SETS = {
    "soft_cap": ("soft_cap",),
    "window": ("window",),
    "sinks": ("sinks",),
    "alibi": ("alibi",),
    "window+sinks": ("window", "sinks"),
    "all": variants.FEATURES,
}


@pytest.fixture
def used(monkeypatch):
    """(kernel, defines) of every kernel launch_attention fetches."""
    log = []
    real = launch.get_kernel

    def spy(like, source, kernel, defines=None):
        log.append((kernel, dict(defines or {})))
        return real(like, source, kernel, defines)

    monkeypatch.setattr(launch, "get_kernel", spy)
    return log


def run(case, causal, splits=None, plan=None, **features):
    """``plan.attention`` with the features; (out, lse)."""
    if plan is None:
        plan = cupaged.HostPlan.build(
            case.page_table, case.kv_lens, case.q_lens, case.page_size, max(case.num_pages, 1)
        ).upload(case.q)
    ws = (
        None
        if splits is None
        else cupaged.SplitWorkspace(plan.queries, case.q.shape[1], case.v_cache.shape[3], splits, case.q)
    )
    return plan.attention(
        case.q, case.k_cache, case.v_cache, case.scale, causal, workspace=ws, return_lse=True, **features
    )


def expect(case, causal, **features):
    return reference.scored_attention(
        case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, causal, **features
    )


def check(case, causal, splits, dtype, what, **features):
    o, lse = run(case, causal, splits, **features)
    ref_o, ref_lse = expect(case, causal, **features)
    assert_close(o, ref_o, dtype, f"{what} out")
    assert_close(lse, ref_lse, dtype, f"{what} lse")


# ----------------------------------------------------------------- every feature on every kernel family

# (what, dtype, D, page size, the kernel that runs: None for a mixed step's two)
KERNELS = [
    ("decode", "f32", 64, 16, "paged_attention"),  # compile-time dims, GQA 4
    ("decode", "bf16", 96, 5, "paged_attention"),  # runtime dims (DIM_CAP)
    ("decode", "bf16", 128, 1, "paged_decode_tc"),  # tensor-core decode, one-token pages
    ("decode", "f16", 64, 16, "paged_decode_tc"),
    ("chunk", "f16", 64, 16, TC_PREFILL),  # rows of one block see different windows
    ("chunk", "bf16", 128, 5, TC_PREFILL),
    ("mixed", "f16", 64, 16, None),  # segments: decodes and chunks in one step
]
Q_LENS = {"decode": [1, 1, 1], "chunk": [40, 20, 33], "mixed": [1] * 6 + [40] + [1] * 6 + [33]}
KV_LENS = {"decode": [70, 33, 90], "chunk": [70, 33, 90], "mixed": [20, 3, 35, 9, 17, 5, 50, 7, 30, 2, 18, 40, 6, 45]}


@pytest.mark.parametrize("what, dtype, d, page, kernel", KERNELS)
@pytest.mark.parametrize("fset", list(FEATURE_SETS))
def test_features_on_every_kernel(used, what, dtype, d, page, kernel, fset):
    """Each feature alone, a window with sinks (gpt-oss) and all four, causal
    and not, without splits and with 3: out and lse within the dtype's
    tolerance of the reference; the variant launched carries exactly the
    features asked for."""
    rng = np.random.default_rng(zlib.crc32(f"{what}/{dtype}/{d}/{fset}".encode()))
    case = make_paged_case(
        rng,
        kv_lens=np.array(KV_LENS[what], np.int32),
        q_lens=np.array(Q_LENS[what]),
        page_size=page,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    features = score_features(FEATURE_SETS[fset], 8, rng)
    for causal in (True, False):
        for splits in (None, 3):
            check(case, causal, splits, dtype, f"{what} {fset} causal={causal} splits={splits}", **features)
    kernels = {k for k, _ in used if k != "attention_split_merge"}
    assert kernels == ({kernel} if kernel else {"paged_decode_tc", TC_PREFILL})
    flags = {k for _, d_ in used for k in d_ if k in ("CP_SOFT_CAP", "CP_WINDOW", "CP_SINKS", "CP_ALIBI")}
    assert flags == {f"CP_{f.upper()}" for f in FEATURE_SETS[fset]}


SOFT_CAPS = [1.0, 50.0, 1e4, 1e6, 1e8]


@pytest.mark.parametrize("what, dtype, d, page, kernel", KERNELS)
def test_soft_cap_accurate_at_every_cap(used, what, dtype, d, page, kernel):
    """Issue #19 item 5: the soft cap's tanh cancelled for small |logit /
    cap| (f32 error vs float64 8e-7 at cap 50, 1e-4 at 1e4, 1e-2 at 1e6, 0.8
    at 1e8: every logit became 0, a uniform average); now every kernel
    family matches the float64 reference within the dtype's tolerance at
    caps 1 .. 1e8, with logits of ordinary size and 8 times larger, causal
    and not, unsplit and split (the merge), alone and with ALiBi after it."""
    rng = np.random.default_rng(zlib.crc32(f"cap/{what}/{dtype}/{d}".encode()))
    case = make_paged_case(
        rng,
        kv_lens=np.array(KV_LENS[what], np.int32),
        q_lens=np.array(Q_LENS[what]),
        page_size=page,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    slopes = score_features(("alibi",), 8, rng)
    for hot in (1.0, 8.0):
        hot_case = dataclasses.replace(case, scale=case.scale * hot)
        for cap in SOFT_CAPS:
            for causal, splits in ((True, None), (False, 3)):
                check(
                    hot_case,
                    causal,
                    splits,
                    dtype,
                    f"{what} cap={cap} x{hot} causal={causal} splits={splits}",
                    soft_cap=cap,
                )
            check(hot_case, True, 3, dtype, f"{what} cap={cap} x{hot} +alibi", soft_cap=cap, **slopes)
    kernels = {k for k, _ in used if k != "attention_split_merge"}
    assert kernels == ({kernel} if kernel else {"paged_decode_tc", TC_PREFILL})
    assert all(d_.get("CP_SOFT_CAP") for k, d_ in used if k != "attention_split_merge")


@pytest.mark.parametrize(
    "dtype, r, p, kernel, arch",
    [
        ("bf16", 512, 64, "paged_mla_seesaw", "sm_90"),
        ("f16", 512, 64, "paged_mla_tc", "sm_80"),
        ("f32", 64, 16, "paged_attention", "sm_90"),
    ],
)
def test_mla_soft_cap_accurate_at_every_cap(used, dtype, r, p, kernel, arch):
    """The same caps through the MLA kernels (both tensor-core builds and the
    CUDA-core kernel's rotary part)."""
    rng = np.random.default_rng(zlib.crc32(f"cap/{dtype}/{r}".encode()))
    case = make_mla_case(
        rng, kv_lens=[40, 70], q_lens=[1, 20], page_size=16, num_heads=16, latent_dim=r, pos_dim=p, dtype=dtype
    )
    qa, keys, values = reference.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos)
    with cpu_arch_override(arch):
        plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
        ws = cupaged.SplitWorkspace(plan.queries, 16, r, 3, case.q)
        for cap in SOFT_CAPS:
            for causal, w in ((True, None), (False, ws)):
                o, lse = plan.mla(
                    case.q,
                    case.q_pos,
                    case.latent,
                    case.k_pos,
                    case.scale,
                    causal,
                    workspace=w,
                    return_lse=True,
                    soft_cap=cap,
                )
                ref_o, ref_lse = reference.scored_attention(
                    qa, keys, values, case.page_table, case.kv_lens, case.q_lens, case.scale, causal, soft_cap=cap
                )
                assert_close(o, ref_o, dtype, f"mla cap={cap} causal={causal} out")
                assert_close(lse, ref_lse, dtype, f"mla cap={cap} causal={causal} lse")
    assert {k for k, _ in used if k != "attention_split_merge"} == {kernel}


@pytest.mark.parametrize("dtype, d", [("bf16", 256), ("f32", 128)])
def test_all_features_other_dims(dtype, d):
    """D = 256 (the 8-warp prefill tile; paged_attention at f32) with every
    feature, a chunk and decodes, causal."""
    rng = np.random.default_rng(d)
    case = make_paged_case(
        rng,
        kv_lens=np.array([50, 37], np.int32),
        q_lens=np.array([24, 1]),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=d,
        dtype=dtype,
    )
    check(case, True, None, dtype, f"{dtype} D{d}", **score_features(variants.FEATURES, 4, rng))


@pytest.mark.parametrize("dtype, d", [("f32", 64), ("bf16", 128)])
def test_many_splits_sink_enters_once(dtype, d):
    """MAX_SPLITS splits over a long decode, most of them empty under the
    window: the sink enters the merge once (per split it would be counted
    64 times), with and without the window."""
    rng = np.random.default_rng(7 + d)
    case = make_paged_case(
        rng,
        kv_lens=np.array([1500, 700, 3], np.int32),
        q_lens=np.array([1, 1, 1]),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    sinks = (rng.standard_normal(8) + 2.0).astype(np.float32)
    for window in (None, 300):
        for splits in (MAX_SPLITS, 9):
            check(case, True, splits, dtype, f"splits={splits} window={window}", sinks=sinks, window=window)


def test_window_one_and_window_past_everything():
    """window = 1 sees the query's own position only (non-causal: from it to
    the end); a window wider than any sequence changes nothing."""
    rng = np.random.default_rng(3)
    case = make_paged_case(
        rng,
        kv_lens=np.array([30, 17], np.int32),
        q_lens=np.array([20, 1]),
        page_size=4,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="f16",
    )
    for causal in (True, False):
        check(case, causal, None, "f16", f"window 1 causal={causal}", window=1)
    o, lse = run(case, True, None, window=2**32 - 1)
    ref = case.reference(True)
    assert_close(o, ref[0], "f16", "huge window")
    assert_close(lse, ref[1], "f16", "huge window lse")


def test_window_follows_device_positions():
    """The window is applied to the positions in the device words: a decode
    step captured once, replayed after advance_plan moved every sequence on
    by one, still matches the reference at the new lengths."""
    from cupaged.ops.advance import advance_plan

    rng = np.random.default_rng(11)
    case = make_paged_case(
        rng,
        kv_lens=np.array([40, 25], np.int32),
        q_lens=np.array([1, 1]),
        page_size=8,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        dtype="f32",
        extra_table_cols=2,
    )
    case.k_cache[np.isnan(case.k_cache)] = 0.5  # the next positions hold data now
    case.v_cache[np.isnan(case.v_cache)] = -0.25
    table = case.page_table.copy()
    spare = sorted(set(range(case.num_pages)) - set(table[table < case.num_pages].tolist()))  # owned by nobody
    for s in range(2):
        j = int(case.kv_lens[s]) // case.page_size
        if table[s, j] >= case.num_pages:
            table[s, j] = spare.pop()
    plan = cupaged.HostPlan.build(table, case.kv_lens, case.q_lens, 8, case.num_pages).upload(case.q)
    out = np.zeros((2, 4, 64), np.float32)
    stream = cupaged.stream_for(case.q)
    stream.begin_capture()
    plan.attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.scale,
        True,
        out=out,
        window=9,
        alibi_slopes=np.full(4, 0.3, np.float32),
    )
    graph = stream.end_capture()
    advance_plan(plan)
    graph.launch()
    ref, _ = reference.scored_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        table,
        case.kv_lens + 1,
        case.q_lens,
        case.scale,
        True,
        window=9,
        alibi_slopes=np.full(4, 0.3, np.float32),
    )
    assert_close(out, ref, "f32", "replayed")


# ----------------------------------------------------------------- MLA


@pytest.mark.parametrize(
    "dtype, r, p, kernel, arch",
    [
        ("bf16", 512, 64, "paged_mla_seesaw", "sm_90"),
        ("f16", 512, 64, "paged_mla_tc", "sm_80"),
        ("f32", 64, 16, "paged_attention", "sm_90"),  # the CUDA-core kernel's rotary part
    ],
)
@pytest.mark.parametrize("fset", ["soft_cap", "window", "sinks", "alibi", "all"])
def test_mla_features(used, dtype, r, p, kernel, arch, fset):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}/{fset}".encode()))
    case = make_mla_case(
        rng, kv_lens=[40, 70], q_lens=[1, 20], page_size=16, num_heads=16, latent_dim=r, pos_dim=p, dtype=dtype
    )
    features = score_features(FEATURE_SETS[fset], 16, rng)
    qa, keys, values = reference.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos)
    for causal, splits in ((True, None), (False, 3)):
        with cpu_arch_override(arch):
            plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 16, r, splits, case.q)
            o, lse = plan.mla(
                case.q,
                case.q_pos,
                case.latent,
                case.k_pos,
                case.scale,
                causal,
                workspace=ws,
                return_lse=True,
                **features,
            )
        ref_o, ref_lse = reference.scored_attention(
            qa, keys, values, case.page_table, case.kv_lens, case.q_lens, case.scale, causal, **features
        )
        assert_close(o, ref_o, dtype, f"mla {fset} out")
        assert_close(lse, ref_lse, dtype, f"mla {fset} lse")
    assert {k for k, _ in used if k != "attention_split_merge"} == {kernel}


# ----------------------------------------------------------------- more queries than keys; no keys

CROSS = [
    ("f32", 64, [5, 1, 3], [2, 0, 9], "paged_attention"),
    ("bf16", 128, [3, 1, 2], [1, 0, 40], "paged_decode_tc"),
    ("f16", 64, [40, 3, 20], [10, 0, 33], TC_PREFILL),
]


@pytest.mark.parametrize("dtype, d, q_lens, kv_lens, kernel", CROSS)
def test_queries_outnumber_keys_non_causal(used, dtype, d, q_lens, kv_lens, kernel):
    """Cross-attention style: q_lens > kv_lens, not causal; every query sees
    all its sequence's keys (with a window: from its own, possibly negative,
    position's window on), a sequence without keys gives out 0 and lse -inf
    (the sink with sinks)."""
    rng = np.random.default_rng(sum(q_lens))
    case = make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages)
    assert not plan.causal_ok and plan.q_pos.min() < 0
    for features in ({}, score_features(("window", "sinks", "alibi"), 8, rng)):
        for splits in (None, 3):
            check(case, False, splits, dtype, f"cross {features.keys()} splits={splits}", **features)
    assert kernel in {k for k, _ in used}


@pytest.mark.parametrize(
    "dtype, d, q_lens, kv_lens",
    [
        ("f32", 64, [1, 1, 1], [0, 12, 0]),  # padded decodes
        ("bf16", 128, [1, 2, 1], [0, 20, 0]),  # tensor-core decode
        ("f16", 64, [30, 20, 1], [0, 45, 0]),  # a chunk with no keys beside a prefill chunk
    ],
)
def test_sequences_without_keys_in_causal_steps(dtype, d, q_lens, kv_lens):
    """kv_lens 0 with queries in a causal step is a caller bug (the step's
    K/V were not appended) and is refused on the host (issue #19 item 3);
    a padded entry is a kv_len word set to 0 on the device instead (what
    DecodeBatch and the decode loops do), which every kernel serves with
    out 0, lse -inf (with sinks lse is the head's sink)."""
    rng = np.random.default_rng(d + sum(q_lens))
    empty = np.repeat(np.array(kv_lens) == 0, q_lens)
    assert not cupaged.HostPlan.build(np.zeros((3, 4), np.int64), kv_lens, q_lens, 16, 1).causal_ok
    legal = np.where(np.array(kv_lens) == 0, np.array(q_lens) + 3, kv_lens).astype(np.int32)
    case = make_paged_case(
        rng,
        kv_lens=legal,
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=d,
        dtype=dtype,
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    assert plan.host.causal_ok
    off = metadata_offsets(plan.queries, plan.sequences)
    plan.words[off["kv_len"] : off["q_start"]] = np.array(kv_lens, np.uint32)  # padded on the "device"
    ref_o, ref_lse = expect(case, True)
    sinks = rng.standard_normal(4).astype(np.float32)
    _, ref_sink_lse = expect(case, True, sinks=sinks)
    for splits in (None, 4):
        o, lse = run(case, True, splits, plan=plan)
        assert (o[empty] == 0).all() and (lse[empty] == -np.inf).all()
        assert_close(o[~empty], ref_o[~empty], dtype, f"empty splits={splits} out")
        assert_close(lse[~empty], ref_lse[~empty], dtype, f"empty splits={splits} lse")
        o, lse = run(case, True, splits, plan=plan, sinks=sinks)
        assert (o[empty] == 0).all()
        np.testing.assert_allclose(lse[empty], np.broadcast_to(sinks, lse[empty].shape), rtol=1e-6)
        assert_close(lse[~empty], ref_sink_lse[~empty], dtype, f"empty sinks splits={splits} lse")


# (q_lens, kv_lens, the first sequence with more queries than keys)
MORE_QUERIES = [
    ([1, 1, 1], [0, 12, 0], 0),  # kv_lens 0 with a query (used to give out 0, lse -inf)
    ([1, 2, 1], [5, 20, 0], 2),  # the last sequence
    ([3, 1], [2, 9], 0),  # q_len > kv_len > 0
    ([0, 0, 4, 5], [0, 7, 9, 4], 3),  # sequences sitting out (q_len 0) are fine, kv_len 0 included
    ([40, 20, 33], [70, 19, 90], 1),  # a prefill chunk one token short
]


@pytest.mark.parametrize("q_lens, kv_lens, seq", MORE_QUERIES)
def test_causal_refuses_queries_past_keys(used, q_lens, kv_lens, seq):
    """Issue #19 item 3: causal attention over a plan with some q_len >
    kv_len (kv_len 0 included) raises before any launch, naming the first
    such sequence and both lengths, from the plan's host data (as
    FlashInfer's single prefill does); out is untouched; the same call
    non-causal runs and matches the reference."""
    rng = np.random.default_rng(seq + sum(q_lens))
    case = make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="f16",
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, max(case.num_pages, 1))
    assert not plan.causal_ok and plan.non_causal_sequence == seq
    plan = plan.upload(case.q)
    out = np.full((plan.queries, 4, 64), 7, np.float16)
    msg = (
        rf"causal: expected False for this plan \(sequence {seq} has q_lens={q_lens[seq]} > "
        rf"kv_lens={kv_lens[seq]}: its first queries sit at negative positions; append .*\), got True"
    )
    for features in ({}, dict(window=5), dict(sinks=np.zeros(4, np.float32))):
        with pytest.raises(PagedAttentionError, match=msg + r" \(attention\)"):
            plan.attention(case.q, case.k_cache, case.v_cache, case.scale, True, out=out, **features)
    with pytest.raises(PagedAttentionError, match=msg):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, out=out)  # causal is the default
    assert used == [] and (out == 7).all()
    check(case, False, None, "f16", "non-causal")


def test_causal_mla_refuses_queries_past_keys(used):
    """Causal MLA likewise (kv_len 0 with queries, and q_len > kv_len > 0);
    non-causal MLA runs."""
    for kv_lens, q_lens, seq in (([9, 0], [1, 1], 1), ([1, 30], [2, 1], 0)):
        rng = np.random.default_rng(seq)
        case = make_mla_case(
            rng, kv_lens=kv_lens, q_lens=q_lens, page_size=16, num_heads=4, latent_dim=64, pos_dim=16, dtype="f32"
        )
        plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
        out = np.full((plan.queries, 4, 64), 7, np.float32)
        with pytest.raises(
            PagedAttentionError,
            match=rf"causal: expected False for this plan \(sequence {seq} has "
            rf"q_lens={q_lens[seq]} > kv_lens={kv_lens[seq]}: .*\(mla\)",
        ):
            plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, True, out=out)
        assert used == [] and (out == 7).all()
        o = plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, False)
        qa, keys, values = reference.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos)
        ref_o, _ = reference.scored_attention(
            qa, keys, values, case.page_table, case.kv_lens, case.q_lens, case.scale, False
        )
        assert_close(o, ref_o, "f32", "mla non-causal")
        used.clear()


def test_sitting_out_stays_causal():
    """q_len 0 sits a step out, with any kv_len (0 included): the plan stays
    causal, and the other sequences' queries match the reference."""
    rng = np.random.default_rng(4)
    case = make_paged_case(
        rng,
        kv_lens=np.array([0, 30, 12, 0], np.int32),
        q_lens=np.array([0, 2, 0, 0]),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="f32",
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages)
    assert plan.causal_ok and plan.non_causal_sequence == -1
    check(case, True, None, "f32", "sitting out")


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_mla_queries_outnumber_keys(arch):
    rng = np.random.default_rng(5)
    case = make_mla_case(
        rng, kv_lens=[3, 0, 30], q_lens=[20, 2, 1], page_size=16, num_heads=16, latent_dim=512, pos_dim=64, dtype="bf16"
    )
    qa, keys, values = reference.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos)
    with cpu_arch_override(arch):
        plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
        o, lse = plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, False, return_lse=True)
    ref_o, ref_lse = reference.scored_attention(
        qa, keys, values, case.page_table, case.kv_lens, case.q_lens, case.scale, False
    )
    assert_close(o, ref_o, "bf16", "mla cross out")
    assert_close(lse, ref_lse, "bf16", "mla cross lse")


def test_pages_outside_the_window_are_never_read():
    """window_pages.py: every kernel family runs with the pages no window
    reaches made inaccessible (mprotect) and matches the reference: a 4k
    window over 32k positions reads 512 of 4096 pages, 1/8 of the bytes."""
    r = subprocess.run([sys.executable, str(HERE / "window_pages.py")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), (r.returncode, r.stdout, r.stderr[-3000:])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) == 10, r.stdout
    assert "read 512 of 4096 pages [paged_attention]" in lines[0]
    kernels = set(re.findall(r"\[(\w+)\]", r.stdout))
    assert kernels == {
        "paged_attention",
        "paged_decode_tc",
        "paged_prefill_tc",
        "paged_prefill_wgmma",
        "paged_prefill_simt",
        "paged_mla_tc",
        "paged_mla_seesaw",
    }


# ----------------------------------------------------------------- bad inputs


def _plan_case(q_lens=(1, 1), kv_lens=(20, 9), heads=4):
    rng = np.random.default_rng(0)
    case = make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=heads,
        num_kv_heads=2,
        head_dim=64,
        dtype="f16",
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    return case, plan


class FakeCupy:
    """Stands for a CuPy array (another backend than the plan's)."""

    __module__ = "cupy._core.core"
    data, device, dtype, shape = 0, SimpleNamespace(id=0), np.dtype(np.float32), (4,)


BAD = [
    (dict(window=0), r"window: expected an int in 1\.\.4294967295, got 0"),
    (dict(window=-3), r"window: expected an int in 1\.\.4294967295, got -3"),
    (dict(window=2.0), r"window: expected an int in 1\.\.4294967295, got 2\.0"),
    (dict(window=True), r"window: expected an int"),
    (dict(window=2**32), r"window: expected an int in 1\.\.4294967295, got 4294967296"),
    (dict(soft_cap=0.0), r"soft_cap: expected a finite float > 0, got 0\.0"),
    (dict(soft_cap=-30), r"soft_cap: expected a finite float > 0, got -30"),
    (dict(soft_cap=float("nan")), r"soft_cap: expected a finite float > 0, got nan"),
    (dict(soft_cap=float("inf")), r"soft_cap: expected a finite float > 0, got inf"),
    (dict(soft_cap="30"), r"soft_cap: expected a finite float > 0, got str '30'"),
    (dict(sinks=np.ones(5, np.float32)), r"sinks: expected shape \[4\] \(one value per query head\), got shape \[5\]"),
    (dict(sinks=np.ones((1, 4), np.float32)), r"sinks: expected shape \[4\]"),
    (dict(sinks=np.ones(4, np.float16)), r"sinks: expected float32 \[4\] \(one value per query head\), got float16"),
    (dict(sinks=np.ones(4)), r"sinks: expected float32 \[4\].*got float64"),
    (dict(sinks=[0.0] * 4), r"sinks: expected a NumPy or CuPy float32 array \[4\], got list"),
    (dict(sinks=np.ones(8, np.float32)[::2]), r"sinks: expected a contiguous array"),
    (dict(alibi_slopes=np.ones(3, np.float32)), r"alibi_slopes: expected shape \[4\]"),
    (dict(alibi_slopes=np.ones(4, np.int32)), r"alibi_slopes: expected float32 \[4\].*got int32"),
    (dict(alibi_slopes=0.5), r"alibi_slopes: expected a NumPy or CuPy float32 array \[4\], got float"),
    (dict(sinks=FakeCupy()), r"sinks: expected an array of the plan's cpu backend, got the gpu backend"),
]


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_options_raise_before_any_launch(used, kwargs, match):
    case, plan = _plan_case()
    out = np.full((2, 4, 64), 7, np.float16)
    with pytest.raises(PagedAttentionError, match=match):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, True, out=out, **kwargs)
    assert used == [] and (out == 7).all()


def test_bad_options_on_mla():
    rng = np.random.default_rng(1)
    case = make_mla_case(
        rng, kv_lens=[9], q_lens=[1], page_size=16, num_heads=4, latent_dim=64, pos_dim=16, dtype="f32"
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    for kwargs, match in (
        (dict(window=0), "window"),
        (dict(sinks=np.ones(5, np.float32)), r"sinks: .*\[4\]"),
        (dict(soft_cap=-1.0), "soft_cap"),
    ):
        with pytest.raises(PagedAttentionError, match=match):
            plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, **kwargs)


def test_outputs_must_not_overlap_the_option_arrays():
    case, plan = _plan_case()
    buf = np.zeros(12, np.float32)
    lse = buf[2:10].reshape(2, 4)  # its first two floats are the sinks' last two
    with pytest.raises(PagedAttentionError, match="lse: expected memory disjoint from sinks"):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, lse=lse, sinks=buf[:4])


def test_non_causal_only_plans():
    """q_lens > kv_lens: causal attention, causal MLA and appends are
    refused before anything runs; non-causal attention runs."""
    case, plan = _plan_case(q_lens=(3, 1), kv_lens=(2, 9))
    assert not plan.host.causal_ok and plan.host.non_causal_sequence == 0
    out = np.full((4, 4, 64), 7, np.float16)
    with pytest.raises(
        PagedAttentionError,
        match=r"causal: expected False for this plan \(sequence 0 has "
        r"q_lens=3 > kv_lens=2: its first queries",
    ):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, True, out=out)
    assert (out == 7).all()
    new = np.zeros((4, 2, 64), np.float16)
    before = case.k_cache.copy()
    with pytest.raises(
        PagedAttentionError,
        match=r"query 0: sits at position -1 \(sequence 0 has q_lens=3 > "
        r"kv_lens=2\), which has no cache slot",
    ):
        plan.append(new, new, case.k_cache, case.v_cache)
    np.testing.assert_array_equal(case.k_cache, before)
    rng = np.random.default_rng(2)
    mcase = make_mla_case(
        rng, kv_lens=[1], q_lens=[2], page_size=16, num_heads=4, latent_dim=64, pos_dim=16, dtype="f32"
    )
    mplan = cupaged.HostPlan.build(mcase.page_table, mcase.kv_lens, mcase.q_lens, 16, mcase.num_pages).upload(mcase.q)
    with pytest.raises(PagedAttentionError, match=r"causal: expected False .* \(mla\)"):
        mplan.mla(mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos, mcase.scale)
    o = plan.attention(case.q, case.k_cache, case.v_cache, case.scale, False)
    assert_close(o, expect(case, False)[0], "f16", "non-causal")


# ----------------------------------------------------------------- what the gate builds


def test_gate_builds_each_feature_on_each_family():
    """VARIANTS (the NVRTC gate) holds, for every kernel family, dtype and
    fast dim, each feature alone and all four (fp8 caches: none and all
    four, FP8_GATE_FEATURES); the defaults carry no feature define."""
    fast = {
        (v.kernel, v.dtype, v.kv_dtype, v.head_dim, v.latent_dim, v.tile, v.target)
        for v in variants.VARIANTS
        if v.kernel != "paged_attention" or v.head_dim
    }
    built = {
        (v.kernel, v.dtype, v.kv_dtype, v.head_dim, v.latent_dim, v.tile, v.target, v.features)
        for v in variants.VARIANTS
    }
    for key in fast:
        sets = variants.FP8_GATE_FEATURES if key[2] in ("e4m3", "e5m2") else variants.GATE_FEATURES
        for fs in sets:
            assert key + (fs,) in built, (key, fs)
    for v in variants.VARIANTS:
        if not v.features:
            assert not any(k in v.defines() for k in ("CP_SOFT_CAP", "CP_WINDOW", "CP_SINKS", "CP_ALIBI"))
    kernels = {v.kernel for v in variants.VARIANTS if v.features == variants.FEATURES}
    assert kernels == set(variants.KERNELS)


def test_choose_splits_counts_the_window():
    """choose_splits(window=): a query sees at most the window, so a 32k
    decode with a 4k window splits as a 4k one would, and a window under
    MIN_TOKENS_PER_SPLIT not at all."""
    host = cupaged.HostPlan.build(np.arange(2048)[None, :] % 64, [32768], [1], 16, 64)
    short = cupaged.HostPlan.build(np.arange(256)[None, :] % 64, [4096], [1], 16, 64)
    assert cupaged.choose_splits(host, 8, multiprocessors=132) == 33
    assert (
        cupaged.choose_splits(host, 8, multiprocessors=132, window=4096)
        == cupaged.choose_splits(short, 8, multiprocessors=132)
        == 16
    )
    assert cupaged.choose_splits(host, 8, multiprocessors=132, window=200) == 1
    with pytest.raises(PagedAttentionError, match="window: expected an int in 1"):
        cupaged.choose_splits(host, 8, multiprocessors=132, window=0)
