"""``python -m cupaged generate`` on a random NumPy-written checkpoint: token
ids in and out, text through the folder's tokenizer.json (when the
tokenizers package is installed), the closing tokens/s line, and one-line
errors."""
from __future__ import annotations

import re

import numpy as np
import pytest

import cupaged
from cupaged.__main__ import main
from cupaged.testing import write_random_checkpoint

LINE = re.compile(r"prefill: (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\); decode: (\d+) tokens in [\d.]+ s "
                  r"\([\d.]+ tokens/s, (\d+) graph launches\)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("cli"), "Qwen3ForCausalLM", eos_token_id=None)


def test_generate_token_ids(folder, capsys):
    assert main(["generate", "--model", str(folder), "--prompt", "5 6 7 8", "--max-new-tokens", "10", "--cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].startswith("Qwen3ForCausalLM on the cpu backend: 2 layers")
    ids = [int(t) for t in lines[1].split()]
    engine = cupaged.Engine.from_pretrained(folder, like=np.zeros(1, np.float32), max_batch=1)
    assert ids == engine.generate([[5, 6, 7, 8]], 10)[0]
    m = LINE.search(out)
    assert m and m.groups() == ("4", "9", "9"), out


def test_generate_text_with_tokenizer(folder, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers", reason="text in / out needs the tokenizers package")
    import shutil
    shutil.copytree(folder, tmp_path / "m")
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "w5 w6 w7 w8", "--max-new-tokens", "6",
                 "--cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    engine = cupaged.Engine.from_pretrained(folder, like=np.zeros(1, np.float32), max_batch=1)
    want = engine.generate([[5, 6, 7, 8]], 6)[0]
    assert lines[1] == "w5 w6 w7 w8 " + " ".join(f"w{t}" for t in want)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "1 2"], "the following arguments are required: --model"),
    (["--model", "/no/such/dir", "--prompt", "1 2"], "path: expected a model folder"),
    (["--model", "MODEL", "--prompt", "hello"],
     r"--prompt: expected token ids like '1 2 3' \(the model folder has no tokenizer.json\)"),
    (["--model", "MODEL", "--prompt", "1 2", "--max-new-tokens", "0"],
     "--max-new-tokens: .*expected an integer from 1"),
    (["--model", "MODEL", "--prompt", "1 999"], r"prompts\[0\]\[1\]: expected a token id in 0..255, got 999"),
])
def test_generate_errors_are_one_line(folder, capsys, argv, message):
    argv = [str(folder) if a == "MODEL" else a for a in argv]
    with pytest.raises(SystemExit) if "required" in message or "--max-new" in message else _no_exit():
        rc = main(["generate", "--cpu"] + argv)
        assert rc == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bench_engine_cpu_smoke():
    """benchmarks/bench_engine.py --cpu runs and reports its columns."""
    import subprocess
    import sys
    from pathlib import Path
    bench = Path(__file__).parents[1] / "benchmarks" / "bench_engine.py"
    r = subprocess.run([sys.executable, str(bench), "--cpu", "--batches", "1,2", "--prompt", "8", "--new", "4"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("batch"))
    for col in ("prefill_tok_s", "decode_tok_s", "host_us_per_step", "graph_launches_per_token", "kernels_per_step"):
        assert col in header
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in ("1", "2")]
    assert rows[-1][5] == "0.500" and rows[-1][6] == "31", r.stdout       # one launch per step serves 2 tokens
