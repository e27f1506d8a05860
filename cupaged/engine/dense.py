"""The dense GQA family: Llama, Mistral, Qwen2, Qwen3.

Per layer: one fused q/k/v projection (the three weights concatenated at
load) into ``qkv [rows, Hq + 2 Hkv, head_dim]``, whose head ranges q, k and
v every later op reads in place (views: docs/layout.md, "Query views"); the
K/V append through the page manager with everything between fused in
(``cupaged.Rotary``, one launch: the q / k / v biases where configured,
Qwen2 always, Llama and Qwen3 with ``attention_bias``; Qwen3's per-head
RMSNorm of q and of k; RoPE, rotate-half as transformers, by the plan's
device positions: K rotated into the cache, q in place), and paged attention at
``head_dim ** -0.5`` (with the layer's sliding window,
``ModelConfig.layer_windows``), then the output projection added to the
residual (fused in the product).
"""

from __future__ import annotations

from .._runtime.arrays import Array
from ..ops import layers
from ..ops.append import Rotary
from ..plan import DevicePlan
from .checkpoint import Checkpoint
from .model import CausalLM


class DenseLM(CausalLM):
    family = "dense"

    def _load_attention(self, ckpt: Checkpoint, p: str) -> dict:
        cfg = self.cfg
        H, D = cfg.hidden, cfg.head_dim
        q, kv = cfg.heads * D, cfg.kv_heads * D
        a = p + "self_attn."
        parts = [(a + "q_proj", q), (a + "k_proj", kv), (a + "v_proj", kv)]
        w = {
            "wqkv": self._w(ckpt, [(n + ".weight", rows) for n, rows in parts], (q + 2 * kv, H)),
            "wo": self._w(ckpt, a + "o_proj.weight", (H, q)),
        }
        if cfg.qkv_bias:  # one upload; the append reads its q, k and v rows (views [heads, head_dim])
            b = self._w(ckpt, [(n + ".bias", rows) for n, rows in parts], (q + 2 * kv,))
            w.update(
                bq=b[:q].reshape(cfg.heads, D),
                bk=b[q : q + kv].reshape(cfg.kv_heads, D),
                bv=b[q + kv :].reshape(cfg.kv_heads, D),
            )
        if cfg.o_bias:
            w["bo"] = self._w(ckpt, a + "o_proj.bias", (H,))
        if cfg.qk_norm:
            w.update(q_norm=self._w(ckpt, a + "q_norm.weight", (D,)), k_norm=self._w(ckpt, a + "k_norm.weight", (D,)))
        return w

    def _alloc_attention(self, r: int) -> None:
        cfg, xp, dt = self.cfg, self.xp, self.dtype
        D = cfg.head_dim
        self.qkv = xp.zeros((r, cfg.heads + 2 * cfg.kv_heads, D), dt)  # q, k, v: its head ranges
        self.attn = xp.zeros((r, cfg.heads, D), dt)

    def cache_layout(self) -> tuple[int, int, int]:
        return self.cfg.kv_heads, self.cfg.head_dim, self.cfg.head_dim

    def _attention(self, plan: DevicePlan, li: int, lw: dict, h: Array, n: int) -> None:
        cfg, proj, hw = self.cfg, self.proj, self.host
        x, qkv, attn = self.x[:n], self.qkv[:n], self.attn[:n]
        hq, hk = cfg.heads, cfg.heads + cfg.kv_heads
        q, k, v = qkv[:, :hq], qkv[:, hq:hk], qkv[:, hk:]  # views of the fused projection's output
        flat = qkv.reshape(n, -1)  # (contiguous: a view)
        proj.linear(h, lw["wqkv"], flat)
        # one launch: the biases added (Qwen2), Qwen3's RMSNorm over each head's head_dim, RoPE of q and k, the append
        extra = dict(q_bias=lw["bq"], k_bias=lw["bk"], v_bias=lw["bv"]) if cfg.qkv_bias else {}
        if cfg.qk_norm:
            extra.update(q_norm=lw["q_norm"], k_norm=lw["k_norm"], eps=cfg.eps)
        cache = self.cache
        assert cache is not None  # attach() ran before the first forward pass
        cache.append(plan, k, v, layer=li, rope=Rotary(self.cos, self.sin, q, **extra))
        window = cfg.layer_windows[li] if cfg.layer_windows else None  # the layer's sliding window
        plan.attention(q, cache.k[li], cache.v[li], cfg.scale, True, out=attn, window=window)
        proj.linear(attn.reshape(n, -1), lw["wo"], x, accumulate=True)
        if cfg.o_bias:
            layers.bias_add(x, lw["bo"], host=hw)
