"""Queries as views (docs/layout.md, "Query views"): every attention kernel
reads q (and MLA's q_rot) at the view's token and head strides, so a column
slice of a fused QKV projection, or the two column ranges of one [tokens,
H, R + P] MLA query, pass as they are (vLLM hands both; the engine's fused
projection makes the first).

Each case puts the queries in a wider buffer whose other elements are NaN
(a view that is not C-contiguous: the token stride, and in the padded-head
layout the head stride, differ from the packed ones), runs the public API
on the CPU backend and compares with the float64 reference at q's dtype
tolerance (``cupaged.testing.tolerance``). A kernel that ignored the strides
would read the NaN columns or other tokens' rows: its output would be NaN or
wrong. Each test names the kernel that served it (``launches`` of the
call's record), so every kernel's query load is covered: paged_attention
(decode and its rotary part), paged_decode_tc, paged_prefill_tc (sm_80),
paged_prefill_wgmma (sm_90), paged_prefill_simt, paged_mla_tc (sm_80),
paged_mla_seesaw and paged_mla_wgmma (sm_90).
"""

from __future__ import annotations

import numpy as np
import pytest
from storage_helpers import check_attention, check_mla, fp8_paged_case, only_kernels, stored_mla

from cupaged import PagedAttentionError
from cupaged._runtime import archs


@pytest.fixture(autouse=True)
def cpu_only(xp_backend):
    if xp_backend.name != "cpu":
        pytest.skip("NumPy cases (the GPU runs the kernels' own tests through tools/device_check.sh)")


def qkv_slice(q: np.ndarray, before: int = 1, after: int = 3) -> np.ndarray:
    """``q`` [n, H, D] as heads ``before .. before + H`` of a NaN [n, before
    + H + after, D] buffer: a fused projection's column slice (token stride
    (before + H + after) * D, head stride D)."""
    n, h, d = q.shape
    buf = np.full((n, before + h + after, d), np.nan, q.dtype)
    view = buf[:, before : before + h]
    view[...] = q
    assert not view.flags.c_contiguous
    return view


def padded_heads(q: np.ndarray, pad: int = 8) -> np.ndarray:
    """``q`` [n, H, D] as the first D columns of a NaN [n, H, D + pad]
    buffer: a head stride of D + pad (16-byte aligned for 16-bit types
    when pad is a multiple of 8)."""
    n, h, d = q.shape
    buf = np.full((n, h, d + pad), np.nan, q.dtype)
    view = buf[..., :d]
    view[...] = q
    return view


LAYOUTS = {"qkv_slice": qkv_slice, "padded_heads": padded_heads}

# (what, dtype, kernels selection may pick from, the case, the arch the CPU stands in for)
ATTENTION = [
    ("decode f32", "f32", {"paged_attention"}, dict(kv_lens=[37, 1, 70], q_lens=[1, 1, 1]), "sm_90"),
    ("decode tc", "f16", {"paged_decode_tc"}, dict(kv_lens=[37, 1, 70], q_lens=[1, 1, 1]), "sm_90"),
    ("chunk simt", "f32", {"paged_prefill_simt"}, dict(kv_lens=[40, 33], q_lens=[24, 9]), "sm_90"),
    ("chunk mma.sync", "f16", {"paged_prefill_tc"}, dict(kv_lens=[40, 33], q_lens=[24, 9]), "sm_80"),
    ("chunk wgmma", "bf16", {"paged_prefill_wgmma"}, dict(kv_lens=[70, 33], q_lens=[64, 9]), "sm_90"),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("what,dtype,kernels,lens,arch", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_attention_reads_q_at_its_strides(monkeypatch, layout, what, dtype, kernels, lens, arch):
    only_kernels(monkeypatch, kernels)
    rng = np.random.default_rng(23)
    sc = fp8_paged_case(rng, None, dtype=dtype, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, **lens)
    sc.case.q = LAYOUTS[layout](sc.case.q)
    with archs.cpu_arch_override(arch):
        assert set(check_attention(sc, what=f"{what} {layout}")) == kernels
        assert set(check_attention(sc, False, splits=3, what=f"{what} {layout} split3")) <= kernels | {
            "attention_split_merge"
        }


# (what, dtype, cache format, kernels, arch)
MLA = [
    ("mla f32", "f32", None, {"paged_attention"}, "sm_90"),
    ("mla mma.sync", "bf16", None, {"paged_mla_tc"}, "sm_80"),
    ("mla seesaw", "bf16", None, {"paged_mla_seesaw"}, "sm_90"),
    ("mla wgmma fp8", "bf16", "e4m3", {"paged_mla_wgmma"}, "sm_90"),
]


@pytest.mark.parametrize("what,dtype,fmt,kernels,arch", MLA, ids=[m[0] for m in MLA])
def test_mla_reads_q_and_q_rot_at_their_strides(monkeypatch, what, dtype, fmt, kernels, arch):
    """q and q_rot as the two column ranges of one NaN-padded [n, H, R + P +
    8] query buffer (vLLM's q_pe is the rotary tail of its query)."""
    only_kernels(monkeypatch, kernels)
    rng = np.random.default_rng(29)
    sm = stored_mla(
        rng, fmt, dtype=dtype, num_heads=16, latent_dim=512, pos_dim=64, kv_lens=[19, 70], q_lens=[1, 3], page_size=16
    )
    q, qr = sm.case.q, sm.case.q_pos
    n, h, r = q.shape
    buf = np.full((n, h, r + qr.shape[2] + 8), np.nan, q.dtype)
    buf[..., :r], buf[..., r : r + qr.shape[2]] = q, qr
    sm.case.q, sm.case.q_pos = buf[..., :r], buf[..., r : r + qr.shape[2]]
    with archs.cpu_arch_override(arch):
        assert set(check_mla(sm, what=what)) == kernels


def test_a_query_view_must_have_a_contiguous_last_dim():
    rng = np.random.default_rng(31)
    sc = fp8_paged_case(rng, None, dtype="f16", kv_lens=[9], q_lens=[1], num_q_heads=4, num_kv_heads=2, head_dim=64)
    q = sc.case.q
    sc.case.q = np.asfortranarray(q)  # the last dim strided
    with pytest.raises(PagedAttentionError, match=r"^q: expected a contiguous innermost dim"):
        check_attention(sc)
    buf = np.zeros((q.shape[0], 2, q.shape[2]), q.dtype)
    sc.case.q = np.lib.stride_tricks.as_strided(buf, q.shape, (q.strides[0], 2, q.itemsize))  # heads overlap
    with pytest.raises(PagedAttentionError, match=r"^q: expected rows that do not overlap"):
        check_attention(sc)


def test_a_query_view_spans_fewer_than_2_32_elements():
    """The kernels' query offsets are 32-bit: a view reaching 2^32 elements
    (a token stride of 2^31, three tokens) is refused before any launch."""
    rng = np.random.default_rng(37)
    sc = fp8_paged_case(
        rng, None, dtype="f16", kv_lens=[9, 9, 9], q_lens=[1, 1, 1], num_q_heads=4, num_kv_heads=2, head_dim=64
    )
    buf = np.zeros(256, np.float16)
    sc.case.q = np.lib.stride_tricks.as_strided(buf, (3, 4, 64), (2**31 * 2, 128, 2))  # never read
    with pytest.raises(PagedAttentionError, match=r"^q: expected a view spanning at most 4294967295 elements"):
        check_attention(sc)
