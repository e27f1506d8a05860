"""Every input check of paged attention and MLA, in one place, and the one
record a checked call hands the launch (``Call``: formats, strides,
alignment, the launches and their grids, the argument struct's values), so
nothing is computed twice. Each check raises PagedAttentionError naming the
argument, what was expected and what came, before anything is allocated or
launched.

``plan`` is any object with ``host`` (a HostPlan), ``backend``, ``device``
and ``stream`` (a DevicePlan; ``Any`` in annotations: plan.py is a layer above
the ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ... import dtypes
from ..._runtime import address, array_backend, check_not_capturing, checks, device_arch, empty
from ..._runtime.arrays import Array
from ...errors import PagedAttentionError
from ...layout import MAX_HEAD_DIM, MAX_ROPE_DIM, MAX_SPLITS
from . import params
from .options import MISSING, AttentionOptions, KVLayer, _Missing, head_array, renamed
from .schedule import Launch, plan_launches
from .splits import SplitWorkspace
from .variants import MERGE_HEADS_PER_BLOCK, ROT_CAPS, VECTOR_BYTES

__all__ = [
    "AttentionOptions",
    "CacheRead",
    "Call",
    "Outputs",
    "attention_call",
    "cache_read",
    "head_array",
    "head_dims",
    "mla_call",
    "outputs",
    "record",
    "rotary_parts",
]


@dataclass(frozen=True)
class Outputs:
    """Where a checked call writes: ``out``, ``lse`` (or None) and the
    split workspace (or None)."""

    out: Array
    lse: Array
    workspace: SplitWorkspace | None


@dataclass(frozen=True)
class CacheRead:
    """How a checked call reads its caches: their format (``fmt``, a
    ``dtypes`` row: q's dtype, or fp8), the dequantization scales (float32
    [] / [1] / [Hkv], None: 1), their strides in the kernels' indexing
    (0: one value, 1: per KV head) and each cache's element strides
    (``strides``: name -> ``checks.row_view``). For MLA, ``k_scale`` is the
    latent's and ``v_scale`` k_rot's (as ``append`` writes them)."""

    fmt: dtypes.DType
    k_scale: Array = None
    v_scale: Array = None
    k_scale_stride: int = 0
    v_scale_stride: int = 0
    strides: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)

    @property
    def kv_dtype(self) -> str:
        """The caches' format token (CP_KV_DTYPE)."""
        return self.fmt.token

    def arrays(self) -> dict[str, Array]:
        """The scales given, by name: inputs the outputs must not overlap."""
        return {k: a for k, a in (("k_scale", self.k_scale), ("v_scale", self.v_scale)) if a is not None}


@dataclass(frozen=True, eq=False)
class Call:
    """One checked call, everything its launch needs, each computed once:
    ``launches`` (``schedule.Launch``, one per segment: variants chosen from
    formats, dims, alignment and strides for the device's arch; grids
    checked), ``values`` (every ``AttentionParams`` field but the query
    range) with ``refs`` (the arrays they address, kept alive by the
    arguments), the outputs, the split workspace and ``opts``."""

    plan: Any
    opts: AttentionOptions
    out: Array
    lse: Array
    workspace: SplitWorkspace | None
    launches: tuple[Launch, ...]
    splits: int
    values: dict[str, Any]  # field name -> int (floats: scale and score options)
    refs: tuple[Array, ...]
    want_lse: bool = False

    def result(self) -> Array | tuple[Array, Array]:
        """What the op returns: out, or (out, lse)."""
        return (self.out, self.lse) if self.want_lse else self.out


def head_dims(hq: int, hkv: int, d: int, dv: int) -> None:
    if hkv < 1 or hq < 1 or hq % hkv:
        raise PagedAttentionError(
            f"q: expected a head count that is a multiple of the caches' {hkv} KV heads, got Hq={hq}"
        )
    for name, v in (("D", d), ("Dv", dv)):
        if not 1 <= v <= MAX_HEAD_DIM:
            raise PagedAttentionError(f"{name}: expected a head dim in 1..{MAX_HEAD_DIM}, got {v}")


def queries(plan: Any, q: Array) -> int:
    """q's rows are the plan's queries (any view whose last dim is
    contiguous); returns its head count."""
    checks.float_array("q", q, 3, view=True)
    if int(q.shape[0]) != plan.host.queries:
        raise PagedAttentionError(
            f"q: expected {plan.host.queries} rows (plan.queries), got shape {checks.shape_str(q.shape)}"
        )
    return int(q.shape[1])


