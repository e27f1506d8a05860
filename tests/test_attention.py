"""Paged attention (kernels_cu/attention.cu through DevicePlan.attention)
against the float64 reference, on the CPU backend and, unchanged, on a GPU.

Every case comes from ``cupaged.testing.make_paged_case``: random page
permutations, lengths that are not multiples of the page size, NaN in every
unused cache slot and a huge sentinel in every unused page-table entry, so a
kernel that reads anything it should not produces NaN or crashes.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import attention, reference
from cupaged.plan import metadata_offsets
from cupaged.testing import as_dtype, assert_close, make_mla_case, make_paged_case

DTYPES = ["f32", "f16", "bf16"]


def _to_device(backend, x: np.ndarray):
    if backend.name == "gpu" and as_dtype(x.dtype).name == "bfloat16":
        try:
            return backend.asarray(x)
        except Exception as e:  # CuPy without a bfloat16 dtype
            pytest.skip(f"CuPy cannot hold bfloat16 arrays here: {e}")
    return backend.asarray(x)


def run(backend, case, causal=True, *, splits=None, out=False, return_lse=True, plan=None):
    """Run ``case`` through the public API; returns (out, lse) as NumPy arrays
    (lse None without return_lse) and the device plan."""
    q, k, v = (_to_device(backend, a) for a in (case.q, case.k_cache, case.v_cache))
    if plan is None:
        plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size,
                                      case.num_pages).upload(q)
    ws = None
    if splits is not None:
        ws = cupaged.SplitWorkspace(plan.queries, q.shape[1], v.shape[3], splits, q)
    kwargs = dict(workspace=ws, return_lse=return_lse)
    if out:
        buf = backend.xp.full((plan.queries, q.shape[1], v.shape[3]), 7, dtype=q.dtype)
        kwargs["out"] = buf
    res = plan.attention(q, k, v, case.scale, causal, **kwargs)
    o, lse = res if return_lse else (res, None)
    if out:
        assert o is kwargs["out"]
    o = backend.to_numpy(o)
    return o, (None if lse is None else backend.to_numpy(lse)), plan


def check(case, o, lse, causal, dtype, what=""):
    ref_out, ref_lse = case.reference(causal)
    assert np.isfinite(o.astype(np.float64)).all(), f"{what}: non-finite output"
    assert_close(o, ref_out, dtype, f"{what} out")
    if lse is not None:
        assert lse.dtype == np.float32
        assert_close(lse, ref_lse, dtype, f"{what} lse")


# ----------------------------------------------------------------- decode

# (page_size, head_dim, head_dim_v, q_heads, kv_heads): fast dims 64/128/256,
# runtime dims 80/96/5 and Dv != D, GQA ratios 1, 2, 3, 4, 8 and 16 (two tiles).
DECODE_SHAPES = [
    (16, 64, None, 4, 4),
    (1, 128, None, 8, 2),
    (64, 96, None, 8, 1),
    (16, 80, None, 6, 2),
    (16, 5, 7, 4, 1),
    (16, 256, None, 2, 1),
    (3, 128, 64, 16, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "ps{}-d{}-dv{}-h{}x{}".format(*s))
def test_decode(xp_backend, dtype, shape):
    page_size, d, dv, hq, hkv = shape
    rng = np.random.default_rng([x or 0 for x in shape])
    case = make_paged_case(rng, sequences=3, max_kv_len=70, page_size=page_size, num_q_heads=hq,
                           num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype)
    o, lse, _ = run(xp_backend, case, causal=True)
    check(case, o, lse, True, dtype, f"decode {shape}")


# (dtype, head_dim, head_dim_v, q_heads, kv_heads): two chunks per lane (f32 256),
# the largest capacities (512, 1024, with Dv != D), one element per row (1).
@pytest.mark.parametrize("shape", [("f32", 256, None, 8, 1), ("f16", 512, None, 4, 1), ("bf16", 1000, 1024, 4, 2),
                                   ("f32", 1, 1, 2, 1), ("f16", 24, 200, 5, 5)],
                         ids=lambda s: "{}-d{}-dv{}-h{}x{}".format(*s))
def test_large_and_odd_dims(xp_backend, shape):
    dtype, d, dv, hq, hkv = shape
    rng = np.random.default_rng(d)
    case = make_paged_case(rng, kv_lens=np.array([19, 33], np.int32), q_lens=np.array([1, 2]), page_size=8,
                           num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype=dtype)
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
    case = make_paged_case(rng, kv_lens=kv_lens, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2,
                           head_dim=128, dtype=dtype)
    o, lse, _ = run(xp_backend, case, causal=causal)
    check(case, o, lse, causal, dtype, f"prefill causal={causal}")


@pytest.mark.parametrize("shape", [(1, 64, 4, 4), (16, 96, 8, 2), (64, 128, 8, 1)],
                         ids=lambda s: "ps{}-d{}-h{}x{}".format(*s))
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
        case = make_paged_case(rng, kv_lens=kv_lens, q_lens=q_lens, page_size=page_size, num_q_heads=hq,
                               num_kv_heads=hkv, head_dim=d, dtype="f16")
        o, lse, _ = run(xp_backend, case, causal=True)
        check(case, o, lse, True, "f16", f"chunk at {done.tolist()}")


# ----------------------------------------------------------------- splits

@pytest.mark.parametrize("dtype", DTYPES)
def test_every_split_count(xp_backend, dtype):
    rng = np.random.default_rng(3)
    case = make_paged_case(rng, kv_lens=np.array([150, 61, 3, 97], np.int32), q_lens=np.array([1, 4, 2, 1]),
                           page_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
    plan = None
    for splits in range(1, 12):
        for causal in (True, False):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"splits={splits} causal={causal}")


def test_max_splits_tiny(xp_backend):
    """MAX_SPLITS on a tiny case: almost every split is empty (lse -inf)."""
    rng = np.random.default_rng(4)
    case = make_paged_case(rng, kv_lens=np.array([5, 40], np.int32), page_size=4, num_q_heads=2, num_kv_heads=1,
                           head_dim=64, dtype="f32")
    for causal in (True, False):
        o, lse, _ = run(xp_backend, case, causal, splits=attention.MAX_SPLITS)
        check(case, o, lse, causal, "f32", f"MAX_SPLITS causal={causal}")


@pytest.mark.parametrize("dtype, q_lens, heads, kernel", [
    ("f32", None, (2, 2), "paged_attention"),
    ("f16", [20, 16], (4, 2), "paged_prefill_tc"),
], ids=["cuda-core", "tensor-core"])
def test_split_partials_follow_layout(xp_backend, kernels_used, dtype, q_lens, heads, kernel):
    """Each kernel's split partials are the layout's: split z of a query with
    L positions covers [z c, min(L, (z + 1) c)), c = ceil(L / splits) rounded
    up to SPLIT_TILE; compared with reference.split_attention_partials."""
    rng = np.random.default_rng(8)
    kv_lens = np.array([100, 33], np.int32)
    case = make_paged_case(rng, kv_lens=kv_lens, q_lens=None if q_lens is None else np.array(q_lens),
                           page_size=16, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=64, dtype=dtype)
    splits = 3
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size,
                                  case.num_pages).upload(q)
    ws = cupaged.SplitWorkspace(plan.queries, heads[0], 64, splits, q)
    plan.attention(q, k, v, case.scale, False, workspace=ws)
    tile = attention.SPLIT_TILE
    size = [-(-(-(-int(n) // splits)) // tile) * tile for n in kv_lens]
    ref_out, ref_lse = reference.split_attention_partials(case.q, case.k_cache, case.v_cache, case.page_table,
                                                          case.kv_lens, case.q_lens, case.scale, size, splits,
                                                          causal=False)
    assert_close(xp_backend.to_numpy(ws.partial_lse), ref_lse, dtype, "partial lse")
    assert_close(xp_backend.to_numpy(ws.partial_out), ref_out, dtype, "partial out")
    assert kernels_used[0] == kernel


# ----------------------------------------------------------------- outputs

@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("return_lse", [True, False])
def test_out_and_lse_arguments(xp_backend, splits, return_lse):
    rng = np.random.default_rng(6)
    case = make_paged_case(rng, sequences=2, max_kv_len=40, num_q_heads=4, num_kv_heads=4, head_dim=64,
                           dtype="f16")
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
    case = make_paged_case(rng, sequences=2, max_kv_len=40, num_q_heads=4, num_kv_heads=2, head_dim=64,
                           dtype="f16")

    def shifted(a):
        buf = np.empty(a.size + 16, a.dtype)
        start = ((-(buf.ctypes.data % 16)) % 16) // a.itemsize + 1
        x = buf[start:start + a.size].reshape(a.shape)
        x[...] = a
        return x

    def shifted_device(a):
        if xp_backend.name == "cpu":
            return shifted(a)
        buf = xp_backend.xp.empty(a.size + 8, a.dtype)    # CuPy buffers start 256-byte aligned
        x = buf[1:1 + a.size].reshape(a.shape)
        x[...] = xp_backend.asarray(a)
        return x

    q, k, v = (shifted_device(a) for a in (case.q, case.k_cache, case.v_cache))
    assert int(q.ctypes.data if xp_backend.name == "cpu" else q.data.ptr) % 16 != 0
    assert attention.select_variant("f16", 64, 64, False, 2)["VEC_LOADS"] == 0
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True)
    check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), True, "f16", "misaligned")


# ----------------------------------------------------------------- metadata

def test_lengths_read_from_device_words(xp_backend):
    """A plan whose device words are rewritten (a decode loop advancing
    lengths on the device) gives the reference for the new lengths: nothing
    about lengths is baked into the launch."""
    rng = np.random.default_rng(10)
    full = make_paged_case(rng, kv_lens=np.array([40, 25], np.int32), page_size=8, num_q_heads=4,
                           num_kv_heads=2, head_dim=64, dtype="f32")
    q, k, v = (xp_backend.asarray(a) for a in (full.q, full.k_cache, full.v_cache))
    shorter = np.array([33, 18], np.int32)
    # Plan built for the shorter lengths (tables hold every page of the full lengths).
    plan = cupaged.HostPlan.build(full.page_table, shorter, full.q_lens, 8, full.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    o1 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref1, _ = reference.paged_attention(full.q, full.k_cache, full.v_cache, full.page_table, shorter,
                                        full.q_lens, full.scale, True)
    assert_close(o1, ref1, "f32", "before")
    # Advance both sequences to their full length on the device.
    plan.words[off["kv_len"]:off["kv_len"] + 2] = xp_backend.asarray(np.array([40, 25], np.uint32))
    plan.words[off["q_pos"]:off["q_pos"] + 2] = xp_backend.asarray(np.array([39, 24], np.uint32))
    o2 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref2, _ = full.reference(True)
    assert_close(o2, ref2, "f32", "after")


def test_nothing_visible_and_bad_metadata(xp_backend):
    """Padded device metadata: a query whose sequence has length 0 gets out 0
    and lse -inf; a sequence index out of range likewise; absurd lengths,
    positions and page ids never make the kernel leave its arrays."""
    rng = np.random.default_rng(13)
    case = make_paged_case(rng, kv_lens=np.array([20, 30, 10], np.int32), page_size=4, num_q_heads=2,
                           num_kv_heads=1, head_dim=64, dtype="f32")
    q, k, v = (xp_backend.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"]] = 0                         # sequence 0: nothing visible
    words[off["q_seq"] + 1] = 0xFFFFFFFF             # query 1: sequence out of range
    for splits in (None, 4):
        ws = None if splits is None else cupaged.SplitWorkspace(3, 2, 64, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        assert (o[:2] == 0).all() and (lse[:2] == -np.inf).all()
        ref_out, ref_lse = case.reference(True)
        assert_close(o[2], ref_out[2], "f32")
        assert_close(lse[2], ref_lse[2], "f32")
    # Absurd metadata: huge lengths and positions, garbage page ids everywhere.
    words[off["kv_len"]:off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"]:off["kv_len"]] = 0xFFFFFFFF
    words[off["q_seq"]:off["q_pos"]] = xp_backend.asarray(np.array([0, 1, 2], np.uint32))
    table = rng.integers(0, 2 ** 32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"]:] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)   # must simply not crash


def test_nan_never_reaches_the_output(xp_backend):
    """Every unused slot is NaN (the tail of each last page, the extra pages),
    including slots inside pages a sequence owns, and page size 1 and 64."""
    for page_size in (1, 64):
        rng = np.random.default_rng(page_size)
        case = make_paged_case(rng, sequences=3, max_kv_len=70, page_size=page_size, num_q_heads=4,
                               num_kv_heads=1, head_dim=128, dtype="bf16", extra_pages=3)
        assert np.isnan(case.k_cache.astype(np.float32)).any()
        for causal in (True, False):
            o, lse, _ = run(xp_backend, case, causal)
            check(case, o, lse, causal, "bf16", f"page_size={page_size}")


def test_capture_and_replay(xp_backend):
    """A captured launch replays with new q contents (grid and arguments
    frozen, data read at replay)."""
    if xp_backend.name != "cpu":
        pytest.skip("GPU capture is covered by the graph tests")
    rng = np.random.default_rng(14)
    case = make_paged_case(rng, sequences=2, max_kv_len=30, num_q_heads=4, num_kv_heads=2, head_dim=64,
                           dtype="f32")
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
    ref, _ = reference.paged_attention(q, case.k_cache, case.v_cache, case.page_table, case.kv_lens,
                                       case.q_lens, case.scale, True)
    assert_close(out, ref, "f32", "replay")


# ----------------------------------------------------------------- dispatch

def test_variant_selection():
    sel = attention.select_variant
    assert sel("f16", 128, 128, True, 8) == {"CP_DTYPE": "f16", "HEAD_DIM": 128, "GROUP_TILE": 8}
    assert sel("bf16", 64, 64, True, 1)["GROUP_TILE"] == 1
    assert sel("f32", 256, 256, True, 3)["GROUP_TILE"] == 4
    # Group of 12 in two tiles of 6 -> tile 8; group of 16 in two tiles of 8.
    assert sel("f16", 128, 128, True, 12)["GROUP_TILE"] == 8
    assert sel("f16", 128, 128, True, 16)["GROUP_TILE"] == 8
    assert sel("f16", 96, 96, True, 4) == {"CP_DTYPE": "f16", "DIM_CAP": 128, "VEC_LOADS": 1, "GROUP_TILE": 4}
    assert sel("f16", 5, 7, True, 1) == {"CP_DTYPE": "f16", "DIM_CAP": 64, "VEC_LOADS": 0, "GROUP_TILE": 1}
    assert sel("f16", 128, 128, False, 1)["VEC_LOADS"] == 0
    assert sel("f32", 1024, 1000, True, 8)["GROUP_TILE"] == 2
    # Every selectable variant is registered for the NVRTC gate.
    registered = {tuple(sorted(v.items())) for v in attention.VARIANTS}
    for dt in DTYPES:
        for d in (1, 5, 63, 64, 80, 96, 128, 200, 256, 300, 512, 576, 1024):
            for dv in (d, 64, 1024):
                for g in (1, 2, 3, 4, 5, 8, 12, 16, 64):
                    for aligned in (True, False):
                        assert tuple(sorted(sel(dt, d, dv, aligned, g).items())) in registered


# ----------------------------------------------------------------- MLA (rotary part)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 16, 4, 16), (512, 64, 16, 1), (96, 200, 3, 64), (512, 64, 1, 16),
                                   (33, 7, 128, 4)],
                         ids=lambda s: "r{}-p{}-h{}-ps{}".format(*s))
def test_mla_rotary_part(xp_backend, dtype, shape):
    """score = scale * (q.latent + q_pos.k_pos), values are the latent rows,
    against reference.paged_mla; decode and a prefill chunk, both masks."""
    r, p, h, page_size = shape
    rng = np.random.default_rng(list(shape))
    case = make_mla_case(rng, kv_lens=np.array([45, 3, 30], np.int32), q_lens=np.array([1, 3, 7]),
                         page_size=page_size, num_heads=h, latent_dim=r, pos_dim=p, dtype=dtype)
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, page_size, case.num_pages).upload(q)
    for causal in (True, False):
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, h, r, splits, q)
            o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
            check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), causal, dtype,
                  f"mla causal={causal} splits={splits}")


def test_rotary_part_needs_one_latent_cache():
    """The rotary variants read V from the K rows: a separate V cache (or
    more than one KV head) is refused rather than silently ignored."""
    rng = np.random.default_rng(1)
    case = make_paged_case(rng, sequences=1, max_kv_len=8, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="f32")
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    out = np.empty((plan.queries, 2, 64), np.float32)
    k_rot = np.zeros(case.k_cache.shape[:3] + (8,), np.float32)
    q_rot = np.zeros((plan.queries, 2, 8), np.float32)
    with pytest.raises(NotImplementedError):
        attention.launch_attention(plan.stream, plan, case.q, case.k_cache, case.v_cache, out, 1.0, True,
                                   q_rot=q_rot, k_rot=k_rot)
    with pytest.raises(NotImplementedError):
        attention.launch_attention(plan.stream, plan, case.q, case.k_cache, case.k_cache, out, 1.0, True,
                                   q_rot=np.zeros((plan.queries, 2, 300), np.float32),
                                   k_rot=np.zeros(case.k_cache.shape[:3] + (300,), np.float32))


# ----------------------------------------------------------------- tensor cores
#
# paged_prefill_tc and paged_mla_tc (f16 / bf16, mma.sync; on the CPU backend
# through the fragment-exact emulation of kernels_cu/ptx.cuh). P is rounded
# to the storage type before O += P V, as in FlashAttention; the dtype
# tolerances cover it.

TC_DTYPES = ["f16", "bf16"]


@pytest.fixture
def kernels_used(monkeypatch):
    """Names of the kernels launch_attention fetches while the test runs."""
    names = []
    real = attention._backend.get_kernel

    def spy(like, source, kernel, defines=None):
        names.append(kernel)
        return real(like, source, kernel, defines)

    monkeypatch.setattr(attention._backend, "get_kernel", spy)
    return names


# (page_size, head_dim, q_heads, kv_heads): GQA 1 (64 queries a block, so
# blocks straddle sequences), 4 and 8, page sizes 1 / 16 / 64, D 64 / 128 / 256.
PREFILL_SHAPES = [
    (16, 64, 4, 4),
    (1, 128, 8, 2),
    (64, 128, 8, 1),
    (16, 256, 8, 2),
    (64, 64, 16, 2),
]


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "ps{}-d{}-h{}x{}".format(*s))
def test_tc_prefill_chunks(xp_backend, kernels_used, dtype, shape):
    """Prefill chunks of 16..80 queries on top of cached tokens (one sequence
    sitting the step out), causal and not, with and without splits."""
    page_size, d, hq, hkv = shape
    rng = np.random.default_rng(list(shape))
    kv_lens = np.array([95, 41, 30, 130], np.int32)
    q_lens = np.array([80, 16, 0, 33], np.int32)
    case = make_paged_case(rng, kv_lens=kv_lens, q_lens=q_lens, page_size=page_size, num_q_heads=hq,
                           num_kv_heads=hkv, head_dim=d, dtype=dtype)
    plan = None
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"tc prefill {shape} causal={causal} splits={splits}")
    assert set(kernels_used) == {"paged_prefill_tc", "attention_split_merge"}


@pytest.mark.parametrize("shape", [("f16", 96, 1, [1, 2, 1]), ("bf16", 6, 2, [30, 17, 5])],
                         ids=lambda s: "{}-h{}x{}".format(*s[:3]))
def test_tc_odd_groups(xp_backend, kernels_used, shape):
    """A group of 96 heads (two head tiles of 64 and 32, one query a block:
    MQA decode runs on tensor cores) and a group of 3 (21 queries x 3 heads,
    one row of 64 unused)."""
    dtype, hq, hkv, q_lens = shape
    rng = np.random.default_rng(hq)
    case = make_paged_case(rng, kv_lens=np.array([50, 23, 70], np.int32), q_lens=np.array(q_lens), page_size=16,
                           num_q_heads=hq, num_kv_heads=hkv, head_dim=64, dtype=dtype)
    plan = None
    for causal in (True, False):
        for splits in (None, 2):
            o, lse, plan = run(xp_backend, case, causal, splits=splits, plan=plan)
            check(case, o, lse, causal, dtype, f"{shape} causal={causal} splits={splits}")
    assert "paged_prefill_tc" in kernels_used and "paged_attention" not in kernels_used


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_tc_prefill_outputs_and_lse_arguments(xp_backend, kernels_used, dtype):
    """out= and return_lse=False on the tensor-core path, unsplit and split."""
    rng = np.random.default_rng(21)
    case = make_paged_case(rng, kv_lens=np.array([40, 57], np.int32), q_lens=np.array([17, 31]), page_size=16,
                           num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=dtype)
    for splits in (None, 2):
        o, lse, _ = run(xp_backend, case, True, splits=splits, out=True, return_lse=False)
        check(case, o, lse, True, dtype, f"out= splits={splits}")
    assert "paged_prefill_tc" in kernels_used


def test_tc_lengths_read_from_device_words(xp_backend, kernels_used):
    """A prefill plan whose device words are advanced (lengths and positions
    5 further, same queries) gives the reference for the new lengths."""
    rng = np.random.default_rng(23)
    full = make_paged_case(rng, kv_lens=np.array([45, 30], np.int32), q_lens=np.array([20, 16]), page_size=8,
                           num_q_heads=8, num_kv_heads=2, head_dim=128, dtype="bf16")
    q, k, v = (_to_device(xp_backend, a) for a in (full.q, full.k_cache, full.v_cache))
    shorter = np.array([40, 25], np.int32)
    plan = cupaged.HostPlan.build(full.page_table, shorter, full.q_lens, 8, full.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    o1 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref1, _ = reference.paged_attention(full.q, full.k_cache, full.v_cache, full.page_table, shorter,
                                        full.q_lens, full.scale, True)
    assert_close(o1, ref1, "bf16", "before")
    plan.words[off["kv_len"]:off["kv_len"] + 2] = xp_backend.asarray(np.array([45, 30], np.uint32))
    pos = np.asarray(xp_backend.to_numpy(plan.words[off["q_pos"]:off["kv_len"]])) + 5
    plan.words[off["q_pos"]:off["kv_len"]] = xp_backend.asarray(pos.astype(np.uint32))
    o2 = xp_backend.to_numpy(plan.attention(q, k, v, full.scale, True))
    ref2, _ = full.reference(True)
    assert_close(o2, ref2, "bf16", "after")
    assert set(kernels_used) == {"paged_prefill_tc"}


def test_tc_nothing_visible_and_bad_metadata(xp_backend, kernels_used):
    """Tensor-core prefill on padded and absurd device metadata: a sequence of
    length 0 and a query with a sequence index out of range get out 0 and
    lse -inf; garbage lengths, positions, page ids and sequence orders never
    make the kernel leave its arrays."""
    rng = np.random.default_rng(24)
    case = make_paged_case(rng, kv_lens=np.array([20, 30, 25], np.int32), q_lens=np.array([16, 16, 20]),
                           page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="f16")
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"]] = 0                                     # sequence 0: nothing visible
    words[off["q_seq"] + 20] = 0xFFFFFFFF                        # query 20 (of sequence 1): bad index
    ref_out, ref_lse = case.reference(True)
    for splits in (None, 4):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 2, 64, splits, q)
        o, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws)
        o, lse = xp_backend.to_numpy(o), xp_backend.to_numpy(lse)
        dead = np.zeros(plan.queries, bool)
        dead[:16] = True
        dead[20] = True
        assert (o[dead] == 0).all() and (lse[dead] == -np.inf).all()
        assert_close(o[~dead], ref_out[~dead], "f16")
        assert_close(lse[~dead], ref_lse[~dead], "f16")
    words[off["kv_len"]:off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"]:off["kv_len"]] = 0xFFFFFFFF
    seqs = rng.integers(0, 3, size=plan.queries).astype(np.uint32)      # out of packing order
    words[off["q_seq"]:off["q_pos"]] = xp_backend.asarray(seqs)
    table = rng.integers(0, 2 ** 32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"]:] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)   # must simply not crash
    assert set(kernels_used) == {"paged_prefill_tc", "attention_split_merge"}


def check_capture_replay(rng, case, dtype, what):
    """Capture attention with a 2-split workspace on the CPU stream, change
    q's contents, replay: the output must match the reference for the new q."""
    q = case.q.copy()
    heads, dv = q.shape[1], case.v_cache.shape[3]
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size,
                                  case.num_pages).upload(q)
    out = np.zeros((plan.queries, heads, dv), q.dtype)
    ws = cupaged.SplitWorkspace(plan.queries, heads, dv, 2, q)
    stream = cupaged.stream_for(q)
    stream.begin_capture()
    plan.attention(q, case.k_cache, case.v_cache, case.scale, True, out=out, workspace=ws)
    graph = stream.end_capture()
    q[...] = rng.standard_normal(q.shape).astype(q.dtype)
    graph.launch()
    ref, _ = reference.paged_attention(q, case.k_cache, case.v_cache, case.page_table, case.kv_lens,
                                       case.q_lens, case.scale, True)
    assert_close(out, ref, dtype, what)


