"""MLA cache storage on the tensor-core MLA kernels (issue #14): the
576-wide DeepSeek cache read as column views (latent = c[..., :512],
k_pos = c[..., 512:], no copy), MLA without a rotary part (P = 0), and fp8
latent caches (e4m3 / e5m2 codes of the latent with k_scale and of k_pos
with v_scale, as append writes them; f16 / bf16 q), on each build
(``mla_arch``: on sm_90 paged_mla_seesaw, or paged_mla_wgmma for an fp8
cache; paged_mla_tc on sm_80), against the
float64 reference on the DEQUANTIZED caches (codes times their scale).

Tolerance: q's dtype (cupaged.testing.tolerance: f16 2e-3, bf16 as listed
there). The codes decode exactly to q's 16-bit type and k_scale applies in
f32 (score scale, output); the one extra rounding is q_rot * v_scale /
k_scale to q's type when the two scales differ, within the same budget as
q's own rounding.

Every case is a step mixing decodes and prefill chunks (16 heads: 4 queries
a block, blocks straddling sequences), causal and not, with and without
3 splits; unused slots hold NaN codes (and Inf on e5m2).
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import _to_device, mla_kernel

import cupaged
from cupaged.testing import as_dtype, assert_close, make_mla_case, reference

R, P = 512, 64
KV_LENS = np.array([45, 3, 30], np.int32)
Q_LENS = np.array([1, 3, 2], np.int32)


def _scales(rng, fmt):
    """Per-tensor k_scale / v_scale, different so that the q_rot fold is exercised."""
    if fmt is None:
        return None, None
    return (np.array(rng.uniform(0.02, 0.2), np.float32), np.array(rng.uniform(0.3, 0.9), np.float32))


def _codes(x, fmt, scale, used, rng):
    """fp8 codes of x (unused slots NaN, on e5m2 also +Inf) as uint8 storage."""
    codes = reference.quantize_fp8(x.astype(np.float32), fmt, scale).view(np.uint8).copy()
    codes[~used] = 0x7F if fmt == "e4m3" else 0x7E
    if fmt == "e5m2":
        codes[~used & (rng.random(used.shape) < 0.5)] = 0x7C
    return codes


class Stored:
    """An MLA case with its caches stored in ``fmt`` (None: q's dtype) as
    ``joint`` column views of one [pages, page_size, 1, R + P] array or as
    two C-contiguous arrays; ``rope`` False: P = 0 (latent only)."""

    def __init__(self, backend, rng, fmt, dtype, *, joint=True, rope=True, heads=16, scales=True, page_size=16):
        case = make_mla_case(
            rng,
            kv_lens=KV_LENS,
            q_lens=Q_LENS,
            page_size=page_size,
            num_heads=heads,
            latent_dim=R,
            pos_dim=P,
            dtype=dtype,
        )
        used = case.slot_used
        self.case, self.fmt, self.rope = case, fmt, rope
        ks, vs = _scales(rng, fmt) if scales else (np.float32(1.0), np.float32(1.0))  # None means 1.0
        if fmt is None:
            lat, kp = case.latent, case.k_pos
            self.lat_ref, self.kp_ref = reference._f64(lat), reference._f64(kp)
            self.kv_args = {}
        else:
            lat, kp = _codes(case.latent, fmt, ks, used, rng), _codes(case.k_pos, fmt, vs, used, rng)
            self.lat_ref = reference.dequantize_fp8(lat, fmt, ks)
            self.kp_ref = reference.dequantize_fp8(kp, fmt, vs)
            self.kv_args = dict(kv_dtype=fmt)
            if scales:
                self.kv_args.update(k_scale=_to_device(backend, ks.reshape(1)))
                if rope:
                    self.kv_args.update(v_scale=_to_device(backend, vs.reshape(1)))
        if joint:
            c = _to_device(backend, np.ascontiguousarray(np.concatenate([lat, kp], axis=-1)))
            self.latent, self.k_pos = c[..., :R], c[..., R:]
        else:
            self.latent, self.k_pos = _to_device(backend, lat), _to_device(backend, kp)
        self.q = _to_device(backend, case.q)
        self.q_pos = _to_device(backend, case.q_pos) if rope else None
        if not rope:
            self.k_pos = None
        self.plan = cupaged.HostPlan.build(
            case.page_table, case.kv_lens, case.q_lens, page_size, case.num_pages
        ).upload(self.q)

    def reference(self, causal):
        c = self.case
        if self.rope:
            return reference.paged_mla(
                c.q, c.q_pos, self.lat_ref, self.kp_ref, c.page_table, c.kv_lens, c.q_lens, c.scale, causal
            )
        return reference.paged_attention(
            c.q, self.lat_ref, self.lat_ref, c.page_table, c.kv_lens, c.q_lens, c.scale, causal
        )

    def run(self, backend, causal, splits):
        heads = self.case.q.shape[1]
        ws = None if splits is None else cupaged.SplitWorkspace(self.plan.queries, heads, R, splits, self.q)
        o, lse = self.plan.mla(
            self.q,
            self.q_pos,
            self.latent,
            self.k_pos,
            self.case.scale,
            causal,
            return_lse=True,
            workspace=ws,
            **self.kv_args,
        )
        return backend.to_numpy(o), backend.to_numpy(lse)


def _check_all(backend, st, what):
    """Every mask and split count against the reference at q's tolerance."""
    dtype = st.case.q.dtype
    for causal in (True, False):
        ref_o, ref_lse = st.reference(causal)
        for splits in (None, 3):
            o, lse = st.run(backend, causal, splits)
            w = f"{what} causal={causal} splits={splits}"
            assert np.isfinite(o.astype(np.float64)).all(), f"{w}: non-finite output"
            assert_close(o, ref_o, dtype, f"{w} out")
            assert_close(lse, ref_lse, dtype, f"{w} lse")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_576_wide_cache_views(xp_backend, mla_arch, kernels_used, dtype):
    """latent = c[..., :512] and k_pos = c[..., 512:] of one 576-wide cache
    (16-byte aligned views, rows 1152 bytes apart) on the tensor-core
    builds, no copy."""
    st = Stored(xp_backend, np.random.default_rng(576), None, dtype)
    assert st.latent.strides[1] == (R + P) * st.latent.itemsize and not st.latent.flags.c_contiguous
    _check_all(xp_backend, st, f"576 view {dtype}")
    assert set(kernels_used) == {mla_arch, "attention_split_merge"}


@pytest.mark.parametrize("fmt, heads", [(None, 16), ("e4m3", 16), (None, 128)])
def test_no_rotary_part(xp_backend, mla_arch, kernels_used, fmt, heads):
    """P = 0: mla(q, None, latent, None) on the tensor-core builds (their
    ROPE_DIM 0 builds), score = scale * q.latent, a 16-bit and an fp8
    latent, each the first 512 columns of a 576-wide cache (a strided view);
    128 heads: two head tiles a query (the fastest grid index, as with a
    rotary part)."""
    st = Stored(xp_backend, np.random.default_rng([heads, fmt is None]), fmt, "bf16", rope=False, heads=heads)
    _check_all(xp_backend, st, f"P=0 {fmt} h={heads}")
    assert set(kernels_used) == {mla_kernel(mla_arch, fmt), "attention_split_merge"}


@pytest.mark.parametrize(
    "case",
    [("e4m3", "bf16", True, 16), ("e5m2", "f16", True, 64), ("e4m3", "f16", False, 16), ("e5m2", "bf16", False, 5)],
    ids=lambda c: "{}-{}-{}-ps{}".format(c[0], c[1], "joint" if c[2] else "contiguous", c[3]),
)
def test_fp8_latent_cache(xp_backend, mla_arch, kernels_used, case):
    """fp8 codes of the latent (k_scale) and of k_pos (v_scale, a different
    scale), in one 576-wide cache or two contiguous arrays, pages of 16, 64
    (FlashMLA's) and 5 tokens: decode and prefill chunks, both masks, splits."""
    fmt, dtype, joint, page_size = case
    st = Stored(
        xp_backend,
        np.random.default_rng([ord(fmt[1]), len(dtype), joint]),
        fmt,
        dtype,
        joint=joint,
        page_size=page_size,
    )
    _check_all(xp_backend, st, f"{fmt} {dtype} joint={joint} page_size={page_size}")
    assert set(kernels_used) == {mla_kernel(mla_arch, fmt), "attention_split_merge"}


def test_fp8_without_scales(xp_backend, mla_arch, kernels_used):
    """An fp8 latent cache without k_scale / v_scale: the codes themselves
    (scale 1.0)."""
    st = Stored(xp_backend, np.random.default_rng(3), "e4m3", "bf16", scales=False)
    assert "k_scale" not in st.kv_args
    _check_all(xp_backend, st, "e4m3 unscaled")
    assert set(kernels_used) == {mla_kernel(mla_arch, "e4m3"), "attention_split_merge"}


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_fp8_masked_nonfinite_codes(xp_backend, mla_arch, kernels_used, fmt):
    """Inf / NaN codes (e5m2 has both, e4m3 only NaN) in valid latent rows of
    tokens later in a chunk reach no query that cannot see them (causal; a
    block's rows see different tokens); those that see them match the
    reference (its Inf / NaN where it has them)."""
    dtype = "f16" if fmt == "e5m2" else "bf16"
    st = Stored(xp_backend, np.random.default_rng([5, ord(fmt[1])]), fmt, dtype, joint=(fmt == "e5m2"))
    c = st.case
    bad = 0x7C if fmt == "e5m2" else 0x7F
    host = np.array(xp_backend.to_numpy(st.latent))
    poisoned = [(0, 44), (1, 1), (2, 29)]  # a decode's last token, tokens inside two chunks
    for s, t in poisoned:
        page = c.page_table[s, t // 16]
        host[page, t % 16, 0, (37 * t) % R] = bad
        st.lat_ref[page, t % 16, 0, (37 * t) % R] = np.inf if fmt == "e5m2" else np.nan
    st.latent[...] = _to_device(xp_backend, host)
    seq = np.repeat(np.arange(3), c.q_lens)
    pos = np.concatenate([np.arange(k - n, k) for k, n in zip(c.kv_lens, c.q_lens)])
    sees = np.zeros(seq.size, bool)
    for s, t in poisoned:
        sees |= (seq == s) & (pos >= t)
    assert sees.any() and (~sees).any()
    ref_o, ref_lse = st.reference(True)
    for splits in (None, 3):
        o, lse = st.run(xp_backend, True, splits)
        what = f"{fmt} splits={splits}"
        assert np.isfinite(o[~sees].astype(np.float64)).all(), f"{what}: a masked Inf/NaN reached a row"
        assert_close(o[~sees], ref_o[~sees], dtype, f"{what} clean rows")
        assert_close(lse[~sees], ref_lse[~sees], dtype, f"{what} clean lse")
        assert not np.isfinite(ref_o[sees]).all()
        assert_close(o[sees], ref_o[sees], dtype, f"{what} rows that see a poisoned token")
    assert set(kernels_used) == {mla_kernel(mla_arch, fmt), "attention_split_merge"}


def test_fp8_with_score_features(xp_backend, mla_arch, kernels_used):
    """An fp8 latent cache with all four score features at once (soft cap,
    window, sinks, ALiBi: the gate's fp8 build), k_scale folded before the
    cap, the sink added once (splits), against reference.scored_attention."""
    st = Stored(xp_backend, np.random.default_rng(14), "e4m3", "bf16")
    c = st.case
    heads = c.q.shape[1]
    rng = np.random.default_rng(41)
    sinks = rng.uniform(-1, 2, heads).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, heads + 1) * 4).astype(np.float32)
    score = dict(soft_cap=3.0, window=20, sinks=sinks, alibi_slopes=slopes)
    dev = dict(score, sinks=_to_device(xp_backend, sinks), alibi_slopes=_to_device(xp_backend, slopes))
    q, k, v = reference.mla_as_attention(c.q, c.q_pos, st.lat_ref, st.kp_ref)
    for causal in (True, False):
        ref_o, ref_lse = reference.scored_attention(
            q, k, v, c.page_table, c.kv_lens, c.q_lens, c.scale, causal, **score
        )
        for splits in (None, 3):
            ws = None if splits is None else cupaged.SplitWorkspace(st.plan.queries, heads, R, splits, st.q)
            o, lse = st.plan.mla(
                st.q, st.q_pos, st.latent, st.k_pos, c.scale, causal, return_lse=True, workspace=ws, **st.kv_args, **dev
            )
            what = f"features causal={causal} splits={splits}"
            assert_close(xp_backend.to_numpy(o), ref_o, c.q.dtype, f"{what} out")
            assert_close(xp_backend.to_numpy(lse), ref_lse, c.q.dtype, f"{what} lse")
    assert set(kernels_used) == {mla_kernel(mla_arch, "e4m3"), "attention_split_merge"}


