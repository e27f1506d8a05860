"""Notices and progress bars (cupaged/_runtime/progress.py): silent when
quiet, when not a terminal and for short work; one line, redrawn, ended."""

from __future__ import annotations

import io

import pytest

from cupaged._runtime import progress


class Tty(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture(autouse=True)
def loud(monkeypatch):
    monkeypatch.delenv("CUPAGED_QUIET", raising=False)
    progress.set_quiet(None)
    yield
    progress.set_quiet(None)


def test_bar_silent_for_short_work_then_drawn_and_ended():
    out, clock = Tty(), Clock()
    with progress.Progress("prefill", 256, "tokens", after=2.0, stream=out, clock=clock) as bar:
        bar.update(64)
        clock.t += 1.0
        bar.update(64)
        assert out.getvalue() == ""  # under 2 s: nothing
        clock.t += 1.5
        bar.update(64)
        assert out.getvalue() == "\rcupaged: prefill: 192/256 tokens [##################......]  75% 2.5 s"
        clock.t += 0.01
        bar.update(1)  # within the redraw interval: not redrawn
        assert out.getvalue().count("\r") == 1
    assert out.getvalue().endswith("193/256 tokens [##################......]  75% 2.5 s\n")


def test_short_work_prints_nothing_at_all():
    out, clock = Tty(), Clock()
    with progress.Progress("loading weights", 10, stream=out, clock=clock) as bar:
        for _ in range(10):
            bar.update()
            clock.t += 0.1
    assert out.getvalue() == ""


@pytest.mark.parametrize("how", ["not a terminal", "set_quiet", "CUPAGED_QUIET"])
def test_no_bar_and_no_notice_when_not_wanted(how, monkeypatch):
    out, clock = (io.StringIO() if how == "not a terminal" else Tty()), Clock()
    if how == "set_quiet":
        progress.set_quiet(True)
    elif how == "CUPAGED_QUIET":
        monkeypatch.setenv("CUPAGED_QUIET", "1")
    bar = progress.Progress("prefill", 4, after=0.0, stream=out, clock=clock)
    clock.t += 5
    bar.update(4)
    bar.close()
    if how != "not a terminal":
        progress.notice("hello", out)
        assert not progress.notice_once(f"test-{how}", "hello", out)
    assert out.getvalue() == ""


def test_notice_once_per_key():
    out = io.StringIO()
    assert progress.notice_once("test-key-once", "compiling kernels", out)
    assert not progress.notice_once("test-key-once", "compiling kernels", out)
    assert out.getvalue() == "cupaged: compiling kernels\n"


def test_unknown_total_counts_up():
    out, clock = Tty(), Clock()
    bar = progress.Progress("reading", 0, "files", after=0.0, stream=out, clock=clock)
    bar.update(3)
    assert bar.line(clock.t) == "cupaged: reading: 3 files 0.0 s"
