"""Float64 NumPy references: the independent oracle for every kernel test.

Each function is written plainly from the math and never calls a cupaged
kernel. Inputs of any float dtype (float32, float16, ``ml_dtypes.bfloat16``)
are cast to float64 first; those casts are exact, so the only rounding is
float64's.

Paged layout (the one definition the kernels follow):

* ``page_table`` int ``[sequences, table_width]``: entry ``[s, j]`` is the
  page holding tokens ``j*page_size .. (j+1)*page_size - 1`` of sequence
  ``s``. Entries past a sequence's length are never read (they may be -1 or
  any sentinel).
* ``kv_lens`` ``[sequences]``: tokens visible this step, this step's new
  tokens included.
* ``q_lens`` ``[sequences]``: new queries of each sequence,
  ``0 <= q_lens <= kv_lens``. Queries are packed in sequence order; query
  ``i`` of sequence ``s`` sits at absolute position
  ``kv_lens[s] - q_lens[s] + i``.
* Causal: the query at position ``p`` sees positions ``0..p`` of its
  sequence (bottom-right aligned); non-causal: all ``kv_lens[s]`` tokens.
* LSE is the natural log of ``sum(exp(score))``. A query that sees no key
  has output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import numpy as np


def _f64(x) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # a signalling NaN casts to a quiet NaN
        return np.asarray(x).astype(np.float64)


def _lengths(kv_lens, q_lens) -> tuple[np.ndarray, np.ndarray]:
    kv = np.asarray(kv_lens, dtype=np.int64)
    ql = np.asarray(q_lens, dtype=np.int64)
    if kv.ndim != 1 or ql.shape != kv.shape:
        raise ValueError(f"kv_lens {kv.shape} and q_lens {ql.shape} must be 1-D of one length")
    if np.any(ql < 0) or np.any(ql > kv):
        raise ValueError(f"expected 0 <= q_lens <= kv_lens, got q_lens {ql.tolist()}, kv_lens {kv.tolist()}")
    return kv, ql


# --------------------------------------------------------------------------
# Positions and gathering
# --------------------------------------------------------------------------


def query_positions(kv_lens, q_lens) -> tuple[np.ndarray, np.ndarray]:
    """Sequence and absolute position of every packed query.

    kv_lens, q_lens: [sequences]. Returns ``(q_seq [queries], q_pos [queries])``
    (int64): query ``i`` of sequence ``s`` has position ``kv_lens[s] - q_lens[s] + i``.
    """
    kv, ql = _lengths(kv_lens, q_lens)
    q_seq = np.repeat(np.arange(len(kv), dtype=np.int64), ql)
    q_pos = np.concatenate([np.arange(k - n, k, dtype=np.int64) for k, n in zip(kv, ql)] + [np.zeros(0, np.int64)])
    return q_seq, q_pos


def visible_lengths(kv_lens, q_lens, causal: bool = True) -> np.ndarray:
    """Keys each packed query sees, int64 [queries]: ``q_pos + 1`` when causal,
    else its sequence's ``kv_lens``."""
    q_seq, q_pos = query_positions(kv_lens, q_lens)
    return q_pos + 1 if causal else np.asarray(kv_lens, dtype=np.int64)[q_seq]


