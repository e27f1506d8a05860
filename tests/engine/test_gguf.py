"""GGUF checkpoints (``cupaged.engine.gguf``) on small random files written
by ``cupaged.testing.gguf`` (the gguf package's GGUFWriter):

* every tensor type read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
  Q4_K, Q5_K, Q6_K)
  loads to the float64 reference dequantization of the file's blocks,
  written from ggml's block layouts (and a hand-computed block per quant);
  Llama's q / k rows are unpermuted (the file holds llama.cpp's layout);
* the metadata gives the ModelConfig of the equivalent config.json;
* the engine on a file gives the greedy tokens (and logits) of the engine on
  the equivalent safetensors folder, and of transformers loading the file
  itself (``gguf_file=``, its own dequantizer and unpermutation);
* the tokenizer (byte-level BPE with the file's merges) and the CLI's text;
* refusals: architecture, tensor type, refused keys, rope scaling, unknown
  tensors, bad values, broken files, no gguf package.

Skipped with the reason when the gguf package is missing.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package (the gguf extra)")

import cupaged  # noqa: E402
from cupaged import CheckpointError, ConfigError, SetupError  # noqa: E402
from cupaged.engine import parse_config  # noqa: E402
from cupaged.engine.gguf import GGUFFile, gguf_tokenizer, read_gguf, unpermute  # noqa: E402
from cupaged.testing.gguf import (  # noqa: E402
    BLOCKS,
    TYPES,
    dequantize_reference,
    permute,
    random_blocks,
    vocabulary,
    write_random_gguf,
    write_reference_folder,
)

LIKE = np.zeros(1, np.float32)
PROMPTS = [[5, 256, 17, 90, 258], [3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
NEW = 6


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal up to float32 rounding of the reference."""
    assert got.shape == ref.shape
    err = np.max(np.abs(got.astype(np.float64) - ref), initial=0)
    assert err <= 2.0**-23 * max(1.0, np.max(np.abs(ref), initial=0)), err


# ---------------------------------------------------------------------------
# Block formats


def _block(kind: str, body: bytes) -> np.ndarray:
    return np.frombuffer(body, np.uint8).reshape(1, BLOCKS[kind][1])


def test_hand_made_blocks():
    """One block per quant, its values computed by hand from the format."""
    f16 = lambda v: np.float16(v).tobytes()  # noqa: E731
    # Q8_0: d = 0.5, q = -16..15 -> -8.0 .. 7.5
    q = np.arange(-16, 16, dtype=np.int8)
    want = {"Q8_0": (_block("Q8_0", f16(0.5) + q.tobytes()), 0.5 * np.arange(-16, 16))}
    # Q4_0: d = 2, bytes 0x80 | j (j < 16): low nibble j -> 2 (j - 8); high nibble 8 -> 0
    qs = bytes(0x80 | j for j in range(16))
    want["Q4_0"] = (_block("Q4_0", f16(2.0) + qs), np.r_[2.0 * (np.arange(16) - 8), np.zeros(16)])
    # Q4_1: d = 2, m = -1, bytes 0x21: low 1 -> 1, high 2 -> 3
    want["Q4_1"] = (_block("Q4_1", f16(2.0) + f16(-1.0) + bytes([0x21] * 16)), np.r_[np.ones(16), 3 * np.ones(16)])
    # Q5_0: d = 2, qh bits 0..15 set (5th bit of values 0..15), bytes 0x50: values 0..15 (0 | 16) - 16 = 0,
    # values 16..31 (5 | 0) - 16 = -11 -> -22
    want["Q5_0"] = (
        _block("Q5_0", f16(2.0) + (0xFFFF).to_bytes(4, "little") + bytes([0x50] * 16)),
        np.r_[np.zeros(16), np.full(16, -22.0)],
    )
    # Q5_1: d = 1, m = 0.5, qh bit 16 only (value 16), bytes 0x11: 1 + 0.5 everywhere but value 16: 17 + 0.5
    q51 = np.full(32, 1.5)
    q51[16] = 17.5
    want["Q5_1"] = (_block("Q5_1", f16(1.0) + f16(0.5) + (1 << 16).to_bytes(4, "little") + bytes([0x11] * 16)), q51)
    # Q5_K: d = 1, dmin = 0, every sub-block scale 1 / min 0, qh bytes 0x01 (bit 0: sub-block 0's 5th bit), qs 0
    sc5 = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    want["Q5_K"] = (
        _block("Q5_K", f16(1.0) + f16(0.0) + sc5 + bytes([1] * 32) + bytes(128)),
        np.r_[np.full(32, 16.0), np.zeros(224)],
    )
    # Q4_K: d = 1, dmin = 0.5; sub-block scales 1..4 / mins 0 (j < 4: scales[j], mins scales[j + 4] & 63),
    # sub-blocks 4..7 scale 0 and min 2 (scales[8 + (j - 4)] = 0x20: low 0, high 2); nibbles all 3
    sc = bytes([1, 2, 3, 4, 0, 0, 0, 0, 0x20, 0x20, 0x20, 0x20])
    q4k = np.r_[np.repeat([3.0, 6.0, 9.0, 12.0], 32), np.full(128, -1.0)]
    want["Q4_K"] = (_block("Q4_K", f16(1.0) + f16(0.5) + sc + bytes([0x33] * 128)), q4k)
    # Q6_K: d = 0.25, scales 2 (int8); ql 0x00, qh 0xFF: every q = (0 | 3 << 4) - 32 = 16 -> 0.25 * 2 * 16 = 8
    want["Q6_K"] = (_block("Q6_K", bytes(128) + bytes([0xFF] * 64) + bytes([2] * 16) + f16(0.25)), np.full(256, 8.0))
    for kind, (raw, values) in want.items():
        np.testing.assert_array_equal(dequantize_reference(raw, kind)[0], values, err_msg=kind)
        got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])  # what the engine runs
        np.testing.assert_array_equal(got[0], values, err_msg=kind)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_dequantizer_matches_reference_on_random_blocks(kind):
    raw = random_blocks(kind, 5, 2 * BLOCKS[kind][0], np.random.default_rng(3))
    _close(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dequantize_reference(raw, kind))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 16 * 3).reshape(4 * 16, 3)
    np.testing.assert_array_equal(unpermute(permute(w, 4), 4), w)
    # head 0, D 16: file row 2i + s is transformers' row s * 8 + i
    p = permute(np.arange(16), 1)
    assert p.tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