def test_tc_capture_and_replay(xp_backend, kernels_used):
    """A captured tensor-core launch (with its shared memory and the merge)
    replays with new q contents."""
    if xp_backend.name != "cpu":
        pytest.skip("GPU capture is covered by the graph tests")
    rng = np.random.default_rng(26)
    case = make_paged_case(rng, kv_lens=np.array([33, 50], np.int32), q_lens=np.array([16, 20]), page_size=16,
                           num_q_heads=4, num_kv_heads=1, head_dim=64, dtype="bf16")
    check_capture_replay(rng, case, "bf16", "replay")
    assert "paged_prefill_tc" in kernels_used


def test_tc_selection():
    """Which variant runs when the step's packing suits the tensor-core
    kernels: f16 / bf16 at a fast dim, or MLA at 512 / 64."""
    tc = attention.select_tensor_core
    assert tc("bf16", 128, 128, True, True) == {"CP_DTYPE": "bf16", "TC_PREFILL": 1, "HEAD_DIM": 128}
    assert tc("f16", 64, 64, True, True)["HEAD_DIM"] == 64
    assert tc("f16", 256, 256, True, True)["HEAD_DIM"] == 256
    assert tc("f16", 128, 128, True, False) is None      # packing unsuited (tc_schedule_ok)
    assert tc("f32", 128, 128, True, True) is None       # no f32 tensor-core path
    assert tc("f16", 96, 96, True, True) is None         # not a fast dim
    assert tc("f16", 128, 64, True, True) is None        # Dv != D
    assert tc("f16", 128, 128, False, True) is None      # misaligned
    assert tc("bf16", 512, 512, True, True, rot_dim=64) == {"CP_DTYPE": "bf16", "TC_MLA": 1,
                                                            "LATENT_DIM": 512, "ROPE_DIM": 64}
    assert tc("bf16", 512, 512, True, True, rot_dim=32) is None       # other rotary dim
    assert tc("bf16", 576, 576, True, True, rot_dim=64) is None
    registered = {tuple(sorted(v.items())) for v in attention.VARIANTS}
    for dt in TC_DTYPES:
        for d in attention.TC_PREFILL_DIMS:
            assert tuple(sorted(tc(dt, d, d, True, True).items())) in registered
        for r, p in attention.TC_MLA_DIMS:
            assert tuple(sorted(tc(dt, r, r, True, True, rot_dim=p).items())) in registered


