"""The variant hook end to end: a toy score variant (``test_bias``, defined
in kernels_cu/attention/variant.cuh) added by one row of ``options.SCORES``
here, and a score with runtime data (``head_bias``: a per-head bias array,
one hook, one option row added here, one params field), compiled on the CPU
backend for every attention kernel and checked against a float64 reference
with the same score. Also keeps the worked example of docs/layout.md
("Adding a score variant") true."""

from __future__ import annotations

import re
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from attention_helpers import TC_PREFILL

import cupaged
from cupaged import PagedAttentionError
from cupaged._runtime import address, cpu_arch_override
from cupaged._runtime.source import kernel_dir
from cupaged.ops.attention import AttentionOptions, launch, options, params, variants
from cupaged.testing import assert_close, make_mla_case, make_paged_case, reference

REPO = Path(__file__).resolve().parents[2]

#: The toy's table row: the whole Python side of adding a score variant.
TEST_BIAS = variants.Score("test_bias", built=False, doc="scale * q.k + 0.5 + 0.125 * head - 0.03125 * (q_pos - k_pos)")


def bias(head, q_pos, k_pos):
    """What score_test_bias adds to scale * q.k (natural units)."""
    return 0.5 + 0.125 * head - 0.03125 * (q_pos - k_pos)


@pytest.fixture
def toy_score(monkeypatch):
    """SCORES with the toy's row; the launches' (kernel, CP_SCORE) are logged."""
    monkeypatch.setitem(variants.SCORES, TEST_BIAS.name, TEST_BIAS)
    return _launch_log(monkeypatch)


def _launch_log(monkeypatch):
    """The (kernel, CP_SCORE) of every launch from now on, in a list."""
    used = []
    real = launch.get_kernel

    def spy(like, source, kernel, defines=None):
        used.append((kernel, (defines or {}).get("CP_SCORE")))
        return real(like, source, kernel, defines)

    monkeypatch.setattr(launch, "get_kernel", spy)
    return used


def biased_reference(q, k_cache, v_cache, page_table, kv_lens, q_lens, scale, causal):
    """Float64 attention with score = scale * q.k + bias(head, q_pos, k_pos):
    out [queries, Hq, Dv], lse [queries, Hq] (natural log)."""
    q64 = np.asarray(q).astype(np.float64)
    q_seq, q_pos = reference.query_positions(kv_lens, q_lens)
    seen = reference.visible_lengths(kv_lens, q_lens, causal)
    hq, hkv = q64.shape[1], k_cache.shape[2]
    kv_head = np.arange(hq) // (hq // hkv)
    out = np.zeros(q64.shape[:2] + (v_cache.shape[3],))
    lse = np.full(q64.shape[:2], -np.inf)
    for i in range(len(q_seq)):
        n = int(seen[i])
        if n == 0:
            continue
        keys = reference.gather_kv(k_cache, page_table, q_seq[i], n)[:, kv_head]  # [n, Hq, D]
        values = reference.gather_kv(v_cache, page_table, q_seq[i], n)[:, kv_head]  # [n, Hq, Dv]
        s = scale * np.einsum("hd,nhd->hn", q64[i], keys) + bias(np.arange(hq)[:, None], q_pos[i], np.arange(n))
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[i] = np.einsum("hn,nhd->hd", p, values) / p.sum(axis=1)[:, None]
        lse[i] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse


def run(case, q, k, v, causal, score, splits=None, q_rot=None, k_rot=None):
    """launch_attention with AttentionOptions(score=...) on the CPU backend;
    returns (out, lse)."""
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(q)
    hq, dv = q.shape[1], v.shape[3]
    out = np.zeros((plan.queries, hq, dv), q.dtype)
    lse = np.zeros((plan.queries, hq), np.float32)
    ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, hq, dv, splits, q)
    opts = AttentionOptions.checked(case.scale, causal, score)
    launch.launch_attention(plan.stream, plan, q, k, v, out, opts, q_rot=q_rot, k_rot=k_rot, lse=lse, workspace=ws)
    return out, lse


@pytest.mark.parametrize(
    "what, dtype, d, kernel",
    [
        ("decode", "f32", 64, "paged_attention"),  # HEAD_DIM fast path, GQA 4
        ("decode", "bf16", 96, "paged_attention"),  # runtime dims (DIM_CAP)
        ("decode", "bf16", 128, "paged_decode_tc"),  # tensor-core decode
        ("decode", "f16", 64, "paged_decode_tc"),
        ("prefill", "f16", 64, TC_PREFILL),  # tensor cores
        ("mixed", "f16", 64, None),  # segments: both kernels in one step
    ],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [None, 3])
