"""Small random Hugging Face-style checkpoints written with NumPy alone (no
torch, no network): a ``config.json`` and a ``model.safetensors`` with the
tensor names and shapes transformers uses for each supported architecture.
For the README's example, the engine benchmark and the checkpoint tests;
the comparisons with transformers use its own ``save_pretrained``.

    folder = write_random_checkpoint(tmp, "LlamaForCausalLM", hidden_size=128)
    engine = cupaged.Engine.from_pretrained(folder, like=np.zeros(1, np.float32))
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

#: NumPy dtype names -> safetensors dtype names.
_ST_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def save_safetensors(path: str | os.PathLike[str], tensors: dict, metadata: dict | None = None) -> Path:
    """Write ``tensors`` (name -> NumPy array) as a safetensors file: an
    8-byte little-endian header length, the JSON header (padded with spaces
    to 8 bytes), then each tensor's bytes in header order."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, offset = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {
            "dtype": _ST_NAMES[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(b)],
        }
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for b in blobs:
            fh.write(b)
    return path


def save_raw_safetensors(path: str | os.PathLike[str], header: dict | str | bytes, data: bytes = b"") -> Path:
    """Write a safetensors file with exactly this header (a dict, JSON-encoded
    as is, or the header's bytes / text) and ``data``: for broken files."""
    if isinstance(header, dict):
        header = json.dumps(header)
    text = header.encode() if isinstance(header, str) else header
    path = Path(path)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def tiny_config(architecture: str = "LlamaForCausalLM", **overrides: Any) -> dict:
    """A small config.json dict of ``architecture`` (2 layers, hidden 64,
    vocab 256), with ``overrides`` applied."""
    cfg = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES.get(architecture, "llama"),
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if architecture.startswith("Deepseek"):
        cfg.update(
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=cfg["num_hidden_layers"],
            n_routed_experts=None,
        )
    cfg.update(overrides)
    if architecture.startswith("Deepseek") and "first_k_dense_replace" not in overrides:
        cfg["first_k_dense_replace"] = cfg["num_hidden_layers"]
    return cfg


def random_weights(config: dict, *, seed: int = 0, std: float = 0.2, dtype: DTypeLike = "float32") -> dict:
    """Random tensors (normal, ``std``; norm weights around 1) under the
    names and shapes transformers gives ``config``'s architecture."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype in ("bfloat16", "bf16") else np.dtype(dtype)
    arch = config["architectures"][0]
    H, V, F, L = config["hidden_size"], config["vocab_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]

    def w(*shape):
        return (rng.standard_normal(shape) * std).astype(np.float32).astype(dt)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32).astype(dt)

    out = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": norm(H)}
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(V, H)
    for i in range(L):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[p + "input_layernorm.weight"] = norm(H)
        out[p + "post_attention_layernorm.weight"] = norm(H)
        for name, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
            out[p + f"mlp.{name}.weight"] = w(*shape)
            if config.get("mlp_bias"):
                out[p + f"mlp.{name}.bias"] = w(shape[0])
        if arch.startswith("Deepseek"):
            R, P, Dn, Dv = (config[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
            ql = config.get("q_lora_rank")
            bias = config.get("attention_bias", False)
            if ql:
                out[a + "q_a_proj.weight"] = w(ql, H)
                if bias:
                    out[a + "q_a_proj.bias"] = w(ql)
                out[a + "q_a_layernorm.weight"] = norm(ql)
                out[a + "q_b_proj.weight"] = w(heads * (Dn + P), ql)
            else:
                out[a + "q_proj.weight"] = w(heads * (Dn + P), H)
            out[a + "kv_a_proj_with_mqa.weight"] = w(R + P, H)
            if bias:
                out[a + "kv_a_proj_with_mqa.bias"] = w(R + P)
            out[a + "kv_a_layernorm.weight"] = norm(R)
            out[a + "kv_b_proj.weight"] = w(heads * (Dn + Dv), R)
            out[a + "o_proj.weight"] = w(H, heads * Dv)
            if bias:
                out[a + "o_proj.bias"] = w(H)
            continue
        kv = config.get("num_key_value_heads") or heads
        D = config.get("head_dim") or H // heads
        out[a + "q_proj.weight"] = w(heads * D, H)
        out[a + "k_proj.weight"] = w(kv * D, H)
        out[a + "v_proj.weight"] = w(kv * D, H)
        out[a + "o_proj.weight"] = w(H, heads * D)
        qkv_bias = arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and config.get("attention_bias"))
        if qkv_bias:
            out[a + "q_proj.bias"] = w(heads * D)
            out[a + "k_proj.bias"] = w(kv * D)
            out[a + "v_proj.bias"] = w(kv * D)
        if arch != "Qwen2ForCausalLM" and arch != "MistralForCausalLM" and config.get("attention_bias"):
            out[a + "o_proj.bias"] = w(H)
        if arch == "Qwen3ForCausalLM":
            out[a + "q_norm.weight"] = norm(D)
            out[a + "k_norm.weight"] = norm(D)
    return out


def write_random_checkpoint(
    folder: str | os.PathLike[str],
    architecture: str = "LlamaForCausalLM",
    *,
    seed: int = 0,
    std: float = 0.2,
    dtype: DTypeLike = "float32",
    **overrides: Any,
) -> Path:
    """``folder`` (created) with ``tiny_config(architecture, **overrides)``
    as config.json and random weights as model.safetensors. Returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(architecture, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_safetensors(folder / "model.safetensors", random_weights(cfg, seed=seed, std=std, dtype=dtype))
    return folder