def _host(q_lens):
    q_lens = np.array(q_lens)
    return cupaged.HostPlan.build(np.zeros((len(q_lens), 1), np.int32), np.maximum(q_lens, 1), q_lens, 256, 1)


def test_block_passes():
    """Sequences meeting in a block of consecutive packed queries, from the
    host plan (sequences without queries do not count): (most, total)."""
    passes = attention.block_passes
    assert attention.tc_queries_per_block(1) == 64 and attention.tc_queries_per_block(3) == 21
    assert attention.tc_queries_per_block(8) == 8 and attention.tc_queries_per_block(128) == 1
    assert passes(_host([1] * 20), 8) == (8, 20)             # decode, G = 8: 8, 8, 4 sequences
    assert passes(_host([1] * 20), 4) == (4, 20)
    assert passes(_host([100, 0, 1]), 8) == (2, 14)         # a prefill chunk and one decode
    assert passes(_host([30, 0, 0, 30]), 64) == (2, 2)
    assert passes(_host([16] * 4 + [1] * 30), 8) == (8, 38)
    assert passes(_host([8, 16, 16, 16, 8]), 64) == (5, 5)
    assert passes(_host([0, 0]), 8) == (0, 0)


def test_tc_schedule_rule():
    """Tensor cores when every block's passes are few and fill a warp on
    average: prefill chunks, MLA-like groups of 16+, a chunk with a few
    decodes; not decode steps of small groups nor many decodes mixed in."""
    ok = attention.tc_schedule_ok
    assert ok(_host([80, 16, 0, 33]), 1) and ok(_host([80, 16, 33]), 8)
    assert ok(_host([8, 16, 16, 16, 8]), 1)                # 5 passes, 64 rows: the fewest rows allowed
    assert ok(_host([1] * 20), 16) and ok(_host([1] * 20), 128)   # MLA decode, 16 and 128 heads
    assert ok(_host([100, 0, 1]), 8)
    assert not ok(_host([1] * 20), 8)                       # decode, G = 8: 8 passes a block
    assert not ok(_host([1, 1, 1]), 2)                      # 3 passes of 2 rows
    assert not ok(_host([16] * 4 + [1] * 30), 8)
    assert not ok(_host([0, 0]), 8)