def workspace(plan: Any, ws: object, heads: int, value_dim: int) -> SplitWorkspace | None:
    if ws is None:
        return None
    if not isinstance(ws, SplitWorkspace):
        raise PagedAttentionError(f"workspace: expected a SplitWorkspace, got {type(ws).__name__}")
    exp = (plan.host.queries, heads, value_dim)
    got = (ws.queries, ws.heads, ws.value_dim)
    if got != exp:
        raise PagedAttentionError(f"workspace: expected queries, heads, value_dim = {exp}, got {got}")
    if ws.backend != plan.backend or ws.device != plan.device:
        raise PagedAttentionError(
            f"workspace: expected the plan's {plan.backend} backend, device {plan.device}; got "
            f"{ws.backend} backend, device {ws.device}"
        )
    if ws.stream is not plan.stream:
        raise PagedAttentionError("workspace: expected the plan's stream, got a workspace made on another stream")
    if not 1 <= ws.splits <= MAX_SPLITS:
        raise PagedAttentionError(f"workspace: expected 1..{MAX_SPLITS} splits, got {ws.splits}")
    return ws


def outputs(
    plan: Any,
    q: Array,
    out: Array | None,
    lse: Array | None,
    return_lse: bool,
    heads: int,
    value_dim: int,
    ws: object,
    inputs: dict[str, Array],
) -> Outputs:
    """Check (or allocate, outside capture) ``out`` [queries, heads,
    value_dim] in q's dtype and ``lse`` float32 [queries, heads] when asked
    for; neither may overlap an input or the workspace."""
    checked = workspace(plan, ws, heads, value_dim)
    if checked is not None:
        inputs = dict(inputs, workspace_out=checked.partial_out, workspace_lse=checked.partial_lse)
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
    return Outputs(out, lse, checked)


def cache_read(
    plan: Any,
    q: Array,
    caches: dict[str, Array],
    opts: AttentionOptions,
    kv_heads: int,
    *,
    v_name: str = "v_cache",
    q_extra: dict[str, Array] | None = None,
) -> CacheRead:
    """The caches' format, strides and scales (the storage options of
    ``opts``), checked against q: ``caches`` (name -> array, the K cache
    first) share one format; an unscaled cache has q's dtype (as do the
    arrays of ``q_extra``), an fp8 cache takes float16 or bfloat16 queries;
    ``k_scale`` / ``v_scale`` (``checks.kv_scale``) only with an fp8 cache,
    ``v_scale`` only when the ``v_name`` cache is given."""
    kv_dtype, k_scale, v_scale = opts.kv_dtype, opts.k_scale, opts.v_scale
    (k_name, k_cache), *rest = caches.items()
    strides, formats = {}, []
    for name, c in caches.items():
        if c is not None:
            f, strides[name] = checks.plan_cache(plan, name, c, kv_dtype)
            formats.append(f)
    fmt = formats[0]  # the K cache's (the others share it: same_dtype below)
    present = {n: c for n, c in rest if c is not None}
    q_extra = {k: a for k, a in (q_extra or {}).items() if a is not None}
    if fmt.scaled:
        checks.same_dtype(k_name, k_cache, **present)
        if str(q.dtype) not in (d.np_dtype.name for d in dtypes.TABLE if d.tensor_core and d.query):
            raise PagedAttentionError(
                f"q: expected dtype float16 or bfloat16 with an fp8 ({fmt.token}) cache, got "
                f"{dtypes.dtype_name(q.dtype)}"
            )
        checks.same_dtype("q", q, **q_extra)
    else:
        checks.same_dtype("q", q, **q_extra, **{k_name: k_cache}, **present)
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and not fmt.scaled:
            raise PagedAttentionError(
                f"{name}: expected None for a {fmt.name} cache (scales belong to fp8 caches: kv_dtype e4m3 / e5m2)"
            )
    if v_scale is not None and caches.get(v_name) is None:
        raise PagedAttentionError(f"v_scale: expected None without {v_name} (it scales {v_name})")
    ks = checks.kv_scale("k_scale", k_scale, kv_heads, k_cache) if k_scale is not None else 0
    vs = checks.kv_scale("v_scale", v_scale, kv_heads, k_cache) if v_scale is not None else 0
    if k_scale is not None or v_scale is not None:
        checks.plan_arrays(plan, **{n: a for n, a in (("k_scale", k_scale), ("v_scale", v_scale)) if a is not None})
    return CacheRead(fmt, k_scale, v_scale, ks, vs, strides)


