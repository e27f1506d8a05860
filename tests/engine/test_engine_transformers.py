"""cupaged.Engine against transformers (CPU backend, float32): for every
supported architecture a randomly initialised small model, whose greedy
``generate`` and the engine's give the same tokens, and whose logits agree
at every step. Two cases run sliding windows shorter than the prompts
(Mistral's on every layer; Qwen2's on the layers past max_window_layers).

Each case runs six prompts (lengths 1, 7, 40, 3, 18, 25) with max_batch 2 or
4 (so waiting prompts replace finished ones: continuous batching) and a
prefill chunk of 16 (the 40-token prompt takes three chunks; with
prefill_per_round 16 each chunk is followed by a decode round of the running
sequences). Logits: ``max |engine - transformers| <= LOGIT_RTOL *
max(1, max |logit|)`` at every generated step of one prompt (float32 on
both sides; the differences are summation order, about 1e-5 here).

Skipped with the reason when torch or transformers is missing (they are the
test extra's transformers and a CPU torch build, see .ci/run).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers comparisons need torch (a CPU build is enough)")
transformers = pytest.importorskip("transformers", reason="the transformers comparisons need transformers")

import cupaged  # noqa: E402
from cupaged.engine.mla import fold_choice  # noqa: E402

LIKE = np.zeros(1, np.float32)
NEW = 8
LOGIT_RTOL = 1e-4
PROMPT_LENS = (1, 7, 40, 3, 18, 25)

_COMMON = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_MOE_OFF = dict(first_k_dense_replace=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)

# (id, config class, config kwargs, engine options)
CASES = [
    (
        "llama-gqa2-llama3-tied",
        "LlamaConfig",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        dict(max_batch=2, page_size=16, prefill_per_round=16),
    ),
    (
        "llama-mha-bias-linear",
        "LlamaConfig",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
        dict(max_batch=4, page_size=8),
    ),
    (
        "mistral-gqa4-d64",
        "MistralConfig",
        dict(
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        dict(max_batch=2, page_size=16),
    ),
    # Sliding windows shorter than most prompts (each layer's window, as transformers applies it).
    (
        "mistral-window8",
        "MistralConfig",
        dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=8),
        dict(max_batch=2, page_size=4),
    ),
    (
        "qwen2-window12-layer1",
        "Qwen2Config",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
        ),
        dict(max_batch=4, page_size=16, prefill_per_round=16),
    ),
    (
        "qwen2-mha-bias-yarn",
        "Qwen2Config",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        dict(max_batch=4, page_size=16),
    ),
    (
        "qwen3-gqa4-d128-qknorm",
        "Qwen3Config",
        dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        dict(max_batch=2, page_size=16, prefill_per_round=16),
    ),
    (
        "deepseek_v3-qlora-yarn-R64-P16",
        "DeepseekV3Config",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            kv_lora_rank=64,
            q_lora_rank=48,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            attention_bias=True,  # q_a_proj's and kv_a_proj's biases in h's one product
            **_MOE_OFF,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 32,
            },
        ),
        dict(max_batch=2, page_size=16, prefill_per_round=16),
    ),
    (
        "deepseek_v3-R512-P64-halves",
        "DeepseekV3Config",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            kv_lora_rank=512,
            q_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_interleave=False,
            **_MOE_OFF,
        ),
        dict(max_batch=4, page_size=16),
    ),
    (
        "deepseek_v2-noqlora-R256-P32",
        "DeepseekV2Config",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            kv_lora_rank=256,
            q_lora_rank=None,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            attention_bias=True,
            **_MOE_OFF,
        ),
        dict(max_batch=2, page_size=16),
    ),
]
IDS = [c[0] for c in CASES]
_MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "DeepseekV3Config": "DeepseekV3ForCausalLM",
    "DeepseekV2Config": "DeepseekV2ForCausalLM",
}


def make_model(case_id: str, seed: int = 0):
    """The case's transformers model, random: weights at initializer_range,
    and (unlike transformers' init, which leaves them at 1 and 0) random
    norm weights and biases, so every parameter matters."""
    _, cls_name, kwargs, _ = next(c for c in CASES if c[0] == case_id)
    kw = dict(_COMMON, **kwargs)
    if "first_k_dense_replace" in kw:
        kw["first_k_dense_replace"] = kw["num_hidden_layers"]
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[cls_name])(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def prompts_for(seed: int = 0, lens=PROMPT_LENS, vocab: int = 256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def hf_generate(model, prompt, new=NEW, eos=None, logits=False):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        output_logits=logits,
        return_dict_in_generate=True,
    )
    toks = out.sequences[0, len(prompt) :].tolist()
    if eos is not None and eos in toks:
        toks = toks[: toks.index(eos) + 1]
    return (toks, torch.stack(out.logits)[:, 0].numpy()) if logits else toks


_engines: dict = {}


def engine_for(case_id: str, model):
    """One engine per case for the module (kernels and graphs are shared by
    the tests of a case)."""
    if case_id not in _engines:
        opts = next(c for c in CASES if c[0] == case_id)[3]
        _engines[case_id] = (
            model,
            cupaged.Engine.from_transformers(model, like=LIKE, prefill_chunk=16, num_pages=96, **opts),
        )
    return _engines[case_id][1]


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(case_id):
        if case_id not in cache:
            cache[case_id] = make_model(case_id)
        return cache[case_id]

    yield get
    _engines.clear()


@pytest.mark.parametrize("case", IDS)
def test_generate_matches_transformers(models, case):
    model = models(case)
    engine = engine_for(case, model)
    prompts = prompts_for()
    expected = [hf_generate(model, p) for p in prompts]
    got = engine.generate(prompts, NEW)
    assert got == expected
    assert len(prompts) > engine.max_batch
    s = engine.stats
    assert s["prefill_tokens"] == sum(PROMPT_LENS)
    assert s["prefill_chunks"] >= 3 and s["readbacks"] >= 2
    assert engine.cache.num_free_pages == engine.cache.num_pages  # every sequence freed (cached pages count)


@pytest.mark.parametrize("case", IDS)
def test_logits_match_transformers_every_step(models, case):
    model = models(case)
    engine = engine_for(case, model)
    prompt = prompts_for(seed=1, lens=(23,))[0]
    toks, ref = hf_generate(model, prompt, logits=True)
    got, logits = engine.generate([prompt], NEW, return_logits=True)
    assert got[0] == toks
    assert logits[0].shape == ref.shape == (NEW, 256)
    err = float(np.abs(logits[0] - ref).max())
    assert err <= LOGIT_RTOL * max(1.0, float(np.abs(ref).max())), f"{case}: max |logit diff| {err:.3g}"


def test_mla_cases_cover_every_fold():
    """The MLA cases run both forms of each up-projection: folded into the
    query / output projection, and one product per head."""
    seen = set()
    for _id, cls_name, kwargs, _ in CASES:
        if cls_name.startswith("Deepseek"):
            cfg = cupaged.engine.parse_config(make_config_dict(cls_name, kwargs))
            seen.add(fold_choice(cfg))
    assert {q for q, _ in seen} == {True, False} and {o for _, o in seen} == {True, False}


def make_config_dict(cls_name, kwargs):
    kw = dict(_COMMON, **kwargs)
    kw["first_k_dense_replace"] = kw["num_hidden_layers"]
    d = getattr(transformers, cls_name)(**kw).to_dict()
    d["architectures"] = [_MODEL_CLASSES[cls_name]]
    return d


@pytest.mark.parametrize("case", ["llama-gqa2-llama3-tied", "deepseek_v3-qlora-yarn-R64-P16"])
def test_shared_prefixes_are_reused(models, case):
    """Prompts with a common 32-token prefix: the first one's full pages are
    cached when it finishes (max_batch 1: the others wait for it), the others
    share them and prefill only their tails; tokens still equal transformers'."""
    model = models(case)
    engine = cupaged.Engine.from_transformers(
        model, like=LIKE, max_batch=1, prefill_chunk=16, num_pages=64, page_size=16
    )
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 256, 32).tolist()
    prompts = [prefix + rng.integers(0, 256, n).tolist() for n in (5, 9, 1)]
    expected = [hf_generate(model, p) for p in prompts]
    before = engine.cache.stats()["hits"]
    assert engine.generate(prompts, NEW) == expected
    assert engine.cache.stats()["hits"] - before == 4  # 2 pages each for the 2nd and 3rd prompt
    assert engine.stats["cached_prompt_tokens"] == 64
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts)) - 64


