"""append(..., rope=Rotary(cos, sin, q)): RoPE fused into paged_append.

Against the float64 reference (reference.apply_rope at each query's absolute
position, then reference.paged_append of the rotated rows): the K rows land
rotated in their slots, the q rows are rotated in place, V rows and every
other byte (NaN-poisoned unused slots, the heads of a fused qkv buffer
between q and k, new_k itself) stay bit for bit; fp8 caches get the rotated
rows quantized; the position is the plan's device word (clamped to the
tables); bad input raises before any launch and writes nothing.
"""

import zlib

import ml_dtypes
import numpy as np
import pytest

from cupaged import HostPlan, PagedAttentionError, Rotary
from cupaged.layout import metadata_offsets
from cupaged.ops.append import append
from cupaged.testing import as_dtype, make_paged_case, reference

# Tolerances of a value rounded to the dtype (the kernel rotates in float32,
# as layers.rope: test_layers' rope tolerances).
TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}
F8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
F8_RTOL = {"e4m3": 2.0**-3, "e5m2": 2.0**-2}  # one step of the format's mantissa

CONFIGS = {
    # name: make_paged_case arguments, q heads (0: K alone), table rows (positions past them are clamped)
    "gqa_decode": (dict(num_kv_heads=2, head_dim=64, page_size=16, sequences=4, max_kv_len=60), 4, 64),
    "mha_prefill_chunk": (
        dict(num_kv_heads=3, head_dim=32, page_size=8, kv_lens=[37, 20, 0, 11], q_lens=[30, 20, 0, 0]),
        3,
        24,
    ),
    "mqa_odd_half": (
        dict(num_kv_heads=1, head_dim=6, head_dim_v=10, page_size=4, sequences=3, max_kv_len=23, q_lens=3),
        5,
        40,
    ),
    "k_alone": (
        dict(num_kv_heads=2, head_dim=128, head_dim_v=64, page_size=16, sequences=2, max_kv_len=40, q_lens=2),
        0,
        64,
    ),
}


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def tables(max_pos, dim):
    cos, sin = reference.rope_tables(np.arange(max_pos), dim)
    return cos, sin, cos.astype(np.float32), sin.astype(np.float32)


def split_qkv(flat, hq, hkv, d, dv):
    """The q [rows, hq, d], k [rows, hkv, d] and v [rows, hkv, dv] views of a
    fused projection's output flat [rows, hq d + hkv (d + dv)]."""
    n = flat.shape[0]
    q = flat[:, : hq * d].reshape(n, hq, d)
    k = flat[:, hq * d : (hq + hkv) * d].reshape(n, hkv, d)
    v = flat[:, (hq + hkv) * d :].reshape(n, hkv, dv)
    return q, k, v


def fused_qkv(rng, queries, hq, hkv, d, dv, dtype):
    """A random fused projection's output and its q, k, v views (split_qkv)."""
    flat = rng.standard_normal((queries, hq * d + hkv * (d + dv))).astype(as_dtype(dtype))
    return (flat, *split_qkv(flat, hq, hkv, d, dv))


def small_case(rng, dtype, hq, hkv, d, dv=None):
    """Three sequences of up to 30 tokens, 3 queries each, pages of 8."""
    return make_paged_case(
        rng,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        head_dim_v=dv,
        page_size=8,
        sequences=3,
        max_kv_len=30,
        q_lens=3,
        dtype=dtype,
    )


def expected(case, q, k, v, cos64, sin64, dtype):
    """(q rotated, caches after the append of the rotated K rows) in float64 / the dtype."""
    _, pos = reference.query_positions(case.kv_lens, case.q_lens)
    p = np.minimum(pos, cos64.shape[0] - 1)
    kr = reference.apply_rope(k, cos64[p], sin64[p])
    qr = reference.apply_rope(q, cos64[p], sin64[p]) if q is not None else None
    ek, ev = reference.paged_append(
        kr.astype(as_dtype(dtype)), v, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens
    )
    return qr, kr, ek, ev


