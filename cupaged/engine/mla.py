"""The MLA family: DeepSeek-V2 and DeepSeek-V3 (dense MLP layers), in
absorbed form on the latent cache.

Per layer and query: the latent ``c = RMSNorm(W_DKV h)`` [R] and the rotated
shared key part ``k_rope = RoPE(W_KR h)`` [P] go to the paged caches (one
head: the cache's K is the latent, its V the rotary part). The query's
rotary part ``q_rope`` [H, P] is rotated by the same tables; its no-rope
part is absorbed: ``q_abs[h] = W_UK[h]^T q_nope[h]`` [R], so
``score = scale * (q_abs . c + q_rope . k_rope)`` equals the expanded form's
``q . k`` (``k_nope[h] = W_UK[h] c``). The kernel's output is the
latent-space average ``o_lat[h]`` [R]; ``v[h] = W_UV[h] o_lat[h]`` and the
output projection follow. ``W_UK`` and ``W_UV`` are the two row blocks of
each head of ``kv_b_proj``.

At load time, where it does not grow the weights, ``W_UK`` is folded into
the query projection (``W_QABS[h] = W_UK[h]^T W_Q_nope[h]``: one product
gives ``q_abs``) and ``W_UV`` into the output projection
(``W_O'[:, h] = W_O[:, h] W_UV[h]``: one product from ``o_lat``). For
DeepSeek's real shapes (R = 512 > the 128 no-rope / value dims) folding
would multiply those weights by up to 4x, so they stay two products per
step: one per head (``ops.layers.linear_heads`` / batched cuBLAS).
``fold_q`` / ``fold_o`` say which was chosen.

Products: the projections that read ``h`` are one product (their weights
concatenated at load): the q LoRA's down-projection or the query, then
``k_rope`` and the latent; the query of a q LoRA is one more product, of
``qa``. Every later op reads its column range in place (views: q_first and
q_rope of the query, the latent, k_rope). The append normalizes and
rotates: the latent is RMSNorm'd into the cache (``kv_a_layernorm``),
k_rope rotated into its rotary part and q_rope in place, in one launch
(``cupaged.Rotary``, ``side="v"``).

Rotary layout: transformers rotates DeepSeek's rotary dims as interleaved
pairs ``(x[2i], x[2i+1])`` (V2 always, through complex numbers; V3 when
``rope_interleave``). The rows of the projections that produce those dims
are permuted at load (even dims first, then odd) so the rotate-half kernel
rotates exactly those pairs; a dot product over both permuted parts is
unchanged. The softmax scale is ``(qk_nope + qk_rope) ** -0.5`` times
yarn's ``mscale(factor, mscale_all_dim) ** 2`` where configured; yarn's
attention factor sits in the cos/sin tables.
"""

from __future__ import annotations

import numpy as np

from .._runtime import address
from .._runtime.arrays import Array
from ..ops import layers
from ..ops.append import Rotary
from ..plan import DevicePlan
from .checkpoint import Checkpoint
from .config import ModelConfig
from .model import CausalLM

#: RMSNorm eps of the latent and q LoRA norms (transformers builds them with
#: the default 1e-6, not rms_norm_eps).
LATENT_EPS = 1e-6


def fold_choice(cfg: ModelConfig) -> tuple[bool, bool]:
    """(fold W_UK into the query projection, fold W_UV into the output
    projection): each when the folded weight is not larger than the two it
    replaces."""
    H, R, Dn, Dv = cfg.heads, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.v_head_dim
    q_in = cfg.q_lora_rank or cfg.hidden
    fold_q = H * R * q_in <= H * Dn * q_in + H * Dn * R
    fold_o = cfg.hidden * H * R <= cfg.hidden * H * Dv + H * Dv * R
    return fold_q, fold_o


def rope_permutation(p: int) -> np.ndarray:
    """Row order that turns interleaved rotary pairs (2i, 2i+1) into the
    rotate-half pairs (i, i + p/2)."""
    return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])


