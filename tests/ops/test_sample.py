"""sample_rows (kernels_cu/sample.cu) against the float64 references of
cupaged.testing.reference: the masks of min-p / top-k / top-p, frequencies of
many draws against the exact probabilities (chi-square), the exact tokens of
the Gumbel draw, penalties, temperature 0 == row_argmax, seeds that do not
depend on the batch, logprobs, counts and steps, capture and replay."""

import numpy as np
import pytest

from cupaged import stream_for
from cupaged.ops import sample as ops
from cupaged.ops.sampling import CPU_THREADS, argmax_into
from cupaged.testing import as_dtype, reference

#: Chi-square critical values at significance 1e-4 by degrees of freedom.
CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def words(logprobs=True, **kw):
    return ops.param_words(logprobs=logprobs, **kw)


def run(logits, params, *, context=None, generated=None, backend=None, steps=None):
    """Sample every row of host ``logits`` [B, V] once, row b with slot b's
    parameter words ``params[b]`` (and counts from ``context`` / ``generated``
    lists of token lists); returns (tokens, logprobs, state)."""
    xp = np if backend is None else backend.xp
    B, V = logits.shape
    dev = xp.asarray(logits)
    state = ops.SamplerState(dev, B, V)
    for b in range(B):
        w = params[b].copy()
        if steps is not None:
            w[ops.FIELD["step"]] = steps[b]
        state.set(
            b, w, context=[] if context is None else context[b], generated=[] if generated is None else generated[b]
        )
    out = xp.full(B, -7, np.int64)
    ops.sample_into(dev, state, out)
    stream_for(dev).synchronize()
    to = (lambda a: a) if backend is None else backend.to_numpy
    return to(out), to(state.first_logprobs), state


def test_temperature_zero_is_row_argmax_bit_for_bit(xp_backend):
    rng = np.random.default_rng(0)
    for dtype in ("f32", "f16", "bf16"):
        x = rng.integers(-3, 4, size=(12, 300)).astype(np.float64)
        x[rng.random(x.shape) < 0.03] = np.nan
        x[rng.random(x.shape) < 0.03] = np.inf
        x[rng.random(x.shape) < 0.03] = -0.0
        x[5] = -np.inf
        x = x.astype(as_dtype(dtype))
        got, _, _ = run(x, [words(seed=b) for b in range(12)], backend=xp_backend)
        want = np.full(12, -7, np.int64)
        argmax_into(x, want)
        stream_for(x).synchronize()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, reference.row_argmax(x))


def test_masks_exact_and_frequencies_chi_square():
    # One launch of 4000 rows: every row the same logits, its own seed; the
    # drawn tokens must be exactly the reference's kept set, with frequencies
    # matching the kept tokens' renormalised probabilities.
    V, B = 8, 4000
    base = np.array([2.0, 1.5, 1.4, 0.3, -0.2, 1.5, -1.0, 0.9], np.float32)
    cases = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=3),  # ties at the boundary: 1.5 twice -> keeps 0, 1, 5
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.3),
        dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.1),
    ]
    for case in cases:
        logits = np.tile(base, (B, 1))
        params = [words(seed=1000 + b, **case) for b in range(B)]
        got, lp, _ = run(logits, params)
        t = np.full(B, case["temperature"])
        mask = reference.sampling_mask(
            logits,
            t,
            np.full(B, case.get("top_k", 0)),
            np.full(B, case.get("top_p", 1.0)),
            np.full(B, case.get("min_p", 0.0)),
        )[0]
        drawn = np.bincount(got, minlength=V)
        assert set(np.nonzero(drawn)[0]) == set(np.nonzero(mask)[0]), case
        z = base.astype(np.float64) / case["temperature"]
        p = np.where(mask, np.exp(z - z.max()), 0.0)
        p /= p.sum()
        kept = np.nonzero(mask)[0]
        expect = B * p[kept]
        chi2 = float(((drawn[kept] - expect) ** 2 / expect).sum())
        assert chi2 < CHI2_1E4[len(kept) - 1], (case, chi2, drawn, expect)
        np.testing.assert_allclose(lp, reference.log_softmax_at(logits, got), rtol=0, atol=2e-6)


