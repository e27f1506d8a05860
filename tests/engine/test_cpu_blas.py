"""The CPU backend's dense layers at BLAS speed: ``ops.layers``' ``host=True``
path (host code: BLAS, the few-row products and row-wise layers of
kernels_cu/host, issued into the CPU stream with ``host_call``)
against float64 NumPy references; the work is recorded into CPU graphs and
replayed (a replay follows new inputs and positions); rows stay independent
(an Inf / NaN row changes only its own outputs); float16 falls back to the
kernels; and the engine's decode graph holds only the attention, append and
sampling kernels, the rest host work."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError
from cupaged._runtime import cpu as _cpu
from cupaged._runtime import host_products, stream_for
from cupaged.graph import capture_graph
from cupaged.ops import layers
from cupaged.testing import write_random_checkpoint

F32 = np.float32
LIKE = np.zeros(1, F32)
RTOL = 2e-5  # float32 against float64: summation order and one rounding per op


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(F32)


def _close(got, want, tol=RTOL):
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def test_embed_gathers_rows_and_zeroes_tokens_outside_the_vocab():
    rng = np.random.default_rng(0)
    table = _rand(rng, 11, 6)
    tokens = np.array([3, 0, 10, -1, 11, 7], np.int64)
    out = np.full((6, 6), np.nan, F32)
    layers.embed(tokens, table, out, host=True)
    want = np.array([table[t] if 0 <= t < 11 else np.zeros(6) for t in tokens], np.float64)
    np.testing.assert_array_equal(out, want.astype(F32))


@pytest.mark.parametrize("in_place", [False, True])
def test_rms_norm(in_place):
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 5, 48) * 3, _rand(rng, 48)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5) * w.astype(np.float64)
    out = x if in_place else np.zeros_like(x)
    layers.rms_norm(x, w, out, 1e-5, host=True)
    _close(out, want)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m,n", [(1, 24), (7, 24), (2, 300), (8, 300), (9, 300), (1, 300), (33, 40)])
def test_linear(accumulate, m, n):
    # up to MAX_ROWS (32) rows: the host products (K 40: vectors and a tail of K % lanes); 33: BLAS
    rng = np.random.default_rng(2)
    x, w, out = _rand(rng, m, 40), _rand(rng, n, 40), _rand(rng, m, n)
    want = x.astype(np.float64) @ w.astype(np.float64).T + (out.astype(np.float64) if accumulate else 0)
    layers.linear(x, w, out, accumulate=accumulate, host=True)
    _close(out, want)


@pytest.mark.parametrize("m", [3, 8, 16])
def test_linear_at_a_large_k(m):
    # K 1536 (a down projection), N 200 (groups of J weight rows and a remainder)
    rng = np.random.default_rng(5)
    x, w, out = _rand(rng, m, 1536), _rand(rng, 200, 1536), _rand(rng, m, 200)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    layers.linear(x, w, out, host=True)
    _close(out, want, 1e-4)


@pytest.mark.parametrize("parts", [1, 2])
def test_host_products_give_each_row_the_same_bits_in_any_batch(parts):
    # out[r] depends on row r of x alone: the same bits for a row alone, in batches of 2 .. 32 rows (blocks of 8 and
    # every remainder), and split over the pool's threads; CUPAGED_BLAS_ONE_THREAD_ROWS is the suite's, so the
    # split is asked of host_products itself
    rng = np.random.default_rng(14)
    k, n = 200, 77
    w, x = _rand(rng, n, k), _rand(rng, 32, k)
    alone = np.empty((32, n), F32)
    for r in range(32):
        host_products.product(x[r : r + 1], w, alone[r : r + 1], False, 1)()
    for m in (2, 3, 5, 7, 8, 9, 13, 16, 32):
        out = np.empty((m, n), F32)
        host_products.product(x[:m], w, out, False, parts)()
        assert np.array_equal(out, alone[:m]), m
    _close(alone, x.astype(np.float64) @ w.astype(np.float64).T, 1e-4)


def test_host_products_split_over_the_pool_threads(monkeypatch):
    monkeypatch.setattr(_cpu, "blas_one_thread_rows", lambda: 0)
    if _cpu.configured_workers() < 2:
        pytest.skip("one CPU worker configured: products stay on one thread")
    rng = np.random.default_rng(12)
    x, w = _rand(rng, 4, 96), _rand(rng, 600, 96)
    out = _rand(rng, 4, 600)
    want = x.astype(np.float64) @ w.astype(np.float64).T + out.astype(np.float64)
    rt = _cpu.runtime()
    before = rt.cupaged_rt_thread_wakes()
    layers.linear(x, w, out, accumulate=True, host=True)
    stream_for(x).synchronize()
    _close(out, want)
    assert rt.cupaged_rt_thread_wakes() == before + 1  # one job of the pool's threads


@pytest.mark.parametrize("accumulate", [False, True])
def test_linear_heads(accumulate):
    rng = np.random.default_rng(3)
    x, w, out = _rand(rng, 4, 3, 16), _rand(rng, 3, 10, 16), _rand(rng, 4, 3, 10)
    want = np.einsum("mhk,hnk->mhn", x.astype(np.float64), w.astype(np.float64))
    want += out.astype(np.float64) if accumulate else 0
    layers.linear_heads(x, w, out, accumulate=accumulate, host=True)
    _close(out, want)


def test_bias_add_and_silu_mul():
    rng = np.random.default_rng(4)
    gu, b = _rand(rng, 3, 20) * 4, _rand(rng, 20)
    want_b = gu.astype(np.float64) + b
    layers.bias_add(gu, b, host=True)
    _close(gu, want_b)
    g, u = want_b[:, :10], want_b[:, 10:]
    out = np.zeros((3, 10), F32)
    layers.silu_mul(gu, out, host=True)
    _close(out, g / (1 + np.exp(-g)) * u)


@pytest.mark.parametrize("stride", [1, 3])
def test_rope_reads_positions_with_stride_and_clamps(stride):
    rng = np.random.default_rng(5)
    rows, heads, dim, max_pos = 4, 3, 8, 6
    x = _rand(rng, rows, heads, dim)
    cos, sin = _rand(rng, max_pos, dim // 2), _rand(rng, max_pos, dim // 2)
    pos = [2, 0, 5, 9]  # 9: past the table, clamped to its last row
    words = np.full(rows * stride, 77, np.uint32)
    words[::stride] = pos
    p = np.minimum(pos, max_pos - 1)
    c, s = cos[p][:, None].astype(np.float64), sin[p][:, None].astype(np.float64)
    a, b = x[..., : dim // 2].astype(np.float64), x[..., dim // 2 :].astype(np.float64)
    want = np.concatenate([a * c - b * s, b * c + a * s], -1)
    layers.rope(x, words, cos, sin, position_stride=stride, host=True)
    _close(x, want)


@pytest.mark.parametrize("rows,width", [(1, 16), (3, 37), (300, 576), (130, 1536)])
def test_row_layers_give_each_row_the_same_bits_in_any_batch(rows, width):
    # kernels_cu/host/layers.cpp: whole vectors and a row tail (37), a prefill's rows (300) and SwiGLU's width
    # (1536): against float64, and every row's bits as when it runs alone
    rng = np.random.default_rng(9)
    x, w = _rand(rng, rows, width) * 3, _rand(rng, width)
    gu = _rand(rng, rows, 2 * width) * 6
    gu[0, :4] = [-100, 100, 0, -90]  # exp's clamps and exact cases
    y = _rand(rng, rows, 3, 2 * width)
    cos, sin = _rand(rng, 50, width), _rand(rng, 50, width)
    pos = rng.integers(0, 60, rows).astype(np.uint32)  # some past the table
    x64, g, u, y64 = x.astype(np.float64), gu[:, :width].astype(np.float64), gu[:, width:], y.astype(np.float64)
    p = np.minimum(pos, 49)
    c, s = cos[p][:, None].astype(np.float64), sin[p][:, None].astype(np.float64)
    a, b = y64[..., :width], y64[..., width:]

    def run(lo, hi):
        norm, silu, rot = np.zeros((hi - lo, width), F32), np.zeros((hi - lo, width), F32), y[lo:hi].copy()
        layers.rms_norm(x[lo:hi], w, norm, 1e-6, host=True)
        layers.silu_mul(gu[lo:hi], silu, host=True)
        layers.rope(rot, pos[lo:hi], cos, sin, host=True)
        return norm, silu, rot

    norm, silu, rot = run(0, rows)
    _close(norm, x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-6) * w)
    np.testing.assert_allclose(silu, g / (1 + np.exp(-g)) * u, rtol=RTOL, atol=1e-30)
    _close(rot, np.concatenate([a * c - b * s, b * c + a * s], -1))
    for r in {0, rows // 2, rows - 1}:
        for whole, alone in zip((norm, silu, rot), run(r, r + 1)):
            np.testing.assert_array_equal(whole[r : r + 1], alone)


def test_a_row_of_inf_and_nan_changes_only_its_own_outputs():
    rng = np.random.default_rng(6)
    x, w = _rand(rng, 4, 32), _rand(rng, 16, 32)
    x[2, 0], x[2, 5] = np.inf, np.nan
    out, h = np.zeros((4, 16), F32), np.zeros((4, 32), F32)
    layers.rms_norm(x, np.ones(32, F32), h, host=True)
    layers.linear(h, w, out, host=True)
    keep = [0, 1, 3]
    assert np.isfinite(out[keep]).all() and np.isfinite(h[keep]).all()
    xk = x[keep].astype(np.float64)
    hk = xk / np.sqrt((xk**2).mean(1, keepdims=True) + 1e-6)
    _close(out[keep], hk @ w.astype(np.float64).T)


def test_host_work_is_recorded_into_a_cpu_graph_and_replayed():
    rng = np.random.default_rng(7)
    x, w, out = _rand(rng, 2, 12), _rand(rng, 5, 12), np.zeros((2, 5), F32)
    y = np.zeros((2, 2, 4), F32)
    cos, sin = _rand(rng, 8, 2), _rand(rng, 8, 2)
    pos = np.array([1, 3], np.uint32)
    with capture_graph(LIKE) as g:
        layers.linear(x, w, out, host=True)
        layers.rope(y, pos, cos, sin, host=True)
    assert not out.any(), "captured host work ran at capture"
    for step in range(2):
        x[:] = _rand(rng, 2, 12)
        y[:] = _rand(rng, 2, 2, 4)
        pos[:] = [step + 4, 2 * step]
        y64 = y.astype(np.float64)
        g.launch()
        _close(out, x.astype(np.float64) @ w.astype(np.float64).T)
        c, s = cos[pos][:, None], sin[pos][:, None]
        a, b = y64[..., :2], y64[..., 2:]
        _close(y, np.concatenate([a * c - b * s, b * c + a * s], -1))
    assert g.graph is not None and g.graph.num_ops == 2
    assert not any(isinstance(op, _cpu.BoundLaunch) for op in g.graph._ops)


def test_host_call_refuses_a_non_callable():
    with pytest.raises(PagedAttentionError, match="fn: expected a callable fn"):
        stream_for(LIKE).host_call(3)


def test_float16_runs_the_kernel():
    rng = np.random.default_rng(8)
    x, w = _rand(rng, 3, 32).astype(np.float16), _rand(rng, 8, 32).astype(np.float16)
    out = np.zeros((3, 8), np.float16)
    with capture_graph(LIKE) as g:
        layers.linear(x, w, out, host=True)
    assert g.graph is not None and isinstance(g.graph._ops[0], _cpu.BoundLaunch)
    g.launch()
    _close(out, x.astype(np.float64) @ w.astype(np.float64).T, tol=2e-3)


def test_the_engine_decode_graph_keeps_only_attention_append_and_sampling_kernels(tmp_path):
    folder = write_random_checkpoint(tmp_path, "LlamaForCausalLM", eos_token_id=None)
    engine = cupaged.Engine.from_pretrained(folder, like=LIKE, dtype="float32", max_batch=2, prefill_chunk=16)
    engine.generate([[5, 6, 7], [8, 9]], 3, stop_token_ids=())
    batch = engine._batches[()]
    graph = batch._graphs[2].graph
    names = [op.function.name for op in graph._ops if isinstance(op, _cpu.BoundLaunch)]
    dense = {"embed", "rms_norm", "linear", "linear_heads", "bias_add", "rope", "silu_mul"}  # layers.cu's kernels
    assert not dense & set(names), names
    layers_ = engine.config.layers
    assert names.count("paged_attention") == names.count("paged_append") == layers_, names
    # the rest: the step's sampling and slot-advance kernels, one each
    assert len(names) == 2 * layers_ + 2, names


class _FakeBlas:
    """An OpenBLAS stand-in recording what settle_blas_spin calls and the
    timeout variable it sees while reading the environment."""

    def __init__(self):
        self.calls = []

    def openblas_read_env(self):
        import os

        self.calls.append(("read_env", os.environ.get("OPENBLAS_THREAD_TIMEOUT")))

    def blas_thread_shutdown_(self):
        self.calls.append(("shutdown", None))


def test_settle_blas_spin_reads_the_shorter_timeout_once_and_leaves_the_environment(monkeypatch):
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.delenv("GOTO_THREAD_TIMEOUT", raising=False)
    monkeypatch.setattr(_cpu, "_spin_settled", False)
    fake = _FakeBlas()
    assert _cpu.settle_blas_spin(fake)
    assert fake.calls == [("read_env", str(_cpu.BLAS_SPIN_LOG2)), ("shutdown", None)]
    import os

    assert "OPENBLAS_THREAD_TIMEOUT" not in os.environ
    assert not _cpu.settle_blas_spin(fake)  # once per process
    assert len(fake.calls) == 2


@pytest.mark.parametrize("variable", ["OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"])
def test_settle_blas_spin_keeps_a_timeout_the_user_set(monkeypatch, variable):
    monkeypatch.setenv(variable, "26")
    monkeypatch.setattr(_cpu, "_spin_settled", False)
    fake = _FakeBlas()
    assert not _cpu.settle_blas_spin(fake)
    assert fake.calls == []


def test_settle_blas_spin_without_openblas_changes_nothing(monkeypatch):
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.delenv("GOTO_THREAD_TIMEOUT", raising=False)
    monkeypatch.setattr(_cpu, "_spin_settled", False)
    assert not _cpu.settle_blas_spin(object())  # another BLAS: no such functions


def test_host_products_leave_no_blas_thread_spinning():
    # After a threaded product, OpenBLAS's idle threads spin 2**28 cycles (~0.1 s of a core) by default; the
    # first host product settles that to 2**BLAS_SPIN_LOG2 (~0.35 ms). Idle CPU time after a product says which.
    import os
    import time

    if _cpu._openblas() is None or (os.cpu_count() or 1) < 2:
        pytest.skip("needs NumPy's OpenBLAS and two CPUs (the spin is of OpenBLAS's own threads)")
    if any(os.environ.get(v, "").strip() for v in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")):
        pytest.skip("the environment sets OpenBLAS's timeout itself")
    rng = np.random.default_rng(9)
    x, w = _rand(rng, 256, 576), _rand(rng, 1536, 576)  # 256 rows: BLAS's own threads (conftest: one thread <= 32)
    out = np.zeros((256, 1536), F32)
    layers.linear(x, w, out, host=True)
    stream_for(x).synchronize()
    _close(out, x.astype(np.float64) @ w.astype(np.float64).T, 1e-4)
    idle = []
    for _ in range(3):
        np.matmul(x, w.T)  # threaded, on this thread: its helper thread then idles
        t0 = time.process_time()
        time.sleep(0.15)
        idle.append(time.process_time() - t0)
    assert min(idle) < 0.03, f"CPU time while idle after a product: {idle} s (OpenBLAS threads still spinning)"