def test_toy_score_variant(toy_score, what, dtype, d, kernel, causal, splits):
    rng = np.random.default_rng(zlib.crc32(f"{what}/{dtype}/{d}".encode()))
    # mixed: six decodes, a chunk of 40, six decodes, a chunk of 33 (D T D T at G = 4).
    q_lens = {"decode": [1, 1, 1], "prefill": [40, 20, 33], "mixed": [1] * 6 + [40] + [1] * 6 + [33]}[what]
    kv_lens = {
        "decode": [70, 33, 90],
        "prefill": [70, 33, 90],
        "mixed": [20, 3, 35, 9, 17, 5, 50, 7, 30, 2, 18, 40, 6, 45],
    }[what]
    case = make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    o, lse = run(case, case.q, case.k_cache, case.v_cache, causal, "test_bias", splits)
    ref_o, ref_lse = biased_reference(
        case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, causal
    )
    assert_close(o, ref_o, dtype, f"{what} out")
    assert_close(lse, ref_lse, dtype, f"{what} lse")
    attention_kernels = {k for k, _ in toy_score if k != "attention_split_merge"}
    assert attention_kernels == ({kernel} if kernel else {"paged_decode_tc", TC_PREFILL})
    assert {s for k, s in toy_score if k != "attention_split_merge"} == {"test_bias"}
    assert all(s is None for k, s in toy_score if k == "attention_split_merge")  # the merge has no score
    # The plain variant of the same step is the unbiased reference.
    plain_o, _ = run(case, case.q, case.k_cache, case.v_cache, causal, "plain", splits)
    assert_close(plain_o, case.reference(causal)[0], dtype, f"{what} plain")


@pytest.mark.parametrize(
    "dtype, r, p, heads, kernel, arch",
    [
        ("f32", 64, 16, 4, "paged_attention", "sm_90"),  # the CUDA-core kernel's rotary part (ROT_CAP)
        ("bf16", 512, 64, 16, "paged_mla_tc", "sm_80"),  # mma.sync
        ("bf16", 512, 64, 16, "paged_mla_seesaw", "sm_90"),  # wgmma (sm_90a), emulated on the CPU
    ],
)
def test_toy_score_variant_mla(toy_score, dtype, r, p, heads, kernel, arch):
    rng = np.random.default_rng(r + p)
    case = make_mla_case(
        rng, kv_lens=[40, 70], q_lens=[1, 20], page_size=16, num_heads=heads, latent_dim=r, pos_dim=p, dtype=dtype
    )
    with cpu_arch_override(arch):
        o, lse = run(
            case, case.q, case.latent, case.latent, True, "test_bias", None, q_rot=case.q_pos, k_rot=case.k_pos
        )
    q_all, keys, values = reference.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos)
    ref_o, ref_lse = biased_reference(q_all, keys, values, case.page_table, case.kv_lens, case.q_lens, case.scale, True)
    assert_close(o, ref_o, dtype, "mla out")
    assert_close(lse, ref_lse, dtype, "mla lse")
    assert {k for k, _ in toy_score} == {kernel}


def test_score_names_are_checked():
    with pytest.raises(PagedAttentionError, match=r"score: expected one of 'plain', got 'test_bias'"):
        AttentionOptions.checked(1.0, True, "test_bias")  # not in SCORES without its row
    with pytest.raises(PagedAttentionError, match=r"score: expected one of 'plain', got 3"):
        AttentionOptions.checked(1.0, True, 3)


def test_toy_is_not_built_for_gpus(toy_score):
    """Only built scores are registered for the NVRTC gate: the toy's row
    (built=False) adds nothing to the gate, and every registered variant is plain."""
    assert {v.score for v in variants.VARIANTS} == {"plain"}
    sel = variants.select_variant("f16", 128, 128, True, 4, score="test_bias")
    assert sel.defines()["CP_SCORE"] == "test_bias" and sel not in variants.VARIANTS


# ----------------------------------------------------------------- the worked example stays true


def _section(title: str) -> str:
    text = (REPO / "docs" / "layout.md").read_text()
    start = text.index(f"## {title}")
    nxt = text.find("\n## ", start + 1)
    return text[start:] if nxt < 0 else text[start:nxt]


