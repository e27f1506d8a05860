"""The README's main job and the standalone kernel checks, as a newcomer runs them."""
import re

import pytest

from cupaged.__main__ import main


@pytest.mark.parametrize("flags", [[], ["--mla"]], ids=["gqa", "mla"])
def test_demo_runs_on_the_cpu_and_every_token_matches(capsys, flags):
    assert main(["demo", "--cpu", "--batch", "2", "--tokens", "6", "--prompt-max", "10", "--chunk", "4"] + flags) == 0
    text = capsys.readouterr().out
    m = re.search(r"tokens matching the float64 reference argmax: (\d+)/(\d+); all within .*: yes", text)
    assert m and m.group(2) == "12" and int(m.group(1)) >= 11, text
    assert "one graph launch per token" in text and "tokens/s" in text


@pytest.mark.parametrize("op, extra", [
    ("attention", ["--splits", "3", "--dtype", "f16"]),
    ("merge", []),
    ("append", ["--dtype", "f32"]),
    ("argmax", ["--vocab", "1001"]),
    ("mla", ["--heads", "4", "--head-dim", "64", "--rope-dim", "16"]),
])
def test_check_ops_report_ok(op, extra, capsys):
    rc = main(["check", op, "--cpu", "--repeat", "1", "--context", "40", "--batch", "3", "--head-dim", "64",
               "--heads", "4", "--kv-heads", "2"] + extra)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert re.search(r"\(ok\)|bit-exact|0 mismatching rows", text), text
