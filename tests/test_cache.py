"""cupaged.cache.PagedKVCache: pages, forks, copy-on-write, exhaustion, and a
long random schedule checked against a pure-Python model of every sequence's
tokens (and, when the attention kernels are present, attention over the
cache against reference.paged_attention)."""

import importlib.util
import zlib

import numpy as np
import pytest

import cupaged
import cupaged.layout
from cupaged import CompileError, HostPlan, PagedAttentionError, capture_graph, stream_for
from cupaged import cache as cache_mod
from cupaged.cache import PagedKVCache, Sequence
from cupaged.ops import append as append_op
from cupaged.ops import layers as cupaged_layers
from cupaged.ops.append import copy_pages as launch_copy_pages
from cupaged.testing import as_dtype, reference, tolerance

HAVE_ATTENTION = importlib.util.find_spec("cupaged.ops.attention") is not None


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def device(cache, x: np.ndarray):
    """x on the cache's backend and device."""
    if cache.backend == "cpu":
        return x
    import cupy

    with cache.k.device:
        return cupy.asarray(x)


def tokens(cache, seq):
    """The K and V rows of seq's tokens in every layer, [length, layers, H, D] /
    [length, layers, H, Dv], read from the cache."""
    t = np.arange(seq.length)
    pages = np.asarray(seq.pages, np.int64)[t // cache.page_size] if seq.length else np.zeros(0, np.int64)
    k = host(cache.k)[:, pages, t % cache.page_size]
    v = host(cache.v)[:, pages, t % cache.page_size]
    return k.swapaxes(0, 1), v.swapaxes(0, 1)


class Model:
    """Every sequence's tokens as plain lists of rows ([layers, H, D] each)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, seq):
        self.k[seq.id], self.v[seq.id] = [], []

    def fork(self, parent, child):
        self.k[child.id], self.v[child.id] = list(self.k[parent.id]), list(self.v[parent.id])

    def free(self, seq):
        del self.k[seq.id], self.v[seq.id]

    def append(self, seqs, counts, nk, nv):
        """nk [layers, queries, H, D], nv [layers, queries, H, Dv]: the step's rows."""
        i = 0
        for s, n in zip(seqs, counts):
            self.k[s.id].extend(nk[:, i : i + n].swapaxes(0, 1))
            self.v[s.id].extend(nv[:, i : i + n].swapaxes(0, 1))
            i += n

    def check(self, cache, seqs):
        for s in seqs:
            k, v = tokens(cache, s)
            assert s.length == len(self.k[s.id])
            if s.length:
                np.testing.assert_array_equal(bits(k), bits(np.stack(self.k[s.id])), err_msg=f"k of seq {s.id}")
                np.testing.assert_array_equal(bits(v), bits(np.stack(self.v[s.id])), err_msg=f"v of seq {s.id}")


def step(cache, seqs, counts, rng, model=None, reserve=0):
    """prepare + append random rows in every layer; returns (plan, report,
    new_k [layers, queries, H, D], new_v)."""
    if isinstance(counts, int):
        counts = [counts] * len(seqs)
    plan, report = cache.prepare(seqs, counts, reserve=reserve)
    n = int(np.sum(counts))
    nk = rng.standard_normal((cache.layers, n, cache.kv_heads, cache.head_dim)).astype(cache.dtype)
    nv = rng.standard_normal((cache.layers, n, cache.kv_heads, cache.value_dim)).astype(cache.dtype)
    for layer in range(cache.layers):
        cache.append(plan, device(cache, nk[layer]), device(cache, nv[layer]), layer=layer)
    if model is not None:
        model.append(seqs, counts, nk, nv)
    return plan, report, nk, nv


def snapshot(cache, seqs):
    return (
        bits(host(cache.k)).copy(),
        bits(host(cache.v)).copy(),
        cache.num_free_pages,
        list(cache._free),
        list(cache._refs),
        [(s.length, s.pages) for s in seqs],
        list(cache._lru),
        sorted(cache._entry),
        dict(cache._stats),
    )


def check_invariants(cache, live):
    """Reference counts are the sequences holding each page; every page is
    held, free or cached, exactly once (no page leaked)."""
    refs = [0] * cache.num_pages
    for s in live:
        assert len(s.pages) >= -(-s.length // cache.page_size)
        for p in s.pages:
            refs[p] += 1
    assert refs == list(cache._refs)
    held = [p for p in range(cache.num_pages) if refs[p]]
    assert len(set(cache._free)) == len(cache._free) and not set(cache._free) & set(cache._lru)
    assert sorted(held + list(cache._free) + list(cache._lru)) == list(range(cache.num_pages))
    assert all(p in cache._entry for p in cache._lru)  # a cached page is indexed


def small_cache(num_pages=8, page_size=4, dtype="f16", **kw):
    return PagedKVCache(num_pages, page_size, 2, 8, dtype, value_dim=kw.pop("value_dim", 4), **kw)


def make_cache(backend, dtype="f16", **kw):
    """small_cache on the backend of the xp_backend fixture."""
    try:
        return small_cache(dtype=dtype, like=backend.xp.zeros(1, np.float16), **kw)
    except Exception as e:  # CuPy without a bfloat16 dtype
        if backend.name == "gpu" and as_dtype(dtype).name == "bfloat16":
            pytest.skip(f"CuPy cannot hold bfloat16 arrays here: {e}")
        raise


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_prefill_then_decode_matches_model(xp_backend, dtype):
    rng = np.random.default_rng(1)
    cache = make_cache(xp_backend, dtype=dtype)
    assert cache.k.shape == (1, 8, 4, 2, 8) and cache.v.shape == (1, 8, 4, 2, 4) and cache.dtype == as_dtype(dtype)
    model = Model()
    a, b = cache.add_sequence(), cache.add_sequence()
    model.add(a)
    model.add(b)
    assert (a.length, a.pages, a.capacity) == (0, (), 0)
    plan, report, _, _ = step(cache, [a, b], [6, 3], rng, model)
    assert (plan.queries, plan.sequences, plan.page_size, plan.pages) == (9, 2, 4, 8)
    assert report.copied_pages == [] and report.copied_bytes == 0 and report.allocated_pages == 3
    assert (a.length, a.capacity, len(a.pages), b.length, len(b.pages)) == (6, 8, 2, 3, 1)
    assert cache.num_free_pages == 5
    for _ in range(3):
        step(cache, [a, b], 1, rng, model)
    model.check(cache, [a, b])
    table = cache.page_table([a, b])
    assert table.dtype == np.int32 and table.tolist() == [list(a.pages), list(b.pages) + [-1]]
    check_invariants(cache, [a, b])


def test_mla_shapes():
    rng = np.random.default_rng(2)
    cache = PagedKVCache(6, 16, 1, 512, "bf16", value_dim=64)
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    step(cache, [a], [20], rng, model)
    c = cache.fork(a)
    model.fork(a, c)
    _, report, _, _ = step(cache, [a, c], [1, 2], rng, model)
    assert report.copied_pages == [(c.pages[1], a.pages[1])]  # a copies, c (the last holder) writes in place
    assert report.copied_bytes == 16 * (512 + 64) * 2
    model.check(cache, [a, c])


def test_fork_isolation_and_copy_report(xp_backend):
    rng = np.random.default_rng(3)
    cache = make_cache(xp_backend, page_size=4)
    model = Model()
    parent = cache.add_sequence()
    model.add(parent)
    step(cache, [parent], [6], rng, model)  # pages [p0 full, p1 with 2 of 4 slots]
    shared = parent.pages[1]
    child = cache.fork(parent)
    model.fork(parent, child)
    assert child.pages == parent.pages and child.length == 6 and child.id != parent.id
    assert cache.ref_count(shared) == 2 and cache.num_free_pages == 6  # nothing copied by fork
    before_k, before_v = (bits(x).copy() for x in tokens(cache, parent))
    plan, report, _, _ = step(cache, [child], [1], rng, model)
    ((src, dst),) = report.copied_pages
    assert src == shared and dst not in parent.pages and child.pages == (parent.pages[0], dst)
    assert report.copied_bytes == cache.page_bytes == 4 * 2 * (8 + 4) * 2
    assert cache.ref_count(shared) == 1 and cache.ref_count(dst) == 1 and cache.ref_count(parent.pages[0]) == 2
    after_k, after_v = (bits(x) for x in tokens(cache, parent))
    np.testing.assert_array_equal(after_k, before_k)
    np.testing.assert_array_equal(after_v, before_v)
    model.check(cache, [parent, child])
    # the parent writes next: its last page is no longer shared, no copy
    _, report, _, _ = step(cache, [parent], [3], rng, model)
    assert report.copied_pages == []
    model.check(cache, [parent, child])
    check_invariants(cache, [parent, child])


@pytest.mark.skipif(not HAVE_ATTENTION, reason="cupaged.ops.attention not present yet")
def test_fork_isolation_attention_bit_identical(xp_backend):
    """The parent's attention output is bit-identical before and after its
    child appends into their shared last page."""
    rng = np.random.default_rng(4)
    cache = make_cache(xp_backend, page_size=4, dtype="f32", value_dim=8)
    parent = cache.add_sequence()
    step(cache, [parent], [7], rng)  # last page 3 of 4 full
    child = cache.fork(parent)
    table = cache.page_table([parent])
    view = HostPlan.build(table, [7], [7], 4, cache.num_pages).upload(cache.k)  # all 7 tokens as queries
    q = rng.standard_normal((7, 4, 8)).astype(np.float32)
    before = host(view.attention(device(cache, q), cache.k[0], cache.v[0], 0.3, causal=True))
    _, report, _, _ = step(cache, [child], [2], rng)
    assert [src for src, _ in report.copied_pages] == [parent.pages[-1]]
    after = host(view.attention(device(cache, q), cache.k[0], cache.v[0], 0.3, causal=True))
    np.testing.assert_array_equal(bits(after), bits(before))
    exp, _ = reference.paged_attention(q, host(cache.k)[0], host(cache.v)[0], table, [7], [7], 0.3)
    atol, rtol = tolerance("f32")
    np.testing.assert_allclose(np.asarray(after, np.float64), exp, atol=atol, rtol=rtol)


def test_both_holders_write_one_copy():
    rng = np.random.default_rng(5)
    cache = small_cache()
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    step(cache, [a], [5], rng, model)
    b = cache.fork(a)
    model.fork(a, b)
    shared = a.pages[1]
    _, report, _, _ = step(cache, [a, b], [1, 2], rng, model)
    assert len(report.copied_pages) == 1 and report.copied_pages[0][0] == shared
    assert b.pages[1] == shared and a.pages[1] == report.copied_pages[0][1]  # the last holder writes in place
    model.check(cache, [a, b])
    check_invariants(cache, [a, b])


def test_exhaustion_changes_nothing():
    rng = np.random.default_rng(6)
    cache = small_cache(num_pages=4)
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    step(cache, [a], [10], rng, model)  # 3 pages, the last half full
    b = cache.fork(a)
    model.fork(a, b)
    cache.k[:, cache._free] = np.nan  # the free page too
    snap = snapshot(cache, [a, b])
    # a: one copy + one new page; b then writes the old page in place + one new page = 3 > 1 free
    with pytest.raises(
        PagedAttentionError,
        match=r"out of pages: this step needs 3 page\(s\) \(2 for new tokens, "
        r"1 to copy shared pages\), 1 of 4 free",
    ):
        cache.prepare([a, b], [3, 3])
    now = snapshot(cache, [a, b])
    for x, y in zip(snap, now):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y
    # what fits still works
    step(cache, [b], [2], rng, model)
    model.check(cache, [a, b])


def _same(snap, now):
    for x, y in zip(snap, now):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def test_stale_plans_raise_and_write_nothing():
    """A plan of prepare goes stale at the cache's next fork, free or
    prepare: appending with it (or attending) raises and writes nothing. It
    used to write into pages then shared with a fork, which read the
    parent's new tokens."""
    rng = np.random.default_rng(16)
    cache = small_cache(num_pages=8, dtype="f32")
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    plan, _, _, _ = step(cache, [a], [3], rng, model)
    nk = np.ones((3, 2, 8), np.float32)
    nv = np.ones((3, 2, 4), np.float32)
    q = np.ones((3, 2, 8), np.float32)

    def stale(p):
        snap = snapshot(cache, [a])
        with pytest.raises(
            PagedAttentionError, match="plan: stale: made by PagedKVCache.prepare before a later fork, free or prepare"
        ):
            cache.append(p, nk, nv)
        with pytest.raises(PagedAttentionError, match="plan: stale"):
            p.append(nk, nv, cache.k[0], cache.v[0])
        with pytest.raises(PagedAttentionError, match="plan: stale"):
            p.attention(q, cache.k[0], cache.v[0], 0.5)
        _same(snap, snapshot(cache, [a]))

    b = cache.fork(a)  # the plan's last page is now shared with b
    model.fork(a, b)
    stale(plan)
    model.check(cache, [a, b])  # b did not get a's rows
    plan2, _, _, _ = step(cache, [a], [1], rng, model)
    stale(plan)
    c = cache.add_sequence()  # a new empty sequence moves no page: plan2 stays valid
    plan2.attention(np.ones((1, 2, 8), np.float32), cache.k[0], cache.v[0], 0.5)
    cache.free(c)
    stale(plan2)
    model.check(cache, [a, b])


def _state(cache, seqs):
    return snapshot(cache, seqs) + ([s.length for s in seqs], [s.pages for s in seqs], cache._generation)


def test_failing_prepare_changes_nothing(monkeypatch):
    """prepare fails inside a capture (its upload is refused) or when the
    copy kernel cannot be built: lengths, pages, refcounts, the free list and
    the K/V contents stay exactly as they were, and a later prepare works."""
    rng = np.random.default_rng(17)
    cache = small_cache(num_pages=8, dtype="f16")
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    step(cache, [a], [6], rng, model)  # 2 pages, the last half full
    b = cache.fork(a)  # the next step of both copies a's last page
    model.fork(a, b)
    snap = _state(cache, [a, b])
    with pytest.raises(PagedAttentionError, match="plan.upload: allocation inside graph capture"):
        with capture_graph(cache.k):
            cache.prepare([a, b], [1, 1])
    _same(snap, _state(cache, [a, b]))

    def no_copy_kernel(like, source, kernel, defines=None):
        raise CompileError(f"cannot build {kernel}")

    with monkeypatch.context() as m:
        m.setattr(append_op, "get_kernel", no_copy_kernel)
        with pytest.raises(CompileError, match="cannot build copy_pages"):
            cache.prepare([a, b], [1, 1])
    _same(snap, _state(cache, [a, b]))
    model.check(cache, [a, b])
    step(cache, [a, b], [1, 1], rng, model)  # the history survived: both read their 6 tokens + 1
    model.check(cache, [a, b])


def test_caches_over_2_32_elements():
    """Caches may hold more than 2^32 elements (page offsets are 64-bit in
    every kernel): the page manager makes one and append, attention and
    copy-on-write work on pages past element 2^32. The arrays are zeroed
    lazily by the OS, so only touched pages take memory."""
    pages, ps, d = 2**20 + 8, 16, 256
    try:
        k = np.zeros((pages, ps, 1, d), np.float16)
        v = np.zeros((pages, ps, 1, d), np.float16)
    except MemoryError:
        pytest.skip("this machine cannot reserve 2 x 8 GiB of address space")
    assert k.size > 2**32
    rng = np.random.default_rng(18)
    table = np.array([[pages - 3, pages - 1], [5, pages - 2]])
    kv, ql = np.array([20, 25]), np.array([20, 9])
    plan = HostPlan.build(table, kv, ql, ps, pages).upload(k)
    nk = rng.standard_normal((29, 1, d)).astype(np.float16)
    nv = rng.standard_normal((29, 1, d)).astype(np.float16)
    ref_k, ref_v = reference.paged_append(
        nk, nv, k[table.reshape(-1)], v[table.reshape(-1)], np.arange(4).reshape(2, 2), kv, ql
    )
    plan.append(nk, nv, k, v)
    np.testing.assert_array_equal(k[table.reshape(-1)].astype(np.float64), ref_k)
    q = rng.standard_normal((29, 2, d)).astype(np.float16)
    out = plan.attention(q, k, v, d**-0.5)
    exp, _ = reference.paged_attention(q, ref_k, ref_v, np.arange(4).reshape(2, 2), kv, ql, d**-0.5, True)
    np.testing.assert_allclose(out.astype(np.float64), exp, **dict(zip(("atol", "rtol"), tolerance("f16"))))
    launch_copy_pages(stream_for(k), k, v, np.array([[pages - 1, pages - 4]], np.uint32), 1)
    np.testing.assert_array_equal(k[pages - 4], k[pages - 1])
    big = PagedKVCache(pages, ps, 1, d, "f16")
    assert big.k.size > 2**32
    x = big.add_sequence()
    p, _ = big.prepare([x], [3])
    big.append(p, nk[:3], nv[:3])
    np.testing.assert_array_equal(big.k[0, p.host.page_table[0, 0], :3], nk[:3])


def test_freed_pages_are_reused_and_refcounted():
    rng = np.random.default_rng(7)
    cache = small_cache(num_pages=6)
    a = cache.add_sequence()
    step(cache, [a], [9], rng)
    pages_a = set(a.pages)
    b = cache.fork(a)
    cache.free(a)
    assert not a.alive and cache.num_free_pages == 3  # b still holds them
    cache.free(b)
    assert cache.num_free_pages == 6
    c = cache.add_sequence()
    step(cache, [c], [12], rng)
    assert set(c.pages) == pages_a  # the most recently freed pages first
    with pytest.raises(PagedAttentionError, match="seq: sequence 0 was freed"):
        cache.free(a)
    with pytest.raises(PagedAttentionError, match=r"seqs\[1\]: sequence 1 was freed"):
        cache.prepare([c, b], 1)


def test_input_errors():
    cache = small_cache()
    other = small_cache()
    a = cache.add_sequence()
    with pytest.raises(PagedAttentionError, match="seqs: expected distinct sequences"):
        cache.prepare([a, a], 1)
    with pytest.raises(PagedAttentionError, match=r"seqs\[0\]: expected a Sequence of this cache, got one of another"):
        cache.prepare([other.add_sequence()], 1)
    with pytest.raises(PagedAttentionError, match=r"seqs\[0\]: expected a Sequence of this cache, got int"):
        cache.prepare([3], 1)
    with pytest.raises(PagedAttentionError, match=r"new_tokens: expected shape \[1\]"):
        cache.prepare([a], [1, 2])
    with pytest.raises(PagedAttentionError, match=r"new_tokens\[0\]: expected an int in 0..4294967295, got -1"):
        cache.prepare([a], [-1])
    with pytest.raises(PagedAttentionError, match="new_tokens: expected an integer array"):
        cache.prepare([a], [1.5])
    with pytest.raises(PagedAttentionError, match="seq: expected a Sequence of this cache"):
        cache.fork(object())
    with pytest.raises(
        PagedAttentionError,
        match="dtype: expected float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got 'int8'",
    ):
        PagedKVCache(4, 4, 1, 8, "int8")
    with pytest.raises(PagedAttentionError, match="page_size: expected an int in 1..256, got 0"):
        PagedKVCache(4, 0, 1, 8, "f16")
    with pytest.raises(PagedAttentionError, match="num_pages"):
        PagedKVCache(0, 4, 1, 8, "f16")
    with pytest.raises(PagedAttentionError, match="like: expected a NumPy or CuPy array"):
        PagedKVCache(4, 4, 1, 8, "f16", like=[1.0])
    with pytest.raises(PagedAttentionError, match="k: .* elements exceed 32-bit indexing"):
        PagedKVCache(2, 256, 2**17, 256, "f16")  # one page past 32-bit indexing
    with pytest.raises(PagedAttentionError, match="layers: expected an int in 1..65535, got 0"):
        PagedKVCache(4, 4, 1, 8, "f16", layers=0)
    with pytest.raises(PagedAttentionError, match="prefix_cache: expected True or False, got int 1"):
        PagedKVCache(4, 4, 1, 8, "f16", prefix_cache=1)
    with pytest.raises(PagedAttentionError, match=r"reserve\[0\]: expected an int in 0..4294967295, got -2"):
        cache.prepare([a], 1, reserve=[-2])
    with pytest.raises(PagedAttentionError, match="tokens: expected an integer array"):
        cache.add_sequence(tokens=[1.5, 2.0])
    with pytest.raises(PagedAttentionError, match="layer: expected an int in 0..0, got 1"):
        cache.append(
            cache.prepare([a], 0)[0], np.zeros((0, 2, 8), np.float16), np.zeros((0, 2, 4), np.float16), layer=1
        )
    with pytest.raises(
        PagedAttentionError, match=r"k_cache: expected a 4-D array .* pass one layer: cache.layer\(i\), or cache.k\[i\]"
    ):
        cache.prepare([a], 0)[0].attention(np.zeros((0, 2, 8), np.float16), cache.k, cache.v, 0.5)
    assert a.length == 0 and cache.num_free_pages == 8


def test_empty_steps():
    cache = small_cache()
    plan, report = cache.prepare([], [])
    assert plan.queries == 0 and plan.sequences == 0 and report.allocated_pages == 0
    a = cache.add_sequence()
    plan, report = cache.prepare([a], 0)
    assert plan.queries == 0 and a.length == 0 and cache.num_free_pages == 8
    cache.append(plan, np.zeros((0, 2, 8), np.float16), np.zeros((0, 2, 4), np.float16))


def test_copy_pages_skips_bad_ids():
    """The copy kernel never trusts its page list: ids >= num_pages are skipped."""
    rng = np.random.default_rng(8)
    buf_k = np.full(4 * 16 + 32, np.nan, np.float32)
    buf_v = np.full(4 * 8 + 32, np.nan, np.float32)
    k = buf_k[16 : 16 + 64].reshape(4, 2, 2, 4)
    v = buf_v[16 : 16 + 32].reshape(4, 2, 2, 2)
    k[...] = rng.standard_normal(k.shape)
    v[...] = rng.standard_normal(v.shape)
    gk, gv = buf_k.copy(), buf_v.copy()
    pairs = np.array([[1, 3], [0, 4], [7, 2], [0xFFFFFFFF, 0]], np.uint32)
    launch_copy_pages(stream_for(k), k, v, pairs, len(pairs))
    exp_k, exp_v = gk.copy(), gv.copy()
    exp_k[16 : 16 + 64].reshape(4, 16)[3] = gk[16 : 16 + 64].reshape(4, 16)[1]
    exp_v[16 : 16 + 32].reshape(4, 8)[3] = gv[16 : 16 + 32].reshape(4, 8)[1]
    np.testing.assert_array_equal(bits(buf_k), bits(exp_k))
    np.testing.assert_array_equal(bits(buf_v), bits(exp_v))


@pytest.mark.parametrize("page_size, seed", [(4, 11), (1, 12)])
def test_random_schedule_matches_model(xp_backend, page_size, seed):
    """200 steps of add / fork / free / prepare+append on a small cache."""
    rng = np.random.default_rng(seed)
    cache = PagedKVCache(
        40 if page_size == 4 else 120, page_size, 2, 8, "f16", value_dim=4, like=xp_backend.xp.zeros(1, np.float16)
    )
    model = Model()
    live: list[Sequence] = []
    copies = exhausted = attention_checks = 0
    for it in range(200):
        r = rng.random()
        if not live or (r < 0.12 and len(live) < 8):
            s = cache.add_sequence()
            model.add(s)
            live.append(s)
        elif r < 0.24 and len(live) < 8:
            parent = live[rng.integers(len(live))]
            child = cache.fork(parent)
            model.fork(parent, child)
            live.append(child)
        elif r < 0.32 and len(live) > 1:
            s = live.pop(rng.integers(len(live)))
            cache.free(s)
            model.free(s)
        else:
            batch = [live[i] for i in rng.permutation(len(live))[: rng.integers(1, len(live) + 1)]]
            counts = [int(rng.integers(0, 7)) if rng.random() < 0.3 else int(rng.integers(0, 2)) for _ in batch]
            snap = snapshot(cache, live)
            try:
                plan, report, _, _ = step(cache, batch, counts, rng, model)
            except PagedAttentionError as e:
                assert "out of pages" in str(e)
                exhausted += 1
                now = snapshot(cache, live)
                assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(snap, now))
                s = live.pop(rng.integers(len(live)))
                cache.free(s)
                model.free(s)
                continue
            copies += len(report.copied_pages)
            if HAVE_ATTENTION and plan.queries and it % 5 == 0:
                attention_checks += 1
                q = rng.standard_normal((plan.queries, 4, 8)).astype(np.float16)
                out = host(plan.attention(device(cache, q), cache.k[0], cache.v[0], 0.35, causal=True))
                h = plan.host
                exp, _ = reference.paged_attention(
                    q, host(cache.k)[0], host(cache.v)[0], h.page_table, h.kv_lens, h.q_lens, 0.35
                )
                atol, rtol = tolerance("f16")
                np.testing.assert_allclose(np.asarray(out, np.float64), exp, atol=atol, rtol=rtol)
        model.check(cache, live)
        check_invariants(cache, live)
    # page size 1: every shared page is full, so nothing is ever copied
    assert (copies > 3 if page_size > 1 else copies == 0) and exhausted >= 1, (copies, exhausted)
    assert attention_checks > 0 or not HAVE_ATTENTION


# ---------------------------------------------------------------------------
# Layers, reservations, prefix reuse


def count_launches(monkeypatch, like):
    """A list that collects the kernel of every launch on like's stream."""
    stream = stream_for(like)
    seen = []
    launch = stream.launch
    monkeypatch.setattr(stream, "launch", lambda *a, **kw: (seen.append(a[0]), launch(*a, **kw))[1])
    return seen


def test_layers_share_one_table_and_copy_in_one_launch(monkeypatch):
    rng = np.random.default_rng(21)
    cache = small_cache(layers=3, dtype="bf16")
    assert cache.k.shape == (3, 8, 4, 2, 8) and cache.v.shape == (3, 8, 4, 2, 4)
    for layer in range(3):  # each layer's view is contiguous and inside the one allocation
        assert cache.k[layer].flags.c_contiguous and cache.k[layer].base is cache.k
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    step(cache, [a], [6], rng, model)
    b = cache.fork(a)
    model.fork(a, b)
    seen = count_launches(monkeypatch, cache.k)
    _, report, _, _ = step(cache, [a, b], [1, 3], rng, model)
    assert len(report.copied_pages) == 1 and report.copied_bytes == 3 * 4 * 2 * (8 + 4) * 2
    assert len(seen) == 1 + 3  # one copy for every layer, then one append per layer
    model.check(cache, [a, b])
    check_invariants(cache, [a, b])


def test_reserve_holds_pages_and_copies_what_they_will_write():
    rng = np.random.default_rng(22)
    cache = small_cache(num_pages=12, layers=2)
    model = Model()
    a = cache.add_sequence()
    model.add(a)
    plan, report, _, _ = step(cache, [a], [5], rng, model, reserve=6)  # 5 tokens, pages for 11
    assert a.length == 5 and len(a.pages) == 3 and a.capacity == 12 and report.allocated_pages == 3
    assert plan.table_width == 3 and plan.host.page_table[0].tolist() == list(a.pages)
    b = cache.fork(a)  # shares the pages holding a's 5 tokens, not a's reserve
    model.fork(a, b)
    assert b.pages == a.pages[:2] and cache.ref_count(a.pages[2]) == 1
    # b reserves without adding tokens: its shared, half-full page 1 is what those tokens write
    report = cache.reserve([b], 4)
    assert [src for src, _ in report.copied_pages] == [a.pages[1]] and b.length == 5 and b.capacity == 12
    model.check(cache, [a, b])
    # later steps use the reserved pages: nothing allocated, nothing copied
    _, report, _, _ = step(cache, [a, b], [3, 4], rng, model)
    assert report.allocated_pages == 0 and report.copied_pages == []
    model.check(cache, [a, b])
    check_invariants(cache, [a, b])
    # exhaustion with a reserve changes nothing
    snap = snapshot(cache, [a, b])
    with pytest.raises(
        PagedAttentionError,
        match=r"prepare: out of pages: this step needs 10 page\(s\) \(10 for "
        r"new tokens, 0 to copy shared pages\), 7 of 12 free",
    ):
        cache.prepare([a], 1, reserve=40)
    with pytest.raises(PagedAttentionError, match=r"reserve: out of pages"):
        cache.reserve([a, b], [20, 20])
    _same(snap, snapshot(cache, [a, b]))


def kv_of_prefix(cache, tokens):
    """Rows a model would compute for ``tokens``: row p of every layer is a
    function of tokens[0..p] (as in a real model), [layers, n, H, D] / Dv."""
    n = len(tokens)
    k = np.empty((cache.layers, n, cache.kv_heads, cache.head_dim), cache.dtype)
    v = np.empty((cache.layers, n, cache.kv_heads, cache.value_dim), cache.dtype)
    for p in range(n):
        r = np.random.default_rng(zlib.crc32(np.asarray(tokens[: p + 1], np.int64).tobytes()))
        k[:, p] = r.standard_normal(k[:, p].shape)
        v[:, p] = r.standard_normal(v[:, p].shape)
    return k, v


def prefill(cache, seq, tokens, model=None, layers=None):
    """prepare + append the rows of tokens[seq.length:]; ``layers``: append
    only these layers (default all). Returns the plan."""
    n = len(tokens) - seq.length
    start = seq.length
    plan, _ = cache.prepare([seq], [n])
    k, v = kv_of_prefix(cache, tokens)
    for layer in range(cache.layers) if layers is None else layers:
        cache.append(plan, k[layer, start:], v[layer, start:], layer=layer)
    if model is not None:
        model.append([seq], [n], k[:, start:], v[:, start:])
    return plan


def test_prefix_hits_share_written_pages_only():
    cache = small_cache(num_pages=16, layers=2, prefix_cache=True)
    model = Model()
    prompt = [7, 1, 9, 4, 4, 2, 8, 3, 5, 6]  # 2 full pages of 4 + 2 tokens
    a = cache.add_sequence(tokens=prompt)
    model.add(a)
    assert a.cached_tokens == 0 and cache.stats()["misses"] == 2
    plan = prefill(cache, a, prompt, model, layers=[0])  # one of two layers written: pending
    assert cache.stats()["indexed_pages"] == 0
    b = cache.add_sequence(tokens=prompt + [1])
    assert b.cached_tokens == 0 and b.pages == ()
    k, v = kv_of_prefix(cache, prompt)
    cache.append(plan, k[1], v[1], layer=1)  # every layer written: indexed
    assert cache.stats()["indexed_pages"] == 2
    c = cache.add_sequence(tokens=prompt + [1, 2, 3])
    model.k[c.id], model.v[c.id] = model.k[a.id][:8], model.v[a.id][:8]
    assert (c.cached_tokens, c.length, c.pages) == (8, 8, a.pages[:2])
    assert cache.ref_count(a.pages[0]) == 2 and cache.stats()["hits"] == 2
    model.check(cache, [a, c])
    # c prefills only the rest, into its own pages; the shared ones are never copied
    plan = prefill(cache, c, prompt + [1, 2, 3], model)
    assert plan.queries == 5 and c.pages[:2] == a.pages[:2]
    model.check(cache, [a, c])
    # a whole prompt of full pages hits all but its last page (the last token yields logits)
    d = cache.add_sequence(tokens=prompt[:8])
    assert d.cached_tokens == 4
    cache.free(d)
    check_invariants(cache, [a, b, c])


def test_stale_plans_drop_their_pending_pages():
    cache = small_cache(num_pages=16, layers=2, prefix_cache=True)
    prompt = list(range(20, 29))
    a = cache.add_sequence(tokens=prompt)
    plan = prefill(cache, a, prompt, layers=[0])
    b = cache.fork(a)  # the plan goes stale before layer 1
    k, v = kv_of_prefix(cache, prompt)
    with pytest.raises(PagedAttentionError, match="plan: stale"):
        cache.append(plan, k[1], v[1], layer=1)
    assert cache.stats()["indexed_pages"] == 0
    assert cache.add_sequence(tokens=prompt).cached_tokens == 0
    cache.free(b)


def test_freed_pages_stay_cached_and_are_evicted_least_recently_used():
    cache = small_cache(num_pages=6, layers=1, prefix_cache=True)
    p1, p2 = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]
    a = cache.add_sequence(tokens=p1)
    prefill(cache, a, p1)
    b = cache.add_sequence(tokens=p2)
    prefill(cache, b, p2)
    pa, pb = a.pages, b.pages
    cache.free(a)  # a's 2 full pages stay cached, its last page goes free
    cache.free(b)
    assert cache.num_cached_pages == 4 and cache.num_free_pages == 6
    assert cache.stats()["cached_pages"] == 4
    check_invariants(cache, [])
    # a hit revives p1's pages (and makes them the most recently used)
    c = cache.add_sequence(tokens=p1)
    assert c.pages == pa[:2] and cache.num_cached_pages == 2
    cache.free(c)  # p1's pages are now younger than p2's
    # a new 5-page sequence takes the 2 free pages, then evicts 3 cached ones, oldest first:
    # b's last full page, then b's first, then (cascade-free) a's second page
    d = cache.add_sequence(tokens=list(range(40, 60)))
    rng = np.random.default_rng(3)
    step(cache, [d], [20], rng)
    ev = cache.stats()["evictions"]
    assert ev == 3 and set(pb[:2]) <= set(d.pages) and pa[1] in d.pages and cache.num_cached_pages == 1
    assert cache.add_sequence(tokens=p2).cached_tokens == 0  # evicted: a miss
    e = cache.add_sequence(tokens=p1)
    assert e.cached_tokens == 4 and e.pages == pa[:1]  # p1's first page is still cached
    check_invariants(cache, [d, e])
    with pytest.raises(PagedAttentionError, match=r"out of pages: .*0 of 6 free"):
        cache.prepare([e], 4)


