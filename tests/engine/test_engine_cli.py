"""``python -m cupaged generate`` on a random NumPy-written checkpoint: token
ids in and out, text through the folder's tokenizer.json (when the
tokenizers package is installed), the closing tokens/s line, and one-line
errors."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

import cupaged
import cupaged.__main__ as cli
from cupaged.__main__ import main
from cupaged.testing import random_weights, save_safetensors, tiny_config, write_random_checkpoint

LINE = re.compile(
    r"prefill: (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\); decode: (\d+) tokens in [\d.]+ s "
    r"\([\d.]+ tokens/s, (\d+) graph launches\)"
)


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
    assert (
        main(["generate", "--model", str(tmp_path / "m"), "--prompt", "w5 w6 w7 w8", "--max-new-tokens", "6", "--cpu"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    engine = cupaged.Engine.from_pretrained(folder, like=np.zeros(1, np.float32), max_batch=1)
    want = engine.generate([[5, 6, 7, 8]], 6)[0]
    assert lines[1] == "w5 w6 w7 w8 " + " ".join(f"w{t}" for t in want)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "1 2"], "the following arguments are required: --model"),
        (["--model", "/no/such/dir", "--prompt", "1 2"], "path: expected a model folder"),
        (
            ["--model", "MODEL", "--prompt", "hello"],
            r"--prompt: expected token ids like '1 2 3' \(the model folder has no tokenizer.json\)",
        ),
        (
            ["--model", "MODEL", "--prompt", "1 2", "--max-new-tokens", "0"],
            "--max-new-tokens: .*expected an integer from 1",
        ),
        (["--model", "MODEL", "--prompt", "1 999"], r"prompts\[0\]\[1\]: expected a token id in 0..255, got 999"),
        (["--model", "MODEL", "--prompt", "1 2", "--top-p", "0"], "--top-p: .*expected a number above 0"),
        (["--model", "MODEL", "--prompt", "1 2", "--temperature", "x"], "--temperature: .*expected a number from 0"),
        (["--model", "MODEL", "--prompt", "1 2", "--dtype", "f64"], "--dtype: invalid choice"),
        (
            ["--model", "MODEL", "--prompt", "1 2", "--chat"],
            r"--chat: expected a model with a tokenizer \(the model folder has no tokenizer.json\)",
        ),
    ],
)
def test_generate_errors_are_one_line(folder, capsys, argv, message):
    argv = [str(folder) if a == "MODEL" else a for a in argv]
    exits = any(w in message for w in ("required", "--max-new", "--top-p", "--temperature", "--dtype"))
    with pytest.raises(SystemExit) if exits else _no_exit():
        rc = main(["generate", "--cpu"] + argv)
        assert rc == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize("prompt", ["1 \u00b2", "\u00b9", "1 \u0661", "\uff15 6", "3 \u2467", "1 -2", "1 2.0"])
def test_prompt_of_non_ascii_digits_is_one_line(folder, capsys, prompt):
    """'²' is a digit to str.isdigit but no int; '١' (Arabic-Indic) is read by
    int() as 1: only ASCII token ids are taken, anything else is refused."""
    assert main(["generate", "--cpu", "--model", str(folder), "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"--prompt: expected token ids like '1 2 3' (the model folder has no tokenizer.json), got {prompt!r}" in err


def _failing_engine(monkeypatch, error):
    class Failing:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise error

    monkeypatch.setattr(cli, "Engine", Failing)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)


@pytest.mark.parametrize(
    "error",
    [
        cupaged.SetupError("no C++ compiler: the CPU backend needs g++ >= 9 (apt install g++)"),
        cupaged.CompileError("g++ failed for paged_attention:\nerror: 'x' was not declared\n  1 | x;\n"),
        cupaged.KernelError("paged_attention: barrier never completed"),
        cupaged.ConfigError("config.json: LlamaForCausalLM: hidden_act: expected 'silu', got 'gelu'"),
        cupaged.CheckpointError("model.safetensors: truncated"),
        cupaged.PagedAttentionError("num_pages: expected an int in 1..2147483647, got 0"),
    ],
)
def test_cupaged_errors_are_one_line_with_status_2(folder, capsys, monkeypatch, error):
    """A broken environment (SetupError), a compile or kernel failure, a bad
    config, checkpoint or argument: one line, exit status 2, no traceback."""
    _failing_engine(monkeypatch, error)
    assert main(["generate", "--cpu", "--model", str(folder), "--prompt", "1 2"]) == 2
    err = capsys.readouterr().err
    first = str(error).splitlines()[0]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"python -m cupaged generate: {first}"), err
    if isinstance(error, cupaged.CompileError):
        assert "(2 more lines: --traceback shows them)" in err


def test_a_bug_is_one_line_saying_how_to_get_the_traceback(folder, capsys, monkeypatch):
    _failing_engine(monkeypatch, TypeError("unsupported operand type(s)"))
    argv = ["generate", "--cpu", "--model", str(folder), "--prompt", "1 2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (
        "python -m cupaged generate: internal error (a bug in cupaged): TypeError: unsupported operand type(s); "
        "rerun with --traceback or CUPAGED_TRACEBACK=1 for the traceback"
    ) in err
    for flags in (argv + ["--traceback"], ["--traceback"] + argv):
        with pytest.raises(TypeError, match="unsupported operand"):
            main(flags)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(TypeError, match="unsupported operand"):
        main(argv)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "0")
    assert main(argv) == 1
    _failing_engine(monkeypatch, cupaged.SetupError("no g++"))
    with pytest.raises(cupaged.SetupError):  # --traceback shows cupaged errors' tracebacks too
        main(argv + ["--traceback"])


def test_an_interrupt_is_one_line(folder, capsys, monkeypatch):
    _failing_engine(monkeypatch, KeyboardInterrupt())
    assert main(["generate", "--cpu", "--model", str(folder), "--prompt", "1 2"]) == 130
    assert capsys.readouterr().err == "python -m cupaged generate: interrupted\n"


def test_help_documents_the_traceback_switch(capsys):
    for argv in (["--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "--traceback" in text and "CUPAGED_TRACEBACK=1" in text, text


def _broken_folder(tmp_path, how):
    cfg = tiny_config("LlamaForCausalLM", eos_token_id=list(range(70)) if how == "eos" else None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = random_weights(cfg)
    if how == "int weight":
        w["model.layers.1.mlp.gate_proj.weight"] = np.zeros((128, 64), np.int32)
    save_safetensors(tmp_path / "model.safetensors", w)
    if how == "index":
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    if how == "generation_config":
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    if how == "header":
        raw = (tmp_path / "model.safetensors").read_bytes()
        (tmp_path / "model.safetensors").write_bytes(raw[:8] + raw[8:16].replace(b"{", b"[") + raw[16:])
    return tmp_path


@pytest.mark.parametrize(
    "how, message",
    [
        ("int weight", r"tensor 'model.layers.1.mlp.gate_proj.weight': expected a floating-point weight .*got I32"),
        ("eos", r"config.json: eos_token_id: expected at most 64 distinct token ids"),
        ("index", r"model.safetensors.index.json: weight_map: expected a JSON object"),
        ("generation_config", r"generation_config.json: eos_token_id: expected a token id"),
        ("header", r"model.safetensors: not a safetensors file: its header is not JSON"),
    ],
)
def test_broken_checkpoints_are_one_line(tmp_path, capsys, how, message):
    folder = _broken_folder(tmp_path, how)
    assert main(["generate", "--cpu", "--model", str(folder), "--prompt", "1 2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_unreadable_tokenizer_is_one_line(folder, tmp_path, capsys):
    pytest.importorskip("tokenizers", reason="reading tokenizer.json needs the tokenizers package")
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    assert main(["generate", "--cpu", "--model", str(tmp_path / "m"), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tokenizer.json: not a readable tokenizer.json" in err, err


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

    bench = Path(__file__).parents[2] / "benchmarks" / "bench_engine.py"
    r = subprocess.run(
        [sys.executable, str(bench), "--cpu", "--batches", "1,2", "--prompt", "8", "--new", "4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("batch"))
    for col in ("prefill_tok_s", "decode_tok_s", "host_us_per_step", "graph_launches_per_token", "kernels_per_step"):
        assert col in header
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in ("1", "2")]
    # one launch per step serves 2 tokens; 2 layers of 9 kernels (norm, fused qkv, the append with q's and k's RoPE
    # fused in, attention, o, norm, gate_up, silu_mul, down) and 5 (embed, final norm, lm_head, argmax, plan advance)
    assert rows[-1][5] == "0.500" and rows[-1][6] == "23", r.stdout


def test_several_prompts_one_batch_and_sampling_flags(folder, capsys):
    """Several --prompt run as one batch, each printed with its index; a seeded
    sampling run repeats; --dtype takes the long names."""
    argv = [
        "generate",
        "--cpu",
        "--model",
        str(folder),
        "--prompt",
        "5 6 7",
        "--prompt",
        "9 8",
        "--max-new-tokens",
        "5",
    ]
    assert main(argv + ["--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "prompts 3, 2 tokens" in out[0]
    engine = cupaged.Engine.from_pretrained(folder, like=np.zeros(1, np.float32), max_batch=2)
    want = engine.generate([[5, 6, 7], [9, 8]], 5)
    assert out[1] == "[0] " + " ".join(map(str, want[0])) and out[2] == "[1] " + " ".join(map(str, want[1]))
    sampled = argv + ["--temperature", "1.5", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "7"]
    runs = []
    for _ in range(2):
        assert main(sampled) == 0
        runs.append(capsys.readouterr().out.splitlines()[1:3])
    assert runs[0] == runs[1]
    sp = cupaged.SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.01, seed=7)
    got = engine.generate([[5, 6, 7], [9, 8]], 5, sampling=sp)
    assert runs[0] == [f"[{i}] " + " ".join(map(str, got[i])) for i in range(2)]


def test_chat_applies_the_template(folder, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers", reason="text in / out needs the tokenizers package")
    pytest.importorskip("jinja2", reason="chat templates need jinja2")
    shutil.copytree(folder, tmp_path / "m")
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    template = "{% for m in messages %}w1 {{ m.content }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert (
        main(
            [
                "generate",
                "--cpu",
                "--model",
                str(tmp_path / "m"),
                "--prompt",
                "w5 w6",
                "--chat",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    engine = cupaged.Engine.from_pretrained(folder, like=np.zeros(1, np.float32), max_batch=1)
    want = engine.generate([[1, 5, 6, 2, 3]], 4)[0]
    assert lines[1] == "w1 w5 w6 w2 w3 " + " ".join(f"w{t}" for t in want)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"cupaged {cupaged.__version__}"


def test_kernel_builds_are_left_out_of_the_figures(folder, capsys, monkeypatch):
    # every reading of the build clock 2 s later: each prefill chunk and decode round "built" for 2 s, more
    # than it took, so its seconds are 0 and the builds are told apart (Engine.stats["compile_seconds"])
    from cupaged._runtime import progress

    ticks = iter(range(0, 10**6, 2))
    monkeypatch.setattr(progress, "build_seconds", lambda: float(next(ticks)))
    assert main(["generate", "--model", str(folder), "--prompt", "5 6 7 8", "--max-new-tokens", "4", "--cpu"]) == 0
    out = capsys.readouterr().out
    m = re.search(
        r"prefill: \d+ tokens in ([\d.]+) s .*; decode: \d+ tokens in ([\d.]+) s .*; "
        r"compiling kernels: ([\d.]+) s, not counted",
        out,
    )
    assert m and float(m[1]) == 0 and float(m[2]) == 0 and float(m[3]) >= 4, out
