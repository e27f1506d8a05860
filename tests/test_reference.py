"""Checks of the float64 references themselves: hand-computed cases and
brute-force Python loops, so the oracle every kernel test relies on is right."""

import math

import ml_dtypes
import numpy as np
import pytest

from cupaged import testing
from cupaged.testing import reference as ref

# ---------------------------------------------------------------- brute force


def brute_attention(q, keys, values, kv_lens, q_lens, scale, causal):
    """Per query, per head, per key Python loop over dense per-sequence
    keys[s]: [kv_len, Hkv, D] and values[s]: [kv_len, Hkv, Dv]."""
    hq, hkv = q.shape[1], keys[0].shape[1]
    out = np.zeros((q.shape[0], hq, values[0].shape[2]))
    lse = np.full((q.shape[0], hq), -math.inf)
    i = 0
    for s, (kv, n) in enumerate(zip(kv_lens, q_lens)):
        for j in range(n):
            pos = kv - n + j
            seen = pos + 1 if causal else kv
            for h in range(hq):
                g = h // (hq // hkv)
                scores = [
                    scale * sum(float(q[i, h, d]) * float(keys[s][t, g, d]) for d in range(q.shape[2]))
                    for t in range(seen)
                ]
                if not scores:
                    continue
                m = max(scores)
                w = [math.exp(x - m) for x in scores]
                lse[i, h] = m + math.log(sum(w))
                for e in range(values[0].shape[2]):
                    out[i, h, e] = sum(w[t] * float(values[s][t, g, e]) for t in range(seen)) / sum(w)
            i += 1
    return out, lse


