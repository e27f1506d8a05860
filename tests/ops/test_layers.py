"""Decoder-step kernels (kernels_cu/layers.cu) on the CPU backend against
float64 NumPy references, all three dtypes, plus their input errors; rope and
rms_norm also on strided views (NaN gaps) through the kernel and host=True
(kernels_cu/host/layers.cpp) paths."""

import numpy as np
import pytest

from cupaged import PagedAttentionError
from cupaged._runtime import host_layers
from cupaged.ops import layers
from cupaged.testing import as_dtype, assert_close, reference

DTYPES = ["f32", "f16", "bf16"]


def _rand(rng, shape, dt, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(as_dtype(dt))


@pytest.mark.parametrize("dt", DTYPES)
def test_embed(dt):
    rng = np.random.default_rng(0)
    table = _rand(rng, (50, 24), dt)
    tokens = np.array([3, 0, 49, -1, 50, 7], np.int64)  # -1 and 50 are out of range -> zeros
    out = np.full((6, 24), np.nan, as_dtype(dt))
    layers.embed(tokens, table, out)
    exp = np.zeros((6, 24))
    for i, t in enumerate(tokens):
        if 0 <= t < 50:
            exp[i] = table[t].astype(np.float64)
    np.testing.assert_array_equal(out.astype(np.float64), exp)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("dim", [1, 37, 256])
def test_rms_norm(dt, dim):
    rng = np.random.default_rng(dim)
    x = _rand(rng, (5, dim), dt, 3.0)
    w = _rand(rng, (dim,), dt)
    out = np.empty_like(x)
    layers.rms_norm(x, w, out, eps=1e-5)
    assert_close(out, reference.rms_norm(x, w, 1e-5), dt)
    layers.rms_norm(x, w, x, eps=1e-5)  # in place
    np.testing.assert_array_equal(x.view(np.uint8), out.view(np.uint8))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 5, 7), (3, 33, 64), (4, 9, 130)])
def test_linear_and_accumulate(dt, m, n, k):
    rng = np.random.default_rng(m * n * k)
    x = _rand(rng, (m, k), dt)
    w = _rand(rng, (n, k), dt, 1 / np.sqrt(k))
    out = np.empty((m, n), as_dtype(dt))
    layers.linear(x, w, out)
    exp = x.astype(np.float64) @ w.astype(np.float64).T
    assert_close(out, exp, dt)
    base = out.astype(np.float64)
    layers.linear(x, w, out, accumulate=True)
    atol, _ = (1e-4, 0) if dt == "f32" else (3e-2, 0)
    np.testing.assert_allclose(out.astype(np.float64), base + exp, atol=atol, rtol=atol)


