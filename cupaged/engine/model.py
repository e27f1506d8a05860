"""What every architecture family shares: weights on the backend, the
embedding, the SwiGLU MLP, the final norm and the LM head, activation
buffers, the rotary tables and the step's forward pass over a plan.

A family (``dense.py``, ``mla.py``) loads its attention weights and issues
its attention block; ``CausalLM.forward(plan, tokens, n, gather=m)`` is one
step's stream work for the plan's ``n`` packed queries: it allocates
nothing and never synchronizes, so a decode step (``gather=None``: logits
for every row) is captured into a graph as is. A prefill chunk gathers the
``m`` rows whose logits it needs (``idx``, one per sequence ending its
prompt in the chunk) before the final norm and the LM head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._runtime import GPU, array_backend, xp_of
from .._runtime.arrays import Array
from ..cache import PagedKVCache
from ..errors import PagedAttentionError
from ..ops import layers
from ..plan import DevicePlan
from . import rope as rope_tables
from .checkpoint import Checkpoint
from .config import ModelConfig
from .projections import Projections

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


class CausalLM:
    """A decoder-only model on one backend (see the module docstring).

    ``max_rows``: most queries of one step (the prefill chunk, at least the
    decode batch); ``max_logits``: most logit rows of one step (the decode
    batch). ``max_len``: rows of the rotary tables (the longest sequence).
    Weights are read from ``ckpt`` (host arrays; a safetensors memory map's
    views stay zero-copy on the CPU backend when no conversion is needed)."""

    family = ""

    def __init__(
        self,
        cfg: ModelConfig,
        ckpt: Checkpoint,
        like: Array,
        dtype: DTypeLike,
        *,
        max_rows: int,
        max_logits: int,
        max_len: int,
    ):
        self.cfg, self.like, self.dtype = cfg, like, np.dtype(dtype)
        self.xp = xp_of(like)
        self.gpu = array_backend(like) == GPU
        self.proj = Projections(like)
        self.host = not self.gpu  # the CPU backend's dense layers: NumPy / BLAS (ops.layers host=True)
        self.max_rows, self.max_logits, self.max_len = max_rows, max_logits, max_len
        self.cache: PagedKVCache | None = None  # set by attach() before the first forward pass
        self.weight_bytes = 0
        H, F = cfg.hidden, cfg.ffn
        embed = self._w(ckpt, "model.embed_tokens.weight", (cfg.vocab, H))
        self.embed = embed
        self.final_norm = self._w(ckpt, "model.norm.weight", (H,))
        if cfg.tie_embeddings and "lm_head.weight" not in ckpt:
            self.lm_head = embed
        else:
            self.lm_head = self._w(ckpt, "lm_head.weight", (cfg.vocab, H))
        self.layers = []
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            lw = {
                "attn_norm": self._w(ckpt, p + "input_layernorm.weight", (H,)),
                "mlp_norm": self._w(ckpt, p + "post_attention_layernorm.weight", (H,)),
                "gate_up": self._w(ckpt, [(p + "mlp.gate_proj.weight", F), (p + "mlp.up_proj.weight", F)], (2 * F, H)),
                "down": self._w(ckpt, p + "mlp.down_proj.weight", (H, cfg.ffn)),
            }
            if cfg.mlp_bias:
                lw["gate_up_bias"] = self._w(
                    ckpt, [(p + "mlp.gate_proj.bias", F), (p + "mlp.up_proj.bias", F)], (2 * F,)
                )
                lw["down_bias"] = self._w(ckpt, p + "mlp.down_proj.bias", (H,))
            lw.update(self._load_attention(ckpt, p))
            self.layers.append(lw)
        cos, sin = rope_tables.tables(cfg.rope, max_len)
        self.cos, self.sin = self._upload(cos), self._upload(sin)
        xp, r, dt = self.xp, max_rows, self.dtype
        self.x = xp.zeros((r, H), dt)
        self.h = xp.zeros((r, H), dt)
        self.gu = xp.zeros((r, 2 * cfg.ffn), dt)
        self.act = xp.zeros((r, cfg.ffn), dt)
        self.tokens = xp.zeros(r, np.int64)  # a prefill chunk's tokens
        self.idx = xp.zeros(max_logits, np.int64)  # rows whose logits a prefill chunk needs
        self.xg = xp.zeros((max_logits, H), dt)
        self.hg = xp.zeros((max_logits, H), dt)
        self.logits = xp.zeros((max_logits, cfg.vocab), dt)
        self.best = xp.zeros(max_logits, np.int64)
        self._alloc_attention(r)

    # -- weights ----------------------------------------------------------------
    def _host(self, ckpt: Checkpoint, names, shape) -> np.ndarray:
        """Host array of one tensor, or of several concatenated along dim 0
        (``names``: (name, rows) pairs, each tensor checked for its own
        shape [rows, *shape[1:]]); ``shape`` is the result's; in the stored
        dtype."""
        if isinstance(names, str):
            return ckpt.get(names, shape)
        assert sum(rows for _, rows in names) == shape[0], (names, shape)
        return np.concatenate([ckpt.get(n, (rows, *shape[1:])) for n, rows in names], axis=0)

    def _w(self, ckpt: Checkpoint, names, shape):
        """A weight on the backend in the model's dtype."""
        return self._upload(self._host(ckpt, names, shape), self.dtype)

    def _upload(self, a: np.ndarray, dtype=None):
        """``a`` as a C-contiguous array of ``dtype`` on the backend: on the
        CPU backend a memory-mapped view that needs no conversion is used as
        is (zero-copy); on the GPU one host-to-device copy."""
        dtype = np.dtype(a.dtype if dtype is None else dtype)
        if a.dtype != dtype:
            a = a.astype(dtype)
        a = np.ascontiguousarray(a)
        self.weight_bytes += a.nbytes
        if not self.gpu:
            return a
        xp = self.xp
        if dtype.name == "bfloat16":  # CuPy has no bfloat16 arithmetic: move the bits
            return xp.asarray(a.view(np.uint16)).view(dtype)
        return xp.asarray(a)

    # -- family hooks -----------------------------------------------------------
    def _load_attention(self, ckpt: Checkpoint, prefix: str) -> dict:
        raise NotImplementedError

    def _alloc_attention(self, rows: int) -> None:
        raise NotImplementedError

    def _attention(self, plan: DevicePlan, li: int, lw: dict, h: Array, n: int) -> None:
        raise NotImplementedError

    def cache_layout(self) -> tuple[int, int, int]:
        """(kv_heads, head_dim, value_dim) of the paged cache."""
        raise NotImplementedError

    def attach(self, cache: PagedKVCache) -> None:
        self.cache = cache

    # -- the step -----------------------------------------------------------------
    def forward(self, plan: DevicePlan, tokens: Array, n: int, gather: int | None = None) -> Array:
        """One step's stream work for the plan's ``n`` queries (tokens int64
        [>= n] on the device). Returns the logits rows: all ``n`` (decode), or
        the ``gather`` rows listed in ``self.idx`` (prefill)."""
        cfg = self.cfg
        if n > self.max_rows:
            raise PagedAttentionError(f"plan: {n} queries exceed the model's {self.max_rows} rows")
        x, h, gu, act = self.x[:n], self.h[:n], self.gu[:n], self.act[:n]
        hw = self.host
        layers.embed(tokens[:n], self.embed, x, host=hw)
        for li, lw in enumerate(self.layers):
            layers.rms_norm(x, lw["attn_norm"], h, cfg.eps, host=hw)
            self._attention(plan, li, lw, h, n)
            layers.rms_norm(x, lw["mlp_norm"], h, cfg.eps, host=hw)
            self.proj.linear(h, lw["gate_up"], gu)
            if cfg.mlp_bias:
                layers.bias_add(gu, lw["gate_up_bias"], host=hw)
            layers.silu_mul(gu, act, host=hw)
            self.proj.linear(act, lw["down"], x, accumulate=True)
            if cfg.mlp_bias:
                layers.bias_add(x, lw["down_bias"], host=hw)
        if gather == 0:  # a prefill chunk that ends no prompt needs no logits
            return self.logits[:0]
        if gather is None:
            if n > self.max_logits:
                raise PagedAttentionError(f"plan: {n} logit rows exceed the model's {self.max_logits}")
            xs, hs, lg = x, h, self.logits[:n]
        else:
            xs, hs, lg = self.xg[:gather], self.hg[:gather], self.logits[:gather]
            layers.embed(self.idx[:gather], x, xs, host=hw)  # gather: row r of xs = x[idx[r]]
        layers.rms_norm(xs, self.final_norm, hs, cfg.eps, host=hw)
        self.proj.linear(hs, self.lm_head, lg)
        return lg