def test_tokens_match_reference_draw_and_masks_on_random_rows():
    rng = np.random.default_rng(5)
    B, V = 48, 1000
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    t = rng.uniform(0.3, 2.0, B)
    k = rng.choice([0, 1, 5, 40, 999, 2000], B)
    p = rng.choice([1.0, 0.9, 0.5, 0.05], B)
    mp = rng.choice([0.0, 0.01, 0.2], B)
    seeds = rng.integers(0, 2**63, B, dtype=np.uint64) * 2 + 1
    steps = rng.integers(0, 1 << 30, B)
    params = [words(temperature=t[b], top_k=k[b], top_p=p[b], min_p=mp[b], seed=int(seeds[b])) for b in range(B)]
    got, _, _ = run(logits, params, steps=steps)
    t32, p32, mp32 = (np.asarray(a, np.float32).astype(np.float64) for a in (t, p, mp))
    z32 = (logits.astype(np.float64) / t32[:, None]).astype(np.float32)  # the kernel's z
    mask = reference.sampling_mask(z32, np.ones(B), k, p32, mp32)
    assert mask[np.arange(B), got].all()
    want = reference.sample_gumbel(z32, mask, np.ones(B), seeds, steps)
    assert (got == want).mean() >= 0.97, np.nonzero(got != want)
    # top_k 1 is the argmax
    assert (got[k == 1] == logits[k == 1].argmax(axis=1)).all()


def test_penalties_match_reference():
    rng = np.random.default_rng(9)
    B, V = 6, 64
    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    context = [list(rng.choice(V, 10, replace=False)) for _ in range(B)]
    generated = [list(rng.choice(V, 12)) for _ in range(B)]
    rep = np.array([1.0, 1.3, 0.7, 1.0, 2.0, 1.2])
    pres = np.array([0.0, 0.0, 0.5, -0.5, 1.5, 2.0])
    freq = np.array([0.0, 0.0, 0.3, 1.0, -0.2, 2.0])
    params = [words(repetition=rep[b], presence=pres[b], frequency=freq[b]) for b in range(B)]
    ctx = np.zeros((B, V), bool)
    gen = np.zeros((B, V), np.int64)
    for b in range(B):
        ctx[b, context[b]] = True
        np.add.at(gen[b], generated[b], 1)
    r32 = [np.float32(v).astype(np.float64) for v in (rep, pres, freq)]
    pen = reference.apply_penalties(logits, ctx, gen, *r32)
    # greedy over penalised logits: the argmax of the reference's
    got, lp, state = run(logits, params, context=context, generated=generated)
    np.testing.assert_array_equal(got, pen.argmax(axis=1))
    np.testing.assert_allclose(lp, reference.log_softmax_at(logits, got), atol=2e-6)  # raw logprobs
    counts = state.counts.copy()
    gen[np.arange(B), got] += 1  # the draw counts itself
    np.testing.assert_array_equal(counts & 0x7FFFFFFF, gen)
    np.testing.assert_array_equal(counts >> 31, ctx)
    assert (state.params[:, ops.FIELD["step"]] == 1).all()


def test_penalised_draws_chi_square():
    # Penalties on every token of a small vocabulary, checked through the
    # frequencies of 3000 draws (one launch) against softmax(penalised).
    V, B = 8, 3000
    base = np.array([1.0, 0.5, 0.2, -0.3, 0.8, -1.0, 0.1, 0.4], np.float32)
    context, generated = [1, 3, 6], [0, 0, 4, 6, 6, 6]
    ctx = np.zeros((1, V), bool)
    ctx[0, context] = True
    gen = np.bincount(generated, minlength=V)[None]
    for rep, pres, freq in ((1.5, 0.0, 0.0), (0.8, 0.4, 0.3), (1.2, -0.5, 0.5)):
        params = [words(temperature=1.0, repetition=rep, presence=pres, frequency=freq, seed=b) for b in range(B)]
        got, _, _ = run(np.tile(base, (B, 1)), params, context=[context] * B, generated=[generated] * B)
        r32 = [np.array([np.float32(v)], np.float64) for v in (rep, pres, freq)]
        p = reference.softmax(reference.apply_penalties(base[None], ctx, gen, *r32))[0]
        drawn = np.bincount(got, minlength=V)
        chi2 = float(((drawn - B * p) ** 2 / (B * p)).sum())
        assert chi2 < CHI2_1E4[V - 1], (rep, pres, freq, chi2, drawn, B * p)


