"""fp8 caches and strided views on the write side: append, write_slots,
PagedKVCache and copy_pages.

* The quantizer (fp8::encode in kernels_cu/fp8.cuh) is bit-exact against
  ml_dtypes (reference.quantize_fp8: x / scale in float32, clamped to the
  format's max finite, rounded to nearest even): every f16 and bf16 bit
  pattern, random float32 bit patterns and the boundary values, per tensor
  and per KV head scales.
* vLLM's test_reshape_and_cache_flash fp8 cases (tests/kernels/attention/
  test_cache.py: key / value from qkv.unbind, NHD and HND layouts of one
  combined [blocks, 2, ...] cache, per-tensor and per-head scales amax / 64,
  the dequantized rows against the originals at atol 1e-3, rtol 0.1), at a
  smaller grid on the CPU backend.
* Rows land in views whose innermost dim is contiguous: HND, the K / V halves
  of a combined KV tensor, the latent / rotary columns of a 576-wide MLA cache
  (bit-exact copies, fp8 quantized), with everything outside them untouched.
* Bad inputs raise PagedAttentionError before any launch and write nothing.
"""

import random

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import HostPlan, PagedAttentionError, PagedKVCache
from cupaged.testing import reference

FMTS = ["e4m3", "e5m2"]
F8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def codes(fmt, shape):
    """A zeroed fp8 cache as ml_dtypes codes."""
    return np.zeros(shape, F8[fmt])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("src", ["f16", "bf16"])
