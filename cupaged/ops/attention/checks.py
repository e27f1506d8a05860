"""Every input check of paged attention and MLA, in one place. Each raises
PagedAttentionError naming the argument, what was expected and what came,
before anything is allocated or launched.

``plan`` is any object with ``host`` (a HostPlan), ``backend``, ``device``
and ``stream`` (a DevicePlan).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..._runtime import array_backend, check_not_capturing, checks, empty
from ... import dtypes
from ...errors import PagedAttentionError
from ...layout import MAX_HEAD_DIM, MAX_ROPE_DIM, MAX_SPLITS, U32_MAX
from .splits import SplitWorkspace
from .variants import FEATURES, SCORES


@dataclass(frozen=True)
class AttentionOptions:
    """The score and visibility choices of one attention call, checked: the
    Python side of ``kernels_cu/attention/variant.cuh``. ``scale``,
    ``causal``, ``soft_cap``, ``window`` and the arrays' addresses go into
    the kernels' argument struct (``params.py``); ``score`` and the features
    that are on (``features``) pick the compiled variant (docs/layout.md,
    "Score variants and visibility").

    ``scale`` multiplies q.k before the softmax; ``causal``: the query at
    absolute position p sees positions 0..p of its sequence, otherwise all
    kv_lens[s]; ``score``: a name in ``variants.SCORES`` ("plain":
    softmax(scale * q.k)); ``soft_cap``: logit = cap * tanh(logit / cap);
    ``window``: the query at p also sees nothing below p - window + 1;
    ``sinks`` float32 [Hq]: a per-head logit in the softmax denominator;
    ``alibi_slopes`` float32 [Hq]: logit += slope[h] * (k_pos - q_pos).
    """

    scale: float
    causal: bool = True
    score: str = "plain"
    soft_cap: float | None = None
    window: int | None = None
    sinks: object = field(default=None, compare=False, repr=False)
    alibi_slopes: object = field(default=None, compare=False, repr=False)

    @property
    def features(self) -> tuple[str, ...]:
        """The score / visibility features that are on, as ``variants.FEATURES``
        names (each a compile-time flag of the kernels)."""
        on = dict(soft_cap=self.soft_cap is not None, window=self.window is not None,
                  sinks=self.sinks is not None, alibi=self.alibi_slopes is not None)
        return tuple(f for f in FEATURES if on[f])

    @classmethod
    def checked(cls, scale, causal, score: str = "plain", *, soft_cap=None, window=None, sinks=None,
                alibi_slopes=None, plan=None, heads: int | None = None) -> "AttentionOptions":
        """Every option checked; ``sinks`` / ``alibi_slopes`` against ``plan``
        (backend, device, stream) and ``heads`` (Hq), which they then need."""
        opts = cls(checks.positive_scale(scale), checks.boolean("causal", causal), score,
                   None if soft_cap is None else checks.positive_scale(soft_cap, "soft_cap"),
                   None if window is None else checks.host_int("window", window, 1, U32_MAX),
                   sinks, alibi_slopes)
        if not isinstance(score, str) or score not in SCORES:
            raise PagedAttentionError(f"score: expected one of {', '.join(map(repr, SCORES))}, got {score!r}")
        for name, a in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
            if a is not None:
                if plan is None or heads is None:
                    raise ValueError(f"{name}: AttentionOptions.checked needs plan= and heads= to check it")
                head_array(plan, name, a, heads)
        return opts

    def check_plan(self, plan, what: str = "attention") -> None:
        """A plan with a sequence whose queries outnumber its keys (q_len >
        kv_len, kv_len 0 included) is non-causal only (docs/layout.md): a
        causal query at a negative position means its K/V were not appended.
        Host plan data only (no device read)."""
        if self.causal and not plan.host.causal_ok:
            s = plan.host.non_causal_sequence
            raise PagedAttentionError(
                f"causal: expected False for this plan (sequence {s} has q_lens={int(plan.host.q_lens[s])} > "
                f"kv_lens={int(plan.host.kv_lens[s])}: its first queries sit at negative positions; append the "
                f"step's new K/V first, so kv_lens counts them), got True ({what})")


def head_array(plan, name: str, a, heads: int) -> None:
    """``a``: a C-contiguous float32 [heads] array on the plan's backend and
    device (sinks, ALiBi slopes)."""
    if array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy float32 array [{heads}], got "
                                  f"{type(a).__name__}")
    checks.plan_arrays(plan, **{name: a})
    if str(a.dtype) != "float32":
        raise PagedAttentionError(f"{name}: expected float32 [{heads}] (one value per query head), got {a.dtype}")
    if tuple(a.shape) != (heads,):
        raise PagedAttentionError(f"{name}: expected shape [{heads}] (one value per query head), got shape "
                                  f"{checks.shape_str(a.shape)}")
    if not a.flags.c_contiguous:
        raise PagedAttentionError(f"{name}: expected a contiguous array, got strides {tuple(a.strides)}")


@dataclass(frozen=True)
class Outputs:
    """Where a checked call writes: ``out``, ``lse`` (or None) and the
    split workspace (or None)."""

    out: object
    lse: object
    workspace: SplitWorkspace | None


def head_dims(hq: int, hkv: int, d: int, dv: int) -> None:
    if hkv < 1 or hq < 1 or hq % hkv:
        raise PagedAttentionError(
            f"q: expected a head count that is a multiple of the caches' {hkv} KV heads, got Hq={hq}")
    for name, v in (("D", d), ("Dv", dv)):
        if not 1 <= v <= MAX_HEAD_DIM:
            raise PagedAttentionError(f"{name}: expected a head dim in 1..{MAX_HEAD_DIM}, got {v}")


def queries(plan, q) -> None:
    if int(q.shape[0]) != plan.host.queries:
        raise PagedAttentionError(f"q: expected {plan.host.queries} rows (plan.queries), got shape "
                                  f"{checks.shape_str(q.shape)}")


def workspace(plan, ws, heads: int, value_dim: int) -> SplitWorkspace | None:
    if ws is None:
        return None
    if not isinstance(ws, SplitWorkspace):
        raise PagedAttentionError(f"workspace: expected a SplitWorkspace, got {type(ws).__name__}")
    exp = (plan.host.queries, heads, value_dim)
    got = (ws.queries, ws.heads, ws.value_dim)
    if got != exp:
        raise PagedAttentionError(
            f"workspace: expected queries, heads, value_dim = {exp}, got {got}")
    if ws.backend != plan.backend or ws.device != plan.device:
        raise PagedAttentionError(
            f"workspace: expected the plan's {plan.backend} backend, device {plan.device}; got "
            f"{ws.backend} backend, device {ws.device}")
    if ws.stream is not plan.stream:
        raise PagedAttentionError("workspace: expected the plan's stream, got a workspace made on another stream")
    if not 1 <= ws.splits <= MAX_SPLITS:
        raise PagedAttentionError(f"workspace: expected 1..{MAX_SPLITS} splits, got {ws.splits}")
    return ws


def outputs(plan, q, out, lse, return_lse: bool, heads: int, value_dim: int, ws, inputs: dict) -> Outputs:
    """Check (or allocate, outside capture) ``out`` [queries, heads,
    value_dim] in q's dtype and ``lse`` float32 [queries, heads] when asked
    for; neither may overlap an input or the workspace."""
    ws = workspace(plan, ws, heads, value_dim)
    if ws is not None:
        inputs = dict(inputs, workspace_out=ws.partial_out, workspace_lse=ws.partial_lse)
    shape = (plan.host.queries, heads, value_dim)
    checks.u32_size("out", shape)
    if out is None:
        check_not_capturing(plan.stream, "out")
        out = empty(q, shape, q.dtype)
    else:
        checks.plan_arrays(plan, out=out)
        checks.float_array("out", out, 3)
        checks.same_dtype("q", q, out=out)
        checks.shape_is("out", out, shape)
        checks.no_overlap("out", out, **inputs)
    if lse is None and return_lse:
        check_not_capturing(plan.stream, "lse")
        lse = empty(q, shape[:2], np.float32)
    elif lse is not None:
        checks.plan_arrays(plan, lse=lse)
        if str(lse.dtype) != "float32" or not lse.flags.c_contiguous:
            raise PagedAttentionError(f"lse: expected a C-contiguous float32 array, got {lse.dtype}")
        checks.shape_is("lse", lse, shape[:2])
        checks.no_overlap("lse", lse, out=out, **inputs)
    return Outputs(out, lse, ws)


@dataclass(frozen=True)
class CacheRead:
    """How a checked call reads its caches: their format (``fmt``, a
    ``dtypes`` row: q's dtype, or fp8), the dequantization scales (float32
    [] / [1] / [Hkv], None: 1) and their strides in the kernels' indexing
    (0: one value, 1: per KV head). For MLA, ``k_scale`` is the latent's and
    ``v_scale`` k_pos's (as ``append`` writes them)."""

    fmt: dtypes.DType
    k_scale: object = None
    v_scale: object = None
    k_scale_stride: int = 0
    v_scale_stride: int = 0

    @property
    def kv_dtype(self) -> str:
        """The caches' format token (CP_KV_DTYPE)."""
        return self.fmt.token

    def arrays(self) -> dict:
        """The scales given, by name: inputs the outputs must not overlap."""
        return {k: a for k, a in (("k_scale", self.k_scale), ("v_scale", self.v_scale)) if a is not None}


