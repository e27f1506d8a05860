"""The f32 row-packed CUDA-core prefill kernel (paged_prefill_simt) against
the float64 reference: GQA / MQA / MHA, D 64 / 128, chunks on top of cached
tokens, mixed steps (decodes stay on paged_attention), every score feature,
splits, strided cache views, Inf / NaN in masked and unused slots, device
metadata, and which kernel the selection picks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from attention_helpers import _host, check, run
from storage_helpers import as_view
from test_prefill_tc import _poison, check_nonfinite
from test_scores import FEATURE_SETS, score_features

import cupaged
from cupaged.ops.attention import schedule, variants
from cupaged.testing import assert_close, make_paged_case, reference

SIMT = "paged_prefill_simt"

# (page_size, head_dim, q_heads, kv_heads): SmolLM2's group of 3 (21 queries x 3 heads a block, one
# row unused), MHA (64 queries a block: blocks straddle sequences), GQA 4, MQA, D 64 / 128, pages
# of 1 / 16 / 64 tokens.
SHAPES = [
    (16, 64, 9, 3),
    (16, 64, 4, 4),
    (1, 128, 8, 2),
    (64, 128, 8, 1),
    (5, 64, 16, 2),
]


def _case(rng, shape, kv_lens, q_lens):
    page_size, d, hq, hkv = shape
    return make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens, np.int32),
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype="f32",
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "ps{}-d{}-h{}x{}".format(*s))
def test_simt_prefill_chunks(xp_backend, kernels_used, shape):
    """Prefill chunks of 16..80 queries on top of cached tokens (one
    sequence sitting the step out), causal and not, with and without
    splits: out and lse within f32 tolerance of the reference."""
    case = _case(np.random.default_rng(list(shape)), shape, [95, 41, 30, 130], [80, 16, 0, 33])
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, "f32", f"simt prefill {shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {SIMT, "attention_split_merge"}


def test_simt_whole_prompt_and_long_context(xp_backend, kernels_used):
    """A 256-token causal prompt (SmolLM2's shape) and a chunk of 40 after
    300 cached tokens: many tiles a block, the diagonal tiles masked row by
    row."""
    case = _case(np.random.default_rng(3), (16, 64, 9, 3), [256, 340], [256, 40])
    for splits in (None, 4):
        o, lse, _ = run(xp_backend, case, True, splits=splits)
        check(case, o, lse, True, "f32", f"long splits={splits}")
    assert set(kernels_used) == {SIMT, "attention_split_merge"}


def test_simt_outputs_and_lse_arguments(xp_backend, kernels_used):
    """out= and return_lse=False, unsplit and split."""
    case = _case(np.random.default_rng(21), (16, 64, 4, 1), [40, 57], [17, 31])
    for splits in (None, 2):
        o, lse, _ = run(xp_backend, case, True, splits=splits, out=True, return_lse=False)
        check(case, o, lse, True, "f32", f"out= splits={splits}")
    assert SIMT in kernels_used


def test_simt_mixed_step_segments(xp_backend, launches):
    """Decodes and chunks in one step: the chunks run on paged_prefill_simt,
    the decode runs around them on paged_attention (schedule.tc_segments),
    and every query matches the reference."""
    q_lens = [1] * 6 + [40] + [1] * 6 + [33]
    kv_lens = [20, 3, 35, 9, 17, 5, 50, 7, 30, 2, 18, 40, 6, 45]
    case = _case(np.random.default_rng(5), (16, 64, 8, 2), kv_lens, q_lens)
    for splits in (None, 3):
        launches.clear()
        o, lse, _ = run(xp_backend, case, True, splits=splits)
        check(case, o, lse, True, "f32", f"mixed splits={splits}")
        attn = [(k, b, n) for k, b, n, _ in launches if b is not None]
        assert attn == [("paged_attention", 0, 6), (SIMT, 6, 40), ("paged_attention", 46, 6), (SIMT, 52, 33)]


# Each feature set at D 64; at D 128 (the other tile geometry; the hooks do not depend on D) all four
# together: one CPU build each (a few seconds of a cold suite), the NVRTC gate builds every set at both.
@pytest.mark.parametrize("d,fset", [(64, f) for f in FEATURE_SETS] + [(128, "all")])
def test_simt_score_features(xp_backend, kernels_used, d, fset):
    """Each score feature alone, a window with sinks and all four (rows of
    one block see different windows), causal and not, unsplit and split:
    out and lse against reference.scored_attention."""
    rng = np.random.default_rng(zlib.crc32(f"simt/{d}/{fset}".encode()))
    case = _case(rng, (16, d, 8, 2), [70, 33, 90], [40, 20, 33])
    features = score_features(FEATURE_SETS[fset], 8, rng)
    q, k, v = (xp_backend.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    for causal in (True, False):
        ref_o, ref_lse = reference.scored_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            case.page_table,
            case.kv_lens,
            case.q_lens,
            case.scale,
            causal,
            **features,
        )
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 8, d, splits, q)
            o, lse = plan.attention(q, k, v, case.scale, causal, workspace=ws, return_lse=True, **features)
            what = f"{fset} d={d} causal={causal} splits={splits}"
            assert_close(xp_backend.to_numpy(o), ref_o, "f32", f"{what} out")
            assert_close(xp_backend.to_numpy(lse), ref_lse, "f32", f"{what} lse")
    assert set(kernels_used) == {SIMT, "attention_split_merge"}


@pytest.mark.parametrize("view", ["hnd", "combined", "mixed"])
def test_simt_strided_views(kernels_used, view):
    """HND, combined-KV and mixed (K NHD, V HND) cache views, 16-byte
    aligned and strided, stay on paged_prefill_simt."""
    case = _case(np.random.default_rng(zlib.crc32(view.encode())), (16, 64, 6, 2), [50, 77], [33, 40])
    if view == "mixed":
        k, v = as_view(case.k_cache, case.v_cache, "nhd")[0], as_view(case.k_cache, case.v_cache, "hnd")[1]
    else:
        k, v = as_view(case.k_cache, case.v_cache, view)
    assert not (k.flags.c_contiguous and v.flags.c_contiguous)
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    ref_o, ref_lse = case.reference(True)
    for splits in (None, 2):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 6, 64, splits, case.q)
        o, lse = plan.attention(case.q, k, v, case.scale, True, workspace=ws, return_lse=True)
        assert_close(o, ref_o, "f32", f"{view} splits={splits} out")
        assert_close(lse, ref_lse, "f32", f"{view} splits={splits} lse")
    assert set(kernels_used) == {SIMT, "attention_split_merge"}


@pytest.mark.parametrize(
    "shape", [(16, 64, 4, 1), (8, 128, 8, 2), (4, 64, 9, 3)], ids=lambda s: "ps{}-d{}-h{}x{}".format(*s)
)
def test_simt_masked_nonfinite_values(xp_backend, kernels_used, shape):
    """Inf / NaN in the value rows of tokens later in a chunk never reach
    the earlier queries, which cannot see them (0 x NaN would be NaN),
    causal, with and without splits; blocks holding two sequences keep one's
    poison out of the other's rows; rows that see a poisoned token match the
    reference's Inf / NaN pattern."""
    case = _case(np.random.default_rng([7, *shape]), shape, [70, 45, 38], [40, 13, 30])
    poisoned = [(0, 45), (0, 52), (0, 69), (2, 37)]
    for s, t in poisoned:
        _poison(case, s, [t])
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check_nonfinite(case, o, lse, causal, "f32", poisoned, f"{shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {SIMT, "attention_split_merge"}


def test_simt_unused_slots_and_window_hidden_tokens_hold_nan(xp_backend, kernels_used):
    """NaN in every K and V slot no query may see: the slots past each
    sequence's length (pages of the table and pages no table names) and,
    with a window, the tokens before every row's window. The output is
    finite and matches the reference computed on clean caches."""
    rng = np.random.default_rng(31)
    case = _case(rng, (16, 64, 9, 3), [70, 45], [40, 20])
    clean_k, clean_v = case.k_cache.copy(), case.v_cache.copy()
    used = np.zeros(case.k_cache.shape[:2], bool)
    window = 9
    hidden = []
    for s, (kl, ql) in enumerate(zip(case.kv_lens, case.q_lens)):
        first_visible = kl - ql - window + 1  # the earliest position any of its queries sees
        for t in range(kl):
            if t >= first_visible:
                used[case.page_table[s, t // 16], t % 16] = True
            else:
                hidden.append((s, t))
    case.k_cache[~used] = np.nan
    case.v_cache[~used] = np.nan
    ref_o, ref_lse = reference.scored_attention(
        case.q, clean_k, clean_v, case.page_table, case.kv_lens, case.q_lens, case.scale, True, window=window
    )
    q, k, v = (xp_backend.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    for splits in (None, 3):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 9, 64, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, workspace=ws, return_lse=True, window=window)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        assert np.isfinite(o).all(), f"splits={splits}: an unused or hidden slot reached the output"
        assert_close(o, ref_o, "f32", f"splits={splits} out")
        assert_close(lse, ref_lse, "f32", f"splits={splits} lse")
    assert hidden and set(kernels_used) == {SIMT, "attention_split_merge"}


# Padded and absurd device metadata: test_prefill_tc.py's test_tc_nothing_visible_and_bad_metadata (f32 case).


def test_simt_selection():
    """f32 at D 64 / 128 with aligned arrays and a step packed for the
    row-packed kernels picks paged_prefill_simt (registered builds); other
    dims, Dv != D, misalignment, an unsuited packing and an arch whose
    shared memory is too small for the D 128 build fall back to the
    per-query kernel; decodes stay on paged_attention."""
    tc = variants.select_tensor_core
    assert tc("f32", 64, 64, True, True) == variants.Variant(SIMT, "f32", "f32", head_dim=64)
    for arch in (None, "sm_80", "sm_90"):
        for d in (64, 128):
            v = tc("f32", d, d, True, True, arch=arch)
            assert v is not None and (v.kernel, v.head_dim) == (SIMT, d)
    assert tc("f32", 64, 64, True, True, arch="sm_86").kernel == SIMT
    assert tc("f32", 128, 128, True, True, arch="sm_86") is None  # 108.5 KiB of shared memory > 99 KiB
    assert tc("f32", 96, 96, True, True) is None
    assert tc("f32", 128, 64, True, True) is None
    assert tc("f32", 64, 64, False, True) is None
    assert tc("f32", 64, 64, True, False) is None
    registered = {tuple(sorted(v.defines().items())) for v in variants.VARIANTS}
    for d in (64, 128):
        assert tuple(sorted(tc("f32", d, d, True, True).defines().items())) in registered
    decode = schedule.plan_launches(_host([1, 1, 1]), "f32", 9, 3, 64, 64, 0, True, True)
    assert [launch.kernel for launch in decode] == ["paged_attention"]
    prefill = schedule.plan_launches(_host([256]), "f32", 9, 3, 64, 64, 0, True, True)
    assert [(launch.kernel, launch.blocks, launch.tiles, launch.threads) for launch in prefill] == [
        (SIMT, -(-256 // 21), 1, 128)
    ]
