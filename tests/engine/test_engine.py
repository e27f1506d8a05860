"""cupaged.Engine without torch: config checks per architecture, checkpoint
folders (missing files, truncated or malformed safetensors, missing or
misshapen tensors), rotary tables, and generate's input checks, on random
checkpoints written with NumPy (cupaged.testing.checkpoints)."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

import cupaged
from cupaged import CheckpointError, ConfigError, PagedAttentionError
from cupaged.engine import parse_config, rope
from cupaged.engine.checkpoint import SafetensorsFile
from cupaged.engine.mla import rope_permutation
from cupaged.testing import random_weights, save_safetensors, tiny_config, write_random_checkpoint

LIKE = np.zeros(1, np.float32)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", eos_token_id=3)


# ---------------------------------------------------------------------------
# config.json checks


@pytest.mark.parametrize(
    "arch",
    [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
    ],
)
def test_every_architecture_parses(arch):
    cfg = parse_config(tiny_config(arch))
    assert cfg.architecture == arch
    assert cfg.family == ("mla" if arch.startswith("Deepseek") else "dense")
    assert cfg.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    assert cfg.rope_interleave == arch.startswith("Deepseek")


def test_model_type_names_the_architecture():
    raw = tiny_config("Qwen3ForCausalLM")
    del raw["architectures"]
    assert parse_config(raw).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    "arch,overrides,match",
    [
        ("GPT2LMHeadModel", {}, r"architectures: expected one of LlamaForCausalLM, .*got 'GPT2LMHeadModel'"),
        (
            "LlamaForCausalLM",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            r"LlamaForCausalLM: rope_scaling.rope_type: expected one of 'default', 'linear', 'llama3', 'yarn', "
            r"got 'dynamic'",
        ),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            r"rope_parameters.rope_type: .*got 'longrope'",
        ),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, r"hidden_act: the MLP is SwiGLU .*got 'gelu'"),
        ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor: .*expected 1.0, got 0.5"),
        (
            "LlamaForCausalLM",
            {"num_key_value_heads": 3},
            r"num_key_value_heads: expected a divisor of "
            r"num_attention_heads \(4\), got 3",
        ),
        ("LlamaForCausalLM", {"hidden_size": None}, r"hidden_size: expected an integer >= 1, got nothing"),
        ("LlamaForCausalLM", {"vocab_size": "256"}, r"vocab_size: expected an integer >= 1, got '256'"),
        (
            "LlamaForCausalLM",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"rope_scaling.low_freq_factor: expected a positive number, got nothing",
        ),
        (
            "LlamaForCausalLM",
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantization_config: quantized checkpoints \('fp8'\) are not supported",
        ),
        ("Qwen3ForCausalLM", {"head_dim": 15}, r"the rotary dim must be even, got 15"),
        (
            "DeepseekV3ForCausalLM",
            {"first_k_dense_replace": 1, "n_routed_experts": 8},
            r"DeepseekV3ForCausalLM: first_k_dense_replace: layers 1 of 2 are mixture-of-experts layers "
            r"\(first_k_dense_replace=1, n_routed_experts=8\); MoE layers are not supported",
        ),
        (
            "DeepseekV2ForCausalLM",
            {"num_hidden_layers": 4, "first_k_dense_replace": 0},
            r"layers 0..3 of 4 are mixture-of-experts",
        ),
        ("DeepseekV3ForCausalLM", {"kv_lora_rank": 0}, r"kv_lora_rank: expected an integer >= 1, got 0"),
    ],
)
def test_unsupported_config_fields_are_refused(arch, overrides, match):
    raw = tiny_config(arch, **overrides)
    for k, v in overrides.items():  # None means "absent"
        if v is None:
            del raw[k]
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_both_rope_config_formats():
    old = tiny_config(
        "LlamaForCausalLM",
        rope_theta=5e5,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    new = tiny_config(
        "LlamaForCausalLM",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    a, b = parse_config(old).rope, parse_config(new).rope
    assert a == b and a.type == "llama3" and a.theta == 5e5


def test_sliding_windows_per_layer():
    """A sliding window is each layer's attention window, as transformers
    applies it (Mistral: every layer; Qwen2 / Qwen3: layer_types, else the
    layers at or past max_window_layers, 28 by default); it caps no length."""
    m = parse_config(tiny_config("MistralForCausalLM", sliding_window=100))
    assert m.max_len == 512 and m.sliding_window == 100 and m.layer_windows == (100, 100)
    assert parse_config(tiny_config("MistralForCausalLM", sliding_window=None)).layer_windows == (None, None)
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        q = tiny_config(arch, sliding_window=64, num_hidden_layers=3)
        assert parse_config(q).layer_windows == (None,) * 3  # use_sliding_window false: no window
        on = dict(q, use_sliding_window=True)
        assert parse_config(on).layer_windows == (None,) * 3  # all below max_window_layers (28)
        assert parse_config(dict(on, max_window_layers=1)).layer_windows == (None, 64, 64)
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        assert parse_config(dict(on, layer_types=types)).layer_windows == (64, None, 64)
        with pytest.raises(
            ConfigError,
            match=r"layer_types: expected a list of 3 of 'sliding_attention', "
            r"'full_attention', got \['sliding_attention'\]",
        ):
            parse_config(dict(on, layer_types=["sliding_attention"]))
        assert parse_config(on).max_len == 512


def test_deepseek_softmax_scale_has_yarn_mscale():
    raw = tiny_config(
        "DeepseekV3ForCausalLM",
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    m = 0.1 * math.log(40.0) + 1.0
    assert parse_config(raw).scale == pytest.approx(192**-0.5 * m * m)
    assert parse_config(tiny_config("DeepseekV3ForCausalLM")).scale == pytest.approx(32**-0.5)


# ---------------------------------------------------------------------------
# rotary tables


def test_rope_tables_of_each_type():
    def spec(**kw):
        return parse_config(tiny_config("LlamaForCausalLM", **kw)).rope

    d = spec()
    np.testing.assert_allclose(rope.inv_freq(d), 10000.0 ** (-np.arange(0, 16, 2) / 16))
    lin = spec(rope_scaling={"type": "linear", "factor": 4.0})
    np.testing.assert_allclose(rope.inv_freq(lin), rope.inv_freq(d) / 4)
    l3 = spec(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    f = rope.inv_freq(l3)
    wavelen = 2 * math.pi / rope.inv_freq(d)
    assert np.allclose(f[wavelen < 16], rope.inv_freq(d)[wavelen < 16])  # high frequencies kept
    assert np.allclose(f[wavelen > 64], rope.inv_freq(d)[wavelen > 64] / 8)
    y = spec(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert rope.attention_factor(y) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    cos, sin = rope.tables(y, 10)
    assert cos.dtype == np.float32 and cos.shape == (10, 8)
    np.testing.assert_allclose(cos[0], rope.attention_factor(y), rtol=1e-6)
    np.testing.assert_allclose(cos**2 + sin**2, rope.attention_factor(y) ** 2, rtol=1e-5)


def test_rope_permutation_turns_interleaved_pairs_into_halves():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 8))
    c, s = (
        np.cos(np.arange(3)[:, None] * np.array([1.0, 0.3, 0.1, 0.01])),
        np.sin(np.arange(3)[:, None] * np.array([1.0, 0.3, 0.1, 0.01])),
    )
    from cupaged.testing import reference

    inter = reference.apply_rope(x, c, s, interleaved=True)
    halves = reference.apply_rope(x[..., rope_permutation(8)], c, s)
    np.testing.assert_allclose(halves, inter[..., rope_permutation(8)])


# ---------------------------------------------------------------------------
# checkpoint folders


def test_safetensors_round_trip_is_zero_copy(tmp_path):
    import ml_dtypes

    t = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.ones(5, ml_dtypes.bfloat16),
        "c": np.arange(3, dtype=np.float16),
    }
    save_safetensors(tmp_path / "x.safetensors", t)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for k, v in t.items():
        got = f.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got.astype(np.float32), v.astype(np.float32))
    assert isinstance(f.get("a").base, np.memmap) or isinstance(f.get("a"), np.memmap)
    assert not f.get("a").flags.writeable


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="expected a model folder .* \\(no such folder\\)"):
        cupaged.Engine.from_pretrained(tmp_path / "nope", like=LIKE)
    with pytest.raises(CheckpointError, match="missing config.json"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors file \(found pytorch_model.bin"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not readable JSON"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


def test_missing_shard_named_by_the_index(tmp_path):
    write_random_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="missing safetensors shard.*model-00002-of-00002.safetensors"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


def test_truncated_safetensors_file(llama_folder, tmp_path):
    data = (llama_folder / "model.safetensors").read_bytes()
    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    st = tmp_path / "model.safetensors"
    st.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: truncated: tensor '.*' ends at data byte \d+, "
        r"the file holds \d+ data bytes",
    ):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    st.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match=r"truncated: the header needs \d+ bytes, the file has 20"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    st.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated: 5 bytes"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    st.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": [1, 2]}   ')
    with pytest.raises(CheckpointError, match="tensor 'a': expected dtype, shape and data_offsets"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


def test_missing_and_misshapen_tensors(tmp_path):
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = random_weights(cfg)
    del w["model.layers.1.mlp.up_proj.weight"]
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    w = random_weights(cfg)
    w["model.layers.0.self_attn.k_proj.weight"] = w["model.layers.0.self_attn.k_proj.weight"][:8]
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model.layers.0.self_attn.k_proj.weight': expected shape "
        r"\[32, 64\], got \[8, 64\]",
    ):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


def test_unsupported_config_refused_before_weights_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(rope_scaling={"type": "dynamic", "factor": 2})))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never opened: the config fails first
    with pytest.raises(ConfigError, match="rope_type: expected one of .*got 'dynamic'"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


# ---------------------------------------------------------------------------
# the engine on NumPy-written checkpoints


def test_generate_on_a_numpy_checkpoint(llama_folder):
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=2, prefill_chunk=8)
    assert e.eos_token_ids == (3,) and e.max_model_len == 512 and e.num_pages == 2 * 32
    out = e.generate([[1, 2, 3], [4] * 20, [5]], 6, stop_token_ids=())
    assert [len(o) for o in out] == [6, 6, 6]
    again = e.generate([[1, 2, 3], [4] * 20, [5]], 6, stop_token_ids=())
    assert again == out  # prefix-cache hits change nothing
    seen = []
    streamed = e.generate([[9, 8, 7]], 5, stop_token_ids=(), on_tokens=lambda i, t: seen.extend(t))
    assert seen == streamed[0]
    assert e.generate([[9, 8, 7]], 1, stop_token_ids=()) == [streamed[0][:1]]


def test_eager_decode_equals_graph_decode(llama_folder):
    kw = dict(like=LIKE, max_batch=2, prefill_chunk=8, num_pages=32)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8]]
    g = cupaged.Engine.from_pretrained(llama_folder, **kw).generate(prompts, 7, stop_token_ids=())
    assert cupaged.Engine.from_pretrained(llama_folder, graph=False, **kw).generate(prompts, 7, stop_token_ids=()) == g


def test_generate_input_errors_change_nothing(llama_folder):
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=2, num_pages=4, page_size=8)
    assert e.max_model_len == 32
    free = e.cache.num_free_pages
    cases = [
        (([[1] * 30], 4), r"prompts\[0\]: 30 tokens \+ max_new_tokens 4 = 34 exceed the engine's max_model_len 32"),
        (([[1, 2], [300]], 2), r"prompts\[1\]\[0\]: expected a token id in 0..255, got 300"),
        (([[]], 2), r"prompts\[0\]: expected at least one token"),
        ((["hello"], 2), r"prompts\[0\]: expected token ids \(ints\), got a str"),
        (("hello", 2), r"prompts: expected a list of prompts \(strings or token-id lists\), got str"),
        (([[1]], 0), "max_new_tokens: expected an int in 1..31, got 0"),
        (([[1]], 2, {"stop_token_ids": [-1]}), r"stop_token_ids: expected token ids >= 0"),
        (([[1]], 2, {"on_tokens": 3}), "on_tokens: expected a callable"),
    ]
    for args, match in cases:
        kw = args[2] if len(args) > 2 else {}
        with pytest.raises(PagedAttentionError, match=match):
            e.generate(args[0], args[1], **kw)
    assert e.cache.num_free_pages == free and e.stats == {}


def test_engine_option_errors(llama_folder):
    for kw, match in [
        ({"like": [0.0]}, "like: expected a NumPy or CuPy array"),
        ({"dtype": "int8"}, "dtype: expected float32, float16 or bfloat16"),
        ({"max_batch": 0}, "max_batch: expected an int in 1..1024"),
        ({"page_size": 300}, "page_size: expected an int in 1..256"),
        ({"max_model_len": 10_000}, "max_model_len: expected an int in 2..512"),
        ({"prefix_cache": 1}, "prefix_cache: expected True or False, got int 1"),
    ]:
        with pytest.raises(PagedAttentionError, match=match):
            cupaged.Engine.from_pretrained(llama_folder, **{"like": LIKE, **kw})


def test_checkpoint_dtype_must_be_a_storage_dtype(tmp_path):
    folder = write_random_checkpoint(tmp_path, dtype="float64")
    with pytest.raises(
        PagedAttentionError,
        match=r"dtype: expected float32, float16 or bfloat16 \(or None: the "
        r"checkpoint's\), got float64 \(the checkpoint's; pass dtype=\)",
    ):
        cupaged.Engine.from_pretrained(folder, like=LIKE)
    e = cupaged.Engine.from_pretrained(folder, like=LIKE, dtype="float16", num_pages=8)
    assert e.dtype == np.float16 and len(e.generate([[1, 2]], 3)[0]) == 3


def test_mla_checkpoint_with_biases_and_q_lora(tmp_path):
    folder = write_random_checkpoint(
        tmp_path, "DeepseekV3ForCausalLM", q_lora_rank=24, attention_bias=True, kv_lora_rank=48, qk_rope_head_dim=8
    )
    e = cupaged.Engine.from_pretrained(folder, like=LIKE, max_batch=2, prefill_chunk=8, num_pages=32)
    out = e.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11]], 5)
    assert [len(o) for o in out] == [5, 5]


def test_prefill_chunks_interleave_with_decode_rounds(llama_folder):
    """prefill_per_round 8 = one chunk of 8 between decode rounds: the short
    prompt decodes while the long one is still being prefilled."""
    e = cupaged.Engine.from_pretrained(
        llama_folder, like=LIKE, max_batch=2, prefill_chunk=8, prefill_per_round=8, num_pages=32
    )
    prompts = [[7], list(range(1, 41))]
    when = {}

    def seen(i, toks):
        when.setdefault(i, e.stats["prefill_tokens"])

    out = e.generate(prompts, 12, stop_token_ids=(), on_tokens=seen)
    assert when[0] < 41 and when[1] == 41  # prompt 0's tokens came before prompt 1 was prefilled
    assert e.stats["prefill_chunks"] == 6 and e.stats["readbacks"] >= 4
    solo = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=1, num_pages=32)
    assert out == [solo.generate([p], 12, stop_token_ids=())[0] for p in prompts]


# ---------------------------------------------------------------------------
# the GPU path (skipped without a GPU): the same tokens as the CPU backend


@pytest.mark.gpu
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("LlamaForCausalLM", {"tie_word_embeddings": True}),
        ("Qwen2ForCausalLM", {}),
        ("DeepseekV3ForCausalLM", {"q_lora_rank": 24}),  # W_UK folded, W_UV per head
        ("DeepseekV2ForCausalLM", {"kv_lora_rank": 128, "qk_nope_head_dim": 8}),  # both per head
    ],
)
def test_gpu_engine_matches_the_cpu_backend(tmp_path, arch, overrides):
    """cuBLAS projections, captured decode graphs and the kernels on CuPy
    arrays give the CPU backend's tokens (float32, decisive random logits);
    bfloat16 runs and stops at max_new_tokens."""
    import cupy

    folder = write_random_checkpoint(tmp_path, arch, **overrides)
    prompts = [[1, 2, 3], list(range(5, 45)), [7], [9, 9, 9, 9]]
    kw = dict(max_batch=2, prefill_chunk=16, num_pages=32)
    cpu = cupaged.Engine.from_pretrained(folder, like=LIKE, **kw).generate(prompts, 8)
    with cupy.cuda.Stream(non_blocking=True):  # capture needs a stream other than the legacy default
        like = cupy.zeros(1, cupy.float32)
        gpu = cupaged.Engine.from_pretrained(folder, like=like, **kw)
        assert gpu.generate(prompts, 8) == cpu
        assert gpu.generate(prompts, 8) == cpu  # graphs replayed, prefix cache hit
        bf16 = cupaged.Engine.from_pretrained(folder, like=like, dtype="bfloat16", **kw)
        assert [len(t) for t in bf16.generate(prompts, 8, stop_token_ids=())] == [8] * 4


def test_prompt_needing_more_pages_than_the_cache(llama_folder):
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, num_pages=2, page_size=8, max_model_len=64)
    with pytest.raises(
        PagedAttentionError,
        match=r"prompts\[1\]: needs 3 pages of 8 tokens, the cache has 2 "
        r"\(num_pages\)",
    ):
        e.generate([[1, 2], [3] * 20], 4)
    assert e.cache.num_free_pages == 2 and e.generate([[1, 2]], 4, stop_token_ids=()) != []


# ---------------------------------------------------------------------------
# stop / eos token ids and prompt token ids (issue #19, item 10)


def test_stop_token_ids_may_be_one_int(llama_folder):
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=2, num_pages=16)
    free = e.generate([[1, 2, 3]], 8, stop_token_ids=())[0]
    stop = free[3]
    want = free[: free.index(stop) + 1]
    for ids in (stop, np.int64(stop), np.int32(stop), [stop], (stop, stop), np.array([stop]), np.array(stop), {stop}):
        assert e.generate([[1, 2, 3]], 8, stop_token_ids=ids) == [want], ids
    assert e.generate([[1, 2, 3]], 8, stop_token_ids=[]) == [free]


@pytest.mark.parametrize(
    "ids, match",
    [
        (True, r"stop_token_ids: expected a token id or a list of token ids \(ints >= 0\), got True"),
        (5.0, r"stop_token_ids: expected a token id or a list .*got 5.0"),
        ("5", r"stop_token_ids: expected a token id or a list .*got '5'"),
        ([1.5], r"stop_token_ids: expected a token id or a list .*got \[1.5\]"),
        ([1, None], r"stop_token_ids: expected .*got \[1, None\]"),
        ([[1, 2]], r"stop_token_ids: expected .*got \[\[1, 2\]\]"),
        ({1: 2}, r"stop_token_ids: expected .*got \{1: 2\}"),
        (-1, r"stop_token_ids: expected token ids >= 0, got \[-1\]"),
        (np.array([3, -2]), r"stop_token_ids: expected token ids >= 0, got \[3, -2\]"),
        (
            list(range(65)),
            r"stop_token_ids: expected at most 64 distinct token ids \(the decode graph's stop list\), "
            r"got 65",
        ),
    ],
)
def test_stop_token_id_errors_change_nothing(llama_folder, ids, match):
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=2, num_pages=8)
    free = e.cache.num_free_pages
    with pytest.raises(PagedAttentionError, match=match):
        e.generate([[1, 2]], 3, stop_token_ids=ids)
    assert e.cache.num_free_pages == free and e.stats == {} and e._batches == {}
    assert len(e.generate([[1, 2]], 3, stop_token_ids=list(range(64)) * 2)[0]) <= 3  # 64 distinct: fine


def test_too_many_eos_ids_are_refused_at_load(tmp_path):
    """A config whose eos list is longer than the decode graph's stop list is
    refused when it is read, naming the field, not at every generate naming
    stop_token_ids (which the caller never passed)."""
    with pytest.raises(
        ConfigError,
        match=r"config.json: eos_token_id: expected at most 64 distinct token ids \(the "
        r"decode graph's stop list\), got 65",
    ):
        parse_config(tiny_config(eos_token_id=list(range(65))))
    assert parse_config(tiny_config(eos_token_id=list(range(64)) + [0, 1])).eos_token_ids == tuple(range(64))
    assert parse_config(tiny_config(eos_token_id=7)).eos_token_ids == (7,)
    with pytest.raises(ConfigError, match=r"config.json: eos_token_id: expected token ids >= 0, got \[2, -1\]"):
        parse_config(tiny_config(eos_token_id=[2, -1]))
    with pytest.raises(ConfigError, match=r"config.json: eos_token_id: expected a token id or a list .*got True"):
        parse_config(tiny_config(eos_token_id=True))
    folder = write_random_checkpoint(tmp_path, eos_token_id=list(range(65)))
    with pytest.raises(ConfigError, match=r"config.json: eos_token_id: expected at most 64"):
        cupaged.Engine.from_pretrained(folder, like=LIKE)


@pytest.mark.parametrize(
    "gen, error, match",
    [
        ({"eos_token_id": list(range(100))}, ConfigError, r"generation_config.json: eos_token_id: expected at most 64"),
        ({"eos_token_id": "</s>"}, ConfigError, r"generation_config.json: eos_token_id: expected a token id .*'</s>'"),
        ({"eos_token_id": [1, -5]}, ConfigError, r"generation_config.json: eos_token_id: expected token ids >= 0"),
        ([1, 2], CheckpointError, r"generation_config.json: expected a JSON object, got list"),
        ("{not json", CheckpointError, r"generation_config.json: not readable JSON"),
    ],
)
def test_generation_config_eos_is_checked(tmp_path, gen, error, match):
    """(A malformed generation_config.json used to be ignored silently,
    falling back to config.json's eos ids.)"""
    folder = write_random_checkpoint(tmp_path, eos_token_id=3)
    (folder / "generation_config.json").write_text(gen if isinstance(gen, str) else json.dumps(gen))
    with pytest.raises(error, match=match):
        cupaged.Engine.from_pretrained(folder, like=LIKE)


def test_generation_config_eos_is_used(tmp_path):
    folder = write_random_checkpoint(tmp_path, eos_token_id=3)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 4, 9]}))
    assert cupaged.Engine.from_pretrained(folder, like=LIKE, num_pages=8).eos_token_ids == (9, 4)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert cupaged.Engine.from_pretrained(folder, like=LIKE, num_pages=8).eos_token_ids == (3,)


