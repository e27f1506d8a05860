"""The GPU backend (cupaged._runtime.gpu).

Tests marked ``gpu`` run on a machine with a CUDA GPU (skipped elsewhere,
with the reason): kernel launch, dynamic shared memory above 48 KiB,
memset_d32, copies, host copies, capture and replay. The rest runs anywhere:
options, the module cache key, argument packing, result checking, and that
nothing here imports CuPy on the CPU path.
"""

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupaged import CompileError, PagedAttentionError, stream_for
from cupaged import _runtime as _backend
from cupaged._runtime import gpu as _gpu
from cupaged._runtime import nvrtc as _nvrtc
from cupaged._runtime import source as _source

KERNELS = Path(__file__).parent / "kernels"
V4 = KERNELS / "gate_v4.cu"
SMEM = KERNELS / "gate_smem.cu"


# ------------------------------------------------------------ CPU-runnable --


def test_cpu_path_never_imports_cupy():
    code = (
        "import sys, numpy as np, cupaged, cupaged._runtime.gpu, cupaged._runtime.nvrtc\n"
        "import cupaged.tools.compile_check\n"
        "s = cupaged.stream_for(np.zeros(4, np.uint32)); s.memset_d32(np.zeros(4, np.uint32), 1)\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_module_options():
    opts = _gpu.module_options()
    assert "-std=c++17" in opts and "-ftz=true" in opts
    assert not any("fast_math" in o or "fast-math" in o for o in opts)
    inc = [o[2:] for o in opts if o.startswith("-I")]
    assert inc == [_nvrtc.find_header_dir()]
    assert all((Path(inc[0]) / h).is_file() for h in ("cuda_fp16.h", "cuda_bf16.h"))
    # the gate compiles with exactly these options plus what CuPy appends
    gate = _nvrtc.gate_options("sm_90")
    assert gate[: len(opts)] == opts
    assert set(gate[len(opts) :]) >= set(_nvrtc.CUPY_APPENDED_OPTIONS)


def test_module_options_compile_like_cupy_would():
    """NVRTC with the RawModule options plus what CuPy appends (-ftz=true,
    --device-as-default-execution-space, -arch=sm_90) compiles our headers."""
    text = _source.assemble(V4, {"GATE_SCALE": "2.0f"})
    opts = _gpu.module_options() + _nvrtc.CUPY_APPENDED_OPTIONS + ("-arch=sm_90",)
    c = _nvrtc.compile_source(text, "sm_90", options=opts)
    assert c.ok, c.log
    assert c.cubin[:4] == b"\x7fELF"


def test_module_cache_key():
    a = _source.assemble(V4, {"GATE_SCALE": "2.0f"})
    b = _source.assemble(V4, {"GATE_SCALE": "3.0f"})
    ka = _gpu.module_key(a, "v", 0)
    assert ka == _gpu.module_key(a, "v", 0)
    assert ka != _gpu.module_key(b, "v", 0)  # other text (other define)
    assert ka != _gpu.module_key(a, "v", 1)  # other device
    assert ka != _gpu.module_key(a + " ", "v", 0)  # any byte of the text counts
    assert ka[0] == 0 and ka[1] == "v"
    # our headers are inlined, so the text alone spells every byte that matters
    assert "warp_sum" in _source.assemble(SMEM, None)


class _FakeMemory:
    def __init__(self, ptr):
        self.ptr = ptr


class _FakeDevice:
    id = 0


class FakeCupyArray:
    """Enough of a CuPy array for array_backend() and pack_args()."""

    def __init__(self, ptr):
        self.data = _FakeMemory(ptr)
        self.device = _FakeDevice()


FakeCupyArray.__module__ = "cupy._core.fake"


def _slot_bytes(slots, i, n):
    return ctypes.string_at(slots[i], n)


def test_pack_args():
    arr = FakeCupyArray(0x7F0012345600)
    assert _backend.array_backend(arr) == _backend.GPU
    args = (
        arr,
        np.int32(-5),
        np.uint32(0xFFFFFFFF),
        np.float32(1.5),
        np.int64(-(2**40)),
        np.uint64(2**63),
        None,
        np.float16(2.0),
    )
    slots, holders = _gpu.pack_args(args, "k")
    assert len(slots) == len(args) and holders is not None
    assert int.from_bytes(_slot_bytes(slots, 0, 8), "little") == 0x7F0012345600
    assert np.frombuffer(_slot_bytes(slots, 1, 4), np.int32)[0] == -5
    assert np.frombuffer(_slot_bytes(slots, 2, 4), np.uint32)[0] == 0xFFFFFFFF
    assert np.frombuffer(_slot_bytes(slots, 3, 4), np.float32)[0] == 1.5
    assert np.frombuffer(_slot_bytes(slots, 4, 8), np.int64)[0] == -(2**40)
    assert np.frombuffer(_slot_bytes(slots, 5, 8), np.uint64)[0] == 2**63
    assert int.from_bytes(_slot_bytes(slots, 6, 8), "little") == 0
    assert np.frombuffer(_slot_bytes(slots, 7, 2), np.float16)[0] == 2.0
    assert _gpu.pack_args((), "k") == (None, None)


def test_kernel_names_with_launch_bounds_after_void():
    """The GPU backend reads kernel names from the raw source, where
    ``void __launch_bounds__(...) name(`` is still spelled out (the CPU
    backend scans preprocessed text, without it)."""
    layers = _source.assemble("layers", {"CP_DTYPE": "f32"})
    assert "void __launch_bounds__(" in layers
    assert _source.kernel_names(layers) == [
        "bias_add",
        "embed",
        "linear",
        "linear_heads",
        "rms_norm",
        "rope",
        "silu_mul",
    ]
    assert _source.kernel_names(_source.assemble("advance", {})) == ["advance_plan", "advance_slots"]
    att = _source.kernel_names(
        _source.assemble(
            "attention/decode", {"CP_DTYPE": "bf16", "CP_KV_DTYPE": "bf16", "HEAD_DIM": 128, "GROUP_TILE": 4}
        )
    )
    assert att == ["paged_attention"]
    merge = _source.kernel_names(_source.assemble("attention/merge", {"CP_DTYPE": "bf16", "CP_KV_DTYPE": "bf16"}))
    assert merge == ["attention_split_merge"]


def test_array_backend_is_not_fooled_by_cupyx_objects():
    class SparseLike:  # cupyx.scipy.sparse matrices have .data and .device too
        data, device = object(), _FakeDevice()

    SparseLike.__module__ = "cupyx.scipy.sparse._csr"
    assert _backend.array_backend(SparseLike()) is None
    assert _backend.array_backend(FakeCupyArray(16)) == _backend.GPU


@pytest.mark.parametrize("bad, what", [(3, "int"), (1.0, "float"), (np.zeros(2), "NumPy array")])
def test_pack_args_rejects_untyped_values(bad, what):
    with pytest.raises(PagedAttentionError, match=r"args\[1\] of k: expected a CuPy array.*" + what):
        _gpu.pack_args((FakeCupyArray(16), bad), "k")


def test_check_names_the_call():
    drv = _gpu.driver_module()
    assert _gpu._check((drv.CUresult.CUDA_SUCCESS,), "cuX") is None
    assert _gpu._check((drv.CUresult.CUDA_SUCCESS, 7), "cuX") == 7
    assert _gpu._check((drv.CUresult.CUDA_SUCCESS, 7, 8), "cuX") == (7, 8)
    with pytest.raises(RuntimeError, match="cuMemsetD32Async failed: CUDA_ERROR_INVALID_VALUE"):
        _gpu._check((drv.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemsetD32Async")


# ------------------------------------------------------------- GPU-only --


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def side_stream(cp):
    """A non-default CuPy stream made current for the test (capture needs one)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        yield s


@pytest.mark.gpu
def test_launch_kernel(cp):
    x = cp.arange(4 * 1000, dtype=cp.float32).reshape(1000, 4)
    y = cp.zeros_like(x)
    k = _backend.get_kernel(x, V4, "copy_v4", {"GATE_SCALE": "2.0f"})
    assert isinstance(k, _gpu.GpuFunction) and k.name == "copy_v4" and k.device == x.device.id
    s = stream_for(x)
    assert s.backend == "gpu" and s.device == x.device.id
    s.launch(k, (4,), (256,), (x, y, np.uint32(1000)))
    s.synchronize()
    cp.testing.assert_array_equal(y, 2 * x)
    # the same kernel object from the cache; f16 -> bf16 kernel of the module
    assert _backend.get_kernel(x, V4, "copy_v4", {"GATE_SCALE": "2.0f"}) is k
    h = cp.arange(300, dtype=cp.float16)
    out = cp.zeros(300, dtype=cp.uint16)
    k2 = _backend.get_kernel(h, V4, "copy_scalar", {"GATE_SCALE": "2.0f"})
    s.launch(k2, (2,), (256,), (h, out, np.uint32(300)))
    s.synchronize()
    import ml_dtypes

    got = out.get().view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(
        got, (2 * np.arange(300, dtype=np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
    )


@pytest.mark.gpu
def test_launch_errors(cp):
    x = cp.zeros(8, cp.float32)
    k = _backend.get_kernel(x, V4, "copy_v4")
    s = stream_for(x)
    with pytest.raises(PagedAttentionError, match=r"args\[2\]"):
        s.launch(k, 1, 32, (x, x, 8))  # a Python int has no C type
    with pytest.raises(KeyError, match="no_such_kernel"):
        _gpu.load_module(_source.assemble(V4, {}), "gate_v4", x.device.id).get_function("no_such_kernel")
    with pytest.raises(CompileError, match="not_declared_anywhere"):
        _gpu.load_module(_source.assemble(KERNELS / "gate_error.cu", {}), "gate_error", x.device.id)


@pytest.mark.gpu
def test_dynamic_shared_memory_above_48k(cp):
    n, block = 4096, 256
    src = cp.random.standard_normal(n, dtype=cp.float32)
    dst = cp.zeros_like(src)
    k = _backend.get_kernel(src, SMEM, "reverse_blocks")
    s = stream_for(src)
    want = src.reshape(-1, block)[:, ::-1].reshape(-1)
    for kib in (16, 64, 32, 96):  # opt-in on the first size above 48 KiB, again only when larger
        dst[:] = 0
        words = kib * 1024 // 4
        s.launch(k, (n // block,), (block,), (src, dst, np.uint32(words)), shared_mem=kib * 1024)
        s.synchronize()
        cp.testing.assert_array_equal(dst, want)
    assert k._smem_optin == 96 * 1024


@pytest.mark.gpu
def test_memset_and_copies(cp):
    a = cp.zeros(8, cp.uint32)
    s = stream_for(a)
    s.memset_d32(a, 0xDEADBEEF, count=3, offset_bytes=8)
    b = cp.arange(8, dtype=cp.uint32)
    s.copy(a, b, nbytes=8, dst_offset=24, src_offset=4)
    host = np.array([7, 9], np.uint32)
    s.copy_from_host(a, host)
    host[:] = 0  # the stream copied the bytes: reuse is fine at once
    s.memset_d32(a, -1, count=1, offset_bytes=4)
    s.synchronize()
    assert a.get().tolist() == [7, 0xFFFFFFFF, 0xDEADBEEF, 0xDEADBEEF, 0xDEADBEEF, 0, 1, 2]
    assert not s._inflight  # synchronize released every staging buffer
    with pytest.raises(PagedAttentionError, match="aligned"):
        s.memset_d32(a.view(cp.uint8)[1:5], 0, count=1)


@pytest.mark.gpu
def test_many_host_copies_stay_ordered(cp):
    a = cp.zeros(1024, cp.int32)
    s = stream_for(a)
    host = np.zeros(1024, np.int32)
    for i in range(200):
        host[:] = i
        s.copy_from_host(a, host)
    s.synchronize()
    assert (a.get() == 199).all()
    assert len(s._free_events) >= 1 and not s._inflight


@pytest.mark.gpu
def test_current_stream_follows_cupy(cp):
    x = cp.zeros(4, cp.float32)
    s0 = stream_for(x)
    assert stream_for(x) is s0 and s0.ptr == cp.cuda.get_current_stream().ptr
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        s1 = stream_for(x)
        assert s1 is not s0 and s1.ptr == other.ptr and stream_for(x) is s1
    assert stream_for(x) is s0


@pytest.mark.gpu
def test_capture_on_legacy_default_stream_rejected(cp):
    x = cp.zeros(4, cp.float32)
    with cp.cuda.Stream.null:
        s = stream_for(x)
        with pytest.raises(PagedAttentionError, match="default stream"):
            s.begin_capture()
        assert not s.capturing


@pytest.mark.gpu
def test_capture_and_replay(cp, side_stream):
    n = 1000
    x = cp.arange(4 * n, dtype=cp.float32).reshape(n, 4)
    y = cp.zeros_like(x)
    a = cp.zeros(4, cp.uint32)
    b = cp.zeros(4, cp.uint32)
    k = _backend.get_kernel(x, V4, "copy_v4", {"GATE_SCALE": "2.0f"})
    s = stream_for(x)
    assert s.ptr == side_stream.ptr
    src = np.array([1, 2, 3, 4], np.uint32)
    c = cp.zeros(4, cp.uint32)
    s.synchronize()
    s.begin_capture()
    try:
        assert s.capturing
        s.memset_d32(a, 5, count=4)
        s.copy(b, a)  # sees the memset: order is kept
        s.memset_d32(a, 6, count=1)
        s.launch(k, (4,), (256,), (x, y, np.uint32(n)))
        s.copy_from_host(c, src)  # host bytes frozen at capture
    finally:
        g = s.end_capture()
    assert not s.capturing and g._native is not None
    src[:] = 0
    s.synchronize()
    assert a.get().tolist() == [0] * 4 and b.get().tolist() == [0] * 4  # nothing ran
    assert float(y.sum()) == 0.0
    g.launch()
    s.synchronize()
    assert a.get().tolist() == [6, 5, 5, 5] and b.get().tolist() == [5, 5, 5, 5]
    assert c.get().tolist() == [1, 2, 3, 4]
    cp.testing.assert_array_equal(y, 2 * x)
    # replay again after changing inputs in place: the graph reads them anew
    x *= -1
    a[:] = 0
    c[:] = 0
    g.launch()
    s.synchronize()
    cp.testing.assert_array_equal(y, 2 * x)
    assert c.get().tolist() == [1, 2, 3, 4] and a.get().tolist() == [6, 5, 5, 5]
    # the graph keeps what it touches alive
    assert any(o is y for o in g._keep_alive) and any(o is k for o in g._keep_alive)


@pytest.mark.gpu
def test_failed_capture_resets_state(cp, side_stream):
    x = cp.zeros(4, cp.float32)
    s = stream_for(x)
    s.begin_capture()
    # a synchronous call on the capturing stream invalidates the capture
    with pytest.raises(RuntimeError, match="cuStreamSynchronize"):
        s.synchronize()
    with pytest.raises(RuntimeError, match="cuStreamEndCapture"):
        s.end_capture()
    assert not s.capturing
    s.memset_d32(cp.zeros(4, cp.uint32), 1)  # the stream works again
    s.synchronize()


# ------------------------------------------- GPU paths on an emulated driver --
# The real driver is absent on CPU-only machines, so the GpuStream / GpuFunction
# code paths run here against a small stand-in with the signatures of
# cuda.bindings.driver (same argument order and result tuples), whose "device
# memory" is host memory. It checks argument order, the capture state machine,
# keep-alive, the host-copy event queue and context push/pop balance; it says
# nothing about real GPU behaviour (the gpu-marked tests above do).


class FakeDriver:
    def __init__(self):
        real = _gpu.driver_module()
        self.CUresult = real.CUresult
        self.CUstreamCaptureMode = real.CUstreamCaptureMode
        self.CUfunction_attribute = real.CUfunction_attribute
        self.CUevent_flags = real.CUevent_flags
        self.CUfunction = real.CUfunction
        self.CUlaunchConfig = real.CUlaunchConfig
        self.CUlaunchAttribute = real.CUlaunchAttribute
        self.CUlaunchAttributeID = real.CUlaunchAttributeID
        self.CUstream = real.CUstream
        self.ok = (real.CUresult.CUDA_SUCCESS,)
        self.ctx_stack = []  # contexts pushed on top of the thread's current one (0: none)
        self.capturing = {}  # stream -> list of ops, or "invalid"
        self.events = {}  # event -> queries left before it reports complete
        self.kernels = {}  # CUfunction handle -> python callable(grid, block, smem, values)
        self.func_attrs = {}
        self.calls = []
        self.launches = []  # per launch: None (cuLaunchKernel), or cuLaunchKernelEx's attributes {id: value}
        self.next_handle = 1000

    # -- helpers
    def _handle(self):
        self.next_handle += 1
        return self.next_handle

    def _current(self):
        return self.ctx_stack[-1] if self.ctx_stack else 0

    def _issue(self, stream, op):
        assert self._current() == 77, "a driver call ran without the device context current"
        cap = self.capturing.get(int(stream))
        if cap == "invalid":
            return (self.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,)
        if cap is not None:
            cap.append(op)
        else:
            op()
        return self.ok

    # -- context
    def cuInit(self, flags):
        return self.ok

    def cuGetErrorString(self, err):
        return (self.CUresult.CUDA_SUCCESS, b"emulated")

    def cuDeviceGet(self, ordinal):
        return (self.CUresult.CUDA_SUCCESS, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):
        assert dev == 0
        return (self.CUresult.CUDA_SUCCESS, 77)

    def cuCtxGetCurrent(self):
        return (self.CUresult.CUDA_SUCCESS, self._current())

    def cuCtxPushCurrent(self, ctx):
        self.ctx_stack.append(int(ctx))
        return self.ok

    def cuCtxPopCurrent(self):
        return (self.CUresult.CUDA_SUCCESS, self.ctx_stack.pop())

    # -- memory
    def cuMemsetD32Async(self, dst, ui, n, stream):
        self.calls.append("memset")
        return self._issue(stream, lambda: ctypes.memmove(dst, np.full(n, ui, np.uint32).ctypes.data, 4 * n))

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        self.calls.append("dtod")
        return self._issue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self.calls.append("htod")
        assert isinstance(src, int)
        return self._issue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    # -- events
    def cuEventCreate(self, flags):
        assert flags == int(self.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        e = self._handle()
        self.events[e] = None
        return (self.CUresult.CUDA_SUCCESS, e)

    def cuEventRecord(self, event, stream):
        assert int(stream) not in self.capturing
        self.events[event] = 2  # completes at the third query
        return self.ok

    def cuEventQuery(self, event):
        left = self.events[event]
        if left:
            self.events[event] = left - 1
            return (self.CUresult.CUDA_ERROR_NOT_READY,)
        return self.ok

    def cuEventDestroy(self, event):
        del self.events[event]
        return self.ok

    # -- streams and graphs
    def cuStreamSynchronize(self, stream):
        if int(stream) in self.capturing:
            self.capturing[int(stream)] = "invalid"
            return (self.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        for e in self.events:
            if self.events[e]:
                self.events[e] = 0
        return self.ok

    def cuStreamBeginCapture(self, stream, mode):
        assert mode == self.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        assert int(stream) not in (0, 1)
        self.capturing[int(stream)] = []
        return self.ok

    def cuStreamEndCapture(self, stream):
        ops = self.capturing.pop(int(stream))
        if ops == "invalid":
            return (self.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
        return (self.CUresult.CUDA_SUCCESS, ("graph", ops))

    def cuGraphInstantiate(self, graph, flags):
        return (self.CUresult.CUDA_SUCCESS, ("exec", list(graph[1])))

    def cuGraphLaunch(self, graph_exec, stream):
        def run():
            for op in graph_exec[1]:
                op()

        return self._issue(stream, run)

    def cuGraphExecDestroy(self, e):
        return self.ok

    def cuGraphDestroy(self, g):
        return self.ok

    # -- kernels
    def cuFuncSetAttribute(self, f, attr, value):
        assert attr == self.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        assert self._current() == 77
        self.func_attrs[int(f)] = value
        return self.ok

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        fn, nargs = self.kernels[int(f)]
        if smem > 48 * 1024:
            assert self.func_attrs.get(int(f), 0) >= smem, "launch above 48 KiB without opting in"
        assert extra == 0
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        # parameters are copied at the call, as the driver does: read them now
        raw = [ctypes.string_at(slots[i], 8) for i in range(nargs)]
        self.launches.append(None)
        return self._issue(stream, lambda: fn((gx, gy, gz), (bx, by, bz), raw))

    def cuLaunchKernelEx(self, config, f, params, extra):
        c = config
        attrs = {}
        for a in list(c.attrs)[: c.numAttrs]:
            ids = self.CUlaunchAttributeID
            assert a.id == ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, a.id
            attrs[a.id] = a.value.programmaticStreamSerializationAllowed
        grid, block = (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ)
        r = self.cuLaunchKernel(f, *grid, *block, c.sharedMemBytes, int(c.hStream), params, extra)
        self.launches[-1] = attrs
        return r


class FakeMemoryPtr:
    def __init__(self, ptr):
        self.ptr = ptr


class EmuArray:
    """A CuPy-like array over host memory (array_backend() says "gpu")."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.data = FakeMemoryPtr(host.ctypes.data)
        self.device = _FakeDevice()
        self.nbytes = host.nbytes
        self.flags = host.flags
        self.dtype = host.dtype


EmuArray.__module__ = "cupy._core.emulated"


class FakeCupyStream:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeCupy:
    """The parts of the cupy module _gpu touches on the stream paths."""

    def __init__(self):
        self.current = FakeCupyStream(0)
        self.pinned = []
        self.cc = "80"  # the device's compute capability

        outer = self

        class cuda:
            class Device:
                def __init__(self, device=0):
                    self.compute_capability = outer.cc

            @staticmethod
            def get_current_stream(device_id=-1):
                return outer.current

            @staticmethod
            def alloc_pinned_memory(n):
                buf = ctypes.create_string_buffer(n)
                outer.pinned.append(buf)
                mem = FakeMemoryPtr(ctypes.addressof(buf))
                mem.buf = buf
                return mem

        self.cuda = cuda


@pytest.fixture
def emu(monkeypatch):
    drv = FakeDriver()
    fake_cupy = FakeCupy()
    monkeypatch.setattr(_gpu, "_drv", drv)
    monkeypatch.setattr(_gpu, "_drv_ready", False)
    monkeypatch.setattr(_gpu, "_primary", {})
    monkeypatch.setattr(_gpu, "_streams", {})
    monkeypatch.setattr(_gpu, "_orphans", __import__("collections").deque())
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    yield drv, fake_cupy
    assert drv.ctx_stack == [], "unbalanced context push/pop"


def _emu_kernel(drv, name, fn, nargs):
    """A GpuFunction whose launches run ``fn`` in the emulated driver."""
    handle = drv._handle()
    drv.kernels[handle] = (fn, nargs)

    class Mod:
        variant = "emulated"

    return _gpu.GpuFunction(name, handle, 0, Mod())


def _scale_kernel(drv):
    def fn(grid, block, raw):  # (const float* src, float* dst, u32 n): dst = 2 * src
        src, dst = (int.from_bytes(r, "little") for r in raw[:2])
        n = int.from_bytes(raw[2][:4], "little")
        s = np.ctypeslib.as_array((ctypes.c_float * n).from_address(src))
        d = np.ctypeslib.as_array((ctypes.c_float * n).from_address(dst))
        d[:] = 2 * s

    return _emu_kernel(drv, "scale", fn, 3)


def test_emulated_stream_ops(emu):
    drv, fake_cupy = emu
    a = EmuArray(np.zeros(8, np.uint32))
    b = EmuArray(np.arange(8, dtype=np.uint32))
    s = _gpu.current_stream(a)
    assert stream_for(a) is s and s.ptr == 0 and s.backend == "gpu"
    s.memset_d32(a, 0xDEADBEEF, count=3, offset_bytes=8)
    s.copy(a, b, nbytes=8, dst_offset=24, src_offset=4)
    host = np.array([7, 9], np.uint32)
    s.copy_from_host(a, host)
    host[:] = 0
    s.memset_d32(a, -1, count=1, offset_bytes=4)
    assert a.host.tolist() == [7, 0xFFFFFFFF, 0xDEADBEEF, 0xDEADBEEF, 0xDEADBEEF, 0, 1, 2]
    assert len(s._inflight) == 1
    s.synchronize()
    assert not s._inflight and len(s._free_events) == 1


def test_emulated_host_copy_queue_is_reaped_lazily(emu):
    drv, fake_cupy = emu
    a = EmuArray(np.zeros(4, np.int32))
    s = _gpu.current_stream(a)
    for i in range(10):
        s.copy_from_host(a, np.full(4, i, np.int32))
    assert a.host.tolist() == [9] * 4
    # each event completes at its third query: a few copies stay in flight, the
    # rest were released and their events reused, and nothing waited
    assert 0 < len(s._inflight) < 10
    assert len(drv.events) == len(s._inflight) + len(s._free_events) < 10
    s.synchronize()
    assert not s._inflight


def test_a_stream_collected_later_keeps_its_events_to_its_own_driver(emu, monkeypatch):
    """A CuPy stream collected after the driver state was replaced (another
    test's emulated driver, here) retires its copies into the queue and
    driver it was made with, never into the new ones."""
    import gc

    drv, fake_cupy = emu
    a = EmuArray(np.zeros(4, np.int32))
    s = _gpu.current_stream(a)
    for i in range(4):
        s.copy_from_host(a, np.full(4, i, np.int32))
    assert s._inflight
    old_orphans = _gpu._orphans
    new_drv, new_orphans = FakeDriver(), __import__("collections").deque()
    monkeypatch.setattr(_gpu, "_drv", new_drv)
    monkeypatch.setattr(_gpu, "_orphans", new_orphans)
    fake_cupy.current = FakeCupyStream(0)  # the old CuPy stream object goes away
    del s
    gc.collect()
    assert not new_orphans and old_orphans
    monkeypatch.setattr(_gpu, "_drv", drv)


def test_emulated_optin_counts_static_shared_memory(emu):
    """Static + dynamic shared memory may total 48 KiB without opting in, so a
    kernel with static shared memory opts in below 48 KiB of dynamic."""
    drv, _ = emu
    k = _scale_kernel(drv)
    k2 = _gpu.GpuFunction("scale_static", k.handle, 0, k._module, static_smem=4096)
    assert k2._smem_optin == 44 * 1024
    x = EmuArray(np.arange(16, dtype=np.float32))
    y = EmuArray(np.zeros(16, np.float32))
    s = _gpu.current_stream(x)
    s.launch(k2, 1, 16, (x, y, np.uint32(16)), shared_mem=44 * 1024)
    assert k2.handle not in drv.func_attrs
    s.launch(k2, 1, 16, (x, y, np.uint32(16)), shared_mem=46 * 1024)
    assert drv.func_attrs[k2.handle] == 46 * 1024


def test_emulated_launch_and_smem_optin(emu):
    drv, _ = emu
    k = _scale_kernel(drv)
    x = EmuArray(np.arange(16, dtype=np.float32))
    y = EmuArray(np.zeros(16, np.float32))
    s = _gpu.current_stream(x)
    s.launch(k, (1,), (16,), (x, y, np.uint32(16)))
    assert y.host.tolist() == (2 * np.arange(16)).tolist()
    s.launch(k, 1, 16, (x, y, np.uint32(16)), shared_mem=64 * 1024)
    assert drv.func_attrs[k.handle] == 64 * 1024
    s.launch(k, 1, 16, (x, y, np.uint32(16)), shared_mem=32 * 1024)
    assert drv.func_attrs[k.handle] == 64 * 1024  # not lowered, not set again
    s.launch(k, 1, 16, (x, y, np.uint32(16)), shared_mem=100 * 1024)
    assert drv.func_attrs[k.handle] == 100 * 1024
    s.launch(k, (0, 1, 1), 16, (x, y, np.uint32(16)))  # empty grid: nothing issued
    with pytest.raises(PagedAttentionError, match="expected a GPU kernel"):
        s.launch(object(), 1, 1, ())


DEPENDENT_CASES = [("90", "1", True), ("100", "1", True), ("90", None, False), ("90", "0", False), ("86", "1", False)]


@pytest.mark.parametrize("cc, env, expect", DEPENDENT_CASES)
def test_emulated_dependent_launch(emu, monkeypatch, cc, env, expect):
    """A dependent launch (the split merge's) with CUPAGED_PDL=1 on compute
    capability 9.0 and later is cuLaunchKernelEx with programmatic stream
    serialization allowed, and nothing else, eagerly and while capturing;
    an ordinary cuLaunchKernel below 9.0 and without CUPAGED_PDL=1 (the
    default); a launch not asked to be dependent is always ordinary. Grid,
    block, shared memory, stream and the parameters reach the kernel either
    way."""
    from cupaged._runtime import stream as _stream

    drv, fake_cupy = emu
    fake_cupy.cc = cc
    fake_cupy.current = FakeCupyStream(0x6000)
    if env is None:
        monkeypatch.delenv(_stream.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(_stream.PDL_ENV, env)
    seen = []

    def fn(grid, block, raw):
        seen.append((grid, block, int.from_bytes(raw[2][:4], "little")))
        _scale_kernel_body(raw)

    k = _emu_kernel(drv, "scale", fn, 3)
    x = EmuArray(np.arange(8, dtype=np.float32))
    y = EmuArray(np.zeros(8, np.float32))
    s = _gpu.current_stream(x)
    s.launch(k, (2, 3, 1), (8,), (x, y, np.uint32(8)), shared_mem=64 * 1024, dependent=True)
    s.launch(k, 1, 8, (x, y, np.uint32(8)))
    s.begin_capture()
    s.launch(k, 1, 8, (x, y, np.uint32(8)), dependent=True)
    s.end_capture()
    pdl = {drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: 1}
    assert drv.launches == ([pdl, None, pdl] if expect else [None, None, None])
    assert seen[0] == ((2, 3, 1), (8, 1, 1), 8) and y.host.tolist() == (2 * np.arange(8)).tolist()


def _scale_kernel_body(raw):
    src, dst = (int.from_bytes(r, "little") for r in raw[:2])
    n = int.from_bytes(raw[2][:4], "little")
    s = np.ctypeslib.as_array((ctypes.c_float * n).from_address(src))
    d = np.ctypeslib.as_array((ctypes.c_float * n).from_address(dst))
    d[:] = 2 * s


def test_emulated_capture_and_replay(emu):
    drv, fake_cupy = emu
    fake_cupy.current = FakeCupyStream(0x5000)
    k = _scale_kernel(drv)
    x = EmuArray(np.arange(8, dtype=np.float32))
    y = EmuArray(np.zeros(8, np.float32))
    a = EmuArray(np.zeros(4, np.uint32))
    b = EmuArray(np.zeros(4, np.uint32))
    c = EmuArray(np.zeros(4, np.uint32))
    s = _gpu.current_stream(x)
    assert s.ptr == 0x5000
    src = np.array([1, 2, 3, 4], np.uint32)
    s.begin_capture()
    assert s.capturing
    s.memset_d32(a, 5, count=4)
    s.copy(b, a)
    s.memset_d32(a, 6, count=1)
    s.launch(k, 1, 8, (x, y, np.uint32(8)))
    s.copy_from_host(c, src)
    g = s.end_capture()
    assert not s.capturing and not s._inflight  # a captured host copy is kept by the graph
    src[:] = 0
    assert a.host.tolist() == [0] * 4 and y.host.tolist() == [0] * 8 and c.host.tolist() == [0] * 4
    g.launch()
    assert a.host.tolist() == [6, 5, 5, 5] and b.host.tolist() == [5] * 4 and c.host.tolist() == [1, 2, 3, 4]
    assert y.host.tolist() == (2 * np.arange(8)).tolist()
    x.host *= -1
    c.host[:] = 0
    g.launch()
    assert y.host.tolist() == (-2 * np.arange(8)).tolist() and c.host.tolist() == [1, 2, 3, 4]
    keep = g._keep_alive
    assert any(o is k for o in keep) and any(o is y for o in keep) and any(o is c for o in keep)
    assert len(keep) > 5


def test_emulated_capture_errors(emu):
    drv, fake_cupy = emu
    a = EmuArray(np.zeros(4, np.uint32))
    s = _gpu.current_stream(a)  # the legacy default stream
    with pytest.raises(PagedAttentionError, match="default stream"):
        s.begin_capture()
    fake_cupy.current = FakeCupyStream(0x6000)
    s = _gpu.current_stream(a)
    s.begin_capture()
    with pytest.raises(RuntimeError, match="cuStreamSynchronize failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        s.synchronize()
    with pytest.raises(RuntimeError, match="cuStreamEndCapture failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        s.end_capture()
    assert not s.capturing
    s.memset_d32(a, 3, count=4)
    assert a.host.tolist() == [3] * 4


def test_emulated_stream_cache_follows_stream_objects(emu):
    drv, fake_cupy = emu
    a = EmuArray(np.zeros(4, np.uint32))
    s0 = _gpu.current_stream(a)
    other = FakeCupyStream(0x7000)
    fake_cupy.current = other
    s1 = _gpu.current_stream(a)
    assert s1 is not s0 and _gpu.current_stream(a) is s1
    s1.copy_from_host(a, np.ones(4, np.uint32))  # leaves a copy "in flight"
    fake_cupy.current = FakeCupyStream(0x7000)  # a new stream object with the same handle
    s2 = _gpu.current_stream(a)
    assert s2 is not s1 and len(_gpu._orphans) == 1  # the old one's staging buffer is kept
    del other
    fake_cupy.current = FakeCupyStream(0)
    assert _gpu.current_stream(a) is not s0  # another object with handle 0: a new wrapper


def test_missing_gpu_pieces_name_the_extra():
    """Without cuda-python, the GPU backend and NVRTC say which extra to install."""
    code = (
        "import sys\n"
        "sys.modules['cuda'] = None\n"  # as if cuda-python were not installed
        "sys.modules['cuda.bindings'] = None\n"
        "from cupaged import PagedAttentionError, CompileError\n"
        "from cupaged._runtime import gpu, nvrtc\n"
        "for f, err in ((gpu.driver_module, PagedAttentionError), (nvrtc.nvrtc_module, CompileError)):\n"
        "    try:\n"
        "        f()\n"
        "        print('no error')\n"
        "    except err as e:\n"
        "        print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr[-2000:])
    assert "needs cuda-python" in lines[0] and "pip install 'cupaged[cuda1" in lines[0], lines[0]
    assert "needs cuda-python" in lines[1] and "cupaged[gate]" in lines[1], lines[1]
