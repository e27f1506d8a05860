"""Rotary tables for the engine: inverse frequencies of each supported rope
type (default, linear, llama3, yarn) and their cos/sin tables.

The tables are computed once on the host, in float64, from the formulas of
transformers' ``modeling_rope_utils`` (the implementation the engine is
checked against), then stored as float32 ``[max_len, dim // 2]`` tables that
``ops.layers.rope`` reads by device position: exact up to that one
rounding. yarn's attention factor (transformers' ``attention_scaling``,
which multiplies cos and sin) is folded into the tables.
"""

from __future__ import annotations

import math

import numpy as np

from .config import RopeSpec


def inv_freq(spec: RopeSpec) -> np.ndarray:
    """float64 [dim // 2]: the inverse frequency of each rotary pair."""
    dim, base, p = spec.dim, spec.theta, spec.params
    exps = np.arange(0, dim, 2, dtype=np.float64) / dim
    freq = 1.0 / base**exps
    if spec.type == "default":
        return freq
    if spec.type == "linear":
        return freq / p["factor"]
    if spec.type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / freq
        out = np.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, out)
    if spec.type == "yarn":
        factor = _yarn_factor(spec)
        old = p["original_max_position_embeddings"]
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base**exps
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    raise ValueError(f"rope type {spec.type!r}")  # (config.py refuses other types)


def _yarn_factor(spec: RopeSpec) -> float:
    f = spec.params.get("factor")
    if f is None:
        return spec.max_position_embeddings / spec.params["original_max_position_embeddings"]
    return f


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(spec: RopeSpec) -> float:
    """The factor transformers multiplies cos and sin by (1 but for yarn)."""
    if spec.type != "yarn":
        return 1.0
    p = spec.params
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = _yarn_factor(spec)
    if p.get("mscale") and p.get("mscale_all_dim"):
        return _mscale(factor, p["mscale"]) / _mscale(factor, p["mscale_all_dim"])
    return _mscale(factor)


def tables(spec: RopeSpec, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos, sin [max_len, dim // 2] for positions 0 .. max_len - 1,
    times the attention factor."""
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq(spec)[None, :]
    af = attention_factor(spec)
    return (np.cos(angles) * af).astype(np.float32), (np.sin(angles) * af).astype(np.float32)