@pytest.mark.parametrize("what", ["decode", "f32", "dim96", "small-chunk"])
def test_tc_falls_back(xp_backend, kernels_used, what):
    """Shapes off the tensor-core path still run, on the CUDA-core kernel:
    decode steps, f32, other dims, and a step mixing a chunk too small for
    a tensor-core segment (6 queries x 2 heads) with six decode queries of a
    small group (seven sequences in one block)."""
    rng = np.random.default_rng(25)
    dtype = "f32" if what == "f32" else "f16"
    d = 96 if what == "dim96" else 64
    q_lens = {"decode": [1, 1, 1], "small-chunk": [6] + [1] * 6}.get(what, [20, 17, 16])
    kv_lens = np.array([30, 25, 40, 9, 17, 3, 21][:len(q_lens)], np.int32)
    case = make_paged_case(rng, kv_lens=kv_lens, q_lens=np.array(q_lens), page_size=16,
                           num_q_heads=4, num_kv_heads=2, head_dim=d, dtype=dtype)
    o, lse, _ = run(xp_backend, case, True)
    check(case, o, lse, True, dtype, what)
    assert kernels_used == ["paged_attention"]


# MLA at DeepSeek's R = 512, P = 64: 16 heads (4 queries a block, blocks
# straddling sequences) and 128 (two head tiles a query).
@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("heads", [16, 128])
def test_tc_mla(xp_backend, kernels_used, dtype, heads):
    rng = np.random.default_rng(heads)
    case = make_mla_case(rng, kv_lens=np.array([45, 3, 30], np.int32), q_lens=np.array([1, 3, 2]),
                         page_size=16, num_heads=heads, latent_dim=512, pos_dim=64, dtype=dtype)
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    for causal in (True, False):
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, heads, 512, splits, q)
            o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
            check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), causal, dtype,
                  f"tc mla h={heads} causal={causal} splits={splits}")
    assert set(kernels_used) == {"paged_mla_tc", "attention_split_merge"}


