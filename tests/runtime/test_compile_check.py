"""The NVRTC gate (python -m cupaged.tools.compile_check) and the NVRTC
helpers under it, on a machine with no GPU: real NVRTC compiles for sm_80 and
sm_90 of the package's kernels and of small kernels in tests/runtime/kernels/gate_*.cu."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cupaged._runtime import nvrtc as _nvrtc
from cupaged._runtime import registry as _registry
from cupaged.ops.attention import variants as attention_variants
from cupaged.tools import compile_check, gate_manifest, launchcheck

KERNELS = Path(__file__).parent / "kernels"
V4 = KERNELS / "gate_v4.cu"
SPILL = KERNELS / "gate_spill.cu"
ERROR = KERNELS / "gate_error.cu"
ARCHS = ("sm_80", "sm_90")


def _by(results, kernel):
    return {r.arch: r for r in results if r.kernel == kernel}


# ---------------------------------------------------------------- the gate --


def test_package_variants_pass_gate():
    """The NVRTC gate over every registered kernel variant for sm_80, sm_86
    and sm_90 (an arch-specific one, CP_TARGET=sm_90a, for its target alone)
    through the committed gate manifest: every unit whose inputs changed
    compiles, a random sample of the rest is recompiled and must equal its
    row, and then nothing spills, nothing fails to compile, no selected
    kernel cannot launch on its arch (sm_89: not even a warning), each
    tensor-core kernel's static shared memory is within
    TC_STATIC_SMEM_BUDGET, and the manifest is current.
    (``python -m cupaged.tools.compile_check --all`` compiles everything.)"""
    variants = _registry.all_variants()
    if not variants:
        pytest.skip("no kernel variants registered yet")
    m = gate_manifest.load()
    here = gate_manifest.toolchain()
    assert m.toolchain in (None, here), (
        f"the gate manifest was written with {m.toolchain}, this machine has {here}: install the gate extra's "
        f"pinned NVRTC and headers (pip install '.[gate]'), or rewrite it: python -m cupaged.tools.compile_check "
        f"--update-manifest"
    )
    t0 = time.perf_counter()
    results = compile_check.check(
        variants,
        gate_manifest.MANIFEST_ARCHS,
        jobs=2,
        cache_dir=compile_check.default_cache_dir(),
        include_dir=_nvrtc.find_header_dir(),
        manifest=m,
    )
    wall = time.perf_counter() - t0
    s = compile_check.summarize(results, wall, 2)
    print(f"\n{m.status()}; {s['variants']} variants, {wall:.2f} s wall with 2 jobs")
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"{r.variant} {r.kernel or '-'} {r.arch}: {r.problems}\n{r.log[:2000]}" for r in bad)
    compiled = {(r.variant, r.arch) for r in results}
    archs = set(gate_manifest.MANIFEST_ARCHS)
    targeted = [d["CP_TARGET"] for _, d in variants if "CP_TARGET" in d]
    assert len(compiled) == (len(variants) - len(targeted)) * len(archs) + len(targeted)
    assert all(t == "sm_90a" for t in targeted) and {a for _, a in compiled} == archs | set(targeted)
    assert launchcheck.arch_warnings(results, gate_manifest.MANIFEST_ARCHS) == []
    tc = ("paged_prefill_tc", "paged_prefill_wgmma", "paged_mla_tc", "paged_mla_wgmma")
    for r in results:
        if r.kernel in tc:
            assert r.smem <= attention_variants.TC_STATIC_SMEM_BUDGET, (r.variant, r.arch, r.smem)
    assert m.current(), (
        f"{m.status()}: the gate manifest is not current; run python -m cupaged.tools.compile_check "
        f"--update-manifest and commit cupaged/tools/gate_manifest.json"
    )


# ---------------------------------------------------------- the manifest --


def _counting(monkeypatch):
    """Count the compiles check() makes (jobs=1: in this process)."""
    calls = []
    real = compile_check._compile_unit

    def counted(text, arch, *a):
        calls.append(arch)
        return real(text, arch, *a)

    monkeypatch.setattr(compile_check, "_compile_unit", counted)
    return calls


def _fields(results):
    return sorted(
        (
            r.variant,
            r.kernel,
            r.arch,
            r.registers,
            r.spill_stores,
            r.spill_loads,
            r.stack_frame,
            r.smem,
            r.wide_load_bits,
            r.ok,
        )
        for r in results
    )


def test_manifest_rows_stand_for_compiles(tmp_path, monkeypatch):
    """Rows written from a compile give the same results without compiling;
    a unit whose source changed compiles; rows no unit uses are stale."""
    path = tmp_path / "m.json"
    m = gate_manifest.load(path, sample=0)
    full = compile_check.check([(V4, {}), (SPILL, {})], ARCHS, manifest=m)
    assert len(m.missing) == 4 and not m.current()
    gate_manifest.write(m.rows_now(), path)
    calls = _counting(monkeypatch)
    m2 = gate_manifest.load(path, sample=0)
    again = compile_check.check([(V4, {}), (SPILL, {})], ARCHS, manifest=m2)
    assert calls == [] and m2.current() and _fields(again) == _fields(full)
    assert any("spills" in p for r in again for p in r.problems)  # a spill recorded still fails
    m3 = gate_manifest.load(path, sample=0)
    compile_check.check([(V4, {"GATE_SCALE": "2.0f"}), (SPILL, {})], ARCHS, manifest=m3)
    assert sorted(calls) == ["sm_80", "sm_90"] and len(m3.missing) == 2  # the changed variant compiled
    assert len(m3.stale()) == 2 and not m3.current()  # the old variant's rows


def test_manifest_sample_catches_a_row_that_lies(tmp_path):
    """A sampled unit is compiled afresh and fails when its row differs
    (a register count, a load width, a function the compile does not have)."""
    path = tmp_path / "m.json"
    m = gate_manifest.load(path, sample=0)
    compile_check.check([(V4, {})], ("sm_80",), manifest=m)
    rows = m.rows_now()
    ((key, row),) = rows.items()
    row["functions"]["copy_v4"][1] += 7
    row["wide"]["copy_scalar"] = 128
    gate_manifest.write(rows, path)
    lied = gate_manifest.load(path, sample=0)
    quiet = compile_check.check([(V4, {})], ("sm_80",), manifest=lied)
    assert all(r.ok for r in quiet)  # not sampled: the row is taken (the full gate would see it)
    sampled = gate_manifest.load(path, sample=1, seed=5)
    results = compile_check.check([(V4, {})], ("sm_80",), manifest=sampled, cache_dir=tmp_path / "cache")
    assert sampled.sampled == [key]
    problems = [p for r in results for p in r.problems]
    assert any("copy_v4: registers" in p and "recorded" in p for p in problems), problems
    assert any("widest loads" in p for p in problems), problems


def test_manifest_key_covers_every_input(tmp_path):
    """The row key changes with the source, the options and the headers'
    contents, and not with the header folder's path."""
    inc = tmp_path / "a"
    inc.mkdir()
    (inc / "cuda_fp16.h").write_text("// one\n")
    other = tmp_path / "b"
    other.mkdir()
    (other / "cuda_fp16.h").write_text("// one\n")
    opts = lambda d: ("-std=c++17", f"-I{d}", "--gpu-architecture=sm_80")  # noqa: E731
    k = gate_manifest.unit_key("text", opts(inc), str(inc))
    assert k == gate_manifest.unit_key("text", opts(other), str(other))
    assert k != gate_manifest.unit_key("text2", opts(inc), str(inc))
    assert k != gate_manifest.unit_key("text", opts(inc)[:-1] + ("--gpu-architecture=sm_90",), str(inc))
    gate_manifest._headers_digest.cache_clear()
    (other / "cuda_fp16.h").write_text("// two\n")
    assert k != gate_manifest.unit_key("text", opts(other), str(other))
    gate_manifest._headers_digest.cache_clear()