def test_hash_collisions_cannot_share_wrong_pages(monkeypatch):
    """Every key collides: a hit still needs equal token ids and the same
    parent entry, so other prompts never share a page, and K/V stay exact."""
    monkeypatch.setattr(cache_mod, "page_key", lambda parent, tokens: b"same")
    cache = small_cache(num_pages=16, layers=1, prefix_cache=True)
    model = Model()
    p1, p2 = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 5, 5, 6, 7, 8, 9]
    a = cache.add_sequence(tokens=p1)
    model.add(a)
    prefill(cache, a, p1, model)
    assert cache.stats()["indexed_pages"] == 1  # the second page collides with the first: not indexed
    b = cache.add_sequence(tokens=p2)
    assert b.cached_tokens == 0
    model.add(b)
    prefill(cache, b, p2, model)
    c = cache.add_sequence(tokens=p1)
    assert c.cached_tokens == 4 and c.pages == a.pages[:1]
    model.k[c.id], model.v[c.id] = model.k[a.id][:4], model.v[a.id][:4]
    model.check(cache, [a, b, c])
    check_invariants(cache, [a, b, c])


def test_fork_and_copy_on_write_over_shared_prefix_pages():
    rng = np.random.default_rng(23)
    cache = small_cache(num_pages=16, layers=2, prefix_cache=True)
    model = Model()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    a = cache.add_sequence(tokens=prompt)
    model.add(a)
    prefill(cache, a, prompt, model)
    b = cache.add_sequence(tokens=prompt + [3, 5])
    model.k[b.id], model.v[b.id] = model.k[a.id][:8], model.v[a.id][:8]
    prefill(cache, b, prompt + [3, 5], model)
    c = cache.fork(b)  # shares b's prefix pages (refcount 3) and its partial page
    model.fork(b, c)
    shared = b.pages[2]
    _, report, _, _ = step(cache, [b, c], [2, 1], rng, model)
    assert report.copied_pages == [(shared, b.pages[2])] and c.pages[2] == shared  # c, the last holder, in place
    assert cache.ref_count(a.pages[0]) == 3
    model.check(cache, [a, b, c])
    for s in (a, b):
        cache.free(s)
    model.check(cache, [c])
    check_invariants(cache, [c])


