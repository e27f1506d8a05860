"""fp8 caches and cache views on the read side (issue #14): paged attention
and MLA over e4m3 / e5m2 caches (per-tensor and per-KV-head scales) and
over strided views (HND, a combined KV tensor, a misaligned view, the
576-wide MLA cache), against the float64 reference on the DEQUANTIZED
cache times its scale (storage_helpers.py), at q's dtype tolerance
(cupaged.testing.tolerance: f16 2e-3, bf16 1.6e-2; decoding is exact and
the scales apply in f32). Unused slots hold NaN codes (and +inf on e5m2),
which must contribute nothing.

The kernel family under test is a parameter (``FAMILIES``): selection is
restricted to it (``only_kernels``) and each test asserts it served the
case. First CPU compiles dominate the time: the cases share builds (D = 64,
GQA group 4 on the fast path; element loads at DIM_CAP 64).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from storage_helpers import (
    check_attention,
    check_mla,
    fp8_paged_case,
    only_kernels,
    reference_out,
    run_attention,
    store,
    stored_mla,
)

import cupaged
from cupaged import PagedAttentionError
from cupaged.testing import assert_close, make_paged_case, reference

FAMILIES = ["paged_attention"]


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    only_kernels(monkeypatch, {request.param})
    return request.param


# (q dtype, fp8 format, per-head scales): every format, q dtype and scale kind
FP8_CASES = [("f16", "e4m3", True), ("bf16", "e4m3", False), ("f16", "e5m2", False), ("bf16", "e5m2", True)]


@pytest.mark.parametrize("dtype,fmt,per_head", FP8_CASES)
def test_fp8_decode_prefill_splits(family, dtype, fmt, per_head):
    """Decode and chunked prefill, causal and not, unsplit and 3 splits, GQA
    group 4, on one build per (q dtype, format)."""
    rng = np.random.default_rng(11)
    dec = fp8_paged_case(
        rng, fmt, per_head, dtype=dtype, kv_lens=[37, 1, 70], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16
    )
    assert check_attention(dec, what=f"{fmt} decode") == (family,)
    check_attention(dec, splits=3, what=f"{fmt} decode split3")
    pre = fp8_paged_case(
        rng,
        fmt,
        per_head,
        dtype=dtype,
        kv_lens=[40, 23, 9],
        q_lens=[7, 23, 3],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
    )
    for causal in (True, False):
        check_attention(pre, causal, what=f"{fmt} prefill causal={causal}")
        check_attention(pre, causal, splits=2, what=f"{fmt} prefill causal={causal} split2")
    for hq, hkv in ((16, 2), (6, 2)):  # two head tiles per KV head; a group of 3 (masked heads)
        g = fp8_paged_case(
            rng,
            fmt,
            per_head,
            dtype=dtype,
            kv_lens=[29, 50],
            q_lens=[1, 2],
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=64,
            page_size=16,
        )
        check_attention(g, splits=2, what=f"{fmt} group {hq // hkv}")


def test_fp8_scales_matter(family):
    """The test can fail: the same codes with scales of 1 (or K's scale
    read for V) give an output far from the kernel's."""
    rng = np.random.default_rng(3)
    sc = fp8_paged_case(rng, "e4m3", True, dtype="f16", kv_lens=[30, 50], num_q_heads=8, num_kv_heads=2, head_dim=64)
    o, _, _ = run_attention(sc)
    ref, _ = reference_out(sc)
    assert_close(o, ref, "f16")
    unscaled = store(rng, sc.case, None)
    unscaled.k_ref = reference.dequantize_fp8(sc.k_cache)
    unscaled.v_ref = reference.dequantize_fp8(sc.v_cache)
    wrong, _ = reference_out(unscaled)
    assert not np.allclose(o.astype(np.float64), wrong, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", ["e5m2"])
def test_fp8_score_features(family, fmt):
    """fp8 with every score feature on (soft cap, window, sinks, ALiBi: the
    gate's fp8 build), decode and chunked prefill, split and not (one
    format: a build of its own)."""
    rng = np.random.default_rng(5)
    sc = fp8_paged_case(
        rng,
        fmt,
        True,
        dtype="bf16",
        kv_lens=[45, 70, 12],
        q_lens=[1, 5, 12],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
    )
    score = dict(
        soft_cap=20.0,
        window=17,
        sinks=rng.standard_normal(8).astype(np.float32),
        alibi_slopes=rng.uniform(0.01, 0.1, 8).astype(np.float32),
    )
    assert check_attention(sc, what="features", **score) == (family,)
    check_attention(sc, splits=3, what="features split3", **score)


@pytest.mark.parametrize("fmt", [None, "e4m3", "e5m2"])
@pytest.mark.parametrize("view", ["hnd", "combined"])
def test_views(family, fmt, view):
    """HND views and the halves of one combined KV tensor, 16-byte aligned
    (vector loads), q's dtype and fp8."""
    rng = np.random.default_rng(7)
    sc = fp8_paged_case(
        rng,
        fmt,
        True,
        view,
        dtype="f16",
        kv_lens=[33, 64, 5],
        q_lens=[1, 6, 5],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
    )
    assert not sc.k_cache.flags.c_contiguous
    assert check_attention(sc, what=view) == (family,)
    check_attention(sc, False, splits=2, what=f"{view} non-causal split2")


@pytest.mark.parametrize("fmt", [None, "e5m2"])
def test_misaligned_view_element_loads(fmt):
    """Caches starting one element past a 16-byte boundary run on
    paged_attention's element-load build (VEC_LOADS 0)."""
    rng = np.random.default_rng(9)
    sc = fp8_paged_case(
        rng,
        fmt,
        False,
        "misaligned",
        dtype="f16",
        kv_lens=[20, 41],
        q_lens=[1, 4],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )
    assert sc.k_cache.ctypes.data % 16 != 0
    assert check_attention(sc, what="misaligned") == ("paged_attention",)
    check_attention(sc, splits=2, what="misaligned split2")


def test_uint8_storage(family):
    """Raw uint8 storage named by kv_dtype reads as the ml_dtypes array."""
    rng = np.random.default_rng(13)
    sc = fp8_paged_case(
        rng, "e4m3", True, dtype="f16", uint8=True, kv_lens=[21, 40], num_q_heads=8, num_kv_heads=2, head_dim=64
    )
    assert sc.k_cache.dtype == np.uint8
    assert check_attention(sc, what="uint8") == (family,)


# ----------------------------------------------------------------------- MLA
@pytest.mark.parametrize("fmt", [None, "e4m3"])
def test_mla_576_view(family, fmt):
    """The DeepSeek cache as one [pages, page_size, 1, 576] array: latent =
    c[..., :512], k_pos = c[..., 512:], bf16 and fp8 (k_scale: the latent,
    v_scale: k_pos)."""
    rng = np.random.default_rng(17)
    sm = stored_mla(rng, fmt, num_heads=8, latent_dim=512, pos_dim=64, kv_lens=[19, 40], q_lens=[1, 3], page_size=16)
    assert sm.latent.strides[2] == 576 * sm.latent.itemsize
    assert check_mla(sm, what="mla 576") == (family,)
    check_mla(sm, splits=2, what="mla 576 split2")


@pytest.mark.parametrize("fmt", [None, "e4m3"])
def test_mla_without_rope(family, fmt):
    """P = 0: mla(q, None, latent, None): V is the latent (scaled by k_scale)."""
    rng = np.random.default_rng(19)
    sm = stored_mla(
        rng,
        fmt,
        rope=False,
        joint=False,
        dtype="f16",
        num_heads=4,
        latent_dim=64,
        pos_dim=16,
        kv_lens=[30, 9, 50],
        q_lens=[1, 9, 2],
        page_size=16,
    )
    assert check_mla(sm, what="mla P=0") == (family,)
    check_mla(sm, False, splits=2, what="mla P=0 non-causal split2")


# ------------------------------------------------------------------ the cache
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_paged_kv_cache_end_to_end(fmt):
    """PagedKVCache(dtype=fmt) + append + attention through kv_args: the
    reference reads the cache's own codes, dequantized."""
    rng = np.random.default_rng(23)
    hq, hkv, d, layers = 8, 2, 64, 2
    k_scale = np.array([0.05, 0.11], np.float32)[None].repeat(layers, 0)
    v_scale = np.array([0.07], np.float32).repeat(layers)
    cache = cupaged.PagedKVCache(
        12, 8, hkv, d, fmt, layers=layers, like=np.zeros(1, np.float16), k_scale=k_scale, v_scale=v_scale
    )
    lens = [13, 30]
    seqs = [cache.add_sequence() for _ in lens]
    plan, _ = cache.prepare(seqs, lens)
    n = sum(lens)
    new_k = rng.standard_normal((n, hkv, d)).astype(np.float16)
    new_v = rng.standard_normal((n, hkv, d)).astype(np.float16)
    q = rng.standard_normal((n, hq, d)).astype(np.float16)
    layer = 1
    cache.append(plan, new_k, new_v, layer=layer)
    out = plan.attention(q, cache.k[layer], cache.v[layer], d**-0.5, **cache.kv_args(layer))
    kr = reference.dequantize_fp8(cache.k[layer], scale=k_scale[layer][:, None])
    vr = reference.dequantize_fp8(cache.v[layer], scale=v_scale[layer])
    ref, _ = reference.paged_attention(
        q, kr, vr, plan.host.page_table, plan.host.kv_lens, plan.host.q_lens, d**-0.5, True
    )
    assert_close(out, ref, "f16")


# ---------------------------------------------------------------------- errors
def _plan_and_case(rng, fmt="e4m3"):
    sc = fp8_paged_case(rng, fmt, True, dtype="f16", kv_lens=[9, 17], num_q_heads=4, num_kv_heads=2, head_dim=32)
    c = sc.case
    plan = cupaged.HostPlan.build(c.page_table, c.kv_lens, c.q_lens, c.page_size, c.num_pages).upload(c.q)
    return plan, sc


def _errors():
    f32 = np.float32
    return [
        (
            "q: expected dtype float16 or bfloat16 with an fp8 (e4m3) cache, got float32",
            lambda sc: dict(q=sc.case.q.astype(f32)),
        ),
        ("k_scale: expected shape [] or [1] (per tensor) or [2]", lambda sc: dict(k_scale=np.ones(3, f32))),
        ("v_scale: expected dtype float32, got float16", lambda sc: dict(v_scale=np.ones(2, np.float16))),
        (
            "k_scale: expected None for a float16 cache",
            lambda sc: dict(k_cache=sc.case.k_cache, v_cache=sc.case.v_cache, kv_dtype=None),
        ),
        (
            "k_cache: uint8 is raw fp8 storage: name its format with kv_dtype",
            lambda sc: dict(k_cache=sc.k_cache.view(np.uint8), v_cache=sc.v_cache.view(np.uint8), kv_dtype=None),
        ),
        ("k_cache: expected a contiguous innermost dim", lambda sc: dict(k_cache=np.asfortranarray(sc.k_cache))),
        (
            "v_cache: expected dtype float8_e4m3fn like k_cache",
            lambda sc: dict(v_cache=sc.v_cache.view(np.uint8).view(ml_dtypes.float8_e5m2), kv_dtype=None),
        ),
        ("kv_dtype: expected one of", lambda sc: dict(kv_dtype="int4")),
    ]


@pytest.mark.parametrize("msg,change", _errors(), ids=[m.split(":")[0] + str(i) for i, (m, _) in enumerate(_errors())])
def test_errors(msg, change):
    """Bad inputs are refused before any launch, naming the argument; out is
    left untouched."""
    rng = np.random.default_rng(29)
    plan, sc = _plan_and_case(rng)
    args = dict(q=sc.case.q, k_cache=sc.k_cache, v_cache=sc.v_cache, **sc.kv_args)
    args.update(change(sc))
    if "kv_dtype" in args and args["kv_dtype"] is None:
        del args["kv_dtype"]
    out = np.full((plan.queries, 4, 32), 7, np.float16)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    if "k_scale: expected None" in msg:
        args.pop("v_scale")
    with pytest.raises(PagedAttentionError, match=re.escape(msg)):
        plan.attention(q, k, v, 0.1, out=out if q.dtype == np.float16 else None, **args)
    assert (out == 7).all()


def test_mla_errors():
    rng = np.random.default_rng(31)
    sm = stored_mla(rng, "e4m3", num_heads=4, latent_dim=64, pos_dim=16, kv_lens=[9, 17])
    c = sm.case
    plan = cupaged.HostPlan.build(c.page_table, c.kv_lens, c.q_lens, c.page_size, c.num_pages).upload(c.q)
    with pytest.raises(PagedAttentionError, match="q_rot, k_rot: expected both or neither"):
        plan.mla(c.q, None, sm.latent, sm.k_pos, 0.1, **sm.kv_args)
    with pytest.raises(PagedAttentionError, match="v_scale: expected None without k_rot"):
        plan.mla(c.q, None, sm.latent, None, 0.1, **sm.kv_args)
    with pytest.raises(PagedAttentionError, match="q: expected dtype float16 or bfloat16"):
        plan.mla(c.q.astype(np.float32), c.q_pos.astype(np.float32), sm.latent, sm.k_pos, 0.1, **sm.kv_args)
    with pytest.raises(PagedAttentionError, match="k_rot: expected dtype float8_e4m3fn or uint8"):
        plan.mla(c.q, c.q_pos, sm.latent, c.k_pos, 0.1, **sm.kv_args)


def test_outputs_must_not_overlap_scales():
    rng = np.random.default_rng(37)
    plan, sc = _plan_and_case(rng)
    lse = np.ones((plan.queries, 4), np.float32)  # valid scales (> 0): the overlap is what is refused
    with pytest.raises(PagedAttentionError, match="lse: expected memory disjoint from k_scale"):
        plan.attention(
            sc.case.q,
            sc.k_cache,
            sc.v_cache,
            0.1,
            lse=lse,
            kv_dtype="e4m3",
            k_scale=lse[0, :2],
            v_scale=sc.kv_args["v_scale"],
        )


def test_non_fp8_views_stay_unchanged(family):
    """A plain f16 case through the NHD path and the same elements as an
    HND view agree to the last bit (one kernel, the same order of work)."""
    rng = np.random.default_rng(41)
    case = make_paged_case(rng, kv_lens=[30, 12], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="f16")
    a, _, _ = run_attention(store(rng, case, None, view="nhd"))
    b, _, _ = run_attention(store(rng, case, None, view="hnd"))
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ selection
def test_selection_follows_the_storage_tables():
    """fp8 builds exist only for FP8_KERNELS, strided caches go only to
    STRIDED_KERNELS, MLA kernels serve V = K only, and the gate registers
    fp8 builds at the fast dims with FP8_GATE_FEATURES only (no compile)."""
    from cupaged.ops.attention import variants
    from cupaged.ops.attention.splits import choose_splits

    rows = [v for vs in variants._TABLE.values() for v in vs]
    assert {v.kernel for v in rows if v.kv_dtype in ("e4m3", "e5m2")} <= variants.FP8_KERNELS
    for v in variants.VARIANTS:
        if v.kv_dtype in ("e4m3", "e5m2"):
            assert variants._gate_fast(v) and v.features in variants.FP8_GATE_FEATURES, v
    for dt, kv in variants.FP8_PAIRS + (("f16", "f16"),):
        for d, rot, latent in ((64, 0, False), (128, 0, False), (512, 64, True), (512, 0, True), (512, 0, False)):
            for strided in (False, True):
                tc = variants.select_tensor_core(
                    dt, d, d, True, True, rot, kv_dtype=kv, strided=strided, latent=latent, arch="sm_90"
                )
                if tc is not None:
                    assert not strided or tc.kernel in variants.STRIDED_KERNELS
                    assert tc.kernel not in ("paged_mla_tc", "paged_mla_wgmma") or latent
                pq = variants.select_variant(
                    dt, d, d, True, 1 if rot else 4, rot, kv_dtype=kv, strided=strided, latent=latent
                )
                assert not strided or pq.kernel in variants.STRIDED_KERNELS
                assert (kv not in ("e4m3", "e5m2")) or pq.kernel in variants.FP8_KERNELS
    case = make_paged_case(np.random.default_rng(0), kv_lens=[4000], num_q_heads=8, num_kv_heads=2, head_dim=128)
    host = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages)
    n = choose_splits(host, 2, multiprocessors=132, q_heads=8, head_dim=128, dtype="bf16", kv_dtype="e4m3")
    assert 1 < n <= 16