@pytest.mark.parametrize("shape", [("bf16", 512, 64, 8, 1), ("f16", 512, 32, 16, 4), ("f32", 512, 64, 16, 4)],
                         ids=lambda s: "{}-r{}-p{}-h{}-q{}".format(*s))
def test_tc_mla_falls_back(xp_backend, kernels_used, shape):
    """MLA shapes off the tensor-core path (8 heads of decode, another
    rotary dim, f32) run on the CUDA-core kernel."""
    dtype, r, p, h, ql = shape
    rng = np.random.default_rng(r + p + h)
    case = make_mla_case(rng, kv_lens=np.array([20, 9], np.int32), q_lens=np.array([ql, 1]), page_size=16,
                         num_heads=h, latent_dim=r, pos_dim=p, dtype=dtype)
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    o, lse = plan.mla(q, qp, lat, kp, case.scale, True, return_lse=True)
    check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), True, dtype, f"mla fallback {shape}")
    assert kernels_used == ["paged_attention"]


# ----------------------------------------------------------------- mixed steps (segments)
#
# A chunked-prefill step mixing prefill chunks (tensor cores) with decode
# queries of a small group (CUDA-core kernel) runs as segments: one launch
# per contiguous run of sequences, each on its kernel (attention.tc_segments).

#: Six decodes, a chunk of 40, six decodes, a chunk of 33: C T C T at G = 4.
Q_MIXED = [1] * 6 + [40] + [1] * 6 + [33]
MIXED_TC = [("paged_attention", 0, 6), ("paged_prefill_tc", 6, 40), ("paged_attention", 46, 6),
            ("paged_prefill_tc", 52, 33)]


