"""cupaged.DecodeBatch: continuous batching on stable buffers, one graph per
batch bucket, stop tokens and length limits on the device, tokens read back
every k launches. Checked on the tiny decoder against each sequence decoded
alone, step by step, eagerly (tokens and every K/V byte equal), plus the
membership rules, no recapture, no device allocation on the hot paths and
every misuse (which changes nothing)."""

import numpy as np
import pytest

import cupaged
from cupaged import DecodeBatch, PagedAttentionError, argmax_into
from cupaged._runtime import arrays as runtime_arrays
from cupaged.demo import tiny

CFG = tiny.TinyConfig(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=48, max_pos=256)
PROMPTS = [
    [5, 17, 3, 88, 40, 2, 9],
    [1, 2, 3],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71],
    [9, 9, 9, 9],
    [33, 21, 8, 90, 4, 4],
]
PAGE = 4


@pytest.fixture(scope="module")
def weights():
    return tiny.rounded(tiny.init_weights(CFG, seed=3), np.float32)


def rows(cache, seq, n=None):
    """K and V of seq's first n (default: length) tokens, every layer."""
    n = seq.length if n is None else n
    t = np.arange(n)
    pages = np.asarray(seq.pages, np.int64)[t // cache.page_size]
    return cache.k[:, pages, t % cache.page_size].copy(), cache.v[:, pages, t % cache.page_size].copy()


class Engine:
    """A tiny model, its cache and the step a DecodeBatch captures."""

    def __init__(self, weights, num_pages=60, max_batch=4, prefix_cache=False, **kw):
        like = np.zeros(1, np.float32)
        self.model = tiny.TinyModel(
            CFG, weights, like, dtype=np.float32, num_pages=num_pages, page_size=PAGE, max_rows=32
        )
        if prefix_cache:
            c = self.model.cache
            self.model.cache = cupaged.PagedKVCache(
                num_pages, PAGE, c.kv_heads, c.head_dim, np.float32, layers=c.layers, like=like, prefix_cache=True
            )
        self.cache = self.model.cache
        self.tok = np.zeros(max_batch, np.int64)
        self.nxt = np.zeros(max_batch, np.int64)
        self.logits = np.zeros((32, CFG.vocab), np.float32)
        self.best = np.zeros(32, np.int64)
        self.steps = 0

        def step(plan):
            self.steps += 1
            self.model.forward(plan, self.tok, self.logits)
            return self.logits[: plan.sequences]

        self.batch = DecodeBatch(self.cache, step, token_buf=self.tok, next_token=self.nxt, max_batch=max_batch, **kw)

    def prefill(self, prompt):
        """A prefilled sequence and its first token (a 1-element device array)."""
        s = self.cache.add_sequence(tokens=prompt)
        plan, _ = self.cache.prepare([s], [len(prompt)])
        self.model.forward(plan, np.asarray(prompt, np.int64), self.logits)
        argmax_into(self.logits[: len(prompt)], self.best[: len(prompt)])
        return s, self.best[len(prompt) - 1 : len(prompt)].copy()


def eager(weights, prompt, n, stop=()):
    """Decode ``prompt`` alone, one prepare + forward per token: (tokens, K, V
    of the written tokens)."""
    m = tiny.TinyModel(
        CFG, weights, np.zeros(1, np.float32), dtype=np.float32, num_pages=60, page_size=PAGE, max_rows=32
    )
    c = m.cache
    logits = np.zeros((32, CFG.vocab), np.float32)
    best = np.zeros(32, np.int64)
    s = c.add_sequence()
    plan, _ = c.prepare([s], [len(prompt)])
    m.forward(plan, np.asarray(prompt, np.int64), logits)
    argmax_into(logits[: len(prompt)], best[: len(prompt)])
    out = [int(best[len(prompt) - 1])]
    tok = np.zeros(1, np.int64)
    while len(out) < n and out[-1] not in stop:
        tok[0] = out[-1]
        plan, _ = c.prepare([s], 1)
        m.forward(plan, tok, logits)
        argmax_into(logits[:1], best[:1])
        out.append(int(best[0]))
    k, v = rows(c, s)
    return out, k, v


def test_changing_membership_equals_each_sequence_decoded_alone(weights):
    """Sequences join every few launches (the first token from the device or
    from the host), finish by length limit at different times, the batch
    grows through buckets 1, 2, 4 and shrinks again; each sequence's tokens
    and K/V bytes equal an eager decode of it alone."""
    limits = [7, 12, 9, 10, 8]  # generated tokens per prompt
    e = Engine(weights, max_len=40, readback_every=3)
    got, seqs, order = {}, {}, list(range(len(PROMPTS)))
    captures0 = cupaged.capture_count()
    buckets_seen = set()
    while order or e.batch.members:
        if order and len(e.batch.members) < 4:
            i = order.pop(0)
            s, first = e.prefill(PROMPTS[i])
            seqs[s] = i
            e.batch.join(s, first if i % 2 else int(first[0]), max_len=len(PROMPTS[i]) + limits[i])
            got[i] = [] if i % 2 else [int(first[0])]
        for _ in range(3):
            if any(not sl.done for sl in e.batch._slot if sl is not None):
                buckets_seen.add(e.batch.bucket)
                e.batch.advance()
        r = e.batch.readback()
        for s, toks in r.tokens.items():
            got[seqs[s]].extend(toks)
        for s, why in r.finished.items():
            assert why == "max_len" and s.length == len(PROMPTS[seqs[s]]) + limits[seqs[s]] - 1
            assert s._batch is None and s not in e.batch.members
            i = seqs[s]
            exp, k, v = eager(weights, PROMPTS[i], limits[i])
            assert got[i] == exp, (i, got[i], exp)
            gk, gv = rows(e.cache, s)
            np.testing.assert_array_equal(gk.view(np.uint8), k.view(np.uint8))
            np.testing.assert_array_equal(gv.view(np.uint8), v.view(np.uint8))
            e.cache.free(s)
    assert set(got) == set(range(len(PROMPTS)))
    assert buckets_seen == {1, 2, 4} and e.batch.captures == 3
    assert cupaged.capture_count() - captures0 == 3
    assert e.cache.num_free_pages == e.cache.num_pages


def test_stop_tokens_finish_on_the_device(weights):
    """A stop id ends a sequence inside the graph: it stops advancing (its
    length word padded), later launches leave its pages alone, and the host
    learns it at the readback, with its exact length; the other sequence
    goes on (and moves to slot 0, the bucket shrinking to 1)."""
    exp, _, _ = eager(weights, PROMPTS[1], 12)
    at = next(i for i in range(3, 12) if exp[i] not in exp[:i])
    stop = exp[at]  # first generated at decode step `at`
    for j in (0, 2, 3, 4):  # a sequence that does not meet the stop id
        exp0, _, _ = eager(weights, PROMPTS[j], at + 6)
        if stop not in exp0:
            break
    else:
        pytest.fail("no prompt avoids the stop token")
    e = Engine(weights, max_len=40, readback_every=12, stop_ids=[stop, 1000])
    s, first = e.prefill(PROMPTS[1])
    other, ofirst = e.prefill(PROMPTS[j])
    e.batch.join(s, int(first[0]))
    e.batch.join(other, ofirst)
    for _ in range(at + 2):
        e.batch.advance()
    assert s.length == len(PROMPTS[1]) + 1 + at + 2  # the host does not know yet
    snap = e.cache.k[:, list(s.pages)].copy()
    r = e.batch.readback()
    assert r.finished == {s: "stop"} and r.tokens[s] == exp[1 : at + 1] and r.finished_at == {s: at - 1}
    assert s.length == len(PROMPTS[1]) + at and s not in e.batch.members  # `at` decode steps wrote `at` tokens
    _, k, v = eager(weights, PROMPTS[1], at + 1)
    gk, gv = rows(e.cache, s)
    np.testing.assert_array_equal(gk.view(np.uint8), k.view(np.uint8))
    np.testing.assert_array_equal(gv.view(np.uint8), v.view(np.uint8))
    assert e.batch.bucket == 1 and e.batch.slot_of(other) == 0
    for _ in range(3):
        e.batch.advance()
    assert np.array_equal(e.cache.k[:, list(s.pages)], snap)  # nothing written for s since it stopped
    r2 = e.batch.readback()
    assert r.tokens[other][0] == exp0[0] and r.tokens[other][1:] + r2.tokens[other] == exp0[1:]


def test_graph_and_eager_batches_agree_and_replay_without_recapture(weights):
    runs = []
    for graph in (True, False):
        e = Engine(weights, max_len=30, readback_every=4, graph=graph)
        out = {}
        for i in (0, 2):
            s, first = e.prefill(PROMPTS[i])
            e.batch.join(s, first)
            out[s.id] = []
        for _ in range(3):
            for _ in range(4):
                e.batch.advance()
            for s, toks in e.batch.readback().tokens.items():
                out[s.id].extend(toks)
        runs.append((out, e.cache.k.copy(), e.batch.captures, e.steps))
    (g, gk, gcap, gsteps), (q, qk, qcap, qsteps) = runs
    assert g == q and np.array_equal(gk.view(np.uint8), qk.view(np.uint8))
    assert gcap == 1 and gsteps == 1 and qcap == 0 and qsteps == 12  # captured once, replayed 12 times


def test_hot_paths_allocate_nothing(weights, monkeypatch):
    """After the first launch of a bucket, join, advance and leave issue
    only stream work on existing buffers."""
    e = Engine(weights, max_len=30, readback_every=2)
    a, fa = e.prefill(PROMPTS[0])
    b, fb = e.prefill(PROMPTS[1])
    c, fc = e.prefill(PROMPTS[3])
    e.batch.join(a, fa)
    e.batch.join(b, fb)
    e.batch.advance()  # bucket 2 captured
    e.batch.readback()

    def refuse(*args, **kw):
        raise AssertionError("allocation on a hot path")

    monkeypatch.setattr(runtime_arrays, "_new", refuse)
    e.batch.leave(b)
    e.batch.join(c, fc)
    e.batch.advance()
    e.batch.advance()
    monkeypatch.undo()
    assert set(e.batch.readback().tokens) == {a, c}


def test_misuse_raises_and_changes_nothing(weights):
    e = Engine(weights, num_pages=8, max_len=24, readback_every=5, max_batch=2)
    a, fa = e.prefill(PROMPTS[0])  # 7 tokens: 2 pages
    b, fb = e.prefill(PROMPTS[2])  # 12 tokens: 3 pages
    with pytest.raises(PagedAttentionError, match="advance: no sequence to decode"):
        e.batch.advance()
    with pytest.raises(PagedAttentionError, match=r"step: expected a callable step\(plan\)"):
        DecodeBatch(e.cache, None, token_buf=e.tok, next_token=e.nxt, max_batch=2, max_len=24)
    with pytest.raises(PagedAttentionError, match=r"token_buf: expected shape \[4\], got \[2\]"):
        DecodeBatch(e.cache, print, token_buf=e.tok, next_token=e.nxt, max_batch=4, max_len=24)
    with pytest.raises(PagedAttentionError, match=r"buckets: expected batch sizes in 1..2 ending at max_batch"):
        DecodeBatch(e.cache, print, token_buf=e.tok, next_token=e.nxt, max_batch=2, max_len=24, buckets=[1])
    with pytest.raises(PagedAttentionError, match="stop_ids: expected an integer array"):
        DecodeBatch(e.cache, print, token_buf=e.tok, next_token=e.nxt, max_batch=2, max_len=24, stop_ids=[0.5])
    e.batch.join(a, fa)
    with pytest.raises(PagedAttentionError, match="seq: sequence 0 is already in a DecodeBatch"):
        e.batch.join(a, fa)
    for call, msg in [
        (lambda: e.cache.free(a), "seq: sequence 0 sits in a DecodeBatch slot"),
        (lambda: e.cache.fork(a), "seq: sequence 0 sits in a DecodeBatch slot"),
        (lambda: e.cache.prepare([a], 1), r"seqs\[0\]: sequence 0 sits in a DecodeBatch slot"),
        (lambda: e.cache.reserve([a], 1), r"seqs\[0\]: sequence 0 sits in a DecodeBatch slot"),
        (lambda: e.batch.join(b, fb, max_len=13), "max_len: sequence 1 holds 12 tokens"),
        (lambda: e.batch.join(b, 1.5), "token: expected an int or a 1-element int64 array"),
        (lambda: e.batch.leave(b), "seq: sequence 1 is not in this batch"),
    ]:
        snap = (e.cache.k.copy(), list(e.cache._free), [s.length for s in (a, b)], e.batch.bucket)
        with pytest.raises(PagedAttentionError, match=msg):
            call()
        assert np.array_equal(snap[0], e.cache.k) and snap[1:] == (
            list(e.cache._free),
            [a.length, b.length],
            e.batch.bucket,
        )
    # out of pages on join: b needs 2 more pages for its next 5 steps, 1 is free
    words = e.batch.plan(2).words.copy()
    with pytest.raises(PagedAttentionError, match="reserve: out of pages"):
        e.batch.join(b, fb)
    assert b._batch is None and b.length == 12 and e.batch.bucket == 1
    assert np.array_equal(words, e.batch.plan(2).words)
    e.batch.advance()
    with pytest.raises(PagedAttentionError, match=r"leave: the batch ran since its last readback\(\)"):
        e.batch.leave(a)
    for _ in range(4):
        e.batch.advance()
    with pytest.raises(PagedAttentionError, match=r"advance: 5 launches since the last readback fill the token ring"):
        e.batch.advance()
    e.batch.readback()
    n = a.length
    e.batch.leave(a)
    assert a.length == n - 1 and a._batch is None and e.batch.members == ()
    e.cache.free(a)  # allowed now
    e.batch.join(b, fb)
    e.batch.advance()
    assert e.batch.readback().tokens[b]


def test_sequence_batch_names_the_batch_that_holds_it(weights):
    """``seq.batch``: None until ``join``, the joined batch (not another one
    of the same cache) while in a slot, None again after ``leave``, after
    finishing at a readback, and after a join that raised; read-only."""
    e = Engine(weights, max_len=40, readback_every=2)
    tok2, nxt2 = np.zeros(4, np.int64), np.zeros(4, np.int64)

    def step2(plan):
        e.model.forward(plan, tok2, e.logits)
        return e.logits[: plan.sequences]

    other = DecodeBatch(e.cache, step2, token_buf=tok2, next_token=nxt2, max_batch=4, max_len=40, readback_every=2)
    a, fa = e.prefill(PROMPTS[0])
    b, fb = e.prefill(PROMPTS[1])
    c, fc = e.prefill(PROMPTS[3])
    assert (a.batch, b.batch, c.batch) == (None, None, None)
    with pytest.raises(PagedAttentionError, match="max_len: sequence 0 holds 7 tokens"):
        e.batch.join(a, fa, max_len=8)
    assert a.batch is None
    e.batch.join(a, fa)
    e.batch.join(b, int(fb[0]), max_len=len(PROMPTS[1]) + 2)  # finishes by its limit
    other.join(c, fc)
    assert a.batch is e.batch and b.batch is e.batch and c.batch is other
    with pytest.raises(PagedAttentionError, match="already in a DecodeBatch"):
        other.join(a, fa)
    assert a.batch is e.batch and a not in other.members
    with pytest.raises(AttributeError):
        a.batch = None
    assert a.batch is e.batch
    e.batch.advance()
    e.batch.advance()
    r = e.batch.readback()
    assert r.finished == {b: "max_len"} and b.batch is None and a.batch is e.batch
    e.batch.leave(a)
    assert a.batch is None and c.batch is other
    child = e.cache.fork(a)
    assert child.batch is None
    other.advance()
    other.readback()
    other.leave(c)
    assert c.batch is None
    for s in (a, b, c, child):
        e.cache.free(s)  # none is held by a batch
    assert e.cache.num_free_pages == e.cache.num_pages


def test_exhaustion_during_advance_launches_nothing(weights):
    """A slot whose next step needs a page when none is free: advance raises
    before any stream work; after a readback the engine preempts one."""
    e = Engine(weights, num_pages=8, max_len=40, readback_every=2)
    a, fa = e.prefill(PROMPTS[0])  # 7 tokens
    b, fb = e.prefill(PROMPTS[1])  # 3 tokens
    e.batch.join(a, fa)
    e.batch.join(b, fb)
    launched = 0
    while True:
        try:
            before = (e.cache.k.copy(), e.batch.launches, [a.length, b.length], list(e.cache._free))
            e.batch.advance()
            launched += 1
        except PagedAttentionError as err:
            assert "reserve: out of pages" in str(err)
            assert np.array_equal(before[0], e.cache.k) and before[1:] == (
                e.batch.launches,
                [a.length, b.length],
                list(e.cache._free),
            )
            break
        if e.batch.launches - e.batch._read_at == 2:
            e.batch.readback()
    assert launched > 5
    e.batch.readback()
    e.batch.leave(b)
    e.cache.free(b)
    e.batch.advance()  # a goes on with b's pages
    assert e.batch.readback().tokens[a]


# --------------------------------------------------------------------------- issue #19: nothing silent, round 3
def _batch_state(e):
    b = e.batch
    return (
        e.cache.k.copy(),
        list(e.cache._free),
        list(e.cache._refs),
        b.members,
        b.bucket,
        b.launches,
        b._read_at,
        [(s.length, s.pages, s.tokens, s._batch) for s in e.cache_seqs],
        e.nxt.copy(),
        b.plan().words.copy(),
    )


def _same_state(x, y):
    for u, v in zip(x, y):
        assert np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v


def test_join_checks_token_ids(weights):
    """An int token is a token id: >= 0, an int64, and below the vocab once
    the step ran (the batch learns it from the logits). 2**64 + 5 used to be
    accepted (token 5 fed, the huge id recorded, and with a prefix cache the
    next readback raised OverflowError while hashing, wedging the batch)."""
    e = Engine(weights, max_len=30, readback_every=4, prefix_cache=True)
    a, fa = e.prefill(PROMPTS[0])
    b, fb = e.prefill(PROMPTS[1])
    e.cache_seqs = [a, b]
    cases = [
        (2**64 + 5, rf"token: expected an int in 0..9223372036854775807, got {2**64 + 5}"),
        (-1, "token: expected an int in 0..9223372036854775807, got -1"),
        (np.int64(-7), "got -7"),
        (np.uint64(2**63), f"got {2**63}"),
    ]
    for token, msg in cases:
        snap = _batch_state(e)
        with pytest.raises(PagedAttentionError, match=msg):
            e.batch.join(a, token)
        _same_state(snap, _batch_state(e))
    assert e.batch.vocab is None
    e.batch.join(a, int(fa[0]))
    e.batch.advance()
    assert e.batch.vocab == CFG.vocab
    for token, msg in [(CFG.vocab, "token: expected an int in 0..95, got 96"), (2**64 + 5, "0..95, got")]:
        snap = _batch_state(e)
        with pytest.raises(PagedAttentionError, match=msg):
            e.batch.join(b, token)
        _same_state(snap, _batch_state(e))
    e.batch.join(b, int(fb[0]))
    for _ in range(3):
        e.batch.advance()
    r = e.batch.readback()
    assert r.tokens[a] == eager(weights, PROMPTS[0], 5)[0][1:] and r.tokens[b] == eager(weights, PROMPTS[1], 4)[0][1:]


def test_bucket_plans_are_range_checked_and_belong_to_the_batch_cache(weights):
    e = Engine(weights, max_len=30, readback_every=4)
    other = Engine(weights, max_len=30, readback_every=4)
    assert e.batch.plan(2).sequences == 2 and e.batch.plan().sequences == 1
    assert cupaged.batch.default_buckets(6) == (1, 2, 4, 6)
    for bad in (0, -3, 1025, 2.5):
        with pytest.raises(PagedAttentionError, match=f"max_batch: expected an int in 1..1024, got {bad}"):
            cupaged.batch.default_buckets(bad)
    for bad, msg in [
        (3, r"bucket: expected one of the batch's buckets \[1, 2, 4\], got 3"),
        (0, r"bucket: expected an int in 1..4, got 0"),
        (8, "got 8"),
        (2.0, "got 2.0"),
    ]:
        with pytest.raises(PagedAttentionError, match=msg):
            e.batch.plan(bad)
    new = np.zeros((1, CFG.kv_heads, CFG.head_dim), np.float32)
    with pytest.raises(PagedAttentionError, match="plan: expected a plan of this cache, got one of another"):
        other.cache.append(e.batch.plan(1), new, new)
    # a step that writes through the other cache is refused at its first launch
    e.batch._step = lambda plan: (other.cache.append(plan, new, new), e.logits[: plan.sequences])[1]
    a, fa = e.prefill(PROMPTS[0])
    e.batch.join(a, fa)
    with pytest.raises(PagedAttentionError, match="plan: expected a plan of this cache, got one of another"):
        e.batch.advance()
    assert not other.cache.k.any()


def _once(fn, exc, at=1):
    """``fn`` that raises ``exc`` on its ``at``-th call (1-based), once."""
    calls = [0]

    def wrapped(*args, **kw):
        calls[0] += 1
        if calls[0] == at:
            raise exc
        return fn(*args, **kw)

    return wrapped


@pytest.mark.parametrize("where", ["wrote", "index_hash", "read", "pack", "pad"])
def test_a_failing_readback_leaves_the_batch_usable(weights, monkeypatch, where):
    """Any exception inside readback() used to wedge the batch (every later
    advance said "call readback() first", or the next readback lost or
    misplaced tokens). A failure is injected once at each stage: while
    learning the tokens (the prefix index of the second slot, its hash, the
    device read) the batch is left as before and says so; while packing the
    slots after a sequence finished, the tokens are kept for the next
    readback and the packing is issued again. Either way the batch goes on,
    and every token and K/V byte equals each sequence decoded alone."""
    e = Engine(weights, max_len=40, readback_every=4, prefix_cache=True)
    b, fb = e.prefill(PROMPTS[1])
    a, fa = e.prefill(PROMPTS[0])
    e.cache_seqs = [b, a]
    e.batch.join(b, fb, max_len=len(PROMPTS[1]) + 3)  # slot 0: finishes in the first round
    e.batch.join(a, int(fa[0]))  # slot 1: moves to slot 0 then
    got = {a: [int(fa[0])], b: []}
    for _ in range(2):
        e.batch.advance()
    snap = _batch_state(e)
    boom = RuntimeError("injected")
    if where == "wrote":
        monkeypatch.setattr(e.cache, "_wrote", _once(e.cache._wrote, boom, at=2))
    elif where == "index_hash":
        monkeypatch.setattr(cupaged.cache, "page_key", _once(cupaged.cache.page_key, OverflowError("injected"), at=2))
    elif where == "read":
        monkeypatch.setattr(e.batch.stream, "read", _once(e.batch.stream.read, boom, at=2))
    elif where == "pack":
        monkeypatch.setattr(e.batch, "_write_slot", _once(e.batch._write_slot, boom))
    else:
        monkeypatch.setattr(e.batch, "_pad_slot", _once(e.batch._pad_slot, boom, at=2))
    with pytest.raises((RuntimeError, OverflowError), match="injected") as info:
        e.batch.readback()
    note = " ".join(getattr(info.value, "__notes__", []))
    if where in ("pack", "pad"):
        assert "the tokens were read and are kept" in note
        assert e.batch.members == (a,) and b._batch is None and b.length == len(PROMPTS[1]) + 2
    else:
        assert "nothing was learned and the batch is as it was" in note
        _same_state(snap, _batch_state(e))
    monkeypatch.undo()
    for _ in range(10):
        for _ in range(4 - (e.batch.launches - e.batch._read_at)):
            e.batch.advance()
        r = e.batch.readback()
        for s, toks in r.tokens.items():
            got[s].extend(toks)
        if len(got[a]) >= 12:
            break
    assert r.finished == {} and e.batch.members == (a,) and e.batch.slot_of(a) == 0 and e.batch.bucket == 1
    for s, prompt in ((a, PROMPTS[0]), (b, PROMPTS[1])):
        exp, k, v = eager(weights, prompt, len(got[s]))
        assert got[s] == exp, (where, s.id, got[s], exp)
        assert k.shape[1] == len(prompt) + len(exp) - 1  # written: the last token is fed next (a) / not written (b)
        gk, gv = rows(e.cache, s, k.shape[1])
        np.testing.assert_array_equal(gk.view(np.uint8), k.view(np.uint8))
        np.testing.assert_array_equal(gv.view(np.uint8), v.view(np.uint8))
    assert len(got[b]) == 3


def test_threads_join_while_another_thread_advances(weights):
    """Thread safety (docs/layout.md): every DecodeBatch method holds the
    cache's lock. A join from a second thread while the first thread is
    inside advance() (its step running) waits for the launch to end; it used
    to grow the bucket mid-launch, copying the running slot's words before
    the device advanced them, so that slot decoded one position wrong."""
    import threading

    e = Engine(weights, max_len=40, readback_every=4, graph=False)
    a, fa = e.prefill(PROMPTS[0])
    b, fb = e.prefill(PROMPTS[2])
    e.batch.join(a, int(fa[0]))
    inside, joined = threading.Event(), threading.Event()
    step, calls = e.batch._step, [0]

    def slow(plan):
        calls[0] += 1
        if calls[0] == 2:
            inside.set()
            joined.wait(0.5)
        return step(plan)

    e.batch._step = slow
    errors = []

    def joiner():
        inside.wait(10)
        try:
            e.batch.join(b, int(fb[0]))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
        joined.set()

    t = threading.Thread(target=joiner)
    t.start()
    got = {a: [int(fa[0])], b: [int(fb[0])]}
    for _ in range(6):
        for _ in range(4):
            e.batch.advance()
        for s, toks in e.batch.readback().tokens.items():
            got[s].extend(toks)
        t.join(0.01)
    t.join(10)
    assert not errors and not t.is_alive() and len(got[b]) > 4
    for s, prompt in ((a, PROMPTS[0]), (b, PROMPTS[2])):
        assert got[s] == eager(weights, prompt, len(got[s]))[0]


# ---------------------------------------------------------------- sampling (vocab=)


def sampled_run(weights, joins, limits, *, readback_every=3):
    """Decode with per-slot SamplingParams: ``joins`` = [(prompt index,
    params, round it joins)]; each round joins, then up to readback_every
    launches and a readback. Returns ({prompt index: tokens}, {prompt index:
    logprobs}, buckets seen, {prompt index: top logprob pairs})."""
    e = Engine(weights, max_len=40, readback_every=readback_every, vocab=CFG.vocab, max_logprobs=4)
    got, lps, seqs, pending, rnd, buckets = {}, {}, {}, list(joins), 0, set()
    tops: dict[int, list] = {}
    while pending or e.batch.members:
        for j in [j for j in pending if j[2] <= rnd]:
            i, params, _ = j
            pending.remove(j)
            s, first = e.prefill(PROMPTS[i])
            seqs[s] = i
            e.batch.join(s, int(first[0]), max_len=len(PROMPTS[i]) + limits[i], sampling=params)
            got[i], lps[i], tops[i] = [int(first[0])], [], []
        for _ in range(readback_every):
            if any(not sl.done for sl in e.batch._slot if sl is not None):
                buckets.add(e.batch.bucket)
                e.batch.advance()
        rb = e.batch.readback()
        for s, t in rb.tokens.items():
            got[seqs[s]].extend(t)
            lps[seqs[s]].extend(rb.logprobs.get(s, []))
            tops[seqs[s]].extend(rb.top_logprobs.get(s, []))
        rnd += 1
    return got, lps, buckets, tops


def test_sampled_tokens_do_not_depend_on_slot_bucket_or_neighbours(weights):
    from cupaged import SamplingParams

    params = [
        SamplingParams(temperature=1.3, seed=11, logprobs=3),
        SamplingParams(temperature=0.9, top_k=8, seed=12),
        SamplingParams(temperature=2.0, top_p=0.8, min_p=0.02, seed=13, logprobs=0),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, seed=14),
    ]
    limits = [9, 14, 6, 11]
    together, lp_together, buckets, top_together = sampled_run(
        weights, [(0, params[0], 0), (1, params[1], 0), (2, params[2], 1), (3, params[3], 2)], limits
    )
    assert 4 in buckets and 2 in buckets  # the batch grew to bucket 4 and (packing) shrank
    greedy = {i: eager(weights, PROMPTS[i], limits[i])[0] for i in range(4)}
    assert [len(p) for p in top_together[0]] == [3] * (limits[0] - 1) and top_together[2] == []
    for pairs, lp, tok in zip(top_together[0], lp_together[0], together[0][1:]):
        assert [v for _, v in pairs] == sorted((v for _, v in pairs), reverse=True)
        assert pairs[0][1] >= lp and (tok not in dict(pairs) or abs(dict(pairs)[tok] - lp) < 1e-6)
    for i in range(4):
        alone, lp_alone, b, top_alone = sampled_run(weights, [(i, params[i], 0)], limits)
        assert [[t for t, _ in p] for p in top_alone[i]] == [[t for t, _ in p] for p in top_together[i]]
        assert b == {1}
        assert together[i] == alone[i], i
        assert len(together[i]) == limits[i]
        np.testing.assert_allclose(lp_together[i], lp_alone[i], atol=1e-6)
        # the first token came from the host (not in the readbacks): a logprob per decoded token
        assert len(lp_together[i]) == (len(together[i]) - 1 if params[i].logprobs is not None else 0)
        assert np.all(np.asarray(lp_together[i]) <= 0) and np.isfinite(lp_together[i]).all()
        assert together[i] != greedy[i], i  # it sampled


