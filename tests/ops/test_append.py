"""cupaged.ops.append.append: the paged_append kernel against reference.paged_append,
bit for bit, and every input error (nothing launched, nothing written).

Caches come from cupaged.testing: random page permutation, every unused slot
NaN-poisoned, a huge sentinel past each sequence's pages. Untouched bytes
must stay identical, NaN payloads included.
"""

import types
import zlib

import ml_dtypes
import numpy as np
import pytest

from cupaged import HostPlan, PagedAttentionError, stream_for
from cupaged.ops.append import append, unit_bytes
from cupaged.testing import as_dtype, make_paged_case, reference

BF16 = ml_dtypes.bfloat16
DTYPES = ["f32", "f16", "bf16"]


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def assert_bits(actual, expected, what=""):
    np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=what)


def new_rows(rng, queries, heads, dim, dtype):
    """[queries, heads, dim] normals with a NaN, an inf and a -0.0 mixed in."""
    x = rng.standard_normal((queries, heads, dim))
    flat = x.reshape(-1)
    flat[:3] = [np.nan, -np.inf, -0.0]
    return x.astype(as_dtype(dtype))


def plan_of(case):
    return HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(
        case.k_cache
    )


CONFIGS = {
    # name: make_paged_case arguments (num_kv_heads, head_dim, head_dim_v, lengths ...)
    "gqa_decode": dict(num_kv_heads=2, head_dim=64, head_dim_v=64, page_size=16, sequences=4, max_kv_len=60),
    "mla": dict(num_kv_heads=1, head_dim=512, head_dim_v=64, page_size=16, kv_lens=[40, 17], q_lens=[3, 1]),
    "odd_dims": dict(num_kv_heads=3, head_dim=7, head_dim_v=5, page_size=5, sequences=3, max_kv_len=23, q_lens=3),
    "page_size_1": dict(num_kv_heads=2, head_dim=16, head_dim_v=8, page_size=1, sequences=3, max_kv_len=9, q_lens=4),
    # a prefill chunk crossing three pages on top of 7 cached tokens, a whole
    # prompt from position 0, an empty sequence and an idle one
    "prefill_chunk": dict(
        num_kv_heads=2, head_dim=24, head_dim_v=40, page_size=8, kv_lens=[37, 20, 0, 11], q_lens=[30, 20, 0, 0]
    ),
}