@pytest.fixture
def launches(monkeypatch):
    """(kernel, q_begin, q_count, blocks along x) of every launch
    launch_attention issues (q_begin and q_count None for the merge), in
    launch order: its stream is wrapped for the test."""
    log = []
    real = attention.launch_attention

    class Spy:
        def __init__(self, stream):
            self.stream = stream

        def launch(self, kernel, grid, block, args, shared_mem=0):
            attn = kernel.name != "attention_split_merge"
            log.append((kernel.name, int(args[11]) if attn else None, int(args[12]) if attn else None,
                        grid[0] if isinstance(grid, tuple) else grid))
            return self.stream.launch(kernel, grid, block, args, shared_mem=shared_mem)

    monkeypatch.setattr(attention, "launch_attention", lambda stream, *a, **k: real(Spy(stream), *a, **k))
    return log


def _segs(q_lens, group):
    return attention.tc_segments(_host(q_lens), group)


def test_tc_segments_rule():
    """The segmentation of a step (host data): whole steps stay one launch,
    mixed ones split into runs of sequences, short tensor-core runs and the
    ones past MAX_SEGMENTS join the CUDA-core segments."""
    T, C = True, False
    assert _segs([1] * 20, 8) == ((C, 0, 20),)                          # decode: CUDA cores
    assert _segs([80, 16, 0, 33], 4) == ((T, 0, 129),)                  # prefill: tensor cores
    assert _segs([0, 0], 8) == ()
    # Few decodes around chunks pack well as a whole at G = 4 (one launch);
    # at G = 1 the decodes at the ends go to CUDA cores, the one between the
    # chunks rides along in their blocks.
    assert _segs([1, 1, 40, 1, 33, 1, 1], 4) == ((T, 0, 78),)
    assert _segs([1, 1, 40, 1, 33, 1, 1], 1) == ((C, 0, 2), (T, 2, 74), (C, 76, 2))
    assert _segs(Q_MIXED, 4) == tuple((n == "paged_prefill_tc", b, c) for n, b, c in MIXED_TC)
    assert _segs([40, 0, 24] + [1] * 8, 4) == ((T, 0, 64), (C, 64, 8))
    assert _segs([1, 1, 8, 1, 1], 4) == ((C, 0, 2), (T, 2, 8), (C, 10, 2))   # 32 rows: worth a launch
    assert _segs([1, 1, 4, 1], 4) == ((C, 0, 7),)                       # 16 rows: fewer than TC_SEGMENT_ROWS
    assert attention.TC_SEGMENT_ROWS == 32 and attention.MAX_SEGMENTS == 4
    # C T C T C T C (chunks of 40, 33, 20): the most queries in four launches are the
    # chunks of 40 and 20 (the last run ends the step), the 33 joins the decodes around it.
    assert _segs(Q_MIXED + [1] * 6 + [20], 4) == ((C, 0, 6), (T, 6, 40), (C, 46, 45), (T, 91, 20))
    assert _segs(Q_MIXED + [1] * 6 + [20] + [1], 4) == ((C, 0, 6), (T, 6, 40), (C, 46, 66))
    # Twenty chunks of 40 between runs of six decodes (no bridging past 16 runs): the first two.
    assert _segs([40] + [1] * 6 + ([40] + [1] * 6) * 19, 4) == ((T, 0, 40), (C, 40, 6), (T, 46, 40),
                                                              (C, 86, 20 * 46 - 86))
    # Alternating runs all too small for a segment: the current single-kernel choice.
    assert _segs([1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 6], 4) == ((C, 0, 33),)
    # MLA: decode queries of 16+ heads are tensor-core rows already; nothing splits.
    assert _segs([1] * 20, 16) == ((T, 0, 20),)
    assert _segs([1, 1, 40, 1, 33, 1, 1], 16) == ((T, 0, 78),)
    assert _segs([1] * 6 + [24, 1], 8) == ((C, 0, 6), (T, 6, 24), (C, 30, 1))
    for q_lens, g in ((Q_MIXED + [1] * 6 + [20], 4), ([1, 1, 40, 1, 33, 1, 1], 1), (Q_MIXED, 2)):
        segs = _segs(q_lens, g)                                         # contiguous, covering, <= 4
        assert [b for _, b, _ in segs] == [0] + list(np.cumsum([c for _, _, c in segs]))[:-1]
        assert sum(c for _, _, c in segs) == sum(q_lens) and len(segs) <= attention.MAX_SEGMENTS


