"""The peers' own cases for the score variants, ported at their tolerances
(issue #14): FlashInfer's logits soft cap (tests/test_logits_cap.py) and
attention sink (tests/attention/test_attention_sink.py) tests, vLLM's
sliding-window / soft-cap varlen tests (tests/kernels/attention/
test_flash_attn.py) and its ALiBi paged decode (test_attention.py). The
peers' references are ported as float64 NumPy, written from their code's
masks and formulas (not cupaged's reference), and their parameter grids are
cut to what the CPU backend runs in seconds.

Conventions met here (docs/layout.md, "Score variants and visibility"):
FlashInfer's ``window_left = w`` is cupaged's ``window = w + 1`` and vLLM's
``sliding_window = w`` (FlashAttention ``window_size = (w - 1, 0)``) is
``window = w``; FlashInfer's test sinks are weights ``exp(s)``, cupaged's are
logits ``s`` (gpt-oss's, vLLM's); vLLM's ALiBi bias is ``slope * (k - (L -
1))`` for a decode at ``L - 1``, cupaged's ``slope * (k_pos - q_pos)``.
cupaged refuses causal attention with more queries than keys (FlashInfer
skips it too: "qo_len > kv_len and causal is not supported"), so vLLM's
causal-prefix-mask case is not ported; non-causal, such queries are ported
from FlashInfer's soft-cap prefill."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged.testing import as_dtype


def _assert_close(actual, expected, atol, rtol, what=""):
    np.testing.assert_allclose(np.asarray(actual).astype(np.float64), expected, atol=atol, rtol=rtol, err_msg=what)


def _paged(rng, keys, values, page_size, dtype, num_pages=None):
    """Scatter per-sequence dense K / V ([len, Hkv, D] each) into random
    pages: (page_table, k_cache, v_cache, num_pages)."""
    need = [-(-len(k) // page_size) for k in keys]
    num_pages = num_pages or sum(need) + 3
    perm = rng.permutation(num_pages)
    width = max(max(need), 1)
    table = np.zeros((len(keys), width), np.int32)
    hkv, d = keys[0].shape[1:]
    dv = values[0].shape[2]
    kc = rng.standard_normal((num_pages, page_size, hkv, d)).astype(as_dtype(dtype))
    vc = rng.standard_normal((num_pages, page_size, hkv, dv)).astype(as_dtype(dtype))
    start = 0
    for s, (k, v) in enumerate(zip(keys, values)):
        table[s, : need[s]] = perm[start : start + need[s]]
        start += need[s]
        t = np.arange(len(k))
        kc[table[s, t // page_size], t % page_size] = k
        vc[table[s, t // page_size], t % page_size] = v
    return table, kc, vc, num_pages


def _run(q, keys, values, q_lens, page_size, dtype, scale, causal, rng, **features):
    table, kc, vc, pages = _paged(rng, keys, values, page_size, dtype)
    kv_lens = np.array([len(k) for k in keys])
    plan = cupaged.HostPlan.build(table, kv_lens, np.array(q_lens), page_size, pages).upload(q)
    return plan.attention(q, kc, vc, scale, causal, **features)


def _softmax_rows(x):
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


# ----------------------------------------------------------------- FlashInfer: logits soft cap


def _flashinfer_soft_cap_ref(q, k, v, soft_cap):
    """attention_logits_soft_cap_torch (FlashInfer tests/test_logits_cap.py):
    MHA, scale 1/sqrt(D), no mask, cap * tanh(s / cap), in float64."""
    d = q.shape[-1]
    s = np.einsum("qhd,khd->qkh", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
    s = soft_cap * np.tanh(s / soft_cap)
    p = _softmax_rows(np.moveaxis(s, 1, 2))  # [q, h, k]
    return np.einsum("qhk,khd->qhd", p, v.astype(np.float64))


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("soft_cap", [1.0, 30.0, 50.0])
def test_flashinfer_single_decode_logits_soft_cap(head_dim, soft_cap):
    """test_single_decode_logits_soft_cap: seq_len 1 / 9 / 81 / 729 (and
    33001 at 4 heads), heads 4 / 32, f16, rtol = atol = 1e-3."""
    rng = np.random.default_rng(int(head_dim + soft_cap))
    for seq_len, heads in ((1, 4), (9, 32), (81, 4), (729, 32), (33001, 4)):
        if seq_len > 1000 and head_dim == 256:
            continue
        q = rng.standard_normal((1, heads, head_dim)).astype(np.float16)
        k = rng.standard_normal((seq_len, heads, head_dim)).astype(np.float16)
        v = rng.standard_normal((seq_len, heads, head_dim)).astype(np.float16)
        o = _run(q, [k], [v], [1], 16, "f16", head_dim**-0.5, True, rng, soft_cap=soft_cap)
        _assert_close(o, _flashinfer_soft_cap_ref(q, k, v, soft_cap), 1e-3, 1e-3, f"seq {seq_len}, heads {heads}")


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("soft_cap", [1.0, 30.0, 50.0])
def test_flashinfer_single_prefill_logits_soft_cap(head_dim, soft_cap):
    """test_single_prefill_logits_soft_cap: single_prefill_with_kv_cache's
    default, not causal; q_len 1 / 17 / 81 against kv_len 1 / 17 / 81 / 987
    (queries outnumbering keys among them), 4 heads, f16, rtol = atol =
    1e-2."""
    rng = np.random.default_rng(int(head_dim * soft_cap))
    for q_len in (1, 17, 81):
        for kv_len in (1, 17, 81, 987):
            q = rng.standard_normal((q_len, 4, head_dim)).astype(np.float16)
            k = rng.standard_normal((kv_len, 4, head_dim)).astype(np.float16)
            v = rng.standard_normal((kv_len, 4, head_dim)).astype(np.float16)
            o = _run(q, [k], [v], [q_len], 16, "f16", head_dim**-0.5, False, rng, soft_cap=soft_cap)
            _assert_close(o, _flashinfer_soft_cap_ref(q, k, v, soft_cap), 1e-2, 1e-2, f"q {q_len}, kv {kv_len}")


# ----------------------------------------------------------------- FlashInfer: attention sinks


def _flashinfer_sink_ref(q, k, v, sink, window_left, causal, sm_scale, batch, seq_len):
    """sink_attention_ref (prefill mode): q_len = kv_len = seq_len per batch
    entry, GQA by repeat, causal and window_left masks, softmax over
    [logits, log(sink)] with the sink column dropped; float64."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = np.repeat(k.astype(np.float64), hq // hkv, axis=1)
    vv = np.repeat(v.astype(np.float64), hq // hkv, axis=1)
    out = np.zeros(q.shape)
    for b in range(batch):
        sl = slice(b * seq_len, (b + 1) * seq_len)
        logits = np.einsum("mhd,nhd->hmn", q[sl].astype(np.float64), kk[sl]) * sm_scale
        i, j = np.arange(seq_len)[:, None], np.arange(seq_len)[None, :]
        mask = (i >= j) if causal else np.ones((seq_len, seq_len), bool)
        if window_left >= 0:
            mask &= i - window_left <= j
        logits = np.where(mask[None], logits, -np.inf)
        cols = np.concatenate([logits, np.broadcast_to(np.log(sink)[:, None, None], (hq, seq_len, 1))], axis=-1)
        p = _softmax_rows(cols)[..., :-1]
        out[sl] = np.einsum("hmn,nhd->mhd", p, vv[sl])
    return out


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("window_left", [-1, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_flashinfer_attention_sink(dtype, window_left, causal):
    """test_attention_sink: 32 query heads, 8 or 32 KV heads, D 128, batches
    of equal q_len = kv_len (1 / 16 / 128), sink = rand * 5 (a weight; its
    log is cupaged's logit), one-token pages; f16 rtol = atol = 1e-3, bf16
    1e-2."""
    rng = np.random.default_rng(42 + window_left + causal)
    tol = 1e-3 if dtype == "f16" else 1e-2
    for batch, seq_len, hkv in ((1, 1, 8), (4, 16, 32), (2, 128, 8)):
        dt = as_dtype(dtype)
        q = rng.standard_normal((batch * seq_len, 32, 128)).astype(dt)
        k = rng.standard_normal((batch * seq_len, hkv, 128)).astype(dt)
        v = rng.standard_normal((batch * seq_len, hkv, 128)).astype(dt)
        sink = (rng.random(32) * 5).astype(np.float32)
        window = None if window_left < 0 else window_left + 1
        keys = [k[b * seq_len : (b + 1) * seq_len] for b in range(batch)]
        values = [v[b * seq_len : (b + 1) * seq_len] for b in range(batch)]
        o = _run(
            q,
            keys,
            values,
            [seq_len] * batch,
            1,
            dtype,
            128**-0.5,
            causal,
            rng,
            sinks=np.log(sink).astype(np.float32),
            window=window,
        )
        ref = _flashinfer_sink_ref(q, k, v, sink, window_left, causal, 128**-0.5, batch, seq_len)
        _assert_close(o, ref, tol, tol, f"batch {batch}, seq {seq_len}, kv heads {hkv}")


# ----------------------------------------------------------------- vLLM: sliding window and soft cap


def _vllm_ref_paged_attn(query, keys, values, query_lens, scale, sliding_window=None, soft_cap=None):
    """ref_paged_attn (vLLM tests/kernels/attention/test_flash_attn.py),
    causal: window_size (sliding_window - 1, 0); mask col > row + shift or
    col < row + shift - left; cap * tanh(s / cap); fully masked rows 0;
    float64."""
    outputs, start = [], 0
    for q_len, k, v in zip(query_lens, keys, values):
        kv_len = len(k)
        q = query[start : start + q_len].astype(np.float64) * scale
        g = q.shape[1] // k.shape[1]
        kk = np.repeat(k.astype(np.float64), g, axis=1)
        vv = np.repeat(v.astype(np.float64), g, axis=1)
        attn = np.einsum("qhd,khd->hqk", q, kk)
        row, col = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        shift = kv_len - q_len
        mask = col > row + shift
        if sliding_window is not None:
            mask |= col < row + shift - (sliding_window - 1)
        if soft_cap is not None:
            attn = soft_cap * np.tanh(attn / soft_cap)
        attn = np.where(mask[None], -np.inf, attn)
        p = _softmax_rows(attn)
        outputs.append(np.einsum("hqk,khd->qhd", p, vv))
        start += q_len
    return np.concatenate(outputs)


def _vllm_case(rng, seq_lens, num_heads, head_size, block_size, dtype):
    dt = as_dtype(dtype)
    hq, hkv = num_heads
    q_lens = [a for a, _ in seq_lens]
    query = rng.standard_normal((sum(q_lens), hq, head_size)).astype(dt)
    keys = [rng.standard_normal((n, hkv, head_size)).astype(dt) for _, n in seq_lens]
    values = [rng.standard_normal((n, hkv, head_size)).astype(dt) for _, n in seq_lens]
    return query, keys, values, q_lens


#: (num_heads, head_size, block_size) each window / soft cap pair takes in turn (vLLM's grids, cut).
_VLLM_SHAPES = [((4, 4), 128, 16), ((8, 2), 256, 32), ((16, 2), 128, 64), ((6, 2), 64, 16), ((12, 3), 96, 32)]


@pytest.mark.parametrize("sliding_window", [None, 1, 32, 256, 1024])
@pytest.mark.parametrize("soft_cap", [None, 10.0])
def test_vllm_varlen_with_paged_kv(sliding_window, soft_cap):
    """test_varlen_with_paged_kv: seq_lens (1, 1328), (5, 18), (129, 463),
    causal, f16, atol 1.5e-2, rtol 1e-2 (a decode, a short and a long chunk:
    per-query and tensor-core kernels in one step)."""
    i = [None, 1, 32, 256, 1024].index(sliding_window) + (soft_cap is not None)
    num_heads, head_size, block_size = _VLLM_SHAPES[i % len(_VLLM_SHAPES)]
    rng = np.random.default_rng(i)
    query, keys, values, q_lens = _vllm_case(
        rng, [(1, 1328), (5, 18), (129, 463)], num_heads, head_size, block_size, "f16"
    )
    scale = head_size**-0.5
    o = _run(query, keys, values, q_lens, block_size, "f16", scale, True, rng, window=sliding_window, soft_cap=soft_cap)
    ref = _vllm_ref_paged_attn(query, keys, values, q_lens, scale, sliding_window, soft_cap)
    _assert_close(o, ref, 1.5e-2, 1e-2)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("sliding_window", [1, 5])
@pytest.mark.parametrize("soft_cap", [None, 10.0])
def test_vllm_varlen_with_paged_kv_block_boundaries(block_size, sliding_window, soft_cap):
    """test_varlen_with_paged_kv_block_boundaries: lengths around the block
    size, head size 80 (the runtime-dim kernel), the edge head counts in
    turn, f16, atol 2e-2, rtol 1e-2."""
    edge = [(1, 1), (2, 2), (4, 1), (6, 2), (8, 4), (12, 3), (16, 2)]
    num_heads = edge[(block_size // 16 + sliding_window + (soft_cap is not None)) % len(edge)]
    rng = np.random.default_rng(block_size + sliding_window)
    seq_lens = [(1, block_size - 1), (2, block_size), (3, block_size + 1), (block_size + 1, 2 * block_size + 1)]
    query, keys, values, q_lens = _vllm_case(rng, seq_lens, num_heads, 80, block_size, "f16")
    scale = 80**-0.5
    o = _run(query, keys, values, q_lens, block_size, "f16", scale, True, rng, window=sliding_window, soft_cap=soft_cap)
    ref = _vllm_ref_paged_attn(query, keys, values, q_lens, scale, sliding_window, soft_cap)
    _assert_close(o, ref, 2e-2, 1e-2)


# ----------------------------------------------------------------- vLLM: ALiBi paged decode


@pytest.mark.parametrize("num_heads, head_size", [((40, 40), 64), ((40, 40), 96), ((64, 8), 128), ((64, 8), 256)])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_vllm_paged_attention_alibi(num_heads, head_size, dtype):
    """test_paged_attention with use_alibi (vLLM tests/kernels/attention/
    test_attention.py): 7 sequences, block size 16, query and caches
    uniform(-scale, scale), slopes randn; ref_single_query_cached_kv_attention
    adds slope * (position - seq_len + 1); atol 1e-3, rtol 1e-5."""
    rng = np.random.default_rng(head_size + num_heads[1])
    hq, hkv = num_heads
    scale = head_size**-0.5
    dt = as_dtype(dtype)
    seq_lens = rng.integers(1, 1024, 7)
    query = rng.uniform(-scale, scale, (7, hq, head_size)).astype(dt)
    keys = [rng.uniform(-scale, scale, (n, hkv, head_size)).astype(dt) for n in seq_lens]
    values = [rng.uniform(-scale, scale, (n, hkv, head_size)).astype(dt) for n in seq_lens]
    slopes = rng.standard_normal(hq).astype(np.float32)
    o = _run(query, keys, values, [1] * 7, 16, dtype, scale, True, rng, alibi_slopes=slopes)
    for i, n in enumerate(seq_lens):
        kk = np.repeat(keys[i].astype(np.float64), hq // hkv, axis=1)
        vv = np.repeat(values[i].astype(np.float64), hq // hkv, axis=1)
        s = scale * np.einsum("hd,nhd->hn", query[i].astype(np.float64), kk)
        s += slopes[:, None].astype(np.float64) * (np.arange(n) - n + 1)[None, :]
        ref = np.einsum("hn,nhd->hd", _softmax_rows(s), vv)
        _assert_close(o[i], ref, 1e-3, 1e-5, f"sequence {i} of {n} tokens")