def cache_read(plan, q, caches: dict, kv_dtype, k_scale, v_scale, kv_heads: int, *, v_name: str = "v_cache",
               q_extra: dict | None = None) -> CacheRead:
    """The caches' format and scales, checked against q: ``caches`` (name ->
    array, the K cache first) share one format; an unscaled cache has q's
    dtype (as do the arrays of ``q_extra``), an fp8 cache takes float16 or
    bfloat16 queries; ``k_scale`` / ``v_scale`` (``checks.kv_scale``) only
    with an fp8 cache, ``v_scale`` only when the ``v_name`` cache is given."""
    (k_name, k_cache), *rest = caches.items()
    fmt = checks.plan_cache(plan, k_name, k_cache, kv_dtype)
    for name, c in rest:
        if c is not None:
            checks.plan_cache(plan, name, c, kv_dtype)
    q_extra = {k: a for k, a in (q_extra or {}).items() if a is not None}
    if fmt.scaled:
        checks.same_dtype(k_name, k_cache, **{n: c for n, c in rest if c is not None})
        if str(q.dtype) not in (dtypes.np_dtype(t).name for t in dtypes.TC_TOKENS if dtypes.lookup(t).query):
            raise PagedAttentionError(f"q: expected dtype float16 or bfloat16 with an fp8 ({fmt.token}) cache, got "
                                      f"{dtypes.dtype_name(q.dtype)}")
        checks.same_dtype("q", q, **q_extra)
    else:
        checks.same_dtype("q", q, **q_extra, **{n: c for n, c in caches.items() if c is not None})
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and not fmt.scaled:
            raise PagedAttentionError(f"{name}: expected None for a {fmt.name} cache (scales belong to fp8 caches: "
                                      f"kv_dtype e4m3 / e5m2)")
    if v_scale is not None and caches.get(v_name) is None:
        raise PagedAttentionError(f"v_scale: expected None without {v_name} (it scales {v_name})")
    ks = checks.kv_scale("k_scale", k_scale, kv_heads, k_cache) if k_scale is not None else 0
    vs = checks.kv_scale("v_scale", v_scale, kv_heads, k_cache) if v_scale is not None else 0
    if k_scale is not None or v_scale is not None:
        checks.plan_arrays(plan, **{n: a for n, a in (("k_scale", k_scale), ("v_scale", v_scale)) if a is not None})
    return CacheRead(fmt, k_scale, v_scale, ks, vs)