def test_tc_segments_invariants():
    """Random steps: segments are contiguous, cover every query, number at
    most MAX_SEGMENTS, and every tensor-core one keeps the TC_MAX_PASSES
    rule on its own range (passes counted here block by block) with at
    least TC_SEGMENT_ROWS rows."""
    rng = np.random.default_rng(34)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        q_lens = np.where(rng.random(n) < 0.25, rng.integers(2, 90, n), rng.integers(0, 2, n))
        group = int(rng.choice([1, 2, 3, 4, 5, 8, 16, 64]))
        segs = _segs(q_lens, group)
        queries = int(q_lens.sum())
        if queries == 0:
            assert segs == ()
            continue
        assert 1 <= len(segs) <= attention.MAX_SEGMENTS, (q_lens, group, segs)
        assert [b for _, b, _ in segs] == [0] + list(np.cumsum([c for _, _, c in segs]))[:-1]
        assert sum(c for _, _, c in segs) == queries
        assert all(segs[i][0] != segs[i + 1][0] for i in range(len(segs) - 1))
        seq = np.repeat(np.arange(n), q_lens)
        heads, qpb = min(group, 64), attention.tc_queries_per_block(group)
        for on_tc, b, c in segs:
            if not on_tc:
                continue
            passes = [len(set(seq[x:min(x + qpb, b + c)].tolist())) for x in range(b, b + c, qpb)]
            assert max(passes) <= attention.TC_MAX_PASSES and c * heads * 5 >= 64 * sum(passes), (q_lens, group)
            assert c * heads >= attention.TC_SEGMENT_ROWS or len(segs) == 1


def test_segments_are_cached_and_sum_the_grids(monkeypatch):
    """The segmentation is host work done once per plan and group; the
    unsplit grid (choose_splits) sums the segments' grids."""
    calls = []
    real = attention._segment
    monkeypatch.setattr(attention, "_segment", lambda host, group: calls.append(group) or real(host, group))
    host = _host(Q_MIXED)
    assert attention.tc_segments(host, 4) is attention.tc_segments(host, 4)
    # bf16, D 128, 8 x 2 heads: 12 decode blocks and ceil(40 / 16) + ceil(33 / 16) tensor-core blocks per KV head.
    assert attention.unsplit_blocks(host, 8, 2, 128, 128, "bf16") == (12 + 3 + 3) * 2
    assert attention.unsplit_blocks(host, 8, 2, 128, 128, np.float32) == 85 * 2    # f32: one CUDA-core launch
    assert calls == [4]