def plan_of(case, like):
    return HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(like)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rotary_append_matches_reference(xp_backend, config, dtype):
    args, hq, max_pos = CONFIGS[config]
    rng = np.random.default_rng(zlib.crc32(f"rope-{config}-{dtype}".encode()))
    case = make_paged_case(rng, num_q_heads=max(hq, 1), dtype=dtype, **args)
    hkv, d, dv = case.k_cache.shape[2], case.k_cache.shape[3], case.v_cache.shape[3]
    flat, q, k, v = fused_qkv(rng, case.num_queries, hq, hkv, d, dv, dtype)
    cos64, sin64, cos, sin = tables(max_pos, d)
    qr, _, ek, ev = expected(case, q if hq else None, k, v, cos64, sin64, dtype)
    xp = xp_backend
    dflat, kc, vc, dcos, dsin = (xp.asarray(a.copy()) for a in (flat, case.k_cache, case.v_cache, cos, sin))
    dq = dflat[:, : hq * d].reshape(q.shape) if hq else None
    dk = dflat[:, hq * d : (hq + hkv) * d].reshape(k.shape)
    dv_ = dflat[:, (hq + hkv) * d :].reshape(v.shape)
    plan = plan_of(case, kc)
    append(plan, dk, dv_, kc, vc, rope=Rotary(dcos, dsin, dq))
    got_flat, got_k, got_v = xp.to_numpy(dflat), xp.to_numpy(kc), xp.to_numpy(vc)
    # V rows bit for bit, every slot the plan does not name untouched (NaN poison included)
    np.testing.assert_array_equal(bits(got_v), bits(ev))
    pages, offsets = plan.host.write_slots()
    written = np.zeros(got_k.shape[:2], bool)
    written[pages, offsets] = True
    np.testing.assert_array_equal(bits(got_k[~written]), bits(case.k_cache[~written]))
    tol = TOL[dtype]
    np.testing.assert_allclose(got_k[written].astype(np.float64), ek[written].astype(np.float64), atol=tol, rtol=tol)
    # the q heads rotated in place; the k and v heads of the buffer (new_k, new_v) unchanged
    np.testing.assert_array_equal(bits(got_flat[:, hq * d :]), bits(flat[:, hq * d :]))
    if hq:
        np.testing.assert_allclose(got_flat[:, : hq * d].reshape(q.shape).astype(np.float64), qr, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "fmt"), [("f32", "e4m3"), ("bf16", "e5m2")])
