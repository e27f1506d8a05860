"""The README's main job and the standalone kernel checks, as a newcomer runs them."""

import re

import pytest

import cupaged
import cupaged.__main__ as cli
from cupaged.__main__ import main


@pytest.mark.parametrize("flags", [[], ["--mla"]], ids=["gqa", "mla"])
def test_demo_runs_on_the_cpu_and_every_token_matches(capsys, flags):
    assert main(["demo", "--cpu", "--batch", "2", "--tokens", "6", "--prompt-max", "10", "--chunk", "4"] + flags) == 0
    text = capsys.readouterr().out
    m = re.search(r"tokens matching the float64 reference argmax: (\d+)/(\d+); all within .*: yes", text)
    assert m and m.group(2) == "12" and int(m.group(1)) >= 11, text
    assert "one graph launch per token" in text and "tokens/s" in text


PAGED = ["--cpu", "--repeat", "1", "--context", "40", "--batch", "3"]


@pytest.mark.parametrize(
    "op, extra",
    [
        (
            "attention",
            PAGED + ["--splits", "3", "--dtype", "f16", "--head-dim", "64", "--heads", "4", "--kv-heads", "2"],
        ),
        ("merge", PAGED + ["--head-dim", "64", "--heads", "4", "--kv-heads", "2"]),
        ("append", PAGED + ["--dtype", "f32", "--head-dim", "64", "--kv-heads", "2"]),
        ("argmax", ["--cpu", "--repeat", "1", "--batch", "3", "--vocab", "1001"]),
        ("mla", PAGED + ["--heads", "4", "--head-dim", "64", "--rope-dim", "16"]),
        ("mla", PAGED + ["--heads", "4", "--head-dim", "64", "--rope-dim", "16", "--splits", "3"]),
    ],
)
def test_check_ops_report_ok(op, extra, capsys):
    rc = main(["check", op] + extra)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert re.search(r"\(ok\)|bit-exact|0 mismatching rows", text), text
    if "--splits" in extra:
        assert "splits 3" in text, text  # honoured, not ignored


def test_each_op_lists_its_own_options(capsys):
    for op, has, lacks in (
        ("append", ["--kv-heads", "--head-dim"], ["--splits", "--vocab", "--heads "]),
        ("argmax", ["--vocab", "--batch"], ["--splits", "--head-dim", "--context"]),
        ("mla", ["--rope-dim", "--splits"], ["--kv-heads", "--vocab"]),
        ("merge", ["--splits"], ["--vocab"]),
    ):
        with pytest.raises(SystemExit) as e:
            main(["check", op, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for flag in has:
            assert flag in text, (op, flag)
        for flag in lacks:
            assert flag not in text, (op, flag)
        assert "(default" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["demo", "--tokens", "0"],
            "python -m cupaged demo: argument --tokens: expected an integer from 1 to 4096, got 0",
        ),
        (["demo", "--head-dim", "15"], "argument --head-dim: expected an even integer from 2 to 1024, got 15"),
        (["demo", "--heads", "6", "--kv-heads", "4"], "--kv-heads: expected a divisor of --heads 6, got 4"),
        (
            ["check", "attention", "--context", "0"],
            "python -m cupaged check attention: argument --context: expected an integer from 1 to 16777216, got 0",
        ),
        (["check", "merge", "--splits", "1"], "argument --splits: expected an integer from 2 to 64, got 1"),
        (["check", "append", "--splits", "3"], "check append: unrecognized arguments: --splits 3"),
        (["check", "argmax", "--head-dim", "64"], "check argmax: unrecognized arguments: --head-dim 64"),
        (["check", "attention", "--q-len", "50", "--context", "40"], "--q-len: expected at most --context 40, got 50"),
        (["check", "attention", "--batch", "x"], "argument --batch: expected an integer from 1 to 65536, got 'x'"),
    ],
)
def test_wrong_arguments_are_one_line(argv, message, capsys):
    """A wrong flag is one line naming it and its range, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--cpu"],
        ["check", "argmax", "--cpu", "--repeat", "1"],
        ["check", "attention", "--cpu", "--repeat", "1"],
    ],
)
def test_environment_errors_are_one_line_and_traceback_on_request(argv, capsys, monkeypatch):
    """A broken environment (cupaged.SetupError: no compiler, a missing extra,
    an unwritable cache) met by any command: one line, exit status 2; with
    --traceback (or CUPAGED_TRACEBACK=1) the exception itself."""

    def broken(*args, **kwargs):
        raise cupaged.SetupError("no C++ compiler found: the CPU backend needs g++ (apt install g++)")

    monkeypatch.setattr(cli, "_like", broken)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("python -m cupaged ") and ": no C++ compiler found: the CPU backend needs g++" in err
    with pytest.raises(cupaged.SetupError):
        main(argv + ["--traceback"])
    with pytest.raises(cupaged.SetupError):
        main(["--traceback"] + argv)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(cupaged.SetupError):
        main(argv)


def test_every_command_lists_the_traceback_flag(capsys):
    for argv in (["demo", "--help"], ["check", "mla", "--help"], ["check", "argmax", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--traceback" in capsys.readouterr().out, argv