# ---------------------------------------------------------------------------
# A random schedule driven through graph decode loops


class TokenModel:
    """The pure-Python model of the graph schedule: every live sequence's
    token ids and how many of them are written. A step's K/V row of token
    t in layer l is row t of that layer's table (what the captured step
    embeds), so every sequence's expected K/V follow from its tokens."""

    def __init__(self, tk, tv, succ):
        self.tk, self.tv, self.succ = tk, tv, succ
        self.tokens: dict[int, list] = {}
        self.written: dict[int, int] = {}

    def add(self, seq, tokens, written):
        self.tokens[seq.id], self.written[seq.id] = list(tokens), written

    def fork(self, parent, child):
        self.tokens[child.id] = list(self.tokens[parent.id][: self.written[parent.id]])
        self.written[child.id] = self.written[parent.id]

    def free(self, seq):
        del self.tokens[seq.id], self.written[seq.id]

    def next_token(self, seq) -> int:
        """The token seq feeds next (known, or generated from its last written one)."""
        toks, w = self.tokens[seq.id], self.written[seq.id]
        return toks[w] if len(toks) > w else int(self.succ[toks[w - 1]])

    def check(self, cache, seqs):
        for s in seqs:
            w = self.written[s.id]
            assert s.length >= w
            k, v = tokens(cache, s)
            toks = np.asarray(self.tokens[s.id][:w], np.int64)
            exp_k = self.tk[:, toks].reshape(cache.layers, w, cache.kv_heads, cache.head_dim).swapaxes(0, 1)
            exp_v = self.tv[:, toks].reshape(cache.layers, w, cache.kv_heads, cache.value_dim).swapaxes(0, 1)
            np.testing.assert_array_equal(bits(k[:w]), bits(exp_k), err_msg=f"k of seq {s.id}")
            np.testing.assert_array_equal(bits(v[:w]), bits(exp_v), err_msg=f"v of seq {s.id}")