def test_same_seed_alone_in_a_batch_and_across_buckets():
    rng = np.random.default_rng(2)
    V = 500
    row = rng.standard_normal(V).astype(np.float32)
    p = words(temperature=1.0, top_p=0.9, seed=77)
    alone, _, _ = run(row[None], [p])
    for B in (3, 8):
        x = rng.standard_normal((B, V)).astype(np.float32)
        x[B - 1] = row
        params = [words(temperature=0.5 + b, seed=b) for b in range(B - 1)] + [p]
        got, _, _ = run(x, params)
        assert got[B - 1] == alone[0]
    # steps: the same seed draws differently at another step, the same at the same step
    draws = [run(row[None], [p], steps=[s])[0][0] for s in range(12)]
    assert len(set(draws)) > 1
    assert draws[3] == run(row[None], [p], steps=[3])[0][0]


def test_decode_ring_clock_rows_and_capture():
    rng = np.random.default_rng(4)
    B, V, R = 3, 40, 4
    state = ops.SamplerState(np.zeros(1, np.float32), 5, V, ring_rows=R)
    for s in range(5):
        state.set(s, words(temperature=1.0, seed=s))
    logits = np.zeros((B, V), np.float32)
    out = np.full(5, -7, np.int64)
    clock = np.zeros(1, np.uint32)
    rows = np.zeros(5, np.int32)
    rows[:B] = [4, 0, 2]
    stream = stream_for(logits)
    stream.begin_capture()
    try:
        ops.sample_into(logits, state, out, rows=rows, clock=clock)
    finally:
        graph = stream.end_capture()
    for trial in range(6):
        logits[...] = rng.standard_normal(logits.shape)
        clock[0] = trial
        graph.launch()
        stream.synchronize()
        assert out[[1, 3]].tolist() == [-7, -7]
        np.testing.assert_allclose(
            state.logprobs[trial % R, [4, 0, 2]], reference.log_softmax_at(logits, out[[4, 0, 2]]), atol=2e-6
        )
    assert state.params[[4, 0, 2], ops.FIELD["step"]].tolist() == [6, 6, 6]
    assert state.params[[1, 3], ops.FIELD["step"]].tolist() == [0, 0]
    assert (state.counts[[4, 0, 2]].sum(axis=1) == 6).all()
    state.move(1, 4)
    stream.synchronize()
    assert state.params[1, ops.FIELD["step"]] == 6 and (state.counts[1] == state.counts[4]).all()


def test_errors():
    from cupaged import PagedAttentionError

    st = ops.SamplerState(np.zeros(1, np.float32), 2, 8)
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(PagedAttentionError, match="logits: expected vocab 8"):
        ops.sample_into(np.zeros((2, 9), np.float32), st, np.zeros(2, np.int64))
    with pytest.raises(PagedAttentionError, match="logits: expected at most 2 rows"):
        ops.sample_into(np.zeros((3, 8), np.float32), st, np.zeros(3, np.int64))
    with pytest.raises(PagedAttentionError, match="out: expected a contiguous int64"):
        ops.sample_into(x, st, np.zeros(2, np.int32))
    with pytest.raises(PagedAttentionError, match="rows: expected a contiguous int32"):
        ops.sample_into(x, st, np.zeros(2, np.int64), rows=np.zeros(2, np.int64))
    with pytest.raises(PagedAttentionError, match="clock: expected a uint32"):
        ops.sample_into(x, st, np.zeros(2, np.int64), clock=np.zeros(1, np.int32))
    with pytest.raises(PagedAttentionError, match=r"context\[0\]: expected a token id in 0..7, got 8"):
        st.set(0, words(), context=[8])