def test_fp8_tiles_copy_half_the_bytes(xp_backend, mla_arch, monkeypatch):
    """An fp8 latent cache is read once, at half the bytes: per token of
    context each block issues (R + P) * 1 / 16 = 36 16-byte cp.async copies
    of codes, against 72 for bf16 (counted by the CPU backend's cp.async;
    the difference between 512 and 256 tokens of one decode query)."""
    if xp_backend.name != "cpu":
        pytest.skip("counts come from the CPU backend")
    from cupaged.ops.attention import launch
    from cupaged.tools import counters

    modules = {}
    real = launch.get_kernel

    def spy(like, source, kernel, defines=None):
        k = real(like, source, kernel, defines)
        if kernel in (mla_arch, mla_kernel(mla_arch, "e4m3")):
            modules[kernel] = k.module
        return k

    monkeypatch.setattr(launch, "get_kernel", spy)
    rng = np.random.default_rng(9)
    bf16 = as_dtype("bf16")
    per_token = {}
    for fmt in (None, "e4m3"):
        copies = []
        for n in (256, 512):
            pages = n // 16
            lat = rng.standard_normal((pages, 16, 1, R + P)).astype(np.float32)
            c = reference.quantize_fp8(lat, fmt, 1.0).view(np.uint8) if fmt else lat.astype(bf16)
            args = dict(kv_dtype=fmt) if fmt else {}
            q = rng.standard_normal((1, 16, R)).astype(bf16)
            q_rot = rng.standard_normal((1, 16, P)).astype(bf16)
            plan = cupaged.HostPlan.build(np.arange(pages, dtype=np.int32)[None], [n], [1], 16, pages).upload(q)
            plan.mla(q, q_rot, c[..., :R], c[..., R:], 0.05, True, **args)  # compiles, loads the module
            kernel = mla_kernel(mla_arch, fmt)
            counters.reset(modules[kernel])
            plan.mla(q, q_rot, c[..., :R], c[..., R:], 0.05, True, **args)
            got = counters.read(modules[kernel])
            copies.append(got["cp_async_16"] + got["cp_async_16_zero"])
        per_token[fmt] = (copies[1] - copies[0]) / 256
    assert per_token == {None: (R + P) * 2 / 16, "e4m3": (R + P) / 16}, per_token


