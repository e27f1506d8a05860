"""The CPU backend's environment: a missing g++, one older than 12, one
whose ``--version`` fails, and a kernel cache that cannot be written are
each one SetupError line naming the fix (no raw PermissionError or
FileNotFoundError). A read-only pre-warmed cache (a deployment image)
serves what it holds without a write; what it lacks is built in a per-user
fallback folder, told once per process on stderr.

Read-only folders are real: ``chmod``, and as root (which ignores modes) the
child runs under ``setpriv`` without capabilities, so that a write into the
folder truly fails; where neither works the cache cases are skipped."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cupaged
from cupaged._runtime import cpu as _cpu
from cupaged.errors import PagedAttentionError, SetupError

REPO = Path(__file__).resolve().parents[2]
UNREADABLE = 77  # the child's exit status when the folder it was told is read-only is writable


# ---- the compiler ---------------------------------------------------------------
@pytest.fixture
def fresh_compiler(tmp_path, monkeypatch):
    """``_compiler`` looked up again (it is cached per process), with a
    private kernel cache; restored afterwards."""
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    _cpu._compiler.cache_clear()
    yield
    _cpu._compiler.cache_clear()


def _fake_cxx(folder: Path, version_line: str, status: int = 0, name: str = "g++") -> Path:
    """A compiler stand-in printing ``version_line`` for ``--version`` (and
    logging each call beside itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(
        f'#!/bin/sh\necho "$@" >> {folder}/calls.log\n'
        f'echo {shlex.quote(version_line)}\necho "Copyright (C) Free Software Foundation, Inc."\n'
        f"exit {status}\n"
    )
    p.chmod(0o755)
    return p


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)
    return msg


def test_cxx_naming_a_missing_file(fresh_compiler, monkeypatch, tmp_path):
    monkeypatch.setenv("CUPAGED_CXX", str(tmp_path / "nowhere" / "g++"))
    with pytest.raises(SetupError) as e:
        _cpu._compiler()
    msg = _one_line(e.value)
    assert msg.startswith("CPU backend: CUPAGED_CXX=") and str(tmp_path / "nowhere" / "g++") in msg
    assert "not found" in msg and "install g++ 12 or later" in msg and "set CUPAGED_CXX" in msg


