"""Cache storage on the tensor-core attention kernels (paged_decode_tc,
paged_prefill_tc; issue #14): fp8 caches and cache views, against the
float64 reference on the DEQUANTIZED cache times its scale
(``storage_helpers``), on the CPU backend (the kernels' own code through
kernels_cu/ptx.cuh's emulation) as sm_80 (``mma_sync_arch``: sm_90 selects
paged_prefill_wgmma, whose storage cases are test_prefill_wgmma.py's).

fp8: e4m3 and e5m2 codes under f16 and bf16 q, scales per tensor (shape []
or [1]) and per KV head; decode at GQA groups 4 and 8 (D 128 / 64), chunked
prefill at D 64 / 128 / 256, causal and not, with and without splits, the
four score features together (a window among them), uint8 storage named by
kv_dtype. The kernels decode each code exactly (K into q's type, V into
f16) and apply the scales in f32 (K's folded into the score scale, V's into
the output), so the tolerance is q's dtype's (``cupaged.testing.tolerance``):
f16 atol/rtol 2e-3 / 2e-3, bf16 1.6e-2 / 1.6e-2. Unused slots of partly
filled pages hold NaN codes (e5m2: Inf in about half), and rows only later
queries see hold NaN / Inf codes: none reaches an output.

Views: HND (a [pages, Hkv, page_size, D] array transposed), the two halves
of a combined [pages, 2, page_size, Hkv, D] tensor, for 16-bit and fp8
caches; a view starting off a 16-byte boundary goes to paged_attention's
element loads instead (not these kernels).

Each test checks which kernel ran (``launch.launches_for``). Builds are
shared between the tests (about 8 fp8 CPU compiles in all).
"""

from __future__ import annotations

import numpy as np
import pytest
from storage_helpers import (
    StoredCase,
    as_view,
    check_attention,
    fp8_paged_case,
    quantized,
    reference_out,
    run_attention,
)

from cupaged.testing import assert_close, reference

DECODE_TC, PREFILL_TC = "paged_decode_tc", "paged_prefill_tc"
pytestmark = pytest.mark.usefixtures("mma_sync_arch")


@pytest.fixture(autouse=True)
def cpu_only(xp_backend):
    if xp_backend.name != "cpu":
        pytest.skip("NumPy storage cases (the GPU runs them through tools/device_check.sh)")


def decode_case(rng, fmt, dtype, per_head, shape, *, view="nhd", uint8=False):
    """Decode steps, one short multi-query sequence at GQA 4 (each query its
    own block: 3 x 4 rows stay on the per-query kernel)."""
    page_size, d, hq, hkv = shape
    kv_lens = np.array([70, 1, 33, 150, 16], np.int32)
    q_lens = np.array([1, 1, 3, 1, 1], np.int32) if hq // hkv <= 4 else np.ones(5, np.int32)
    return fp8_paged_case(
        rng,
        fmt,
        per_head,
        view,
        dtype=dtype,
        uint8=uint8,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
    )


def prefill_case(rng, fmt, dtype, per_head, shape, *, view="nhd"):
    """Chunks of 16..80 queries on cached tokens, one sequence sitting out."""
    page_size, d, hq, hkv = shape
    return fp8_paged_case(
        rng,
        fmt,
        per_head,
        view,
        dtype=dtype,
        kv_lens=np.array([95, 41, 30, 130], np.int32),
        q_lens=np.array([80, 16, 0, 33], np.int32),
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
    )


def poisoned(sc) -> bool:
    """Whether the stored case has NaN / Inf codes in unused slots."""
    raw = np.asarray(sc.k_cache).view(np.uint8) & 0x7F
    return bool(((raw == 0x7F) | (raw == 0x7E) | (raw == 0x7C)).any())


# (fmt, q dtype, per-head scales, (page_size, D, Hq, Hkv)): GQA 4 at D 128, GQA 8 at D 64 (pages of 16 and 5).
DECODE = [
    ("e4m3", "f16", True, (16, 128, 32, 8)),
    ("e5m2", "bf16", False, (16, 128, 32, 8)),
    ("e4m3", "bf16", False, (5, 64, 16, 2)),
    ("e5m2", "bf16", True, (16, 128, 16, 2)),
]


