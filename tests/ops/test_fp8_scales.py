"""fp8 scales of 0, a negative number, NaN or Inf (issue #19 item 4): appends
would saturate every code (or write NaN) and attention would average
uniformly, so every host scale is refused before anything runs
(``checks.scale_values``): PagedKVCache's k_scale / v_scale (a number, per
layer, per layer and KV head), and the scale arrays of write_slots,
plan.append, attention, mla and the torch adapter. Device (CuPy) scales are
not read back (docs/layout.md, "Cache views and fp8 caches")."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import HostPlan, PagedAttentionError, PagedKVCache
from cupaged.ops import append as append_mod
from cupaged.ops.attention import launch

BAD = [0.0, -0.0, -1.0, -1e-30, float("nan"), float("inf"), float("-inf")]
E4M3 = ml_dtypes.float8_e4m3fn


def _msg(name, value, index=None):
    at = "" if index is None else rf"\[{index}\]"
    shown = {0.0: "0.0", -1.0: "-1.0", -1e-30: "-1e-30"}.get(value, repr(float(value)))
    if value == 0.0:
        shown = "-?0.0"
    return rf"{name}{at}: expected a finite float > 0 \(an fp8 scale\), got {shown}"


@pytest.fixture
def launched(monkeypatch):
    """Every kernel the attention and append launch layers fetch."""
    log = []
    for mod in (launch, append_mod):
        real = mod.get_kernel

        def spy(like, source, kernel, defines=None, _real=real):
            log.append(kernel)
            return _real(like, source, kernel, defines)

        monkeypatch.setattr(mod, "get_kernel", spy)
    return log


def _setup(rng):
    host = HostPlan.build([[0, 1], [2, -1]], [7, 3], [2, 1], 4, 4)
    plan = host.upload(np.zeros(1, np.float32))
    k8 = np.zeros((4, 4, 2, 16), E4M3)
    v8 = np.zeros((4, 4, 2, 16), E4M3)
    nk = rng.standard_normal((3, 2, 16)).astype(np.float16)
    q = rng.standard_normal((3, 4, 16)).astype(np.float16)
    return plan, k8, v8, nk, q


def _scales(bad, per_head):
    """(a bad scale array, the index the message names) per tensor or per head."""
    if per_head:
        return np.array([1.0, bad], np.float32), 1
    return np.array([bad], np.float32), 0


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_bad_scales_refused_by_every_op(launched, bad, per_head, which):
    rng = np.random.default_rng(1)
    plan, k8, v8, nk, q = _setup(rng)
    scale, idx = _scales(bad, per_head)
    good = np.ones(1, np.float32)
    kw = {"k_scale": good, "v_scale": good, which: scale}
    msg = _msg(which, bad, idx)
    out = np.full((3, 4, 16), 7, np.float16)
    calls = [
        lambda: plan.append(nk, nk, k8, v8, **kw),
        lambda: cupaged.write_slots(nk, nk, k8, v8, np.array([0, 1, 8]), **kw),
        lambda: plan.attention(q, k8, v8, 0.25, out=out, **kw),
    ]
    for call in calls:
        with pytest.raises(PagedAttentionError, match=msg):
            call()
    assert not k8.view(np.uint8).any() and not v8.view(np.uint8).any() and (out == 7).all()
    assert launched == []


@pytest.mark.parametrize("bad", BAD)
def test_bad_scales_refused_by_mla(launched, bad):
    rng = np.random.default_rng(2)
    plan, *_ = _setup(rng)
    lat = np.zeros((4, 4, 1, 64), E4M3)
    kp = np.zeros((4, 4, 1, 16), E4M3)
    q = rng.standard_normal((3, 4, 64)).astype(np.float16)
    qp = rng.standard_normal((3, 4, 16)).astype(np.float16)
    ok = np.ones(1, np.float32)
    for kw, name in (
        (dict(k_scale=np.float32([bad]), v_scale=ok), "k_scale"),
        (dict(k_scale=ok, v_scale=np.full((), bad, np.float32)), "v_scale"),
    ):
        with pytest.raises(PagedAttentionError, match=_msg(name, bad, 0 if kw[name].ndim else None)):
            plan.mla(q, qp, lat, kp, 0.1, **kw)
        with pytest.raises(PagedAttentionError, match=_msg(name, bad, 0 if kw[name].ndim else None)):
            plan.append(q[:, :1], qp[:, :1], lat, kp, **kw)
    with pytest.raises(PagedAttentionError, match=_msg("k_scale", bad, 0)):
        plan.mla(q, None, lat, None, 0.1, k_scale=np.float32([bad]))  # MLA without a rotary part
    assert launched == [] and not lat.view(np.uint8).any()


@pytest.mark.parametrize("bad", BAD)
def test_bad_scales_refused_by_the_page_manager(bad):
    """PagedKVCache: a number, per layer and per layer and KV head, as NumPy
    data or Python lists; the message names the offending entry."""
    for kw, name, idx in (
        (dict(k_scale=bad), "k_scale", "0"),
        (dict(v_scale=[1.0, bad]), "v_scale", "1"),
        (dict(k_scale=np.array([[1.0, 2.0], [bad, 1.0]])), "k_scale", "1, 0"),
        (dict(v_scale=np.array([[1.0, 2.0], [0.5, bad]], np.float32)), "v_scale", "1, 1"),
    ):
        with pytest.raises(PagedAttentionError, match=_msg(name, bad, idx)):
            PagedKVCache(8, 4, 2, 16, "e4m3", layers=2, **kw)


def test_scales_that_overflow_float32_are_refused():
    """A float64 scale past float32's range would be stored as Inf."""
    with pytest.raises(PagedAttentionError, match=r"k_scale\[0\]: expected a finite float > 0 .* got inf"):
        PagedKVCache(8, 4, 2, 16, "e5m2", k_scale=1e39)
    with pytest.raises(PagedAttentionError, match=r"v_scale\[1\]: .*got -3.0"):
        PagedKVCache(8, 4, 2, 16, "e5m2", layers=2, v_scale=np.array([1, -3]))  # integer data