def test_worked_example_in_docs():
    """docs/layout.md "Adding a score variant": the files it cites exist, its
    hook is variant.cuh's code word for word, its table row is the one this
    test adds, and each kernel calls each hook at one site."""
    doc = _section("Adding a score variant")
    for path in set(re.findall(r"`((?:kernels_cu|cupaged|tests)/[\w/.]+)`", doc)):
        assert (REPO / path).exists(), f"docs/layout.md cites {path}, which does not exist"
    hook = textwrap.dedent(re.search(r"```cpp\n(.*?)```", doc, re.S).group(1)).strip()
    assert hook in (kernel_dir() / "attention" / "variant.cuh").read_text(), "the doc's hook is not variant.cuh's"
    row = textwrap.dedent(re.search(r"```python\n(.*?)```", doc, re.S).group(1)).strip().rstrip(",")
    assert eval("{" + row + "}", {"Score": variants.Score}) == {TEST_BIAS.name: TEST_BIAS}, (
        "the doc's table row is not the one this test adds"
    )
    assert "SCORES: dict[str, Score] = {" in (REPO / "cupaged/ops/attention/options.py").read_text()
    # The runtime-data example: its hook is variant.cuh's, its option row the one HEAD_BIAS_ROW adds, its
    # params field the one params.py has.
    hooks = [textwrap.dedent(h).strip() for h in re.findall(r"```cpp\n(.*?)```", doc, re.S)]
    rows = [textwrap.dedent(r).strip() for r in re.findall(r"```python\n(.*?)```", doc, re.S)]
    assert len(hooks) == 3 and len(rows) == 3
    assert hooks[1] in (kernel_dir() / "attention" / "variant.cuh").read_text()
    assert hooks[2] in (kernel_dir() / "attention" / "params.cuh").read_text()
    assert rows[1] == HEAD_BIAS_SOURCE
    assert rows[2] in (REPO / "cupaged/ops/attention/params.py").read_text()
    # One call site of each hook per kernel (visible: through span.cuh's share, by att::query_span or, from
    # the words att::query_words loaded, att::share).
    att = kernel_dir() / "attention"
    for name in ("decode.cu", "decode_tc.cu", "prefill_tc.cu", "mla_tc.cu", "mla_wgmma.cu", "mla_seesaw.cu"):
        text = (att / name).read_text()
        assert text.count("variant::score(") == 1, name
        assert text.count("softmax::State") >= 1, name
    assert (att / "span.cuh").read_text().count("variant::visible(") == 1
    sites = ("query_span(p", "share(p, qw")
    files = ("decode.cu", "decode_tc.cu", "tc_common.cuh")
    assert sum((att / n).read_text().count(c) for n in files for c in sites) == 3


# ----------------------------------------------------------------- a score with runtime data

#: The runtime-data toy's option row (docs/layout.md quotes it): the whole Python side of a score whose
#: values come at run time (score_head_bias in variant.cuh reads them from AttentionParams.head_bias).
HEAD_BIAS_SOURCE = textwrap.dedent("""\
    Option("head_bias", "float32 [Hq]: logit += bias[h]", per_head, ("head_bias",), lambda a: (address(a),),
           score="head_bias", array=True, reference="head_bias"),""").strip()
HEAD_BIAS = eval(
    HEAD_BIAS_SOURCE.rstrip(","), {"Option": options.Option, "per_head": options.per_head, "address": address}
)


def head_bias_hook(x, bias, head, q_pos, k_pos):
    """The float64 reference's hook: logit += bias[h]."""
    return x + np.asarray(bias, np.float64)[head][:, None]


@pytest.fixture
def head_bias_row(monkeypatch):
    """The option row and its reference hook (first: the score comes before the cap and ALiBi); the
    launches' (kernel, CP_SCORE) are logged."""
    monkeypatch.setitem(options.ROWS, HEAD_BIAS.name, HEAD_BIAS)
    monkeypatch.setattr(reference, "LOGIT_HOOKS", {"head_bias": head_bias_hook, **reference.LOGIT_HOOKS})
    return _launch_log(monkeypatch)