@pytest.mark.parametrize("fmt, dtype, per_head, shape", DECODE, ids=lambda x: str(x))
def test_decode_tc_fp8(fmt, dtype, per_head, shape):
    rng = np.random.default_rng([len(fmt), len(dtype), shape[1], shape[2]])
    sc = decode_case(rng, fmt, dtype, per_head, shape)
    assert poisoned(sc)
    for causal in (True, False):
        for splits in (None, 3):
            ran = check_attention(sc, causal, splits=splits, what=f"{fmt}/{dtype} {shape} {causal} {splits}")
            assert ran == (DECODE_TC,), ran


# (fmt, q dtype, per-head scales, (page_size, D, Hq, Hkv)): D 64 / 128 / 256, GQA 1 / 4.
PREFILL = [
    ("e4m3", "f16", False, (16, 64, 4, 4)),
    ("e5m2", "bf16", True, (1, 128, 8, 2)),
    ("e4m3", "bf16", True, (16, 256, 8, 2)),
]


@pytest.mark.parametrize("fmt, dtype, per_head, shape", PREFILL, ids=lambda x: str(x))
def test_prefill_tc_fp8(fmt, dtype, per_head, shape):
    rng = np.random.default_rng([len(fmt), len(dtype), shape[1]])
    sc = prefill_case(rng, fmt, dtype, per_head, shape)
    assert poisoned(sc)
    for causal in (True, False):
        for splits in (None, 3):
            ran = check_attention(sc, causal, splits=splits, what=f"{fmt}/{dtype} {shape} {causal} {splits}")
            assert ran == (PREFILL_TC,), ran


def test_scale_shapes_and_uint8_storage():
    """A per-tensor scale of shape [1] reads as shape []; uint8 storage named
    by kv_dtype reads as the ml_dtypes array; the scales matter (a wrong one
    fails the comparison); no scales mean 1."""
    rng = np.random.default_rng(40)
    sc = decode_case(rng, "e5m2", "bf16", False, (16, 128, 32, 8), uint8=True)
    assert sc.k_cache.dtype == np.uint8
    sc.kv_args["k_scale"] = sc.kv_args["k_scale"].reshape(1)
    assert check_attention(sc, True, what="uint8, [1] scales") == (DECODE_TC,)
    sc.kv_args["v_scale"] = np.array(sc.kv_args["v_scale"] * 1.5, np.float32)
    o, _, _ = run_attention(sc, True)
    with pytest.raises(AssertionError):
        assert_close(o, reference_out(sc, True)[0], "bf16")
    sc.kv_args["v_scale"] = np.array(sc.kv_args["v_scale"] / 1.5, np.float32)
    sc.kv_args["k_scale"] = np.array(sc.kv_args["k_scale"] * 1.5, np.float32)
    _, lse, _ = run_attention(sc, True)
    with pytest.raises(AssertionError):
        assert_close(lse, reference_out(sc, True)[1], "bf16")
    # No scales: the codes' own values (scale 1), decode and prefill.
    for sc, kernel in (
        (decode_case(rng, None, "f16", False, (16, 128, 32, 8)), DECODE_TC),
        (prefill_case(rng, None, "f16", False, (16, 64, 4, 4)), PREFILL_TC),
    ):
        case, one = sc.case, np.float32(1)
        codes = [
            quantized(c.astype(np.float32), "e4m3", one, poison_rng=rng, used=case.slot_used)
            for c in (case.k_cache, case.v_cache)
        ]
        sc = StoredCase(case, *codes, {"kv_dtype": "e4m3"}, *(reference.dequantize_fp8(c, scale=one) for c in codes))
        assert check_attention(sc, True, splits=2, what=f"{kernel} unscaled") == (kernel,)


def test_score_features_with_fp8():
    """Soft cap, window, sinks and ALiBi together (the gate's build) over
    fp8 caches: the K scale is folded before the cap, the V scale after the
    sink; decode and a chunked prefill, split and not."""
    rng = np.random.default_rng(41)
    for sc, kernel in (
        (decode_case(rng, "e4m3", "f16", True, (16, 128, 32, 8)), DECODE_TC),
        (prefill_case(rng, "e5m2", "bf16", True, (1, 128, 8, 2)), PREFILL_TC),
    ):
        hq = sc.case.q.shape[1]
        score = dict(
            soft_cap=6.0,
            window=24,
            sinks=rng.uniform(-1, 2, hq).astype(np.float32),
            alibi_slopes=rng.uniform(0, 0.1, hq).astype(np.float32),
        )
        for splits in (None, 3):
            assert check_attention(sc, True, splits=splits, what=f"{kernel} features {splits}", **score) == (kernel,)


