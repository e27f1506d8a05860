"""Property-based test: random, partly invalid plans and operands.

Each example either raises PagedAttentionError (and then it must be invalid
by an independent rule written here, and nothing is written) or is valid and
matches the float64 reference. Unused cache slots hold NaN.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cupaged import HostPlan, PagedAttentionError, SplitWorkspace
from cupaged.testing import assert_close, reference


@st.composite
def cases(draw):
    """A valid case, then (half the time) one corruption of it."""
    sequences = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    width = draw(st.integers(1, 3))
    num_pages = draw(st.integers(1, 8))
    cap = width * page_size
    kv = [draw(st.integers(0, cap)) for _ in range(sequences)]
    ql = [draw(st.integers(0, k)) for k in kv]
    table = [
        [
            draw(st.integers(0, num_pages - 1)) if j < -(-kv[s] // page_size) else draw(st.sampled_from([-1, 2**30, 0]))
            for j in range(width)
        ]
        for s in range(sequences)
    ]
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8]))
    dv = draw(st.sampled_from([d, 6]))
    c = dict(
        table=table,
        kv=kv,
        ql=ql,
        page_size=page_size,
        num_pages=num_pages,
        hq=hq,
        hkv=hkv,
        d=d,
        dv=dv,
        scale=draw(st.sampled_from([0.3, 1.0])),
        causal=draw(st.booleans()),
        splits=draw(st.sampled_from([None, 1, 2, 3])),
        seed=draw(st.integers(0, 2**16)),
    )
    s = draw(st.integers(0, sequences - 1))
    corruption = draw(
        st.sampled_from(
            [None] * 6
            + ["page_size", "kv_over", "kv_neg", "q_over", "q_neg", "page_neg", "page_over", "heads", "scale"]
        )
    )
    if corruption == "page_size":
        c["page_size"] = draw(st.sampled_from([0, 257]))
    elif corruption == "kv_over":
        c["kv"][s] = cap + draw(st.integers(1, 3))
    elif corruption == "kv_neg":
        c["kv"][s], c["ql"][s] = -1, 0
    elif corruption == "q_over":
        c["ql"][s] = c["kv"][s] + draw(st.integers(1, 2))
    elif corruption == "q_neg":
        c["ql"][s] = -1
    elif corruption in ("page_neg", "page_over") and c["kv"][s] > 0:
        j = draw(st.integers(0, -(-c["kv"][s] // page_size) - 1))
        c["table"][s][j] = -1 if corruption == "page_neg" else num_pages + draw(st.integers(0, 2))
    elif corruption == "heads":
        c["hq"] += 1 if hkv == 2 else 0
    elif corruption == "scale":
        c["scale"] = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf")]))
    return c


def _valid(c) -> bool:
    ps = c["page_size"]
    if not 1 <= ps <= 256:
        return False
    cap = len(c["table"][0]) * ps
    for s, (k, q) in enumerate(zip(c["kv"], c["ql"])):
        if not (0 <= k <= cap and q >= 0):
            return False
        if q > k and c["causal"]:  # more queries than keys (kv 0 included): non-causal only (docs/layout.md)
            return False
        for j in range(-(-k // ps)):
            if not 0 <= c["table"][s][j] < c["num_pages"]:
                return False
    return c["hq"] % c["hkv"] == 0 and math.isfinite(c["scale"]) and c["scale"] > 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_plans_raise_or_match_reference(c):
    rng = np.random.default_rng(c["seed"])
    ps_alloc = min(max(c["page_size"], 1), 16)
    k = rng.standard_normal((c["num_pages"], ps_alloc, c["hkv"], c["d"])).astype(np.float32)
    v = rng.standard_normal((c["num_pages"], ps_alloc, c["hkv"], c["dv"])).astype(np.float32)
    valid = _valid(c)
    if valid:  # poison every slot no sequence uses
        used = np.zeros((c["num_pages"], ps_alloc), bool)
        for s, n in enumerate(c["kv"]):
            for t in range(n):
                used[c["table"][s][t // c["page_size"]], t % c["page_size"]] = True
        k[~used] = np.nan
        v[~used] = np.nan
    queries = max(0, sum(max(q, 0) for q in c["ql"]))
    q = rng.standard_normal((queries, c["hq"], c["d"])).astype(np.float32)
    out = np.full((queries, c["hq"], c["dv"]), 7.0, np.float32)
    try:
        plan = HostPlan.build(c["table"], c["kv"], c["ql"], c["page_size"], c["num_pages"])
        dplan = plan.upload(q)
        ws = None if c["splits"] is None else SplitWorkspace(queries, c["hq"], c["dv"], c["splits"], q)
        got, lse = dplan.attention(q, k, v, c["scale"], c["causal"], workspace=ws, out=out, return_lse=True)
    except PagedAttentionError:
        assert not valid, f"a valid case was rejected: {c}"
        np.testing.assert_array_equal(out, 7.0)
        return
    assert valid, f"an invalid case was accepted: {c}"
    exp, exp_lse = reference.scored_attention(q, k, v, np.array(c["table"]), c["kv"], c["ql"], c["scale"], c["causal"])
    assert got is out
    assert_close(got, exp, np.float32)
    assert_close(lse, exp_lse, np.float32)


def test_property_rule_sees_both_outcomes():
    """Guard against a vacuous property: the rule classifies known cases."""
    base = dict(
        table=[[0, 1]],
        kv=[5],
        ql=[1],
        page_size=4,
        num_pages=2,
        hq=2,
        hkv=1,
        d=4,
        dv=4,
        scale=0.5,
        causal=True,
        splits=None,
        seed=0,
    )
    assert _valid(base)
    for change in (
        dict(ql=[6]),
        dict(kv=[0]),
        dict(kv=[9]),
        dict(table=[[0, 2]]),
        dict(hq=3, hkv=2),
        dict(scale=0.0),
        dict(page_size=0),
    ):
        assert not _valid({**base, **change}), change
    with pytest.raises(PagedAttentionError):
        HostPlan.build([[0, 2]], [5], [1], 4, 2)