# ---------------------------------------------------------------------------
# Weights and config


@pytest.mark.parametrize(
    "arch, kind",
    [("llama", k) for k in TYPES] + [("qwen2", "Q4_K"), ("qwen2", "BF16"), ("qwen3", "Q6_K"), ("qwen3", "F16")],
)
def test_weights_equal_reference(tmp_path, arch, kind):
    path, weights, config = write_random_gguf(tmp_path / "m.gguf", arch, kind, tie=kind == "Q4_1", seed=1)
    cfg, ckpt, eos = read_gguf(path)
    assert cfg == parse_config(config)
    assert eos == (len(vocabulary()) - 1,)
    assert set(ckpt.names()) == set(weights)
    for name, ref in weights.items():
        got = ckpt.get(name, ref.shape)
        stored = {"F16": np.float16, "BF16": cupaged.dtypes.np_dtype("bf16")}.get(kind, np.float32)
        assert got.dtype == (stored if got.ndim == 2 else np.float32), name
        _close(got, ref)


def test_llama_q_k_are_unpermuted(tmp_path):
    """The file's q rows are llama.cpp's interleaved layout: read raw they
    differ from the reference; loaded, they equal it."""
    path, weights, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "F32")
    raw = GGUFFile(path).tensors["blk.0.attn_q.weight"].data
    ref = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(np.asarray(raw, np.float64), ref)
    _close(read_gguf(path)[1].get("model.layers.0.self_attn.q_proj.weight"), ref)


# ---------------------------------------------------------------------------
# The engine


def _engine(path, **kw):
    return cupaged.Engine.from_pretrained(path, like=LIKE, dtype="float32", max_batch=2, max_model_len=64, **kw)


@pytest.mark.parametrize(
    "arch, kind, extra",
    [("llama", "Q4_1", dict(tie=True)), ("qwen2", "Q8_0", {}), ("qwen3", "BF16", dict(attention_bias=True))],
)
def test_engine_on_gguf_equals_engine_on_folder(tmp_path, arch, kind, extra):
    path, weights, config = write_random_gguf(tmp_path / "m.gguf", arch, kind, seed=2, **extra)
    folder = write_reference_folder(tmp_path / "ref", weights, config)
    got, got_logits = _engine(path).generate(PROMPTS, NEW, return_logits=True, stop_token_ids=())
    want, want_logits = _engine(folder).generate(PROMPTS, NEW, return_logits=True, stop_token_ids=())
    assert got == want
    for a, b in zip(got_logits, want_logits):
        assert np.max(np.abs(a - b)) <= 1e-4 * max(1.0, np.max(np.abs(b)))


def test_engine_on_gguf_matches_transformers(tmp_path):
    """transformers reads the same file (its own dequantizer, name map and
    unpermutation): the same greedy tokens."""
    torch = pytest.importorskip("torch", reason="the transformers comparison needs torch")
    transformers = pytest.importorskip("transformers", reason="the transformers comparison needs transformers")
    path, _, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "Q8_0", seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    got = _engine(path).generate(PROMPTS, NEW, stop_token_ids=())
    for p, toks in zip(PROMPTS, got):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert out[0, len(p) :].tolist() == toks