def test_rotary_append_into_fp8(fmt, dtype):
    """Rotated, rounded to the rows' dtype, then quantized with a per-head K
    scale and a per-tensor V scale."""
    rng = np.random.default_rng(zlib.crc32(f"rope-fp8-{fmt}-{dtype}".encode()))
    case = small_case(rng, dtype, 4, 2, 64)
    hkv, d = 2, 64
    _, q, k, v = fused_qkv(rng, case.num_queries, 4, hkv, d, d, dtype)
    cos64, sin64, cos, sin = tables(64, d)
    qr, kr, _, _ = expected(case, q, k, v, cos64, sin64, dtype)
    ks, vs = np.array([0.5, 2.0], np.float32), np.array([0.25], np.float32)
    kc = np.zeros(case.k_cache.shape, F8[fmt])
    vc = np.zeros(case.v_cache.shape, F8[fmt])
    plan = plan_of(case, kc)
    q0, k0 = q.copy(), k.copy()
    append(plan, k, v, kc, vc, k_scale=ks, v_scale=vs, rope=Rotary(cos, sin, q))
    pages, offsets = plan.host.write_slots()
    got_k = kc[pages, offsets].astype(np.float64) * ks[None, :, None]
    got_v = vc[pages, offsets]
    exp_k = kr.astype(as_dtype(dtype)).astype(np.float64)
    np.testing.assert_allclose(got_k, exp_k, rtol=F8_RTOL[fmt], atol=2.0**-6 * ks.max())
    np.testing.assert_array_equal(bits(got_v), bits(reference.quantize_fp8(v, fmt, vs[0])))
    np.testing.assert_allclose(q.astype(np.float64), qr, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(bits(k), bits(k0))
    assert not np.array_equal(bits(q), bits(q0))


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mla_rotary_part(xp_backend, dtype, norm):
    """side="v": an MLA cache's rotary part (new_v: k_pos) rotated, the latent
    (new_k) copied bit for bit, or RMSNorm'd by k_norm (DeepSeek's kv_a
    layernorm), q_rope (a view of the one input product, beside k_pos)
    rotated in place."""
    rng = np.random.default_rng(zlib.crc32(f"rope-mla-{dtype}-{norm}".encode()))
    heads, r, pr = 4, 64, 16
    case = small_case(rng, dtype, 1, 1, r, pr)
    n = case.num_queries
    inp = rng.standard_normal((n, (heads + 1) * pr + r)).astype(as_dtype(dtype))  # [q_rope | k_rope | latent]
    ropes = inp[:, : (heads + 1) * pr].reshape(n, heads + 1, pr)
    q, kr, lat = ropes[:, :heads], ropes[:, heads:], inp[:, None, (heads + 1) * pr :]
    cos64, sin64, cos, sin = tables(64, pr)
    _, pos = reference.query_positions(case.kv_lens, case.q_lens)
    exp_q = reference.apply_rope(q, cos64[pos], sin64[pos])
    exp_kr = reference.apply_rope(kr, cos64[pos], sin64[pos]).astype(as_dtype(dtype))
    wl = (1 + 0.3 * rng.standard_normal(r)).astype(as_dtype(dtype))
    lat_in = reference.rms_norm(lat, wl, 1e-6).astype(as_dtype(dtype)) if norm else lat
    e_lat, e_kr = reference.paged_append(
        lat_in, exp_kr, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens
    )
    xp = xp_backend
    dinp, kc, vc, dcos, dsin = (xp.asarray(a.copy()) for a in (inp, case.k_cache, case.v_cache, cos, sin))
    dropes = dinp[:, : (heads + 1) * pr].reshape(n, heads + 1, pr)
    plan = plan_of(case, kc)
    append(
        plan,
        dinp[:, None, (heads + 1) * pr :],
        dropes[:, heads:],
        kc,
        vc,
        rope=Rotary(dcos, dsin, dropes[:, :heads], side="v", k_norm=xp.asarray(wl) if norm else None),
    )
    got = xp.to_numpy(dinp)
    tol = TOL[dtype]
    if norm:  # rounded once, from an f32 sum in another order: at the dtype's tolerance, the rest untouched
        got_k = xp.to_numpy(kc)
        np.testing.assert_allclose(got_k.astype(np.float64), e_lat.astype(np.float64), atol=tol, rtol=tol)
        pages, offsets = plan.host.write_slots()
        untouched = np.ones(got_k.shape[:2], bool)
        untouched[pages, offsets] = False
        np.testing.assert_array_equal(bits(got_k[untouched]), bits(case.k_cache[untouched]))
        assert not np.allclose(
            got_k[pages, offsets].astype(np.float64), lat[:, 0].astype(np.float64)[:, None], atol=0.05
        )
    else:
        np.testing.assert_array_equal(bits(xp.to_numpy(kc)), bits(e_lat))
    got_v = xp.to_numpy(vc)
    pages, offsets = plan.host.write_slots()
    np.testing.assert_allclose(
        got_v[pages, offsets].astype(np.float64), e_kr[pages, offsets].astype(np.float64), atol=tol, rtol=tol
    )
    written = np.zeros(got_v.shape[:2], bool)
    written[pages, offsets] = True
    np.testing.assert_array_equal(bits(got_v[~written]), bits(case.v_cache[~written]))
    np.testing.assert_allclose(got[:, : heads * pr].reshape(n, heads, pr).astype(np.float64), exp_q, atol=tol, rtol=tol)
    np.testing.assert_array_equal(
        bits(got[:, heads * pr :]), bits(inp[:, heads * pr :])
    )  # k_rope and latent as they were


@pytest.mark.parametrize(("dtype", "fmt"), [("f32", None), ("f16", None), ("bf16", None), ("bf16", "e4m3")])
def test_qk_norm_then_rope(xp_backend, dtype, fmt):
    """Qwen3: q_norm / k_norm (per-head RMSNorm over the head dim) before the
    rotation, in the same launch: q and K are normalized, rounded to the
    dtype (as rms_norm writes them), rotated; V copied; into an fp8 cache
    too."""
    rng = np.random.default_rng(zlib.crc32(f"rope-norm-{dtype}-{fmt}".encode()))
    hq, hkv, d = 4, 2, 64
    case = small_case(rng, dtype, hq, hkv, d)
    flat, q, k, v = fused_qkv(rng, case.num_queries, hq, hkv, d, d, dtype)
    flat *= 3  # rows far from unit RMS: the norm must matter
    wq = (1 + 0.3 * rng.standard_normal(d)).astype(as_dtype(dtype))
    wk = (1 + 0.3 * rng.standard_normal(d)).astype(as_dtype(dtype))
    eps = 1e-6
    cos64, sin64, cos, sin = tables(64, d)

    def normed(x, wt):
        return reference.rms_norm(x.astype(np.float64), wt.astype(np.float64), eps).astype(as_dtype(dtype))

    qr, kr, ek, ev = expected(case, normed(q, wq), normed(k, wk), v, cos64, sin64, dtype)
    xp = xp_backend
    dflat, dcos, dsin, dwq, dwk = (xp.asarray(a.copy()) for a in (flat, cos, sin, wq, wk))
    dq, dk, dv_ = split_qkv(dflat, hq, hkv, d, d)
    if fmt is None:
        kc, vc = xp.asarray(case.k_cache.copy()), xp.asarray(case.v_cache.copy())
    else:
        kc, vc = xp.asarray(np.zeros(case.k_cache.shape, F8[fmt])), xp.asarray(np.zeros(case.v_cache.shape, F8[fmt]))
    plan = plan_of(case, kc)
    append(plan, dk, dv_, kc, vc, rope=Rotary(dcos, dsin, dq, q_norm=dwq, k_norm=dwk, eps=eps))
    tol = TOL[dtype] * 3  # (rounded twice: after the norm and after the rotation)
    got = xp.to_numpy(dflat)
    np.testing.assert_allclose(got[:, : hq * d].reshape(q.shape).astype(np.float64), qr, atol=tol, rtol=tol)
    np.testing.assert_array_equal(bits(got[:, hq * d :]), bits(flat[:, hq * d :]))
    pages, offsets = plan.host.write_slots()
    got_k = xp.to_numpy(kc)[pages, offsets].astype(np.float64)
    exp_k = ek[pages, offsets].astype(np.float64) if fmt is None else kr.astype(as_dtype(dtype)).astype(np.float64)
    if fmt is None:
        np.testing.assert_allclose(got_k, exp_k, atol=tol, rtol=tol)
        np.testing.assert_array_equal(bits(xp.to_numpy(vc)), bits(ev))
    else:
        np.testing.assert_allclose(got_k, exp_k, rtol=F8_RTOL[fmt], atol=2.0**-6)
    # the norm is applied, not skipped: the rotation alone is far from it
    plain, _, _, _ = expected(case, q, k, v, cos64, sin64, dtype)
    assert not np.allclose(got[:, : hq * d].reshape(q.shape).astype(np.float64), plain, atol=0.1)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("norm", [False, True])
def test_bias_then_norm_then_rope(xp_backend, dtype, norm):
    """Qwen2's q / k / v biases added in the append (as bias_add), then (with
    the norms) the RMSNorm, then the rotation; V gets its bias, unrotated."""
    rng = np.random.default_rng(zlib.crc32(f"rope-bias-{dtype}-{norm}".encode()))
    hq, hkv, d = 4, 2, 32
    case = small_case(rng, dtype, hq, hkv, d)
    flat, q, k, v = fused_qkv(rng, case.num_queries, hq, hkv, d, d, dtype)
    dt = as_dtype(dtype)
    bq, bk, bv = (rng.standard_normal((h, d)).astype(dt) for h in (hq, hkv, hkv))
    wq, wk = ((1 + 0.3 * rng.standard_normal(d)).astype(dt) for _ in range(2))
    cos64, sin64, cos, sin = tables(64, d)

    def prep(x, b, wt):
        y = (x.astype(np.float64) + b.astype(np.float64)).astype(dt)
        return reference.rms_norm(y, wt, 1e-6).astype(dt) if norm else y

    qr, _, ek, ev = expected(
        case, prep(q, bq, wq), prep(k, bk, wk), (v.astype(np.float64) + bv).astype(dt), cos64, sin64, dtype
    )
    xp = xp_backend
    dflat, kc, vc = (xp.asarray(a.copy()) for a in (flat, case.k_cache, case.v_cache))
    dq, dk, dv_ = split_qkv(dflat, hq, hkv, d, d)
    norms = dict(q_norm=xp.asarray(wq), k_norm=xp.asarray(wk)) if norm else {}
    rope = Rotary(
        xp.asarray(cos),
        xp.asarray(sin),
        dq,
        q_bias=xp.asarray(bq),
        k_bias=xp.asarray(bk),
        v_bias=xp.asarray(bv),
        **norms,
    )
    plan = plan_of(case, kc)
    append(plan, dk, dv_, kc, vc, rope=rope)
    tol = TOL[dtype] * 3
    got = xp.to_numpy(dflat)
    np.testing.assert_allclose(got[:, : hq * d].reshape(q.shape).astype(np.float64), qr, atol=tol, rtol=tol)
    np.testing.assert_array_equal(bits(got[:, hq * d :]), bits(flat[:, hq * d :]))
    pages, offsets = plan.host.write_slots()
    gk, gv = xp.to_numpy(kc), xp.to_numpy(vc)
    np.testing.assert_allclose(
        gk[pages, offsets].astype(np.float64), ek[pages, offsets].astype(np.float64), atol=tol, rtol=tol
    )
    np.testing.assert_array_equal(bits(gv[pages, offsets]), bits(ev[pages, offsets]))  # one rounding of x + b: exact


@pytest.mark.parametrize("aligned", [True, False])
def test_table_rows_off_the_16_byte_grid(aligned):
    """The tables' rows are read 16 bytes at a time where they are aligned,
    a float at a time where not (a table that is a view one float off the
    grid): the same rotation either way, no misaligned vector load (the CPU
    backend checks each one's address)."""
    rng = np.random.default_rng(21)
    case = small_case(rng, "bf16", 4, 2, 64)
    flat, q, k, v = fused_qkv(rng, case.num_queries, 4, 2, 64, 64, "bf16")
    cos64, sin64, cos, sin = tables(64, 64)
    if not aligned:
        cos, sin = (np.concatenate([np.zeros(1, np.float32), t.ravel()])[1:].reshape(t.shape) for t in (cos, sin))
        assert cos.ctypes.data % 16 and sin.ctypes.data % 16
    qr, _, ek, _ = expected(case, q, k, v, cos64, sin64, "bf16")
    kc = case.k_cache.copy()
    plan = plan_of(case, kc)
    append(plan, k, v, kc, case.v_cache.copy(), rope=Rotary(cos, sin, q))
    pages, offsets = plan.host.write_slots()
    tol = TOL["bf16"]
    np.testing.assert_allclose(q.astype(np.float64), qr, atol=tol, rtol=tol)
    np.testing.assert_allclose(
        kc[pages, offsets].astype(np.float64), ek[pages, offsets].astype(np.float64), atol=tol, rtol=tol
    )


def test_position_is_the_device_word():
    """The rotation follows the plan's device q_pos word (what a decode loop
    advances between graph replays), not the host plan."""
    rng = np.random.default_rng(11)
    d = 16
    cos64, sin64, cos, sin = tables(32, d)
    k = rng.standard_normal((1, 1, d)).astype(np.float32)
    v = rng.standard_normal((1, 1, d)).astype(np.float32)
    q = rng.standard_normal((1, 2, d)).astype(np.float32)
    kc = np.full((2, 4, 1, d), np.nan, np.float32)
    vc = np.full((2, 4, 1, d), np.nan, np.float32)
    plan = HostPlan.build([[1, 0]], [3], [1], 4, 2).upload(kc)
    off = metadata_offsets(plan.host.queries, plan.host.sequences)
    plan.words[off["q_pos"]] = 6  # query 0 at position 6 (page 0, offset 2) ...
    plan.words[off["kv_len"]] = 7  # ... of a sequence of length 7
    q0 = q.copy()
    append(plan, k, v, kc, vc, rope=Rotary(cos, sin, q))
    np.testing.assert_allclose(kc[0, 2], reference.apply_rope(k, cos64[[6]], sin64[[6]])[0], atol=1e-5)
    np.testing.assert_allclose(q, reference.apply_rope(q0, cos64[[6]], sin64[[6]]), atol=1e-5)
    assert np.isnan(kc[1]).all() and np.isnan(kc[0, [0, 1, 3]]).all()


def test_padded_queries_rotate_q_and_write_nothing():
    """A query with no slot (a padded row, kv_len 0) writes no K/V; its q row
    is still rotated (its attention output is ignored)."""
    d = 8
    cos64, sin64, cos, sin = tables(8, d)
    kc = np.full((2, 4, 1, d), np.nan, np.float16)
    vc = np.full((2, 4, 1, d), np.nan, np.float16)
    plan = HostPlan.build([[0], [1]], [2, 0], [1, 0], 4, 2).upload(kc)
    plan.words[metadata_offsets(plan.host.queries, plan.host.sequences)["kv_len"]] = 0  # query 0 loses its slot
    k = np.ones((1, 1, d), np.float16)
    q = np.ones((1, 1, d), np.float16)
    append(plan, k, k, kc, vc, rope=Rotary(cos, sin, q))
    assert np.isnan(kc).all() and np.isnan(vc).all()
    np.testing.assert_allclose(q, reference.apply_rope(np.ones((1, 1, d)), cos64[[1]], sin64[[1]]), atol=2e-3)


def test_rotary_errors_write_nothing():
    rng = np.random.default_rng(5)
    case = make_paged_case(
        rng, num_q_heads=2, num_kv_heads=2, head_dim=16, page_size=4, sequences=2, max_kv_len=9, q_lens=1, dtype="f32"
    )
    n = case.num_queries
    _, q, k, v = fused_qkv(rng, n, 2, 2, 16, 16, "f32")
    _, _, cos, sin = tables(16, 16)
    plan = plan_of(case, case.k_cache)
    before = [a.copy() for a in (q, k, v, case.k_cache, case.v_cache)]

    def bad(rope, match, **kw):
        with pytest.raises(PagedAttentionError, match=match):
            append(plan, kw.get("k", k), v, case.k_cache, case.v_cache, rope=rope)

    bad((cos, sin), r"rope: expected a cupaged.Rotary")
    bad(Rotary(cos.astype(np.float64), sin, q), r"cos: expected a contiguous float32 \[max_pos, 8\] table")
    bad(Rotary(cos[:, :4].copy(), sin[:, :4].copy(), q), r"cos: expected a contiguous float32 \[max_pos, 8\]")
    bad(Rotary(cos, sin[:8], q), r"sin: expected shape \[16, 8\]")
    bad(Rotary(cos, sin, q.astype(np.float16)), r"rope.q: expected dtype float32 like new_k")
    bad(Rotary(cos, sin, q[:, :, :8]), r"rope.q: expected shape \[%d, 2, 16\]" % n)
    bad(Rotary(cos, sin, q[:-1]), r"rope.q: expected shape")
    bad(Rotary(cos, sin, k), r"rope.q: expected memory disjoint from new_k")
    bad(Rotary(cos, sin, case.k_cache[0, :n]), r"rope.q: expected memory disjoint from k_cache")
    for a, b in zip(before, (q, k, v, case.k_cache, case.v_cache)):
        np.testing.assert_array_equal(bits(a), bits(b))
    bad(Rotary(cos, sin, None, q_norm=cos[0]), r"rope.q_norm: expected None without rope.q")
    bad(Rotary(cos, sin, q, q_norm=np.ones(8, np.float32)), r"rope.q_norm: expected shape \[16\], got \[8\]")
    bad(Rotary(cos, sin, q, k_norm=np.ones(16, np.float16)), r"rope.k_norm: expected dtype float32 like new_k")
    bad(Rotary(cos, sin, q, k_norm=np.ones(16, np.float32), eps=-1.0), r"rope.eps: expected a finite float >= 0")
    bad(Rotary(cos, sin, q, v_norm=np.ones(8, np.float32)), r"rope.v_norm: expected shape \[16\], got \[8\]")
    bad(Rotary(cos, sin, q, k_bias=np.ones((2, 8), np.float32)), r"rope.k_bias: expected shape \[2, 16\], got \[2, 8\]")
    bad(Rotary(cos, sin, None, q_bias=np.ones((2, 16), np.float32)), r"rope.q_bias: expected None without rope.q")
    bad(
        Rotary(case.k_cache.reshape(-1)[: 16 * 8].reshape(16, 8), sin, q),
        r"rope.cos: expected memory disjoint from k_cache",
    )
    bad(Rotary(cos, sin, q, side="q"), r"rope.side: expected 'k' or 'v' \(the rows rotated\), got 'q'")
    with pytest.raises(PagedAttentionError, match="rope.side: expected 'k' without new_v and v_cache"):
        append(plan, k, None, case.k_cache, None, rope=Rotary(cos, sin, q, side="v"))
    with pytest.raises(PagedAttentionError, match="rope.v_norm: expected None without new_v and v_cache"):
        append(plan, k, None, case.k_cache, None, rope=Rotary(cos, sin, q, v_norm=cos[0]))
    odd = make_paged_case(
        rng, num_q_heads=1, num_kv_heads=1, head_dim=7, page_size=4, sequences=1, max_kv_len=5, q_lens=1, dtype="f32"
    )
    k7 = np.zeros((1, 1, 7), np.float32)
    with pytest.raises(PagedAttentionError, match="rope: expected an even K head dim to rotate, got 7"):
        append(plan_of(odd, odd.k_cache), k7, k7, odd.k_cache, odd.v_cache, rope=Rotary(cos, sin))
