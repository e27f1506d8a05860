"""Helpers of the cache-storage tests (fp8 caches and cache views; issue #14):
build a case's caches in a storage layout and format, run them through the
public API and compare with the float64 reference on the DEQUANTIZED cache
times its scale. Any kernel family can reuse them: ``run_attention`` /
``run_mla`` return the kernels that ran (``launch.launches_for``), so a
test can assert its family served the case.

Layouts (``view``): ``"nhd"`` (the plain C-contiguous [pages, page_size,
Hkv, D]), ``"hnd"`` (a view of a [pages, Hkv, page_size, D] array),
``"combined"`` (kv[:, 0] / kv[:, 1] of one [pages, 2, page_size, Hkv, D]
tensor; D == Dv), ``"misaligned"`` (C-contiguous, but starting one element
past a 16-byte boundary: element loads).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import cupaged
from cupaged.ops.attention import inputs, launch
from cupaged.testing import assert_close, make_mla_case, make_paged_case, reference

FP8 = ["e4m3", "e5m2"]
VIEWS = ["nhd", "hnd", "combined", "misaligned"]


# ------------------------------------------------------------------ storage
def storage_like(a: np.ndarray, offset_bytes: int = 0) -> np.ndarray:
    """A C-contiguous array of a's shape and dtype starting ``offset_bytes``
    past a 64-byte boundary (a copy of a)."""
    a = np.asarray(a)
    buf = np.zeros(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset_bytes
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def as_view(k: np.ndarray, v: np.ndarray, view: str) -> tuple[np.ndarray, np.ndarray]:
    """k_cache, v_cache [pages, page_size, Hkv, D / Dv] with the same
    elements in storage layout ``view`` (module docstring)."""
    if view == "nhd":
        return storage_like(k), storage_like(v)
    if view == "hnd":

        def hnd(c):
            base = storage_like(np.ascontiguousarray(c.transpose(0, 2, 1, 3)))  # [pages, Hkv, page_size, D]
            return base.transpose(0, 2, 1, 3)

        return hnd(k), hnd(v)
    if view == "combined":
        assert k.shape == v.shape, "a combined KV tensor needs D == Dv"
        kv = storage_like(np.stack([k, v], axis=1))  # [pages, 2, page_size, Hkv, D]
        return kv[:, 0], kv[:, 1]
    if view == "misaligned":
        return storage_like(k, k.itemsize), storage_like(v, v.itemsize)
    raise ValueError(view)


@dataclasses.dataclass
class StoredCase:
    """A paged case with its caches stored in a format: ``case`` (the float
    case: q, layout; its caches hold the values before quantization),
    ``k_cache`` / ``v_cache`` (stored: fp8 codes or q's dtype), ``kv_args``
    (kv_dtype / k_scale / v_scale for the API) and the dequantized float64
    caches ``k_ref`` / ``v_ref`` the reference reads."""

    case: object
    k_cache: np.ndarray
    v_cache: np.ndarray
    kv_args: dict
    k_ref: np.ndarray
    v_ref: np.ndarray


def scales(rng, fmt: str | None, per_head: bool, heads: int):
    """A float32 dequantization scale: [heads] per KV head or [] per tensor
    (None without fp8)."""
    if fmt is None:
        return None
    s = rng.uniform(0.02, 0.2, heads if per_head else ()).astype(np.float32)
    return s


def quantized(case_k, fmt, scale, *, poison_rng=None, used=None):
    """fp8 codes of ``case_k`` [pages, page_size, Hkv, D] with ``scale``
    ([] or [Hkv]); unused slots (``~used``) hold NaN codes, and Inf codes
    on e5m2 (which has them) in about half of them."""
    s = np.asarray(scale, np.float32)
    sb = s[:, None] if s.ndim == 1 else s
    codes = reference.quantize_fp8(case_k, fmt, sb)
    if used is not None:
        raw = codes.view(np.uint8)
        nan = 0x7F if fmt == "e4m3" else 0x7E
        raw[~used] = nan
        if fmt == "e5m2" and poison_rng is not None:
            mask = ~used & (poison_rng.random(used.shape) < 0.5)
            raw[mask] = 0x7C  # +inf
    return codes


def store(rng, case, fmt: str | None, per_head: bool = False, view: str = "nhd", uint8: bool = False) -> StoredCase:
    """``case`` (a PagedCase) stored as ``fmt`` ("e4m3" / "e5m2" with
    scales per head or per tensor, or None: q's dtype) in layout ``view``.
    ``uint8``: fp8 as raw uint8 storage named by kv_dtype."""
    if fmt is None:
        k, v = as_view(case.k_cache, case.v_cache, view)
        return StoredCase(case, k, v, {}, reference._f64(case.k_cache), reference._f64(case.v_cache))
    hkv = case.k_cache.shape[2]
    ks, vs = scales(rng, fmt, per_head, hkv), scales(rng, fmt, per_head, hkv)
    used = case.slot_used
    kc = quantized(case.k_cache.astype(np.float32), fmt, ks, poison_rng=rng, used=used)
    vc = quantized(case.v_cache.astype(np.float32), fmt, vs, poison_rng=rng, used=used)
    bk = ks[:, None] if ks.ndim else ks
    bv = vs[:, None] if vs.ndim else vs
    k_ref = reference.dequantize_fp8(kc, scale=bk)
    v_ref = reference.dequantize_fp8(vc, scale=bv)
    if uint8:
        kc, vc = kc.view(np.uint8), vc.view(np.uint8)
    k, v = as_view(kc, vc, view)
    return StoredCase(case, k, v, dict(kv_dtype=fmt, k_scale=ks, v_scale=vs), k_ref, v_ref)


def fp8_paged_case(rng, fmt, per_head=False, view="nhd", *, dtype="f16", uint8=False, **kw) -> StoredCase:
    """A random PagedCase (``make_paged_case(**kw)`` in ``dtype``) stored
    as ``fmt`` in ``view``."""
    return store(rng, make_paged_case(rng, dtype=dtype, **kw), fmt, per_head, view, uint8)


# ------------------------------------------------------------------ families
def only_kernels(monkeypatch, names) -> None:
    """Make selection pick from the builds of the kernels ``names`` only
    (the others are left out of ``variants._TABLE`` for the test), so a
    test runs one kernel family on shapes another would take."""
    from cupaged.ops.attention import variants

    names = set(names)
    table = {k: [v for v in rows if v.kernel in names] for k, rows in variants._TABLE.items()}
    monkeypatch.setattr(variants, "_TABLE", table)


# ------------------------------------------------------------------ running
def kernels(plan, q, k, v, out, opts, **kw) -> tuple[str, ...]:
    """The kernels ``launch_attention`` runs for these arrays (``kw``:
    q_rot, k_rot, read as ``launch.launches_for`` takes them)."""
    return tuple(x.kernel for x in launch.launches_for(plan, q, k, v, out, opts, **kw))


def run_attention(sc: StoredCase, causal=True, *, splits=None, **score):
    """Run a StoredCase through ``DevicePlan.attention`` (CPU backend).
    Returns (out, lse, kernels that ran)."""
    case = sc.case
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(
        case.q
    )
    ws = None
    if splits:
        ws = cupaged.SplitWorkspace(plan.queries, case.q.shape[1], sc.v_cache.shape[3], splits, like=case.q)
    out = np.zeros((plan.queries, case.q.shape[1], sc.v_cache.shape[3]), case.q.dtype)
    o, lse = plan.attention(
        case.q,
        sc.k_cache,
        sc.v_cache,
        case.scale,
        causal,
        workspace=ws,
        out=out,
        return_lse=True,
        **score,
        **sc.kv_args,
    )
    call = inputs.attention_call(
        plan, case.q, sc.k_cache, sc.v_cache, case.scale, causal, workspace=ws, out=out, **score, **sc.kv_args
    )
    return o, lse, tuple(x.kernel for x in call.launches)


def reference_out(sc: StoredCase, causal=True, **score):
    """The float64 reference on the dequantized caches."""
    case = sc.case
    if score:
        return reference.scored_attention(
            case.q, sc.k_ref, sc.v_ref, case.page_table, case.kv_lens, case.q_lens, case.scale, causal, **score
        )
    return reference.paged_attention(
        case.q, sc.k_ref, sc.v_ref, case.page_table, case.kv_lens, case.q_lens, case.scale, causal
    )


def check_attention(sc: StoredCase, causal=True, *, splits=None, what="", **score) -> tuple[str, ...]:
    """Run and compare out and lse at q's dtype tolerance (the decoding is
    exact and the scales apply in f32: docs/layout.md, "Cache views and fp8
    caches"). Returns the kernels that ran."""
    o, lse, ran = run_attention(sc, causal, splits=splits, **score)
    ref_o, ref_lse = reference_out(sc, causal, **score)
    dt = sc.case.q.dtype
    assert np.isfinite(o.astype(np.float64)).all(), f"{what}: non-finite output"
    assert_close(o, ref_o, dt, f"{what} out")
    assert_close(lse, ref_lse, dt, f"{what} lse")
    return ran


# ------------------------------------------------------------------ MLA
@dataclasses.dataclass
class StoredMla:
    """An MLA case stored in one [pages, page_size, 1, R + P] cache (``c``):
    latent = c[..., :R], k_pos = c[..., R:] (None when P = 0), fp8 or q's
    dtype; the dequantized float64 ``latent_ref`` / ``k_pos_ref``."""

    case: object
    latent: np.ndarray
    k_pos: np.ndarray | None
    kv_args: dict
    latent_ref: np.ndarray
    k_pos_ref: np.ndarray | None


def stored_mla(rng, fmt, *, rope=True, joint=True, dtype="bf16", **kw) -> StoredMla:
    """A random MLA case (``make_mla_case(**kw)``) stored as ``fmt`` (None:
    q's dtype); ``joint``: latent and k_pos are column views of one
    [pages, page_size, 1, R + P] array; ``rope`` False: P = 0."""
    case = make_mla_case(rng, dtype=dtype, **kw)
    lat, kp = case.latent, case.k_pos
    args = {}
    if fmt is not None:
        ks, vs = scales(rng, fmt, False, 1), scales(rng, fmt, False, 1)
        used = case.slot_used
        lat = quantized(lat.astype(np.float32), fmt, ks, poison_rng=rng, used=used)
        kp = quantized(kp.astype(np.float32), fmt, vs, poison_rng=rng, used=used)
        lat_ref, kp_ref = reference.dequantize_fp8(lat, scale=ks), reference.dequantize_fp8(kp, scale=vs)
        args = dict(kv_dtype=fmt, k_scale=ks, v_scale=vs) if rope else dict(kv_dtype=fmt, k_scale=ks)
    else:
        lat_ref, kp_ref = reference._f64(lat), reference._f64(kp)
    r = lat.shape[3]
    if joint:
        c = storage_like(np.concatenate([lat, kp], axis=-1))
        lat, kp = c[..., :r], c[..., r:]
    else:
        lat, kp = storage_like(lat), storage_like(kp)
    if not rope:
        kp, kp_ref = None, None
    return StoredMla(case, lat, kp, args, lat_ref, kp_ref)


def check_mla(sm: StoredMla, causal=True, *, splits=None, what="") -> tuple[str, ...]:
    """Run ``DevicePlan.mla`` on a StoredMla and compare with the float64
    reference on the dequantized caches; returns the kernels that ran."""
    case = sm.case
    q_pos = case.q_pos if sm.k_pos is not None else None
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(
        case.q
    )
    ws = None
    r = case.q.shape[2]
    if splits:
        ws = cupaged.SplitWorkspace(plan.queries, case.q.shape[1], r, splits, like=case.q)
    out = np.zeros((plan.queries, case.q.shape[1], r), case.q.dtype)
    o, lse = plan.mla(
        case.q, q_pos, sm.latent, sm.k_pos, case.scale, causal, workspace=ws, out=out, return_lse=True, **sm.kv_args
    )
    if sm.k_pos is not None:
        ref_o, ref_lse = reference.paged_mla(
            case.q,
            case.q_pos,
            sm.latent_ref,
            sm.k_pos_ref,
            case.page_table,
            case.kv_lens,
            case.q_lens,
            case.scale,
            causal,
        )
    else:
        ref_o, ref_lse = reference.paged_attention(
            case.q, sm.latent_ref, sm.latent_ref, case.page_table, case.kv_lens, case.q_lens, case.scale, causal
        )
    dt = case.q.dtype
    assert np.isfinite(o.astype(np.float64)).all(), f"{what}: non-finite output"
    assert_close(o, ref_o, dt, f"{what} out")
    assert_close(lse, ref_lse, dt, f"{what} lse")
    call = inputs.mla_call(
        plan, case.q, q_pos, sm.latent, sm.k_pos, case.scale, causal, workspace=ws, out=out, **sm.kv_args
    )
    return tuple(x.kernel for x in call.launches)


__all__ = [
    "FP8",
    "VIEWS",
    "StoredCase",
    "StoredMla",
    "as_view",
    "check_attention",
    "check_mla",
    "fp8_paged_case",
    "kernels",
    "only_kernels",
    "quantized",
    "reference_out",
    "run_attention",
    "scales",
    "storage_like",
    "store",
    "stored_mla",
]
