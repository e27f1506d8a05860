"""Kernel arguments passed by value as a C struct (cupaged/_runtime/structs.py):
one field table gives the C declaration and the NumPy dtype; the CPU
launcher checks the size against the compiled parameter (code ``x<N>``),
copies the bytes at bind and keeps the arrays the struct addresses alive;
the GPU launcher passes the same bytes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import gpu as _gpu
from cupaged._runtime.stream import CpuStream
from cupaged._runtime.structs import Field, StructArg, c_struct, struct_dtype
from cupaged.errors import PagedAttentionError

# Mixed sizes, so that C alignment inserts padding (after `half`, and at the end).
FIELDS = (
    Field("src", "const float*", "[n]"),
    Field("dst", "float*", "[n]"),
    Field("n", "u32", ""),
    Field("scale", "float", ""),
    Field("half", "u32", ""),
    Field("tag", "u64", ""),
    Field("last", "int", ""),
)
DTYPE = struct_dtype(FIELDS)

SOURCE = (
    c_struct("Args", FIELDS)
    + """
extern "C" __global__ void scale_add(const Args a, float extra) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.dst[i] = a.src[i] * a.scale + (float)(a.tag & 0xffu) + (float)a.half + (float)a.last + extra;
}
struct Pair { unsigned lo, hi; };
extern "C" __global__ void pair_sum(const Pair p, unsigned* out) { out[0] = p.lo + p.hi; }
"""
)


@pytest.fixture(scope="module")
def mod():
    return _cpu.load_module("typedef unsigned int u32;\ntypedef unsigned long long u64;\n" + SOURCE, "struct_args")


def pack(src, dst, n, scale=2.0, half=3, tag=0x1234, last=-5):
    value = np.array((src.ctypes.data, dst.ctypes.data, n, scale, half, tag, last), dtype=DTYPE)[()]
    return StructArg(value, (src, dst))


def test_layout_follows_c():
    assert DTYPE.itemsize == 48 and DTYPE.isalignedstruct
    assert [DTYPE.fields[f.name][1] for f in FIELDS] == [0, 8, 16, 20, 24, 32, 40]
    assert DTYPE["src"] == np.uint64 and DTYPE["scale"] == np.float32
    text = c_struct("Args", FIELDS)
    assert "const float* __restrict__ src;" in text and "u64 tag;" in text
    assert 'static_assert(sizeof(Args) == 48, "Args: the NumPy dtype packs 48 bytes");' in text


def test_param_codes(mod):
    f = mod.get_function("scale_add")
    assert f.param_codes == ("x48", "f4") and f.param_types[0] == "Args"
    assert mod.get_function("pair_sum").param_codes == ("x8", "p")


def test_struct_argument_runs(mod):
    src = np.arange(70, dtype=np.float32)
    dst = np.zeros(70, np.float32)
    mod.get_function("scale_add").bind((3, 1, 1), (32, 1, 1), 0, (pack(src, dst, 65), np.float32(0.5)))()
    want = src[:65] * 2.0 + 0x34 + 3 - 5 + 0.5
    np.testing.assert_array_equal(dst[:65], want)
    assert (dst[65:] == 0).all()
    # A bare structured scalar works too (nothing kept alive by it).
    out = np.zeros(1, np.uint32)
    pair = np.array((7, 35), dtype=np.dtype([("lo", np.uint32), ("hi", np.uint32)], align=True))[()]
    mod.get_function("pair_sum").bind((1, 1, 1), (1, 1, 1), 0, (pair, out))()
    assert out[0] == 42


def test_values_frozen_and_arrays_kept_alive(mod):
    """bind copies the struct's bytes (a graph replays them) and holds the
    arrays the StructArg names until the bound launch goes."""
    src = np.ones(32, np.float32)
    dst = np.zeros(32, np.float32)
    arg = pack(src, dst, 32)
    bound = mod.get_function("scale_add").bind((1, 1, 1), (32, 1, 1), 0, (arg, np.float32(0)))
    arg.value["scale"] = 100.0  # after bind: not seen
    alive = weakref.ref(src)
    del src, arg
    gc.collect()
    assert alive() is not None
    bound()
    np.testing.assert_array_equal(dst, np.full(32, 2.0 + 0x34 + 3 - 5, np.float32))
    del bound
    gc.collect()
    assert alive() is None


def test_capture_keeps_struct_arrays(mod):
    stream = CpuStream()
    src = np.ones(32, np.float32)
    dst = np.zeros(32, np.float32)
    stream.begin_capture()
    stream.launch(mod.get_function("scale_add"), (1,), (32,), (pack(src, dst, 32), np.float32(1)))
    graph = stream.end_capture()
    alive = weakref.ref(src)
    del src
    gc.collect()
    assert alive() is not None
    graph.launch()
    assert dst[0] == 2.0 + 0x34 + 3 - 5 + 1


@pytest.mark.parametrize(
    "bad, msg",
    [
        (
            lambda s, d: np.array((1, 2), dtype=[("a", np.uint64), ("b", np.uint32)])[()],
            r"argument 0 of kernel scale_add \(Args\): expected a structured NumPy scalar of 48 bytes \(the struct's "
            r"size\), got 12 bytes",
        ),
        (
            lambda s, d: np.uint64(5),
            r"argument 0 .*expected a structured NumPy scalar \(np.void\) of 48 bytes, got "
            r"numpy.uint64",
        ),
        (lambda s, d: 5, r"argument 0 .*Python int"),
        (lambda s, d: s, r"argument 0 .*got a NumPy array"),
    ],
)
def test_struct_argument_errors(mod, bad, msg):
    src, dst = np.ones(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(PagedAttentionError, match=msg):
        mod.get_function("scale_add").bind((1, 1, 1), (4, 1, 1), 0, (bad(src, dst), np.float32(0)))
    with pytest.raises(
        PagedAttentionError,
        match=r"argument 1 of kernel pair_sum .*expected a NumPy array, got a "
        r"struct \(StructArg\)",
    ):
        mod.get_function("pair_sum").bind(
            (1, 1, 1), (1, 1, 1), 0, (np.zeros(1, [("lo", "u4"), ("hi", "u4")])[0], pack(src, dst, 4))
        )


def test_struct_arg_needs_a_structured_scalar():
    with pytest.raises(TypeError, match="expected a structured NumPy scalar"):
        StructArg(np.uint32(3))


def test_gpu_pack_args_passes_the_bytes():
    """GPU launches pass a struct parameter's bytes as cuLaunchKernel reads
    them: the slot points at a copy of the structured scalar."""
    src, dst = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    arg = pack(src, dst, 4)
    for a in (arg, arg.value):
        slots, holders = _gpu.pack_args((a, np.uint32(9)), "k")
        raw = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 48).from_address(slots[0]))).tobytes()
        assert raw == arg.value.tobytes()
        assert slots[0] % 8 == 0 and len(holders) == 2