class MlaLM(CausalLM):
    family = "mla"

    def _load_attention(self, ckpt: Checkpoint, p: str) -> dict:
        cfg = self.cfg
        Hd, H, R, P, Dn, Dv = cfg.hidden, cfg.heads, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.qk_nope_dim, cfg.v_head_dim
        a = p + "self_attn."
        self.fold_q, self.fold_o = fold_choice(cfg)
        perm = rope_permutation(P) if cfg.rope_interleave else np.arange(P)
        w = {}
        f64 = np.float64
        q_in = cfg.q_lora_rank or Hd
        if cfg.q_lora_rank:
            wq = self._host(ckpt, a + "q_b_proj.weight", (H * (Dn + P), q_in))
            w["q_a_norm"] = self._w(ckpt, a + "q_a_layernorm.weight", (q_in,))
        else:
            wq = self._host(ckpt, a + "q_proj.weight", (H * (Dn + P), Hd))
        wq = wq.reshape(H, Dn + P, q_in)
        kv_b = self._host(ckpt, a + "kv_b_proj.weight", (H * (Dn + Dv), R)).reshape(H, Dn + Dv, R)
        w_uk, w_uv = kv_b[:, :Dn], kv_b[:, Dn:]  # [H, Dn, R], [H, Dv, R]
        if self.fold_q:
            q_first = np.einsum("hdr,hdi->hri", w_uk.astype(f64), wq[:, :Dn].astype(f64))  # [H, R, q_in]
        else:
            q_first = wq[:, :Dn]
            w["w_uk_t"] = self._upload(w_uk.transpose(0, 2, 1), self.dtype)  # [H, R, Dn]
        # the query's rows: [q_first (H x F) | q_rope (H x P)], F = R folded, Dn not
        wq_rows = [q_first.reshape(-1, q_in), wq[:, Dn:][:, perm].reshape(H * P, q_in)]
        kv_a = self._host(ckpt, a + "kv_a_proj_with_mqa.weight", (R + P, Hd))
        kv_rows = [kv_a[R:][perm], kv_a[:R]]  # [k_rope (P) | latent (R)]
        b = self._host(ckpt, a + "kv_a_proj_with_mqa.bias", (R + P,)) if cfg.qkv_bias else None
        kv_bias = [b[R:][perm], b[:R]] if b is not None else []
        # h's one product: [q_a (q LoRA) or the query | k_rope | latent]; with a q LoRA the query is qa's
        if cfg.q_lora_rank:
            first = [self._host(ckpt, a + "q_a_proj.weight", (q_in, Hd))]
            first_bias = [self._host(ckpt, a + "q_a_proj.bias", (q_in,))] if b is not None else []
            w["wq"] = self._upload(np.concatenate(wq_rows), self.dtype)
        else:
            first, first_bias = wq_rows, [np.zeros(sum(len(r) for r in wq_rows), b.dtype)] if b is not None else []
        w["w_in"] = self._upload(np.concatenate(first + kv_rows), self.dtype)
        if b is not None:
            w["b_in"] = self._upload(np.concatenate(first_bias + kv_bias), self.dtype)
        w["kv_norm"] = self._w(ckpt, a + "kv_a_layernorm.weight", (R,))
        wo = self._host(ckpt, a + "o_proj.weight", (Hd, H * Dv))
        if self.fold_o:
            folded = np.einsum("xhv,hvr->xhr", wo.reshape(Hd, H, Dv).astype(f64), w_uv.astype(f64))
            w["wo_lat"] = self._upload(folded.reshape(Hd, H * R), self.dtype)
        else:
            w["w_uv"] = self._upload(w_uv, self.dtype)  # [H, Dv, R]
            w["wo"] = self._upload(wo, self.dtype)
        if cfg.o_bias:
            w["bo"] = self._w(ckpt, a + "o_proj.bias", (Hd,))
        return w

    def _alloc_attention(self, r: int) -> None:
        """``self.inp`` [rows, (q_lora or H (F + P)) + P + R]: h's one
        product, whose column ranges the step reads in place (views): q_a
        (q LoRA) or the query, then k_rope and the latent; with a q LoRA the
        query [H (F + P)] is ``self.qb``, qa's product. The query's ranges
        q_first [H, F] and q_rope [H, P] (F = R folded, Dn not) sit side by
        side."""
        cfg, xp, dt = self.cfg, self.xp, self.dtype
        H, R, P = cfg.heads, cfg.kv_lora_rank, cfg.qk_rope_dim
        fq, fo = fold_choice(cfg)
        F = R if fq else cfg.qk_nope_dim
        nq = H * (F + P)
        self.inp = xp.zeros((r, (cfg.q_lora_rank or nq) + P + R), dt)
        q_src = xp.zeros((r, nq), dt) if cfg.q_lora_rank else self.inp[:, :nq]
        self.qb = q_src if cfg.q_lora_rank else None
        c0 = cfg.q_lora_rank or nq  # where k_rope starts in self.inp
        self.q_first = _split(q_src[:, : H * F], H, F)  # [rows, H, F]
        self.q_rope = _split(q_src[:, H * F : nq], H, P)  # [rows, H, P]
        self.k_rope = _split(self.inp[:, c0 : c0 + P], 1, P)  # [rows, 1, P]
        self.lat = _split(self.inp[:, c0 + P :], 1, R)  # [rows, 1, R]
        self.q_abs = self.q_first if fq else xp.zeros((r, H, R), dt)
        self.o_lat = xp.zeros((r, H, R), dt)
        if not fo:
            self.v_out = xp.zeros((r, H, cfg.v_head_dim), dt)

    def cache_layout(self) -> tuple[int, int, int]:
        return 1, self.cfg.kv_lora_rank, self.cfg.qk_rope_dim

    def _attention(self, plan: DevicePlan, li: int, lw: dict, h: Array, n: int) -> None:
        cfg, proj, hw = self.cfg, self.proj, self.host
        x, inp, q_rope, q_abs, lat, k_rope, o_lat = (
            b[:n] for b in (self.x, self.inp, self.q_rope, self.q_abs, self.lat, self.k_rope, self.o_lat)
        )
        proj.linear(h, lw["w_in"], inp)  # [q_a or the query | k_rope | latent]
        if cfg.qkv_bias:
            layers.bias_add(inp, lw["b_in"], host=hw)
        if cfg.q_lora_rank:
            qa = inp[:, : cfg.q_lora_rank]
            layers.rms_norm(qa, lw["q_a_norm"], qa, LATENT_EPS, host=hw)
            assert self.qb is not None  # allocated with a q LoRA
            proj.linear(qa, lw["wq"], self.qb[:n])  # [q_first | q_rope]
        if not self.fold_q:
            proj.linear_heads(self.q_first[:n], lw["w_uk_t"], q_abs)
        cache = self.cache
        assert cache is not None  # attach() ran before the first forward pass
        # the latent RMSNorm'd into the cache, k_rope rotated into the rotary part and q_rope in place: one launch
        rope = Rotary(self.cos, self.sin, q_rope, side="v", k_norm=lw["kv_norm"], eps=LATENT_EPS)
        cache.append(plan, lat, k_rope, layer=li, rope=rope)
        plan.mla(q_abs, q_rope, cache.k[li], cache.v[li], cfg.scale, True, out=o_lat)
        if self.fold_o:
            proj.linear(o_lat.reshape(n, -1), lw["wo_lat"], x, accumulate=True)
        else:
            v_out = self.v_out[:n]
            proj.linear_heads(o_lat, lw["w_uv"], v_out)
            proj.linear(v_out.reshape(n, -1), lw["wo"], x, accumulate=True)
        if cfg.o_bias:
            layers.bias_add(x, lw["bo"], host=hw)


def _split(cols: Array, heads: int, dim: int) -> Array:
    """A column range [rows, heads * dim] of a wider buffer as [rows, heads,
    dim]: a view (splitting its contiguous last dim never copies; checked,
    since a copy would leave the buffer unwritten)."""
    v = cols.reshape(cols.shape[0], heads, dim)
    assert address(v) == address(cols) and v.strides[2] == cols.itemsize, "the split must be a view"
    return v
