"""cupaged.interop: torch tensors (and JAX arrays) through every op, zero-copy.

Tests that need torch take the ``torch`` fixture (``pytest.importorskip``), so
the file is skipped cleanly without it; the JAX test needs only jax. CPU
tensors run the CPU backend and are checked against the float64 references;
``@pytest.mark.gpu`` tests need CuPy, a GPU and a CUDA build of torch.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError, interop
from cupaged.layout import metadata_offsets
from cupaged.testing import as_dtype, assert_close, make_mla_case, make_paged_case, reference

DTYPES = ["f32", "f16", "bf16"]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _tdtype(torch, dt):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]


def _t(torch, a, device="cpu"):
    """A torch copy of NumPy ``a`` made by torch itself (not by interop), in
    a's dtype; bfloat16 values go through float32 exactly."""
    if str(a.dtype) == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)
    return torch.from_numpy(np.array(a)).to(device)


def _np(t):
    """float64 NumPy copy of a tensor (made by torch)."""
    return t.detach().cpu().double().numpy()


def _same_bits(a, b) -> bool:
    """Bit-equal tensors (NaN included)."""
    return a.numpy().tobytes() == b.numpy().tobytes()


def _plan(torch, case, like):
    host = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages)
    return interop.torch_plan(host, like)


def _case(dt, **kw):
    return make_paged_case(
        np.random.default_rng(1),
        kv_lens=np.array([37, 5, 20], np.int32),
        q_lens=[1, 5, 3],
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=dt,
        **kw,
    )