def dense_kv(cache, page_table, kv_lens):
    """Per-sequence dense copies by a plain token loop."""
    ps = cache.shape[1]
    return [
        np.array([cache[page_table[s, t // ps], t % ps] for t in range(kv)], dtype=np.float64).reshape(
            kv, *cache.shape[2:]
        )
        for s, kv in enumerate(kv_lens)
    ]


# ---------------------------------------------------------------- positions


def test_query_positions_hand_case():
    q_seq, q_pos = ref.query_positions([5, 3, 0, 4], [2, 3, 0, 1])
    assert q_seq.tolist() == [0, 0, 1, 1, 1, 3]
    assert q_pos.tolist() == [3, 4, 0, 1, 2, 3]
    assert ref.visible_lengths([5, 3, 0, 4], [2, 3, 0, 1], causal=True).tolist() == [4, 5, 1, 2, 3, 4]
    assert ref.visible_lengths([5, 3, 0, 4], [2, 3, 0, 1], causal=False).tolist() == [5, 5, 3, 3, 3, 4]


def test_query_positions_empty_and_invalid():
    q_seq, q_pos = ref.query_positions([0, 0], [0, 0])
    assert q_seq.shape == (0,) and q_pos.shape == (0,)
    with pytest.raises(ValueError, match="q_lens <= kv_lens"):
        ref.query_positions([2], [3])


def test_gather_kv_reads_only_the_sequence_slots():
    # cache[p, o] = 10 * p + o, NaN in every slot that is not read.
    cache = np.full((4, 3, 1, 1), np.nan)
    table = np.array([[2, 0, 2**30]])
    for t in range(5):
        p, o = table[0, t // 3], t % 3
        cache[p, o] = 10 * p + o
    got = ref.gather_kv(cache, table, 0, 5)
    assert got.shape == (5, 1, 1) and got.dtype == np.float64
    assert got[:, 0, 0].tolist() == [20, 21, 22, 0, 1]
    assert ref.gather_kv(cache, table, 0, 0).shape == (0, 1, 1)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (3, 1)])
def test_paged_attention_matches_brute_force(causal, hq, hkv):
    rng = np.random.default_rng(hq * 10 + hkv + causal)
    case = testing.make_paged_case(
        rng,
        kv_lens=[5, 1, 7, 0],
        q_lens=[2, 1, 3, 0],
        page_size=3,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=3,
        head_dim_v=2,
        dtype="f32",
    )
    out, lse = case.reference(causal)
    keys = dense_kv(case.k_cache, case.page_table, case.kv_lens)
    values = dense_kv(case.v_cache, case.page_table, case.kv_lens)
    want_out, want_lse = brute_attention(case.q, keys, values, case.kv_lens, case.q_lens, case.scale, causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    assert not np.isnan(out).any()


def test_single_key_and_uniform_scores():
    # One key: out is its value, lse the one score.
    q = np.array([[[1.0, 2.0]]])
    k = np.array([[[[3.0, -1.0]]]])
    v = np.array([[[[7.0, 8.0, 9.0]]]])
    out, lse = ref.paged_attention(q, k, v, [[0]], [1], [1], scale=0.5)
    assert out.tolist() == [[[7.0, 8.0, 9.0]]]
    assert lse.tolist() == [[0.5 * (3.0 - 2.0)]]
    # q = 0: every score 0, out is the mean of the values, lse = log(n).
    rng = np.random.default_rng(0)
    vals = rng.standard_normal((2, 4, 1, 2))
    out, lse = ref.paged_attention(np.zeros((1, 1, 2)), np.ones((2, 4, 1, 2)), vals, [[1, 0]], [6], [1], 1.0)
    dense = np.concatenate([vals[1], vals[0]])[:6, 0]
    np.testing.assert_allclose(out[0, 0], dense.mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(lse[0, 0], math.log(6), rtol=1e-14)


def test_softmax_weights_sum_to_one_and_shift_invariance():
    rng = np.random.default_rng(1)
    case = testing.make_paged_case(rng, kv_lens=[9, 4], q_lens=[3, 2], page_size=4, head_dim=4, dtype="f32")
    ones = np.where(np.isnan(case.v_cache), np.nan, 1.0)
    out, _ = ref.paged_attention(case.q, case.k_cache, ones, case.page_table, case.kv_lens, case.q_lens, case.scale)
    np.testing.assert_allclose(out, 1.0, rtol=1e-14)
    # An extra dim with q = c and k = 1 adds scale * c to every score: out
    # unchanged, lse shifted; c large enough to overflow a naive exp.
    c = 1e4
    q2 = np.concatenate([case.q.astype(np.float64), np.full(case.q.shape[:2] + (1,), c)], axis=-1)
    k2 = np.concatenate([case.k_cache.astype(np.float64), np.ones(case.k_cache.shape[:3] + (1,))], axis=-1)
    out0, lse0 = case.reference()
    out1, lse1 = ref.paged_attention(q2, k2, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale)
    np.testing.assert_allclose(out1, out0, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse1, lse0 + case.scale * c, rtol=1e-12)


def test_causal_mask_ignores_later_keys():
    rng = np.random.default_rng(2)
    case = testing.make_paged_case(rng, kv_lens=[10], q_lens=[4], page_size=4, head_dim=4, dtype="f32")
    out, lse = case.reference(causal=True)
    # Change the key and value of the last token (position 9): only the last
    # query (position 9) sees it under the causal mask; every query does otherwise.
    k2, v2 = case.k_cache.copy(), case.v_cache.copy()
    p, o = case.page_table[0, 9 // 4], 9 % 4
    k2[p, o] += 1.0
    v2[p, o] += 1.0
    out2, lse2 = ref.paged_attention(case.q, k2, v2, case.page_table, case.kv_lens, case.q_lens, case.scale)
    np.testing.assert_array_equal(out2[:3], out[:3])
    np.testing.assert_array_equal(lse2[:3], lse[:3])
    assert not np.allclose(out2[3], out[3])
    nc, _ = case.reference(causal=False)
    nc2, _ = ref.paged_attention(case.q, k2, v2, case.page_table, case.kv_lens, case.q_lens, case.scale, causal=False)
    assert all(not np.allclose(nc2[i], nc[i]) for i in range(4))
    # Non-causal: every query of a sequence sees all kv_lens tokens, so the
    # last query, at position kv_len - 1, agrees between the two.
    np.testing.assert_array_equal(nc[3], out[3])


def test_low_precision_inputs_are_cast_exactly():
    rng = np.random.default_rng(3)
    for dtype in ("f16", "bf16"):
        case = testing.make_paged_case(rng, kv_lens=[6], q_lens=[2], page_size=4, head_dim=8, dtype=dtype)
        out, lse = case.reference()
        out64, lse64 = ref.paged_attention(
            case.q.astype(np.float64),
            case.k_cache.astype(np.float64),
            case.v_cache.astype(np.float64),
            case.page_table,
            case.kv_lens,
            case.q_lens,
            case.scale,
        )
        np.testing.assert_array_equal(out, out64)
        np.testing.assert_array_equal(lse, lse64)
    assert float(np.asarray(1 + 2**-7, dtype=ml_dtypes.bfloat16).astype(np.float64)) == 1 + 2**-7


def test_paged_mla_matches_direct_loop():
    rng = np.random.default_rng(4)
    case = testing.make_mla_case(
        rng, kv_lens=[5, 3], q_lens=[2, 1], page_size=2, num_heads=2, latent_dim=3, pos_dim=2, dtype="f32"
    )
    out, lse = case.reference()
    latent = dense_kv(case.latent, case.page_table, case.kv_lens)
    kpos = dense_kv(case.k_pos, case.page_table, case.kv_lens)
    q_seq, q_pos = ref.query_positions(case.kv_lens, case.q_lens)
    for i, (s, p) in enumerate(zip(q_seq, q_pos)):
        for h in range(2):
            scores = np.array(
                [
                    case.scale
                    * (
                        sum(float(case.q[i, h, r]) * latent[s][t, 0, r] for r in range(3))
                        + sum(float(case.q_pos[i, h, r]) * kpos[s][t, 0, r] for r in range(2))
                    )
                    for t in range(p + 1)
                ]
            )
            w = np.exp(scores - scores.max())
            np.testing.assert_allclose(lse[i, h], scores.max() + math.log(w.sum()), rtol=1e-12)
            np.testing.assert_allclose(out[i, h], (w[:, None] * latent[s][: p + 1, 0]).sum(0) / w.sum(), rtol=1e-12)
    # The MLA operands serve the split helper too.
    po, pl = ref.split_attention_partials(
        *ref.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos),
        case.page_table,
        case.kv_lens,
        case.q_lens,
        case.scale,
        2,
    )
    np.testing.assert_allclose(ref.merge_splits(po, pl)[0], out, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------- splits


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split_size", [1, 3, 5, 64, [2, 7, 4]])
def test_merge_of_splits_equals_unsplit(causal, split_size):
    rng = np.random.default_rng(5)
    case = testing.make_paged_case(
        rng, kv_lens=[11, 3, 17], q_lens=[3, 1, 4], page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype="bf16"
    )
    po, pl = ref.split_attention_partials(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        case.kv_lens,
        case.q_lens,
        case.scale,
        split_size,
        causal=causal,
    )
    assert po.shape[1:] == case.q.shape and pl.shape[1:] == case.q.shape[:2]
    out, lse = ref.merge_splits(po, pl)
    want_out, want_lse = case.reference(causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_split_partials_empty_splits_and_extra_splits():
    rng = np.random.default_rng(6)
    case = testing.make_paged_case(rng, kv_lens=[5], q_lens=[5], page_size=2, head_dim=4, dtype="f32")
    po, pl = ref.split_attention_partials(
        case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, 2, num_splits=4
    )
    # Query at position p sees splits 0..p // 2; later splits are empty; split 3 is past every length.
    for i in range(5):
        for j in range(4):
            if j > i // 2:
                assert np.all(pl[j, i] == -np.inf) and np.all(po[j, i] == 0)
            else:
                assert np.all(np.isfinite(pl[j, i]))
    out, lse = ref.merge_splits(po, pl)
    np.testing.assert_allclose(out, case.reference()[0], rtol=1e-12, atol=1e-13)


def test_merge_hand_case_and_empty():
    po = np.array([[[[1.0, 0.0]]], [[[0.0, 1.0]]], [[[np.nan, np.nan]]]])  # [3, 1, 1, 2]
    pl = np.array([[[math.log(1.0)]], [[math.log(3.0)]], [[-math.inf]]])  # [3, 1, 1]
    out, lse = ref.merge_splits(po, pl)
    np.testing.assert_allclose(out[0, 0], [0.25, 0.75], rtol=1e-15)
    np.testing.assert_allclose(lse[0, 0], math.log(4.0), rtol=1e-15)
    out, lse = ref.merge_splits(np.full((2, 1, 1, 2), np.nan), np.full((2, 1, 1), -np.inf))
    assert out.tolist() == [[[0.0, 0.0]]] and lse.tolist() == [[-math.inf]]
    # One split merges to itself.
    out, lse = ref.merge_splits(po[:1], pl[:1])
    assert out.tolist() == [[[1.0, 0.0]]] and lse.tolist() == [[0.0]]


# ---------------------------------------------------------------- append


def test_paged_append_writes_exact_slots():
    rng = np.random.default_rng(7)
    case = testing.make_paged_case(
        rng, kv_lens=[6, 0, 3], q_lens=[2, 0, 3], page_size=4, num_q_heads=2, head_dim=2, dtype="f16"
    )
    new_k = rng.standard_normal((5, 2, 2)).astype(np.float16)
    new_v = rng.standard_normal((5, 2, 2)).astype(np.float16)
    k0, v0 = case.k_cache.copy(), case.v_cache.copy()
    k1, v1 = ref.paged_append(new_k, new_v, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens)
    np.testing.assert_array_equal(case.k_cache, k0)  # inputs untouched
    assert k1.dtype == np.float16
    expect_k, expect_v = k0.copy(), v0.copy()
    slots = [(0, 4), (0, 5), (2, 0), (2, 1), (2, 2)]  # (sequence, position) of each query
    for i, (s, p) in enumerate(slots):
        expect_k[case.page_table[s, p // 4], p % 4] = new_k[i]
        expect_v[case.page_table[s, p // 4], p % 4] = new_v[i]
    np.testing.assert_array_equal(k1, expect_k)  # NaN == NaN elsewhere
    np.testing.assert_array_equal(v1, expect_v)


# ---------------------------------------------------------------- row argmax


def brute_argmax(row):
    best = 0
    for j in range(1, len(row)):
        a, b = float(row[j]), float(row[best])
        if (math.isnan(a) and not math.isnan(b)) or (not math.isnan(b) and a > b):
            best = j
    return best


def test_row_argmax_hand_cases():
    nan, inf = math.nan, math.inf
    rows = [
        [1.0, 3.0, 3.0, 2.0],
        [-inf, -inf, -inf, -inf],
        [0.0, nan, 5.0, nan],
        [-0.0, 0.0, -1.0, -0.0],
        [inf, 1.0, inf, nan],
        [-1.0, -inf, -0.5, -2.0],
    ]
    assert ref.row_argmax(np.array(rows)).tolist() == [1, 0, 1, 0, 3, 2]
    assert ref.row_argmax(np.array(rows)).dtype == np.int64
    assert ref.row_argmax(np.zeros((0, 4))).shape == (0,)
    with pytest.raises(ValueError, match="vocab >= 1"):
        ref.row_argmax(np.zeros((2, 0)))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_row_argmax_matches_loop(dtype):
    rng = np.random.default_rng(8)
    x = rng.integers(-3, 4, size=(40, 13)).astype(np.float64)  # many ties
    x[rng.random(x.shape) < 0.05] = np.nan
    x[rng.random(x.shape) < 0.1] = -np.inf
    x = x.astype(testing.as_dtype(dtype))
    assert ref.row_argmax(x).tolist() == [brute_argmax(r) for r in x]


# ---------------------------------------------------------------- model pieces


def test_rms_norm():
    x = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(ref.rms_norm(x, [1.0, 2.0], eps=0.0), [[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope(interleaved):
    rng = np.random.default_rng(9)
    d, r = 8, 6  # partial rotary: last 2 dims pass through
    cos, sin = ref.rope_tables(np.arange(5), r)
    assert cos.shape == (5, 3)
    np.testing.assert_allclose(cos[:, 0], np.cos(np.arange(5)))  # frequency base**0 = 1
    x = rng.standard_normal((5, 2, d))
    y = ref.apply_rope(x, cos, sin, interleaved)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity
    np.testing.assert_array_equal(y[..., r:], x[..., r:])
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)
    # Relative: <rope(q, m), rope(k, n)> depends only on m - n.
    q, k = rng.standard_normal((1, 1, d)), rng.standard_normal((1, 1, d))

    def dot(m, n):
        cm, sm = ref.rope_tables([m], r)
        cn, sn = ref.rope_tables([n], r)
        return float(np.sum(ref.apply_rope(q, cm, sm, interleaved) * ref.apply_rope(k, cn, sn, interleaved)))

    np.testing.assert_allclose(dot(7, 3), dot(104, 100), rtol=1e-11)
    # Pairs by hand for position 1, pair 0 (angle 1).
    a, b = (x[1, 0, 0], x[1, 0, 1]) if interleaved else (x[1, 0, 0], x[1, 0, 3])
    got = (y[1, 0, 0], y[1, 0, 1]) if interleaved else (y[1, 0, 0], y[1, 0, 3])
    np.testing.assert_allclose(got, (a * math.cos(1) - b * math.sin(1), b * math.cos(1) + a * math.sin(1)))


def test_swiglu_mlp_matches_loop():
    rng = np.random.default_rng(10)
    x, wg, wu, wd = (rng.standard_normal(s) for s in [(2, 3), (3, 4), (3, 4), (4, 3)])
    got = ref.swiglu_mlp(x, wg, wu, wd)
    for n in range(2):
        h = []
        for f in range(4):
            g = sum(x[n, d] * wg[d, f] for d in range(3))
            u = sum(x[n, d] * wu[d, f] for d in range(3))
            h.append(g / (1 + math.exp(-g)) * u)
        for d in range(3):
            np.testing.assert_allclose(got[n, d], sum(h[f] * wd[f, d] for f in range(4)), rtol=1e-12)


def test_softmax():
    np.testing.assert_allclose(ref.softmax([[0.0, math.log(3.0)]]), [[0.25, 0.75]])
    np.testing.assert_allclose(ref.softmax([[1000.0, 1000.0]]), [[0.5, 0.5]])


# ---------------------------------------------------------------- the test-case builder


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_make_paged_case_is_poisoned_and_permuted(dtype, page_size):
    rng = np.random.default_rng(11)
    case = testing.make_paged_case(
        rng,
        sequences=5,
        max_kv_len=40,
        page_size=page_size,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        q_lens=3,
    )
    assert case.k_cache.dtype == testing.as_dtype(dtype) and case.q.dtype == testing.as_dtype(dtype)
    assert case.page_table.dtype == np.int32 and case.kv_lens.dtype == np.int32 and case.q_lens.dtype == np.int32
    assert case.q.shape == (int(case.q_lens.sum()), 4, 8) and case.k_cache.shape[2:] == (2, 8)
    if page_size > 1:
        assert np.all(case.kv_lens % page_size != 0)
    owned = []
    for s, kv in enumerate(case.kv_lens):
        n = -(-int(kv) // page_size)
        owned += case.page_table[s, :n].tolist()
        assert np.all(case.page_table[s, n:] == testing.PAGE_SENTINEL)
        assert not np.isnan(ref.gather_kv(case.k_cache, case.page_table, s, kv)).any()
    assert len(set(owned)) == len(owned) and case.num_pages == len(owned) + 2
    assert case.slot_used.sum() == case.kv_lens.sum()
    k = case.k_cache.astype(np.float64)
    assert np.all(np.isnan(k[~case.slot_used])) and not np.isnan(k[case.slot_used]).any()
    out, lse = case.reference()
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_make_paged_case_options():
    rng = np.random.default_rng(12)
    case = testing.make_paged_case(
        rng, kv_lens=[0, 4, 9], q_lens=[0, 4, 2], page_size=8, unused_entry=-1, extra_pages=0, head_dim=16
    )
    assert case.page_table[0].tolist() == [-1, -1, -1] and case.page_table[1, 1:].tolist() == [-1, -1]
    assert sorted(case.page_table[case.page_table >= 0].tolist()) == [0, 1, 2]
    assert case.scale == 0.25 and case.num_queries == 6
    gpu_like = case.map(lambda a: a.copy())
    assert gpu_like is not case and np.array_equal(gpu_like.page_table, case.page_table)
    with pytest.raises(ValueError, match="q_lens"):
        testing.make_paged_case(rng, kv_lens=[2], q_lens=[-1])
    assert testing.make_paged_case(rng, kv_lens=[2], q_lens=[3]).num_queries == 3  # a non-causal-only case


def test_tolerance():
    assert testing.tolerance(np.float32) < testing.tolerance("f16") < testing.tolerance(ml_dtypes.bfloat16)
    assert testing.tolerance("bfloat16") == testing.tolerance("bf16")
    with pytest.raises(ValueError):
        testing.tolerance(np.int32)
