"""MLA (DevicePlan.mla): the CUDA-core kernel's rotary part and the
tensor-core MLA kernel, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import DTYPES, TC_DTYPES, _to_device, check

import cupaged
from cupaged.ops.attention import AttentionOptions, launch, variants
from cupaged.testing import assert_close, make_mla_case, make_paged_case, reference

# ----------------------------------------------------------------- MLA (rotary part)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(64, 16, 4, 16), (512, 64, 16, 1), (96, 200, 3, 64), (512, 64, 1, 16), (33, 7, 128, 4)],
    ids=lambda s: "r{}-p{}-h{}-ps{}".format(*s),
)
def test_mla_rotary_part(xp_backend, dtype, shape):
    """score = scale * (q.latent + q_pos.k_pos), values are the latent rows,
    against reference.paged_mla; decode and a prefill chunk, both masks."""
    r, p, h, page_size = shape
    rng = np.random.default_rng(list(shape))
    case = make_mla_case(
        rng,
        kv_lens=np.array([45, 3, 30], np.int32),
        q_lens=np.array([1, 3, 7]),
        page_size=page_size,
        num_heads=h,
        latent_dim=r,
        pos_dim=p,
        dtype=dtype,
    )
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, page_size, case.num_pages).upload(q)
    for causal in (True, False):
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, h, r, splits, q)
            o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
            check(
                case,
                xp_backend.to_numpy(o),
                xp_backend.to_numpy(lse),
                causal,
                dtype,
                f"mla causal={causal} splits={splits}",
            )


def test_rotary_part_needs_one_latent_cache():
    """The rotary variants read V from the K rows: a separate V cache (or
    more than one KV head) is refused rather than silently ignored."""
    rng = np.random.default_rng(1)
    case = make_paged_case(rng, sequences=1, max_kv_len=8, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="f32")
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    out = np.empty((plan.queries, 2, 64), np.float32)
    k_rot = np.zeros(case.k_cache.shape[:3] + (8,), np.float32)
    q_rot = np.zeros((plan.queries, 2, 8), np.float32)
    with pytest.raises(cupaged.PagedAttentionError, match="v_cache: expected the K cache itself"):
        launch.launch_attention(
            plan.stream, plan, case.q, case.k_cache, case.v_cache, out, AttentionOptions(1.0), q_rot=q_rot, k_rot=k_rot
        )
    with pytest.raises(cupaged.PagedAttentionError, match="q_rot: expected a rotary dim up to 256"):
        launch.launch_attention(
            plan.stream,
            plan,
            case.q,
            case.k_cache,
            case.k_cache,
            out,
            AttentionOptions(1.0),
            q_rot=np.zeros((plan.queries, 2, 300), np.float32),
            k_rot=np.zeros(case.k_cache.shape[:3] + (300,), np.float32),
        )


# MLA at DeepSeek's R = 512, P = 64: 16 heads (4 queries a block, blocks
# straddling sequences) and 128 (two head tiles a query), on each
# tensor-core build (mla_arch: wgmma on sm_90, mma.sync on sm_80).
@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("heads", [16, 128])
def test_tc_mla(xp_backend, mla_arch, kernels_used, dtype, heads):
    rng = np.random.default_rng(heads)
    case = make_mla_case(
        rng,
        kv_lens=np.array([45, 3, 30], np.int32),
        q_lens=np.array([1, 3, 2]),
        page_size=16,
        num_heads=heads,
        latent_dim=512,
        pos_dim=64,
        dtype=dtype,
    )
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    for causal in (True, False):
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, heads, 512, splits, q)
            o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
            check(
                case,
                xp_backend.to_numpy(o),
                xp_backend.to_numpy(lse),
                causal,
                dtype,
                f"tc mla h={heads} causal={causal} splits={splits}",
            )
    assert set(kernels_used) == {mla_arch, "attention_split_merge"}


@pytest.mark.parametrize(
    "shape",
    [("bf16", 512, 64, 8, 1), ("f16", 512, 32, 16, 4), ("f32", 512, 64, 16, 4)],
    ids=lambda s: "{}-r{}-p{}-h{}-q{}".format(*s),
)
def test_tc_mla_falls_back(xp_backend, kernels_used, shape):
    """MLA shapes off the tensor-core path (8 heads of decode, another
    rotary dim, f32) run on the CUDA-core kernel."""
    dtype, r, p, h, ql = shape
    rng = np.random.default_rng(r + p + h)
    case = make_mla_case(
        rng,
        kv_lens=np.array([20, 9], np.int32),
        q_lens=np.array([ql, 1]),
        page_size=16,
        num_heads=h,
        latent_dim=r,
        pos_dim=p,
        dtype=dtype,
    )
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    o, lse = plan.mla(q, qp, lat, kp, case.scale, True, return_lse=True)
    check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), True, dtype, f"mla fallback {shape}")
    assert kernels_used == ["paged_attention"]


@pytest.mark.parametrize(
    "shape",
    [
        ("bf16", 16, [1, 1, 40, 1, 33, 1, 1], [("paged_mla_tc", 0, 78)]),
        ("f16", 8, [1] * 6 + [24, 1], [("paged_attention", 0, 6), ("paged_mla_tc", 6, 24), ("paged_attention", 30, 1)]),
    ],
    ids=lambda s: "{}-h{}".format(*s[:2]),
)
def test_mla_mixed(xp_backend, mla_arch, launches, shape):
    """MLA steps mixing chunks and decodes: at 16 heads every decode query
    already brings 16 tensor-core rows, so the step stays one paged_mla_tc
    launch; at 8 heads the decodes run on the CUDA-core kernel around it."""
    dtype, heads, q_lens, expect = shape
    rng = np.random.default_rng(heads)
    q_lens = np.array(q_lens, np.int32)
    case = make_mla_case(
        rng,
        kv_lens=q_lens + rng.integers(1, 40, q_lens.size).astype(np.int32),
        q_lens=q_lens,
        page_size=16,
        num_heads=heads,
        latent_dim=512,
        pos_dim=64,
        dtype=dtype,
    )
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    qpb = variants.tc_queries_per_block(heads)
    expect = [(mla_arch if n == "paged_mla_tc" else n, b, c) for n, b, c in expect]
    # the MLA kernels' grid x: head tiles (one at 8 or 16 heads) x query blocks
    grids = [(n, b, c, -(-c // qpb) if n == mla_arch else c) for n, b, c in expect]
    for causal, splits in ((True, None), (False, 3)):
        launches.clear()
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, heads, 512, splits, q)
        o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
        check(
            case,
            xp_backend.to_numpy(o),
            xp_backend.to_numpy(lse),
            causal,
            dtype,
            f"mla mixed h={heads} causal={causal} splits={splits}",
        )
        merge = [("attention_split_merge", None, None, plan.queries)] if splits else []
        assert launches == grids + merge


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("heads", [16])
def test_tc_mla_masked_nonfinite_latent(xp_backend, mla_arch, kernels_used, dtype, heads):
    """Issue #12 item 7 on the MLA kernels: Inf / NaN in latent rows (the
    values, and the keys) of tokens later in a chunk never reach the queries
    that cannot see them, causal, with and without splits, also across the
    sequences sharing a block (16 heads: 4 queries a block, so rows of one
    block see different tokens; with 64 heads or more a block holds one
    query, whose rows all see the same tokens); the rows that see them match
    the float64 reference (its Inf / NaN where it has them; lse checked
    where the reference's is finite)."""
    rng = np.random.default_rng([heads, 12])
    kv_lens, q_lens = np.array([40, 29, 20], np.int32), np.array([21, 7, 12], np.int32)
    case = make_mla_case(
        rng, kv_lens=kv_lens, q_lens=q_lens, page_size=16, num_heads=heads, latent_dim=512, pos_dim=64, dtype=dtype
    )
    poisoned = [(0, 30, np.inf), (0, 37, np.nan), (2, 19, -np.inf), (1, 27, np.nan)]
    for s, t, val in poisoned:
        page = case.page_table[s, t // 16]
        case.latent[page, t % 16, 0, (37 * t) % 512] = val
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    seq = np.repeat(np.arange(3), q_lens)
    pos = np.concatenate([np.arange(k - n, k) for k, n in zip(kv_lens, q_lens)])
    for causal in (True, False):
        ref_out, ref_lse = case.reference(causal)
        sees = np.zeros(plan.queries, bool)
        for s, t, _ in poisoned:
            sees |= (seq == s) & ((pos >= t) if causal else True)
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, heads, 512, splits, q)
            o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
            o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
            what = f"h={heads} causal={causal} splits={splits}"
            assert np.isfinite(o[~sees].astype(np.float64)).all(), f"{what}: a masked Inf/NaN reached a row"
            assert_close(o[~sees], ref_out[~sees], dtype, f"{what} clean rows")
            assert_close(lse[~sees], ref_lse[~sees], dtype, f"{what} clean lse")
            assert not np.isfinite(ref_out[sees]).all()
            assert_close(o[sees], ref_out[sees], dtype, f"{what} rows that see a poisoned token")
            keep = np.isfinite(ref_lse[sees])
            assert_close(lse[sees][keep], ref_lse[sees][keep], dtype, f"{what} lse of rows that see one")
    assert set(kernels_used) == {mla_arch, "attention_split_merge"}


def test_tc_mla_lengths_read_from_device_words(xp_backend, mla_arch, kernels_used):
    """An MLA plan whose device words are advanced (lengths and positions 5
    further, same queries, grid unchanged) gives the reference for the new
    lengths, on each tensor-core build."""
    from cupaged.layout import metadata_offsets

    rng = np.random.default_rng(31)
    full = make_mla_case(
        rng,
        kv_lens=np.array([45, 30], np.int32),
        q_lens=np.array([3, 1]),
        page_size=16,
        num_heads=16,
        latent_dim=512,
        pos_dim=64,
        dtype="bf16",
    )
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (full.q, full.q_pos, full.latent, full.k_pos))
    shorter = full.kv_lens - 5
    plan = cupaged.HostPlan.build(full.page_table, shorter, full.q_lens, 16, full.num_pages).upload(q)
    o1 = xp_backend.to_numpy(plan.mla(q, qp, lat, kp, full.scale, True))
    ref1, _ = reference.paged_mla(
        full.q, full.q_pos, full.latent, full.k_pos, full.page_table, shorter, full.q_lens, full.scale, True
    )
    assert_close(o1, ref1, "bf16", "before")
    off = metadata_offsets(plan.queries, plan.sequences)
    plan.words[off["kv_len"] : off["kv_len"] + 2] = xp_backend.asarray(full.kv_lens.astype(np.uint32))
    pos = np.asarray(xp_backend.to_numpy(plan.words[off["q_pos"] : off["kv_len"]])) + 5
    plan.words[off["q_pos"] : off["kv_len"]] = xp_backend.asarray(pos.astype(np.uint32))
    o2 = xp_backend.to_numpy(plan.mla(q, qp, lat, kp, full.scale, True))
    assert_close(o2, full.reference(True)[0], "bf16", "after")
    assert set(kernels_used) == {mla_arch}