# ------------------------------------------------------------------ views


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "int64", "int32"])
def test_views_share_memory_both_ways(torch, dt):
    tdt = {"int64": torch.int64, "int32": torch.int32}.get(dt) or _tdtype(torch, dt)
    base = torch.arange(24).to(tdt).reshape(4, 6)
    t = base[1:]  # a storage offset
    a = interop.as_array(t)
    assert isinstance(a, np.ndarray) and a.shape == (3, 6) and a.ctypes.data == t.data_ptr()
    assert str(a.dtype) == {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(dt, dt)
    a[0, 0] = 100  # a write through the view shows in torch
    assert base[1, 0].item() == 100
    back = interop.as_torch(a)
    assert back.dtype == tdt and back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    assert interop.as_array(a) is a and interop.as_torch(t) is t
    n = np.arange(6, dtype=as_dtype(dt) if dt in DTYPES else dt).reshape(2, 3)
    tn = interop.as_torch(n)
    assert tn.dtype == tdt and tn.data_ptr() == n.ctypes.data and _np(tn).tolist() == n.astype(float).tolist()


def test_views_of_grad_and_empty_tensors(torch):
    w = torch.ones(3, requires_grad=True)
    assert interop.as_array(w).ctypes.data == w.data_ptr()  # read through detach()
    assert interop.as_array(torch.empty(0, 4)).shape == (0, 4)
    with pytest.raises(PagedAttentionError, match="m: expected a CPU or CUDA tensor, got device meta"):
        interop.as_array(torch.empty(2, device="meta"), "m")
    with pytest.raises(PagedAttentionError, match="x: expected a torch tensor or a NumPy/CuPy array, got builtins"):
        interop.as_array([1.0], "x")


# ------------------------------------------------------------------ ops against the references


@pytest.mark.parametrize("dt", DTYPES)
def test_attention(torch, dt):
    case = _case(dt)
    q, k, v = (_t(torch, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = _plan(torch, case, q)
    ref_out, ref_lse = case.reference(True)
    out, lse = plan.attention(q, k, v, case.scale, True, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == (plan.queries, 4, 64)
    assert_close(_np(out), ref_out, dt, "out")
    assert_close(_np(lse), ref_lse, dt, "lse")
    # Preallocated out/lse are written in place and returned themselves.
    buf, lbuf = torch.full_like(out, 7), torch.full_like(lse, 7)
    ptrs = buf.data_ptr(), lbuf.data_ptr()
    res = plan.attention(q, k, v, case.scale, True, out=buf, lse=lbuf)
    assert res[0] is buf and res[1] is lbuf and (buf.data_ptr(), lbuf.data_ptr()) == ptrs
    assert torch.equal(buf, out) and torch.equal(lbuf, lse)
    # Split-KV workspace, and no causal mask.
    ws = plan.workspace(4, 64, 2)
    o2 = plan.attention(q, k, v, case.scale, False, workspace=ws)
    assert_close(_np(o2), case.reference(False)[0], dt, "split, non-causal")


@pytest.mark.parametrize("dt", DTYPES)
def test_mla(torch, dt):
    case = make_mla_case(
        np.random.default_rng(2),
        kv_lens=np.array([30, 9], np.int32),
        q_lens=[1, 4],
        num_heads=4,
        latent_dim=64,
        pos_dim=16,
        dtype=dt,
    )
    q, q_pos, latent, k_pos = (_t(torch, a) for a in (case.q, case.q_pos, case.latent, case.k_pos))
    plan = _plan(torch, case, q)
    ref_out, ref_lse = case.reference(True)
    out = torch.empty_like(q)
    res, lse = plan.mla(q, q_pos, latent, k_pos, case.scale, return_lse=True, out=out)
    assert res is out
    assert_close(_np(out), ref_out, dt, "mla out")
    assert_close(_np(lse), ref_lse, dt, "mla lse")


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_score_variants(torch, dt):
    """soft_cap, window, sinks and alibi_slopes (float32 tensors) through the
    adapter, split and not, attention and MLA; a sinks tensor that overlaps
    lse, or of the wrong dtype, is refused."""
    case = _case(dt)
    q, k, v = (_t(torch, a) for a in (case.q, case.k_cache, case.v_cache))
    plan = _plan(torch, case, q)
    sinks = torch.linspace(-1.0, 2.0, 4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    kw = dict(soft_cap=5.0, window=3, sinks=sinks, alibi_slopes=slopes)
    ref = reference.scored_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        case.kv_lens,
        case.q_lens,
        case.scale,
        True,
        soft_cap=5.0,
        window=3,
        sinks=sinks.numpy(),
        alibi_slopes=slopes.numpy(),
    )
    for ws in (None, plan.workspace(4, 64, 3)):
        out, lse = plan.attention(q, k, v, case.scale, True, return_lse=True, workspace=ws, **kw)
        assert_close(_np(out), ref[0], dt, "out")
        assert_close(_np(lse), ref[1], dt, "lse")
    buf = torch.zeros(2 * plan.queries * 4)
    with pytest.raises(PagedAttentionError, match="lse: expected memory disjoint from sinks"):
        plan.attention(q, k, v, case.scale, lse=buf[: plan.queries * 4].view(plan.queries, 4), sinks=buf[:4])
    with pytest.raises(PagedAttentionError, match=r"alibi_slopes: expected float32 \[4\].*got float16"):
        plan.attention(q, k, v, case.scale, alibi_slopes=slopes.half())
    mcase = make_mla_case(
        np.random.default_rng(4),
        kv_lens=np.array([30, 9], np.int32),
        q_lens=[1, 4],
        num_heads=4,
        latent_dim=64,
        pos_dim=16,
        dtype=dt,
    )
    mq, mq_pos, latent, k_pos = (_t(torch, a) for a in (mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos))
    mplan = _plan(torch, mcase, mq)
    out = mplan.mla(mq, mq_pos, latent, k_pos, mcase.scale, window=5, sinks=sinks)
    qa, keys, values = reference.mla_as_attention(mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos)
    ref = reference.scored_attention(
        qa,
        keys,
        values,
        mcase.page_table,
        mcase.kv_lens,
        mcase.q_lens,
        mcase.scale,
        True,
        window=5,
        sinks=sinks.numpy(),
    )
    assert_close(_np(out), ref[0], dt, "mla out")


@pytest.mark.parametrize("dt", DTYPES)
def test_append(torch, dt):
    case = _case(dt)
    rng = np.random.default_rng(3)
    dtype = as_dtype(dt)
    nk = rng.standard_normal((case.num_queries, 2, 64)).astype(dtype)
    nv = rng.standard_normal((case.num_queries, 2, 64)).astype(dtype)
    k, v = _t(torch, case.k_cache), _t(torch, case.v_cache)
    ptrs = k.data_ptr(), v.data_ptr()
    plan = _plan(torch, case, k)
    assert plan.append(_t(torch, nk), _t(torch, nv), k, v) is None
    exp_k, exp_v = reference.paged_append(
        nk, nv, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens
    )
    assert (k.data_ptr(), v.data_ptr()) == ptrs
    np.testing.assert_array_equal(_np(k), exp_k.astype(np.float64))
    np.testing.assert_array_equal(_np(v), exp_v.astype(np.float64))


@pytest.mark.parametrize("dt", DTYPES)
def test_argmax_and_layers(torch, dt):
    rng = np.random.default_rng(4)
    dtype = as_dtype(dt)
    logits = rng.standard_normal((3, 1000)).astype(dtype)
    out = torch.full((3,), -1, dtype=torch.int64)
    assert interop.argmax_into(_t(torch, logits), out) is out
    assert out.tolist() == reference.row_argmax(logits).tolist()
    assert interop.argmax(_t(torch, logits)).tolist() == out.tolist()

    x, w = rng.standard_normal((5, 40)).astype(dtype), rng.standard_normal(40).astype(dtype)
    tx, tw = _t(torch, x), _t(torch, w)
    y = torch.empty_like(tx)
    assert interop.rms_norm(tx, tw, y, eps=1e-5) is y
    assert_close(_np(y), reference.rms_norm(x, w, 1e-5), dt, "rms_norm")
    interop.rms_norm(tx, tw, tx, eps=1e-5)  # out may be exactly x
    assert torch.equal(tx, y)

    wl = (rng.standard_normal((9, 40)) / np.sqrt(40)).astype(dtype)
    z = torch.empty(5, 9, dtype=_tdtype(torch, dt))
    interop.linear(_t(torch, x), _t(torch, wl), z)
    assert_close(_np(z), x.astype(np.float64) @ wl.astype(np.float64).T, dt, "linear")

    gu = rng.standard_normal((5, 2 * 8)).astype(dtype)
    s = torch.empty(5, 8, dtype=_tdtype(torch, dt))
    interop.silu_mul(_t(torch, gu), s)
    g64 = gu.astype(np.float64)
    assert_close(_np(s), reference.silu(g64[:, :8]) * g64[:, 8:], dt, "silu_mul")

    e = torch.empty(3, 40, dtype=_tdtype(torch, dt))
    interop.embed(torch.tensor([4, 0, 2]), tx, e)
    assert torch.equal(e, tx[[4, 0, 2]])


def test_rope_reads_plan_words(torch):
    """A mixed call: torch x, cos, sin with the plan's own NumPy words as positions."""
    case = _case("f32")
    plan = _plan(torch, case, _t(torch, case.q))
    q64 = np.random.default_rng(5).standard_normal((case.num_queries, 4, 64))
    x = torch.from_numpy(q64.astype(np.float32))
    cos, sin = (torch.from_numpy(t.astype(np.float32)) for t in reference.rope_tables(np.arange(64), 64))
    off = metadata_offsets(plan.queries, plan.sequences)["q_pos"]
    assert interop.rope(x, plan.plan.words[off : off + plan.queries], cos, sin) is x
    pos = plan.host.q_pos
    assert_close(_np(x), reference.apply_rope(q64, cos.numpy()[pos], sin.numpy()[pos]), "f32", "rope")


def test_kv_cache(torch):
    cache = interop.TorchKVCache(
        num_pages=8, page_size=4, kv_heads=2, head_dim=16, dtype=torch.float16, like=torch.empty(0)
    )
    assert cache.k.dtype == torch.float16 and cache.k.data_ptr() == cache.cache.k.ctypes.data
    a = cache.add_sequence()
    b = cache.add_sequence()
    rng = np.random.default_rng(6)

    def new(n):
        return rng.standard_normal((n, 2, 16)).astype(np.float16)

    plan, _ = cache.prepare([a, b], [6, 3])
    assert isinstance(plan, interop.TorchPlan)
    nk, nv = new(9), new(9)
    cache.append(plan, torch.from_numpy(nk), torch.from_numpy(nv))
    q = new(9)
    assert tuple(cache.k.shape) == (1, 8, 4, 2, 16)
    out = plan.attention(torch.from_numpy(q), cache.k[0], cache.v[0], 0.25)
    table = cache.page_table([a, b])
    k_ref, v_ref = reference.paged_append(
        nk, nv, np.zeros((8, 4, 2, 16)), np.zeros((8, 4, 2, 16)), table, [6, 3], [6, 3]
    )
    ref, _ = reference.paged_attention(q, k_ref, v_ref, table, [6, 3], [6, 3], 0.25, True)
    assert_close(_np(out), ref, "f16", "cache attention")
    # two layers: one table, one plan, each layer's rows in its own view of the one allocation
    layered = interop.TorchKVCache(
        num_pages=8, page_size=4, kv_heads=2, head_dim=16, dtype=torch.float16, layers=2, like=torch.empty(0)
    )
    c = layered.add_sequence()
    plan, _ = layered.prepare([c], [6], reserve=2)
    assert tuple(layered.k.shape) == (2, 8, 4, 2, 16) and c.capacity == 8
    for layer in range(2):
        layered.append(plan, torch.from_numpy(nk[:6] * (layer + 1)), torch.from_numpy(nv[:6]), layer=layer)
    pages = list(c.pages)
    got = _np(layered.k[1])[pages].reshape(-1, 2, 16)[:6]
    np.testing.assert_array_equal(got, nk[:6] * 2)


# ------------------------------------------------------------------ fp8 and views


def _fp8_t(torch, codes):
    """A torch fp8 tensor holding the ml_dtypes fp8 array ``codes`` (a copy made by torch)."""
    t8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[str(codes.dtype)]
    return torch.from_numpy(np.array(codes.view(np.uint8))).view(t8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_and_strided_tensors(torch, fmt):
    """fp8 tensors and strided views (HND, a combined KV tensor) pass
    zero-copy, with k_scale / v_scale tensors; the result matches the
    reference on the dequantized cache."""
    case = _case("f16")
    hkv = case.k_cache.shape[2]
    ks = torch.tensor([0.05, 0.09], dtype=torch.float32)
    vs = torch.tensor([0.07], dtype=torch.float32)
    kc = reference.quantize_fp8(case.k_cache, fmt, ks.numpy()[:, None])
    vc = reference.quantize_fp8(case.v_cache, fmt, vs.numpy())
    k_ref = reference.dequantize_fp8(kc, scale=ks.numpy()[:, None].astype(np.float64))
    v_ref = reference.dequantize_fp8(vc, scale=vs.numpy().astype(np.float64))
    ref, ref_lse = reference.paged_attention(
        case.q, k_ref, v_ref, case.page_table, case.kv_lens, case.q_lens, case.scale, True
    )
    k_hnd = _fp8_t(torch, np.ascontiguousarray(kc.transpose(0, 2, 1, 3))).transpose(1, 2)  # [pages, ps, Hkv, D]
    kv = torch.stack([_fp8_t(torch, kc), _fp8_t(torch, vc)], dim=1)  # [pages, 2, ps, Hkv, D]
    q = _t(torch, case.q)
    plan = _plan(torch, case, q)
    for k, v in ((k_hnd, _fp8_t(torch, vc)), (kv[:, 0], kv[:, 1])):
        a = interop.as_array(k)
        assert a.ctypes.data == k.data_ptr() and a.strides == tuple(x * k.element_size() for x in k.stride())
        assert str(a.dtype) == str(k.dtype).removeprefix("torch.")
        out, lse = plan.attention(q, k, v, case.scale, k_scale=ks, v_scale=vs, return_lse=True)
        assert out.dtype == torch.float16
        assert_close(_np(out), ref, "f16", f"{fmt} torch")
        assert_close(_np(lse), ref_lse, "f16", f"{fmt} torch lse")
    # back: an ml_dtypes fp8 array as a torch fp8 tensor, same memory
    t = interop.as_torch(kc)
    assert t.dtype == _fp8_t(torch, kc[:1]).dtype and t.data_ptr() == kc.ctypes.data
    with pytest.raises(PagedAttentionError, match="q: expected dtype float16 or bfloat16"):
        plan.attention(q.float(), k_hnd, kv[:, 1], case.scale, k_scale=ks, v_scale=vs)
    lse = torch.zeros(plan.queries, 4)
    with pytest.raises(PagedAttentionError, match="lse: expected memory disjoint from k_scale"):
        plan.attention(q, k_hnd, kv[:, 1], case.scale, k_scale=lse[0, :hkv], v_scale=vs, lse=lse)


def test_fp8_kv_cache_and_mla_views(torch):
    """TorchKVCache(dtype=torch.float8_e4m3fn): fp8 tensors, append
    quantizes, attention reads it back through kv_args; MLA on column views
    of one torch cache."""
    cache = interop.TorchKVCache(
        num_pages=8,
        page_size=4,
        kv_heads=2,
        head_dim=16,
        dtype=torch.float8_e4m3fn,
        like=torch.empty(0),
        k_scale=torch.tensor([[0.02, 0.05]]),
        v_scale=0.03,
    )
    assert cache.k.dtype == torch.float8_e4m3fn and cache.k.data_ptr() == cache.cache.k.ctypes.data
    a = cache.add_sequence()
    rng = np.random.default_rng(8)
    plan, _ = cache.prepare([a], [7])
    nk, nv, q = (rng.standard_normal((7, h, 16)).astype(np.float16) for h in (2, 2, 4))
    cache.append(plan, torch.from_numpy(nk), torch.from_numpy(nv))
    out = plan.attention(torch.from_numpy(q), cache.k[0], cache.v[0], 0.25, **cache.kv_args(0))
    table = cache.page_table([a])
    kr = reference.dequantize_fp8(cache.cache.k[0], scale=np.array([[0.02], [0.05]]))
    vr = reference.dequantize_fp8(cache.cache.v[0], scale=0.03)
    ref, _ = reference.paged_attention(q, kr, vr, table, [7], [7], 0.25, True)
    assert_close(_np(out), ref, "f16", "fp8 cache attention")
    # MLA: latent and k_pos as column views of one [pages, page_size, 1, R + P] tensor
    mc = make_mla_case(
        np.random.default_rng(9),
        kv_lens=np.array([20, 9], np.int32),
        q_lens=[1, 2],
        num_heads=4,
        latent_dim=64,
        pos_dim=16,
        dtype="bf16",
    )
    c = _t(torch, np.concatenate([mc.latent, mc.k_pos], axis=-1))
    q, q_pos = _t(torch, mc.q), _t(torch, mc.q_pos)
    mplan = _plan(torch, mc, q)
    out = mplan.mla(q, q_pos, c[..., :64], c[..., 64:], mc.scale)
    assert_close(_np(out), mc.reference(True)[0], "bf16", "mla views")
    out = mplan.mla(q, None, c[..., :64], None, mc.scale)  # P = 0
    ref, _ = reference.paged_attention(mc.q, mc.latent, mc.latent, mc.page_table, mc.kv_lens, mc.q_lens, mc.scale)
    assert_close(_np(out), ref, "bf16", "mla P=0")


def test_mla_zero_width_rotary_tensors(torch):
    """Issue #19 item 12: zero-width q_pos [T, H, 0] / k_pos [pages,
    page_size, 1, 0] tensors (FlashInfer's MLA without a rotary part) are
    P = 0 like None: the same output to the last bit; a zero-width one
    beside a real rotary part is refused."""
    mc = make_mla_case(
        np.random.default_rng(10),
        kv_lens=np.array([20, 9], np.int32),
        q_lens=[1, 2],
        num_heads=4,
        latent_dim=64,
        pos_dim=16,
        dtype="bf16",
    )
    c = _t(torch, np.concatenate([mc.latent, mc.k_pos], axis=-1))
    q = _t(torch, mc.q)
    mplan = _plan(torch, mc, q)
    base = mplan.mla(q, None, c[..., :64], None, mc.scale)
    ref, _ = reference.paged_attention(mc.q, mc.latent, mc.latent, mc.page_table, mc.kv_lens, mc.q_lens, mc.scale)
    assert_close(_np(base), ref, "bf16", "mla P=0")
    for q_pos, k_pos in (
        (q.new_zeros(3, 4, 0), c.new_zeros(c.shape[:3] + (0,))),
        (q[..., :0], c[..., 64:64]),
        (q[..., :0], c[..., 80:]),
    ):
        out, lse = mplan.mla(q, q_pos, c[..., :64], k_pos, mc.scale, return_lse=True)
        assert torch.equal(out, base)
    with pytest.raises(
        PagedAttentionError,
        match=r"q_rot, k_rot: expected both or neither .*got q_rot shape "
        r"\[3, 4, 0\] and k_rot shape \[\d+, 16, 1, 16\]",
    ):
        mplan.mla(q, q.new_zeros(3, 4, 0), c[..., :64], c[..., 64:], mc.scale)


# ------------------------------------------------------------------ overlap


def test_out_aliasing_q_through_another_view_is_rejected(torch):
    case = _case("f32")
    n = case.q.size
    buf = torch.zeros(2 * n)
    q = buf[:n].view(case.q.shape)
    q.copy_(torch.from_numpy(case.q))
    k, v = _t(torch, case.k_cache), _t(torch, case.v_cache)
    plan = _plan(torch, case, q)
    before = buf.clone()
    for out in (
        buf[n // 2 : n // 2 + n].view(case.q.shape),  # half over q, another view of its storage
        q.view(-1).view(case.q.shape),
    ):  # q itself, through a fresh view
        with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from q, but they overlap"):
            plan.attention(q, k, v, case.scale, out=out)
        assert torch.equal(buf, before)
    # Disjoint slices of the same storage are fine.
    out = buf[n:].view(case.q.shape)
    plan.attention(q, k, v, case.scale, out=out)
    assert_close(_np(out), case.reference(True)[0], "f32")


def test_out_or_lse_overlapping_the_cache_is_rejected(torch):
    case = _case("f16")
    q, v = _t(torch, case.q), _t(torch, case.v_cache)
    flat = torch.zeros(case.k_cache.size + 8, dtype=torch.float16)
    k = flat[8:].view(case.k_cache.shape)
    k.copy_(_t(torch, case.k_cache))
    plan = _plan(torch, case, q)
    before = flat.clone()
    out = flat[: q.numel()].view(q.shape)  # reaches 8 elements past k's start
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from k_cache"):
        plan.attention(q, k, v, case.scale, out=out)
    assert _same_bits(flat, before)
    lse = flat.view(torch.float32)[4 : 4 + plan.queries * 4].view(plan.queries, 4)
    with pytest.raises(PagedAttentionError, match="lse: expected memory disjoint from k_cache"):
        plan.attention(q, k, v, case.scale, lse=lse)
    out = torch.empty_like(q)
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from lse"):
        plan.attention(q, k, v, case.scale, out=out, lse=out.view(torch.float32)[: plan.queries * 4].view(-1, 4))
    assert _same_bits(flat, before)


def test_other_writes_checked_for_overlap(torch):
    case = _case("f32")
    k, v = _t(torch, case.k_cache), _t(torch, case.v_cache)
    plan = _plan(torch, case, k)
    before = k.clone()
    nk = k.view(-1)[: case.num_queries * 2 * 64].view(case.num_queries, 2, 64)  # new_k inside k_cache
    with pytest.raises(PagedAttentionError, match="k_cache: expected memory disjoint from new_k"):
        plan.append(nk, torch.zeros(case.num_queries, 2, 64), k, v)
    with pytest.raises(PagedAttentionError, match="k_cache: expected memory disjoint from v_cache"):
        plan.append(torch.zeros(case.num_queries, 2, 64), torch.zeros(case.num_queries, 2, 64), k, k)
    assert _same_bits(k, before)

    buf = torch.randn(40)
    x = buf[:32].view(4, 8)
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from x"):
        interop.rms_norm(x, torch.ones(8), buf[8:].view(4, 8))  # out = x shifted one row: not exactly x
    w = torch.randn(4, 8)
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from weight"):
        interop.linear(torch.randn(2, 8), w, w.view(-1)[:8].view(2, 4))
    logits = torch.randn(2, 8)
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from logits"):
        interop.argmax_into(logits, logits.view(torch.int64)[0, :2])
    with pytest.raises(PagedAttentionError, match="out: expected a tensor that does not require grad"):
        interop.silu_mul(torch.randn(2, 8), torch.zeros(2, 4, requires_grad=True))


# ------------------------------------------------------------------ mixing


def test_mixed_torch_and_numpy(torch):
    case = _case("f32")
    q = _t(torch, case.q)
    plan = _plan(torch, case, case.q)  # a NumPy like works too
    out = plan.attention(q, case.k_cache, case.v_cache, case.scale)  # NumPy caches, torch q
    assert isinstance(out, torch.Tensor)
    assert_close(_np(out), case.reference(True)[0], "f32")
    np_out = np.empty(out.shape, np.float32)
    assert plan.attention(q, case.k_cache, case.v_cache, case.scale, out=np_out) is np_out
    np.testing.assert_array_equal(np_out, out.numpy())
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from q"):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, out=torch.from_numpy(case.q))
    with pytest.raises(PagedAttentionError, match="v_cache: expected dtype float32 like q"):
        plan.attention(q, case.k_cache, case.v_cache.astype(np.float16), case.scale)
    with pytest.raises(PagedAttentionError, match="q: expected a NumPy or CuPy array, got torch.Tensor"):
        plan.plan.attention(q, case.k_cache, case.v_cache, case.scale)  # the plain DevicePlan wants arrays
    with pytest.raises(PagedAttentionError, match="logits: expected a torch tensor or a NumPy/CuPy array"):
        interop.argmax_into([[1.0, 2.0]], torch.empty(1, dtype=torch.int64))


# ------------------------------------------------------------------ JAX


def test_jax_arrays_are_read_zero_copy():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    x = jnp.asarray(logits)
    view = np.from_dlpack(x)
    assert view.ctypes.data == x.unsafe_buffer_pointer()
    assert interop.as_array(x).ctypes.data == x.unsafe_buffer_pointer()
    out = np.empty(3, np.int64)
    interop.argmax_into(x, out)
    assert out.tolist() == reference.row_argmax(logits).tolist()
    assert jnp.from_dlpack(out).tolist() == out.tolist()


# ------------------------------------------------------------------ GPU


def _cuda(torch, dt="f32"):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here (CPU build of torch)")
    if dt == "bf16":
        import cupy

        try:
            cupy.empty(1, dtype=as_dtype("bf16"))
        except Exception as e:  # CuPy without a bfloat16 dtype
            pytest.skip(f"CuPy cannot hold bfloat16 arrays here: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTYPES)
def test_gpu_attention_on_a_torch_stream(torch, dt):
    _cuda(torch, dt)
    case = _case(dt)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = (_t(torch, a, "cuda") for a in (case.q, case.k_cache, case.v_cache))
        plan = _plan(torch, case, q)
        assert plan.stream.ptr == s.cuda_stream
        assert interop.as_array(q).data.ptr == q.data_ptr()
        out = torch.empty_like(q)
        res, lse = plan.attention(q, k, v, case.scale, out=out, return_lse=True)
        assert res is out and lse.is_cuda
        y = out * 1  # torch work after ours on the same stream
    with pytest.raises(PagedAttentionError, match="torch's current stream"):
        plan.attention(q, k, v, case.scale)  # default stream now, plan on s
    s.synchronize()
    assert_close(_np(y), case.reference(True)[0], dt, "gpu out")
    assert_close(_np(lse), case.reference(True)[1], dt, "gpu lse")


@pytest.mark.gpu
def test_gpu_score_variants_on_cuda_tensors(torch):
    """sinks / alibi_slopes as CUDA tensors on the plan's stream (unchecked here: no GPU)."""
    _cuda(torch, "f16")
    case = _case("f16")
    q, k, v = (_t(torch, a, "cuda") for a in (case.q, case.k_cache, case.v_cache))
    plan = _plan(torch, case, q)
    sinks = torch.linspace(-1.0, 2.0, 4, device="cuda")
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    out, lse = plan.attention(
        q, k, v, case.scale, True, return_lse=True, soft_cap=5.0, window=3, sinks=sinks, alibi_slopes=slopes
    )
    torch.cuda.synchronize()
    ref = reference.scored_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        case.kv_lens,
        case.q_lens,
        case.scale,
        True,
        soft_cap=5.0,
        window=3,
        sinks=sinks.cpu().numpy(),
        alibi_slopes=slopes.cpu().numpy(),
    )
    assert_close(_np(out), ref[0], "f16", "gpu out")
    assert_close(_np(lse), ref[1], "f16", "gpu lse")


@pytest.mark.gpu
def test_gpu_append_argmax_and_overlap(torch):
    _cuda(torch, "bf16")
    case = _case("bf16")
    k, v = _t(torch, case.k_cache, "cuda"), _t(torch, case.v_cache, "cuda")
    plan = _plan(torch, case, k)
    rng = np.random.default_rng(8)
    nk = rng.standard_normal((case.num_queries, 2, 64)).astype(as_dtype("bf16"))
    plan.append(_t(torch, nk, "cuda"), _t(torch, nk, "cuda"), k, v)
    exp_k, _ = reference.paged_append(nk, nk, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens)
    np.testing.assert_array_equal(_np(k), exp_k.astype(np.float64))
    logits = torch.randn(4, 5000, device="cuda")
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    interop.argmax_into(logits, out)
    assert out.tolist() == logits.argmax(1).tolist()
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from k_cache"):
        plan.attention(_t(torch, case.q, "cuda"), k, v, case.scale, out=k.view(-1)[: case.q.size].view(case.q.shape))
    with pytest.raises(PagedAttentionError, match="must share a backend"):
        plan.attention(_t(torch, case.q), k, v, case.scale)  # a CPU q with CUDA caches


@pytest.mark.gpu
def test_gpu_fp8_tensors_and_views(torch):
    """fp8 CUDA tensors (CuPy sees raw uint8 storage; the adapter passes
    kv_dtype) in an HND view, with CUDA scale tensors (unchecked here: no GPU)."""
    _cuda(torch, "f16")
    case = _case("f16")
    ks = torch.tensor([0.05, 0.09], device="cuda")
    vs = torch.tensor([0.07], device="cuda")
    kc = reference.quantize_fp8(case.k_cache, "e4m3", ks.cpu().numpy()[:, None])
    vc = reference.quantize_fp8(case.v_cache, "e4m3", vs.cpu().numpy())
    k = _fp8_t(torch, np.ascontiguousarray(kc.transpose(0, 2, 1, 3))).cuda().transpose(1, 2)
    v = _fp8_t(torch, vc).cuda()
    q = _t(torch, case.q, "cuda")
    plan = _plan(torch, case, q)
    assert interop.as_array(k).data.ptr == k.data_ptr()
    out, lse = plan.attention(q, k, v, case.scale, k_scale=ks, v_scale=vs, return_lse=True)
    torch.cuda.synchronize()
    k_ref = reference.dequantize_fp8(kc, scale=ks.cpu().numpy()[:, None].astype(np.float64))
    v_ref = reference.dequantize_fp8(vc, scale=vs.cpu().numpy().astype(np.float64))
    ref = reference.paged_attention(case.q, k_ref, v_ref, case.page_table, case.kv_lens, case.q_lens, case.scale)
    assert_close(_np(out), ref[0], "f16", "gpu fp8 out")
    assert_close(_np(lse), ref[1], "f16", "gpu fp8 lse")