def test_no_gxx_on_path(fresh_compiler, monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    monkeypatch.delenv("CUPAGED_CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(SetupError) as e:
        _cpu._compiler()
    msg = _one_line(e.value)
    assert msg.startswith("CPU backend: g++ not found") and "apt-get install g++" in msg


def test_empty_cxx_means_gxx(fresh_compiler, monkeypatch, tmp_path):
    monkeypatch.setenv("CUPAGED_CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SetupError, match="^CPU backend: g\\+\\+ not found"):
        _cpu._compiler()


def test_cxx_not_executable(fresh_compiler, monkeypatch, tmp_path):
    p = tmp_path / "g++"
    p.write_text("not a program\n")
    p.chmod(0o644)
    monkeypatch.setenv("CUPAGED_CXX", str(p))
    with pytest.raises(SetupError, match="not found .*not an executable file.*install g\\+\\+ 12"):
        _cpu._compiler()


@pytest.mark.parametrize(
    "line, version",
    [
        ("g++ (GCC) 11.4.0", "11.4"),
        ("g++ (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0", "11.4"),
        ("g++ (GCC) 11.4.1 20231218 (Red Hat 11.4.1-3)", "11.4"),
        ("g++-10 (Debian 10.2.1-6) 10.2.1 20210110", "10.2"),
        ("g++ (GCC) 9.5.0", "9.5"),
    ],
)
def test_old_gxx(fresh_compiler, monkeypatch, tmp_path, line, version):
    cxx = _fake_cxx(tmp_path / "bin", line)
    monkeypatch.setenv("CUPAGED_CXX", str(cxx))
    with pytest.raises(SetupError) as e:
        _cpu._compiler()
    msg = _one_line(e.value)
    assert msg.startswith(f"CPU backend: g++ {version} ({cxx}) is too old: expected g++ 12 or later"), msg
    assert "CUPAGED_CXX" in msg


@pytest.mark.parametrize(
    "line",
    [
        "g++ (GCC) 12.1.0",
        "g++ (Debian 12.2.0-14+deb12u1) 12.2.0",
        "g++ (GCC) 13.2.1 20231205 (Red Hat 13.2.1-6)",
        "x86_64-conda-linux-gnu-c++ (conda-forge gcc 14.2.0-1) 14.2.0",
        "g++-15 (Homebrew GCC 15.1.0) 15.1.0",
        "Ubuntu clang version 18.1.3 (1ubuntu1)",
    ],
)
def test_recent_gxx_is_accepted(fresh_compiler, monkeypatch, tmp_path, line):
    cxx = _fake_cxx(tmp_path / "bin", line)
    monkeypatch.setenv("CUPAGED_CXX", str(cxx))
    path, text = _cpu._compiler()
    assert path == str(cxx) and text.startswith(line)


def test_old_gxx_is_refused_from_the_version_stamp_too(fresh_compiler, monkeypatch, tmp_path):
    """The version text is cached on disk; a later process reads it there,
    without running the compiler, and must still refuse it."""
    cxx = _fake_cxx(tmp_path / "bin", "g++ (GCC) 11.4.0")
    monkeypatch.setenv("CUPAGED_CXX", str(cxx))
    for _ in range(2):
        _cpu._compiler.cache_clear()
        with pytest.raises(SetupError, match="g\\+\\+ 11.4 .* is too old"):
            _cpu._compiler()
    assert (tmp_path / "bin" / "calls.log").read_text() == "--version\n"  # the second came from the stamp


@pytest.mark.parametrize(
    "line, status, match",
    [
        ("g++ (GCC) 13.1.0", 1, "`.*g\\+\\+ --version` failed .*exit status 1.*install g\\+\\+ 12"),
        ("hello", 0, "cannot read the version of .*'hello'.*expected g\\+\\+ 12 or later"),
        ("", 0, "cannot read the version of .*expected g\\+\\+ 12 or later"),
    ],
)
def test_unusable_version_output(fresh_compiler, monkeypatch, tmp_path, line, status, match):
    cxx = _fake_cxx(tmp_path / "bin", line, status)
    if not line:
        cxx.write_text("#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("CUPAGED_CXX", str(cxx))
    with pytest.raises(SetupError, match=match) as e:
        _cpu._compiler()
    _one_line(e.value)


def test_missing_compiler_through_the_public_api(tmp_path):
    """A fresh process (no runtime loaded) running a real op: the error is
    the SetupError line, with no FileNotFoundError anywhere in the report."""
    r = _python(
        """
        import numpy as np, cupaged
        x = np.array([[1.0, 3.0, 2.0]], np.float32)
        try:
            cupaged.argmax_into(x, np.zeros(1, np.int64))
        except cupaged.SetupError as e:
            print("SetupError:", e)
        """,
        {"CUPAGED_CACHE_DIR": str(tmp_path / "cache"), "CUPAGED_CXX": str(tmp_path / "none" / "g++")},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("SetupError: CPU backend: CUPAGED_CXX=") and r.stdout.count("\n") == 1, r.stdout
    assert "Error" not in r.stderr


def test_setup_error_is_exported():
    assert cupaged.SetupError is SetupError and issubclass(SetupError, RuntimeError)


# ---- the kernel cache -------------------------------------------------------------
KERNEL = 'extern "C" __global__ void add(int* x) {{ x[threadIdx.x] += {n}; }}\n'

PROBE = """
import os, sys
from pathlib import Path
ro = os.environ.get("EXPECT_READ_ONLY")
if ro:                                  # the test can only fail honestly if this folder is read-only to us
    try:
        open(Path(ro) / ".probe", "w").close()
    except OSError:
        pass
    else:
        os.unlink(Path(ro) / ".probe")
        sys.exit(77)
"""

LOAD = (
    PROBE
    + """
import numpy as np
from cupaged._runtime import cpu as _cpu, source as _source
for src in sys.argv[1:]:
    n = int(Path(src).stem[1:])
    m = _cpu.load_module(_source.assemble(Path(src)), Path(src).stem)
    x = np.arange(8, dtype=np.int32)
    m.get_function("add").bind((1, 1, 1), (8, 1, 1), 0, (x,))()
    assert (x == np.arange(8) + n).all(), x
    print(m.path, flush=True)
"""
)


def _python(code: str, env: dict, args=(), restricted: bool = False) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "CUPAGED_CXX")}
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    if restricted and os.geteuid() == 0:  # root writes through any mode: drop its capabilities
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a folder read-only")
        cmd = [setpriv, "--bounding-set=-all", "--inh-caps=-all", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=600)
    if r.returncode == UNREADABLE:
        pytest.skip("cannot make a folder read-only here")
    return r


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(cache holding the runtime and kernel k1, the compiler wrapper that
    logs its calls, the kernel sources folder), built once."""
    root = tmp_path_factory.mktemp("warm")
    src = root / "src"
    src.mkdir()
    for n in (1, 2, 3):
        (src / f"k{n}.cu").write_text(KERNEL.format(n=n))
    log = root / "cxx.log"
    cxx = root / "cxx"
    cxx.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    r = _python(LOAD, {"CUPAGED_CACHE_DIR": str(root / "cache"), "CUPAGED_CXX": str(cxx)}, [src / "k1.cu"])
    assert r.returncode == 0, r.stderr
    return root / "cache", cxx, src


def _read_only_copy(cache: Path, dest: Path) -> Path:
    shutil.copytree(cache, dest)
    for p in [dest, *dest.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    return dest


def _snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def _dir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _env(cache: Path, cxx: Path, home: Path, tmp: Path, **extra) -> dict:
    return {"CUPAGED_CACHE_DIR": str(cache), "CUPAGED_CXX": str(cxx), "HOME": str(home), "TMPDIR": str(tmp), **extra}


def _calls(cxx: Path) -> str:
    log = cxx.with_name("cxx.log")
    text = log.read_text() if log.exists() else ""
    log.write_text("")
    return text


def _notices(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("cupaged: kernel cache ")]


def _assert_one_setup_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cupaged.errors.SetupError: "), r.stderr[-3000:]
    for hidden in ("PermissionError", "FileNotFoundError", "OSError", "During handling", "direct cause"):
        assert hidden not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("Traceback") == 1
    return last


def test_read_only_prewarmed_cache_serves_what_it_holds(warm, tmp_path):
    cache, cxx, src = warm
    ro = _read_only_copy(cache, tmp_path / "ro")
    before = _snapshot(ro)
    _calls(cxx)
    r = _python(
        LOAD,
        _env(ro, cxx, tmp_path / "home", _dir(tmp_path / "tmp"), EXPECT_READ_ONLY=str(ro)),
        [src / "k1.cu"],
        restricted=True,
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == ro
    assert _calls(cxx) == ""  # no compiler run, not even --version
    assert _notices(r.stderr) == [] and r.stderr == ""
    assert _snapshot(ro) == before
    assert not (tmp_path / "home").exists() and os.listdir(tmp_path / "tmp") == []  # no fallback made


def test_read_only_prewarmed_cache_builds_the_rest_in_a_fallback(warm, tmp_path):
    cache, cxx, src = warm
    ro = _read_only_copy(cache, tmp_path / "ro")
    before = _snapshot(ro)
    home = tmp_path / "home"
    env = _env(ro, cxx, home, _dir(tmp_path / "tmp"), EXPECT_READ_ONLY=str(ro))
    fallback = home / ".cache" / "cupaged" / "cpu"
    _calls(cxx)
    r = _python(LOAD, env, [src / "k1.cu", src / "k2.cu", src / "k3.cu"], restricted=True)
    assert r.returncode == 0, r.stderr
    paths = [Path(p) for p in r.stdout.split()]
    assert [p.parent for p in paths] == [ro, fallback, fallback]
    notices = _notices(r.stderr)
    assert len(notices) == 1 and r.stderr.strip() == notices[0], r.stderr  # one line, once per process
    assert f"kernel cache {ro} is not writable" in notices[0] and str(fallback) in notices[0]
    assert "CUPAGED_CACHE_DIR" in notices[0]
    built = {Path(a).name.split("-")[0] for a in _calls(cxx).split() if a.endswith(".cu") or a.endswith(".cpp")}
    # k2 and k3 built, k1 and the runtime kept (file names, not substrings: a build folder's random suffix
    # may spell "k1")
    assert "k2" in built and "k3" in built and "k1" not in built and "cupaged_rt.cpp" not in built, built
    assert _snapshot(ro) == before
    # a later process finds them in the fallback: nothing built, the notice once again
    r = _python(LOAD, env, [src / "k2.cu", src / "k1.cu"], restricted=True)
    assert r.returncode == 0, r.stderr
    assert [Path(p).parent for p in r.stdout.split()] == [fallback, ro]
    assert _calls(cxx) == ""
    assert len(_notices(r.stderr)) == 1 and r.stderr.strip() == _notices(r.stderr)[0]


def test_xdg_cache_home_is_the_first_fallback(warm, tmp_path):
    cache, cxx, src = warm
    ro = _read_only_copy(cache, tmp_path / "ro")
    xdg = tmp_path / "xdg"
    r = _python(
        LOAD,
        _env(ro, cxx, tmp_path / "home", _dir(tmp_path / "tmp"), XDG_CACHE_HOME=str(xdg), EXPECT_READ_ONLY=str(ro)),
        [src / "k2.cu"],
        restricted=True,
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == xdg / "cupaged" / "cpu"


def test_temp_folder_is_the_last_fallback(warm, tmp_path):
    cache, cxx, src = warm
    ro = _read_only_copy(cache, tmp_path / "ro")
    tmp = _dir(tmp_path / "tmp")
    r = _python(LOAD, _env(ro, cxx, ro / "home", tmp, EXPECT_READ_ONLY=str(ro)), [src / "k2.cu"], restricted=True)
    assert r.returncode == 0, r.stderr
    private = tmp / f"cupaged-{os.geteuid()}"
    assert Path(r.stdout.strip()).parent == private / "cpu"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_damaged_library_in_a_read_only_cache_is_rebuilt_elsewhere(warm, tmp_path):
    cache, cxx, src = warm
    dest = tmp_path / "ro"
    shutil.copytree(cache, dest)
    k1 = next(dest.glob("k1-*.so"))
    with open(k1, "r+b") as f:
        f.truncate(k1.stat().st_size // 3)
    ro = _read_only_copy(dest, tmp_path / "ro2")
    r = _python(
        LOAD,
        _env(ro, cxx, tmp_path / "home", _dir(tmp_path / "tmp"), EXPECT_READ_ONLY=str(ro)),
        [src / "k1.cu"],
        restricted=True,
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == tmp_path / "home" / ".cache" / "cupaged" / "cpu" / k1.name
    assert len(_notices(r.stderr)) == 1


def test_read_only_cache_and_no_writable_fallback(warm, tmp_path):
    cache, cxx, src = warm
    ro = _read_only_copy(cache, tmp_path / "ro")
    r = _python(
        LOAD,
        _env(ro, cxx, ro / "home", ro / "tmp", EXPECT_READ_ONLY=str(ro)),
        [src / "k1.cu", src / "k2.cu"],
        restricted=True,
    )
    assert Path(r.stdout.strip()).parent == ro  # k1, which it holds, still ran
    last = _assert_one_setup_error(r)
    assert f"kernel cache {ro} is not writable (Permission denied)" in last
    assert str(ro / "home" / ".cache" / "cupaged" / "cpu") in last and "cupaged-" in last
    assert last.endswith("set CUPAGED_CACHE_DIR to a writable folder")


def test_uncreatable_cache_builds_the_runtime_in_the_fallback(warm, tmp_path):
    """A cold start whose cache folder cannot be made: the runtime library
    follows the same rule as the kernels."""
    _, cxx, src = warm
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    cache = ro / "images" / "cupaged"
    home = tmp_path / "home"
    r = _python(
        LOAD, _env(cache, cxx, home, _dir(tmp_path / "tmp"), EXPECT_READ_ONLY=str(ro)), [src / "k1.cu"], restricted=True
    )
    assert r.returncode == 0, r.stderr
    fallback = home / ".cache" / "cupaged" / "cpu"
    assert Path(r.stdout.strip()).parent == fallback
    assert len(list(fallback.glob("cupaged_rt-*.so"))) == 1
    assert len(_notices(r.stderr)) == 1 and f"kernel cache {cache} is not writable" in r.stderr


def test_cold_read_only_cache_and_no_fallback(warm, tmp_path):
    _, cxx, src = warm
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    r = _python(LOAD, _env(ro, cxx, ro, ro, EXPECT_READ_ONLY=str(ro)), [src / "k1.cu"], restricted=True)
    assert r.stdout == ""
    last = _assert_one_setup_error(r)
    assert f"SetupError: kernel cache {ro} is not writable" in last and "CUPAGED_CACHE_DIR" in last


@pytest.mark.parametrize("problem", ["open to others", "another owner", "a file"])
def test_shared_temp_fallback_must_be_ours_alone(monkeypatch, tmp_path, problem):
    """Libraries in the temp fallback are loaded into the process: a
    ``cupaged-<uid>`` folder others may write, or that is not ours, is
    refused."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    private = tmp_path / f"cupaged-{os.geteuid()}"
    if problem == "a file":
        private.write_text("")
    else:
        private.mkdir()
        private.chmod(0o777 if problem == "open to others" else 0o700)
        if problem == "another owner":
            if os.geteuid() != 0:
                pytest.skip("chown needs root")
            os.chown(private, 65534, 65534)
    assert _cpu.unwritable(private / "cpu") is not None
    assert not (private / "cpu").exists()
    private.unlink() if problem == "a file" else private.rmdir()
    assert _cpu.unwritable(private / "cpu") is None  # made afresh, private
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


# ---- CuPy's disk cache (the GPU backend), with a stand-in CuPy ----------------------
FAKE_CUPY = """
import hashlib, os, sys, tempfile, types
calls = []


def get_cache_dir():
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


class RawModule:        # CuPy's disk cache as compiler._compile_with_cache_cuda keeps it
    def __init__(self, code, options):
        self.code = code

    def compile(self):
        d = get_cache_dir()
        path = os.path.join(d, hashlib.md5(self.code.encode()).hexdigest() + ".cubin")
        if os.path.exists(path):
            calls.append("hit " + d)
            return
        calls.append("compile")
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, delete=False) as f:
            f.write(b"cubin")
        os.replace(f.name, path)


class Device:
    compute_capability = "90"

    def __init__(self, i):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


cupy, cuda, compiler = (types.ModuleType(n) for n in ("cupy", "cupy.cuda", "cupy.cuda.compiler"))
compiler.CompileException, compiler.get_cache_dir = type("CompileException", (Exception,), {}), get_cache_dir
cuda.compiler, cuda.Device, cupy.cuda, cupy.RawModule = compiler, Device, cuda, RawModule
sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.compiler": compiler})
from cupaged._runtime import gpu
for text in sys.argv[1:]:
    gpu.GpuModule(text, text, 0)
    print(calls.pop(0) if len(calls) == 1 else " + ".join(calls), flush=True)
    calls.clear()
print(os.environ.get("CUPY_CACHE_DIR"))
"""


def _cupy_cache(tmp_path: Path, holds: str) -> Path:
    ro = tmp_path / "cupy_ro"
    ro.mkdir()
    (ro / (hashlib.md5(holds.encode()).hexdigest() + ".cubin")).write_bytes(b"cubin")
    return _read_only_copy(ro, tmp_path / "cupy_ro2")


def test_read_only_cupy_cache_serves_what_it_holds_and_moves_the_rest(tmp_path):
    ro = _cupy_cache(tmp_path, "A")
    home = tmp_path / "home"
    fallback = home / ".cache" / "cupaged" / "cupy"
    env = {
        "CUPY_CACHE_DIR": str(ro),
        "HOME": str(home),
        "TMPDIR": str(_dir(tmp_path / "tmp")),
        "EXPECT_READ_ONLY": str(ro),
    }
    r = _python(PROBE + FAKE_CUPY, env, ["A", "B", "C"], restricted=True)
    assert r.returncode == 0, r.stderr
    # B and C: CuPy compiles, cannot save into the read-only cache, and they are compiled again into the fallback
    assert r.stdout.splitlines() == [f"hit {ro}", "compile + compile", "compile + compile", str(ro)]
    notices = _notices(r.stderr)
    assert len(notices) == 1 and r.stderr.strip() == notices[0], r.stderr
    assert f"kernel cache {ro} is not writable" in notices[0] and str(fallback) in notices[0]
    assert "CUPY_CACHE_DIR" in notices[0]
    # a later process goes to the fallback at once for B (no wasted compile), to the read-only cache for A
    r = _python(PROBE + FAKE_CUPY, env, ["B", "A"], restricted=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"hit {fallback}", f"hit {ro}", str(ro)]
    assert r.stderr == ""


def test_read_only_cupy_cache_and_no_writable_fallback(tmp_path):
    ro = _cupy_cache(tmp_path, "A")
    env = {"CUPY_CACHE_DIR": str(ro), "HOME": str(ro), "TMPDIR": str(ro), "EXPECT_READ_ONLY": str(ro)}
    r = _python(PROBE + FAKE_CUPY, env, ["A", "B"], restricted=True)
    assert r.stdout.splitlines() == [f"hit {ro}"]
    last = _assert_one_setup_error(r)
    assert f"kernel cache {ro} is not writable" in last and last.endswith("set CUPY_CACHE_DIR to a writable folder")


def test_isa_flags_follow_the_cpu(tmp_path):
    with_fma = tmp_path / "fma"
    with_fma.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2\n")
    without = tmp_path / "nofma"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx fmax\n")  # a flag that merely starts with fma
    assert _cpu._host_isa_flags("x86_64", str(with_fma)) == ("-mfma", "-mavx2")
    assert _cpu._host_isa_flags("x86_64", str(without)) == ()
    avx512 = tmp_path / "avx512"
    avx512.write_text("flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512vl avx512bw\n")
    assert _cpu._host_isa_flags("x86_64", str(avx512)) == (
        "-mfma",
        "-mavx2",
        "-mavx512f",
        "-mavx512vl",
        "-mavx512dq",
        "-mprefer-vector-width=256",
    )
    no_avx2 = tmp_path / "fma_only"
    no_avx2.write_text("flags\t\t: fpu sse2 avx fma avx512f avx512dq avx512vl\n")  # an extension after a missing one
    assert _cpu._host_isa_flags("x86_64", str(no_avx2)) == ("-mfma",)
    assert _cpu._host_isa_flags("aarch64", str(with_fma)) == ()  # FMA is in the base ISA there
    assert _cpu._host_isa_flags("x86_64", str(tmp_path / "absent")) == ()
    assert "-ffp-contract=off" in _cpu.MODULE_FLAGS  # only fmaf fuses: the bits do not depend on the flag


@pytest.mark.parametrize("raw,want", [("", 0), ("32", 32), (" 0 ", 0), ("-1", None), ("many", None)])
def test_blas_one_thread_rows(monkeypatch, raw, want):
    monkeypatch.setenv("CUPAGED_BLAS_ONE_THREAD_ROWS", raw)
    _cpu.blas_one_thread_rows.cache_clear()
    try:
        if want is None:
            with pytest.raises(
                PagedAttentionError, match=f"CUPAGED_BLAS_ONE_THREAD_ROWS: expected an integer >= 0, got '{raw}'"
            ):
                _cpu.blas_one_thread_rows()
        else:
            assert _cpu.blas_one_thread_rows() == want
    finally:
        _cpu.blas_one_thread_rows.cache_clear()