def test_vocab_batch_greedy_equals_argmax_batch(weights):
    from cupaged import SamplingParams

    limits = [7, 10, 5, 8]
    got, _, _, _ = sampled_run(weights, [(i, SamplingParams.greedy(), i % 2) for i in range(4)], limits)
    for i in range(4):
        assert got[i] == eager(weights, PROMPTS[i], limits[i])[0]


def test_sampling_join_errors(weights):
    from cupaged import SamplingParams

    e = Engine(weights, max_len=40)
    s, first = e.prefill(PROMPTS[0])
    with pytest.raises(PagedAttentionError, match="sampling: this DecodeBatch takes the argmax"):
        e.batch.join(s, first, sampling=SamplingParams(temperature=1.0))
    with pytest.raises(PagedAttentionError, match="sampling: expected a SamplingParams or None, got dict"):
        e.batch.join(s, first, sampling={"temperature": 1.0})
    assert e.batch.members == ()
    e.batch.join(s, first, sampling=SamplingParams.greedy())  # greedy on an argmax batch is fine
    e2 = Engine(weights, max_len=40, vocab=CFG.vocab)
    s2, first2 = e2.prefill(PROMPTS[1])
    with pytest.raises(PagedAttentionError, match="drawn_by: expected a device token"):
        e2.batch.join(s2, int(first2[0]), drawn_by=(e2.batch.sampler, 0))
    with pytest.raises(PagedAttentionError, match="drawn_by: expected \\(SamplerState"):
        e2.batch.join(s2, first2, drawn_by=("x", 0))
    assert e2.batch.members == ()


