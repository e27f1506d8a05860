"""``SamplingParams``: how one request draws its tokens (vLLM's names).

Sampling runs on the device inside the decode graph (``cupaged.ops.sample``:
per-slot parameter words, per-slot token counts, Philox4x32-10 keyed by the
request's seed and its step), so one graph serves requests with different
parameters and a request's tokens do not depend on its batch neighbours or
the batch's bucket.

    SamplingParams()                                   # greedy (temperature 0): the argmax
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    SamplingParams(temperature=1.0, top_k=50, min_p=0.05, repetition_penalty=1.1, logprobs=0)

Semantics (vLLM's, in its order): penalties on the logits (repetition over
prompt and generated tokens, presence and frequency over generated ones),
then temperature (0: greedy, penalties still applied), min-p, top-k, top-p
(ties at a top-k / top-p boundary are kept), then a draw. ``logprobs=n``
returns each drawn token's log-probability under the raw logits (vLLM's
default "raw" logprobs) and those of the n most likely tokens (at most
``MAX_LOGPROBS``, vLLM's default limit).
A request without a seed gets a random one.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from .errors import PagedAttentionError
from .ops.sample import param_words

#: Seeds are 64-bit: 0 .. SEED_MAX.
SEED_MAX = (1 << 64) - 1
#: Largest top_k (the kernel's 32-bit counts).
TOP_K_MAX = (1 << 31) - 1
#: Most top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def _number(name: str, v, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise PagedAttentionError(f"{name}: expected a number, got {type(v).__name__}")
    f = float(v)
    ok = math.isfinite(f) and (f > lo if lo_open else f >= lo) and f <= hi
    if not ok:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise PagedAttentionError(f"{name}: expected a finite number in {span}, got {v!r}")
    return f


def _integer(name: str, v, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        shown = v if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else f"{type(v).__name__} {v!r}"
        raise PagedAttentionError(f"{name}: expected {what}, got {shown}")
    return int(v)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling (checked at construction; PagedAttentionError
    names the field).

    temperature: >= 0; 0 is greedy. top_k: 0 or -1 for off, else >= 1.
    top_p: in (0, 1]. min_p: in [0, 1]. repetition_penalty: > 0 (1: off).
    presence_penalty, frequency_penalty: in [-2, 2] (0: off). seed: an int in
    0 .. 2**64 - 1, or None (a random one per request). logprobs: None (off)
    or n in 0..MAX_LOGPROBS (the drawn token's log-probability and the n
    most likely tokens' ones)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "temperature", _number("temperature", self.temperature, 0.0, 1e30))
        k = _integer("top_k", self.top_k, -1, TOP_K_MAX, f"-1, 0 (off) or a count in 1..{TOP_K_MAX}")
        set_(self, "top_k", k)
        set_(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        set_(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        set_(
            self, "repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0, 1e30, lo_open=True)
        )
        set_(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        if self.seed is not None:
            set_(self, "seed", _integer("seed", self.seed, 0, SEED_MAX, f"None or an int in 0..{SEED_MAX}"))
        if self.logprobs is not None:
            what = f"None or a count of top logprobs in 0..{MAX_LOGPROBS}"
            set_(self, "logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS, what))

    @classmethod
    def greedy(cls) -> "SamplingParams":
        """Temperature 0: the argmax of the (penalised) logits."""
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 and no penalty: exactly the engine's argmax."""
        return (
            self.temperature == 0.0
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )

    def words(self, seed: int | None = None) -> np.ndarray:
        """The device parameter words (``cupaged.ops.sample.FIELDS``) of this
        request with ``seed`` (default: its own, else a random one)."""
        s = self.seed if seed is None else seed
        if s is None:
            s = secrets.randbits(64)
        return param_words(
            temperature=self.temperature,
            top_k=max(0, self.top_k),
            top_p=self.top_p,
            min_p=self.min_p,
            repetition=self.repetition_penalty,
            presence=self.presence_penalty,
            frequency=self.frequency_penalty,
            seed=s,
            logprobs=self.logprobs is not None,
            top_n=self.logprobs or 0,
        )


def as_sampling(name: str, v, n: int) -> list[SamplingParams]:
    """``n`` SamplingParams from None (greedy for all), one SamplingParams
    (for all) or a list of ``n``."""
    if v is None:
        return [SamplingParams.greedy()] * n
    if isinstance(v, SamplingParams):
        return [v] * n
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise PagedAttentionError(f"{name}: expected one SamplingParams per prompt ({n}), got {len(v)}")
        for i, p in enumerate(v):
            if not isinstance(p, SamplingParams):
                raise PagedAttentionError(f"{name}[{i}]: expected a SamplingParams, got {type(p).__name__}")
        return list(v)
    raise PagedAttentionError(
        f"{name}: expected a SamplingParams, a list of them (one per prompt) or None, got {type(v).__name__}"
    )


__all__ = ["SamplingParams"]