def layer_operands(
    name: str, layer: KVLayer, other: object, other_name: str, options: dict[str, Any]
) -> tuple[Array, Array, dict[str, Any]]:
    """A layer view (``cache.layer(i)``) in place of the two caches: (its K,
    its V, ``options`` with its storage options), ``other`` (the V slot)
    left out."""
    if other is not None and other is not MISSING:
        raise PagedAttentionError(
            f"{other_name}: expected nothing with a layer view ({name} = cache.layer(i) "
            f"holds both caches; pass scale= by keyword), got {type(other).__name__}"
        )
    given = [n for n in layer.storage() if options.get(n) is not None]
    if given:
        raise PagedAttentionError(
            f"{given[0]}: expected nothing with a layer view (cache.layer(i) holds the "
            f"storage options of its caches), got {given[0]}=..."
        )
    return layer.k, layer.v, {**options, **layer.storage()}


def attention_call(
    plan: Any,
    q: Array,
    k_cache: Array,
    v_cache: Array,
    scale: float | None,
    causal: bool = True,
    *,
    workspace: SplitWorkspace | None = None,
    out: Array | None = None,
    lse: Array | None = None,
    return_lse: bool = False,
    **options: Any,
) -> Call:
    """``DevicePlan.attention``'s checks (its docstring has the shapes): q
    [queries, Hq, D]; k_cache [pages, page_size, Hkv, D]; v_cache [pages,
    page_size, Hkv, Dv] (views whose innermost dim is contiguous, possibly of
    one combined tensor; or k_cache a layer view and v_cache None): q's
    dtype, or fp8 (``kv_dtype``, ``k_scale`` / ``v_scale``) under float16 /
    bfloat16 queries; Hq a multiple of Hkv. Returns the call's record."""
    if isinstance(k_cache, KVLayer):
        k_cache, v_cache, options = layer_operands("k_cache", k_cache, v_cache, "v_cache", options)
    elif v_cache is None or v_cache is MISSING:
        raise PagedAttentionError(
            "v_cache: expected the V cache [pages, page_size, Hkv, Dv] (or k_cache = "
            "cache.layer(i), which holds both), got None"
        )
    checks.plan_arrays(plan, q=q, k_cache=k_cache, v_cache=v_cache)
    hq = queries(plan, q)
    opts = AttentionOptions.checked(scale, causal, plan=plan, heads=hq, **options)
    read = cache_read(
        plan,
        q,
        dict(k_cache=k_cache, v_cache=v_cache),
        opts,
        int(k_cache.shape[2]) if getattr(k_cache, "ndim", 0) == 4 else 0,
    )
    d, hkv, dv = int(q.shape[2]), int(k_cache.shape[2]), int(v_cache.shape[3])
    checks.v_like_k(k_cache, v_cache)
    if int(k_cache.shape[3]) != d:
        raise PagedAttentionError(
            f"k_cache: expected head dim D={d} like q, got shape {checks.shape_str(k_cache.shape)}"
        )
    head_dims(hq, hkv, d, dv)
    opts.check_plan(plan, "attention")
    o = outputs(
        plan,
        q,
        out,
        lse,
        return_lse or lse is not None,
        hq,
        dv,
        workspace,
        dict(q=q, k_cache=k_cache, v_cache=v_cache, **opts.arrays()),
    )
    return record(plan, q, k_cache, v_cache, opts, o, read, want_lse=return_lse or lse is not None)


def _zero_width(a: Array) -> bool:
    return array_backend(a) is not None and a.ndim >= 1 and int(a.shape[-1]) == 0


def _operand(a: Array) -> str:
    if a is None:
        return "None"
    return f"shape {checks.shape_str(a.shape)}" if array_backend(a) is not None else type(a).__name__


def rotary_parts(q_rot: Array | None, k_rot: Array | None) -> tuple[Array | None, Array | None]:
    """MLA's rotary operands, with P = 0 spelled either way: None, or
    zero-width arrays (last dim 0, FlashInfer's spelling: q_rot [queries,
    H, 0], k_rot [pages, page_size, 1, 0]), both alike. Returns (q_rot,
    k_rot), None for both when there is no rotary part."""
    none_q, none_k = q_rot is None or _zero_width(q_rot), k_rot is None or _zero_width(k_rot)
    if none_q and none_k:
        return None, None
    if none_q or none_k:
        raise PagedAttentionError(
            f"q_rot, k_rot: expected both or neither (neither, None or zero-width: MLA without a "
            f"rotary part, P = 0), got q_rot {_operand(q_rot)} and k_rot {_operand(k_rot)}"
        )
    return q_rot, k_rot