def attention_inputs(plan, q, k_cache, v_cache, *, kv_dtype=None, k_scale=None, v_scale=None) -> CacheRead:
    """q [queries, Hq, D]; k_cache [pages, page_size, Hkv, D]; v_cache
    [pages, page_size, Hkv, Dv] (views whose innermost dim is contiguous,
    possibly of one combined tensor): q's dtype, or fp8 (``kv_dtype``,
    ``k_scale`` / ``v_scale``) under float16 / bfloat16 queries; Hq a
    multiple of Hkv."""
    checks.plan_arrays(plan, q=q, k_cache=k_cache, v_cache=v_cache)
    checks.float_array("q", q, 3)
    read = cache_read(plan, q, dict(k_cache=k_cache, v_cache=v_cache), kv_dtype, k_scale, v_scale,
                      int(k_cache.shape[2]) if getattr(k_cache, "ndim", 0) == 4 else 0)
    hq, d = int(q.shape[1]), int(q.shape[2])
    hkv, dv = int(k_cache.shape[2]), int(v_cache.shape[3])
    queries(plan, q)
    checks.v_like_k(k_cache, v_cache)
    if int(k_cache.shape[3]) != d:
        raise PagedAttentionError(f"k_cache: expected head dim D={d} like q, got shape "
                                  f"{checks.shape_str(k_cache.shape)}")
    head_dims(hq, hkv, d, dv)
    return read


