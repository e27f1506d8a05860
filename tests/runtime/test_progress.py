"""Notices and progress bars (cupaged/_runtime/progress.py): silent when
quiet, when not a terminal and for short work; one line, redrawn, ended."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import cupaged
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


def test_first_build_of_each_kind_is_told_once(tmp_path, monkeypatch, capsys):
    """cpu._building tells the first build of each kind (CPU library, arch-specific cubin) once per process."""
    from cupaged._runtime import cpu, gpu

    monkeypatch.setattr(progress, "_told", set())
    built = []
    for notice in (cpu.CPU_BUILD_NOTICE, cpu.CPU_BUILD_NOTICE, gpu.TARGET_BUILD_NOTICE, gpu.TARGET_BUILD_NOTICE):
        cpu._building(tmp_path, built.append, tmp_path / f"lib{len(built)}", notice)
    assert len(built) == 4
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "cupaged: " + cpu.CPU_BUILD_NOTICE.format(folder=tmp_path),
        "cupaged: " + gpu.TARGET_BUILD_NOTICE.format(folder=tmp_path),
    ]


def test_arch_specific_cubins_compile_once_then_load_from_disk(tmp_path, monkeypatch):
    """gpu.target_cubin: NVRTC once per (source, options, NVRTC), then the kept file (no GPU needed)."""
    from cupaged._runtime import gpu, nvrtc

    try:
        nvrtc.nvrtc_version()
        opts = gpu.module_options() + ("--gpu-architecture=sm_90a",)
    except Exception as e:  # noqa: BLE001 -- no NVRTC here
        pytest.skip(f"NVRTC unavailable: {e}")
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = nvrtc.compile_source
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'
    first = gpu.target_cubin(src, "probe", "sm_90a", opts)
    again = gpu.target_cubin(src, "probe", "sm_90a", opts)
    assert first == again and first[:4] == b"\x7fELF" and calls == ["sm_90a"]
    assert len(list((tmp_path / "cache").glob("probe-sm_90a-*.cubin"))) == 1
    gpu.target_cubin(src.replace("1.0f", "2.0f"), "probe", "sm_90a", opts)
    assert calls == ["sm_90a", "sm_90a"]  # another source: compiled
    with pytest.raises(cupaged.CompileError, match="NVRTC could not compile probe for sm_90a"):
        gpu.target_cubin("this is not C++", "probe", "sm_90a", opts)


def test_build_time_counts_each_build_once():
    """progress.building: time inside adds to build_seconds; a build inside a build (a module's build making the
    precompiled shim) counts once; cpu._building runs its build inside one."""
    import time

    from cupaged._runtime import cpu

    t0 = progress.build_seconds()
    with progress.building():
        time.sleep(0.05)
        with progress.building():
            time.sleep(0.05)
    mid = progress.build_seconds()
    assert 0.1 <= mid - t0 < 0.5
    cpu._building(Path("."), lambda path: time.sleep(0.05), Path("unused"))
    assert 0.05 <= progress.build_seconds() - mid < 0.5