def test_cli_without_the_gate_extra_says_one_line():
    """No cuda-python: one line naming the gate extra, exit 2, no traceback."""
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "from cupaged.tools import compile_check\nsys.exit(compile_check.main([]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cupaged[gate]" in r.stderr


def test_v4_detected_and_required():
    results = compile_check.check([(V4, {})], ARCHS, require_v4=["copy_v4"])
    assert all(r.ok and r.compiled for r in results)
    v4, scalar = _by(results, "copy_v4"), _by(results, "copy_scalar")
    assert set(v4) == set(scalar) == set(ARCHS)
    for arch in ARCHS:
        assert v4[arch].v4 and v4[arch].wide_load_bits == 128
        assert not scalar[arch].v4 and scalar[arch].wide_load_bits == 16
        assert v4[arch].registers > 0 and v4[arch].spill_stores == 0
    # requiring 128-bit loads of the scalar kernel fails it
    results = compile_check.check([(V4, {})], ("sm_90",), require_v4=["copy_scalar"])
    (r,) = [r for r in results if r.kernel == "copy_scalar"]
    assert not r.ok and "128-bit" in r.problems[0]


def test_spill_fails_gate():
    results = compile_check.check([(SPILL, {})], ARCHS)
    assert {r.arch for r in results} == set(ARCHS)
    for r in results:
        assert r.kernel == "spill_heavy" and r.compiled
        assert r.spill_stores > 0 and r.spill_loads > 0 and r.stack_frame > 0
        assert r.registers <= 32  # __launch_bounds__(1024, 2)
        assert not r.ok and "spills" in r.problems[0]


