"""Plans built on the device (cupaged.ops.plan_build, DevicePlanBuilder), on
the CPU backend: the words equal HostPlan.build(...).upload's for the padded
step bit for bit, attention through them matches the float64 reference, bad
shapes raise before any launch, bad values stay inside the arrays."""

import numpy as np
import pytest

from cupaged import DevicePlanBuilder, HostPlan, PagedAttentionError
from cupaged.ops import plan_build
from cupaged.testing import reference

rng = np.random.default_rng(7)


def random_step(n, page_size, width, num_pages, max_q=9):
    """A mixed step of n sequences: decodes, prefills and chunked prefills (q_len <= kv_len)."""
    kinds = rng.integers(0, 3, n)
    kv = np.where(kinds == 0, rng.integers(1, width * page_size + 1, n), rng.integers(1, width * page_size + 1, n))
    ql = np.where(kinds == 0, 1, np.minimum(kv, rng.integers(1, max_q + 1, n)))
    ql[kinds == 1] = np.minimum(kv[kinds == 1], max_q)  # whole prefills where they fit
    if n:
        ql[rng.integers(0, n)] = 0  # a sequence sitting the step out
    pages = rng.permutation(num_pages)[: n * width].reshape(n, width) if n * width <= num_pages else None
    table = rng.integers(0, num_pages, (n, width)) if pages is None else pages
    used = -(-kv // page_size)
    table = np.where(np.arange(width)[None, :] < used[:, None], table, -1)
    qsl = np.zeros(n + 1, np.int64)
    np.cumsum(ql, out=qsl[1:])
    return qsl.astype(np.int32), kv.astype(np.int32), table.astype(np.int32), ql


def padded_reference(qsl, kv, table, ql, rows, width, queries, page_size, num_pages):
    """HostPlan.build of the step padded the way DevicePlanBuilder documents."""
    n = len(kv)
    t = np.full((rows, width), -1, np.int64)
    t[:n, : table.shape[1]] = table
    k = np.zeros(rows, np.int64)
    k[:n] = kv
    q = np.zeros(rows, np.int64)
    q[:n] = ql
    q[-1] = queries - int(ql.sum())
    return HostPlan.build(t, k, q, page_size, num_pages), t, k, q


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_device_words_equal_host_words(page_size):
    width, num_pages, max_seqs, max_q = 6, 200, 7, 70
    builder = DevicePlanBuilder(max_q, max_seqs, width, page_size, num_pages, np.zeros(1, np.float32))
    for trial in range(12):
        n = int(rng.integers(0, max_seqs + 1))
        qsl, kv, table, ql = random_step(n, page_size, width, num_pages)
        cols = int(rng.integers(1, width + 1)) if trial % 3 == 0 else width  # narrower tables: no page past them
        if cols < width:
            kv = np.minimum(kv, cols * page_size).astype(np.int32)
            ql = np.minimum(ql, kv)
            qsl = np.concatenate(([0], np.cumsum(ql))).astype(np.int32)
            table = np.ascontiguousarray(table[:, :cols])
        base = int(rng.integers(0, 5))  # query_start_loc need not start at 0
        q_total = int(ql.sum())
        queries = int(rng.integers(q_total, max_q + 1)) if trial % 2 else max_q
        plan = builder.build(qsl + base, kv, table, queries=queries)
        ref, *_ = padded_reference(qsl, kv, table, ql, max_seqs + 1, width, queries, page_size, num_pages)
        assert plan.queries == queries and plan.sequences == max_seqs + 1
        np.testing.assert_array_equal(plan.words, ref.upload(np.zeros(1, np.float32)).words)
        assert builder.errors() == 0


def test_strided_block_table_rows_and_reuse():
    """vLLM's block table is a row slice of a wider persistent buffer; one plan object per Q is reused."""
    builder = DevicePlanBuilder(8, 3, 4, 4, 50, np.zeros(1, np.float32))
    big = rng.integers(0, 50, (5, 7)).astype(np.int32)
    qsl, kv = np.array([0, 1, 4, 5], np.int32), np.array([9, 12, 3], np.int32)
    plan = builder.build(qsl, kv, big[:3, :4], queries=8)
    ref, *_ = padded_reference(qsl, kv, big[:3, :4], np.diff(qsl), 4, 4, 8, 4, 50)
    np.testing.assert_array_equal(plan.words, ref.words)
    assert builder.build(qsl, kv, big[:3, :4], queries=8) is plan
    assert np.shares_memory(plan.words, builder.words)


#: (dtype, Hq, Hkv, D, page size): the CUDA-core kernel, the tensor-core decode kernel, and (a group of 32 query
#: heads) the row-packed tensor-core kernel, whose blocks meet queries of whatever sequences the device wrote.
ATTENTION_CASES = [("f32", 4, 2, 64, 4), ("f16", 8, 1, 64, 16), ("f16", 32, 1, 64, 8)]


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "d", "page_size"), ATTENTION_CASES)
def test_attention_through_device_plan_matches_reference(dtype, heads, kv_heads, d, page_size):
    width, num_pages, max_seqs, max_q = 5, 40, 5, 48
    np_dtype = np.float32 if dtype == "f32" else np.float16
    builder = DevicePlanBuilder(max_q, max_seqs, width, page_size, num_pages, np.zeros(1, np_dtype))
    k_cache = rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np_dtype)
    v_cache = rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np_dtype)
    for _ in range(2):
        qsl, kv, table, ql = random_step(max_seqs, page_size, width, num_pages)
        plan = builder.build(qsl, kv, table)
        q = rng.standard_normal((max_q, heads, d)).astype(np_dtype)
        q[int(ql.sum()) :] = np.nan  # padded query rows: their output is 0 whatever they hold
        out = np.full((max_q, heads, d), 7, np_dtype)
        plan.attention(q, k_cache, v_cache, 0.125, True, out=out)
        t = int(ql.sum())
        want, _ = reference.scored_attention(q[:t], k_cache, v_cache, table, kv, ql, 0.125, True)
        tol = 2e-5 if dtype == "f32" else 3e-3
        np.testing.assert_allclose(out[:t].astype(np.float64), want, rtol=tol, atol=tol)
        np.testing.assert_array_equal(out[t:], 0)
        assert builder.errors() == 0