# ----------------------------------------------------------------- no rotary part, FlashInfer's spelling


@pytest.mark.parametrize(
    "dtype, r, heads, kernel",
    [
        ("f32", 64, 4, "paged_attention"),
        ("bf16", 512, 16, "mla_arch"),  # the tensor-core builds (ROPE_DIM 0)
        ("f16", 96, 3, "paged_attention"),
    ],
)
def test_zero_width_rotary_part_is_no_rotary_part(xp_backend, mla_arch, kernels_used, dtype, r, heads, kernel):
    """Issue #19 item 12: MLA without a rotary part spelled FlashInfer's way,
    zero-width q_pos [T, H, 0] and k_pos [pages, page_size, 1, 0] (or any
    zero-width last dim: a 576-wide cache's empty column range, a 3-D
    [pages, page_size, 0]), is P = 0 exactly as None is: the same kernel,
    bit-identical output and lse, the reference of q.latent."""
    rng = np.random.default_rng([r, heads])
    case = make_mla_case(
        rng,
        kv_lens=np.array([45, 3, 30], np.int32),
        q_lens=np.array([1, 3, 20], np.int32),
        page_size=16,
        num_heads=heads,
        latent_dim=r,
        pos_dim=8,
        dtype=dtype,
    )
    q, latent = (_to_device(xp_backend, a) for a in (case.q, case.latent))
    xp = xp_backend.xp
    joint = xp.concatenate([latent, latent[..., :8]], axis=-1)  # a [pages, page_size, 1, R + 8] cache
    t = int(case.q.shape[0])
    spellings = [
        (xp.zeros((t, heads, 0), q.dtype), xp.zeros(latent.shape[:3] + (0,), latent.dtype)),
        (q[..., :0], joint[..., r:r]),  # empty column ranges of views
        (xp.zeros((t, heads, 0), q.dtype), xp.zeros(latent.shape[:2] + (0,), latent.dtype)),
        (None, xp.zeros(latent.shape[:3] + (0,), latent.dtype)),  # mixed: both mean P = 0
        (xp.zeros((t, heads, 0), q.dtype), None),
    ]
    ref, ref_lse = reference.paged_attention(
        case.q, case.latent, case.latent, case.page_table, case.kv_lens, case.q_lens, case.scale, True
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    for splits in (None, 3):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, heads, r, splits, q)
        base_o, base_lse = (
            xp_backend.to_numpy(a) for a in plan.mla(q, None, latent, None, case.scale, workspace=ws, return_lse=True)
        )
        assert_close(base_o, ref, dtype, "None")
        assert_close(base_lse, ref_lse, dtype, "None lse")
        n_kernels = len(kernels_used)
        for q_pos, k_pos in spellings:
            o, lse = (
                xp_backend.to_numpy(a)
                for a in plan.mla(q, q_pos, latent, k_pos, case.scale, workspace=ws, return_lse=True)
            )
            np.testing.assert_array_equal(o.view(np.uint8), base_o.view(np.uint8))
            np.testing.assert_array_equal(lse, base_lse)
        assert set(kernels_used[n_kernels:]) <= set(kernels_used[:n_kernels])
    want = mla_arch if kernel == "mla_arch" else kernel
    assert want in kernels_used


