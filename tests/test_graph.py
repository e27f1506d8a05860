"""CUDA-graph decode on the CPU backend (the same tests run on a GPU):
graph replays == eager loop == float64 reference model; cache equality;
stable buffers; misuse errors."""

import gc

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError, argmax_into
from cupaged.demo import tiny
from cupaged.graph import DecodeLoop, DeviceScalars, PagedDecodeLoop, capture_graph, seed_tokens
from cupaged.layout import metadata_offsets
from cupaged.plan import HostPlan
from cupaged.testing import reference

CFG = tiny.TinyConfig(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=48, max_pos=256)
PROMPTS = [[5, 17, 3, 88, 40, 2, 9], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]


def _model(xp_like, w):
    return tiny.TinyModel(CFG, w, xp_like, dtype=np.float32, num_pages=40, page_size=4, max_rows=32)


@pytest.fixture(scope="module")
def weights():
    return tiny.rounded(tiny.init_weights(CFG, seed=3), np.float32)


def test_graph_tokens_equal_eager_and_reference(weights):
    like = np.zeros(1, np.float32)
    m_graph, m_eager = _model(like, weights), _model(like, weights)
    t_graph, loop = tiny.generate(m_graph, PROMPTS, 9, chunk=5, graph=True)
    t_eager, _ = tiny.generate(m_eager, PROMPTS, 9, chunk=5, graph=False)
    assert loop.graph is not None and loop.graph.graph.num_ops > 10
    np.testing.assert_array_equal(t_graph, t_eager)
    exact, ok = tiny.check_tokens(CFG, weights, PROMPTS, t_graph)
    assert ok, f"tokens {t_graph} disagree with the float64 reference"
    assert exact >= t_graph.size - 1
    # the caches the graph wrote equal the eager ones, bit for bit (every layer: one array each)
    np.testing.assert_array_equal(m_graph.cache.k, m_eager.cache.k)
    np.testing.assert_array_equal(m_graph.cache.v, m_eager.cache.v)


def test_generate_twice_on_one_model(weights):
    """A second tiny.generate on the same model finishes the first one's
    loop (its spare step never ran) before freeing its sequences, and gives
    the same tokens again."""
    m = _model(np.zeros(1, np.float32), weights)
    first, loop = tiny.generate(m, PROMPTS, 5, chunk=5, graph=False)
    again, _ = tiny.generate(m, PROMPTS, 5, chunk=5, graph=False)
    np.testing.assert_array_equal(first, again)
    assert all(not s.alive for s in loop.seqs)


def test_device_scalars_update_with_memsets():
    like = np.zeros(1, np.float32)
    sc = DeviceScalars(7, like)
    assert sc.seq_len_k.tolist() == [7] and sc.write_pos.tolist() == [7]
    addr = sc.buffer.ctypes.data
    s = cupaged.stream_for(like)
    s.begin_capture()
    sc.update(11)  # captured: runs on replay
    g = s.end_capture()
    assert sc.write_pos.tolist() == [7]
    g.launch()
    assert sc.write_pos.tolist() == [11] and sc.seq_len_k.tolist() == [12]
    assert sc.buffer.ctypes.data == addr
    with pytest.raises(PagedAttentionError, match="initial_seq_len"):
        DeviceScalars(-1, like)


def test_device_scalars_alias_plan_words():
    like = np.zeros(1, np.float32)
    plan = HostPlan.build([[0, 1], [2, 3]], [3, 5], [1, 1], 4, 4).upload(like)
    sc = DeviceScalars.of_plan(plan, 1)
    sc.update(6)
    off = metadata_offsets(2, 2)
    assert plan.words[off["kv_len"] + 1] == 7 and plan.words[off["q_pos"] + 1] == 6
    assert plan.words[off["kv_len"]] == 3 and plan.words[off["q_pos"]] == 2


def test_seed_tokens_writes_both_halves():
    buf = np.zeros(3, np.int64)
    seed_tokens(buf, [5, 2**63 - 1, 2**40 + 3])
    assert buf.tolist() == [5, 2**63 - 1, 2**40 + 3]