def _graph_state(cache, seqs):
    return snapshot(cache, seqs) + ([s.length for s in seqs], [s._batch for s in seqs])


@pytest.mark.parametrize("seed", [31, 32])
def test_random_schedule_through_graph_decode_loops(seed):
    """Joins, leaves, forks, prefix hits, evictions and exhaustion on a small
    prefix-caching cache, every decode step a graph launch (a DecodeBatch over
    buckets 1/2/4 and cache-driven PagedDecodeLoops), against TokenModel:
    contents equal, tokens as predicted, no page leaked, failed calls change
    nothing, no recapture."""
    rng = np.random.default_rng(seed)
    V, H, D, DV, layers, ps, k_steps = 24, 1, 4, 2, 2, 4, 3
    cache = PagedKVCache(27, ps, H, D, "f32", layers=layers, value_dim=DV, prefix_cache=True)
    tk = rng.standard_normal((layers, V, H * D)).astype(np.float32)
    tv = rng.standard_normal((layers, V, H * DV)).astype(np.float32)
    succ = rng.permutation(V)
    nt = np.zeros((V, V), np.float32)
    nt[np.arange(V), succ] = 1.0
    stop = 0
    model = TokenModel(tk, tv, succ)
    max_batch = 4
    nk, nv = np.zeros((max_batch, H * D), np.float32), np.zeros((max_batch, H * DV), np.float32)
    logits = np.zeros((max_batch, V), np.float32)

    def make_step(token_buf):
        def step(plan):
            B = plan.sequences
            for layer in range(layers):
                cupaged_layers.embed(token_buf[:B], tk[layer], nk[:B])
                cupaged_layers.embed(token_buf[:B], tv[layer], nv[:B])
                cache.append(plan, nk[:B].reshape(B, H, D), nv[:B].reshape(B, H, DV), layer=layer)
            cupaged_layers.embed(token_buf[:B], nt, logits[:B])
            return logits[:B]

        return step

    tok, nxt = np.zeros(max_batch, np.int64), np.zeros(max_batch, np.int64)
    batch = cupaged.DecodeBatch(
        cache,
        make_step(tok),
        token_buf=tok,
        next_token=nxt,
        max_batch=max_batch,
        max_len=40,
        stop_ids=[stop],
        readback_every=k_steps,
    )
    live: list[Sequence] = []
    prompts: list[list] = []
    device_first: dict[int, int] = {}
    limits: dict[int, int] = {}
    counts = dict(hits=0, exhausted=0, joins=0, leaves=0, forks=0, finished=0, loops=0, batch_steps=0)
    captures0 = cupaged.capture_count()
    loop_captures = 0

    def idle():
        return [s for s in live if s._batch is None]

    def fail_unchanged(call, what):
        before = _graph_state(cache, live)
        try:
            call()
        except PagedAttentionError as e:
            assert what in str(e), str(e)
            _same(before, _graph_state(cache, live))
            counts["exhausted"] += "out of pages" in str(e)
            return True
        return False

    def readback():
        r = batch.readback()
        for s in list(r.tokens) + list(r.finished):
            assert s._batch is None or s in batch.members
        for s in [x for x in live if x._batch is batch or x in r.finished]:
            # the model's prediction: feed, generate by succ until the stop id or the limit
            exp, w = [], model.written[s.id]
            toks = model.tokens[s.id]
            assert len(toks) == w + 1  # the token it feeds next is known
            for _ in range(r.steps):
                w += 1  # a launch writes the pending token ...
                toks.append(int(succ[toks[-1]]))  # ... and generates the next one
                exp.append(toks[-1])
                if toks[-1] == stop or len(toks) >= limits[s.id]:
                    break
            done = bool(exp) and (exp[-1] == stop or len(toks) >= limits[s.id])
            if s.id in device_first:  # a first token that joined from the device
                exp.insert(0, device_first.pop(s.id))
            got = r.tokens.get(s, [])
            assert got == exp, (s.id, got, exp, r.steps)
            model.written[s.id] = w
            assert (s in r.finished) == done, (s.id, r.finished, exp)
            if done:
                counts["finished"] += 1
                assert s.length == w
            else:
                assert s.length == w + 1
        return r

    for _ in range(120):
        r = rng.random()
        if r < 0.2 or not live:
            if prompts and rng.random() < 0.5:  # share a prefix of an earlier prompt
                base = prompts[rng.integers(len(prompts))]
                prompt = base[: rng.integers(1, len(base) + 1)] + rng.integers(1, V, rng.integers(1, 4)).tolist()
            else:
                prompt = rng.integers(1, V, rng.integers(3, 11)).tolist()
            s = cache.add_sequence(tokens=prompt)
            counts["hits"] += s.cached_tokens > 0
            model.add(s, prompt, s.cached_tokens)
            live.append(s)
            model.check(cache, [s])  # a hit's pages hold exactly its prefix
            start = s.length

            def pre():
                plan, _ = cache.prepare([s], [len(prompt) - start])
                toks = np.asarray(prompt[start:], np.int64)
                for layer in range(layers):
                    cache.append(
                        plan, tk[layer][toks].reshape(-1, H, D), tv[layer][toks].reshape(-1, H, DV), layer=layer
                    )

            if fail_unchanged(pre, "out of pages"):
                live.remove(s)
                cache.free(s)
                model.free(s)
                if idle():
                    victim = idle()[rng.integers(len(idle()))]
                    live.remove(victim)
                    cache.free(victim)
                    model.free(victim)
                continue
            model.written[s.id] = len(prompt)
            prompts.append(prompt)
        elif r < 0.35 and idle() and batch.launches == batch._read_at:
            s = idle()[rng.integers(len(idle()))]
            if s.length + 3 >= 40:
                continue
            limit = min(40, s.length + int(rng.integers(3, 14)))
            first = model.next_token(s)
            tok_arg = first if rng.random() < 0.5 else np.array([first], np.int64)

            def join():
                batch.join(s, tok_arg, max_len=limit)

            if fail_unchanged(join, "out of pages" if len(batch.members) < max_batch else "batch is full"):
                continue
            counts["joins"] += 1
            limits[s.id] = limit
            if not isinstance(tok_arg, int):
                device_first[s.id] = first
            if len(model.tokens[s.id]) == model.written[s.id]:
                model.tokens[s.id].append(first)
        elif r < 0.45 and idle():
            parent = idle()[rng.integers(len(idle()))]
            child = cache.fork(parent)
            model.fork(parent, child)
            live.append(child)
            counts["forks"] += 1
        elif r < 0.55 and idle() and len(live) > 2:
            s = idle()[rng.integers(len(idle()))]
            live.remove(s)
            cache.free(s)
            model.free(s)
        elif r < 0.65 and batch.members and batch.launches == batch._read_at:
            s = batch.members[rng.integers(len(batch.members))]
            batch.leave(s)
            counts["leaves"] += 1
            model.tokens[s.id] = model.tokens[s.id][: model.written[s.id] + 1]
        elif r < 0.75 and idle():
            group = [s for s in idle() if s.length][:3]
            if not group:
                continue
            reserve = int(rng.integers(0, 4))
            got = []

            def prep():
                got.append(cache.prepare(group, 1, reserve=reserve)[0])

            if fail_unchanged(prep, "out of pages"):
                continue
            plan = got[0]
            tb, nb = np.zeros(len(group), np.int64), np.array([model.next_token(s) for s in group], np.int64)
            for s, t in zip(group, nb):
                if len(model.tokens[s.id]) == model.written[s.id]:
                    model.tokens[s.id].append(int(t))
            loop = cupaged.PagedDecodeLoop(make_step(tb), plan, token_buf=tb, next_token=nb, cache=cache)
            loop_captures += 1
            kv = cupaged.layout.metadata_offsets(len(group), len(group))["kv_len"]
            for _ in range(loop.steps_left):
                loop.advance()
                assert [s.length for s in group] == plan.words[kv : kv + len(group)].tolist()
                for s, t in zip(group, nb):
                    model.written[s.id] += 1
                    model.tokens[s.id].append(int(t))
            for s in group:
                assert s.length == model.written[s.id]
                model.tokens[s.id] = model.tokens[s.id][: model.written[s.id] + 1]
            counts["loops"] += 1
        elif batch.members:
            for _ in range(k_steps):
                if all(sl.done for sl in batch._slot if sl is not None):
                    break

                def adv():
                    batch.advance()

                if fail_unchanged(adv, "out of pages"):
                    break
                counts["batch_steps"] += 1
            readback()
        if batch.launches == batch._read_at:
            model.check(cache, live)
        check_invariants(cache, live)
    # drain the batch, free everything: every page comes back (held 0, free or cached)
    while batch.members:
        if batch.launches > batch._read_at:
            readback()
            continue
        for s in list(batch.members):
            batch.leave(s)
    for s in live:
        cache.free(s)
    check_invariants(cache, [])
    assert cache.num_free_pages == cache.num_pages
    stats = cache.stats()
    assert counts["hits"] and stats["hits"] and stats["evictions"] and counts["exhausted"], (counts, stats)
    assert counts["joins"] and counts["forks"] and counts["loops"] and counts["batch_steps"] > 10, counts
    assert batch.captures <= 3 and cupaged.capture_count() - captures0 == batch.captures + loop_captures