def _zero_width(a) -> bool:
    return array_backend(a) is not None and a.ndim >= 1 and int(a.shape[-1]) == 0


def _operand(a) -> str:
    if a is None:
        return "None"
    return f"shape {checks.shape_str(a.shape)}" if array_backend(a) is not None else type(a).__name__


def rotary_parts(q_pos, k_pos) -> tuple:
    """MLA's rotary operands, with P = 0 spelled either way: None, or
    zero-width arrays (last dim 0, FlashInfer's spelling: q_pos [queries,
    H, 0], k_pos [pages, page_size, 1, 0]), both alike. Returns (q_pos,
    k_pos), None for both when there is no rotary part."""
    none_q, none_k = q_pos is None or _zero_width(q_pos), k_pos is None or _zero_width(k_pos)
    if none_q and none_k:
        return None, None
    if none_q or none_k:
        raise PagedAttentionError(f"q_pos, k_pos: expected both or neither (neither, None or zero-width: MLA without a "
                                  f"rotary part, P = 0), got q_pos {_operand(q_pos)} and k_pos {_operand(k_pos)}")
    return q_pos, k_pos


def mla_inputs(plan, q, q_pos, latent, k_pos, *, kv_dtype=None, k_scale=None, v_scale=None) -> CacheRead:
    """q [queries, H, R]; q_pos [queries, H, P]; latent [pages, page_size, 1,
    R]; k_pos [pages, page_size, 1, P] (views whose innermost dim is
    contiguous, e.g. the two column ranges of one [pages, page_size, 1, R +
    P] cache): one dtype, or fp8 caches (``k_scale``: the latent's,
    ``v_scale``: k_pos's) under float16 / bfloat16 queries;
    1 <= P <= MAX_ROPE_DIM. Without a rotary part (P = 0) q_pos and k_pos
    are both None (``rotary_parts`` turns zero-width ones into None)."""
    q_pos, k_pos = rotary_parts(q_pos, k_pos)
    checks.plan_arrays(plan, q=q, q_pos=q_pos, latent=latent, k_pos=k_pos)
    checks.float_array("q", q, 3)
    if q_pos is not None:
        checks.float_array("q_pos", q_pos, 3)
    read = cache_read(plan, q, dict(latent=latent, k_pos=k_pos), kv_dtype, k_scale, v_scale, 1, v_name="k_pos",
                      q_extra=dict(q_pos=q_pos))
    n, h, r = (int(x) for x in q.shape)
    queries(plan, q)
    for name, cache in (("latent", latent), ("k_pos", k_pos)):
        if cache is not None and int(cache.shape[2]) != 1:
            raise PagedAttentionError(f"{name}: expected one shared head (dim 2 == 1), got shape "
                                      f"{checks.shape_str(cache.shape)}")
    if q_pos is not None:
        if tuple(q_pos.shape[:2]) != (n, h):
            raise PagedAttentionError(f"q_pos: expected shape [{n}, {h}, P] like q, got "
                                      f"{checks.shape_str(q_pos.shape)}")
        p = int(q_pos.shape[2])
        if not 1 <= p <= MAX_ROPE_DIM:
            raise PagedAttentionError(f"q_pos: expected a rotary dim P in 1..{MAX_ROPE_DIM}, got {p}")
        if int(k_pos.shape[3]) != p:
            raise PagedAttentionError(f"k_pos: expected rotary dim P={p} like q_pos, got shape "
                                      f"{checks.shape_str(k_pos.shape)}")
    if int(latent.shape[3]) != r:
        raise PagedAttentionError(f"latent: expected R={r} like q, got shape {checks.shape_str(latent.shape)}")
    head_dims(h, 1, r, r)
    return read