# ---------------------------------------------------------------------------
# Tokenizer and CLI


def test_tokenizer_from_metadata(tmp_path):
    pytest.importorskip("tokenizers", reason="the GGUF tokenizer needs the tokenizers package")
    path, _, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "F16")
    tok = gguf_tokenizer(path)
    V = len(vocabulary())
    # byte-level symbols are the bytes' ids; the merges make 'he' (257) and 'Ġthe' (258); <|end|> is special
    assert tok.encode("the the<|end|>").ids == [ord("t"), 257, 258, V - 1]
    assert tok.encode("é").ids == list("é".encode())
    assert tok.decode([ord("t"), 257, 258, V - 1], skip_special_tokens=True) == "the the"


def test_cli_generates_text_from_gguf(tmp_path, capsys):
    pytest.importorskip("tokenizers", reason="the GGUF tokenizer needs the tokenizers package")
    from cupaged.__main__ import main

    path, _, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "Q8_0", seed=5)
    assert main(["generate", "--model", str(path), "--prompt", "the the", "--max-new-tokens", "4", "--cpu"]) == 0
    out = capsys.readouterr().out
    head, rest = out.split("\n", 1)
    assert head.startswith("LlamaForCausalLM on the cpu backend: 2 layers")
    text = rest.rsplit("\nprefill: ", 1)[0]  # (the generated text may hold newlines)
    engine = cupaged.Engine.from_pretrained(path, like=LIKE, max_batch=1)
    ids = [ord("t"), 257, 258]
    tok = gguf_tokenizer(path)
    assert text == tok.decode(ids + engine.generate([ids], 4)[0], skip_special_tokens=True)


# ---------------------------------------------------------------------------
# Refusals


def _raw(kind: str, rows: int, cols: int):
    n, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return (np.zeros((rows, cols // n * size), np.uint8), kind)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (dict(extra_metadata={"llama.expert_count": ("add_uint32", 8)}), ConfigError, r"llama\.expert_count: not supp"),
        (
            dict(extra_metadata={"llama.rope.scaling.type": ("add_string", "yarn")}),
            ConfigError,
            r"llama\.rope\.scaling\.type: expected 'none' or 'linear'.*got 'yarn'",
        ),
        (dict(extra_tensors={"rope_freqs.weight": np.ones(32)}), ConfigError, r"'rope_freqs\.weight': per-dim"),
        (
            dict(num_key_value_heads=3),
            ConfigError,
            r"llama\.attention\.head_count_kv \(num_key_value_heads\): expected a divisor",
        ),
        (dict(extra_tensors={"blk.0.attn_foo.weight": np.ones(8)}), CheckpointError, r"'blk\.0\.attn_foo\.weight'"),
        (dict(extra_tensors={"blk.7.attn_norm.weight": np.ones(256)}), CheckpointError, r"block_count is 2"),
        (
            dict(extra_tensors={"blk.0.attn_q.bias": _raw("IQ4_NL", 1, 256)}),
            CheckpointError,
            r"'blk\.0\.attn_q\.bias': type IQ4_NL is not supported; expected one of F32, F16, BF16, Q8_0",
        ),
    ],
)
def test_refused(tmp_path, kw, error, message):
    path, _, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "F32", **kw)
    with pytest.raises(error, match=message):
        cupaged.Engine.from_pretrained(path, like=LIKE)


def test_refused_architecture(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "g.gguf", "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"g\.gguf: general\.architecture: expected one of 'llama'.*got 'gpt2'"):
        cupaged.Engine.from_pretrained(tmp_path / "g.gguf", like=LIKE)


def test_broken_files(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointError, match=r"not a GGUF file: expected the magic b'GGUF', got b'PK"):
        cupaged.Engine.from_pretrained(tmp_path / "x.gguf", like=LIKE)
    path, _, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "F32")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: not a readable GGUF file"):
        cupaged.Engine.from_pretrained(tmp_path / "cut.gguf", like=LIKE)
    # a folder holding only a .gguf says to pass the file
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text("{}")
    (tmp_path / "f" / "m.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"found m\.gguf: pass the \.gguf file itself"):
        cupaged.engine.Checkpoint.from_folder(tmp_path / "f")


def test_no_gguf_package(tmp_path, monkeypatch):
    path, _, _ = write_random_gguf(tmp_path / "m.gguf", "llama", "F32")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(SetupError, match=r"needs the gguf package: pip install 'cupaged\[gguf\]'"):
        GGUFFile(path)