def _view(sc, view):
    """sc with its caches in ``view``; "mixed": K as stored (NHD), V an HND
    view (K and V with different strides)."""
    if view == "mixed":
        sc.v_cache = as_view(sc.v_cache, sc.v_cache, "hnd")[1]
    return sc


@pytest.mark.parametrize("view", ["hnd", "combined", "mixed"])
@pytest.mark.parametrize("fmt", [None, "e4m3"], ids=["16bit", "e4m3"])
def test_views(view, fmt):
    """HND and combined-KV views (strided, 16-byte aligned), and K / V with
    different strides, stay on the tensor-core kernels, 16-bit or fp8."""
    rng = np.random.default_rng([len(view), 1 if fmt else 0])
    layout = "nhd" if view == "mixed" else view
    sc = _view(decode_case(rng, fmt, "bf16" if fmt is None else "f16", True, (16, 128, 32, 8), view=layout), view)
    assert not (sc.k_cache.flags.c_contiguous and sc.v_cache.flags.c_contiguous)
    assert check_attention(sc, True, splits=3, what=f"decode {view} {fmt}") == (DECODE_TC,)
    sc = _view(prefill_case(rng, fmt, "f16", False, (16, 64, 4, 4), view=layout), view)
    assert check_attention(sc, False, what=f"prefill {view} {fmt}") == (PREFILL_TC,)


@pytest.mark.parametrize("fmt", [None, "e4m3"], ids=["16bit", "e4m3"])
def test_misaligned_view_leaves_tensor_cores(fmt):
    """A cache one element off a 16-byte boundary cannot take cp.async: the
    step runs on paged_attention's element loads, still right."""
    rng = np.random.default_rng(42)
    sc = prefill_case(rng, fmt, "f16", False, (16, 64, 4, 4), view="misaligned")
    ran = check_attention(sc, True, what=f"misaligned {fmt}")
    assert DECODE_TC not in ran and PREFILL_TC not in ran and "paged_attention" in ran


@pytest.mark.parametrize("splits", [None, 2])
def test_nonfinite_codes_only_later_queries_see(splits):
    """NaN codes in the K row and Inf / NaN codes in the V row of tokens
    that only later queries of their chunk see (causal, inside tiles the
    earlier rows do see): the earlier queries' outputs are the reference's,
    finite, on both kernels (prefill: tc::pv_step keeps the masked value
    rows out of the f16 mma)."""
    rng = np.random.default_rng(43)
    for sc, kernel in (
        (decode_case(rng, "e5m2", "bf16", True, (16, 128, 32, 8)), DECODE_TC),
        (prefill_case(rng, "e4m3", "f16", False, (16, 64, 4, 4)), PREFILL_TC),
    ):
        case = sc.case
        kv_lens, q_lens = case.kv_lens, case.q_lens
        # Sequence 0's last key is seen only by its last query; sequence 3's last two by its last two.
        hits = [(0, int(kv_lens[0]) - 1)] + (
            [(3, int(kv_lens[3]) - 2), (3, int(kv_lens[3]) - 1)] if q_lens[3] > 1 else [(2, int(kv_lens[2]) - 1)]
        )
        inf = 0x7C if sc.kv_args["kv_dtype"] == "e5m2" else 0x7F
        dirty = np.zeros(int(q_lens.sum()), bool)
        starts = np.concatenate([[0], np.cumsum(q_lens)])
        for s, t in hits:
            page, slot = case.page_table[s, t // case.page_size], t % case.page_size
            sc.k_cache.view(np.uint8)[page, slot] = 0x7F if sc.kv_args["kv_dtype"] == "e4m3" else 0x7E
            sc.v_cache.view(np.uint8)[page, slot] = inf
            first = int(kv_lens[s] - q_lens[s])  # position of the sequence's first query
            dirty[starts[s] + max(0, t - first) : starts[s + 1]] = True
        o, lse, ran = run_attention(sc, True, splits=splits)
        assert ran == (kernel,), ran
        ref_o, ref_lse = reference_out(sc, True)
        clean = ~dirty
        assert np.isfinite(o[clean].astype(np.float64)).all()
        assert_close(o[clean], ref_o[clean], sc.case.q.dtype, f"{kernel} earlier queries")
        assert_close(lse[clean], ref_lse[clean], sc.case.q.dtype, f"{kernel} earlier queries' lse")
        assert not np.isfinite(o[dirty].astype(np.float64)).all()  # the later ones do see them
