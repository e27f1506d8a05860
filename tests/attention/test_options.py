"""The options of an attention call written once (``options.ROWS``): the
features, docstrings, torch adapter and reference follow the rows; the old
spellings (MLA's ``q_pos`` / ``k_pos`` keywords, ``ops.attention.checks``)
work for one release with a DeprecationWarning; a page manager's layer view
(``cache.layer(i)``) stands for K, V and their storage options."""

from __future__ import annotations

import inspect
import re
import warnings

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError
from cupaged.interop import torch as tinterop
from cupaged.ops import attention
from cupaged.ops.attention import inputs, options, variants
from cupaged.testing import assert_close, make_mla_case, make_paged_case, reference


def _plan(case):
    return cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(
        case.q
    )


def test_features_come_from_the_rows():
    assert variants.FEATURES == options.FEATURES == ("soft_cap", "window", "sinks", "alibi")
    assert variants.SCORES is options.SCORES and variants.Score is options.Score
    assert cupaged.AttentionOptions is options.AttentionOptions is attention.AttentionOptions
    opts = cupaged.AttentionOptions(0.5, True, soft_cap=2.0, window=4)
    assert opts.features == ("soft_cap", "window") and opts.sinks is None and opts.score == "plain"


@pytest.mark.parametrize(
    "fn", [cupaged.DevicePlan.attention, cupaged.DevicePlan.mla, tinterop.TorchPlan.attention, tinterop.TorchPlan.mla]
)
def test_docstrings_list_every_row(fn):
    doc = " ".join(fn.__doc__.split())
    for row in options.ROWS.values():
        assert f"``{row.name}``: {' '.join(row.doc.split())}" in doc, (fn.__qualname__, row.name)
    assert "{options}" not in fn.__doc__
    # The options are keywords of one ** parameter: their names are written in the rows only.
    params = inspect.signature(fn).parameters
    assert not set(params) & set(options.ROWS)
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_every_logit_row_has_a_reference_hook():
    refs = {r.reference for r in options.ROWS.values() if r.reference}
    assert refs == set(reference.LOGIT_HOOKS)


def test_unknown_and_doubled_options_are_cupaged_errors():
    with pytest.raises(PagedAttentionError, match=r"bias: expected an option among score, soft_cap"):
        cupaged.AttentionOptions.checked(1.0, True, bias=1.0)
    with pytest.raises(PagedAttentionError, match=r"sinks: AttentionOptions.checked needs plan= and heads="):
        cupaged.AttentionOptions.checked(1.0, True, sinks=np.zeros(2, np.float32))
    with pytest.raises(PagedAttentionError, match=r"score: given twice"):
        cupaged.AttentionOptions(1.0, True, "plain", score="plain")


def test_params_of_the_rows():
    """Each row fills its params fields (0 when not given), as the launch had them."""
    sinks = np.zeros(4, np.float32)
    p = cupaged.AttentionOptions(1.0, True, soft_cap=2.0, window=5, sinks=sinks).params()
    assert p["soft_cap"] == 2.0 * options.LOG2E and p["inv_soft_cap"] == 1.0 / (2.0 * options.LOG2E)
    assert p["window"] == 5 and p["sinks"] == sinks.ctypes.data and p["alibi_slopes"] == 0
    assert cupaged.AttentionOptions(1.0).params() == dict(soft_cap=0, inv_soft_cap=0, window=0, sinks=0, alibi_slopes=0)


def test_checks_module_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="ops.attention.checks is now cupaged.ops.attention.inputs"):
        mod = attention.checks
    assert mod is inputs


@pytest.fixture
def mla_case():
    rng = np.random.default_rng(11)
    return make_mla_case(
        rng, kv_lens=[20, 9], q_lens=[1, 3], page_size=16, num_heads=4, latent_dim=64, pos_dim=16, dtype="f32"
    )