@pytest.mark.parametrize("dt", DTYPES)
def test_rope_reads_positions_from_device_words(dt):
    rng = np.random.default_rng(4)
    rows, heads, dim, max_pos = 5, 3, 16, 40
    x = _rand(rng, (rows, heads, dim), dt)
    cos64, sin64 = reference.rope_tables(np.arange(max_pos), dim)
    cos, sin = cos64.astype(np.float32), sin64.astype(np.float32)
    words = np.zeros(2 * rows, np.uint32)
    pos = np.array([0, 3, 39, 12, 1000])  # 1000 is clamped to the last row
    words[::2] = pos
    got = x.copy()
    layers.rope(got, words, cos, sin, position_stride=2)
    p = np.minimum(pos, max_pos - 1)
    exp = reference.apply_rope(x, cos[p], sin[p])
    assert_close(got, exp, dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_silu_mul(dt):
    rng = np.random.default_rng(5)
    gu = _rand(rng, (4, 2 * 45), dt, 2.0)
    out = np.empty((4, 45), as_dtype(dt))
    layers.silu_mul(gu, out)
    g, u = gu[:, :45].astype(np.float64), gu[:, 45:].astype(np.float64)
    assert_close(out, reference.silu(g) * u, dt)


def test_layer_errors():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(PagedAttentionError, match=r"weight: expected \[N, 8\]"):
        layers.linear(x, np.zeros((3, 9), np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(PagedAttentionError, match=r"out: expected shape \[2, 3\]"):
        layers.linear(x, np.zeros((3, 8), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from x"):
        layers.linear(x, np.zeros((8, 8), np.float32), x)
    with pytest.raises(PagedAttentionError, match="weight: expected dtype float32 like x"):
        layers.rms_norm(x, np.zeros(8, np.float16), x)
    with pytest.raises(PagedAttentionError, match="tokens: expected a contiguous int64"):
        layers.embed(np.zeros(2, np.int32), np.zeros((4, 8), np.float32), x)
    with pytest.raises(PagedAttentionError, match="x: expected an even head dim"):
        layers.rope(
            np.zeros((1, 1, 3), np.float32),
            np.zeros(1, np.uint32),
            np.zeros((4, 1), np.float32),
            np.zeros((4, 1), np.float32),
        )
    with pytest.raises(PagedAttentionError, match="positions: expected at least 3 words"):
        layers.rope(
            np.zeros((2, 1, 4), np.float32),
            np.zeros(2, np.uint32),
            np.zeros((4, 2), np.float32),
            np.zeros((4, 2), np.float32),
            position_stride=2,
        )
    with pytest.raises(PagedAttentionError, match=r"out: expected shape \[2, 3\]"):
        layers.silu_mul(np.zeros((2, 6), np.float32), np.zeros((2, 4), np.float32))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,h,n,k", [(1, 1, 5, 7), (3, 4, 33, 16), (5, 2, 9, 130)])
def test_linear_heads_and_accumulate(dt, m, h, n, k):
    rng = np.random.default_rng(m * h * n * k)
    x = _rand(rng, (m, h, k), dt)
    w = _rand(rng, (h, n, k), dt, 1 / np.sqrt(k))
    out = np.full((m, h, n), np.nan, as_dtype(dt))
    layers.linear_heads(x, w, out)
    exp = reference.linear_heads(x, w)
    assert_close(out, exp, dt)
    base = out.astype(np.float64)
    layers.linear_heads(x, w, out, accumulate=True)
    atol = 1e-4 if dt == "f32" else 3e-2
    np.testing.assert_allclose(out.astype(np.float64), base + exp, atol=atol, rtol=atol)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
def test_products_read_x_at_its_strides(dt, host):
    """linear's x a column slice [M, K] of a NaN [M, K + 11] buffer, and
    linear_heads' x the first K columns of each head of a NaN [M, H, K + 5]
    buffer (MLA's no-rope query beside its rotary part): the NaN columns are
    never read (a product that ignored the strides would read them)."""
    rng = np.random.default_rng(41)
    m, h, n, k = 3, 2, 9, 24
    buf = np.full((m, k + 11), np.nan, as_dtype(dt))
    x = buf[:, 4 : 4 + k]
    x[...] = _rand(rng, (m, k), dt)
    assert np.isnan(buf.reshape(-1)[: m * k]).any()  # read as packed rows, x would bring NaN
    w = _rand(rng, (n, k), dt, 1 / np.sqrt(k))
    out = np.full((m, n), np.nan, as_dtype(dt))
    layers.linear(x, w, out, host=host)
    assert_close(out, x.astype(np.float64) @ w.astype(np.float64).T, dt)
    buf3 = np.full((m, h, k + 5), np.nan, as_dtype(dt))
    x3 = buf3[..., :k]
    x3[...] = _rand(rng, (m, h, k), dt)
    w3 = _rand(rng, (h, n, k), dt, 1 / np.sqrt(k))
    out3 = np.full((m, h, n), np.nan, as_dtype(dt))
    layers.linear_heads(x3, w3, out3, host=host)
    assert_close(out3, reference.linear_heads(x3, w3), dt)
    with pytest.raises(PagedAttentionError, match=r"x: expected a contiguous innermost dim"):
        layers.linear(buf[:, ::2], np.zeros((n, (k + 12) // 2), as_dtype(dt)), out, host=host)


@pytest.mark.parametrize("dt", DTYPES)
def test_bias_add(dt):
    rng = np.random.default_rng(6)
    x = _rand(rng, (5, 37), dt)
    b = _rand(rng, (37,), dt)
    got = x.copy()
    layers.bias_add(got, b)
    assert_close(got, x.astype(np.float64) + b.astype(np.float64), dt)
    layers.bias_add(got[:0], b)  # no rows: nothing launched


def test_linear_heads_and_bias_errors():
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(PagedAttentionError, match=r"weight: expected \[3, N, 8\]"):
        layers.linear_heads(x, np.zeros((2, 4, 8), np.float32), np.zeros((2, 3, 4), np.float32))
    with pytest.raises(PagedAttentionError, match=r"out: expected shape \[2, 3, 4\]"):
        layers.linear_heads(x, np.zeros((3, 4, 8), np.float32), np.zeros((2, 3, 5), np.float32))
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from x"):
        layers.linear_heads(x, np.zeros((3, 8, 8), np.float32), x)
    with pytest.raises(PagedAttentionError, match=r"bias: expected shape \[8\]"):
        layers.bias_add(np.zeros((2, 8), np.float32), np.zeros(7, np.float32))
    with pytest.raises(PagedAttentionError, match="bias: expected dtype float32 like x"):
        layers.bias_add(np.zeros((2, 8), np.float32), np.zeros(8, np.float16))


# -- strided row views (rope's x, rms_norm's x and out): columns of a fused QKV buffer ---------------------------
def _strided(rng, dt, layout, shape, scale=1.0):
    """A NaN-filled buffer and ``take``, which maps any array shaped like it to a
    strided ``shape`` view of it ([rows, dim] or [rows, heads, dim], its last dim
    contiguous); the view of the buffer holds random values, the gaps NaN.

    "qkv": the first heads of a fused [rows, (heads + 2) * dim] projection buffer (rows a
    wider row apart, heads dim apart); "padded": heads dim + 6 apart, a row and a head
    around them, starting 2 elements into a head (rows and heads with gaps between)."""
    rows, mid, dim = shape[0], shape[1:-1], shape[-1]
    if layout == "qkv":
        n = int(np.prod(mid, dtype=np.int64))
        buf = np.full((rows, (n + 2) * dim), np.nan, as_dtype(dt))

        def take(a):
            return a[:, : n * dim].reshape(shape)

    else:
        buf = np.full((rows + 1, *(m + 2 for m in mid), dim + 6), np.nan, as_dtype(dt))

        def take(a):
            return a[(slice(1, None), *(slice(1, m + 1) for m in mid), slice(2, dim + 2))]

    view = take(buf)
    assert np.shares_memory(view, buf) and not view.flags.c_contiguous
    view[...] = _rand(rng, shape, dt, scale)
    # the test can fail: read as if C-contiguous from its first element, the view would take in NaN gaps
    start = (view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // buf.itemsize
    assert np.isnan(buf.reshape(-1)[start : start + view.size].astype(np.float64)).any()
    return buf, take


def _assert_gaps_nan(buf, take):
    gaps = np.ones(buf.shape, bool)
    take(gaps)[...] = False
    assert gaps.any() and np.isnan(buf[gaps].astype(np.float64)).all(), "a gap between the view's rows was written"


def _host_calls(monkeypatch, name):
    """Count the host=True path's calls of host_layers.<name> (so a test sees that it ran)."""
    calls, real = [], getattr(host_layers, name)

    def spy(*args, **kw):
        calls.append(name)
        return real(*args, **kw)

    monkeypatch.setattr(host_layers, name, spy)
    return calls


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("layout,dim", [("qkv", 16), ("padded", 40)])
def test_rope_on_a_strided_view(dt, host, layout, dim, monkeypatch):
    # host=True runs kernels_cu/host/layers.cpp for float32, the kernel otherwise
    rng = np.random.default_rng(dim)
    rows, heads, max_pos = 5, 3, 40
    buf, take = _strided(rng, dt, layout, (rows, heads, dim))
    x = take(buf)
    x0 = x.astype(np.float64)
    cos64, sin64 = reference.rope_tables(np.arange(max_pos), dim)
    cos, sin = cos64.astype(np.float32), sin64.astype(np.float32)
    pos = np.array([0, 3, 39, 12, 1000], np.uint32)  # 1000 is clamped to the last row
    calls = _host_calls(monkeypatch, "rope")
    layers.rope(x, pos, cos, sin, host=host)
    assert len(calls) == (host and dt == "f32")
    p = np.minimum(pos, max_pos - 1)
    assert_close(x, reference.apply_rope(x0, cos[p], sin[p]), dt)
    _assert_gaps_nan(buf, take)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(5, 37), (4, 3, 16)])  # [rows, dim]; [tokens, heads, head_dim] (q/k norm)
@pytest.mark.parametrize("layout", ["qkv", "padded"])
def test_rms_norm_on_strided_views(dt, host, shape, layout, monkeypatch):
    rng = np.random.default_rng(len(shape))
    xbuf, take = _strided(rng, dt, layout, shape, 3.0)
    obuf, otake = _strided(rng, dt, "padded" if layout == "qkv" else "qkv", shape)  # out: other strides than x's
    x, out = take(xbuf), otake(obuf)
    out[...] = np.nan
    w = _rand(rng, shape[-1:], dt)
    x_bits = xbuf.copy()
    exp = reference.rms_norm(x, w, 1e-5)
    calls = _host_calls(monkeypatch, "rms_norm")
    layers.rms_norm(x, w, out, eps=1e-5, host=host)
    assert_close(out, exp, dt)
    _assert_gaps_nan(obuf, otake)
    np.testing.assert_array_equal(xbuf.view(np.uint8), x_bits.view(np.uint8))  # x read only
    layers.rms_norm(x, w, take(xbuf), eps=1e-5, host=host)  # in place: a second view of x's very elements
    np.testing.assert_array_equal(x.view(np.uint8), out.view(np.uint8))
    _assert_gaps_nan(xbuf, take)
    assert len(calls) == 2 * (host and dt == "f32")


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
def test_rms_norm_per_head_of_a_contiguous_3d_array(dt, host):
    rng = np.random.default_rng(8)
    x = _rand(rng, (3, 4, 24), dt, 2.0)  # [tokens, heads, head_dim]
    w = _rand(rng, (24,), dt)
    out = np.full_like(x, np.nan)
    layers.rms_norm(x, w, out, eps=1e-6, host=host)
    exp = reference.rms_norm(x, w, 1e-6)
    assert_close(out, exp, dt)
    # normalized over each head, not the whole row: the row-wise answer differs
    flat = reference.rms_norm(x.reshape(3, -1), np.tile(w, 4), 1e-6).reshape(x.shape)
    assert not np.allclose(exp, flat, atol=0.1)
    layers.rms_norm(x, w, x, eps=1e-6, host=host)
    np.testing.assert_array_equal(x.view(np.uint8), out.view(np.uint8))


@pytest.mark.parametrize("host", [False, True])
def test_rms_norm_out_interleaved_with_x(host):
    # x and out: alternate heads of one buffer, disjoint though their spans meet
    rng = np.random.default_rng(9)
    buf = _rand(rng, (3, 4, 8), "f32")
    x, out = buf[:, 0::2], buf[:, 1::2]
    x0 = x.copy()
    w = _rand(rng, (8,), "f32")
    layers.rms_norm(x, w, out, host=host)
    np.testing.assert_array_equal(x, x0)
    assert_close(out, reference.rms_norm(x0, w, 1e-6), "f32")


@pytest.mark.parametrize("host", [False, True])
def test_strided_view_errors(host):
    f32 = np.float32
    w = np.ones(4, f32)
    cos = sin = np.zeros((4, 2), f32)
    pos = np.zeros(2, np.uint32)
    every_other = np.zeros((2, 3, 8), f32)[..., ::2]  # [2, 3, 4], last dim 2 elements apart
    with pytest.raises(PagedAttentionError, match=r"x: expected a contiguous innermost dim"):
        layers.rope(every_other, pos, cos, sin, host=host)
    with pytest.raises(PagedAttentionError, match=r"x: expected a contiguous innermost dim"):
        layers.rms_norm(every_other, w, np.zeros((2, 3, 4), f32), host=host)
    with pytest.raises(PagedAttentionError, match=r"out: expected a contiguous innermost dim"):
        layers.rms_norm(np.zeros((2, 3, 4), f32), w, every_other, host=host)
    with pytest.raises(PagedAttentionError, match=r"x: expected non-negative strides"):
        layers.rope(np.zeros((2, 3, 4), f32)[::-1], pos, cos, sin, host=host)
    rows_overlap = np.lib.stride_tricks.as_strided(np.zeros(16, f32), (3, 4), (8, 4))  # rows 2 elements apart
    with pytest.raises(PagedAttentionError, match=r"x: expected rows that do not overlap"):
        layers.rms_norm(rows_overlap, w, np.zeros((3, 4), f32), host=host)
    far = np.lib.stride_tricks.as_strided(np.zeros(4, f32), (2, 4), (4 << 32, 4))  # rows 2^32 elements apart
    with pytest.raises(PagedAttentionError, match=r"x: expected outer strides of at most 4294967295 elements"):
        layers.rms_norm(far, w, np.zeros((2, 4), f32), host=host)
    with pytest.raises(PagedAttentionError, match=r"x: expected a 2-D or 3-D array, got shape \[1, 2, 3, 4\]"):
        layers.rms_norm(np.zeros((1, 2, 3, 4), f32), w, np.zeros((1, 2, 3, 4), f32), host=host)
    with pytest.raises(PagedAttentionError, match=r"weight: expected shape \[4\]"):
        layers.rms_norm(np.zeros((2, 3, 4), f32), np.ones(12, f32), np.zeros((2, 3, 4), f32), host=host)
    with pytest.raises(PagedAttentionError, match=r"x: expected at most 65535 heads"):
        layers.rms_norm(np.zeros((1, 65536, 1), f32), np.ones(1, f32), np.zeros((1, 65536, 1), f32), host=host)
    # out overlapping x without being x's very view: contiguous (one row shifted) and strided (a head shifted)
    buf = np.full(20, np.nan, f32)
    with pytest.raises(PagedAttentionError, match="out: expected memory disjoint from x"):
        layers.rms_norm(buf[:16].reshape(4, 4), w, buf[4:].reshape(4, 4), host=host)
    heads = np.full((2, 3, 4), np.nan, f32)
    with pytest.raises(PagedAttentionError, match=r"out: expected memory disjoint from x \(or x itself"):
        layers.rms_norm(heads[:, :2], w, heads[:, 1:], host=host)
    assert np.isnan(buf).all() and np.isnan(heads).all()  # raised before any launch