def to_device(backend, x):
    try:
        return backend.asarray(x)
    except Exception as e:  # CuPy without a bfloat16 dtype
        if backend.name == "gpu" and as_dtype(x.dtype).name == "bfloat16":
            pytest.skip(f"CuPy cannot hold bfloat16 arrays here: {e}")
        raise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_append_matches_reference(xp_backend, config, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{config}-{dtype}".encode()))
    case = make_paged_case(rng, num_q_heads=CONFIGS[config]["num_kv_heads"], dtype=dtype, **CONFIGS[config])
    hkv, d, dv = case.k_cache.shape[2], case.k_cache.shape[3], case.v_cache.shape[3]
    new_k = new_rows(rng, case.num_queries, hkv, d, dtype)
    new_v = new_rows(rng, case.num_queries, hkv, dv, dtype)
    exp_k, exp_v = reference.paged_append(
        new_k, new_v, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens
    )
    nk, nv, k, v = (to_device(xp_backend, a) for a in (new_k, new_v, case.k_cache, case.v_cache))
    plan = HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(k)
    assert append(plan, nk, nv, k, v) is None
    k, v = xp_backend.to_numpy(k), xp_backend.to_numpy(v)
    assert_bits(k, exp_k, "k_cache")
    assert_bits(v, exp_v, "v_cache")
    # the slots written are the ones the plan names, and nothing else changed
    pages, offsets = plan.host.write_slots()
    changed = np.argwhere((bits(k) != bits(case.k_cache)).reshape(k.shape[0], k.shape[1], -1).any(-1))
    assert {tuple(x) for x in changed} <= set(zip(pages.tolist(), offsets.tolist()))


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_misaligned_arrays_and_guards(dtype):
    """Base addresses off the 16-byte grid force narrower copy units; guard
    bytes around every array must survive."""
    rng = np.random.default_rng(7)
    dt = as_dtype(dtype)
    case = make_paged_case(
        rng,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=64,
        head_dim_v=32,
        page_size=4,
        sequences=3,
        max_kv_len=14,
        q_lens=2,
        dtype=dtype,
    )

    def embed(a):
        buf = np.full(a.size + 24, np.nan, dt)  # NaN guards on both sides
        view = buf[1 : 1 + a.size].reshape(a.shape)  # one element off the 16-byte grid
        view[...] = a
        return buf, view

    arrays = {}
    for name, a in (
        ("k", case.k_cache),
        ("v", case.v_cache),
        ("nk", new_rows(rng, case.num_queries, 2, 64, dtype)),
        ("nv", new_rows(rng, case.num_queries, 2, 32, dtype)),
    ):
        arrays[name] = embed(a)
    (kb, k), (vb, v), (_, nk), (_, nv) = arrays["k"], arrays["v"], arrays["nk"], arrays["nv"]
    assert unit_bytes(k.ctypes.data, nk.ctypes.data) == dt.itemsize
    kb0, vb0 = kb.copy(), vb.copy()
    exp_k, exp_v = reference.paged_append(nk, nv, k, v, case.page_table, case.kv_lens, case.q_lens)
    append(plan_of(case), nk, nv, k, v)
    assert_bits(k, exp_k)
    assert_bits(v, exp_v)
    for buf, before, n in ((kb, kb0, k.size), (vb, vb0, v.size)):
        assert_bits(buf[:1], before[:1], "guard before")
        assert_bits(buf[1 + n :], before[1 + n :], "guard after")


def test_corrupt_words_write_nothing_outside():
    """Whatever the device words say, the kernel stays inside the caches:
    a bad sequence index, a position past the table and a bad page id are
    skipped; the rest is written."""
    rng = np.random.default_rng(3)
    case = make_paged_case(
        rng, num_q_heads=2, num_kv_heads=2, head_dim=8, page_size=4, kv_lens=[5, 9, 3, 6], dtype="f32"
    )
    nk = new_rows(rng, 4, 2, 8, "f32")
    nv = new_rows(rng, 4, 2, 8, "f32")
    plan = plan_of(case)
    h = plan.host
    exp_k, exp_v = reference.paged_append(
        nk, nv, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens
    )
    q_seq, q_pos = 16, 16 + h.queries
    table = 17 + 2 * h.queries + 2 * h.sequences
    plan.words[q_seq + 0] = 0xFFFFFFF0  # query 0: sequence out of range
    plan.words[q_pos + 1] = 0xFFFFFFF0  # query 1: position past the table
    col = int(h.q_pos[2]) // h.page_size
    plan.words[table + 2 * h.table_width + col] = h.pages  # query 2: page id == num_pages
    k, v = case.k_cache.copy(), case.v_cache.copy()
    append(plan, nk, nv, k, v)
    pages, offsets = h.write_slots()
    for i in range(3):  # skipped: expect the old bytes
        exp_k[pages[i], offsets[i]] = case.k_cache[pages[i], offsets[i]]
        exp_v[pages[i], offsets[i]] = case.v_cache[pages[i], offsets[i]]
    assert_bits(k, exp_k)
    assert_bits(v, exp_v)


def test_graph_replay_reads_positions_from_device_words():
    """Captured once, replayed after the positions and lengths were advanced
    in the device words: the second replay writes the next slot."""
    table = [[2, 0]]
    plan = HostPlan.build(table, [3], [1], 4, 3).upload(np.zeros(1, np.float16))
    k = np.full((3, 4, 1, 8), np.nan, np.float16)
    v = np.full((3, 4, 1, 8), np.nan, np.float16)
    nk = np.arange(8, dtype=np.float16).reshape(1, 1, 8)
    nv = -nk
    s = stream_for(k)
    s.begin_capture()
    try:
        append(plan, nk, nv, k, v)
    finally:
        g = s.end_capture()
    assert np.isnan(k).all()  # recorded, not run
    g.launch()
    exp_k, exp_v = reference.paged_append(nk, nv, np.full_like(k, np.nan), np.full_like(v, np.nan), table, [3], [1])
    assert_bits(k, exp_k)
    # the device advances sequence 0 to length 6 (position 5: page 0, offset 1)
    h = plan.host
    plan.words[16 + h.queries] = 5
    plan.words[16 + 2 * h.queries] = 6
    nk += 100
    nv -= 100
    g.launch()
    exp_k, exp_v = reference.paged_append(nk, nv, exp_k, exp_v, table, [6], [1])
    assert_bits(k, exp_k)
    assert_bits(v, exp_v)


def test_duplicate_slots_rejected_and_nothing_written():
    plan = HostPlan.build([[3], [3]], [2, 2], [1, 1], 4, 4).upload(np.zeros(1, np.float32))
    k = np.full((4, 4, 1, 8), np.nan, np.float32)
    v = np.full((4, 4, 1, 8), np.nan, np.float32)
    nk = np.ones((2, 1, 8), np.float32)
    with pytest.raises(PagedAttentionError, match="both write page 3 offset 1; a shared page must be copied"):
        append(plan, nk, nk.copy(), k, v)
    assert np.isnan(k).all() and np.isnan(v).all()


def test_zero_queries_launch_nothing(monkeypatch):
    plan = HostPlan.build([[0], [1]], [3, 2], [0, 0], 4, 2).upload(np.zeros(1, np.float16))
    k = np.zeros((2, 4, 2, 8), np.float16)
    v = np.zeros((2, 4, 2, 4), np.float16)

    def boom(*a, **kw):
        raise AssertionError("launched")

    monkeypatch.setattr(plan.stream, "launch", boom)
    monkeypatch.setattr("cupaged.ops.append.get_kernel", boom)
    assert append(plan, np.zeros((0, 2, 8), np.float16), np.zeros((0, 2, 4), np.float16), k, v) is None
    # and still checked
    with pytest.raises(PagedAttentionError, match=r"new_k: expected shape \[0, 2, 8\], got \[1, 2, 8\]"):
        append(plan, np.zeros((1, 2, 8), np.float16), np.zeros((0, 2, 4), np.float16), k, v)


# ---------------------------------------------------------------------------
# input errors


def _case(dtype=np.float32, hkv=2, d=8, dv=6):
    # seq 0: 6 tokens, 2 new; seq 1: 3 tokens, 1 new; seq 2: idle
    plan = HostPlan.build([[5, 2, -1], [0, -1, -1], [1, 3, 4]], [6, 3, 9], [2, 1, 0], 4, 6)
    plan = plan.upload(np.zeros(1, np.float32))
    rng = np.random.default_rng(0)
    nk = rng.standard_normal((3, hkv, d)).astype(dtype)
    nv = rng.standard_normal((3, hkv, dv)).astype(dtype)
    k = rng.standard_normal((6, 4, hkv, d)).astype(dtype)
    v = rng.standard_normal((6, 4, hkv, dv)).astype(dtype)
    return plan, nk, nv, k, v


def _bad(plan, nk, nv, k, v, match):
    kb = bits(k).copy() if isinstance(k, np.ndarray) else None
    vb = bits(v).copy() if isinstance(v, np.ndarray) else None
    with pytest.raises(PagedAttentionError, match=match):
        append(plan, nk, nv, k, v)
    if kb is not None and k.flags.c_contiguous:
        np.testing.assert_array_equal(bits(k), kb)
    if vb is not None and v.flags.c_contiguous:
        np.testing.assert_array_equal(bits(v), vb)


def test_good_case_runs():
    plan, nk, nv, k, v = _case()
    exp_k, exp_v = reference.paged_append(nk, nv, k, v, plan.host.page_table, plan.host.kv_lens, plan.host.q_lens)
    append(plan, nk, nv, k, v)
    assert_bits(k, exp_k)
    assert_bits(v, exp_v)


def test_rank_errors():
    plan, nk, nv, k, v = _case()
    _bad(plan, nk[0], nv, k, v, "new_k: expected a 3-D array, got shape")
    _bad(plan, nk, nv[..., None], k, v, "new_v: expected a 3-D array")
    _bad(plan, nk, nv, k[0], v, "k_cache: expected a 4-D array")
    _bad(plan, nk, nv, k, v[..., None], "v_cache: expected a 4-D array")


def test_dtype_and_layout_errors():
    plan, nk, nv, k, v = _case()
    _bad(plan, nk.astype(np.int32), nv, k, v, "new_k: expected dtype float32, float16 or bfloat16, got int32")
    _bad(plan, nk, nv.astype(np.float16), k, v, "new_v: expected dtype float32 like new_k, got float16")
    _bad(plan, nk, nv, k.astype(BF16), v, "k_cache: expected dtype float32 like new_k, got bfloat16")
    _bad(
        plan,
        nk,
        nv,
        k,
        v.astype(np.float64),
        r"v_cache: expected dtype float32, float16, bfloat16, float8_e4m3fn or float8_e5m2 "
        r"\(or uint8 with kv_dtype=\), "
        "got float64",
    )
    _bad(
        plan,
        nk.astype(np.float16),
        nv.astype(np.float16),
        k,
        v,
        "k_cache: expected dtype float16 like new_k, got float32",
    )
    # strided views are fine as long as the innermost dim is contiguous (tests/ops/test_append_fp8.py)
    _bad(plan, np.asfortranarray(nk), nv, k, v, r"new_k: expected a contiguous innermost dim")
    _bad(plan, nk, nv, np.asfortranarray(k), v, r"k_cache: expected a contiguous innermost dim")
    _bad(plan, nk.tolist(), nv, k, v, "new_k: expected a NumPy or CuPy array")
    _bad(plan, nk, nv, k, None, "new_v, v_cache: expected both or neither")
    _bad(plan, nk, nv, k, v.tolist(), "v_cache: expected a NumPy or CuPy array")


def test_shape_errors():
    plan, nk, nv, k, v = _case()
    _bad(plan, nk[:2].copy(), nv, k, v, r"new_k: expected shape \[3, 2, 8\], got \[2, 2, 8\]")
    _bad(plan, nk, nv[:, :, :5].copy(), k, v, r"new_v: expected shape \[3, 2, 6\], got \[3, 2, 5\]")
    _bad(plan, nk, nv, k[:, :, :, :4].copy(), v, r"new_k: expected shape \[3, 2, 4\], got \[3, 2, 8\]")
    _bad(plan, nk, nv, k[:, :, :1].copy(), v, r"v_cache: expected shape \[6, 4, 1, Dv\] like k_cache")
    _bad(plan, nk, nv, k[:5].copy(), v, r"k_cache: expected shape \[6, 4, ...\] \(plan.pages, plan.page_size")
    _bad(plan, nk, nv, k, v[:, :3].copy(), r"v_cache: expected shape \[6, 4, ...\]")
    _bad(plan, nk[:, :, :0].copy(), nv, k[..., :0].copy(), v, "k_cache, v_cache: expected Hkv, D and Dv >= 1")


def test_overlap_errors():
    plan, nk, nv, k, v = _case(d=6, dv=6)
    flat = np.zeros(k.size + nk.size, np.float32)
    kk = flat[: k.size].reshape(k.shape)
    _bad(plan, flat[-nk.size - 6 : -6].reshape(nk.shape), nv, kk, v, "new_k: expected memory disjoint from k_cache")
    vv = k.reshape(-1)[: v.size].reshape(v.shape)
    _bad(plan, nk, nv, k, vv, "k_cache: expected memory disjoint from v_cache")
    _bad(plan, nk, v.reshape(-1)[: nv.size].reshape(nv.shape), k, v, "new_v: expected memory disjoint from v_cache")


def test_u32_and_plan_errors():
    plan, nk, nv, k, v = _case()
    big = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(3, 2**20, 2**12), strides=(2**34, 2**14, 4))
    _bad(plan, big, nv, k, v, "new_k: .* elements exceed 32-bit indexing")
    _bad(plan.host, nk, nv, k, v, "plan: expected a DevicePlan")


class FakeCupy:
    """Looks like a CuPy array to the backend checks (never reaches a kernel)."""

    def __init__(self, a, device=0):
        self._a = a
        self.shape, self.dtype, self.ndim, self.flags, self.nbytes = a.shape, a.dtype, a.ndim, a.flags, a.nbytes
        self.device = types.SimpleNamespace(id=device)
        self.data = types.SimpleNamespace(ptr=0)


FakeCupy.__module__ = "cupy._core.core"


def test_backend_errors():
    plan, nk, nv, k, v = _case()
    _bad(plan, nk, FakeCupy(nv), k, v, "new_v: expected a NumPy array like new_k")
    _bad(
        plan,
        FakeCupy(nk),
        FakeCupy(nv),
        FakeCupy(k),
        FakeCupy(v),
        "new_k: expected an array of the plan's cpu backend, got the gpu backend",
    )