def test_sampled_hot_paths_allocate_nothing(weights, monkeypatch):
    """With vocab= (the sampler in the graph): after a bucket's first launch,
    join (parameters and counts by stream-ordered copies), advance, leave
    (packing moves a slot's sampler state) allocate nothing on the device."""
    from cupaged import SamplingParams

    e = Engine(weights, max_len=30, readback_every=2, vocab=CFG.vocab)
    a, fa = e.prefill(PROMPTS[0])
    b, fb = e.prefill(PROMPTS[1])
    c, fc = e.prefill(PROMPTS[3])
    e.batch.join(a, fa, sampling=SamplingParams(temperature=1.0, seed=1))
    e.batch.join(b, fb, sampling=SamplingParams(temperature=0.5, top_p=0.9, seed=2))
    e.batch.advance()  # bucket 2 captured
    e.batch.readback()
    captures = e.batch.captures

    def refuse(*args, **kw):
        raise AssertionError("allocation on a hot path")

    monkeypatch.setattr(runtime_arrays, "_new", refuse)
    e.batch.leave(a)  # b moves from slot 1 to slot 0
    e.batch.join(c, fc, sampling=SamplingParams(temperature=1.5, top_k=5, seed=3, logprobs=0))
    e.batch.advance()
    e.batch.advance()
    monkeypatch.undo()
    assert set(e.batch.readback().tokens) == {b, c}
    assert e.batch.captures == captures  # new parameters, same graphs
