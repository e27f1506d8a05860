"""A tiny Llama-style decoder built only from cupaged ops, and its float64
NumPy reference.

RMSNorm, RoPE (rotate-half), GQA attention through the page manager (one
layered ``PagedKVCache``: ``cache.append`` + ``DevicePlan.attention``), SwiGLU
MLP, weights seeded random. Every step is stream work on preallocated
buffers, so one decode step can be captured into a graph on either backend.
``generate`` prefills through ``cache.prepare`` and decodes through a
cache-driven ``PagedDecodeLoop``. Used by the decode-graph tests and by
``python -m cupaged demo``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._runtime import Stream, stream_for, xp_of
from .._runtime.arrays import Array
from ..cache import PagedKVCache
from ..errors import PagedAttentionError
from ..graph import PagedDecodeLoop
from ..ops import layers
from ..ops.append import Rotary
from ..ops.sampling import argmax_into
from ..plan import DevicePlan
from ..testing import reference

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

    from ..ops.attention.splits import SplitWorkspace


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-5
    max_pos: int = 1024
    # MLA variant (DeepSeek-style, absorbed at run time): latent R, rotary P,
    # per-head no-rope query/key dim and value dim.
    mla: bool = False
    latent_dim: int = 32
    rope_dim: int = 8
    nope_dim: int = 16
    v_head_dim: int = 16

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim if self.mla else self.head_dim


def init_weights(cfg: TinyConfig, seed: int = 0) -> dict:
    """Seeded random weights, float64, Linear layout [out, in]."""
    rng = np.random.default_rng(seed)

    def lin(n_out, n_in, gain=1.0):
        return rng.standard_normal((n_out, n_in)) * gain / math.sqrt(n_in)

    hq, hkv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    w = {
        "embed": rng.standard_normal((cfg.vocab, cfg.hidden)),
        "final_norm": 1.0 + 0.1 * rng.standard_normal(cfg.hidden),
        "lm_head": lin(cfg.vocab, cfg.hidden, 4.0),
        "layers": [],
    }
    H, R, P, Dn, Dv = cfg.heads, cfg.latent_dim, cfg.rope_dim, cfg.nope_dim, cfg.v_head_dim
    for _ in range(cfg.layers):
        if cfg.mla:
            attn = {
                "w_dkv": lin(R, cfg.hidden),
                "kv_norm": 1.0 + 0.1 * rng.standard_normal(R),
                "w_kr": lin(P, cfg.hidden),
                "w_qn": lin(H * Dn, cfg.hidden),
                "w_qr": lin(H * P, cfg.hidden),
                "w_uk": rng.standard_normal((H, Dn, R)) / math.sqrt(R),  # k_nope[h] = w_uk[h] @ c
                "w_uv": rng.standard_normal((H, Dv, R)) / math.sqrt(R),  # v[h] = w_uv[h] @ c
                "wo": lin(cfg.hidden, H * Dv),
            }
        else:
            attn = {
                "wq": lin(hq, cfg.hidden),
                "wk": lin(hkv, cfg.hidden),
                "wv": lin(hkv, cfg.hidden),
                "wo": lin(cfg.hidden, hq),
            }
        w["layers"].append(
            {
                "attn_norm": 1.0 + 0.1 * rng.standard_normal(cfg.hidden),
                **attn,
                "mlp_norm": 1.0 + 0.1 * rng.standard_normal(cfg.hidden),
                "w_gate_up": lin(2 * cfg.ffn, cfg.hidden),
                "w_down": lin(cfg.hidden, cfg.ffn),
            }
        )
    return w


def rounded(weights: dict, dtype: DTypeLike) -> dict:
    """The weights as the model stores them (rounded to ``dtype``), back in
    float64: what the reference must use to isolate kernel arithmetic."""

    def r(a):
        return np.asarray(a).astype(dtype).astype(np.float64)

    return {
        "embed": r(weights["embed"]),
        "final_norm": r(weights["final_norm"]),
        "lm_head": r(weights["lm_head"]),
        "layers": [{k: r(v) for k, v in lw.items()} for lw in weights["layers"]],
    }


def rope_tables(cfg: TinyConfig) -> tuple[np.ndarray, np.ndarray]:
    """float64 cos, sin [max_pos, rotary_dim // 2] (head_dim, or rope_dim for MLA)."""
    return reference.rope_tables(np.arange(cfg.max_pos), cfg.rotary_dim, cfg.rope_base)


def _reference_mla(cfg: TinyConfig, lw: dict, h, cos, sin, mask) -> np.ndarray:
    """Non-absorbed MLA of one sequence, float64: keys and values are
    up-projected from the latent for every token (what the absorbed kernel
    path must equal). h [n, hidden] -> attention output [n, H * Dv]."""
    n, H, P = h.shape[0], cfg.heads, cfg.rope_dim
    c = reference.rms_norm(h @ lw["w_dkv"].T, lw["kv_norm"], cfg.eps)  # [n, R]
    k_rope = reference.apply_rope((h @ lw["w_kr"].T).reshape(n, 1, P), cos, sin)[:, 0]  # [n, P]
    q_nope = (h @ lw["w_qn"].T).reshape(n, H, cfg.nope_dim)
    q_rope = reference.apply_rope((h @ lw["w_qr"].T).reshape(n, H, P), cos, sin)
    k_nope = np.einsum("hdr,kr->khd", lw["w_uk"], c)  # [n, H, Dn]
    v = np.einsum("hvr,kr->khv", lw["w_uv"], c)  # [n, H, Dv]
    s = (np.einsum("qhd,khd->hqk", q_nope, k_nope) + np.einsum("qhp,kp->hqk", q_rope, k_rope)) / math.sqrt(
        cfg.nope_dim + P
    )
    s = np.where(mask[None], s, -np.inf)
    return np.einsum("hqk,khv->qhv", reference.softmax(s, axis=-1), v).reshape(n, -1)


def reference_logits(cfg: TinyConfig, weights: dict, tokens: ArrayLike) -> np.ndarray:
    """float64 logits [n, vocab] of one sequence ``tokens`` [n], computed in
    full from scratch (no cache): the oracle for the paged model."""
    tokens = np.asarray(tokens, np.int64)
    n, d = len(tokens), cfg.head_dim
    cos, sin = rope_tables(cfg)
    cos, sin = cos[:n], sin[:n]
    x = weights["embed"][tokens]  # [n, hidden]
    group = cfg.heads // cfg.kv_heads
    mask = np.tril(np.ones((n, n), bool))
    for lw in weights["layers"]:
        h = reference.rms_norm(x, lw["attn_norm"], cfg.eps)
        if cfg.mla:
            attn = _reference_mla(cfg, lw, h, cos, sin, mask)
        else:
            q = reference.apply_rope((h @ lw["wq"].T).reshape(n, cfg.heads, d), cos, sin)
            k = reference.apply_rope((h @ lw["wk"].T).reshape(n, cfg.kv_heads, d), cos, sin)
            v = (h @ lw["wv"].T).reshape(n, cfg.kv_heads, d)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [n, heads, d]
            s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            s = np.where(mask[None], s, -np.inf)
            attn = np.einsum("hqk,khd->qhd", reference.softmax(s, axis=-1), v).reshape(n, -1)
        x = x + attn @ lw["wo"].T
        h = reference.rms_norm(x, lw["mlp_norm"], cfg.eps)
        gate, up = lw["w_gate_up"][: cfg.ffn], lw["w_gate_up"][cfg.ffn :]
        x = x + reference.swiglu_mlp(h, gate.T, up.T, lw["w_down"].T)
    return reference.rms_norm(x, weights["final_norm"], cfg.eps) @ weights["lm_head"].T


def _block_diag(blocks) -> np.ndarray:
    rows, cols = sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks)
    out = np.zeros((rows, cols))
    r = c = 0
    for b in blocks:
        out[r : r + b.shape[0], c : c + b.shape[1]] = b
        r, c = r + b.shape[0], c + b.shape[1]
    return out