def test_compile_error_fails_gate_with_log():
    results = compile_check.check([(ERROR, {})], ARCHS)
    assert len(results) == 2
    for r in results:
        assert not r.compiled and not r.ok and r.kernel == ""
        assert r.problems == ["compile error"]
        line = next(i for i, t in enumerate(ERROR.read_text().splitlines(), 1) if "not_declared_anywhere" in t)
        assert "not_declared_anywhere" in r.log and f"gate_error.cu({line})" in r.log


def test_defines_filter_and_max_stack():
    results = compile_check.check([(V4, {"GATE_SCALE": "2.0f"})], ("sm_80",), filter="scalar")
    assert [r.kernel for r in results] == ["copy_scalar"]
    assert results[0].variant == "gate_v4_GATE_SCALE_2_0f"
    # a filter matching the variant name keeps all of its kernels
    assert len(compile_check.check([(V4, {})], ("sm_80",), filter="gate_v4")) == 2
    assert compile_check.check([(V4, {})], ("sm_80",), filter="nothing_like_this") == []
    r = compile_check.check([(SPILL, {})], ("sm_80",), max_stack=0)[0]
    assert any("stack frame" in p for p in r.problems)


def test_disk_cache(tmp_path):
    first = compile_check.check([(V4, {}), (ERROR, {})], ("sm_80",), cache_dir=tmp_path)
    assert not any(r.cached for r in first) and len(list(tmp_path.iterdir())) == 2
    again = compile_check.check([(V4, {}), (ERROR, {})], ("sm_80",), cache_dir=tmp_path)
    assert all(r.cached for r in again)
    key = lambda r: (r.variant, r.kernel, r.registers, r.wide_load_bits, r.problems, r.log, r.seconds)  # noqa: E731
    assert [key(r) for r in first] == [key(r) for r in again]
    # another define is another source text, so another entry
    other = compile_check.check([(V4, {"GATE_SCALE": "2.0f"})], ("sm_80",), cache_dir=tmp_path)
    assert not any(r.cached for r in other)
    # keep_ptx compiles anyway, to have the PTX
    kept = compile_check.check([(V4, {})], ("sm_80",), cache_dir=tmp_path, keep_ptx=True)
    assert not any(r.cached for r in kept) and all(".entry" in r.ptx for r in kept)


def test_zero_variants_is_fine():
    assert compile_check.check([], ARCHS) == []


def test_cli_zero_variants_warns_and_passes(monkeypatch, capsys):
    monkeypatch.setattr(_registry, "all_variants", lambda: [])
    assert compile_check.main([]) == 0
    assert "no kernel variants are registered" in capsys.readouterr().err
    assert compile_check.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"] == []


def test_bad_arch_rejected():
    with pytest.raises(ValueError, match="arch"):
        compile_check.check([(V4, {})], ("hopper",))


def test_compute_arch_gives_ptx_without_report():
    results = compile_check.check([(V4, {})], ("compute_90",), require_v4=["copy_v4"])
    # no ptxas run for a virtual architecture: kernel rows from the PTX alone
    assert [(r.kernel, r.v4, r.registers, r.ok) for r in results] == [
        ("copy_scalar", False, 0, True),
        ("copy_v4", True, 0, True),
    ]
    c = _nvrtc.compile_source(V4.read_text(), "compute_90")
    assert c.ok and ".entry copy_v4" in c.ptx and c.cubin == b""


def test_parallel_jobs_match_serial():
    serial = compile_check.check([(V4, {}), (SPILL, {})], ARCHS, jobs=1)
    parallel = compile_check.check([(V4, {}), (SPILL, {})], ARCHS, jobs=4)
    key = lambda r: (r.variant, r.kernel, r.arch, r.registers, r.spill_stores, r.wide_load_bits)  # noqa: E731
    assert [key(r) for r in serial] == [key(r) for r in parallel]