# --------------------------------------------------------------------------- issue #19: nothing silent, round 3
def test_a_plan_of_another_cache_is_refused_and_writes_nothing():
    """Two caches of one shape (a draft and a target model): a plan of one
    names the other's pages by the same ids, so the other cache's append
    (the only cache method that takes a plan) refuses it before any launch,
    as it refuses a plan no cache made; each cache takes its own plans."""
    rng = np.random.default_rng(41)
    draft, target = small_cache(), small_cache()
    model = Model()
    t = target.add_sequence()
    model.add(t)
    step(target, [t], 6, rng, model)  # target's sequence 0 holds pages 0 and 1
    d = draft.add_sequence()
    plan, _ = draft.prepare([d], 3)  # draft's sequence 0 gets page 0 too
    nk = rng.standard_normal((3, 2, 8)).astype(np.float16)
    nv = rng.standard_normal((3, 2, 4)).astype(np.float16)
    before = snapshot(target, [t]), snapshot(draft, [d])
    with pytest.raises(
        PagedAttentionError,
        match=r"plan: expected a plan of this cache, got one of another "
        r"PagedKVCache \(PagedKVCache\(num_pages=8",
    ):
        target.append(plan, nk, nv)
    hand = HostPlan.build(plan.host.page_table, plan.host.kv_lens, plan.host.q_lens, 4, 8).upload(target.k)
    with pytest.raises(
        PagedAttentionError,
        match=r"plan: expected a plan of this cache \(made by its prepare, or a "
        r"DecodeBatch's\), got DevicePlan made by no PagedKVCache",
    ):
        target.append(hand, nk, nv)
    with pytest.raises(PagedAttentionError, match="got int made by no PagedKVCache"):
        target.append(3, nk, nv)
    _same(before[0], snapshot(target, [t]))
    _same(before[1], snapshot(draft, [d]))
    model.check(target, [t])  # target's rows are what it wrote
    draft.append(plan, nk, nv)  # its own cache takes it
    k, _ = tokens(draft, d)
    np.testing.assert_array_equal(bits(k[:, 0]), bits(nk))
    model.check(target, [t])