class TinyModel:
    """The tiny decoder on one backend: weights, its page manager ``cache`` (a
    PagedKVCache of ``cfg.layers`` layers: ``cache.k`` [layers, num_pages,
    page_size, kv_heads, head_dim]; for MLA the latent [.., 1, latent_dim] and
    rotary [.., 1, rope_dim] caches) and activation buffers for up to
    ``max_rows`` queries per step, all allocated here, once.

    ``forward(plan, tokens, logits)`` issues one step's stream work for the
    plan's packed queries: tokens int64 [>= queries] (device), logits
    [>= queries, vocab]. It allocates nothing and never synchronizes.
    """

    def __init__(
        self,
        cfg: TinyConfig,
        weights: dict,
        like: Array,
        *,
        dtype: DTypeLike = np.float32,
        num_pages: int,
        page_size: int,
        max_rows: int,
    ):
        self.cfg, self.dtype, self.page_size, self.num_pages = cfg, np.dtype(dtype), page_size, num_pages
        self.xp = xp = xp_of(like)
        self.like = like

        def dev(a, dt=self.dtype):
            return xp.asarray(np.ascontiguousarray(np.asarray(a).astype(dt)))

        host_layers = [dict(lw) for lw in weights["layers"]]
        if not cfg.mla:  # one fused QKV projection: q, k and v are column slices of its output
            for lw in host_layers:
                lw["wqkv"] = np.concatenate([lw.pop("wq"), lw.pop("wk"), lw.pop("wv")])
        if cfg.mla:  # absorb the up-projections as block-diagonal Linear weights (tiny sizes: fine)
            for lw in host_layers:
                # h's one product: [q_nope (H Dn) | q_rope (H P) | k_rope (P) | latent (R)]
                lw["w_in"] = np.concatenate([lw.pop(k) for k in ("w_qn", "w_qr", "w_kr", "w_dkv")])
                lw["w_uk_bd"] = _block_diag([m.T for m in lw.pop("w_uk")])  # q_nope[h] -> q_abs[h] (R)
                lw["w_uv_bd"] = _block_diag(list(lw.pop("w_uv")))  # o_lat[h] -> v_out[h] (Dv)
        self.w = {
            "embed": dev(weights["embed"]),
            "final_norm": dev(weights["final_norm"]),
            "lm_head": dev(weights["lm_head"]),
            "layers": [{k: dev(v) for k, v in lw.items()} for lw in host_layers],
        }
        cos, sin = rope_tables(cfg)
        self.cos, self.sin = dev(cos, np.float32), dev(sin, np.float32)
        if cfg.mla:  # k: the latent [.., pages, ps, 1, R]; v: the rotated k_pos [.., pages, ps, 1, P]
            heads, d, dv = 1, cfg.latent_dim, cfg.rope_dim
        else:
            heads, d, dv = cfg.kv_heads, cfg.head_dim, cfg.head_dim
        self.cache = PagedKVCache(
            num_pages, page_size, heads, d, self.dtype, layers=cfg.layers, value_dim=dv, like=like
        )
        self._live: list = []  # the sequences of the last generate
        self._loop: PagedDecodeLoop | None = None  # its decode loop (finished before the next generate frees them)
        r, hd = max_rows, cfg.head_dim
        self.max_rows = r
        self.x = xp.zeros((r, cfg.hidden), self.dtype)
        self.h = xp.zeros((r, cfg.hidden), self.dtype)
        # the fused projection's output [rows, Hq + 2 Hkv, hd]: q, k, v its head ranges (views, read in place)
        self.qkv = xp.zeros((r, cfg.heads + 2 * cfg.kv_heads, hd), self.dtype)
        self.attn = xp.zeros((r, cfg.heads, hd), self.dtype)
        self.gu = xp.zeros((r, 2 * cfg.ffn), self.dtype)
        self.act = xp.zeros((r, cfg.ffn), self.dtype)
        self.scale = 1.0 / math.sqrt(hd)
        if cfg.mla:
            H, R, P, Dn = cfg.heads, cfg.latent_dim, cfg.rope_dim, cfg.nope_dim
            # h's one product and its column ranges (views, read in place): q_rope and k_rope side by side
            self.inp = xp.zeros((r, H * Dn + (H + 1) * P + R), self.dtype)
            self.q_nope = self.inp[:, : H * Dn]
            ropes = self.inp[:, H * Dn : H * Dn + (H + 1) * P].reshape(r, H + 1, P)
            assert ropes.strides[2] == ropes.itemsize and ropes.strides[0] == self.inp.strides[0]  # a view
            self.q_rope, self.k_rope = ropes[:, :H], ropes[:, H:]
            self.lat = self.inp[:, None, H * Dn + (H + 1) * P :]
            self.q_abs = xp.zeros((r, H, R), self.dtype)
            self.o_lat = xp.zeros((r, H, R), self.dtype)
            self.v_out = xp.zeros((r, H * cfg.v_head_dim), self.dtype)
            self.scale = 1.0 / math.sqrt(cfg.nope_dim + P)  # from the model's QK dims, not from R

    def forward(
        self, plan: DevicePlan, tokens: Array, logits: Array, *, workspace: SplitWorkspace | None = None
    ) -> None:
        cfg, n = self.cfg, plan.host.queries
        if n > self.max_rows:
            raise PagedAttentionError(f"plan: expected at most max_rows={self.max_rows} queries, got {n}")
        x, h, gu, act = (b[:n] for b in (self.x, self.h, self.gu, self.act))
        layers.embed(tokens[:n], self.w["embed"], x)
        for li, lw in enumerate(self.w["layers"]):
            layers.rms_norm(x, lw["attn_norm"], h, cfg.eps)
            if cfg.mla:
                self._mla(plan, li, lw, h, n, workspace)
            else:
                self._gqa(plan, li, lw, h, n, workspace)
            layers.rms_norm(x, lw["mlp_norm"], h, cfg.eps)
            layers.linear(h, lw["w_gate_up"], gu)
            layers.silu_mul(gu, act)
            layers.linear(act, lw["w_down"], x, accumulate=True)
        layers.rms_norm(x, self.w["final_norm"], h, cfg.eps)
        layers.linear(h, self.w["lm_head"], logits[:n])

    def _gqa(self, plan, li, lw, h, n, workspace) -> None:
        """GQA attention block: x += wo(attention(rope(q), rope(k), v)), q, k
        and v the head ranges of one fused projection's output (one product;
        the RoPE of q and k fused into the append, one launch)."""
        cfg = self.cfg
        x, qkv, attn = self.x[:n], self.qkv[:n], self.attn[:n]
        hq, hk = cfg.heads, cfg.heads + cfg.kv_heads
        q, k, v = qkv[:, :hq], qkv[:, hq:hk], qkv[:, hk:]
        layers.linear(h, lw["wqkv"], qkv.reshape(n, -1))
        self.cache.append(plan, k, v, layer=li, rope=Rotary(self.cos, self.sin, q))  # RoPE of q and k fused in
        plan.attention(q, self.cache.k[li], self.cache.v[li], self.scale, True, out=attn, workspace=workspace)
        layers.linear(attn.reshape(n, -1), lw["wo"], x, accumulate=True)

    def _mla(self, plan, li, lw, h, n, workspace) -> None:
        """MLA block, absorbed: the latent and rotated k_pos go to the caches;
        q_abs[h] = w_uk[h]^T q_nope[h]; the kernel attends over the latent;
        v_out[h] = w_uv[h] o_lat[h]; x += wo(v_out). The projections of h are
        one product, whose column ranges the later ops read in place (q_rope
        and k_rope rotated by the append, in its launch)."""
        cfg = self.cfg
        x, inp, lat, kr, qn, qr, qa, ol, vo = (
            b[:n]
            for b in (
                self.x,
                self.inp,
                self.lat,
                self.k_rope,
                self.q_nope,
                self.q_rope,
                self.q_abs,
                self.o_lat,
                self.v_out,
            )
        )
        layers.linear(h, lw["w_in"], inp)
        layers.linear(qn, lw["w_uk_bd"], qa.reshape(n, -1))
        # the latent RMSNorm'd into its cache, k_rope rotated into the rotary cache and q_rope in place: one launch
        rope = Rotary(self.cos, self.sin, qr, side="v", k_norm=lw["kv_norm"], eps=cfg.eps)
        self.cache.append(plan, lat, kr, layer=li, rope=rope)
        plan.mla(qa, qr, self.cache.k[li], self.cache.v[li], self.scale, True, out=ol, workspace=workspace)
        layers.linear(ol.reshape(n, -1), lw["w_uv_bd"], vo)
        layers.linear(vo, lw["wo"], x, accumulate=True)

    def stream(self) -> Stream:
        return stream_for(self.like)


