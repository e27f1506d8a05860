"""Decoder-step kernels (kernels_cu/layers.cu) on the CPU backend against
float64 NumPy references, all three dtypes, plus their input errors."""

import numpy as np
import pytest

from cupaged import PagedAttentionError
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
