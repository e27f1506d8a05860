"""Engine text in / text out (issue #23 item 3): string and chat prompts
through the folder's tokenizer, Completion results (text, finish reason),
stream_generate's events equal to generate's results, a stream left early
frees its pages; the loading and large-model notices."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import cupaged
from cupaged._runtime import progress
from cupaged.engine import engine as engine_mod
from cupaged.engine.checkpoint import Checkpoint
from cupaged.engine.text import Completion, TextCodec
from cupaged.errors import PagedAttentionError
from cupaged.testing import write_random_checkpoint

tokenizers = pytest.importorskip("tokenizers", reason="text in / out needs the tokenizers package")

CPU = np.zeros(1, np.float32)
TEMPLATE = "{% for m in messages %}w1 {{ m.content }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Llama (vocab 256, eos 3) with a word-level tokenizer: "wN" is token N."""
    f = write_random_checkpoint(tmp_path_factory.mktemp("text"), "LlamaForCausalLM", eos_token_id=3)
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(f / "tokenizer.json"))
    (f / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "w3"}))
    return f


@pytest.fixture(scope="module")
def engine(folder):
    return cupaged.Engine.from_pretrained(folder, like=CPU, max_batch=2, num_pages=64)


def _words(ids):
    return " ".join(f"w{t}" for t in ids)


def test_text_prompts_give_completions(engine):
    by_ids = engine.generate([[5, 6, 7], [9, 10]], 6, stop_token_ids=())
    got = engine.generate(["w5 w6 w7", [9, 10]], 6, stop_token_ids=())
    assert got == by_ids and all(isinstance(c, Completion) for c in got)
    assert [c.prompt_index for c in got] == [0, 1] and got[0].prompt_ids == [5, 6, 7]
    assert got[0].text == _words(by_ids[0]) and got[1].text == _words(by_ids[1])
    assert all(c.finish_reason == "length" and c.logprobs is None for c in got)


def test_finish_reason_stop(engine):
    greedy = engine.generate([[5, 6, 7]], 12, stop_token_ids=())[0]
    stop = greedy[2]
    got = engine.generate([[5, 6, 7]], 12, stop_token_ids=[stop])[0]
    assert got == greedy[: greedy.index(stop) + 1] and got.finish_reason == "stop"


def test_chat_prompts_use_the_template(engine):
    want = engine.generate([[1, 5, 6, 2, 3]], 4, stop_token_ids=())
    assert engine.generate(["w5 w6"], 4, chat=True, stop_token_ids=()) == want
    msgs = [{"role": "user", "content": "w5"}, {"role": "user", "content": "w6"}]
    want2 = engine.generate([[1, 5, 2, 1, 6, 2, 3]], 4, stop_token_ids=())
    assert engine.generate([msgs], 4, chat=True, stop_token_ids=()) == want2
    with pytest.raises(PagedAttentionError, match=r"prompts\[0\]: with chat=True expected a string"):
        engine.generate([[5, 6]], 4, chat=True)


def test_stream_events_add_up_to_generate(engine):
    prompts = ["w5 w6 w7", [9, 10], "w11"]
    want = engine.generate(prompts, 9, stop_token_ids=())
    ids = [[] for _ in prompts]
    text = ["" for _ in prompts]
    finished = {}
    for ev in engine.stream_generate(prompts, 9, stop_token_ids=()):
        assert ev.index not in finished
        ids[ev.index] += ev.token_ids
        text[ev.index] += ev.text
        if ev.finished is not None:
            finished[ev.index] = ev.finished
    assert ids == want and [finished[i] for i in range(3)] == want
    assert [t.strip() for t in text] == [c.text for c in want]
    assert all(finished[i].finish_reason == "length" for i in range(3))


def test_leaving_a_stream_early_frees_its_pages(engine):
    free = engine.cache.num_free_pages
    stream = engine.stream_generate(["w5 w6 w7", "w8"], 20, stop_token_ids=())
    first = next(stream)
    assert first.token_ids
    stream.close()  # as a `break` out of the loop does
    assert engine.cache.num_free_pages == free
    assert engine.generate([[5, 6, 7]], 3, stop_token_ids=()) == engine.generate(["w5 w6 w7"], 3, stop_token_ids=())


def test_no_tokenizer_and_bad_tokenizer_option(folder, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    e = cupaged.Engine.from_pretrained(bare, like=CPU, max_batch=1, num_pages=16)
    assert e.text is None
    with pytest.raises(
        PagedAttentionError, match=r"prompts\[0\]: expected token ids \(ints\), got a str .*tokenizer.json"
    ):
        e.generate(["w5"], 2)
    e.text = TextCodec.from_folder(folder)  # a tokenizer of your own
    assert e.generate(["w5"], 2).__class__ is list and e.generate(["w5"], 2)[0].text is not None
    with pytest.raises(PagedAttentionError, match="tokenizer: expected a TextCodec, a model folder or a GGUF file"):
        cupaged.Engine.from_pretrained(bare, like=CPU, max_batch=1, num_pages=16, tokenizer=3)


def test_large_model_on_the_cpu_is_told_and_loading_is_counted(folder, monkeypatch, capsys):
    monkeypatch.setattr(progress, "_told", set())
    monkeypatch.setattr(engine_mod, "CPU_WARN_PARAMETERS", 1000)
    monkeypatch.delenv("CUPAGED_QUIET", raising=False)
    reads, gets = [], []
    real = progress.Progress.update
    monkeypatch.setattr(progress.Progress, "update", lambda self, n=1: reads.append(self.what) or real(self, n))
    real_get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, *a, **k: gets.append(a[0]) or real_get(self, *a, **k))
    cupaged.Engine.from_pretrained(folder, like=CPU, max_batch=1, num_pages=16)
    err = capsys.readouterr().err
    assert "cupaged: warning: a 0M-parameter model on the CPU backend runs at CPU speed" in err
    assert reads.count("loading weights") == len(gets) > 0  # a bar step per tensor read