def generate(
    model: TinyModel,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    *,
    chunk: int = 16,
    graph: bool = True,
    on_step: Callable[[int], object] | None = None,
) -> tuple[np.ndarray, PagedDecodeLoop]:
    """Greedy generation for a batch of prompts of different lengths, through
    the model's page manager.

    Sequences of ``model.cache`` (those of an earlier generate are freed
    first); prefill in chunks of at most ``chunk`` tokens per sequence (eager
    stream work, one ``cache.prepare`` plan per chunk), then ``new_tokens -
    1`` decode steps through a cache-driven PagedDecodeLoop over
    ``cache.prepare(seqs, 1, reserve=new_tokens - 1)`` (one graph launch per
    token when ``graph``; one step to spare). Returns (tokens int64 [B,
    new_tokens] on the host, the decode loop, whose ``seqs`` are the
    sequences). The only host readback is the token history at the end.
    """
    xp, like = model.xp, model.like
    cache = model.cache
    if model._loop is not None:
        model._loop.finish()  # its spare step was never run: the loop lets its sequences go
    for s in model._live:
        if s.alive:
            cache.free(s)
    B = len(prompts)
    plens = np.array([len(p) for p in prompts], np.int64)
    seqs = model._live = [cache.add_sequence(tokens=p) for p in prompts]
    stream = stream_for(like)
    logits = xp.zeros((model.max_rows, model.cfg.vocab), model.dtype)
    best = xp.zeros(model.max_rows, np.int64)
    next_token = xp.zeros(B, np.int64)
    token_buf = xp.zeros(B, np.int64)
    history = xp.zeros((new_tokens, B), np.int64)
    # ---- chunked prefill
    done = np.zeros(B, np.int64)
    while (done < plens).any():
        q_lens = np.minimum(chunk, plens - done)
        kv = done + q_lens
        plan, _ = cache.prepare(seqs, q_lens)
        toks = np.concatenate([np.asarray(prompts[s][done[s] : kv[s]], np.int64) for s in range(B)])
        tok_dev = xp.asarray(toks)
        model.forward(plan, tok_dev, logits)
        argmax_into(logits[: plan.host.queries], best[: plan.host.queries])
        ends = plan.host.q_lens.cumsum() - 1
        for s in range(B):
            if q_lens[s] and kv[s] == plens[s]:  # this chunk ends the prompt: its last row predicts token 1
                stream.copy(next_token, best, nbytes=8, dst_offset=8 * s, src_offset=8 * int(ends[s]))
        done = kv
    stream.copy(history, next_token, nbytes=8 * B)
    # ---- decode: step i feeds token i at position plen + i - 1
    plan, _ = cache.prepare(seqs, 1, reserve=new_tokens - 1)

    def step(p: DevicePlan) -> Array:
        model.forward(p, token_buf, logits)
        return logits[:B]

    loop = PagedDecodeLoop(step, plan, token_buf=token_buf, next_token=next_token, cache=cache, graph=graph)
    model._loop = loop
    for i in range(1, new_tokens):
        loop.advance()
        stream.copy(history, next_token, nbytes=8 * B, dst_offset=8 * B * i)
        if on_step is not None:
            on_step(i)
    tokens = history.T.copy() if xp is np else xp.asnumpy(history).T.copy()
    return tokens, loop


def check_tokens(
    cfg: TinyConfig, weights64: dict, prompts: Sequence[Sequence[int]], tokens: np.ndarray, *, margin: float = 1e-3
) -> tuple[int, bool]:
    """Compare generated tokens [B, N] with the float64 reference model.

    Returns (exact, ok): how many tokens equal the reference argmax, and
    whether every token is within ``margin`` of the reference maximum logit
    (a near-tie may pick either, given float32 arithmetic in the kernels).
    """
    exact, ok = 0, True
    for s, prompt in enumerate(prompts):
        seq = np.concatenate([np.asarray(prompt, np.int64), tokens[s]])
        ref = reference_logits(cfg, weights64, seq[:-1])[len(prompt) - 1 :]  # rows predicting tokens[s]
        for j, t in enumerate(tokens[s]):
            exact += int(np.argmax(ref[j]) == t)
            ok &= bool(ref[j, t] >= ref[j].max() - margin)
    return exact, ok