def test_ref_count_and_counts_are_range_checked():
    """Every page id and count argument of the page manager is checked:
    ref_count(-1) no longer answers for the last page, ref_count(num_pages)
    raises a cupaged error, not IndexError."""
    cache = small_cache()
    a = cache.add_sequence()
    cache.prepare([a], 5)
    assert [cache.ref_count(p) for p in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert cache.ref_count(np.int64(1)) == 1
    for bad, msg in [
        (-1, "got -1"),
        (8, "got 8"),
        (2**64, f"got {2**64}"),
        (1.0, "got 1.0"),
        (True, "got True"),
        ("0", "got '0'"),
        (None, "got None"),
    ]:
        with pytest.raises(PagedAttentionError, match=rf"page: expected an int in 0..7, {msg}"):
            cache.ref_count(bad)
    snap = snapshot(cache, [a])
    for call, msg in [
        (
            lambda: cache.prepare([a], 2**70),
            rf"new_tokens: expected an int in 0..4294967295, got "
            rf"{2**70}",
        ),
        (lambda: cache.prepare([a], 1, reserve=2**40), "reserve: expected an int in 0..4294967295"),
        (lambda: cache.reserve([a], -1), "tokens: expected an int in 0..4294967295, got -1"),
        (lambda: cache.reserve([a], True), "tokens: expected an integer array, got dtype bool"),
        (lambda: cache.kv_args(-1), "layer: expected an int in 0..0, got -1"),
    ]:
        with pytest.raises(PagedAttentionError, match=msg):
            call()
        _same(snap, snapshot(cache, [a]))


@pytest.mark.parametrize(
    "bad, msg",
    [
        ([1, -1], r"tokens\[1\]: expected a token id in 0..9223372036854775807, got -1"),
        ([3, 2**64 + 5], rf"tokens\[1\]: expected a token id in 0..9223372036854775807, got {2**64 + 5}"),
        ([2**63], rf"tokens\[0\]: expected a token id in 0..9223372036854775807, got {2**63}"),
        (np.array([4, 5, -3]), r"tokens\[2\]: expected a token id in 0..9223372036854775807, got -3"),
        (np.array([1.0]), "tokens: expected an integer array, got dtype float64"),
        ([[1, 2]], "tokens: expected a 1-D array"),
        ([True, False], "tokens: expected an integer array, got dtype bool"),
    ],
)
def test_token_ids_are_checked_where_they_enter_the_cache(bad, msg):
    """add_sequence(tokens=) and add_tokens take ints >= 0 (int64): a huge or
    negative id is refused before anything changes (it used to be kept, and
    the prefix index then failed hashing it, or hashed a wrapped value)."""
    cache = small_cache(prefix_cache=True)
    a = cache.add_sequence(tokens=[1, 2, 3, 4, 5])
    snap, n = snapshot(cache, [a]), cache._next_id
    with pytest.raises(PagedAttentionError, match=msg):
        cache.add_sequence(tokens=bad)
    with pytest.raises(PagedAttentionError, match=msg):
        cache.add_tokens(a, bad)
    _same(snap, snapshot(cache, [a]))
    assert a.tokens == (1, 2, 3, 4, 5) and cache._next_id == n
    cache.add_tokens(a, np.array([2**63 - 1], np.uint64))  # the largest id an int64 holds
    assert a.tokens[-1] == 2**63 - 1


def test_threads_share_one_cache_safely(monkeypatch):
    """Thread safety (docs/layout.md): every method holds the cache's lock.
    One thread's prepare is held between choosing its pages and taking them;
    another thread's prepare meanwhile waits instead of choosing the same
    free pages (which both would then hold with a count of 1)."""
    import threading

    cache = small_cache(num_pages=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    entered, done = threading.Event(), threading.Event()
    copy = cache._copy
    first = threading.get_ident()

    def slow_copy(stream, pairs):  # inside prepare: pages chosen, not yet taken
        if threading.get_ident() == first:
            entered.set()
            done.wait(0.5)  # the other thread's prepare would finish here without the lock
        copy(stream, pairs)

    monkeypatch.setattr(cache, "_copy", slow_copy)
    errors = []

    def other():
        entered.wait(5)
        try:
            cache.prepare([b], 8)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    cache.prepare([a], 8)
    t.join(10)
    assert not errors and not t.is_alive()
    assert not set(a.pages) & set(b.pages) and len(a.pages) == len(b.pages) == 2
    check_invariants(cache, [a, b])
    assert cache.num_free_pages == 4


def test_threads_random_schedule_keeps_every_invariant():
    """Four threads fork, prepare, reserve and free their own sequences of one
    cache at once (the interpreter switching threads every few microseconds):
    every page is held, free or cached exactly once, and every reference count
    is the number of sequences holding the page."""
    import sys
    import threading

    cache = small_cache(num_pages=64, prefix_cache=True)
    live, lock = set(), threading.Lock()
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(60):
                op = rng.integers(4)
                if op == 0 or not mine:
                    s = cache.add_sequence(tokens=rng.integers(0, 3, 6).tolist())
                    mine.append(s)
                elif op == 1 and len(mine) < 4:
                    mine.append(cache.fork(mine[rng.integers(len(mine))]))
                elif op == 2:
                    try:
                        cache.prepare(
                            [mine[rng.integers(len(mine))]], int(rng.integers(1, 4)), reserve=int(rng.integers(3))
                        )
                    except PagedAttentionError as e:
                        assert "out of pages" in str(e)
                else:
                    cache.free(mine.pop(rng.integers(len(mine))))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        with lock:
            live.update(mine)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    check_invariants(cache, list(live))


def test_cpu_cache_memory_is_committed_at_construction():
    """A NumPy cache's pages are written at construction, so the first
    appends into it take no page faults (ru_minflt: the OS maps a page of
    NumPy's zeros on its first write)."""
    import resource

    c = PagedKVCache(64, 16, 4, 64, "f32", layers=2, like=np.zeros(1, np.float32))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c.k[...] = 1.0  # every page of both caches, as appends would
    c.v[...] = 1.0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 32, f"{faults} page faults writing {2 * c.k.nbytes} committed bytes"
    assert 2 * c.k.nbytes <= cache_mod.CPU_COMMIT_BYTES  # (a larger cache is left lazily mapped)
