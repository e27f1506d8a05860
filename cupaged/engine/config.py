"""Model configs: a Hugging Face ``config.json`` (a dict) checked per
architecture and normalized into ``ModelConfig``.

Each supported architecture has its own check of the fields it needs
(``ARCHITECTURES``); a field it does not implement, or a value it cannot
run, raises ``ConfigError`` naming the architecture, the field, what is
supported and what came, before any weight is read. Both config formats are
read: transformers 5's ``rope_parameters`` and the older top-level
``rope_theta`` / ``rope_scaling``.

What is refused (everything else that affects the forward pass is
implemented exactly):

* every architecture: ``hidden_act`` other than silu (SwiGLU MLP), a
  ``quantization_config`` (fp8 / int checkpoints), rope types other than
  default / linear / llama3 / yarn (``dynamic``, ``longrope``, ...), a
  ``partial_rotary_factor`` below 1, an odd rotary dim, query heads that are
  not a multiple of the KV heads;
* (Mistral / Qwen2 / Qwen3 sliding windows run as transformers runs them:
  each layer's window, ``ModelConfig.layer_windows``, is the attention's
  ``window``, and sequences are not capped at it;)
* DeepSeek-V2 / V3: mixture-of-experts layers (layers at or past
  ``first_k_dense_replace``); the multi-token-prediction layers of V3
  checkpoints are not run (their weights are ignored), as in transformers'
  ``generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..ops.advance import MAX_STOP_IDS

#: Rope types the engine computes tables for (``rope.py``).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: model_type -> architecture, for configs without ``architectures``.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of ``dim`` dims: ``type`` (one of ROPE_TYPES),
    ``theta`` (base) and the type's parameters (factor, ...), as read from
    the config (``rope.py`` turns it into tables)."""

    type: str
    theta: float
    dim: int
    params: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs of a model, from its config.json.

    ``family``: "dense" (Llama, Mistral, Qwen2, Qwen3: GQA attention) or
    "mla" (DeepSeek-V2/V3: multi-head latent attention). Sizes use the
    transformers names' meaning: ``heads`` query heads, ``kv_heads`` KV
    heads, ``head_dim``, ``ffn`` (intermediate size). MLA: ``q_lora_rank``
    (None: a plain q projection), ``kv_lora_rank`` (the latent R),
    ``qk_nope_dim``, ``qk_rope_dim`` (the rotary P), ``v_head_dim``;
    ``rope_interleave``: the checkpoint's rotary dims are interleaved pairs.
    ``scale``: the attention softmax scale. ``max_len``: the longest
    sequence (prompt and generated tokens) the model allows here.
    ``sliding_window``: the configured window (None: none);
    ``layer_windows``: each layer's (None: full attention), the ``window``
    its attention runs with (dense family; empty for MLA).
    """

    architecture: str
    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    max_len: int
    rope: RopeSpec
    scale: float
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    latent_eps: float = 1e-6
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


# ---------------------------------------------------------------------------
# Field readers: each names the architecture and the field in its error


class _Fields:
    def __init__(self, arch: str, raw: dict):
        self.arch, self.raw = arch, raw

    def error(self, name: str, expected: str, got) -> ConfigError:
        shown = "nothing (missing)" if got is _MISSING else repr(got)
        return ConfigError(f"config.json: {self.arch}: {name}: expected {expected}, got {shown}")

    def int(self, name: str, lo: int = 1, default=None, *, optional: bool = False):
        v = self.raw.get(name, _MISSING)
        if v is _MISSING or v is None:
            if optional or default is not None:
                return default
            raise self.error(name, f"an integer >= {lo}", v)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self.error(name, f"an integer >= {lo}", v)
        return v

    def float(self, name: str, default=None, *, positive: bool = True) -> float:
        v = self.raw.get(name, _MISSING)
        if v is _MISSING or v is None:
            if default is not None:
                return default
            raise self.error(name, "a number", v)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise self.error(name, "a positive number" if positive else "a number", v)
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.raw.get(name, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.error(name, "true or false", v)
        return v

    def equals(self, name: str, allowed, default, why: str):
        v = self.raw.get(name, default)
        if v is None:
            v = default
        if v not in allowed:
            raise ConfigError(
                f"config.json: {self.arch}: {name}: {why}; expected {' or '.join(map(repr, allowed))}, got {v!r}"
            )
        return v


_MISSING = object()


def _architecture(raw: dict, hint: str | None) -> str:
    if hint is not None:
        return hint
    archs = raw.get("architectures")
    if isinstance(archs, (list, tuple)) and archs:
        return str(archs[0])
    mt = raw.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ConfigError(
        f"config.json: architectures: expected one of {', '.join(ARCHITECTURES)} (or a known "
        f"model_type: {', '.join(MODEL_TYPES)}), got architectures={archs!r}, model_type={mt!r}"
    )


def token_ids(name: str, value: Any, error: type[Exception] = ConfigError) -> tuple[int, ...]:
    """Stop (eos) token ids: None (none), an int, or a sequence of ints >= 0,
    returned distinct and in order; at most ``MAX_STOP_IDS`` of them (the
    decode graph's stop list). Anything else raises ``error`` naming
    ``name``."""
    if value is None:
        return ()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    one = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    items = [value] if one else value
    if not one and (isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__")):
        raise error(f"{name}: expected a token id or a list of token ids (ints >= 0), got {value!r}"[:300])
    items = list(items)
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in items):
        raise error(f"{name}: expected a token id or a list of token ids (ints >= 0), got {value!r}"[:300])
    ids = tuple(dict.fromkeys(int(t) for t in items))
    if any(t < 0 for t in ids):
        raise error(f"{name}: expected token ids >= 0, got {list(ids)}"[:300])
    if len(ids) > MAX_STOP_IDS:
        raise error(
            f"{name}: expected at most {MAX_STOP_IDS} distinct token ids (the decode graph's stop list), got {len(ids)}"
        )
    return ids


def _eos(raw: dict) -> tuple:
    return token_ids("config.json: eos_token_id", raw.get("eos_token_id"))


def _common(f: _Fields) -> dict:
    raw = f.raw
    if raw.get("quantization_config"):
        q = raw["quantization_config"]
        kind = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise ConfigError(
            f"config.json: {f.arch}: quantization_config: quantized checkpoints ({kind!r}) are not "
            f"supported; expected float32 / float16 / bfloat16 weights"
        )
    f.equals("hidden_act", ("silu", "swish"), "silu", "the MLP is SwiGLU (silu(gate) * up)")
    vocab = f.int("vocab_size")
    hidden = f.int("hidden_size")
    layers = f.int("num_hidden_layers")
    heads = f.int("num_attention_heads")
    ffn = f.int("intermediate_size")
    eps = f.float("rms_norm_eps", 1e-6)
    max_pos = f.int("max_position_embeddings", 2, default=2048)
    return dict(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        ffn=ffn,
        eps=eps,
        max_pos=max_pos,
        tie=f.bool("tie_word_embeddings", False),
    )


def _rope(f: _Fields, dim: int, max_pos: int) -> RopeSpec:
    """The rotary parameters of either config format (transformers 5's
    ``rope_parameters``, or ``rope_theta`` + ``rope_scaling``)."""
    raw = f.raw
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise f.error("rope_parameters", "a dict", params)
    where = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"config.json: {f.arch}: {where}: per-layer-type rope parameters are not supported; expected one dict"
        )
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: {f.arch}: {where}.rope_type: expected one of "
            f"{', '.join(map(repr, ROPE_TYPES))}, got {kind!r}"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise f.error(f"{where}.rope_theta", "a positive number", theta)
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if prf is not None and prf != 1 and prf != 1.0:
        raise ConfigError(
            f"config.json: {f.arch}: partial_rotary_factor: partial rotary embeddings are not "
            f"supported; expected 1.0, got {prf!r}"
        )
    if dim % 2:
        raise ConfigError(f"config.json: {f.arch}: the rotary dim must be even, got {dim}")

    def num(name, default=None, positive=True):
        v = params.get(name, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
            raise f.error(f"{where}.{name}", "a positive number", v)
        return float(v)

    out: dict = {}
    if kind == "linear":
        out["factor"] = num("factor")
        if out["factor"] is None:
            raise f.error(f"{where}.factor", "a positive number", _MISSING)
    elif kind == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            out[name] = num(name)
            if out[name] is None:
                raise f.error(f"{where}.{name}", "a positive number", _MISSING)
        if out["high_freq_factor"] == out["low_freq_factor"]:
            raise f.error(f"{where}.high_freq_factor", "a value other than low_freq_factor", params["high_freq_factor"])
        out["original_max_position_embeddings"] = num(
            "original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos)
        )
    elif kind == "yarn":
        out["original_max_position_embeddings"] = num(
            "original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos)
        )
        out["factor"] = num("factor")
        for name in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            out[name] = num(name, positive=False)
        t = params.get("truncate", True)
        if not isinstance(t, bool):
            raise f.error(f"{where}.truncate", "true or false", t)
        out["truncate"] = t
    return RopeSpec(kind, float(theta), dim, out, max_pos)


def _sliding(f: _Fields, max_pos: int, *, flag: str | None) -> int | None:
    """The sliding window, when one applies (Mistral: ``sliding_window``;
    Qwen2/3: only with ``use_sliding_window``): the query at position p sees
    positions p - window + 1 .. p (transformers' mask, the attention's
    ``window``)."""
    if flag is not None and not f.bool(flag, False):
        return None
    w = f.int("sliding_window", 1, optional=True)
    return w


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_windows(f: _Fields, layers: int, window: int | None, *, per_layer: bool) -> tuple:
    """Each layer's window (None: full attention), as transformers runs
    them: Mistral every layer (``per_layer`` False); Qwen2 / Qwen3 the layers
    config.json's ``layer_types`` marks "sliding_attention", else those at or
    past ``max_window_layers`` (transformers' default 28)."""
    if window is None:
        return (None,) * layers
    if not per_layer:
        return (window,) * layers
    types = f.raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
            raise f.error("layer_types", f"a list of {layers} of {', '.join(map(repr, _LAYER_TYPES))}", types)
        return tuple(window if t == "sliding_attention" else None for t in types)
    first = f.int("max_window_layers", 0, default=28)
    return tuple(window if i >= first else None for i in range(layers))


# ---------------------------------------------------------------------------
# Per-architecture checks


def _dense(f: _Fields, *, qkv_bias=None, qk_norm=False, sliding_flag=None, attention_bias_field=True) -> ModelConfig:
    c = _common(f)
    heads = c["heads"]
    kv_heads = f.int("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ConfigError(
            f"config.json: {f.arch}: num_key_value_heads: expected a divisor of num_attention_heads "
            f"({heads}), got {kv_heads}"
        )
    head_dim = f.int("head_dim", default=None, optional=True)
    if head_dim is None:
        if c["hidden"] % heads:
            raise ConfigError(
                f"config.json: {f.arch}: hidden_size ({c['hidden']}) is not a multiple of "
                f"num_attention_heads ({heads}) and head_dim is not set"
            )
        head_dim = c["hidden"] // heads
    rope = _rope(f, head_dim, c["max_pos"])
    bias = f.bool("attention_bias", False) if attention_bias_field else False
    window = _sliding(f, c["max_pos"], flag=sliding_flag)
    return ModelConfig(
        architecture=f.arch,
        family="dense",
        vocab=c["vocab"],
        hidden=c["hidden"],
        layers=c["layers"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=c["ffn"],
        eps=c["eps"],
        max_len=c["max_pos"],
        rope=rope,
        scale=head_dim**-0.5,
        tie_embeddings=c["tie"],
        qkv_bias=bias if qkv_bias is None else qkv_bias,
        o_bias=bias,
        mlp_bias=f.bool("mlp_bias", False),
        qk_norm=qk_norm,
        sliding_window=window,
        layer_windows=_layer_windows(f, c["layers"], window, per_layer=sliding_flag is not None),
        eos_token_ids=_eos(f.raw),
        raw=f.raw,
    )


def _llama(f: _Fields) -> ModelConfig:
    """Llama 2/3/3.1+: rope_theta, linear / llama3 / yarn rope scaling, tied
    embeddings, optional attention and MLP biases, head_dim."""
    return _dense(f)


def _mistral(f: _Fields) -> ModelConfig:
    """Mistral: Llama's layers; a sliding window on every layer."""
    return _dense(f, qkv_bias=False, sliding_flag=None, attention_bias_field=False)


def _qwen2(f: _Fields) -> ModelConfig:
    """Qwen2: q/k/v projections with bias (o without); with
    use_sliding_window, a window on the layers of layer_types /
    max_window_layers."""
    return _dense(f, qkv_bias=True, sliding_flag="use_sliding_window", attention_bias_field=False)


def _qwen3(f: _Fields) -> ModelConfig:
    """Qwen3: per-head RMSNorm of q and k before RoPE; attention_bias on q/k/v/o."""
    return _dense(f, qk_norm=True, sliding_flag="use_sliding_window")


def _deepseek(f: _Fields, v3: bool) -> ModelConfig:
    """DeepSeek-V2 / V3 with dense MLP layers only: MLA with or without q
    LoRA, the decoupled rotary part (interleaved pairs: V2 always, V3 when
    rope_interleave), the softmax scale of the q/k head dims times yarn's
    mscale(factor, mscale_all_dim)^2 where configured."""
    c = _common(f)
    layers = c["layers"]
    first_dense = f.int("first_k_dense_replace", 0, default=3 if v3 else 0)
    if first_dense < layers:
        experts = f.raw.get("n_routed_experts")
        moe = f"{first_dense}..{layers - 1}" if first_dense < layers - 1 else f"{first_dense}"
        raise ConfigError(
            f"config.json: {f.arch}: first_k_dense_replace: layers {moe} of {layers} are mixture-of-experts layers "
            f"(first_k_dense_replace={first_dense}, n_routed_experts={experts}); MoE layers are not supported yet: "
            f"expected first_k_dense_replace >= num_hidden_layers ({layers}), every layer a dense MLP"
        )
    q_lora = f.int("q_lora_rank", 1, optional=True)
    kv_lora = f.int("kv_lora_rank")
    nope = f.int("qk_nope_head_dim")
    rope_dim = f.int("qk_rope_head_dim")
    v_dim = f.int("v_head_dim")
    interleave = f.bool("rope_interleave", True) if v3 else True
    rope = _rope(f, rope_dim, c["max_pos"])
    scale = (nope + rope_dim) ** -0.5
    if rope.type != "default":
        # transformers' yarn_apply_mscale: any non-default rope type with
        # mscale_all_dim scales the softmax by mscale(factor, mscale_all_dim)^2
        p = f.raw.get("rope_parameters") or f.raw.get("rope_scaling") or {}
        all_dim = p.get("mscale_all_dim") or 0
        if all_dim:
            factor = p.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)):
                raise f.error("rope_parameters.factor", "a number (yarn's mscale needs it)", factor)
            m = 1.0 if factor <= 1 else 0.1 * float(all_dim) * math.log(factor) + 1.0
            scale *= m * m
    return ModelConfig(
        architecture=f.arch,
        family="mla",
        vocab=c["vocab"],
        hidden=c["hidden"],
        layers=layers,
        heads=c["heads"],
        kv_heads=1,
        head_dim=nope + rope_dim,
        ffn=c["ffn"],
        eps=c["eps"],
        max_len=c["max_pos"],
        rope=rope,
        scale=scale,
        tie_embeddings=c["tie"],
        qkv_bias=f.bool("attention_bias", False),
        o_bias=f.bool("attention_bias", False),
        mlp_bias=f.bool("mlp_bias", False) if not v3 else False,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_dim=nope,
        qk_rope_dim=rope_dim,
        v_head_dim=v_dim,
        rope_interleave=interleave,
        eos_token_ids=_eos(f.raw),
        raw=f.raw,
    )


#: Supported architectures and their checks.
ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "DeepseekV2ForCausalLM": lambda f: _deepseek(f, v3=False),
    "DeepseekV3ForCausalLM": lambda f: _deepseek(f, v3=True),
}


def parse_config(raw: dict, architecture: str | None = None) -> ModelConfig:
    """Check ``raw`` (a config.json dict) for its architecture
    (``architecture``, else ``raw["architectures"][0]``, else its
    ``model_type``) and return the normalized ModelConfig. Raises
    ConfigError naming the field on anything it cannot run."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: expected a JSON object, got {type(raw).__name__}")
    arch = _architecture(raw, architecture)
    check = ARCHITECTURES.get(arch)
    if check is None:
        raise ConfigError(f"config.json: architectures: expected one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    return check(_Fields(arch, raw))
