"""Text in, text out (cupaged/engine/text.py): the chat template rendered as
transformers renders it, streamed text equal to the whole decode with no
broken character, Completion as a list with its finish reason."""

from __future__ import annotations

import json

import pytest

from cupaged.engine.text import Completion, Detokenizer, TextCodec, finish_reason
from cupaged.errors import CheckpointError, ConfigError

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package (pip install 'cupaged[tokenizers]')")
pytest.importorskip("jinja2", reason="jinja2 renders chat templates")

CORPUS = [
    "The capital of France is Paris.",
    "Le café est très bon, naïve façade.",
    "日本語のテキスト と emoji 🙂 too",
    "hello world, hello tokens",
] * 4

# ChatML with a default system message (SmolLM2-Instruct's shape), a loop
# control and a raise_exception branch.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Blocks on their own indented lines (trim_blocks / lstrip_blocks matter), tojson, the eos variable.
INDENTED = """{% for message in messages %}
    {% if message.role == 'user' %}
  user says {{ message.content | tojson }}
    {% else %}
  {{ message.role }}: {{ message.content }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
assistant:
{% endif %}"""


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE tokenizer trained on CORPUS (multi-byte characters span tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture
def folder(tmp_path, byte_bpe):
    byte_bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": None, "eos_token": "<|im_end|>"})
    )
    return tmp_path


@pytest.mark.parametrize("template", [CHATML, INDENTED], ids=["chatml", "indented"])
def test_chat_template_renders_and_tokenizes_as_transformers(folder, byte_bpe, template):
    transformers = pytest.importorskip("transformers", reason="transformers (the reference for chat templates)")
    codec = TextCodec.from_folder(folder)
    codec = TextCodec(codec.tokenizer, template, codec.special_tokens)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_bpe, eos_token="<|im_end|>")
    hf.chat_template = template
    for messages in (
        "What is the capital of France?",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour, café?"}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "日本"},
        ],
    ):
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        want_text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert codec.render_chat(messages) == want_text
        want_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert codec.encode(messages, chat=True) == list(want_ids)
    assert codec.encode("hello world") == hf("hello world")["input_ids"]


def test_template_errors_are_config_errors(folder, byte_bpe):
    codec = TextCodec.from_folder(folder)
    with pytest.raises(Exception, match="unknown role tool"):
        codec.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ConfigError, match=r"messages\[0\]: expected"):
        codec.render_chat([{"content": "no role"}])
    with pytest.raises(ConfigError, match="chat: expected a model with a chat template"):
        TextCodec(byte_bpe).encode("hi", chat=True)
    with pytest.raises(ConfigError, match="chat_template: expected a Jinja2 template"):
        TextCodec(byte_bpe, "{% for %}").render_chat("hi")


def test_folder_without_tokenizer_and_bad_config(tmp_path, byte_bpe):
    assert TextCodec.from_folder(tmp_path) is None
    byte_bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not readable JSON"):
        TextCodec.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": 3}')
    with pytest.raises(CheckpointError, match="chat_template: expected a string, got int"):
        TextCodec.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a readable tokenizer.json"):
        TextCodec.from_folder(tmp_path)


@pytest.mark.parametrize("text", CORPUS[:4])
def test_streamed_text_is_the_whole_decode_and_never_a_broken_character(folder, text):
    codec = TextCodec.from_folder(folder)
    prompt = codec.encode("The capital")
    ids = codec.encode(text)
    assert any("\ufffd" in codec.decode([t]) for t in ids) or text.isascii()  # the case is real
    d = Detokenizer(codec, prompt)
    pieces = [d.push([t]) for t in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    whole = codec.decode(prompt + ids)
    assert codec.decode(prompt) + "".join(pieces) == whole
    assert d.text == "".join(pieces)


def test_completion_is_a_list_with_its_reason():
    c = Completion(
        [5, 6, 2],
        prompt_index=1,
        prompt_ids=[1, 2],
        text="ab",
        finish_reason="stop",
        logprobs=[{5: -0.1}, {6: -1}, {2: -2}],
    )
    assert c == [5, 6, 2] and isinstance(c, list) and c.token_ids == [5, 6, 2]
    assert (
        c.prompt_index == 1
        and c.text == "ab"
        and c.finish_reason == "stop"
        and c.logprobs == [{5: -0.1}, {6: -1.0}, {2: -2.0}]
    )
    assert "finish_reason='stop'" in repr(c)
    assert finish_reason([5, 6, 2], {2}, 8) == "stop"
    assert finish_reason([5, 6, 7], {2}, 3) == "length"
    assert finish_reason([], {2}, 3) == "length"