def test_selection():
    """The MLA builds serve an MLA call (V is the latent) with P = 64 or 0,
    strided views and fp8 latents, each registered for the gate; a plain
    attention call of the same dims (one KV head, D = Dv = 512, its own V
    cache) never goes to them."""
    from cupaged.ops.attention import variants

    registered = {tuple(sorted(v.defines().items())) for v in variants.VARIANTS}
    tc = variants.select_tensor_core
    for kv in ("bf16", "e4m3", "e5m2"):
        for p in (64, 0):
            wgmma = "paged_mla_wgmma" if kv != "bf16" else "paged_mla_seesaw"
            for arch, kernel in ((None, "paged_mla_tc"), ("sm_80", "paged_mla_tc"), ("sm_90", wgmma)):
                v = tc("bf16", R, R, True, True, p, kv_dtype=kv, arch=arch, latent=True, strided=True)
                assert (v.kernel, v.kv_dtype, v.latent_dim, v.rope_dim) == (kernel, kv, R, p)
                assert tuple(sorted(v.defines().items())) in registered
                budget = variants.KERNELS[v.kernel].static_smem_budget
                assert variants.resident_blocks(v) == 1 and v.smem + budget <= 227 * 1024
            assert tc("bf16", R, R, False, True, p, kv_dtype=kv, latent=True) is None  # misaligned
        assert tc("bf16", R, R, True, True, 0, kv_dtype=kv, arch="sm_90") is None  # not an MLA call