def mla_call(
    plan: Any,
    q: Array,
    q_rot: Array | _Missing = MISSING,
    latent: Array = None,
    k_rot: Array | _Missing = MISSING,
    scale: float | None = None,
    causal: bool = True,
    *,
    workspace: SplitWorkspace | None = None,
    out: Array | None = None,
    lse: Array | None = None,
    return_lse: bool = False,
    **options: Any,
) -> Call:
    """``DevicePlan.mla``'s checks (its docstring has the shapes): q
    [queries, H, R]; q_rot [queries, H, P]; latent [pages, page_size, 1,
    R]; k_rot [pages, page_size, 1, P] (views whose innermost dim is
    contiguous, e.g. the two column ranges of one [pages, page_size, 1, R +
    P] cache; or latent a layer view: K the latent, V k_rot): one dtype, or
    fp8 caches (``k_scale``: the latent's, ``v_scale``: k_rot's) under
    float16 / bfloat16 queries; 1 <= P <= MAX_ROPE_DIM, or no rotary part
    (P = 0: both None or zero-width). ``q_pos`` / ``k_pos``: the deprecated
    names of q_rot / k_rot. Returns the call's record."""
    parts = renamed(options, dict(q_rot=q_rot, k_rot=k_rot), dict(q_pos="q_rot", k_pos="k_rot"))
    q_rot, k_rot = parts["q_rot"], parts["k_rot"]
    if isinstance(latent, KVLayer):
        latent, k_rot, options = layer_operands("latent", latent, k_rot, "k_rot", options)
    if latent is None:
        raise PagedAttentionError("latent: expected a NumPy or CuPy array [pages, page_size, 1, R], got None")
    q_rot, k_rot = rotary_parts(None if q_rot is MISSING else q_rot, None if k_rot is MISSING else k_rot)
    checks.plan_arrays(plan, q=q, q_rot=q_rot, latent=latent, k_rot=k_rot)
    h = queries(plan, q)
    opts = AttentionOptions.checked(scale, causal, plan=plan, heads=h, **options)
    if q_rot is not None:
        checks.float_array("q_rot", q_rot, 3, view=True)
    read = cache_read(plan, q, dict(latent=latent, k_rot=k_rot), opts, 1, v_name="k_rot", q_extra=dict(q_rot=q_rot))
    n, r = int(q.shape[0]), int(q.shape[2])
    for name, cache in (("latent", latent), ("k_rot", k_rot)):
        if cache is not None and int(cache.shape[2]) != 1:
            raise PagedAttentionError(
                f"{name}: expected one shared head (dim 2 == 1), got shape {checks.shape_str(cache.shape)}"
            )
    if q_rot is not None:
        if tuple(q_rot.shape[:2]) != (n, h):
            raise PagedAttentionError(
                f"q_rot: expected shape [{n}, {h}, P] like q, got {checks.shape_str(q_rot.shape)}"
            )
        p = int(q_rot.shape[2])
        if not 1 <= p <= MAX_ROPE_DIM:
            raise PagedAttentionError(f"q_rot: expected a rotary dim P in 1..{MAX_ROPE_DIM}, got {p}")
        assert k_rot is not None  # rotary_parts: both or neither
        if int(k_rot.shape[3]) != p:
            raise PagedAttentionError(
                f"k_rot: expected rotary dim P={p} like q_rot, got shape {checks.shape_str(k_rot.shape)}"
            )
    if int(latent.shape[3]) != r:
        raise PagedAttentionError(f"latent: expected R={r} like q, got shape {checks.shape_str(latent.shape)}")
    head_dims(h, 1, r, r)
    opts.check_plan(plan, "mla")
    o = outputs(
        plan,
        q,
        out,
        lse,
        return_lse or lse is not None,
        h,
        r,
        workspace,
        dict(q=q, q_rot=q_rot, latent=latent, k_rot=k_rot, **opts.arrays()),
    )
    return record(
        plan, q, latent, latent, opts, o, read, q_rot=q_rot, k_rot=k_rot, want_lse=return_lse or lse is not None
    )


# ---------------------------------------------------------------------------
# The record


