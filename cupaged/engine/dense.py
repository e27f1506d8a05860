"""The dense GQA family: Llama, Mistral, Qwen2, Qwen3.

Per layer: q, k, v projections (with biases where configured: Qwen2 always
on q/k/v, Llama and Qwen3 with ``attention_bias``), Qwen3's per-head RMSNorm
of q and k (the RMSNorm kernel over ``[rows * heads, head_dim]``), RoPE by
the plan's device positions (rotate-half, as transformers), the K/V append
through the page manager and paged attention at ``head_dim ** -0.5`` (with
the layer's sliding window, ``ModelConfig.layer_windows``), then
the output projection added to the residual (fused in the product).
"""

from __future__ import annotations

from .._runtime.arrays import Array
from ..ops import layers
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
        w = {
            "wq": self._w(ckpt, a + "q_proj.weight", (q, H)),
            "wk": self._w(ckpt, a + "k_proj.weight", (kv, H)),
            "wv": self._w(ckpt, a + "v_proj.weight", (kv, H)),
            "wo": self._w(ckpt, a + "o_proj.weight", (H, q)),
        }
        if cfg.qkv_bias:
            w.update(
                bq=self._w(ckpt, a + "q_proj.bias", (q,)),
                bk=self._w(ckpt, a + "k_proj.bias", (kv,)),
                bv=self._w(ckpt, a + "v_proj.bias", (kv,)),
            )
        if cfg.o_bias:
            w["bo"] = self._w(ckpt, a + "o_proj.bias", (H,))
        if cfg.qk_norm:
            w.update(q_norm=self._w(ckpt, a + "q_norm.weight", (D,)), k_norm=self._w(ckpt, a + "k_norm.weight", (D,)))
        return w

    def _alloc_attention(self, r: int) -> None:
        cfg, xp, dt = self.cfg, self.xp, self.dtype
        D = cfg.head_dim
        self.q = xp.zeros((r, cfg.heads, D), dt)
        self.k = xp.zeros((r, cfg.kv_heads, D), dt)
        self.v = xp.zeros((r, cfg.kv_heads, D), dt)
        self.attn = xp.zeros((r, cfg.heads, D), dt)

    def cache_layout(self) -> tuple[int, int, int]:
        return self.cfg.kv_heads, self.cfg.head_dim, self.cfg.head_dim

    def _attention(self, plan: DevicePlan, li: int, lw: dict, h: Array, positions: Array, n: int) -> None:
        cfg, proj, hw = self.cfg, self.proj, self.host
        x, q, k, v, attn = self.x[:n], self.q[:n], self.k[:n], self.v[:n], self.attn[:n]
        q2, k2, v2 = q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)
        proj.linear(h, lw["wq"], q2)
        proj.linear(h, lw["wk"], k2)
        proj.linear(h, lw["wv"], v2)
        if cfg.qkv_bias:
            layers.bias_add(q2, lw["bq"], host=hw)
            layers.bias_add(k2, lw["bk"], host=hw)
            layers.bias_add(v2, lw["bv"], host=hw)
        if cfg.qk_norm:  # RMSNorm over each head's head_dim
            qh, kh = q.reshape(-1, cfg.head_dim), k.reshape(-1, cfg.head_dim)
            layers.rms_norm(qh, lw["q_norm"], qh, cfg.eps, host=hw)
            layers.rms_norm(kh, lw["k_norm"], kh, cfg.eps, host=hw)
        layers.rope(q, positions, self.cos, self.sin, host=hw)
        layers.rope(k, positions, self.cos, self.sin, host=hw)
        cache = self.cache
        assert cache is not None  # attach() ran before the first forward pass
        cache.append(plan, k, v, layer=li)
        window = cfg.layer_windows[li] if cfg.layer_windows else None  # the layer's sliding window
        plan.attention(q, cache.k[li], cache.v[li], cfg.scale, True, out=attn, window=window)
        proj.linear(attn.reshape(n, -1), lw["wo"], x, accumulate=True)
        if cfg.o_bias:
            layers.bias_add(x, lw["bo"], host=hw)
