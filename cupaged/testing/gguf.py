"""Small random GGUF files for the tests (the ``gguf`` package's
``GGUFWriter``), and float64 NumPy references of the GGML block formats the
engine reads, written from llama.cpp's block layouts (``ggml-common.h``,
``dequantize_row_*`` in ``ggml-quants.c``) independently of the ``gguf``
package's dequantizer the engine uses.

    path, weights, config = write_random_gguf(tmp / "m.gguf", "llama", "Q4_1")
    # weights: transformers name -> float64 array [out, in], what the engine must load;
    # config: the equivalent config.json dict (write_reference_folder writes both as a model folder)

Quantized tensors are random raw blocks (every bit pattern of the quants,
scales drawn so the weights have about ``std``); F32 / F16 / BF16 tensors are
random values in that dtype. Norm weights are F32 (as llama.cpp writes them).
Llama's q / k weights (and biases) are written permuted as llama.cpp's
converter permutes them (``permute``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .checkpoints import save_safetensors, tiny_config

#: GGML block formats: name -> (values per block, bytes per block).
BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
#: Every tensor type the writer writes (and the engine reads).
TYPES = ("F32", "F16", "BF16", *BLOCKS)
#: GGUF architecture names -> transformers architectures.
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# The test vocabulary: the 256 byte-level symbols, three merges and a control token (the stop token).
_MERGES = ["Ġ t", "h e", "Ġt he"]
_CONTROL = "<|end|>"


def _f16(a) -> np.ndarray:
    """float64 values of little-endian f16 bytes [..., 2]."""
    return np.ascontiguousarray(a).view("<f2")[..., 0].astype(np.float64)


def dequantize_reference(blocks: np.ndarray, kind: str) -> np.ndarray:
    """float64 values [rows, cols] of GGML-quantized rows ``blocks``
    (uint8 [rows, cols / values per block * bytes per block])."""
    n, size = BLOCKS[kind]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, size)  # [rows, blocks, bytes]
    out = np.zeros(b.shape[:2] + (n,), np.float64)
    if kind == "Q8_0":  # d (f16), qs[32] (int8): x = d * q
        d = _f16(b[..., 0:2])
        q = b[..., 2:34].view(np.int8).astype(np.float64)
        out[:] = d[..., None] * q
    elif kind in ("Q4_0", "Q4_1"):  # d, (m,) qs[16]: x[j] = d * lo(qs[j]) (- 8 | + m), x[j + 16] from hi
        d = _f16(b[..., 0:2])
        start = 2 if kind == "Q4_0" else 4
        qs = b[..., start : start + 16].astype(np.int64)
        for j in range(16):
            lo, hi = qs[..., j] & 0xF, qs[..., j] >> 4
            if kind == "Q4_0":
                out[..., j], out[..., j + 16] = d * (lo - 8), d * (hi - 8)
            else:
                m = _f16(b[..., 2:4])
                out[..., j], out[..., j + 16] = d * lo + m, d * hi + m
    elif kind in ("Q5_0", "Q5_1"):  # d, (m,) qh (u32: bit j = 5th bit of value j), qs[16] as Q4
        d = _f16(b[..., 0:2])
        start = 2 if kind == "Q5_0" else 4
        qh = b[..., start : start + 4].astype(np.int64)
        high = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
        qs = b[..., start + 4 : start + 20].astype(np.int64)
        for j in range(16):
            lo = (qs[..., j] & 0xF) | (((high >> j) & 1) << 4)
            hi = (qs[..., j] >> 4) | (((high >> (j + 16)) & 1) << 4)
            if kind == "Q5_0":
                out[..., j], out[..., j + 16] = d * (lo - 16), d * (hi - 16)
            else:
                m = _f16(b[..., 2:4])
                out[..., j], out[..., j + 16] = d * lo + m, d * hi + m
    elif kind in ("Q4_K", "Q5_K"):  # d, dmin, scales[12] (8 x 6-bit scale and min), (qh[32],) qs[128]
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc = b[..., 4:16].astype(np.int64)
        qh = b[..., 16:48].astype(np.int64)  # (Q5_K: bit j of byte l = 5th bit of sub-block j's value l)
        qs = b[..., 16:144].astype(np.int64) if kind == "Q4_K" else b[..., 48:176].astype(np.int64)
        for j in range(8):  # sub-block j: values 32j .. 32j + 31
            if j < 4:
                scale, mn = sc[..., j] & 63, sc[..., j + 4] & 63
            else:
                scale = (sc[..., j + 4] & 0xF) | ((sc[..., j - 4] >> 6) << 4)
                mn = (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)
            for lane in range(32):
                byte = qs[..., 32 * (j // 2) + lane]
                nib = byte & 0xF if j % 2 == 0 else byte >> 4
                if kind == "Q5_K":
                    nib = nib | (((qh[..., lane] >> j) & 1) << 4)
                out[..., 32 * j + lane] = d * scale * nib - dmin * mn
    elif kind == "Q6_K":  # ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d
        ql, qh = b[..., 0:128].astype(np.int64), b[..., 128:192].astype(np.int64)
        sc = b[..., 192:208].view(np.int8).astype(np.float64)
        d = _f16(b[..., 208:210])
        for y in range(256):
            half, r = divmod(y, 128)
            k, lane = divmod(r, 32)
            lb = ql[..., 64 * half + lane + (32 if k in (1, 3) else 0)]
            low = lb & 0xF if k < 2 else lb >> 4
            high = (qh[..., 32 * half + lane] >> (2 * k)) & 3
            out[..., y] = d * sc[..., 8 * half + lane // 16 + 2 * k] * ((low | (high << 4)) - 32)
    else:
        raise ValueError(f"kind: expected one of {', '.join(BLOCKS)}, got {kind!r}")
    return out.reshape(rows, -1)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, std: float = 0.2) -> np.ndarray:
    """Random raw blocks of ``kind``: uint8 [rows, cols / n * bytes] whose
    values have about ``std`` (random quants, scales drawn for ``std``)."""
    n, size = BLOCKS[kind]
    if cols % n:
        raise ValueError(f"cols: expected a multiple of {kind}'s block of {n}, got {cols}")
    b = rng.integers(0, 256, size=(rows, cols // n, size), dtype=np.uint8)

    def put_f16(at: int, values) -> None:
        b[..., at : at + 2] = np.asarray(values, np.float16).reshape(rows, -1, 1).view(np.uint8)

    u = lambda lo, hi: rng.uniform(lo, hi, size=(rows, cols // n))  # noqa: E731
    if kind == "Q8_0":
        put_f16(0, u(0.5, 1.5) * std / 64)
    elif kind in ("Q4_0", "Q5_0"):
        put_f16(0, u(0.5, 1.5) * std / (4 if kind == "Q4_0" else 8))
    elif kind in ("Q4_1", "Q5_1"):
        put_f16(0, u(0.5, 1.5) * std / (4 if kind == "Q4_1" else 8))
        put_f16(2, -u(1.0, 2.0) * std)
    elif kind in ("Q4_K", "Q5_K"):
        put_f16(0, u(0.5, 1.5) * std / (128 if kind == "Q4_K" else 256))
        put_f16(2, u(0.5, 1.5) * std / 64)
    elif kind == "Q6_K":
        b[..., 192:208] = rng.integers(-64, 65, size=(rows, cols // n, 16)).astype(np.int8).view(np.uint8)
        put_f16(208, u(0.5, 1.5) * std / 512)
    return b.reshape(rows, -1)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q / k row permutation (convert_hf_to_gguf.py
    LlamaModel.permute): transformers' half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level symbol of each byte 0..255."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = bs[:]
    for byte in range(256):
        if byte not in bs:
            bs.append(byte)
            cs.append(256 + len(cs) - 188)
    symbol = dict(zip(bs, cs))
    return [chr(symbol[byte]) for byte in range(256)]


def vocabulary() -> list[str]:
    """The test files' tokens: the 256 byte-level symbols (in byte order), the merges' tokens, ``<|end|>``."""
    return [*_bytes_to_unicode(), "Ġt", "he", "Ġthe", _CONTROL]


#: GGUF tensor name stems -> transformers names (the writer's side of the mapping).
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_test_config(architecture: str = "llama", **overrides: Any) -> dict:
    """The config.json dict of the random GGUF files: 2 layers, hidden 256
    (a K-quant block), 4 / 2 heads of 64, ffn 512, vocab 260 (the test
    vocabulary; its last token ``<|end|>`` the eos), ``overrides`` applied."""
    cfg = tiny_config(
        ARCHS[architecture],
        vocab_size=len(vocabulary()),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=2.0**-17,  # (exact in the file's float32)
        rope_theta=10000.0,
        eos_token_id=len(vocabulary()) - 1,
    )
    cfg.update(overrides)
    return cfg


def write_random_gguf(
    path: str | os.PathLike[str],
    architecture: str = "llama",
    tensor_type: str = "Q8_0",
    *,
    seed: int = 0,
    std: float = 0.2,
    tie: bool = False,
    extra_metadata: dict | None = None,
    extra_tensors: dict | None = None,
    **overrides: Any,
) -> tuple[Path, dict[str, np.ndarray], dict]:
    """A random GGUF file of ``architecture`` (llama / qwen2 / qwen3) with
    its 2-D weights in ``tensor_type`` (norms F32), the test tokenizer
    (byte-level BPE) and stop token. Returns (path, weights: transformers name
    -> float64 [out, in] as the engine must load them, config.json dict).
    ``extra_metadata`` (key -> (writer method name, value)) and
    ``extra_tensors`` (GGUF name -> a float32 array, or (uint8 rows, GGML
    type name) for raw blocks) are added as given."""
    import gguf  # the optional `gguf` extra (the tests skip without it)

    path = Path(path)
    cfg = gguf_test_config(architecture, tie_word_embeddings=tie, **overrides)
    rng = np.random.default_rng(seed)
    H, F, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qkv_bias = architecture == "qwen2" or bool(cfg.get("attention_bias"))
    o_bias = architecture != "qwen2" and bool(cfg.get("attention_bias"))
    w = gguf.GGUFWriter(path, architecture)
    a = architecture
    w.add_uint32(f"{a}.block_count", L)
    w.add_uint32(f"{a}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", H)
    w.add_uint32(f"{a}.feed_forward_length", F)
    w.add_uint32(f"{a}.attention.head_count", heads)
    w.add_uint32(f"{a}.attention.head_count_kv", kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{a}.rope.freq_base", cfg["rope_theta"])
    w.add_uint32(f"{a}.rope.dimension_count", D)
    if a != "llama":
        w.add_uint32(f"{a}.attention.key_length", D)
        w.add_uint32(f"{a}.attention.value_length", D)
    w.add_uint32(f"{a}.vocab_size", V)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_token_list(vocabulary())
    w.add_token_types([1] * (V - 1) + [3])
    w.add_token_merges(_MERGES)
    w.add_uint32("tokenizer.ggml.eos_token_id", V - 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    for key, (method, value) in (extra_metadata or {}).items():
        getattr(w, method)(key, value)

    weights: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf: str, shape: tuple, *, norm: bool = False, n_head: int | None = None) -> None:
        kind = None
        raw: np.ndarray
        values: np.ndarray
        if len(shape) == 1:  # norms and biases: F32
            raw = (1.0 + 0.1 * rng.standard_normal(shape) if norm else std * rng.standard_normal(shape)).astype(
                np.float32
            )
            values = raw.astype(np.float64)
        elif tensor_type in BLOCKS:
            raw = random_blocks(tensor_type, shape[0], shape[1], rng, std)
            kind = gguf.GGMLQuantizationType[tensor_type]
            values = dequantize_reference(raw, tensor_type)
        else:
            v = (std * rng.standard_normal(shape)).astype(np.float32)
            if tensor_type == "BF16":
                bf = v.astype(ml_dtypes.bfloat16)
                raw, kind = bf.view(np.uint8).reshape(shape[0], -1), gguf.GGMLQuantizationType.BF16
                values = bf.astype(np.float64)
            else:
                raw = v.astype(np.float16) if tensor_type == "F16" else v
                values = raw.astype(np.float64)
        # the file holds llama.cpp's permuted rows; `weights` the transformers layout
        weights[hf] = _from_llama_cpp(values, n_head) if n_head else values
        w.add_tensor(gguf_name, np.ascontiguousarray(raw), raw_dtype=kind)

    put("token_embd.weight", "model.embed_tokens.weight", (V, H))
    put("output_norm.weight", "model.norm.weight", (H,), norm=True)
    if not tie:
        put("output.weight", "lm_head.weight", (V, H))
    for i in range(L):
        p, hp = f"blk.{i}.", f"model.layers.{i}."
        perm_q = heads if a == "llama" else None
        perm_k = kv if a == "llama" else None
        put(p + "attn_norm.weight", hp + "input_layernorm.weight", (H,), norm=True)
        put(p + "ffn_norm.weight", hp + "post_attention_layernorm.weight", (H,), norm=True)
        put(p + "attn_q.weight", hp + "self_attn.q_proj.weight", (heads * D, H), n_head=perm_q)
        put(p + "attn_k.weight", hp + "self_attn.k_proj.weight", (kv * D, H), n_head=perm_k)
        put(p + "attn_v.weight", hp + "self_attn.v_proj.weight", (kv * D, H))
        put(p + "attn_output.weight", hp + "self_attn.o_proj.weight", (H, heads * D))
        if qkv_bias:
            put(p + "attn_q.bias", hp + "self_attn.q_proj.bias", (heads * D,), n_head=perm_q)
            put(p + "attn_k.bias", hp + "self_attn.k_proj.bias", (kv * D,), n_head=perm_k)
            put(p + "attn_v.bias", hp + "self_attn.v_proj.bias", (kv * D,))
        if o_bias:
            put(p + "attn_output.bias", hp + "self_attn.o_proj.bias", (H,))
        if a == "qwen3":
            put(p + "attn_q_norm.weight", hp + "self_attn.q_norm.weight", (D,), norm=True)
            put(p + "attn_k_norm.weight", hp + "self_attn.k_norm.weight", (D,), norm=True)
        put(p + "ffn_gate.weight", hp + "mlp.gate_proj.weight", (F, H))
        put(p + "ffn_up.weight", hp + "mlp.up_proj.weight", (F, H))
        put(p + "ffn_down.weight", hp + "mlp.down_proj.weight", (H, F))
    for name, t in (extra_tensors or {}).items():
        if isinstance(t, tuple):  # (raw uint8 rows, GGML type name)
            w.add_tensor(name, np.ascontiguousarray(t[0]), raw_dtype=gguf.GGMLQuantizationType[t[1]])
        else:
            w.add_tensor(name, np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, weights, cfg


def _from_llama_cpp(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The transformers-layout tensor whose ``permute`` is ``rows`` (row r
    of the file is transformers' row ``permute(arange)[r]``)."""
    src = permute(np.arange(rows.shape[0]), n_head)
    out = np.empty_like(rows)
    out[src] = rows
    return out


def write_reference_folder(folder: str | os.PathLike[str], weights: dict, config: dict) -> Path:
    """A model folder (config.json, model.safetensors in float32) of the
    weights ``write_random_gguf`` returned: the same model as the file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_safetensors(folder / "model.safetensors", {k: v.astype(np.float32) for k, v in weights.items()})
    return folder
