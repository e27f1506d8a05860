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

from .._runtime.arrays import Array
from ..ops import layers
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
            w["wqa"] = self._w(ckpt, a + "q_a_proj.weight", (q_in, Hd))
            if cfg.qkv_bias:
                w["bqa"] = self._w(ckpt, a + "q_a_proj.bias", (q_in,))
            w["q_a_norm"] = self._w(ckpt, a + "q_a_layernorm.weight", (q_in,))
            wq = self._host(ckpt, a + "q_b_proj.weight", (H * (Dn + P), q_in))
        else:
            wq = self._host(ckpt, a + "q_proj.weight", (H * (Dn + P), Hd))
        wq = wq.reshape(H, Dn + P, q_in)
        w["wq_rope"] = self._upload(wq[:, Dn:][:, perm].reshape(H * P, q_in), self.dtype)
        kv_b = self._host(ckpt, a + "kv_b_proj.weight", (H * (Dn + Dv), R)).reshape(H, Dn + Dv, R)
        w_uk, w_uv = kv_b[:, :Dn], kv_b[:, Dn:]  # [H, Dn, R], [H, Dv, R]
        if self.fold_q:
            folded = np.einsum("hdr,hdi->hri", w_uk.astype(f64), wq[:, :Dn].astype(f64))  # [H, R, q_in]
            w["wq_abs"] = self._upload(folded.reshape(H * R, q_in), self.dtype)
        else:
            w["wq_nope"] = self._upload(wq[:, :Dn].reshape(H * Dn, q_in), self.dtype)
            w["w_uk_t"] = self._upload(w_uk.transpose(0, 2, 1), self.dtype)  # [H, R, Dn]
        kv_a = self._host(ckpt, a + "kv_a_proj_with_mqa.weight", (R + P, Hd))
        w["wdkv"] = self._upload(kv_a[:R], self.dtype)
        w["wkr"] = self._upload(kv_a[R:][perm], self.dtype)
        if cfg.qkv_bias:
            b = self._host(ckpt, a + "kv_a_proj_with_mqa.bias", (R + P,))
            w["bdkv"] = self._upload(b[:R], self.dtype)
            w["bkr"] = self._upload(b[R:][perm], self.dtype)
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
        cfg, xp, dt = self.cfg, self.xp, self.dtype
        H, R, P = cfg.heads, cfg.kv_lora_rank, cfg.qk_rope_dim
        if cfg.q_lora_rank:
            self.qa = xp.zeros((r, cfg.q_lora_rank), dt)
        self.q_rope = xp.zeros((r, H, P), dt)
        self.q_abs = xp.zeros((r, H, R), dt)
        self.lat = xp.zeros((r, 1, R), dt)
        self.k_rope = xp.zeros((r, 1, P), dt)
        self.o_lat = xp.zeros((r, H, R), dt)
        fq, fo = fold_choice(cfg)
        if not fq:
            self.q_nope = xp.zeros((r, H, cfg.qk_nope_dim), dt)
        if not fo:
            self.v_out = xp.zeros((r, H, cfg.v_head_dim), dt)

    def cache_layout(self) -> tuple[int, int, int]:
        return 1, self.cfg.kv_lora_rank, self.cfg.qk_rope_dim

    def _attention(self, plan: DevicePlan, li: int, lw: dict, h: Array, positions: Array, n: int) -> None:
        cfg, proj, hw = self.cfg, self.proj, self.host
        x, q_rope, q_abs, lat, k_rope, o_lat = (
            b[:n] for b in (self.x, self.q_rope, self.q_abs, self.lat, self.k_rope, self.o_lat)
        )
        src = h
        if cfg.q_lora_rank:
            src = self.qa[:n]
            proj.linear(h, lw["wqa"], src)
            if cfg.qkv_bias:
                layers.bias_add(src, lw["bqa"], host=hw)
            layers.rms_norm(src, lw["q_a_norm"], src, LATENT_EPS, host=hw)
        proj.linear(src, lw["wq_rope"], q_rope.reshape(n, -1))
        layers.rope(q_rope, positions, self.cos, self.sin, host=hw)
        if self.fold_q:
            proj.linear(src, lw["wq_abs"], q_abs.reshape(n, -1))
        else:
            q_nope = self.q_nope[:n]
            proj.linear(src, lw["wq_nope"], q_nope.reshape(n, -1))
            proj.linear_heads(q_nope, lw["w_uk_t"], q_abs)
        lat2, kr2 = lat.reshape(n, -1), k_rope.reshape(n, -1)
        proj.linear(h, lw["wdkv"], lat2)
        proj.linear(h, lw["wkr"], kr2)
        if cfg.qkv_bias:
            layers.bias_add(lat2, lw["bdkv"], host=hw)
            layers.bias_add(kr2, lw["bkr"], host=hw)
        layers.rms_norm(lat2, lw["kv_norm"], lat2, LATENT_EPS, host=hw)
        layers.rope(k_rope, positions, self.cos, self.sin, host=hw)
        cache = self.cache
        assert cache is not None  # attach() ran before the first forward pass
        cache.append(plan, lat, k_rope, layer=li)
        plan.mla(q_abs, q_rope, cache.k[li], cache.v[li], cfg.scale, True, out=o_lat)
        if self.fold_o:
            proj.linear(o_lat.reshape(n, -1), lw["wo_lat"], x, accumulate=True)
        else:
            v_out = self.v_out[:n]
            proj.linear_heads(o_lat, lw["w_uv"], v_out)
            proj.linear(v_out.reshape(n, -1), lw["wo"], x, accumulate=True)
        if cfg.o_bias:
            layers.bias_add(x, lw["bo"], host=hw)