def test_good_scales_still_work():
    """Tiny (subnormal), huge and ordinary positive scales pass and append /
    read back as before."""
    rng = np.random.default_rng(3)
    plan, k8, v8, nk, q = _setup(rng)
    for s in (1e-44, 3e38, 0.5):
        sc = np.array([s, 1.0], np.float32)
        plan.append(nk, nk, k8, v8, k_scale=sc, v_scale=sc[:1])
        plan.attention(q, k8, v8, 0.25, k_scale=sc, v_scale=sc[:1])
    cache = PagedKVCache(8, 4, 2, 16, "e4m3", layers=2, k_scale=[1e-30, 2.0], v_scale=np.float32(7))
    assert cache.v_scale.tolist() == [7.0, 7.0]


def test_torch_adapter_refuses_bad_scales():
    torch = pytest.importorskip("torch")
    from cupaged.interop import torch as ct

    rng = np.random.default_rng(4)
    host = HostPlan.build([[0, 1], [2, -1]], [7, 3], [2, 1], 4, 4)
    tp = ct.torch_plan(host, torch.zeros(1))
    k8 = torch.zeros((4, 4, 2, 16), dtype=torch.float8_e4m3fn)
    v8 = torch.zeros((4, 4, 2, 16), dtype=torch.float8_e4m3fn)
    nk = torch.from_numpy(rng.standard_normal((3, 2, 16)).astype(np.float16))
    q = torch.from_numpy(rng.standard_normal((3, 4, 16)).astype(np.float16))
    one = torch.ones(1)
    for bad in (0.0, float("nan"), -2.0):
        scale = torch.tensor([1.0, bad])
        with pytest.raises(PagedAttentionError, match=_msg("v_scale", bad, 1)):
            tp.append(nk, nk, k8, v8, k_scale=one, v_scale=scale)
        with pytest.raises(PagedAttentionError, match=_msg("k_scale", bad, 1)):
            tp.attention(q, k8, v8, 0.25, k_scale=scale, v_scale=one)
    assert not k8.view(torch.uint8).any() and not v8.view(torch.uint8).any()