@pytest.mark.parametrize("case", ["qwen2-mha-bias-yarn", "deepseek_v2-noqlora-R256-P32"])
def test_stop_tokens_end_sequences_like_transformers(models, case):
    """A stop token (eos) ends a sequence where transformers' greedy generate
    ends it, the stop token included; others run to max_new_tokens."""
    model = models(case)
    engine = engine_for(case, model)
    prompts = prompts_for(seed=3, lens=(6, 11, 2))
    free = [hf_generate(model, p, new=12) for p in prompts]
    stop = free[0][4]  # the fifth token of the first prompt's output
    expected = [hf_generate(model, p, new=12, eos=stop) for p in prompts]
    assert len(expected[0]) == free[0].index(stop) + 1 <= 5
    assert engine.generate(prompts, 12, stop_token_ids=[stop]) == expected
    # the prefill's token itself may be the stop token
    first = free[1][0]
    expected = [hf_generate(model, p, new=12, eos=first) for p in prompts]
    assert expected[1] == [first]
    assert engine.generate(prompts, 12, stop_token_ids=[first]) == expected


@pytest.mark.parametrize("case", ["llama-gqa2-llama3-tied", "deepseek_v3-R512-P64-halves"])
def test_save_pretrained_folder_loads(models, case, tmp_path):
    """What save_pretrained writes (safetensors; a tied lm_head is not stored)
    loads through from_pretrained and generates the same tokens."""
    model = models(case)
    model.save_pretrained(tmp_path)
    engine = cupaged.Engine.from_pretrained(tmp_path, like=LIKE, max_batch=2, prefill_chunk=16, num_pages=64)
    assert engine.dtype == np.float32
    prompts = prompts_for(seed=5, lens=(9, 1, 30))
    assert engine.generate(prompts, NEW) == [hf_generate(model, p) for p in prompts]


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    """A bfloat16 checkpoint maps as bfloat16 (ml_dtypes) and converts to the
    engine's float32; it equals transformers on the same rounded weights."""
    model = make_model("mistral-gqa4-d64", seed=4)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    ref = type(model).from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = cupaged.Engine.from_pretrained(tmp_path, like=LIKE, dtype="float32", max_batch=2, num_pages=64)
    bf16 = cupaged.Engine.from_pretrained(tmp_path, like=LIKE, max_batch=2, num_pages=64)
    assert bf16.dtype.name == "bfloat16"
    prompts = prompts_for(seed=6, lens=(4, 13))
    assert engine.generate(prompts, NEW) == [hf_generate(ref, p) for p in prompts]
    assert [len(t) for t in bf16.generate(prompts, 4)] == [4, 4]
    mem = cupaged.Engine.from_transformers(model, like=LIKE, max_batch=2, num_pages=64)  # bf16 tensors in memory
    assert mem.dtype.name == "bfloat16" and mem.generate(prompts, 4) == bf16.generate(prompts, 4)


def test_from_transformers_refuses_a_moe_model():
    kw = dict(
        _COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
    )
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw))
    with pytest.raises(cupaged.ConfigError, match=r"first_k_dense_replace: layers 1 of 2 are mixture-of-experts"):
        cupaged.Engine.from_transformers(model, like=LIKE)