@pytest.mark.parametrize("q_lens", [[1] * 5, [40, 0, 33], [1, 1, 40, 1, 33, 1, 1]], ids=["decode", "prefill", "few"])
def test_whole_steps_are_one_launch(xp_backend, launches, q_lens):
    """Decode-only and prefill-only steps, and chunks with a few decodes that
    pack well as a whole (G = 4), stay one launch over all queries."""
    rng = np.random.default_rng(len(q_lens))
    q_lens = np.array(q_lens, np.int32)
    case = make_paged_case(rng, kv_lens=q_lens + 6, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2,
                           head_dim=64, dtype="f16")
    o, lse, plan = run(xp_backend, case, True)
    check(case, o, lse, True, "f16", f"whole step {q_lens.tolist()}")
    n = plan.queries
    assert launches == ([("paged_attention", 0, n, n)] if n == 5 else [("paged_prefill_tc", 0, n, -(-n // 16))])


# (page_size, head_dim, q_heads, kv_heads, q_lens, launches (kernel, q_begin, q_count))
MIXED_SHAPES = [
    (16, 64, 8, 2, Q_MIXED, MIXED_TC),
    (8, 128, 8, 2, Q_MIXED, MIXED_TC),
    (16, 64, 4, 4, [1, 1, 40, 1, 33, 1, 1],
     [("paged_attention", 0, 2), ("paged_prefill_tc", 2, 74), ("paged_attention", 76, 2)]),
    (4, 128, 4, 1, [40, 0, 24] + [1] * 8, [("paged_prefill_tc", 0, 64), ("paged_attention", 64, 8)]),
]


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("shape", MIXED_SHAPES, ids=lambda s: "ps{}-d{}-h{}x{}-q{}".format(*s[:4], len(s[4])))
def test_mixed_steps(xp_backend, launches, dtype, shape):
    """Decode queries on the CUDA-core kernel and prefill chunks on tensor
    cores in one step: each segment's launch covers its own queries, every
    query matches the float64 reference (out and lse, causal and not, with
    and without splits: one merge over all queries)."""
    page_size, d, hq, hkv, q_lens, expect = shape
    rng = np.random.default_rng([page_size, d, hq, len(q_lens)])
    q_lens = np.array(q_lens, np.int32)
    kv_lens = (q_lens + rng.integers(1, 70, q_lens.size)).astype(np.int32)
    case = make_paged_case(rng, kv_lens=kv_lens, q_lens=q_lens, page_size=page_size, num_q_heads=hq,
                           num_kv_heads=hkv, head_dim=d, dtype=dtype)
    qpb = attention.tc_queries_per_block(hq // hkv)
    grids = [(n, b, c, -(-c // qpb) if n == "paged_prefill_tc" else c) for n, b, c in expect]
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
    case = make_paged_case(rng, kv_lens=q_lens + 9, q_lens=q_lens, page_size=16, num_q_heads=8, num_kv_heads=2,
                           head_dim=64, dtype="f16")
    o, lse, _ = run(xp_backend, case, True, out=True, return_lse=False)
    check(case, o, lse, True, "f16", "mixed out=")
    assert [n for n, *_ in launches] == [n for n, _, _ in MIXED_TC]
    if xp_backend.name != "cpu":
        return                                       # GPU capture: the graph tests
    check_capture_replay(rng, case, "f16", "mixed replay")


def test_mixed_step_bad_metadata(xp_backend, kernels_used):
    """Padded and absurd device metadata on a segmented step: a decode whose
    sequence has length 0 and a chunk query with a bad sequence index get
    out 0 and lse -inf; garbage everywhere (sequence indices pointing across
    segments included) never makes a segment leave its arrays."""
    rng = np.random.default_rng(32)
    q_lens = np.array(Q_MIXED, np.int32)
    case = make_paged_case(rng, kv_lens=q_lens + 7, q_lens=q_lens, page_size=4, num_q_heads=8, num_kv_heads=2,
                           head_dim=64, dtype="bf16")
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(q)
    off = metadata_offsets(plan.queries, plan.sequences)
    words = plan.words
    words[off["kv_len"] + 2] = 0                     # decode query 2 (CUDA-core segment): nothing visible
    words[off["q_seq"] + 60] = 0xFFFFFFFF            # query 60 (chunk of 33, tensor cores): bad index
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
    words[off["kv_len"]:off["q_start"]] = 0xFFFFFFFF
    words[off["q_pos"]:off["kv_len"]] = 0xFFFFFFFF
    seqs = rng.integers(0, plan.sequences + 2, size=plan.queries).astype(np.uint32)
    words[off["q_seq"]:off["q_pos"]] = xp_backend.asarray(seqs)
    table = rng.integers(0, 2 ** 32, size=int(plan.words.size) - off["page_table"], dtype=np.uint64)
    table[::3] = rng.integers(0, case.num_pages, size=table[::3].size)
    words[off["page_table"]:] = xp_backend.asarray(table.astype(np.uint32))
    for causal in (True, False):
        plan.attention(q, k, v, case.scale, causal, return_lse=True)   # must simply not crash
    assert {"paged_attention", "paged_prefill_tc"} <= set(kernels_used)


@pytest.mark.parametrize("kernel", ["paged_attention", "paged_prefill_tc"])
def test_launch_range_is_clamped(xp_backend, monkeypatch, kernel):
    """q_begin / q_count are host arguments, clamped anyway: a range running
    past the plan's queries (or starting past them, or wrapping 32 bits) with
    a grid larger than it writes only the plan's queries inside it."""
    rng = np.random.default_rng(33)
    q_lens = np.array([20, 17], np.int32)
    case = make_paged_case(rng, kv_lens=q_lens + 5, q_lens=q_lens, page_size=16, num_q_heads=4, num_kv_heads=1,
                           head_dim=64, dtype="f16")
    q, k, v = (_to_device(xp_backend, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    n = plan.queries
    ref_out, ref_lse = case.reference(True)
    if kernel == "paged_prefill_tc":
        assert attention._schedule(plan.host, "f16", 4, 1, 64, 64, 0, True, True)[0][0] == kernel
        head = attention._schedule(plan.host, "f16", 4, 1, 64, 64, 0, True, True)[0][:4]
    else:
        head = (kernel, attention.select_variant("f16", 64, 64, True, 4), attention.THREADS, 0)
    for begin, count, blocks in ((n - 5, 2 ** 32 - 1, 9), (n + 3, 4, 2), (2 ** 32 - 2, 5, 3), (3, 6, 20)):
        # One launch of `blocks` blocks along x over [begin, begin + count) (one head tile: G = 4).
        monkeypatch.setattr(attention, "_schedule", lambda *a, r=(blocks, 1, begin, count): [head + r])
        out = xp_backend.xp.full((n, 4, 64), 7, dtype=q.dtype)
        lse = xp_backend.xp.full((n, 4), 5.0, dtype=np.float32)
        plan.attention(q, k, v, case.scale, True, out=out, lse=lse)
        o, l = xp_backend.to_numpy(out), xp_backend.to_numpy(lse)
        per_block = attention.tc_queries_per_block(4) if kernel == "paged_prefill_tc" else 1
        hit = np.zeros(n, bool)
        if begin < n:
            hit[begin:min(n, begin + count, begin + blocks * per_block)] = True
        assert (o[~hit] == 7).all() and (l[~hit] == 5.0).all(), (begin, count)
        assert_close(o[hit], ref_out[hit], "f16", f"range {begin} {count}")
        assert_close(l[hit], ref_lse[hit], "f16", f"range {begin} {count}")


@pytest.mark.parametrize("shape", [("bf16", 16, [1, 1, 40, 1, 33, 1, 1], [("paged_mla_tc", 0, 78)]),
                                   ("f16", 8, [1] * 6 + [24, 1],
                                    [("paged_attention", 0, 6), ("paged_mla_tc", 6, 24), ("paged_attention", 30, 1)])],
                         ids=lambda s: "{}-h{}".format(*s[:2]))
def test_mla_mixed(xp_backend, launches, shape):
    """MLA steps mixing chunks and decodes: at 16 heads every decode query
    already brings 16 tensor-core rows, so the step stays one paged_mla_tc
    launch; at 8 heads the decodes run on the CUDA-core kernel around it."""
    dtype, heads, q_lens, expect = shape
    rng = np.random.default_rng(heads)
    q_lens = np.array(q_lens, np.int32)
    case = make_mla_case(rng, kv_lens=q_lens + rng.integers(1, 40, q_lens.size).astype(np.int32), q_lens=q_lens,
                         page_size=16, num_heads=heads, latent_dim=512, pos_dim=64, dtype=dtype)
    q, qp, lat, kp = (_to_device(xp_backend, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(q)
    qpb = attention.tc_queries_per_block(heads)
    grids = [(n, b, c, -(-c // qpb) if n == "paged_mla_tc" else c) for n, b, c in expect]
    for causal, splits in ((True, None), (False, 3)):
        launches.clear()
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, heads, 512, splits, q)
        o, lse = plan.mla(q, qp, lat, kp, case.scale, causal, return_lse=True, workspace=ws)
        check(case, xp_backend.to_numpy(o), xp_backend.to_numpy(lse), causal, dtype,
              f"mla mixed h={heads} causal={causal} splits={splits}")
        merge = [("attention_split_merge", None, None, plan.queries)] if splits else []
        assert launches == grids + merge