def test_quantize_every_16_bit_pattern(fmt, src):
    """Every f16 / bf16 bit pattern, scale 1 for K and a per-head scale for V."""
    dt = np.float16 if src == "f16" else ml_dtypes.bfloat16
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dt).reshape(512, 2, 64)
    k, v = codes(fmt, (32, 16, 2, 64)), codes(fmt, (32, 16, 2, 64))
    vs = np.array([0.375, 1e-3], np.float32)
    cupaged.write_slots(x, x, k, v, np.arange(512), v_scale=vs)
    ek = reference.quantize_fp8(x, fmt)
    ev = reference.quantize_fp8(x, fmt, vs[None, :, None])
    np.testing.assert_array_equal(bits(k).reshape(512, 2, 64), bits(ek))
    np.testing.assert_array_equal(bits(v).reshape(512, 2, 64), bits(ev))


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_float32_bit_patterns_and_boundaries(fmt):
    rng = np.random.default_rng(1)
    mx = float(ml_dtypes.finfo(F8[fmt]).max)
    tiny = float(ml_dtypes.finfo(F8[fmt]).smallest_subnormal)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            -np.nan,
            mx,
            -mx,
            np.nextafter(mx, np.inf, dtype=np.float32),
            mx * 1.0625,
            mx * 1.0625 - 1e-3,
            mx * 1.03,
            tiny,
            tiny / 2,
            tiny * 1.5,
            tiny * 2.5,
            np.nextafter(np.float32(tiny / 2), np.float32(1)),
            1e-40,
            -1e-40,
            3e38,
        ],
        np.float32,
    )
    rand = rng.integers(0, 1 << 32, 4096 * 2 - special.size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.integers(1, 1 << 8, 4096) * np.float32(tiny)).astype(np.float32) * rng.choice([1, -1], 4096)
    with np.errstate(invalid="ignore"):
        x = np.concatenate([special, rand, near]).astype(np.float32).reshape(-1, 4, 32)  # [96, 4, 32]
    n = x.shape[0]
    for ks in (np.float32(1.0), np.float32(0.0625), np.array([3.0, 1e-3, 7e2, 0.5], np.float32)):
        k = codes(fmt, (n // 8, 8, 4, 32))
        v = codes(fmt, (n // 8, 8, 4, 32))
        ksa = np.array([ks], np.float32) if np.ndim(ks) == 0 else ks
        cupaged.write_slots(x, x[::-1].copy(), k, v, np.arange(n), k_scale=ksa)
        exp_k = reference.quantize_fp8(x, fmt, ksa.reshape(-1, 1) if ksa.size > 1 else ksa[0])
        np.testing.assert_array_equal(bits(k).reshape(x.shape), bits(exp_k))
        np.testing.assert_array_equal(bits(v).reshape(x.shape), bits(reference.quantize_fp8(x[::-1], fmt)))


# -- vLLM test_reshape_and_cache_flash, fp8 ------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scale_type", ["tensor", "attn_head"])
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (80, 16), (256, 32)])
def test_vllm_reshape_and_cache_flash_fp8(xp_backend, dtype, layout, scale_type, head_size, block_size):
    random.seed(0)
    rng = np.random.default_rng(0)
    tokens, heads, blocks = 21, 8, 24 if xp_backend.name == "cpu" else 512
    dt = np.float32 if dtype == "f32" else ml_dtypes.bfloat16
    qkv = rng.standard_normal((tokens, 3, heads, head_size)).astype(dt)
    key, value = qkv[:, 1], qkv[:, 2]  # strided views (qkv.unbind)
    slots = np.array(random.sample(range(blocks * block_size), tokens), np.int64)
    if scale_type == "tensor":
        ks = np.array([key.astype(np.float32).max() / 64], np.float32)
        vs = np.array([value.astype(np.float32).max() / 64], np.float32)
    else:
        ks = (key.astype(np.float32).max(axis=(0, 2)) / 64).astype(np.float32)
        vs = (value.astype(np.float32).max(axis=(0, 2)) / 64).astype(np.float32)
    # one combined uint8 tensor, as kv_cache_factory_flashinfer makes it; HND views through a transpose
    shape = (blocks, 2, block_size, heads, head_size) if layout == "NHD" else (blocks, 2, heads, block_size, head_size)
    kv = xp_backend.asarray(rng.integers(0, 256, shape, dtype=np.uint8))
    kc, vc = kv[:, 0], kv[:, 1]
    if layout == "HND":
        kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
    before = xp_backend.to_numpy(kv).copy()
    dev = xp_backend.asarray
    cupaged.write_slots(dev(qkv)[:, 1], dev(qkv)[:, 2], kc, vc, slots, kv_dtype="fp8", k_scale=dev(ks), v_scale=dev(vs))
    got_k, got_v = xp_backend.to_numpy(kc), xp_backend.to_numpy(vc)
    page, off = slots // block_size, slots % block_size
    for got, new, sc in ((got_k, key, ks), (got_v, value, vs)):
        rows = got[page, off]  # [tokens, heads, head_size] uint8
        sc_b = sc.reshape(-1, 1) if sc.size > 1 else sc[0]
        deq = reference.dequantize_fp8(rows, "e4m3", sc_b)
        np.testing.assert_allclose(deq, new.astype(np.float64), atol=1e-3, rtol=0.1)  # vLLM's tolerance
        np.testing.assert_array_equal(rows, bits(reference.quantize_fp8(new, "e4m3", sc_b)))
    # nothing else changed
    after = xp_backend.to_numpy(kv)
    mask = np.ones(after.shape, bool)
    if layout == "NHD":
        mask[page, :, off] = False
    else:
        mask[page, :, :, off] = False
    np.testing.assert_array_equal(after[mask], before[mask])


# -- strided views ---------------------------------------------------------------------------------
def _plan(rng, page_size=4, pages=7):
    kv_lens, q_lens = np.array([9, 3, 6]), np.array([4, 3, 2])
    table = np.full((3, 3), -1)
    perm = rng.permutation(pages)
    table[0, :3], table[1, :1], table[2, :2] = perm[:3], perm[3:4], perm[4:6]
    return HostPlan.build(table, kv_lens, q_lens, page_size, pages)


@pytest.mark.parametrize("fmt", [None, "e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["HND", "combined", "mla576"])
def test_append_into_views(fmt, layout):
    """Rows go into views; the bytes outside them (the other half of the
    combined tensor, the other columns of the MLA cache) stay as they were."""
    rng = np.random.default_rng(7)
    host = _plan(rng)
    plan = host.upload(np.zeros(1, np.float32))
    n, hkv, d = host.queries, 2, 32
    dt = ml_dtypes.bfloat16

    def mk(shape):
        if fmt is None:
            return rng.standard_normal(shape).astype(dt)
        return rng.integers(0, 256, shape, dtype=np.uint8)

    if layout == "HND":
        kbuf, vbuf = mk((7, hkv, 4, d)), mk((7, hkv, 4, d))
        kc, vc = kbuf.transpose(0, 2, 1, 3), vbuf.transpose(0, 2, 1, 3)
        bufs = (kbuf, vbuf)
        dv = d
    elif layout == "combined":
        kbuf = mk((7, 2, 4, hkv, d))
        kc, vc = kbuf[:, 0], kbuf[:, 1]
        bufs = (kbuf,)
        dv = d
    else:
        hkv, d, dv = 1, 512, 64
        kbuf = mk((7, 4, 1, 576))
        kc, vc = kbuf[..., :512], kbuf[..., 512:]
        bufs = (kbuf,)
    qkv = rng.standard_normal((n, hkv, d + dv + 8)).astype(dt)
    nk, nv = qkv[..., :d], qkv[..., d + 8 :]  # slices of a fused projection
    before = [b.copy() for b in bufs]
    ks = np.array([0.5], np.float32) if fmt else None
    vs = np.linspace(0.25, 2, hkv).astype(np.float32) if fmt else None
    plan.append(nk, nv, kc, vc, kv_dtype=fmt, k_scale=ks, v_scale=vs)
    if fmt is None:
        exp_k, exp_v = reference.paged_append(
            nk, nv, np.ascontiguousarray(kc), np.ascontiguousarray(vc), host.page_table, host.kv_lens, host.q_lens
        )
    else:
        qk = reference.quantize_fp8(nk, fmt, ks[0]).view(np.uint8)
        qv = reference.quantize_fp8(nv, fmt, vs[:, None]).view(np.uint8)
        exp_k, exp_v = reference.paged_append(
            qk,
            qv,
            np.ascontiguousarray(before_view(before, layout, 0, d)),
            np.ascontiguousarray(before_view(before, layout, 1, d)),
            host.page_table,
            host.kv_lens,
            host.q_lens,
        )
    np.testing.assert_array_equal(bits(kc), bits(exp_k))
    np.testing.assert_array_equal(bits(vc), bits(exp_v))
    if layout == "mla576":  # the two views share every row of one buffer; neither spilled into the other
        np.testing.assert_array_equal(bits(kbuf[..., :512]), bits(exp_k))
        np.testing.assert_array_equal(bits(kbuf[..., 512:]), bits(exp_v))


def before_view(before, layout, which, d):
    if layout == "HND":
        return before[which].transpose(0, 2, 1, 3)
    if layout == "combined":
        return before[0][:, which]
    return before[0][..., :512] if which == 0 else before[0][..., 512:]


def test_append_k_only_mla_without_rotary_part():
    rng = np.random.default_rng(3)
    host = _plan(rng)
    plan = host.upload(np.zeros(1, np.float32))
    lat = np.zeros((7, 4, 1, 64), np.float16)
    new = rng.standard_normal((host.queries, 1, 64)).astype(np.float16)
    plan.append(new, None, lat, None)
    exp, _ = reference.paged_append(
        new, new, np.zeros_like(lat), np.zeros_like(lat), host.page_table, host.kv_lens, host.q_lens
    )
    np.testing.assert_array_equal(bits(lat), bits(exp))
    with pytest.raises(PagedAttentionError, match="new_v, v_cache: expected both or neither"):
        plan.append(new, new, lat, None)


@pytest.mark.parametrize("fmt", FMTS)
def test_paged_kv_cache_fp8(fmt):
    """PagedKVCache(dtype=fp8): per-layer / per-head scales, appends
    quantize, copy-on-write copies codes bit for bit, kv_args reads back."""
    rng = np.random.default_rng(4)
    cache = PagedKVCache(8, 4, 2, 16, fmt, layers=2, k_scale=[0.5, 2.0], v_scale=[[1.0, 0.25], [3.0, 0.5]])
    assert cache.k.dtype == np.dtype(F8[fmt]) and cache.kv_dtype == fmt and cache.page_bytes == 2 * 4 * 2 * 32
    assert cache.k_scale.dtype == np.float32 and cache.v_scale.shape == (2, 2)
    a = cache.add_sequence()
    plan, _ = cache.prepare([a], [6])
    news = [(rng.standard_normal((6, 2, 16)) * 4).astype(np.float16) for _ in range(4)]
    for layer in range(2):
        cache.append(plan, news[2 * layer], news[2 * layer + 1], layer=layer)
    b = cache.fork(a)
    plan, report = cache.prepare([a, b], [1, 1])
    assert report.copied_pages
    for layer, (ks, vs) in enumerate(((0.5, [1.0, 0.25]), (2.0, [3.0, 0.5]))):
        args = cache.kv_args(layer)
        assert args["kv_dtype"] == fmt and args["k_scale"].shape == (1,) and args["v_scale"].shape == (2,)
        for seq in (a, b):
            pages = list(seq.pages)
            k = cache.k[layer][pages].reshape(-1, 2, 16)[:6]
            v = cache.v[layer][pages].reshape(-1, 2, 16)[:6]
            np.testing.assert_array_equal(bits(k), bits(reference.quantize_fp8(news[2 * layer], fmt, ks)))
            np.testing.assert_array_equal(
                bits(v), bits(reference.quantize_fp8(news[2 * layer + 1], fmt, np.array(vs)[:, None]))
            )
    with pytest.raises(PagedAttentionError, match="k_scale: expected None for a float16 cache"):
        PagedKVCache(8, 4, 2, 16, "f16", k_scale=1.0)
    with pytest.raises(PagedAttentionError, match=r"v_scale: expected a number or float data of shape \[2\]"):
        PagedKVCache(8, 4, 2, 16, fmt, layers=2, v_scale=[1.0, 2.0, 3.0])
    assert not PagedKVCache(8, 4, 2, 16, "bf16").kv_args(0)


def test_copy_pages_fp8_and_strided_pages():
    rng = np.random.default_rng(5)
    kv = rng.integers(0, 256, (3, 6, 2, 4, 2, 8), dtype=np.uint8)  # [layers, pages, 2, page, heads, d]
    k, v = kv[:, :, 0], kv[:, :, 1]
    before = kv.copy()
    cupaged.copy_pages(k, v, [0, 2], [5, 3])
    exp = before.copy()
    exp[:, 5], exp[:, 3] = before[:, 0], before[:, 2]
    np.testing.assert_array_equal(kv, exp)
    f8 = rng.standard_normal((6, 4, 2, 8)).astype(ml_dtypes.float8_e5m2)
    f8v = f8.copy()
    cupaged.copy_pages(f8, f8v, [1], [4])
    np.testing.assert_array_equal(bits(f8[4]), bits(f8[1]))
    hnd = np.zeros((6, 2, 4, 8), np.float16).transpose(0, 2, 1, 3)  # a page is still one block
    cupaged.copy_pages(hnd, hnd.copy(), [1], [4])
    with pytest.raises(PagedAttentionError, match="k_cache: expected each page .* to fill one contiguous block"):
        cupaged.copy_pages(kv[:, :, :, 0], kv[:, :, :, 1], [0], [1])


def test_fp8_write_errors_write_nothing():
    rng = np.random.default_rng(6)
    host = _plan(rng)
    plan = host.upload(np.zeros(1, np.float32))
    n = host.queries
    k8 = np.zeros((7, 4, 2, 16), np.uint8)
    v8 = np.zeros((7, 4, 2, 16), np.uint8)
    nk = rng.standard_normal((n, 2, 16)).astype(np.float16)
    f16c = np.zeros((7, 4, 2, 16), np.float16)
    one = np.ones(1, np.float32)
    cases = [
        (lambda: plan.append(nk, nk, k8, v8), "k_cache: uint8 is raw fp8 storage: name its format with kv_dtype="),
        (lambda: plan.append(nk, nk, k8, v8, kv_dtype="int4"), "kv_dtype: expected one of"),
        (
            lambda: plan.append(nk, nk, f16c, f16c.copy(), kv_dtype="e4m3"),
            r"k_cache: expected dtype float8_e4m3fn or uint8 \(raw fp8 storage\) for kv_dtype='e4m3', got float16",
        ),
        (
            lambda: plan.append(nk, nk, k8, v8, kv_dtype="e4m3", k_scale=np.ones(3, np.float32)),
            r"k_scale: expected shape \[\] or \[1\] \(per tensor\) or \[2\] \(per KV head, contiguous\), got \[3\]",
        ),
        (
            lambda: plan.append(nk, nk, k8, v8, kv_dtype="e4m3", v_scale=np.ones(2, np.float64)),
            "v_scale: expected dtype float32, got float64",
        ),
        (
            lambda: plan.append(nk, nk, k8, v8, kv_dtype="e4m3", k_scale=1.0),
            "k_scale: expected a float32 NumPy or CuPy array",
        ),
        (lambda: plan.append(nk, nk, f16c, f16c.copy(), k_scale=one), "k_scale: expected None for a float16 cache"),
        (
            lambda: plan.append(nk.astype(ml_dtypes.float8_e4m3fn), nk, k8, v8, kv_dtype="e4m3"),
            "new_k: expected dtype float32, float16 or bfloat16, got float8_e4m3fn",
        ),
        (
            lambda: plan.append(nk, nk, np.asfortranarray(k8), v8, kv_dtype="e4m3"),
            "k_cache: expected a contiguous innermost dim",
        ),
        (lambda: plan.append(nk, nk, k8, v8.view(ml_dtypes.float8_e5m2)), "k_cache: uint8 is raw fp8 storage"),
        (
            lambda: plan.append(nk, nk, k8.view(ml_dtypes.float8_e4m3fn), v8.view(ml_dtypes.float8_e5m2)),
            "v_cache: expected dtype float8_e4m3fn like k_cache, got float8_e5m2",
        ),
        (
            lambda: plan.append(
                nk, nk, np.lib.stride_tricks.as_strided(k8, (7, 4, 2, 16), (512, 16, 8, 1)), v8, kv_dtype="e4m3"
            ),
            "k_cache: expected rows that do not overlap one another",
        ),
        (
            lambda: plan.append(nk, nk, k8[:, :, :, :16], k8[:, :, :, :16], kv_dtype="e4m3"),
            "k_cache: expected memory disjoint from v_cache",
        ),
        (
            lambda: cupaged.write_slots(nk, nk, k8, v8, np.arange(n), kv_dtype="e4m3", k_scale=k8[0, 0, 0, :1]),
            "k_scale: expected dtype float32, got uint8",
        ),
    ]
    for call, msg in cases:
        with pytest.raises(PagedAttentionError, match=msg):
            call()
        assert not k8.any() and not v8.any() and not f16c.any()