def contiguous(a: Array) -> bool:
    """``a`` is laid out C-contiguously (dims of size 1 ignored)."""
    step = int(a.itemsize)
    for n, s in reversed(list(zip(a.shape, a.strides))):
        if int(n) > 1 and int(s) != step:
            return False
        step *= int(n)
    return True


def same_view(a: Array, b: Array) -> bool:
    """``a`` and ``b`` are one view (address, shape and strides)."""
    return (
        address(a) == address(b)
        and tuple(a.shape) == tuple(b.shape)
        and tuple(a.strides) == tuple(b.strides)
        and a.itemsize == b.itemsize
    )


def record(
    plan: Any,
    q: Array,
    k_cache: Array,
    v_cache: Array,
    opts: AttentionOptions,
    o: Outputs,
    read: CacheRead,
    *,
    q_rot: Array | None = None,
    k_rot: Array | None = None,
    want_lse: bool = False,
) -> Call:
    """The record of a checked call (its inputs already checked; ``read``
    holds the caches' format, scales and strides). The launches' variants
    are chosen from dtypes, dims, alignment (every base address and every
    stride of a dim longer than 1 a multiple of 16 bytes: 16-byte loads /
    cp.async), whether a cache view is strided (not C-contiguous:
    STRIDED_KERNELS only) and whether V is the K cache (MLA), for the
    device's arch; every grid of the step (attention launches and the merge)
    is checked here, before the first launch, so a merge that could not
    launch never finds the split kernels' partials written."""
    host = plan.host
    queries, hq, d = (int(s) for s in q.shape)
    hkv, dv = int(k_cache.shape[2]), int(v_cache.shape[3])
    rot_dim = 0 if q_rot is None else int(q_rot.shape[2])
    ws = o.workspace
    splits = 1 if ws is None else int(ws.splits)
    latent = same_view(k_cache, v_cache)
    launches: tuple[Launch, ...] = ()
    if queries:
        aligned = all(checks.aligned(a, VECTOR_BYTES) for a in (q, k_cache, v_cache, o.out))
        aligned_tc = aligned and (not rot_dim or all(checks.aligned(a, VECTOR_BYTES) for a in (q_rot, k_rot)))
        strided = not all(contiguous(a) for a in (k_cache, v_cache, k_rot) if a is not None)
        launches = plan_launches(
            host,
            dtypes.token(q.dtype),
            hq,
            hkv,
            d,
            dv,
            rot_dim,
            aligned,
            aligned_tc,
            opts.kernel_score,
            arch=device_arch(q),
            features=opts.features,
            kv_dtype=read.kv_dtype,
            strided=strided,
            latent=latent,
        )
        tiles = max(launch.tiles for launch in launches)
        if hkv * tiles > 65535:
            raise PagedAttentionError(
                f"q: expected at most 65535 KV heads x head tiles in a launch, got {hkv} x {tiles}"
            )
        if queries > 2**31 - 1:
            raise PagedAttentionError(f"q: expected at most {2**31 - 1} queries in a launch, got {queries}")
        for launch in launches:
            gx, gy, _ = launch.grid(hkv, splits)
            if gx > 2**31 - 1 or gy > 65535:
                raise PagedAttentionError(
                    f"q: {launch.kernel}'s grid ({gx}, {gy}) exceeds (2^31 - 1, 65535) for "
                    f"{queries} queries and {hq} query heads"
                )
        if splits > 1 and -(-hq // MERGE_HEADS_PER_BLOCK) > 65535:
            raise PagedAttentionError(
                f"q: expected at most {65535 * MERGE_HEADS_PER_BLOCK} query heads for the split merge, got {hq}"
            )
    k_scale, k_scale_stride = read.k_scale, read.k_scale_stride
    v_scale, v_scale_stride = read.v_scale, read.v_scale_stride
    if latent and not rot_dim:  # MLA without a rotary part: V is the latent, scaled as K
        v_scale, v_scale_stride = k_scale, k_scale_stride
    k_names = [n for n in read.strides if n != "k_rot"]  # the K (and V) cache, as the checks named them
    k_strides = read.strides[k_names[0]]
    v_strides = read.strides[k_names[1]] if len(k_names) > 1 and not latent else k_strides
    rot_strides = read.strides["k_rot"][:2] if k_rot is not None else (0, 0)  # page, slot (one head)
    q_strides = checks.view_strides("q", q)  # token, head
    q_rot_strides = checks.view_strides("q_rot", q_rot) if q_rot is not None else (0, 0)
    split = ws if splits > 1 else None  # the workspace of the split partials (None: unsplit)
    refs = tuple(
        a
        for a in (
            q,
            k_cache,
            v_cache,
            q_rot,
            k_rot,
            plan.words,
            o.out,
            o.lse,
            *opts.arrays().values(),
            k_scale,
            v_scale,
        )
        if a is not None
    ) + ((split.partial_out, split.partial_lse) if split is not None else ())
    # Pointers a launch never reads are 0 (no rotary part, no lse, no split, an option not given).
    values: dict[str, Any] = dict.fromkeys(params.NAMES, 0)
    values.update(opts.params())
    values.update(
        q=address(q),
        k_cache=address(k_cache),
        v_cache=address(v_cache),
        q_rot=0 if q_rot is None else address(q_rot),
        k_rot=0 if k_rot is None else address(k_rot),
        words=address(plan.words),
        out=address(o.out),
        lse=0 if o.lse is None else address(o.lse),
        part_out=address(split.partial_out) if split is not None else 0,
        part_lse=address(split.partial_lse) if split is not None else 0,
        queries=host.queries,
        sequences=host.sequences,
        table_width=host.table_width,
        page_size=host.page_size,
        num_pages=host.pages,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        value_dim=dv,
        rot_dim=rot_dim,
        splits=splits,
        kv_len_hint=host.max_kv_len,  # a u32 word of every plan
        causal=int(opts.causal),
        write_lse=int(o.lse is not None),
        scale=opts.scale,
        k_stride_page=k_strides[0],
        k_stride_slot=k_strides[1],
        k_stride_head=k_strides[2],
        v_stride_page=v_strides[0],
        v_stride_slot=v_strides[1],
        v_stride_head=v_strides[2],
        rot_stride_page=rot_strides[0],
        rot_stride_slot=rot_strides[1],
        k_scale=0 if k_scale is None else address(k_scale),
        v_scale=0 if v_scale is None else address(v_scale),
        k_scale_stride=k_scale_stride,
        v_scale_stride=v_scale_stride,
        q_stride_token=q_strides[0],
        q_stride_head=q_strides[1],
        q_rot_stride_token=q_rot_strides[0],
        q_rot_stride_head=q_rot_strides[1],
    )
    return Call(plan, opts, o.out, o.lse, ws, launches, splits, values, refs, want_lse)


def unchecked(
    plan: Any,
    q: Array,
    k_cache: Array,
    v_cache: Array,
    out: Array,
    opts: AttentionOptions,
    *,
    q_rot: Array | None = None,
    k_rot: Array | None = None,
    lse: Array | None = None,
    workspace: SplitWorkspace | None = None,
    read: CacheRead | None = None,
) -> Call:
    """The record of arrays that come unchecked (``launch.launch_attention``,
    the layer under the ops): the rotary parts' structure is checked and the
    caches' strides computed here (``read``: format and scales, None: q's
    dtype, no scales)."""
    hkv, d, dv = int(k_cache.shape[2]), int(k_cache.shape[3]), int(v_cache.shape[3])
    if q_rot is not None or k_rot is not None:
        if q_rot is None or k_rot is None:
            raise PagedAttentionError("q_rot, k_rot: expected both or neither")
        if int(q_rot.shape[2]) > ROT_CAPS[-1]:
            raise PagedAttentionError(
                f"q_rot: expected a rotary dim up to {ROT_CAPS[-1]} (built), got {int(q_rot.shape[2])}"
            )
        if hkv != 1 or dv != d or address(v_cache) != address(k_cache):
            raise PagedAttentionError(
                "v_cache: expected the K cache itself with a rotary part (one KV head, "
                "v_cache the same array as k_cache: the MLA latent cache)"
            )
    if read is None:  # the caller's contract: a known dtype (unchecked here; no launch reads None's format)
        read = CacheRead(cast(dtypes.DType, dtypes.lookup(k_cache.dtype)))
    caches = dict(k_cache=k_cache, v_cache=v_cache, **({} if k_rot is None else dict(k_rot=k_rot)))
    read = CacheRead(
        read.fmt,
        read.k_scale,
        read.v_scale,
        read.k_scale_stride,
        read.v_scale_stride,
        {n: checks.row_view(n, c) for n, c in caches.items()},
    )
    return record(plan, q, k_cache, v_cache, opts, Outputs(out, lse, workspace), read, q_rot=q_rot, k_rot=k_rot)
