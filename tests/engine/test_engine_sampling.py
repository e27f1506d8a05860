"""Engine.generate(..., sampling=SamplingParams(...)) on a tiny random Llama
checkpoint (CPU backend): temperature 0 is the greedy output, seeded draws
repeat alone and among other requests (another bucket, another slot), a list
gives each prompt its own parameters, logprobs against a float64 log-softmax
of the logits, penalised greedy against the float64 penalties, and a bad
sampling argument raises naming it."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError, SamplingParams
from cupaged.testing import reference, write_random_checkpoint

LIKE = np.zeros(1, np.float32)
# std 1.0: logits spread enough that sampled and greedy outputs differ
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", std=1.0)
    return cupaged.Engine.from_pretrained(folder, like=LIKE, max_batch=4, prefill_chunk=16, readback_every=4)


def test_temperature_zero_is_greedy(engine):
    greedy = engine.generate(PROMPTS, 6, stop_token_ids=())
    assert engine.generate(PROMPTS, 6, stop_token_ids=(), sampling=SamplingParams(temperature=0.0)) == greedy
    assert engine.generate(PROMPTS, 6, stop_token_ids=(), sampling=[SamplingParams.greedy()] * 4) == greedy


def test_seeded_draws_repeat_alone_and_in_a_batch(engine):
    sp = SamplingParams(temperature=1.5, top_k=20, seed=1234)
    alone = engine.generate([PROMPTS[1]], 8, stop_token_ids=(), sampling=sp)[0]
    assert engine.generate([PROMPTS[1]], 8, stop_token_ids=(), sampling=sp)[0] == alone
    others = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2)]
    # in a batch of 3 (bucket 4), in another slot, next to other parameters
    batch = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], 8, stop_token_ids=(), sampling=others + [sp])
    assert batch[2] == alone
    # another seed draws differently; top_k 1 is greedy
    greedy = engine.generate([PROMPTS[1]], 8, stop_token_ids=())[0]
    assert alone != greedy
    other = SamplingParams(temperature=1.5, top_k=20, seed=6)
    assert engine.generate([PROMPTS[1]], 8, stop_token_ids=(), sampling=other)[0] != alone
    top1 = SamplingParams(temperature=1.5, top_k=1, seed=6)
    assert engine.generate([PROMPTS[1]], 8, stop_token_ids=(), sampling=top1)[0] == greedy


def test_penalised_greedy_against_reference(engine):
    # temperature 0 with penalties: each token is the argmax of the step's
    # raw logits penalised by the float64 reference (prompt as context, the
    # tokens generated before it as counts)
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.9)
    prompt = [5, 5, 6, 55, 243]
    toks, logits = engine.generate([prompt], 10, stop_token_ids=(), sampling=sp, return_logits=True)
    V = engine.config.vocab
    ctx = np.zeros((1, V), bool)
    ctx[0, prompt] = True
    gen = np.zeros((1, V), np.int64)
    r32 = [np.array([np.float32(v)], np.float64) for v in (1.8, 0.7, 0.9)]
    for t, row in zip(toks[0], logits[0]):
        pen = reference.apply_penalties(row[None], ctx, gen, *r32)
        assert t == int(pen.argmax()), (t, pen.argmax())
        gen[0, t] += 1
    assert toks[0] != engine.generate([prompt], 10, stop_token_ids=())[0]


def test_logprobs_against_reference(engine):
    sp = SamplingParams(temperature=1.0, seed=7, logprobs=0)
    toks, logits = engine.generate([PROMPTS[0]], 5, stop_token_ids=(), sampling=sp, return_logits=True)
    lps = [c.logprobs for c in toks]
    assert len(lps[0]) == len(toks[0]) == 5
    assert [list(d) for d in lps[0]] == [[t] for t in toks[0]]  # the drawn token only
    drawn = [d[t] for d, t in zip(lps[0], toks[0])]
    np.testing.assert_allclose(drawn, reference.log_softmax_at(logits[0], toks[0]), atol=1e-5)
    toks2 = engine.generate([PROMPTS[0], PROMPTS[3]], 5, stop_token_ids=(), sampling=[sp, SamplingParams(seed=1)])
    lps2 = [c.logprobs for c in toks2]
    assert toks2[0] == toks[0] and lps2[1] is None
    again = [d[t] for d, t in zip(lps2[0], toks2[0])]
    np.testing.assert_allclose(again, drawn, atol=1e-4)  # (batch-1 vs batch-2 logits differ in rounding)


@pytest.mark.parametrize("max_new", [1, 6])
def test_top_logprobs_against_reference(engine, max_new):
    # logprobs=4: per token the drawn one, then the 4 most likely (the
    # prefill's first token and the decode graph's), vs a float64 log-softmax
    sp = SamplingParams(temperature=2.0, seed=3, logprobs=4)
    toks, logits = engine.generate([PROMPTS[1]], max_new, stop_token_ids=(), sampling=sp, return_logits=True)
    lps = [c.logprobs for c in toks]
    assert len(lps[0]) == len(toks[0]) == max_new
    ids, want = reference.top_logprobs(logits[0], 4)
    for t, d, row_ids, row_lp, row in zip(toks[0], lps[0], ids, want, logits[0]):
        assert list(d) == [t] + [i for i in row_ids.tolist() if i != t]
        for tok, lp in zip(row_ids, row_lp):
            assert abs(d[int(tok)] - lp) < 1e-5
        assert abs(d[t] - reference.log_softmax_at(row[None], [t])[0]) < 1e-5


def test_bad_sampling_argument(engine):
    # (SamplingParams' own checks: tests/ops/test_sampling_params.py)
    with pytest.raises(PagedAttentionError, match=r"sampling: expected one SamplingParams per prompt \(4\), got 2"):
        engine.generate(PROMPTS, 3, sampling=[SamplingParams()] * 2)
    with pytest.raises(PagedAttentionError, match=r"sampling\[1\]: expected a SamplingParams, got dict"):
        engine.generate(PROMPTS[:2], 3, sampling=[SamplingParams(), {"temperature": 1.0}])
    with pytest.raises(PagedAttentionError, match="sampling: expected a SamplingParams, a list"):
        engine.generate(PROMPTS, 3, sampling={"temperature": 1.0})