def test_mla_rotary_keywords(mla_case):
    """q_rot / k_rot by keyword or position; q_pos / k_pos keywords still
    work for one release, with a DeprecationWarning; both spellings: an error."""
    c = mla_case
    plan = _plan(c)
    ref, _ = reference.paged_mla(c.q, c.q_pos, c.latent, c.k_pos, c.page_table, c.kv_lens, c.q_lens, c.scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(plan.mla(c.q, c.q_pos, c.latent, c.k_pos, c.scale), ref, "f32", "positional")
        assert_close(plan.mla(c.q, q_rot=c.q_pos, latent=c.latent, k_rot=c.k_pos, scale=c.scale), ref, "f32", "kw")
    with pytest.warns(DeprecationWarning, match=r"q_pos= is deprecated, pass q_rot="):
        with pytest.warns(DeprecationWarning, match=r"k_pos= is deprecated, pass k_rot="):
            out = plan.mla(c.q, q_pos=c.q_pos, latent=c.latent, k_pos=c.k_pos, scale=c.scale)
    assert_close(out, ref, "f32", "deprecated keywords")
    with pytest.raises(PagedAttentionError, match=r"q_pos: given together with q_rot"):
        plan.mla(c.q, c.q_pos, c.latent, c.k_pos, c.scale, q_pos=c.q_pos)


def test_torch_mla_rotary_keywords(mla_case):
    torch = pytest.importorskip("torch")
    c = mla_case
    plan = tinterop.torch_plan(
        cupaged.HostPlan.build(c.page_table, c.kv_lens, c.q_lens, 16, c.num_pages), torch.zeros(1)
    )
    t = {
        k: torch.from_numpy(np.ascontiguousarray(v))
        for k, v in dict(q=c.q, q_rot=c.q_pos, latent=c.latent, k_rot=c.k_pos).items()
    }
    ref, _ = reference.paged_mla(c.q, c.q_pos, c.latent, c.k_pos, c.page_table, c.kv_lens, c.q_lens, c.scale)
    assert_close(plan.mla(t["q"], t["q_rot"], t["latent"], t["k_rot"], c.scale).numpy(), ref, "f32", "torch")
    with pytest.warns(DeprecationWarning) as caught:
        out = plan.mla(t["q"], q_pos=t["q_rot"], latent=t["latent"], k_pos=t["k_rot"], scale=c.scale)
    said = " ".join(str(w.message) for w in caught)
    assert "q_pos= is deprecated" in said and "k_pos= is deprecated" in said, said
    assert_close(out.numpy(), ref, "f32", "torch deprecated keywords")


# ----------------------------------------------------------------- layer views


def _cache_step(dtype="float32", layers=2, **kw):
    cache = cupaged.PagedKVCache(16, 4, 2, 8, dtype, layers=layers, **kw)
    seq = cache.add_sequence()
    plan, _ = cache.prepare([seq], [5])
    return cache, plan


def test_layer_view_serves_attention_and_append():
    cache, plan = _cache_step()
    rng = np.random.default_rng(2)
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    nk, nv = (rng.standard_normal((5, 2, 8)).astype(np.float32) for _ in range(2))
    plan.append(nk, nv, cache.layer(1))
    np.testing.assert_array_equal(cache.k[0][plan.host.write_slots()], 0)  # layer 0 untouched
    layer = cache.layer(1)
    assert layer.k.base is cache.k and layer.kv_dtype is None and layer.k_scale is None
    a = plan.attention(q, cache.layer(1), scale=0.3)
    b = plan.attention(q, cache.k[1], cache.v[1], 0.3)
    np.testing.assert_array_equal(a, b)
    ref, _ = reference.paged_attention(
        q, cache.k[1], cache.v[1], plan.host.page_table, plan.host.kv_lens, plan.host.q_lens, 0.3
    )
    assert_close(a, ref, "f32", "layer view")


def test_layer_view_of_an_fp8_cache_carries_its_scales():
    pytest.importorskip("ml_dtypes")
    cache, plan = _cache_step("e4m3", k_scale=np.float32(0.5), v_scale=np.float32(0.25))
    rng = np.random.default_rng(3)
    q = rng.standard_normal((5, 4, 8)).astype(np.float16)
    nk, nv = (rng.standard_normal((5, 2, 8)).astype(np.float16) for _ in range(2))
    plan.append(nk, nv, cache.layer(0))
    a = plan.attention(q, cache.layer(0), scale=0.3)
    b = plan.attention(q, cache.k[0], cache.v[0], 0.3, **cache.kv_args(0))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(PagedAttentionError, match=r"k_scale: expected nothing with a layer view"):
        plan.attention(q, cache.layer(0), scale=0.3, k_scale=np.float32(1.0))


def test_layer_view_errors_name_it():
    cache, plan = _cache_step()
    q = np.zeros((5, 4, 8), np.float32)
    with pytest.raises(
        PagedAttentionError,
        match=r"k_cache: expected a 4-D array .*pass one layer: "
        r"cache.layer\(i\), or cache.k\[i\]",
    ):
        plan.attention(q, cache.k, cache.v, 0.3)
    with pytest.raises(
        PagedAttentionError,
        match=r"v_cache: expected nothing with a layer view .*pass scale= by "
        r"keyword",
    ):
        plan.attention(q, cache.layer(0), 0.3)
    with pytest.raises(PagedAttentionError, match=r"layer: expected"):
        cache.layer(2)
    for v in (None,):  # a plain K cache without its V: named, not an AttributeError
        with pytest.raises(PagedAttentionError, match=r"v_cache: expected the V cache .*cache.layer\(i\)"):
            plan.attention(q, cache.k[0], v, 0.3)
    with pytest.raises(PagedAttentionError, match=r"v_cache: expected the V cache"):
        plan.attention(q, cache.k[0], scale=0.3)


def test_errors_are_cupaged_errors():
    """What raised NotImplementedError / ValueError on the way to the launch is a PagedAttentionError."""
    rng = np.random.default_rng(1)
    case = make_paged_case(rng, sequences=1, max_kv_len=8, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="f32")
    plan = _plan(case)
    out = np.empty((plan.queries, 2, 64), np.float32)
    with pytest.raises(PagedAttentionError, match=r"q_rot, k_rot: expected both or neither"):
        attention.launch_attention(
            plan.stream,
            plan,
            case.q,
            case.k_cache,
            case.k_cache,
            out,
            cupaged.AttentionOptions(1.0),
            q_rot=np.zeros((plan.queries, 2, 8), np.float32),
        )
    with pytest.raises(PagedAttentionError, match=r"scale: expected a finite float > 0, got NoneType"):
        plan.attention(case.q, case.k_cache, case.v_cache)
    with pytest.raises(PagedAttentionError, match=r"latent: expected a NumPy or CuPy array"):
        plan.mla(case.q, None)
    assert re.search(r"raise (NotImplementedError|ValueError)\(", inspect.getsource(inputs)) is None
    assert re.search(r"raise (NotImplementedError|ValueError)\(", inspect.getsource(options)) is None