def test_replay_survives_dropped_references_and_new_allocations(weights):
    like = np.zeros(1, np.float32)
    m = _model(like, weights)
    ref_tokens, _ = tiny.generate(_model(like, weights), PROMPTS[:2], 6, chunk=4, graph=False)

    junk = []

    def churn(i):  # allocate and free arrays between replays; collect garbage
        junk.append(np.random.default_rng(i).standard_normal((256, 64)))
        if len(junk) > 3:
            junk.pop(0)
        gc.collect()

    tokens, loop = tiny.generate(m, PROMPTS[:2], 6, chunk=4, graph=True, on_step=churn)
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_allocation_inside_capture_is_rejected():
    like = np.zeros(1, np.float32)
    plan = HostPlan.build([[0]], [2], [1], 4, 1).upload(like)
    q = np.zeros((1, 2, 8), np.float32)
    k = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(PagedAttentionError, match="out: allocation inside graph capture"):
        with capture_graph(like):
            plan.attention(q, k, k, 0.3)
    with pytest.raises(PagedAttentionError, match="plan.upload: allocation inside graph capture"):
        with capture_graph(like):
            HostPlan.build([[0]], [2], [1], 4, 1).upload(like)
    with pytest.raises(PagedAttentionError, match="SplitWorkspace: allocation inside graph capture"):
        with capture_graph(like):
            cupaged.SplitWorkspace(1, 2, 8, 2, like)
    # the stream is usable again after a failed capture
    assert not cupaged.stream_for(like).capturing
    with capture_graph(like) as g:
        pass
    g.launch()


def test_decode_loop_misuse():
    like = np.zeros(1, np.float32)
    plan = HostPlan.build([[0, 1]], [3], [2], 4, 2).upload(like)
    with pytest.raises(PagedAttentionError, match="plan: expected one query per sequence"):
        PagedDecodeLoop(lambda p: None, plan, token_buf=np.zeros(1, np.int64), next_token=np.zeros(1, np.int64))
    plan = HostPlan.build([[0, 1]], [3], [1], 4, 2).upload(like)
    with pytest.raises(PagedAttentionError, match="token_buf: expected a contiguous int64"):
        PagedDecodeLoop(lambda p: None, plan, token_buf=np.zeros(1, np.int32), next_token=np.zeros(1, np.int64))
    with pytest.raises(PagedAttentionError, match=r"next_token: expected shape \[1\]"):
        PagedDecodeLoop(lambda p: None, plan, token_buf=np.zeros(1, np.int64), next_token=np.zeros(2, np.int64))


def test_decode_loop_with_rope_slices(weights):
    """The single-sequence helper: scalars + RoPE slices copied per step."""
    like = np.zeros(1, np.float32)
    cos, sin = (t.astype(np.float32) for t in tiny.rope_tables(CFG))
    cos_sl, sin_sl = np.zeros((1, cos.shape[1]), np.float32), np.zeros((1, sin.shape[1]), np.float32)
    sc = DeviceScalars(0, like)
    token_buf, next_token = np.zeros(1, np.int64), np.zeros(1, np.int64)
    logits = np.zeros((1, 4), np.float32)
    seen = []

    def step():
        # a toy step made of stream work: logits[0, :2] = cos/sin slice row
        s = cupaged.stream_for(like)
        s.copy(logits, cos_sl, nbytes=4)
        s.copy(logits, sin_sl, nbytes=4, dst_offset=4)
        return logits

    loop = DecodeLoop(
        step,
        token_buf=token_buf,
        next_token=next_token,
        scalars=sc,
        seq_len=5,
        rope_tables=(cos, sin),
        rope_slices=(cos_sl, sin_sl),
    )
    loop.seed(3)
    for _ in range(3):
        loop.advance()
        seen.append((float(logits[0, 0]), float(logits[0, 1]), int(sc.write_pos[0]), int(sc.seq_len_k[0])))
    assert [s[2:] for s in seen] == [(5, 6), (6, 7), (7, 8)]
    assert [s[0] for s in seen] == [float(cos[p, 0]) for p in (5, 6, 7)]
    assert next_token.tolist() == [int(np.argmax(logits[0]))]


def test_decode_loop_past_its_rope_table_changes_nothing():
    """advance() past the RoPE table raises before any stream work: the
    token buffer, the device scalars and the host count stay as they were."""
    like = np.zeros(1, np.float32)
    cos = np.arange(6, dtype=np.float32).reshape(3, 2)
    sin = -cos
    slices = (np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32))
    sc = DeviceScalars(0, like)
    token_buf, next_token = np.zeros(1, np.int64), np.array([9], np.int64)
    logits = np.zeros((1, 4), np.float32)
    loop = DecodeLoop(
        lambda: logits,
        token_buf=token_buf,
        next_token=next_token,
        scalars=sc,
        seq_len=2,
        rope_tables=(cos, sin),
        rope_slices=slices,
        graph=False,
    )
    loop.advance()  # position 2: the table's last row
    assert slices[0].tolist() == [[4.0, 5.0]] and loop.seq_len == 3
    token_buf[0] = 5  # anything the failed call would overwrite
    before = (token_buf.copy(), sc.buffer.copy(), slices[0].copy(), next_token.copy())
    with pytest.raises(PagedAttentionError, match=r"seq_len: position 3 is past the RoPE table \(3 rows\)"):
        loop.advance()
    for a, b in zip(before, (token_buf, sc.buffer, slices[0], next_token)):
        np.testing.assert_array_equal(a, b)
    assert loop.seq_len == 3