def test_bad_shapes_raise_naming_the_argument_before_any_launch():
    builder = DevicePlanBuilder(8, 2, 3, 4, 10, np.zeros(1, np.float32))
    before = builder.words.copy()
    qsl, kv, table = np.array([0, 1, 2], np.int32), np.array([3, 4], np.int32), np.zeros((2, 3), np.int32)
    cases = [
        ((qsl.astype(np.int64), kv, table), "query_start_loc: expected a 1-D int32 array"),
        ((qsl, kv.astype(np.uint32), table), "seq_lens: expected a 1-D int32 array"),
        ((qsl, kv, table[0]), "block_table: expected a 2-D int32 array"),
        ((qsl[:2], kv, table), r"query_start_loc: expected shape \[3\]"),
        ((qsl, kv, table[:1]), "block_table: expected 2 rows"),
        ((qsl, kv, np.zeros((2, 4), np.int32)), "block_table: expected at most 3 columns"),
        ((qsl, kv, np.zeros((2, 6), np.int32)[:, ::2]), "block_table: expected contiguous rows"),
        (
            (np.arange(4, dtype=np.int32), np.ones(3, np.int32), np.zeros((3, 3), np.int32)),
            "seq_lens: expected at most 2",
        ),
        ((list(qsl), kv, table), "query_start_loc: expected a NumPy or CuPy array"),
    ]
    for args, match in cases:
        with pytest.raises(PagedAttentionError, match=match):
            builder.build(*args)
    with pytest.raises(PagedAttentionError, match="queries: expected"):
        builder.build(qsl, kv, table, queries=9)
    with pytest.raises(PagedAttentionError, match="page_size"):
        DevicePlanBuilder(8, 2, 3, 0, 10, np.zeros(1))
    np.testing.assert_array_equal(builder.words, before)


def test_bad_values_give_a_safe_plan_and_status_bits():
    """Values no host check sees: the plan reads nothing for them, the status names them."""
    Q, S, W, P, N = 10, 3, 2, 4, 6
    builder = DevicePlanBuilder(Q, S, W, P, N, np.zeros(1, np.float32))
    table = np.array([[0, 1], [2, 3], [4, 5]], np.int32)

    plan = builder.build(np.array([0, 4, 2, 5], np.int32), np.array([5, 5, 5], np.int32), table)
    assert builder.errors() == plan_build.BAD_QUERY_START
    ref, *_ = padded_reference(np.zeros(4, np.int32), np.array([5, 5, 5]), table, np.zeros(3, int), S + 1, W, Q, P, N)
    np.testing.assert_array_equal(plan.words, ref.words)  # the step padded out: every query in the padding row
    builder.build(np.array([0, 4, 8, 12], np.int32), np.array([5, 5, 5], np.int32), table)
    assert builder.errors() == plan_build.BAD_QUERY_START  # more queries than the plan's 10

    plan = builder.build(np.array([0, 1, 2, 3], np.int32), np.array([-3, 9, 2**31 - 1], np.int32), table)
    assert builder.errors() == plan_build.BAD_SEQ_LEN | plan_build.NEGATIVE_POSITION
    ref, *_ = padded_reference(np.array([0, 1, 2, 3]), np.zeros(3, int), table, np.ones(3, int), S + 1, W, Q, P, N)
    np.testing.assert_array_equal(plan.words, ref.words)  # lengths out of range read nothing
    assert plan.host.causal_ok and plan.host.stable  # the host cannot know: the status bit says it

    bad_table = np.array([[0, -1], [6, 2**31 - 1], [4, 9]], np.int32)
    plan = builder.build(np.array([0, 1, 2, 3], np.int32), np.array([5, 5, 4], np.int32), bad_table)
    assert builder.errors() == plan_build.BAD_PAGE  # [0, 1], [1, 0], [1, 1] inside their lengths; [2, 1] is not
    pt = plan.words[-(S + 1) * W :].reshape(S + 1, W)
    np.testing.assert_array_equal(pt[:3], [[0, 0xFFFFFFFF], [0xFFFFFFFF, 0xFFFFFFFF], [4, 0xFFFFFFFF]])
    with pytest.raises(PagedAttentionError, match="device plan metadata: a block id"):
        builder.build(np.array([0, 1, 2, 3], np.int32), np.array([5, 5, 4], np.int32), bad_table)
        builder.check()
    builder.check()  # cleared