@pytest.mark.parametrize(
    "what, dtype, d, kernel",
    [
        ("decode", "f32", 64, "paged_attention"),
        ("decode", "bf16", 96, "paged_attention"),
        ("decode", "bf16", 128, "paged_decode_tc"),
        ("decode", "f16", 64, "paged_decode_tc"),
        ("prefill", "f16", 64, TC_PREFILL),
        ("mixed", "f16", 64, None),
    ],
)
@pytest.mark.parametrize(
    "causal, splits, extra", [(True, None, {}), (False, 3, {}), (True, 2, dict(soft_cap=0.7, alibi_slopes=True))]
)
def test_head_bias_score(head_bias_row, what, dtype, d, kernel, causal, splits, extra):
    rng = np.random.default_rng(zlib.crc32(f"bias/{what}/{dtype}/{d}".encode()))
    q_lens = {"decode": [1, 1, 1], "prefill": [40, 20, 33], "mixed": [1] * 6 + [40] + [1] * 6 + [33]}[what]
    kv_lens = {
        "decode": [70, 33, 90],
        "prefill": [70, 33, 90],
        "mixed": [20, 3, 35, 9, 17, 5, 50, 7, 30, 2, 18, 40, 6, 45],
    }[what]
    case = make_paged_case(
        rng,
        kv_lens=np.array(kv_lens, np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
    )
    bias = rng.uniform(-2.0, 2.0, 8).astype(np.float32)
    if extra.get("alibi_slopes"):
        extra = dict(extra, alibi_slopes=rng.uniform(0.0, 0.2, 8).astype(np.float32))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 8, d, splits, case.q)
    o, lse = plan.attention(
        case.q, case.k_cache, case.v_cache, case.scale, causal, workspace=ws, return_lse=True, head_bias=bias, **extra
    )
    ref_o, ref_lse = reference.scored_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        case.kv_lens,
        case.q_lens,
        case.scale,
        causal,
        head_bias=bias,
        **extra,
    )
    assert_close(o, ref_o, dtype, f"{what} out")
    assert_close(lse, ref_lse, dtype, f"{what} lse")
    attention_kernels = {k for k, _ in head_bias_row if k != "attention_split_merge"}
    assert attention_kernels == ({kernel} if kernel else {"paged_decode_tc", TC_PREFILL})
    assert {s for k, s in head_bias_row if k != "attention_split_merge"} == {"head_bias"}
    # Without the bias the same plan runs plain: the unbiased reference.
    assert_close(
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, causal, workspace=ws),
        case.reference(causal)[0],
        dtype,
        f"{what} plain",
    )


@pytest.mark.parametrize(
    "dtype, r, p, heads, kernel, arch",
    [
        ("f32", 64, 16, 4, "paged_attention", "sm_90"),
        ("bf16", 512, 64, 16, "paged_mla_tc", "sm_80"),
        ("bf16", 512, 64, 16, "paged_mla_seesaw", "sm_90"),
    ],
)
def test_head_bias_score_mla(head_bias_row, dtype, r, p, heads, kernel, arch):
    rng = np.random.default_rng(r + p + 1)
    case = make_mla_case(
        rng, kv_lens=[40, 70], q_lens=[1, 20], page_size=16, num_heads=heads, latent_dim=r, pos_dim=p, dtype=dtype
    )
    bias = rng.uniform(-2.0, 2.0, heads).astype(np.float32)
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    with cpu_arch_override(arch):
        o, lse = plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, return_lse=True, head_bias=bias)
    q_all, keys, values = reference.mla_as_attention(case.q, case.q_pos, case.latent, case.k_pos)
    ref_o, ref_lse = reference.scored_attention(
        q_all, keys, values, case.page_table, case.kv_lens, case.q_lens, case.scale, True, head_bias=bias
    )
    assert_close(o, ref_o, dtype, "mla out")
    assert_close(lse, ref_lse, dtype, "mla lse")
    assert {k for k, _ in head_bias_row} == {kernel}


def test_head_bias_is_one_row_hook_and_field(head_bias_row):
    """The option fills its one params field (0 when not given), selects its score and is checked like
    every per-head array, before anything runs."""
    rng = np.random.default_rng(5)
    case = make_paged_case(
        rng, kv_lens=np.array([9, 4], np.int32), page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="f32"
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 8, case.num_pages).upload(case.q)
    bias = np.ones(4, np.float32)
    opts = AttentionOptions.checked(1.0, True, plan=plan, heads=4, head_bias=bias)
    assert opts.params()["head_bias"] == bias.ctypes.data and opts.kernel_score == "head_bias"
    assert AttentionOptions.checked(1.0).params()["head_bias"] == 0 and "head_bias" in params.NAMES
    out = np.full((plan.queries, 4, 64), 7.0, np.float32)
    for bad, msg in (
        (np.ones(3, np.float32), r"head_bias: expected shape \[4\]"),
        (np.ones(4, np.float64), r"head_bias: expected float32 \[4\]"),
        ([1.0] * 4, r"head_bias: expected a NumPy or CuPy float32 array"),
    ):
        with pytest.raises(PagedAttentionError, match=msg):
            plan.attention(case.q, case.k_cache, case.v_cache, case.scale, out=out, head_bias=bad)
    assert head_bias_row == [] and (out == 7).all()


def test_unknown_option_is_named():
    """Without its row an option is an unknown keyword, named (a cupaged error, nothing runs)."""
    rng = np.random.default_rng(6)
    case = make_paged_case(
        rng, kv_lens=np.array([9], np.int32), page_size=8, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="f32"
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 8, case.num_pages).upload(case.q)
    with pytest.raises(PagedAttentionError, match=r"head_bias: expected an option among score, soft_cap, window"):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, head_bias=np.ones(2, np.float32))