# ------------------------------------------------------------------ the CLI --


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "cupaged.tools.compile_check", "--no-cache", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_exit_codes_and_json(tmp_path):
    ok = _cli(
        "--source",
        str(V4),
        "-D",
        "GATE_SCALE=3.0f",
        "--require-v4",
        "copy_v4",
        "--json",
        "-j",
        "2",
        "--keep-ptx",
        str(tmp_path),
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    data = json.loads(ok.stdout)
    assert {(r["kernel"], r["arch"], r["v4"]) for r in data["results"]} == {
        ("copy_v4", "sm_80", True),
        ("copy_v4", "sm_90", True),
        ("copy_scalar", "sm_80", False),
        ("copy_scalar", "sm_90", False),
    }
    assert data["summary"]["failures"] == 0 and data["archs"] == ["sm_80", "sm_90"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gate_v4_GATE_SCALE_3_0f.sm_80.ptx",
        "gate_v4_GATE_SCALE_3_0f.sm_90.ptx",
    ]
    assert "ld.global.nc.v4.f32" in (tmp_path / "gate_v4_GATE_SCALE_3_0f.sm_90.ptx").read_text()

    spill = _cli("--source", str(SPILL), "--arch", "sm_90")
    assert spill.returncode == 1 and "spills" in spill.stdout and "FAIL" in spill.stdout

    err = _cli("--source", str(ERROR), "--arch", "sm_80")
    assert err.returncode == 1 and "COMPILE ERROR" in err.stdout and "not_declared_anywhere" in err.stdout

    missing = _cli("--source", str(V4), "--arch", "sm_80", "--require-v4", "no_such_kernel")
    assert missing.returncode == 1 and "matches no compiled kernel" in missing.stdout

    usage = _cli("--source", str(V4), "--arch", "volta")
    assert usage.returncode == 2


# ------------------------------------------------------- report parsing --

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperPf
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'b' for 'sm_80'
ptxas info    : Function properties for b
ptxas         .     1208 bytes stack frame, 1276 bytes spill stores, 2440 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 1208 bytes cumulative stack size, 372 bytes cmem[0]
ptxas info    : Compile time = 78.112 ms
ptxas info    : Compiling entry function 'a' for 'sm_80'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline \
stage in the function 'a'
ptxas info    : Function properties for a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'old' for 'sm_80'
ptxas info    : Function properties for old
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, 2048 bytes smem, 360 bytes cmem[0]
"""


def test_parse_ptxas():
    rep = _nvrtc.parse_ptxas(PTXAS_LOG)
    assert set(rep) == {"_Z6helperPf", "a", "b", "old"}
    b, a, old, h = rep["b"], rep["a"], rep["old"], rep["_Z6helperPf"]
    assert (b.is_entry, b.registers, b.stack_frame, b.spill_stores, b.spill_loads, b.cmem, b.cumulative_stack) == (
        True,
        32,
        1208,
        1276,
        2440,
        372,
        1208,
    )
    assert (a.registers, a.barriers, a.smem, a.spill_stores) == (40, 1, 1024, 0)
    assert (old.registers, old.smem) == (12, 2048)  # an older ptxas line format
    assert not h.is_entry and (h.stack_frame, h.spill_stores, h.spill_loads) == (16, 8, 4)
    # ptxas serializing a kernel's wgmma is a gate failure (recorded in its manifest row too)
    assert a.wgmma_serialized.startswith("C7515: non wgmma instructions defining accumulator registers")
    assert not (b.wgmma_serialized or old.wgmma_serialized)
    row = gate_manifest.unit_row("v", "sm_80", True, rep, {})
    assert gate_manifest.row_reports(row)["a"].wgmma_serialized == a.wgmma_serialized
    assert len(row["functions"]["b"]) == 6  # rows of kernels ptxas did not serialize keep their six figures


PTX = """\
.visible .entry k1(
\t.param .u64 k1_param_0
)
{
\tld.global.nc.v4.f32 \t{%f1, %f2, %f3, %f4}, [%rd4];
}
.visible .entry k2(
\t.param .u64 k2_param_0
)
{
\tld.global.nc.L1::no_allocate.v2.u64 \t{%rd5, %rd6}, [%rd4];
}
.func  (.param .b32 func_retval0) _Z1fv(
)
{
\tld.global.v4.u32 \t{%r1, %r2, %r3, %r4}, [%rd1];
}
.visible .entry k3(
)
{
\tld.global.v2.f32 \t{%f1, %f2}, [%rd4];
\tld.global.u16 \t%rs1, [%rd2];
}
.visible .entry k4(
)
{
\tcp.async.cg.shared.global [%r1], [%rd1], 16;
}
.visible .entry k5(
)
{
\tcp.async.ca.shared.global [%r1], [%rd1], 4;
\tld.global.v4.u16 \t{%rs1, %rs2, %rs3, %rs4}, [%rd4];
}
"""


def test_wide_load_detection():
    assert _nvrtc.kernel_wide_loads(PTX) == {"k1": 128, "k2": 128, "k3": 64, "k4": 128, "k5": 64}
    funcs = _nvrtc.ptx_functions(PTX)
    assert funcs["_Z1fv"][0] == "func" and _nvrtc.widest_global_load(funcs["_Z1fv"][1]) == 128
    assert _nvrtc.ld_global_bits(".nc.v4.f32") == 128
    assert _nvrtc.ld_global_bits(".v2.f64") == 128
    assert _nvrtc.ld_global_bits(".u8") == 8
    assert _nvrtc.ld_global_bits(".v4.b16") == 64
    assert _nvrtc.ld_global_bits(".v4.f16x2") == 128


# ------------------------------------------------------ options, headers --


def test_gate_options_mirror_gpu_options():
    opts = _nvrtc.gate_options("sm_90", include_dir="/x/include")
    assert opts[: len(_nvrtc.gpu_options("/x/include"))] == _nvrtc.gpu_options("/x/include")
    assert "-I/x/include" in opts and "-std=c++17" in opts
    assert "--gpu-architecture=sm_90" in opts and "--ptxas-options=-v" in opts
    assert "--device-as-default-execution-space" in opts  # CuPy adds it on the GPU
    assert not any("fast_math" in o or "fast-math" in o for o in opts)
    assert "--ptxas-options=-v" not in _nvrtc.gate_options("compute_90", include_dir="/x")


def _fake_headers(folder: Path, cudart_version: int | None):
    folder.mkdir(parents=True)
    for h in _nvrtc.REQUIRED_HEADERS:
        (folder / h).write_text("// stand-in\n")
    if cudart_version is not None:
        (folder / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {cudart_version}\n")


def test_header_discovery_order(tmp_path):
    major = _nvrtc.nvrtc_version()[0]
    other = 13 if major == 12 else 12
    root = tmp_path / "site-packages" / "nvidia"
    _fake_headers(root / "cu13" / "include", other * 1000)  # wrong major for this NVRTC
    _fake_headers(root / "cuda_runtime" / "include", major * 1000 + 90)  # matching major
    cuda_path = tmp_path / "cuda"
    _fake_headers(cuda_path / "include", None)  # version unknown
    (tmp_path / "incomplete").mkdir()
    (tmp_path / "incomplete" / "cuda_fp16.h").write_text("")  # no cuda_bf16.h: skipped
    env = {"CUDA_PATH": str(cuda_path), "CUPAGED_CUDA_INCLUDE": str(tmp_path / "incomplete")}
    found = _nvrtc.header_dir_candidates(env=env, nvidia_roots=[root], use_pathfinder=False)
    paths = [Path(h.path) for h in found]
    assert paths[0] == (root / "cuda_runtime" / "include").resolve()
    assert paths.index((cuda_path / "include").resolve()) < paths.index((root / "cu13" / "include").resolve())
    assert (tmp_path / "incomplete").resolve() not in paths
    by_path = {Path(h.path): h for h in found}
    assert by_path[(root / "cu13" / "include").resolve()].found_via == "wheel-cu13"
    assert by_path[(root / "cu13" / "include").resolve()].cuda_major == other

    # an explicit folder always wins, whatever its version
    _fake_headers(tmp_path / "mine", other * 1000)
    env["CUPAGED_CUDA_INCLUDE"] = str(tmp_path / "mine")
    found = _nvrtc.header_dir_candidates(env=env, nvidia_roots=[root], use_pathfinder=False)
    assert Path(found[0].path) == (tmp_path / "mine").resolve() and found[0].found_via == "env"


def test_cu13_wheel_layout_found(tmp_path):
    """A CUDA 13 environment: only site-packages/nvidia/cu13/include."""
    root = tmp_path / "nvidia"
    _fake_headers(root / "cu13" / "include", 13000)
    found = _nvrtc.header_dir_candidates(env={}, nvidia_roots=[root], use_pathfinder=False)
    assert [h.found_via for h in found if str(tmp_path) in h.path] == ["wheel-cu13"]


def test_real_header_dir_compiles_fp16_bf16():
    inc = _nvrtc.find_header_dir()
    assert all((Path(inc) / h).is_file() for h in _nvrtc.REQUIRED_HEADERS)
    c = _nvrtc.compile_source(V4.read_text(), "sm_80")
    assert c.ok, c.log
    assert c.cubin[:4] == b"\x7fELF" and ".entry copy_scalar" in c.ptx
    assert "Used" in c.log and "registers" in c.log