def test_zero_width_with_a_real_rotary_part_is_refused(kernels_used):
    """One of q_pos / k_pos with P >= 1 and the other zero-width (or None):
    a clear error naming both shapes, before any launch."""
    rng = np.random.default_rng(8)
    case = make_mla_case(
        rng,
        kv_lens=np.array([20, 9], np.int32),
        q_lens=np.array([1, 2], np.int32),
        page_size=16,
        num_heads=4,
        latent_dim=64,
        pos_dim=16,
        dtype="f32",
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    out = np.full((plan.queries, 4, 64), 7, np.float32)
    zq, zk = case.q_pos[..., :0], case.k_pos[..., :0]
    for q_pos, k_pos, got in (
        (zq, case.k_pos, r"got q_rot shape \[3, 4, 0\] and k_rot shape \[\d+, 16, 1, 16\]"),
        (case.q_pos, zk, r"got q_rot shape \[3, 4, 16\] and k_rot shape \[\d+, 16, 1, 0\]"),
        (None, case.k_pos, r"got q_rot None and k_rot shape \[\d+, 16, 1, 16\]"),
        (case.q_pos, None, r"got q_rot shape \[3, 4, 16\] and k_rot None"),
        (np.zeros((3, 0), np.float32), case.k_pos, r"got q_rot shape \[3, 0\] and k_rot shape"),
    ):
        with pytest.raises(
            cupaged.PagedAttentionError,
            match=r"q_rot, k_rot: expected both or neither \(neither, "
            r"None or zero-width: MLA without a rotary part, "
            r"P = 0\), " + got,
        ):
            plan.mla(case.q, q_pos, case.latent, k_pos, case.scale, out=out)
    with pytest.raises(cupaged.PagedAttentionError, match="k_rot: expected a NumPy or CuPy array, got builtins.list"):
        plan.mla(case.q, case.q_pos, case.latent, [0.0], case.scale, out=out)
    assert kernels_used == [] and (out == 7).all()


def test_seesaw_mla_masks_only_edge_tiles(xp_backend, kernels_used):
    """paged_mla_seesaw's owner warps take the unmasked softmax on a tile whose 32 tokens all their rows see,
    and mask only the others (FlashAttention-3's split): decode at 256, 250, 96 and 64 tokens, 64 heads (one
    query a block; a tile's softmax runs in its owner's 4 warps): on the CPU the edge-tile marker counts the
    250-token sequence's last tile and the empty tile that pads the 96-token sequence's three to an even count,
    4 marks each, causal or not; the outputs match the reference."""
    if xp_backend.name != "cpu":
        pytest.skip("the edge-tile marker counts on the CPU backend")
    from cupaged._runtime import archs, get_kernel
    from cupaged.ops.attention import inputs
    from cupaged.tools import counters

    rng = np.random.default_rng(5)
    case = make_mla_case(
        rng,
        kv_lens=np.array([256, 250, 96, 64], np.int32),
        q_lens=np.array([1, 1, 1, 1]),
        page_size=16,
        num_heads=64,
        latent_dim=512,
        pos_dim=64,
        dtype="bf16",
    )
    with archs.cpu_arch_override("sm_90"):
        plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
        for causal in (True, False):
            (la,) = inputs.mla_call(plan, case.q, case.q_pos, case.latent, case.k_pos, case.scale, causal).launches
            assert la.kernel == "paged_mla_seesaw"
            module = get_kernel(case.q, la.source, la.kernel, la.defines).module
            counters.reset(module)
            o, lse = plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, causal, return_lse=True)
            check(case, o, lse, causal, "bf16", f"seesaw mla causal={causal}")
            assert counters.read_all(module)["edge_tile"] == 8, causal
    assert set(kernels_used) == {"paged_mla_seesaw"}