@pytest.mark.parametrize("geometry", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_large_vocab_half_types_against_reference(dtype, geometry, monkeypatch):
    # vocab 32003 in f16 / bf16 (many ties after rounding): the drawn token
    # lies in the reference mask and is the reference's Gumbel draw; in the
    # CPU backend's geometry (one warp a row) and the GPU's (1024 threads:
    # the cross-warp reductions through shared memory)
    monkeypatch.setenv("CUPAGED_CPU_GEOMETRY", geometry)
    blocks = []
    real = ops.stream_for

    class Spy:
        def __init__(self, stream):
            self.stream = stream

        def __getattr__(self, name):
            return getattr(self.stream, name)

        def launch(self, kernel, grid, block, args, shared_mem=0, dependent=False):
            blocks.append(block[0])
            return self.stream.launch(kernel, grid, block, args, shared_mem=shared_mem, dependent=dependent)

    monkeypatch.setattr(ops, "stream_for", lambda a: Spy(real(a)))
    rng = np.random.default_rng(11)
    B, V = 4, 32003
    logits = (rng.standard_normal((B, V)) * 2).astype(as_dtype(dtype))
    t = np.array([0.7, 1.0, 1.5, 1.2])
    k, p, mp = np.array([0, 100, 0, 2000]), np.array([0.9, 1.0, 0.6, 0.95]), np.array([0.0, 0.0, 0.01, 0.05])
    seeds, steps = np.array([5, 6, 7, 2**63 + 9], np.uint64), np.array([0, 1, 2, 3])
    params = [words(temperature=t[b], top_k=k[b], top_p=p[b], min_p=mp[b], seed=int(seeds[b])) for b in range(B)]
    got, lp, _ = run(logits, params, steps=steps)
    t32 = np.asarray(t, np.float32).astype(np.float64)
    z32 = (logits.astype(np.float64) / t32[:, None]).astype(np.float32)
    mask = reference.sampling_mask(
        z32, np.ones(B), k, np.float32(p).astype(np.float64), np.float32(mp).astype(np.float64)
    )
    assert mask[np.arange(B), got].all()
    np.testing.assert_array_equal(got, reference.sample_gumbel(z32, mask, np.ones(B), seeds, steps))
    np.testing.assert_allclose(lp, reference.log_softmax_at(logits, got), atol=1e-5)
    assert blocks == [CPU_THREADS if geometry == "cpu" else 1024]


def test_rows_with_nan_or_inf_take_the_greedy_token():
    V = 50
    x = np.random.default_rng(1).standard_normal((4, V)).astype(np.float32)
    x[0, 7] = np.nan
    x[1, [3, 9]] = np.inf
    x[2, :] = -np.inf
    x[3, 20] = 1e30  # / temperature 1e-30: +inf
    params = [words(temperature=1.0, seed=1)] * 3 + [words(temperature=1e-30, seed=1)]
    got, _, _ = run(x, params)
    assert got.tolist() == [7, 3, 0, 20]


def test_logprobs_off_writes_nan():
    x = np.random.default_rng(2).standard_normal((2, 30)).astype(np.float32)
    got, lp, _ = run(x, [words(logprobs=False), words(temperature=1.0, seed=3, logprobs=False)])
    assert np.isnan(lp).all() and got[0] == x[0].argmax()


def test_top_logprobs_against_reference():
    rng = np.random.default_rng(8)
    B, V, N = 5, 300, 6
    x = rng.integers(-4, 5, size=(B, V)).astype(np.float32)  # many ties
    x[1, [7, 200]] = np.nan  # (logprobs NaN for row 1: only the ids are checked)
    x[2] = rng.standard_normal(V)
    dev = x.copy()
    state = ops.SamplerState(dev, B, V, ring_rows=3, max_logprobs=N)
    ns = [6, 6, 3, 0, 1]
    for b in range(B):
        state.set(b, words(temperature=1.0 if b % 2 else 0.0, seed=b, top_n=ns[b]))
    out = np.zeros(B, np.int64)
    clock = np.full(1, 4, np.uint32)
    ops.sample_into(dev, state, out, clock=clock)
    ops.sample_into(dev, state, out)  # clock None: the first_* buffers
    stream_for(dev).synchronize()
    ids, lps = reference.top_logprobs(x, N)
    for b in range(B):
        n = ns[b]
        for got_ids, got_lp in (
            (state.top_ids[4 % 3, b, :n], state.top_logprobs[4 % 3, b, :n]),
            (state.first_top_ids[b, :n], state.first_top_logprobs[b, :n]),
        ):
            np.testing.assert_array_equal(got_ids, ids[b, :n])
            if b != 1:
                np.testing.assert_allclose(got_lp, lps[b, :n], atol=2e-6)
    with pytest.raises(Exception, match="words: expected top_n <= 6"):
        state.set(0, words(top_n=7))


def test_rows_out_of_range_do_nothing():
    x = np.random.default_rng(3).standard_normal((3, 20)).astype(np.float32)
    state = ops.SamplerState(x, 3, 20)
    out = np.full(3, -7, np.int64)
    rows = np.array([1, -1, 3], np.int32)  # only row 0 names a slot
    ops.sample_into(x, state, out, rows=rows)
    stream_for(x).synchronize()
    assert out.tolist() == [-7, int(x[0].argmax()), -7]
    assert state.params[:, ops.FIELD["step"]].tolist() == [0, 1, 0]
