"""cupaged.SamplingParams: vLLM's fields and defaults, every bad value raising
PagedAttentionError naming the field, and the device words it encodes
(cupaged.ops.sample.FIELDS)."""

import numpy as np
import pytest

from cupaged import PagedAttentionError, SamplingParams
from cupaged.ops import sample as ops
from cupaged.sampling import as_sampling


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None and not p.is_greedy
    assert SamplingParams.greedy().is_greedy
    assert not SamplingParams(temperature=0.0, repetition_penalty=1.2).is_greedy


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(temperature=-1.0), "temperature: expected a finite number in [0, 1e+30], got -1.0"),
        (dict(temperature=float("nan")), "temperature: expected a finite number in [0, 1e+30], got nan"),
        (dict(temperature=float("inf")), "temperature: expected a finite number"),
        (dict(temperature="hot"), "temperature: expected a number, got str"),
        (dict(temperature=True), "temperature: expected a number, got bool"),
        (dict(top_k=-2), "top_k: expected -1, 0 (off) or a count in 1..2147483647, got -2"),
        (dict(top_k=1.5), "top_k: expected -1, 0 (off) or a count in 1..2147483647, got float 1.5"),
        (dict(top_k=2**31), "top_k: expected -1, 0 (off)"),
        (dict(top_p=0.0), "top_p: expected a finite number in (0, 1], got 0.0"),
        (dict(top_p=1.5), "top_p: expected a finite number in (0, 1], got 1.5"),
        (dict(min_p=-0.1), "min_p: expected a finite number in [0, 1], got -0.1"),
        (dict(min_p=1.1), "min_p: expected a finite number in [0, 1]"),
        (dict(repetition_penalty=0.0), "repetition_penalty: expected a finite number in (0, 1e+30], got 0.0"),
        (dict(presence_penalty=3.0), "presence_penalty: expected a finite number in [-2, 2], got 3.0"),
        (dict(frequency_penalty=-2.5), "frequency_penalty: expected a finite number in [-2, 2], got -2.5"),
        (dict(seed=-1), "seed: expected None or an int in 0..18446744073709551615, got -1"),
        (dict(seed=2**64), "seed: expected None or an int in 0..18446744073709551615"),
        (dict(seed=1.0), "seed: expected None or an int in 0..18446744073709551615, got float 1.0"),
        (dict(logprobs=21), "logprobs: expected None or a count of top logprobs in 0..20, got 21"),
        (dict(logprobs=-1), "logprobs: expected None or a count of top logprobs in 0..20, got -1"),
        (dict(logprobs=1.0), "logprobs: expected None or a count of top logprobs in 0..20, got float 1.0"),
    ],
)
def test_bad_values_name_the_field(kw, message):
    with pytest.raises(PagedAttentionError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(message), str(e.value)


def test_words():
    p = SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=2**40 + 5)
    w = p.words()
    f = ops.FIELD
    assert w.dtype == np.uint32 and w.shape == (len(ops.FIELDS),)
    assert w[f["temperature"] : f["temperature"] + 1].view(np.float32)[0] == np.float32(0.7)
    assert w[f["top_k"]] == 0  # -1: off
    assert w[f["top_p"] : f["top_p"] + 1].view(np.float32)[0] == np.float32(0.9)
    assert w[f["repetition"] : f["repetition"] + 1].view(np.float32)[0] == np.float32(1.1)
    assert (int(w[f["seed_hi"]]) << 32 | int(w[f["seed_lo"]])) == 2**40 + 5
    assert w[f["step"]] == 0
    assert (w[f["logprobs"]], w[f["top_n"]]) == (0, 0)
    w5 = SamplingParams(logprobs=5).words()
    assert (w5[f["logprobs"]], w5[f["top_n"]]) == (1, 5)
    w0 = SamplingParams(logprobs=0).words()
    assert (w0[f["logprobs"]], w0[f["top_n"]]) == (1, 0)
    assert (p.words(seed=3)[f["seed_lo"]], p.words(seed=3)[f["seed_hi"]]) == (3, 0)
    # no seed: a random one per call
    q = SamplingParams()
    assert len({int(q.words()[f["seed_lo"]]) for _ in range(4)}) > 1


def test_as_sampling():
    a, b = SamplingParams(seed=1), SamplingParams(seed=2)
    assert as_sampling("sampling", None, 2) == [SamplingParams.greedy()] * 2
    assert as_sampling("sampling", a, 3) == [a, a, a]
    assert as_sampling("sampling", [a, b], 2) == [a, b]
    with pytest.raises(PagedAttentionError, match=r"sampling: expected one SamplingParams per prompt \(3\), got 2"):
        as_sampling("sampling", [a, b], 3)
    with pytest.raises(PagedAttentionError, match=r"sampling\[1\]: expected a SamplingParams, got dict"):
        as_sampling("sampling", [a, {}], 2)
    with pytest.raises(PagedAttentionError, match="sampling: expected a SamplingParams, a list of them"):
        as_sampling("sampling", "greedy", 2)