def test_engine_eos_token_ids_argument_is_checked(llama_folder):
    assert cupaged.Engine.from_pretrained(llama_folder, like=LIKE, num_pages=8, eos_token_ids=7).eos_token_ids == (7,)
    for ids, match in (
        (list(range(65)), r"eos_token_ids: expected at most 64 distinct token ids"),
        ([-1], r"eos_token_ids: expected token ids >= 0, got \[-1\]"),
        ("2", r"eos_token_ids: expected a token id or a list of token ids"),
    ):
        with pytest.raises(PagedAttentionError, match=match):
            cupaged.Engine.from_pretrained(llama_folder, like=LIKE, num_pages=8, eos_token_ids=ids)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1, True]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got bool True"),
        ([[1], [np.bool_(False)]], r"prompts\[1\]\[0\]: expected a token id in 0..255, got bool False"),
        ([[1.0, 2]], r"prompts\[0\]\[0\]: expected a token id in 0..255, got float 1.0"),
        ([[3, 2**70]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got 1180591620717411303424"),
        ([[3, -1]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got -1"),
        ([[255, 256]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got 256"),
        ([[1, [2]]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got list \[2\]"),
        ([[1, None]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got NoneType None"),
        ([[1, "2"]], r"prompts\[0\]\[1\]: expected a token id in 0..255, got str '2'"),
        ([[1], np.array([4, 2**16 - 1], np.uint16)], r"prompts\[1\]\[1\]: expected a token id in 0..255, got 65535"),
        (
            [np.array([2**64 - 1], np.uint64)],
            r"prompts\[0\]\[0\]: expected a token id in 0..255, got "
            r"18446744073709551615",
        ),
        ([np.array([1.0, 2.0])], r"prompts\[0\]: expected a 1-D integer array of token ids, got float64 \[2\]"),
        ([np.array([[1, 2]])], r"prompts\[0\]: expected a 1-D integer array of token ids, got int64 \[1, 2\]"),
        ([np.array([True])], r"prompts\[0\]: expected a 1-D integer array of token ids, got bool \[1\]"),
        ([5], r"prompts\[0\]: expected a list of token ids \(ints\), got int"),
        ([iter([1, 2])], r"prompts\[0\]: expected a list of token ids \(ints\), got list_iterator"),
        ([{1: 2}], r"prompts\[0\]: expected a list of token ids \(ints\), got dict"),
        ([{3, 1}], r"prompts\[0\]: expected a list of token ids \(ints\), got set"),
        ([b"\x01"], r"prompts\[0\]: expected token ids \(ints\), got a bytes"),
    ],
)
def test_prompt_token_ids_are_checked(llama_folder, prompts, match):
    """Each prompt token is an int in 0..vocab-1, named by prompt and
    position, before anything runs (a bool or a float is no token id)."""
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=2, num_pages=8)
    free = e.cache.num_free_pages
    with pytest.raises(PagedAttentionError, match=match):
        e.generate(prompts, 2, stop_token_ids=())
    assert e.cache.num_free_pages == free and e.stats == {} and e._batches == {}


def test_prompt_token_ids_of_every_integer_kind(llama_folder):
    e = cupaged.Engine.from_pretrained(llama_folder, like=LIKE, max_batch=2, num_pages=8)
    want = e.generate([[7, 255, 0]], 3, stop_token_ids=())
    for p in (
        (7, 255, 0),
        np.array([7, 255, 0], np.uint8),
        np.array([7, 255, 0], np.int32),
        [np.int64(7), np.uint16(255), 0],
        range(7, 8),
    ):
        got = e.generate([p], 3, stop_token_ids=())
        assert got == (want if len(p) == 3 else e.generate([[7]], 3, stop_token_ids=())), p


def _private_reads(source: str) -> list[str]:
    """``x._name`` attributes of ``source`` read off anything but ``self`` /
    ``cls`` (dunders aside), as "line: expression"."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_private_reads_finds_what_it_should():
    src = (
        "def f(self, cache, seq):\n    self._a\n    cache._lock\n    self.e._join(1)\n    seq.__class__\n"
        "    seq.batch\n"
    )
    assert _private_reads(src) == ["3: cache._lock", "4: self.e._join"]


def test_engine_reads_no_private_names_of_other_objects():
    """cupaged/engine/ reads the cache, the batch, sequences and its own
    helper objects through public names only, no ``other._name``."""
    folder = Path(rope.__file__).parent
    found = {p.name: _private_reads(p.read_text()) for p in sorted(folder.glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}
