"""The wgmma chunked-prefill kernel (paged_prefill_wgmma, sm_90a) against the
float64 references, on the CPU backend standing in for sm_90
(``cpu_arch_override``; kernels_cu/ptx.cuh emulates wgmma asynchronously:
the products are queued per warp and run at the wait_group covering them).

Chunks on cached prefixes, GQA 1 / 3 / 4 / 8 / 96, D 64 / 128 / 256, page
sizes 1 / 16 / 64 over a random page permutation with NaN / Inf in the
unused slots (``make_paged_case``), causal and not, splits, the score
features (soft cap, window, sinks, ALiBi) and score variants (the toy
``test_bias``, the runtime-data ``head_bias`` of test_variant.py), fp8 e4m3 /
e5m2 caches and strided views, and Inf / NaN value rows only later queries
see. P is rounded to the 16-bit type before O += P V (f16 for fp8 caches),
as in paged_prefill_tc; the tolerances are q's dtype's, as in
test_prefill_tc.py and test_tc_storage.py. Selection: sm_90 runs this kernel for
tensor-core prefill, sm_80 (and no arch) paged_prefill_tc (the autouse
fixture ``sm90`` puts the CPU backend on sm_90)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import PREFILL_WGMMA, TC_DTYPES, check, run
from storage_helpers import check_attention, fp8_paged_case, reference_out, run_attention
from test_variant import HEAD_BIAS, TEST_BIAS, _launch_log, biased_reference, head_bias_hook

import cupaged
from cupaged._runtime import archs
from cupaged.ops.attention import launch, options, plan_launches, variants
from cupaged.ops.attention.kernels import prefill_wgmma
from cupaged.testing import assert_close, make_paged_case, reference

MERGE = "attention_split_merge"


@pytest.fixture(autouse=True)
def sm90(xp_backend):
    """The CPU backend as sm_90 (whatever CUPAGED_CPU_ARCH says); on a GPU only an sm_90 device runs these."""
    if xp_backend.name == "gpu":
        import cupy

        if archs.device_arch(cupy.zeros(1)) != "sm_90":
            pytest.skip("the GPU is not sm_90")
        yield
        return
    with archs.cpu_arch_override("sm_90"):
        yield


def _case(rng, shape, dtype, kv_lens=(95, 41, 30, 130), q_lens=(80, 16, 0, 33)):
    page_size, d, hq, hkv = shape
    return make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens, np.int32),
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )


# (page_size, head_dim, q_heads, kv_heads): GQA 1 (128 queries a block: blocks straddle sequences), 4 and 8,
# page sizes 1 / 16 / 64, D 64 / 128 / 256.
SHAPES = [
    (16, 64, 4, 4),
    (1, 128, 8, 2),
    (64, 128, 8, 1),
    (16, 256, 8, 2),
]


# Each shape with one dtype (f16 and bf16 both at D 128): one build a case, the suite's cold time in mind.
@pytest.mark.parametrize(
    "dtype, shape",
    [(d, s) for d, s in zip(("bf16", "f16", "bf16", "f16"), SHAPES)],
    ids=lambda s: str(s).replace(" ", ""),
)
def test_wgmma_prefill_chunks(xp_backend, kernels_used, dtype, shape):
    """Chunks of 16..80 queries on cached tokens (one sequence sitting the
    step out), causal and not, with and without splits."""
    rng = np.random.default_rng(list(shape))
    case = _case(rng, shape, dtype)
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"wgmma prefill {shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {PREFILL_WGMMA, MERGE}


@pytest.mark.parametrize(
    "shape",
    [("bf16", (16, 64, 1, 1), [300], [300]), ("f16", (16, 128, 8, 8), [200, 70], [140, 3])],
    ids=["1x300", "chunked"],
)
def test_wgmma_long_prefill(xp_backend, kernels_used, shape):
    """A whole prefill of 300 queries (three blocks of 128 rows, causal
    diagonals inside the tiles) and a chunk of 140 on a prefix of 60."""
    dtype, dims, kv_lens, q_lens = shape
    rng = np.random.default_rng(len(kv_lens))
    case = _case(rng, dims, dtype, kv_lens, q_lens)
    for causal, splits in ((True, None), (False, None), (True, 2)):
        o, lse, _ = run(xp_backend, case, causal, splits=splits)
        check(case, o, lse, causal, dtype, f"{shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {PREFILL_WGMMA, MERGE}


@pytest.mark.parametrize(
    "shape", [("f16", 96, 1, [1, 2, 1]), ("bf16", 6, 2, [30, 17, 5])], ids=lambda s: "{}-h{}x{}".format(*s[:3])
)
def test_wgmma_odd_groups(xp_backend, kernels_used, shape):
    """A group of 96 heads (one query a block of 128 rows, 32 unused) and a
    group of 3 (42 queries x 3 heads, two rows unused)."""
    dtype, hq, hkv, q_lens = shape
    rng = np.random.default_rng(hq)
    case = _case(rng, (16, 64, hq, hkv), dtype, [50, 23, 70], q_lens)
    for causal in (True, False):
        for splits in (None, 2):
            o, lse, _ = run(xp_backend, case, causal, splits=splits)
            check(case, o, lse, causal, dtype, f"{shape} causal={causal} splits={splits}")
    assert PREFILL_WGMMA in kernels_used and "paged_prefill_tc" not in kernels_used


def test_wgmma_score_features(xp_backend, kernels_used):
    """Soft cap, window, sinks and ALiBi, each alone and all together, causal
    and not, split and not (bf16, D 128, GQA 4)."""
    rng = np.random.default_rng(7)
    case = _case(rng, (16, 128, 8, 2), "bf16", [150, 41, 90], [130, 16, 33])
    hq = 8
    sinks = rng.uniform(-1, 2, hq).astype(np.float32)
    slopes = rng.uniform(0, 0.1, hq).astype(np.float32)
    every = [
        dict(soft_cap=6.0),
        dict(window=24),
        dict(sinks=sinks),
        dict(alibi_slopes=slopes),
        dict(soft_cap=6.0, window=70, sinks=sinks, alibi_slopes=slopes),
    ]
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    for feats in every:
        for causal, splits in ((True, None), (False, 3), (True, 2)):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, hq, 128, splits, case.q)
            o, lse = plan.attention(
                case.q, case.k_cache, case.v_cache, case.scale, causal, workspace=ws, return_lse=True, **feats
            )
            ref_o, ref_lse = reference.scored_attention(
                case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, causal,
                **feats,
            )  # fmt: skip
            what = f"{sorted(feats)} causal={causal} splits={splits}"
            o = np.asarray(o)
            assert np.isfinite(o.astype(np.float64)).all(), what
            assert_close(o, ref_o, "bf16", f"{what} out")
            assert_close(np.asarray(lse), ref_lse, "bf16", f"{what} lse")
    assert set(kernels_used) == {PREFILL_WGMMA, MERGE}


@pytest.fixture
def toy_scores(monkeypatch, xp_backend):
    """SCORES with test_variant.py's toy row and its head_bias option row (CPU only: a new score compiles
    from the test's variant.cuh hooks); the launches' (kernel, CP_SCORE) are logged."""
    if xp_backend.name != "cpu":
        pytest.skip("score variants defined by the tests (CPU backend)")
    monkeypatch.setitem(variants.SCORES, TEST_BIAS.name, TEST_BIAS)
    monkeypatch.setitem(options.ROWS, HEAD_BIAS.name, HEAD_BIAS)
    monkeypatch.setattr(reference, "LOGIT_HOOKS", {"head_bias": head_bias_hook, **reference.LOGIT_HOOKS})
    return _launch_log(monkeypatch)


@pytest.mark.parametrize("causal, splits", [(True, None), (False, 3)])
def test_wgmma_score_variants(toy_scores, causal, splits):
    """The score hook of variant.cuh: the toy test_bias (head and positions)
    and head_bias (runtime data, with the soft cap and ALiBi on top)."""
    rng = np.random.default_rng(11)
    case = _case(rng, (16, 64, 8, 2), "f16", [70, 33, 90], [40, 20, 33])
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 8, 64, splits, case.q)
    out = np.zeros((plan.queries, 8, 64), case.q.dtype)
    lse = np.zeros((plan.queries, 8), np.float32)
    opts = options.AttentionOptions.checked(case.scale, causal, "test_bias")
    launch.launch_attention(plan.stream, plan, case.q, case.k_cache, case.v_cache, out, opts, lse=lse, workspace=ws)
    ref_o, ref_lse = biased_reference(
        case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, causal
    )
    assert_close(out, ref_o, "f16", "test_bias out")
    assert_close(lse, ref_lse, "f16", "test_bias lse")
    bias = rng.uniform(-2.0, 2.0, 8).astype(np.float32)
    extra = dict(soft_cap=0.7, alibi_slopes=rng.uniform(0.0, 0.2, 8).astype(np.float32))
    o, lse2 = plan.attention(
        case.q, case.k_cache, case.v_cache, case.scale, causal, workspace=ws, return_lse=True, head_bias=bias, **extra
    )
    ref_o, ref_lse = reference.scored_attention(
        case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, causal,
        head_bias=bias, **extra,
    )  # fmt: skip
    assert_close(o, ref_o, "f16", "head_bias out")
    assert_close(lse2, ref_lse, "f16", "head_bias lse")
    used = {(k, s) for k, s in toy_scores if k != MERGE}
    assert used == {(PREFILL_WGMMA, "test_bias"), (PREFILL_WGMMA, "head_bias")}


@pytest.fixture
def cpu_only(xp_backend):
    if xp_backend.name != "cpu":
        pytest.skip("NumPy storage cases (the GPU runs them through tools/device_check.sh)")


# (fmt, q dtype, per-head scales, (page_size, D, Hq, Hkv), view): D 64 / 128 / 256, GQA 1 / 4, NHD / HND /
# combined views.
FP8 = [
    ("e4m3", "f16", False, (16, 64, 4, 4), "nhd"),
    ("e5m2", "bf16", True, (1, 128, 8, 2), "combined"),
    ("e4m3", "bf16", True, (16, 128, 8, 2), "hnd"),
    ("e5m2", "f16", True, (16, 256, 8, 2), "nhd"),
]


@pytest.mark.parametrize("fmt, dtype, per_head, shape, view", FP8, ids=lambda x: str(x))
def test_wgmma_fp8_and_views(cpu_only, fmt, dtype, per_head, shape, view):
    """fp8 caches (NaN / Inf codes in unused slots), scales per tensor or KV
    head, strided views; against the reference on the dequantized cache."""
    page_size, d, hq, hkv = shape
    rng = np.random.default_rng([len(fmt), len(dtype), d, len(view)])
    sc = fp8_paged_case(
        rng, fmt, per_head, view, dtype=dtype, kv_lens=np.array([95, 41, 30, 130], np.int32),
        q_lens=np.array([80, 16, 0, 33], np.int32), page_size=page_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
    )  # fmt: skip
    for causal, splits in ((True, None), (False, 3), (True, 3)):
        ran = check_attention(sc, causal, splits=splits, what=f"{fmt}/{dtype} {shape} {view} {causal} {splits}")
        assert ran == (PREFILL_WGMMA,), ran
    if view == "nhd" and d == 128:
        return
    sc16 = fp8_paged_case(
        rng, None, False, view, dtype=dtype, kv_lens=np.array([60, 35], np.int32), q_lens=np.array([40, 18]),
        page_size=page_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
    )  # fmt: skip
    if view != "nhd":
        assert not (sc16.k_cache.flags.c_contiguous and sc16.v_cache.flags.c_contiguous)
    assert check_attention(sc16, True, splits=2, what=f"16-bit {view}") == (PREFILL_WGMMA,)


@pytest.mark.parametrize("fmt", [None, "e5m2"], ids=["16bit", "e5m2"])
@pytest.mark.parametrize("splits", [None, 2])
def test_wgmma_nonfinite_rows_only_later_queries_see(cpu_only, fmt, splits):
    """Inf / NaN in the K and V rows of tokens that only later queries of
    their chunk see (causal, inside tiles the earlier rows do see): the
    earlier queries' outputs are the reference's, finite; the later ones
    see them."""
    rng = np.random.default_rng(43 + (fmt is None))
    sc = fp8_paged_case(
        rng, fmt, False, "nhd", dtype="f16", kv_lens=np.array([95, 41, 30, 130], np.int32),
        q_lens=np.array([80, 16, 0, 33], np.int32), page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=128,
    )  # fmt: skip
    case = sc.case
    kv_lens, q_lens = case.kv_lens, case.q_lens
    hits = [(0, int(kv_lens[0]) - 1), (3, int(kv_lens[3]) - 2), (3, int(kv_lens[3]) - 1)]
    dirty = np.zeros(int(q_lens.sum()), bool)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    for i, (s, t) in enumerate(hits):
        page, slot = case.page_table[s, t // case.page_size], t % case.page_size
        if fmt is None:
            sc.k_cache[page, slot] = np.nan
            sc.v_cache[page, slot] = (np.inf, np.nan, -np.inf)[i]
        else:
            sc.k_cache.view(np.uint8)[page, slot] = 0x7E  # NaN
            sc.v_cache.view(np.uint8)[page, slot] = (0x7C, 0x7E, 0xFC)[i]  # Inf, NaN, -Inf
        first = int(kv_lens[s] - q_lens[s])  # position of the sequence's first query
        dirty[starts[s] + max(0, t - first) : starts[s + 1]] = True
    if fmt is None:
        sc.k_ref, sc.v_ref = sc.k_cache.astype(np.float64), sc.v_cache.astype(np.float64)
    o, lse, ran = run_attention(sc, True, splits=splits)
    assert ran == (PREFILL_WGMMA,), ran
    ref_o, ref_lse = reference_out(sc, True)
    clean = ~dirty
    assert np.isfinite(o[clean].astype(np.float64)).all()
    assert_close(o[clean], ref_o[clean], case.q.dtype, "earlier queries")
    assert_close(lse[clean], ref_lse[clean], case.q.dtype, "earlier queries' lse")
    assert not np.isfinite(o[dirty].astype(np.float64)).all()  # the later ones see them


def _host(q_lens, kv_lens, page=16):
    per = -(-max(kv_lens) // page)
    table = np.arange(len(q_lens) * per).reshape(len(q_lens), per)
    return cupaged.HostPlan.build(table, kv_lens, q_lens, page, len(q_lens) * per)


def test_selection_per_arch():
    """A D 128 causal prefill (1 x 4096) and a chunked one (4 x 2048): one
    paged_prefill_wgmma launch on sm_90 (sm_90a build, 128-row blocks, its
    shared memory), paged_prefill_tc on sm_80 and without an arch; both
    dtypes and fp8 caches; every head dim of the kernel."""
    for q_lens, kv_lens in (([4096], [4096]), ([2048] * 4, [4096] * 4)):
        host = _host(q_lens, kv_lens)
        for dt in TC_DTYPES:
            (L,) = plan_launches(host, dt, 32, 8, 128, 128, 0, True, True, arch="sm_90")
            assert L.kernel == PREFILL_WGMMA and L.defines["CP_TARGET"] == "sm_90a"
            assert L.threads == prefill_wgmma.THREADS + prefill_wgmma.PRODUCER_THREADS
            assert L.smem == prefill_wgmma.smem_bytes(128)
            assert L.blocks == -(-sum(q_lens) * 4 // 128) and L.grid(8, 1) == (L.blocks, 8, 1)
            assert [x.kernel for x in plan_launches(host, dt, 32, 8, 128, 128, 0, True, True, arch="sm_80")] == [
                "paged_prefill_tc"
            ]
            assert [x.kernel for x in plan_launches(host, dt, 32, 8, 128, 128, 0, True, True)] == ["paged_prefill_tc"]
    for dt in TC_DTYPES:
        for kv in (dt, "e4m3", "e5m2"):
            for d in prefill_wgmma.DIMS:
                v = variants.select_tensor_core(dt, d, d, True, True, kv_dtype=kv, arch="sm_90")
                assert v is not None and v.kernel == PREFILL_WGMMA and v.rows == 128, (dt, kv, d)
                assert v.smem == prefill_wgmma.smem_bytes(d, kv) and v.runs_on("sm_90") and not v.runs_on("sm_80")
                assert variants.select_tensor_core(dt, d, d, True, True, kv_dtype=kv, arch="sm_80").kernel == (
                    "paged_prefill_tc"
                )


@pytest.mark.parametrize("window", [None, 100])
def test_only_edge_tiles_mask(xp_backend, kernels_used, window):
    """A tile every row of a warp sees whole takes the unmasked softmax; only the tiles some row sees in part
    (the causal diagonal, a window's start, a sequence's end) mask (FlashAttention-3's split). One sequence
    prefilled from 0, 256 tokens, GQA 4 (32 queries of 4 heads a block of 128 rows, 4 queries a warp): on
    the CPU, the edge-tile marker counts one tile per consumer warp and block for the diagonal, none
    non-causal, and with a window those where the warp's rows start too; the outputs match the reference."""
    rng = np.random.default_rng(11)
    case = make_paged_case(
        rng,
        kv_lens=np.array([256], np.int32),
        q_lens=np.array([256], np.int32),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=128,
        dtype="bf16",
    )
    from cupaged._runtime import get_kernel
    from cupaged.ops.attention import inputs
    from cupaged.tools import counters

    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages)
    dplan = plan.upload(case.q)
    opts = {} if window is None else {"window": window}
    marks = {}
    for causal in (True, False):
        if xp_backend.name == "cpu":
            (la,) = inputs.attention_call(
                dplan, case.q, case.k_cache, case.v_cache, case.scale, causal, **opts
            ).launches
            assert la.kernel == PREFILL_WGMMA
            module = get_kernel(case.q, la.source, la.kernel, la.defines).module
            counters.reset(module)
        q, k, v = (xp_backend.xp.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
        dev = plan.upload(q)
        o, lse = dev.attention(q, k, v, case.scale, causal, return_lse=True, **opts)
        ref_out, ref_lse = reference.scored_attention(
            case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, causal,
            **opts,
        )  # fmt: skip
        assert_close(xp_backend.to_numpy(o), ref_out, "bf16", f"causal={causal} window={window} out")
        assert_close(xp_backend.to_numpy(lse), ref_lse, "bf16", f"causal={causal} window={window} lse")
        if xp_backend.name == "cpu":
            marks[causal] = counters.read_all(module)["edge_tile"]
    assert PREFILL_WGMMA in kernels_used
    if xp_backend.name != "cpu":
        return
    blocks, consumer_warps = 256 // 32, 8
    # Warp w of block k holds queries 32 k + 4 w .. + 3: the diagonal is in one tile of 64 (never at its end).
    diagonal = blocks * consumer_warps
    if window is None:
        assert marks == {True: diagonal, False: 0}, marks
    else:
        # A window of 100: query q sees [q - 99, q] (causal) or [q - 99, 256). A block reads its tiles of 64
        # from its rows' first position on (32 queries: block k from 32 k - 99); a warp's tile is whole for
        # it when every one of its 4 queries sees all 64 tokens: count the tiles that are not.
        def edges(causal):
            def span(q):
                return max(0, q - window + 1), (q + 1 if causal else 256)

            n = 0
            for b0 in range(0, 256, 32):
                lo_b = min(span(q)[0] for q in range(b0, b0 + 32))
                hi_b = max(span(q)[1] for q in range(b0, b0 + 32))
                for q0 in range(b0, b0 + 32, 4):
                    rows = [span(q) for q in range(q0, q0 + 4)]
                    n += sum(not all(a <= t0 and t0 + 64 <= b for a, b in rows) for t0 in range(lo_b, hi_b, 64))
            return n

        assert marks == {True: edges(True), False: edges(False)}, marks