def gather_kv(cache, page_table, s: int, length: int) -> np.ndarray:
    """The first ``length`` tokens of sequence ``s`` as a dense float64 array.

    cache: [pages, page_size, H, D]; page_table: [sequences, table_width].
    Returns [length, H, D]. Reads only ``page_table[s, :ceil(length / page_size)]``
    and, within those pages, only the slots of the first ``length`` tokens.
    """
    cache = np.asarray(cache)
    page_size = cache.shape[1]
    t = np.arange(int(length))
    pages = np.asarray(page_table)[s, t // page_size].astype(np.int64)
    return _f64(cache[pages, t % page_size])


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------


def _attend(q, k, v, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of one query over ``n`` keys, GQA by head grouping.

    q: [Hq, D]; k: [n, Hkv, D]; v: [n, Hkv, Dv] (all float64).
    Returns (out [Hq, Dv], lse [Hq]); n == 0 gives out 0, lse -inf.
    """
    hq, hkv, dv = q.shape[0], k.shape[1], v.shape[2]
    if k.shape[0] == 0:
        return np.zeros((hq, dv)), np.full(hq, -np.inf)
    kv_head = np.arange(hq) // (hq // hkv)  # query head h uses kv head h // group
    scores = scale * np.einsum("hd,nhd->hn", q, k[:, kv_head])  # [Hq, n]
    m = scores.max(axis=1, keepdims=True)  # subtract the max: exp never overflows
    p = np.exp(scores - m)  # [Hq, n]
    total = p.sum(axis=1)  # [Hq]
    out = np.einsum("hn,nhd->hd", p, v[:, kv_head]) / total[:, None]
    return out, m[:, 0] + np.log(total)


def _check_attention_shapes(q, k_cache, v_cache, page_table, kv_lens, q_lens) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(
            f"expected q [queries, Hq, D] and caches [pages, page_size, Hkv, D], got "
            f"{q.shape}, {k_cache.shape}, {v_cache.shape}"
        )
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"cache shapes do not match: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k_cache.shape[2]}")
    if q.shape[0] != int(np.sum(q_lens)):
        raise ValueError(f"q has {q.shape[0]} queries, sum(q_lens) is {int(np.sum(q_lens))}")
    if np.asarray(page_table).shape[0] != len(kv_lens):
        raise ValueError(f"page_table has {np.asarray(page_table).shape[0]} rows for {len(kv_lens)} sequences")


def _paged_attention_ranges(q, k_cache, v_cache, page_table, kv_lens, q_lens, scale, causal, key_range):
    """Attention of every packed query over the keys it sees that also lie in
    ``key_range(s) = (lo, hi)`` (token positions of sequence s)."""
    q, k_cache, v_cache = np.asarray(q), np.asarray(k_cache), np.asarray(v_cache)
    _check_attention_shapes(q, k_cache, v_cache, page_table, kv_lens, q_lens)
    kv, _ = _lengths(kv_lens, q_lens)
    q_seq, _ = query_positions(kv_lens, q_lens)
    seen = visible_lengths(kv_lens, q_lens, causal)
    q64 = _f64(q)
    out = np.zeros(q.shape[:2] + (v_cache.shape[3],))  # [queries, Hq, Dv]
    lse = np.full(q.shape[:2], -np.inf)  # [queries, Hq]
    for s in range(len(kv)):
        keys = gather_kv(k_cache, page_table, s, kv[s])  # [kv_len, Hkv, D]
        values = gather_kv(v_cache, page_table, s, kv[s])  # [kv_len, Hkv, Dv]
        lo, hi = key_range(s)
        for i in np.nonzero(q_seq == s)[0]:
            stop = min(hi, seen[i])
            start = min(lo, stop)
            out[i], lse[i] = _attend(q64[i], keys[start:stop], values[start:stop], scale)
    return out, lse


def paged_attention(
    q, k_cache, v_cache, page_table, kv_lens, q_lens, scale: float, causal: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Paged multi-/grouped-query attention for packed queries.

    q: [queries, Hq, D]; k_cache: [pages, page_size, Hkv, D];
    v_cache: [pages, page_size, Hkv, Dv]; page_table: [sequences, table_width];
    kv_lens, q_lens: [sequences]. Query head h uses kv head ``h // (Hq // Hkv)``.
    score = scale * q.k over the keys the query sees (see the module docstring).

    Returns (out [queries, Hq, Dv] float64, lse [queries, Hq] float64).
    """
    return _paged_attention_ranges(
        q, k_cache, v_cache, page_table, kv_lens, q_lens, scale, causal, lambda s: (0, np.iinfo(np.int64).max)
    )


def _soft_cap(x, cap, head, q_pos, k_pos):
    return cap * np.tanh(x / cap)


def _alibi(x, slopes, head, q_pos, k_pos):
    return x + _f64(slopes)[head][:, None] * (k_pos[None, :] - q_pos)


#: The float64 logit hook of each option row that changes the logit
#: (``cupaged/ops/attention/options.py``, ``Option.reference``), in the
#: kernels' order (a score variant's first, then the cap, then ALiBi):
#: ``hook(x [Hq, n] logits, value, head [Hq], q_pos, k_pos [n]) -> logits``.
LOGIT_HOOKS = {"soft_cap": _soft_cap, "alibi_slopes": _alibi}


def scored_attention(
    q,
    k_cache,
    v_cache,
    page_table,
    kv_lens,
    q_lens,
    scale: float,
    causal: bool = True,
    *,
    window=None,
    sinks=None,
    **logit_options,
) -> tuple[np.ndarray, np.ndarray]:
    """Paged attention with the score variants (docs/layout.md, "Score
    variants and visibility"), written from their definitions; shapes as in
    ``paged_attention``. Query i of sequence s sits at position
    ``p = kv_lens[s] - q_lens[s] + i``, negative when ``q_lens > kv_lens``
    (allowed here when not causal, or when kv_lens[s] is 0).

    * visible keys: ``0 .. p`` when causal, else ``0 .. kv_lens[s] - 1``;
      with ``window`` only those ``>= p - window + 1``;
    * logit of key k for head h: ``x = scale * q.k``, then each hook of
      ``LOGIT_HOOKS`` given in ``logit_options`` in its order: ``x =
      soft_cap * tanh(x / soft_cap)``; ``x += alibi_slopes[h] * (k - p)``;
    * ``sinks`` [Hq] (natural-unit logits): ``out = sum_k exp(x_k) v_k /
      (exp(sinks[h]) + sum_k exp(x_k))`` and ``lse = log(exp(sinks[h]) +
      sum_k exp(x_k))``; a query that sees nothing gets out 0 and lse
      ``sinks[h]`` (``-inf`` without sinks).

    Returns (out [queries, Hq, Dv], lse [queries, Hq]), float64.
    """
    q, k_cache, v_cache = np.asarray(q), np.asarray(k_cache), np.asarray(v_cache)
    kv = np.asarray(kv_lens, dtype=np.int64)
    ql = np.asarray(q_lens, dtype=np.int64)
    if kv.ndim != 1 or ql.shape != kv.shape or np.any(ql < 0) or np.any(kv < 0):
        raise ValueError(f"expected kv_lens and q_lens of one length, >= 0; got {kv.tolist()}, {ql.tolist()}")
    if causal and np.any((ql > kv) & (kv > 0)):
        raise ValueError("causal attention needs q_lens <= kv_lens where kv_lens > 0")
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.shape[:3] != k_cache.shape[:3] or q.shape[0] != ql.sum():
        raise ValueError(
            f"shapes do not match: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}, q_lens sum {int(ql.sum())}"
        )
    hq, hkv, dv = q.shape[1], k_cache.shape[2], v_cache.shape[3]
    kv_head = np.arange(hq) // (hq // hkv)
    q64 = _f64(q)
    sink = None if sinks is None else _f64(sinks).reshape(hq)
    unknown = [n for n in logit_options if n not in LOGIT_HOOKS]
    if unknown:
        raise ValueError(f"no reference hook for {unknown} (LOGIT_HOOKS: {list(LOGIT_HOOKS)})")
    hooks = [(h, logit_options[n]) for n, h in LOGIT_HOOKS.items() if logit_options.get(n) is not None]
    heads = np.arange(hq)
    out = np.zeros((q.shape[0], hq, dv))
    lse = np.full((q.shape[0], hq), -np.inf) if sink is None else np.tile(sink, (q.shape[0], 1))
    i = 0
    for s in range(len(kv)):
        keys = gather_kv(k_cache, page_table, s, kv[s])[:, kv_head]  # [kv_len, Hq, D]
        values = gather_kv(v_cache, page_table, s, kv[s])[:, kv_head]  # [kv_len, Hq, Dv]
        for j in range(ql[s]):
            p = int(kv[s] - ql[s] + j)
            hi = min(p + 1, int(kv[s])) if causal else int(kv[s])
            lo = 0 if window is None else max(0, p - int(window) + 1)
            if lo < hi:
                pos = np.arange(lo, hi)
                x = scale * np.einsum("hd,nhd->hn", q64[i], keys[lo:hi])  # [Hq, n]
                for hook, value in hooks:
                    x = hook(x, value, heads, p, pos)
                cols = x if sink is None else np.concatenate([x, sink[:, None]], axis=1)
                m = cols.max(axis=1, keepdims=True)
                e = np.exp(cols - m)
                total = e.sum(axis=1)
                out[i] = np.einsum("hn,nhd->hd", e[:, : hi - lo], values[lo:hi]) / total[:, None]
                lse[i] = m[:, 0] + np.log(total)
            i += 1
    return out, lse


def mla_as_attention(q, q_pos, latent, k_pos) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLA operands as plain attention operands, so every attention reference
    (``paged_attention``, ``split_attention_partials``) serves MLA too.

    q: [queries, H, R]; q_pos: [queries, H, P]; latent: [pages, page_size, 1, R];
    k_pos: [pages, page_size, 1, P]. Returns (queries [queries, H, R + P],
    keys [pages, page_size, 1, R + P], values = latent) in float64: the dot
    product of ``[q, q_pos]`` with ``[latent, k_pos]`` is exactly
    ``q.latent + q_pos.k_pos``.
    """
    q, q_pos, latent, k_pos = (np.asarray(a) for a in (q, q_pos, latent, k_pos))
    if latent.ndim != 4 or latent.shape[2] != 1 or k_pos.shape[:3] != latent.shape[:3]:
        raise ValueError(
            f"expected latent [pages, page_size, 1, R] and k_pos [pages, page_size, 1, P], "
            f"got {latent.shape}, {k_pos.shape}"
        )
    if q.ndim != 3 or q_pos.shape[:2] != q.shape[:2] or q_pos.shape[2] != k_pos.shape[3]:
        raise ValueError(f"expected q [queries, H, R] and q_pos [queries, H, P], got {q.shape}, {q_pos.shape}")
    return (
        np.concatenate([_f64(q), _f64(q_pos)], axis=-1),
        np.concatenate([_f64(latent), _f64(k_pos)], axis=-1),
        _f64(latent),
    )


def paged_mla(
    q, q_pos, latent, k_pos, page_table, kv_lens, q_lens, scale: float, causal: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Paged multi-head latent attention (one shared latent head).

    q: [queries, H, R]; q_pos: [queries, H, P]; latent: [pages, page_size, 1, R];
    k_pos: [pages, page_size, 1, P]. score = scale * (q.latent + q_pos.k_pos),
    values are the latent rows. Returns (out [queries, H, R], lse [queries, H]),
    float64.
    """
    return paged_attention(*mla_as_attention(q, q_pos, latent, k_pos), page_table, kv_lens, q_lens, scale, causal)


# --------------------------------------------------------------------------
# Split-KV partials and their merge
# --------------------------------------------------------------------------


def split_attention_partials(
    q,
    k_cache,
    v_cache,
    page_table,
    kv_lens,
    q_lens,
    scale: float,
    split_size,
    num_splits: int | None = None,
    causal: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-split partial attention over token ranges.

    Split ``j`` of sequence ``s`` covers key positions
    ``[j * split_size[s], (j + 1) * split_size[s])`` (``split_size``: an int or
    [sequences]), intersected with what each query sees. ``num_splits``
    defaults to the most any sequence needs. Shapes as in ``paged_attention``.

    Returns (partial_out [splits, queries, Hq, Dv], partial_lse [splits, queries, Hq]);
    a split with no visible key has out 0 and lse -inf.
    """
    kv = np.asarray(kv_lens, dtype=np.int64)
    size = np.broadcast_to(np.asarray(split_size, dtype=np.int64), kv.shape)
    if np.any(size < 1):
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    if num_splits is None:
        num_splits = int(max([1] + [-(-k // n) for k, n in zip(kv, size)]))
    parts = [
        _paged_attention_ranges(
            q,
            k_cache,
            v_cache,
            page_table,
            kv_lens,
            q_lens,
            scale,
            causal,
            lambda s, j=j: (j * size[s], (j + 1) * size[s]),
        )
        for j in range(num_splits)
    ]
    return np.stack([o for o, _ in parts]), np.stack([l for _, l in parts])


def merge_splits(partial_out, partial_lse) -> tuple[np.ndarray, np.ndarray]:
    """Log-sum-exp merge of split partial results.

    partial_out: [splits, queries, H, Dv]; partial_lse: [splits, queries, H].
    out = sum_j exp(lse_j - lse) * out_j with lse = log(sum_j exp(lse_j)).
    A split with lse -inf contributes nothing, whatever its partial out holds;
    if every split is empty the result is out 0, lse -inf.
    Returns (out [queries, H, Dv], lse [queries, H]), float64.
    """
    po, pl = _f64(partial_out), _f64(partial_lse)
    empty_split = pl == -np.inf  # [splits, queries, H]
    po = np.where(empty_split[..., None], 0.0, po)
    m = pl.max(axis=0)  # [queries, H]
    all_empty = m == -np.inf
    m = np.where(all_empty, 0.0, m)
    w = np.exp(pl - m)  # [splits, queries, H]; 0 for empty
    total = w.sum(axis=0)  # [queries, H]
    out = (w[..., None] * po).sum(axis=0) / np.where(all_empty, 1.0, total)[..., None]
    lse = np.where(all_empty, -np.inf, m + np.log(np.where(all_empty, 1.0, total)))
    return out, lse


# --------------------------------------------------------------------------
# Append
# --------------------------------------------------------------------------


def paged_append(new_k, new_v, k_cache, v_cache, page_table, kv_lens, q_lens) -> tuple[np.ndarray, np.ndarray]:
    """Write each packed query's new key/value row into the paged caches.

    new_k: [queries, Hkv, D]; new_v: [queries, Hkv, Dv];
    k_cache: [pages, page_size, Hkv, D]; v_cache: [pages, page_size, Hkv, Dv].
    The row of the query at position p of sequence s goes to page
    ``page_table[s, p // page_size]``, slot ``p % page_size``. Returns new
    caches (copies, the caches' dtype); every other slot is unchanged.
    """
    k_out, v_out = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    new_k, new_v = np.asarray(new_k), np.asarray(new_v)
    q_seq, q_pos = query_positions(kv_lens, q_lens)
    if new_k.shape != (len(q_seq),) + k_out.shape[2:] or new_v.shape != (len(q_seq),) + v_out.shape[2:]:
        raise ValueError(
            f"expected new_k [{len(q_seq)}, Hkv, D] and new_v [{len(q_seq)}, Hkv, Dv] matching "
            f"the caches, got {new_k.shape}, {new_v.shape}"
        )
    page_size = k_out.shape[1]
    for i, (s, p) in enumerate(zip(q_seq, q_pos)):
        page = int(page_table[s][p // page_size])
        k_out[page, p % page_size] = new_k[i]
        v_out[page, p % page_size] = new_v[i]
    return k_out, v_out


# --------------------------------------------------------------------------
# fp8 K/V storage
# --------------------------------------------------------------------------


def _fp8_type(fmt):
    import ml_dtypes

    names = {
        "e4m3": ml_dtypes.float8_e4m3fn,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "fp8": ml_dtypes.float8_e4m3fn,
        "fp8_e4m3": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2,
        "float8_e5m2": ml_dtypes.float8_e5m2,
        "fp8_e5m2": ml_dtypes.float8_e5m2,
    }
    t = names.get(fmt) if isinstance(fmt, str) else np.dtype(fmt).type
    if t not in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        raise ValueError(f"expected an fp8 format (e4m3 / e5m2), got {fmt!r}")
    return t


def quantize_fp8(x, fmt, scale=1.0) -> np.ndarray:
    """The fp8 codes appends store for ``x`` (any float array) with ``scale``
    (a number or an array broadcasting against x): ``x / scale`` divided in
    float32, clamped to +-max finite (saturation; NaN stays NaN) and rounded
    to the nearest code, ties to even, by ml_dtypes. Returns an ml_dtypes
    fp8 array of x's shape."""
    import ml_dtypes

    t = _fp8_type(fmt)
    mx = np.float32(ml_dtypes.finfo(t).max)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        y = np.asarray(x).astype(np.float32) / np.asarray(scale, np.float32)
        return np.clip(y, -mx, mx).astype(t)


def dequantize_fp8(codes, fmt=None, scale=1.0) -> np.ndarray:
    """The float64 values fp8 ``codes`` stand for: code * scale. ``codes``:
    an ml_dtypes fp8 array, or uint8 storage with ``fmt`` ("e4m3" / "e5m2");
    ``scale`` broadcasts against them (e.g. [Hkv, 1] for per-head scales of a
    [pages, page_size, Hkv, D] cache)."""
    c = np.asarray(codes)
    if c.dtype == np.uint8:
        c = c.view(_fp8_type(fmt))
    return _f64(c) * np.asarray(scale, np.float64)


# --------------------------------------------------------------------------
# Row-wise
# --------------------------------------------------------------------------


def row_argmax(logits) -> np.ndarray:
    """Index of the maximum of each row, int64 [batch].

    logits: [batch, vocab], vocab >= 1. Ties: the first index wins (-0.0 and
    +0.0 tie). NaN counts as larger than everything, so the first NaN of a
    row wins, as with ``numpy.argmax``. A row of -inf gives 0.
    """
    x = _f64(logits)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"expected logits [batch, vocab] with vocab >= 1, got shape {x.shape}")
    return np.argmax(x, axis=1).astype(np.int64)


def softmax(x, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along ``axis``, float64."""
    x = _f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# --------------------------------------------------------------------------
# Tiny-model pieces
# --------------------------------------------------------------------------


def rms_norm(x, weight, eps: float = 1e-6) -> np.ndarray:
    """x: [..., D]; weight: [D]. ``x / sqrt(mean(x**2) + eps) * weight``, float64."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(weight)


def rope_tables(positions, rotary_dim: int, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables [n, rotary_dim // 2] for integer ``positions`` [n]:
    angle[p, i] = p * base ** (-2 i / rotary_dim)."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # [rotary_dim / 2]
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n, rotary_dim / 2]
    return np.cos(angles), np.sin(angles)


def apply_rope(x, cos, sin, interleaved: bool = False) -> np.ndarray:
    """Rotary position embedding of x: [n, H, D] with tables cos, sin: [n, r/2].

    The first r dims are rotated, the rest pass through. Pairs are
    ``(i, i + r/2)`` (rotate-half, the Llama/NeoX layout), or ``(2i, 2i+1)``
    when ``interleaved``: ``(a, b) -> (a cos - b sin, b cos + a sin)``.
    """
    x = _f64(x)
    half = np.asarray(cos).shape[-1]
    c, s = _f64(cos)[:, None, :], _f64(sin)[:, None, :]  # [n, 1, r/2]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
        out[..., :half], out[..., half : 2 * half] = a * c - b * s, b * c + a * s
    return out


def linear_heads(x, w) -> np.ndarray:
    """One linear layer per head, float64: x [M, H, K], w [H, N, K] ->
    out [M, H, N] with out[m, h] = w[h] @ x[m, h]."""
    return np.einsum("mhk,hnk->mhn", _f64(x), _f64(w))


def silu(x) -> np.ndarray:
    """x * sigmoid(x), float64."""
    x = _f64(x)
    return x / (1.0 + np.exp(-x))


def swiglu_mlp(x, w_gate, w_up, w_down) -> np.ndarray:
    """SwiGLU MLP: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``.

    x: [n, D]; w_gate, w_up: [D, F]; w_down: [F, D]. Returns [n, D] float64.
    """
    x = _f64(x)
    return (silu(x @ _f64(w_gate)) * (x @ _f64(w_up))) @ _f64(w_down)


# --------------------------------------------------------------------------
# Sampling (cupaged.ops.sample)
# --------------------------------------------------------------------------

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 (Salmon et al. 2011, Random123) of ``counter`` uint32
    [..., 4] under ``key`` uint32 [..., 2]: uint32 [..., 4]."""
    c = np.asarray(counter, np.uint64) & 0xFFFFFFFF
    k = np.asarray(key, np.uint64) & 0xFFFFFFFF
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    x = [np.broadcast_to(c[..., i], shape) for i in range(4)]
    k0, k1 = np.broadcast_to(k[..., 0], shape), np.broadcast_to(k[..., 1], shape)
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(_PHILOX_M[0]) * x[0]
        p1 = np.uint64(_PHILOX_M[1]) * x[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & mask
        hi1, lo1 = p1 >> np.uint64(32), p1 & mask
        x = [hi1 ^ x[1] ^ k0, lo1, hi0 ^ x[3] ^ k1, lo0]
        k0 = (k0 + np.uint64(_PHILOX_W[0])) & mask
        k1 = (k1 + np.uint64(_PHILOX_W[1])) & mask
    return np.stack(x, axis=-1).astype(np.uint32)


def apply_penalties(logits, context, generated, repetition, presence, frequency) -> np.ndarray:
    """vLLM's penalties, float64 [batch, vocab]: a token in the context or
    generated (``context`` bool [batch, vocab], ``generated`` int counts
    [batch, vocab]) is divided (logit > 0) or multiplied (<= 0) by its row's
    ``repetition`` [batch]; then logit -= frequency * count + presence *
    (count > 0)."""
    x = _f64(logits).copy()
    gen = np.asarray(generated, np.float64)
    seen = np.asarray(context, bool) | (gen > 0)
    rep = np.asarray(repetition, np.float64)[:, None]
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - np.asarray(frequency, np.float64)[:, None] * gen - np.asarray(presence, np.float64)[:, None] * (gen > 0)
    return x


def sampling_mask(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Which tokens a sampler may draw, bool [batch, vocab], for finite
    ``logits`` [batch, vocab] and per-row ``temperature`` (> 0), ``top_k``
    (0: off), ``top_p`` and ``min_p``, applied in vLLM's order: min-p
    (probability >= min_p * the largest), then top-k (value >= the k-th
    largest kept value; ties kept), then top-p over the kept tokens
    renormalised (a token stays when the kept tokens of larger value hold less
    than top_p of the kept mass; ties at the boundary kept)."""
    z = _f64(logits) / np.asarray(temperature, np.float64)[:, None]
    out = np.zeros(z.shape, bool)
    for b in range(z.shape[0]):
        row = z[b]
        p = np.exp(row - row.max())
        keep = p >= float(min_p[b]) * p.max()
        k = int(top_k[b])
        if 0 < k < keep.sum():
            kth = np.sort(row[keep])[::-1][k - 1]
            keep &= row >= kth
        if float(top_p[b]) < 1.0:
            mass = np.where(keep, p, 0.0)
            total = mass.sum()
            order = np.argsort(row, kind="stable")  # ascending values
            suffix = np.concatenate([np.cumsum(mass[order][::-1])[::-1], [0.0]])  # mass at sorted positions >= i
            above = suffix[np.searchsorted(row[order], row, side="right")]  # mass of the values > each
            keep &= above < float(top_p[b]) * total
        out[b] = keep
    return out


def gumbel_of_words(words) -> np.ndarray:
    """The Gumbel noise -log(-log(u)) of uint32 ``words``, u = ((w >> 9) +
    0.5) / 2**23 in (0, 1), float64."""
    u = ((np.asarray(words, np.uint64) >> np.uint64(9)).astype(np.float64) + 0.5) / 2.0**23
    return -np.log(-np.log(u))


def sample_gumbel(logits, mask, temperature, seeds, steps) -> np.ndarray:
    """Tokens int64 [batch]: the argmax over ``mask``ed tokens of logits /
    temperature + the Gumbel noise of Philox4x32-10 word 0 at counter
    (token, step, 0, 0) under key (seed & 0xffffffff, seed >> 32)."""
    z = _f64(logits) / np.asarray(temperature, np.float64)[:, None]
    batch, vocab = z.shape
    seeds = np.asarray(seeds, np.uint64)
    ctr = np.zeros((batch, vocab, 4), np.uint64)
    ctr[..., 0] = np.arange(vocab)[None, :]
    ctr[..., 1] = np.asarray(steps, np.uint64)[:, None]
    key = np.stack([seeds & np.uint64(0xFFFFFFFF), seeds >> np.uint64(32)], axis=-1)[:, None, :]
    g = gumbel_of_words(philox4x32_10(ctr, key)[..., 0])
    return np.argmax(np.where(mask, z + g, -np.inf), axis=1).astype(np.int64)


def log_softmax_at(logits, tokens) -> np.ndarray:
    """log softmax(logits[b])[tokens[b]] per row, float64 [batch]."""
    x = _f64(logits)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    return x[np.arange(x.shape[0]), np.asarray(tokens)] - lse


def top_logprobs(logits, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` largest logits of each row, largest first (NaN counts as the
    largest; ties: the lower index first): (ids int64 [batch, n], their log
    softmax float64 [batch, n])."""
    x = _f64(logits)
    key = np.where(np.isnan(x), np.inf, x)
    ids = np.empty((x.shape[0], n), np.int64)
    for b in range(x.shape[0]):
        nan = np.isnan(x[b])
        # NaN first (by index), then by value descending, index ascending
        order = np.lexsort((np.arange(x.shape[1]), -key[b], ~nan))
        ids[b] = order[:n]
    m = np.nanmax(np.where(np.isinf(x) & (x < 0), -np.inf, x), axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    return ids, np.take_along_axis(x, ids, axis=1) - lse[:, None]