def test_padded_entries_are_safe_in_a_paged_decode_graph():
    """active=False entries: length word 0 on the device, so their attention
    output is 0, their append is skipped (their page stays untouched) and
    they never advance; the active entry matches the reference every step."""
    like = np.zeros(1, np.float32)
    rng = np.random.default_rng(11)
    ps, hq, hkv, d = 4, 2, 1, 8
    k = rng.standard_normal((4, ps, hkv, d)).astype(np.float32)
    v = rng.standard_normal((4, ps, hkv, d)).astype(np.float32)
    table = np.array([[0, 1], [2, 3]])
    plan = HostPlan.build(table, [3, 1], [1, 1], ps, 4).upload(like)
    new_k = rng.standard_normal((2, hkv, d)).astype(np.float32)
    new_v = rng.standard_normal((2, hkv, d)).astype(np.float32)
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    out = np.zeros((2, hq, d), np.float32)
    logits = np.zeros((2, 3), np.float32)

    def step(p):
        p.append(new_k, new_v, k, v)
        p.attention(q, k, v, 0.5, True, out=out)
        return logits

    pages_before = k[2:].copy(), v[2:].copy()
    loop = PagedDecodeLoop(
        step, plan, token_buf=np.zeros(2, np.int64), next_token=np.zeros(2, np.int64), active=[True, False]
    )
    k_ref, v_ref = k.copy(), v.copy()
    for i in range(4):  # positions 2, 3, 4, 5 of sequence 0
        loop.advance()
        pos = 2 + i
        k_ref[table[0, pos // ps], pos % ps] = new_k[0]
        v_ref[table[0, pos // ps], pos % ps] = new_v[0]
        exp, _ = reference.paged_attention(q[:1], k_ref, v_ref, table[:1], [pos + 1], [1], 0.5, True)
        np.testing.assert_allclose(out[:1], exp, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(k[2:], pages_before[0])
    np.testing.assert_array_equal(v[2:], pages_before[1])
    assert loop.steps_left == 8 - 7 + 1  # lengths 7 now: positions 6 and 7 remain


@pytest.mark.parametrize(
    "table, kv, steps, why",
    [
        ([[0, 1], [2, 1]], [3, 3], 2, "page 1 .*is held twice"),  # a reserved page shared by two rows
        ([[0, -1]], [3], 2, "sequence 0's page-table column 1 holds no page"),
        ([[0, 0]], [3], 0, "page 0 .*is held twice"),  # one page at two columns
        ([[0, 1], [0, 2]], [3, 3], None, "queries 0 and 1 .* both write page 0 offset 2"),  # a shared last page
    ],
)
def test_paged_decode_loop_stops_before_a_write_that_is_not_its_own(table, kv, steps, why):
    """A decode loop whose reserved columns hold no page, or a page another
    sequence holds, stops before the step that would write there: that
    advance raises and writes nothing (two sequences' tokens never share a
    slot, and no token goes nowhere)."""
    like = np.zeros(1, np.float32)
    rng = np.random.default_rng(2)
    table = np.array(table)
    n = len(kv)
    k = rng.standard_normal((3, 4, 1, 8)).astype(np.float32)
    v = rng.standard_normal((3, 4, 1, 8)).astype(np.float32)
    plan = HostPlan.build(table, kv, [1] * n, 4, 3).upload(like)
    new = np.ones((n, 1, 8), np.float32)
    logits = np.zeros((n, 3), np.float32)

    def step(p):
        p.append(new, new, k, v)
        return logits

    if steps is None:  # the first step's writes already collide: the capture of its append refuses
        with pytest.raises(PagedAttentionError, match=why):
            PagedDecodeLoop(step, plan, token_buf=np.zeros(n, np.int64), next_token=np.zeros(n, np.int64))
        return
    loop = PagedDecodeLoop(step, plan, token_buf=np.zeros(n, np.int64), next_token=np.zeros(n, np.int64))
    assert loop.steps_left == steps
    for _ in range(steps):
        loop.advance()
    before = k.copy(), v.copy(), plan.words.copy()
    with pytest.raises(PagedAttentionError, match=why):
        loop.advance()
    for a, b in zip(before, (k, v, plan.words)):
        np.testing.assert_array_equal(a, b)


def test_graph_keeps_buffers_alive_after_user_references_are_dropped():
    import weakref

    like = np.zeros(1, np.float32)
    logits = np.zeros((2, 5), np.float32)
    logits[0, 3] = 1.0
    logits[1, 1] = 2.0
    out = np.zeros(2, np.int64)
    with capture_graph(like) as g:
        cupaged.argmax_into(logits, out)
    alive = weakref.ref(logits)
    view = logits[:]  # still reaches the same memory
    del logits
    gc.collect()
    assert alive() is not None  # the graph holds it
    view[0, :] = [0, 0, 0, 0, 9]
    junk = [np.ones((64, 64)) for _ in range(8)]  # noqa: F841
    g.launch()
    assert out.tolist() == [4, 1]


def test_arrays_of_another_backend_or_device_are_rejected_in_capture():
    class FakeCupy:  # looks like a CuPy array to the backend check
        __module__ = "cupy._core.core"
        data = None

        class device:
            id = 0

    like = np.zeros(1, np.float32)
    out = np.zeros(2, np.int64)
    with pytest.raises(PagedAttentionError, match="NumPy array .* got a CuPy array"):
        with capture_graph(like):
            cupaged.stream_for(like).copy(out, FakeCupy())
    with pytest.raises(PagedAttentionError, match="got a CuPy array"):
        with capture_graph(like):
            cupaged.argmax_into(np.zeros((2, 4), np.float32), FakeCupy())
    assert not cupaged.stream_for(like).capturing


def test_mla_model_graph_equals_eager_and_non_absorbed_reference():
    """The MLA variant: latent + rotary caches through append, absorbed
    attention through DevicePlan.mla, against a float64 model that
    up-projects keys and values for every token (no absorption)."""
    cfg = tiny.TinyConfig(
        vocab=96,
        hidden=32,
        layers=2,
        heads=4,
        ffn=48,
        max_pos=256,
        mla=True,
        latent_dim=24,
        rope_dim=6,
        nope_dim=8,
        v_head_dim=10,
    )
    w = tiny.rounded(tiny.init_weights(cfg, seed=5), np.float32)
    like = np.zeros(1, np.float32)

    def model():
        return tiny.TinyModel(cfg, w, like, dtype=np.float32, num_pages=40, page_size=4, max_rows=32)

    m_graph, m_eager = model(), model()
    t_graph, _ = tiny.generate(m_graph, PROMPTS, 7, chunk=5, graph=True)
    t_eager, _ = tiny.generate(m_eager, PROMPTS, 7, chunk=5, graph=False)
    np.testing.assert_array_equal(t_graph, t_eager)
    exact, ok = tiny.check_tokens(cfg, w, PROMPTS, t_graph)
    assert ok and exact >= t_graph.size - 1, t_graph
    assert m_graph.cache.k.shape == (2, 40, 4, 1, 24) and m_graph.cache.v.shape == (2, 40, 4, 1, 6)
    np.testing.assert_array_equal(m_graph.cache.k, m_eager.cache.k)
    np.testing.assert_array_equal(m_graph.cache.v, m_eager.cache.v)


def _rows(cache, seq):
    t = np.arange(seq.length)
    pages = np.asarray(seq.pages, np.int64)[t // cache.page_size]
    return cache.k[:, pages, t % cache.page_size], cache.v[:, pages, t % cache.page_size]


def _prefill(m, seqs, prompts, logits, best, next_token):
    plan, _ = m.cache.prepare(seqs, [len(p) for p in prompts])
    m.forward(plan, np.concatenate([np.asarray(p, np.int64) for p in prompts]), logits)
    argmax_into(logits[: plan.queries], best[: plan.queries])
    ends = plan.host.q_lens.cumsum() - 1
    next_token[:] = best[ends]


@pytest.mark.parametrize("graph", [True, False])
def test_cache_driven_loop_follows_the_device_and_continues_like_eager(weights, graph):
    """prepare(seqs, 1, reserve=r) + PagedDecodeLoop(cache=...): as many steps
    as the pages hold (>= 1 + r); after every advance each seq.length equals
    its kv_len word on the device; a second round continues from there; the
    tokens and every K/V byte equal a step-by-step eager run."""
    like = np.zeros(1, np.float32)
    B = len(PROMPTS)
    runs = []
    for driven in (True, False):
        m = _model(like, weights)
        seqs = [m.cache.add_sequence() for _ in PROMPTS]
        logits, best = np.zeros((32, CFG.vocab), np.float32), np.zeros(32, np.int64)
        token_buf, next_token = np.zeros(B, np.int64), np.zeros(B, np.int64)
        _prefill(m, seqs, PROMPTS, logits, best, next_token)
        history = [next_token.copy()]
        if driven:
            for reserve in (5, 2):
                plan, _ = m.cache.prepare(seqs, 1, reserve=reserve)
                L = np.array([s.length for s in seqs]) - 1
                loop = PagedDecodeLoop(
                    lambda p: (m.forward(p, token_buf, logits), logits[:B])[1],
                    plan,
                    token_buf=token_buf,
                    next_token=next_token,
                    cache=m.cache,
                    seqs=seqs,
                    graph=graph,
                )
                steps = loop.steps_left
                assert steps == min(s.capacity - int(n) for s, n in zip(seqs, L)) and steps >= 1 + reserve
                kv = metadata_offsets(B, B)["kv_len"]
                for _ in range(steps):
                    loop.advance()
                    history.append(next_token.copy())
                    assert [s.length for s in seqs] == plan.words[kv : kv + B].tolist()
                assert [s.length for s in seqs] == (L + steps).tolist()
                with pytest.raises(PagedAttentionError, match="reserve more pages"):
                    loop.advance()
            n_steps = len(history) - 1
        else:
            for _ in range(n_steps):
                token_buf[:] = next_token
                plan, _ = m.cache.prepare(seqs, 1)
                m.forward(plan, token_buf, logits)
                argmax_into(logits[:B], next_token)
                history.append(next_token.copy())
        runs.append((np.array(history), [_rows(m.cache, s) for s in seqs], [s.length for s in seqs]))
    (h1, r1, l1), (h2, r2, l2) = runs
    np.testing.assert_array_equal(h1, h2)
    assert l1 == l2
    for (k1, v1), (k2, v2) in zip(r1, r2):
        np.testing.assert_array_equal(k1.view(np.uint8), k2.view(np.uint8))
        np.testing.assert_array_equal(v1.view(np.uint8), v2.view(np.uint8))


def test_cache_driven_loop_misuse_and_finish(weights):
    like = np.zeros(1, np.float32)
    m = _model(like, weights)
    seqs = [m.cache.add_sequence() for _ in PROMPTS[:2]]
    logits, best = np.zeros((32, CFG.vocab), np.float32), np.zeros(32, np.int64)
    token_buf, next_token = np.zeros(2, np.int64), np.zeros(2, np.int64)
    _prefill(m, seqs, PROMPTS[:2], logits, best, next_token)

    def step(p):
        m.forward(p, token_buf, logits)
        return logits[:2]

    plan, _ = m.cache.prepare(seqs, 1, reserve=6)
    with pytest.raises(PagedAttentionError, match=r"seqs: expected the plan's sequences \(plan.seqs\), in row order"):
        PagedDecodeLoop(step, plan, token_buf=token_buf, next_token=next_token, cache=m.cache, seqs=seqs[::-1])
    with pytest.raises(PagedAttentionError, match="active: a loop driven by a cache decodes every sequence"):
        PagedDecodeLoop(step, plan, token_buf=token_buf, next_token=next_token, cache=m.cache, active=[1, 0])
    hand = HostPlan.build(plan.host.page_table, plan.host.kv_lens, [1, 1], 4, 40).upload(like)
    with pytest.raises(PagedAttentionError, match="plan: expected a plan made by cache.prepare of the given cache"):
        PagedDecodeLoop(step, hand, token_buf=token_buf, next_token=next_token, cache=m.cache)
    loop = PagedDecodeLoop(step, plan, token_buf=token_buf, next_token=next_token, cache=m.cache)
    for _ in range(3):
        loop.advance()
    lengths = [s.length for s in seqs]
    loop.finish()  # the token prepared for step 4 is not written: lengths drop it
    assert [s.length for s in seqs] == [n - 1 for n in lengths] and loop.steps_left == 0
    with pytest.raises(PagedAttentionError, match="the loop was finished"):
        loop.advance()
    # a later prepare makes a loop stale: advance raises before issuing anything
    plan, _ = m.cache.prepare(seqs, 1, reserve=2)
    loop = PagedDecodeLoop(step, plan, token_buf=token_buf, next_token=next_token, cache=m.cache)
    loop.advance()
    other = m.cache.add_sequence()
    m.cache.prepare([other], 3)
    before = (plan.words.copy(), token_buf.copy(), [s.length for s in seqs])
    with pytest.raises(PagedAttentionError, match="plan: stale"):
        loop.advance()
    assert np.array_equal(before[0], plan.words) and np.array_equal(before[1], token_buf)
    assert before[2] == [s.length for s in seqs]


# --------------------------------------------------------------------------- issue #19: nothing silent, round 3
class _Driven:
    """Prefilled sequences of a tiny model and the buffers of their
    cache-driven decode loops; ``history`` collects each step's tokens."""

    def __init__(self, weights, prompts=PROMPTS[:2], num_pages=40):
        self.m = tiny.TinyModel(
            CFG, weights, np.zeros(1, np.float32), dtype=np.float32, num_pages=num_pages, page_size=4, max_rows=32
        )
        self.cache, self.B, self.prompts = self.m.cache, len(prompts), prompts
        self.seqs = [self.cache.add_sequence() for _ in prompts]
        self.logits, self.best = np.zeros((32, CFG.vocab), np.float32), np.zeros(32, np.int64)
        self.tok, self.nxt = np.zeros(self.B, np.int64), np.zeros(self.B, np.int64)
        _prefill(self.m, self.seqs, prompts, self.logits, self.best, self.nxt)
        self.history = [self.nxt.copy()]

    def step(self, p):
        self.m.forward(p, self.tok, self.logits)
        return self.logits[: self.B]

    def loop(self, reserve, graph=True):
        plan, _ = self.cache.prepare(self.seqs, 1, reserve=reserve)
        return plan, PagedDecodeLoop(
            self.step, plan, token_buf=self.tok, next_token=self.nxt, cache=self.cache, graph=graph
        )

    def advance(self, loop, n):
        for _ in range(n):
            loop.advance()
            self.history.append(self.nxt.copy())

    def eager(self, n):
        """n decode steps, one prepare + forward each."""
        for _ in range(n):
            self.tok[:] = self.nxt
            plan, _ = self.cache.prepare(self.seqs, 1)
            self.m.forward(plan, self.tok, self.logits)
            argmax_into(self.logits[: self.B], self.nxt)
            self.history.append(self.nxt.copy())

    def check_against(self, ref: "_Driven", weights):
        """Tokens, lengths and every K/V byte equal ``ref``'s (decoded
        eagerly), and the tokens agree with the float64 reference model."""
        got, exp = np.array(self.history).T, np.array(ref.history).T
        np.testing.assert_array_equal(got, exp)
        assert [s.length for s in self.seqs] == [s.length for s in ref.seqs]
        for a, b in zip(self.seqs, ref.seqs):
            for x, y in zip(_rows(self.cache, a), _rows(ref.cache, b)):
                np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
        exact, ok = tiny.check_tokens(CFG, weights, self.prompts, got)
        assert ok and exact >= got.size - 1, got


def _manager_state(d):
    c = d.cache
    return (c.k.copy(), list(c._free), list(c._refs), [(s.length, s.pages, s.alive) for s in d.seqs])


@pytest.mark.parametrize("graph", [True, False])
def test_touching_a_sequence_of_a_live_loop_raises_naming_finish(weights, graph):
    """A cache-driven loop left after 2 of its steps: its sequences' lengths
    count the step prepared next, so prepare / fork / free / reserve (and a
    DecodeBatch join) of them raise naming loop.finish(), changing nothing
    (they used to be accepted: the next prepare wrote one position further,
    attention then read an unwritten row). The loop goes on; after finish()
    the sequences continue exactly like an eager decode."""
    ref = _Driven(weights)
    ref.eager(7)
    d = _Driven(weights)
    plan, loop = d.loop(reserve=5, graph=graph)
    d.advance(loop, 2)
    a = d.seqs[0]
    batch = cupaged.DecodeBatch(
        d.cache, d.step, token_buf=np.zeros(2, np.int64), next_token=np.zeros(2, np.int64), max_batch=2, max_len=40
    )
    snap = _manager_state(d)
    for call, what in [
        (lambda: d.cache.prepare(d.seqs, 1), r"seqs\[0\]: .* before prepare or reserve"),
        (lambda: d.cache.prepare([d.seqs[1]], 1), r"seqs\[0\]: sequence 1 .* before prepare"),
        (lambda: d.cache.reserve([a], 4), r"seqs\[0\]: .* before prepare or reserve"),
        (lambda: d.cache.fork(a), "seq: .* before fork"),
        (lambda: d.cache.free(a), "seq: .* before free"),
        (lambda: batch.join(a, 3), "seq: .* before join"),
    ]:
        with pytest.raises(
            PagedAttentionError,
            match=r"sequence \d is driven by a live PagedDecodeLoop \(2 of \d+ "
            r"steps run\), and its length \d+ counts the step prepared "
            r"next.*call loop.finish\(\)",
        ):
            call()
        with pytest.raises(PagedAttentionError, match=what):
            call()
        for x, y in zip(snap, _manager_state(d)):
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
    assert batch.members == () and a._batch is None
    d.advance(loop, 1)  # the refused calls left the loop alone
    loop.finish()
    loop.finish()  # twice: nothing more
    assert [s.length for s in d.seqs] == [len(p) + 3 for p in PROMPTS[:2]]
    with pytest.raises(PagedAttentionError, match="the loop was finished"):
        loop.advance()
    d.eager(4)
    d.check_against(ref, weights)
    d.cache.free(a)  # free again


@pytest.mark.parametrize("graph", [True, False])
def test_a_dropped_loop_lets_its_sequences_go(weights, graph):
    """A loop garbage-collected without finish() finishes itself (reference
    counting alone: the loop is in no cycle), so its sequences are not
    wedged: their lengths drop the prepared step and eager decoding continues
    exactly like a decode that never had the loop."""
    ref = _Driven(weights)
    ref.eager(6)
    d = _Driven(weights)

    def partial():
        _, loop = d.loop(reserve=4, graph=graph)
        d.advance(loop, 2)

    gc.collect()
    gc.disable()
    try:
        partial()
        assert [s.length for s in d.seqs] == [len(p) + 2 for p in PROMPTS[:2]]
        d.eager(4)
    finally:
        gc.enable()
    d.check_against(ref, weights)


def test_a_stale_loop_can_still_finish_and_its_plan_goes_stale(weights):
    """A prepare of another sequence makes a live loop stale; finish() still
    ends it (it used to raise "stale", wedging the sequences). A loop that
    ended before its last step leaves its plan stale (its device lengths
    count the dropped step); a plan a loop drove cannot drive another loop."""
    ref = _Driven(weights)
    ref.eager(7)
    d = _Driven(weights)
    plan, loop = d.loop(reserve=5)
    d.advance(loop, 3)
    other = d.cache.add_sequence()
    d.cache.prepare([other], 3)
    with pytest.raises(PagedAttentionError, match="plan: stale"):
        loop.advance()
    loop.finish()
    assert [s.length for s in d.seqs] == [len(p) + 3 for p in PROMPTS[:2]]
    d.cache.free(other)
    nk = np.zeros((2, CFG.kv_heads, CFG.head_dim), np.float32)
    for call in (
        lambda: d.cache.append(plan, nk, nk),
        lambda: plan.append(nk, nk, d.cache.k[0], d.cache.v[0]),
        lambda: PagedDecodeLoop(d.step, plan, token_buf=d.tok, next_token=d.nxt, cache=d.cache),
    ):
        with pytest.raises(
            PagedAttentionError,
            match=r"plan: stale: its PagedDecodeLoop was finished after 3 of "
            r"\d+ steps",
        ):
            call()
    d.eager(4)
    d.check_against(ref, weights)
    # a loop that ran every step: the sequences are free at once, its plan drives no second loop
    plan, loop = d.loop(reserve=1)
    with pytest.raises(PagedAttentionError, match="plan: a PagedDecodeLoop already drove this plan"):
        PagedDecodeLoop(d.step, plan, token_buf=d.tok, next_token=d.nxt, cache=d.cache)
    d.advance(loop, loop.steps_left)
    with pytest.raises(PagedAttentionError, match="plan: a PagedDecodeLoop already drove this plan"):
        PagedDecodeLoop(d.step, plan, token_buf=d.tok, next_token=d.nxt, cache=d.cache)
    d.cache.fork(d.seqs[0])


def test_a_loop_refuses_a_plan_of_another_cache(weights):
    """PagedDecodeLoop(cache=, plan=): the plan must be that cache's
    prepare's (a draft and a target cache of one shape share page ids)."""
    d, e = _Driven(weights), _Driven(weights)
    plan, _ = d.cache.prepare(d.seqs, 1, reserve=2)
    e_state = _manager_state(e)
    with pytest.raises(
        PagedAttentionError,
        match="plan: expected a plan made by cache.prepare of the given cache, got one of another PagedKVCache",
    ):
        PagedDecodeLoop(d.step, plan, token_buf=d.tok, next_token=d.nxt, cache=e.cache)
    batch = cupaged.DecodeBatch(
        d.cache, d.step, token_buf=np.zeros(2, np.int64), next_token=np.zeros(2, np.int64), max_batch=2, max_len=40
    )
    with pytest.raises(PagedAttentionError, match="got a DecodeBatch's slot plan"):
        PagedDecodeLoop(d.step, batch.plan(2), token_buf=d.tok, next_token=d.nxt, cache=d.cache)
    with pytest.raises(PagedAttentionError, match="cache: expected a PagedKVCache"):
        PagedDecodeLoop(d.step, plan, token_buf=d.tok, next_token=d.nxt, cache=object())
    for x, y in zip(e_state, _manager_state(e)):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
    PagedDecodeLoop(d.step, plan, token_buf=d.tok, next_token=d.nxt, cache=d.cache).advance()  # its own cache


def test_seeds_and_scalars_are_checked_before_any_stream_work(weights):
    """seed_tokens / loop.seed take token ids >= 0 (below the vocab once the
    step ran); DeviceScalars.update an int. A bad value writes nothing (2**64
    + 5 used to be fed as token 5, -2 as 2**64 - 2)."""
    buf = np.full(2, 7, np.int64)
    for tokens, msg in [
        ([1, -2], r"tokens\[1\]: expected a token id in 0..9223372036854775807, got -2"),
        (
            [2**64 + 5, 1],
            rf"tokens\[0\]: expected a token id in 0..9223372036854775807, got "
            rf"{2**64 + 5}",
        ),
        ([1.5, 2], "tokens: expected an integer array, got dtype float64"),
        (np.array([3, -1]), r"tokens\[1\]: expected a token id .* got -1"),
    ]:
        with pytest.raises(PagedAttentionError, match=msg):
            seed_tokens(buf, tokens)
        assert buf.tolist() == [7, 7]
    with pytest.raises(PagedAttentionError, match=r"tokens\[0\]: expected a token id in 0..9, got 10"):
        seed_tokens(buf, [10, 0], vocab=10)
    seed_tokens(buf, np.array([9, 0]), vocab=10)
    assert buf.tolist() == [9, 0]
    d = _Driven(weights)
    _, loop = d.loop(reserve=2)
    assert loop.vocab == CFG.vocab
    before = d.nxt.copy()
    with pytest.raises(PagedAttentionError, match=r"tokens\[1\]: expected a token id in 0..95, got 96"):
        loop.seed([3, 96])
    assert np.array_equal(before, d.nxt)
    loop.seed([3, 95])
    assert d.nxt.tolist() == [3, 95]
    sc = DeviceScalars(4, np.zeros(1, np.float32))
    for bad in (5.5, True, -1, 2**31 - 1):
        with pytest.raises(PagedAttentionError, match="seq_len: expected an int in 0..2147483646"):
            sc.update(bad)
    assert sc.write_pos.tolist() == [4]


def test_paged_decode_loop_with_a_sampler(weights):
    """sampler=: greedy parameters give the argmax loop's tokens; seeded
    sampling gives the same tokens captured and eager, other tokens than
    greedy, and logprobs (the ring, by step) equal a float64 log-softmax of
    the logits the eager step read."""
    from cupaged import SamplingParams
    from cupaged.ops.sample import SamplerState

    like = np.zeros(1, np.float32)
    B = len(PROMPTS)

    def run(graph, params):
        m = _model(like, weights)
        seqs = [m.cache.add_sequence() for _ in PROMPTS]
        logits, best = np.zeros((32, CFG.vocab), np.float32), np.zeros(32, np.int64)
        token_buf, next_token = np.zeros(B, np.int64), np.zeros(B, np.int64)
        _prefill(m, seqs, PROMPTS, logits, best, next_token)
        sampler = None
        if params is not None:
            sampler = SamplerState(like, B, CFG.vocab, ring_rows=16)
            for r, p in enumerate(params):
                sampler.set(r, p.words(), context=PROMPTS[r])
        plan, _ = m.cache.prepare(seqs, 1, reserve=6)
        seen = []

        def step(p):
            m.forward(p, token_buf, logits)
            if not graph:
                seen.append(logits[:B].copy())
            return logits[:B]

        loop = PagedDecodeLoop(
            step,
            plan,
            token_buf=token_buf,
            next_token=next_token,
            cache=m.cache,
            seqs=seqs,
            graph=graph,
            sampler=sampler,
        )
        hist = []
        for _ in range(loop.steps_left):
            loop.advance()
            hist.append(next_token.copy())
        loop.finish()
        lps = None if sampler is None else sampler.logprobs[: len(hist)].copy()
        return np.array(hist), lps, seen

    argmax, _, _ = run(True, None)
    greedy, _, _ = run(True, [SamplingParams.greedy()] * B)
    np.testing.assert_array_equal(greedy, argmax)
    params = [SamplingParams(temperature=1.5, seed=s, top_p=0.95, logprobs=0) for s in range(B)]
    g, g_lp, _ = run(True, params)
    e, e_lp, seen = run(False, params)
    np.testing.assert_array_equal(g, e)
    assert not np.array_equal(g, argmax)
    np.testing.assert_array_equal(g_lp, e_lp)
    for t, (toks, rows) in enumerate(zip(e, seen)):
        np.testing.assert_allclose(e_lp[t], reference.log_softmax_at(rows, toks), atol=2e-6)
    m = _model(like, weights)
    seqs = [m.cache.add_sequence() for _ in PROMPTS]
    m.cache.prepare(seqs, [len(p) for p in PROMPTS])
    plan, _ = m.cache.prepare(seqs, 1)
    with pytest.raises(PagedAttentionError, match="sampler: expected a SamplerState or None, got str"):
        PagedDecodeLoop(
            lambda p: None, plan, token_buf=np.zeros(B, np.int64), next_token=np.zeros(B, np.int64), sampler="x"
        )
