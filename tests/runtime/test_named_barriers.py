"""Named barriers on the CPU backend (PTX ISA bar.sync / bar.arrive with an
id and a thread count), through kernels_cu/attention/warpgroup.cuh's
wrappers: warpgroups taking turns (FlashAttention-3's ping-pong), a producer
warp signalling consumers, and the errors a GPU would hang or misbehave on.
The fibers run in thread order until one parks, so without a working barrier
every check below sees the wrong order."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged.errors import KernelError

KERNELS = r"""
extern "C" __global__ void pingpong(int* log, int turns) {
    // Two warpgroups alternate: warpgroup w waits on barrier 1 + w (its turn), logs it, hands the turn on.
    __shared__ int pos;
    const unsigned wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) pos = 0;
    __syncthreads();
    if (wg == 1) wgb::arrive(1, 256);  // warpgroup 0 goes first
    for (int i = 0; i < turns; ++i) {
        wgb::sync(1 + wg, 256);  // @PP_SYNC
        if ((threadIdx.x & 127u) == 0) log[pos++] = (int)wg;
        wgb::arrive(2 - wg, 256);
    }
    wgb::regs_inc<240>();  // a no-op here
}

extern "C" __global__ void producer(int* out) {
    // Warp 3 writes, then arrives on barrier 3 (128 threads); warps 0 .. 2 wait there and read.
    __shared__ int v[4];
    if (threadIdx.x >> 5 == 3) {
        if ((threadIdx.x & 31u) < 4) v[threadIdx.x & 31u] = 100 + (int)(threadIdx.x & 31u);
        wgb::arrive(3, 128);
    } else {
        wgb::sync(3, 128);
        out[threadIdx.x] = v[threadIdx.x & 3u];
    }
}

extern "C" __global__ void bad_id(int* out) { wgb::sync((unsigned)out[0], 64); }
extern "C" __global__ void bad_count(int* out) { wgb::sync(1, (unsigned)out[0]); }
extern "C" __global__ void two_counts(int* out) {
    if (threadIdx.x < 32) wgb::arrive(2, 64);
    else wgb::sync(2, 96);  // @TWO_B
}
extern "C" __global__ void waits_forever(int* out) {
    if (threadIdx.x < 32) wgb::sync(4, 64);  // @FOREVER
    out[threadIdx.x] = 1;
}
"""


def line_of(marker: str) -> int:
    for i, line in enumerate(KERNELS.splitlines(), start=1):
        if f"// @{marker}" in line:
            return i
    raise AssertionError(marker)


@pytest.fixture(scope="module")
def mod():
    header = _source.read_source(_source.kernel_dir() / "attention" / "warpgroup.cuh")
    return _cpu.load_module(header + '#line 1 "named_barriers.cu"\n' + KERNELS, "named_barriers")


def run(mod, name, threads, *args):
    mod.get_function(name).bind((1, 1, 1), (threads, 1, 1), 0, args)()


def test_pingpong_alternates(mod):
    log = np.full(10, -1, np.int32)
    run(mod, "pingpong", 256, log, np.int32(5))
    assert log.tolist() == [0, 1] * 5


def test_arrive_does_not_wait_and_sync_waits_for_the_count(mod):
    out = np.zeros(128, np.int32)
    run(mod, "producer", 128, out)
    assert out[:96].tolist() == [100 + (t & 3) for t in range(96)] and not out[96:].any()


@pytest.mark.parametrize(
    "name,arg,want",
    [
        ("bad_id", 0, "bar.sync(0, 64)"),
        ("bad_id", 16, "barrier ids 1 .. 15"),
        ("bad_count", 48, "a multiple of 32"),
        ("bad_count", 96, "at most the block's"),
    ],
)
def test_bad_ids_and_counts(mod, name, arg, want):
    with pytest.raises(KernelError) as e:
        run(mod, name, 64, np.array([arg], np.int32))
    assert want in str(e.value)


def test_one_barrier_one_count(mod):
    with pytest.raises(KernelError) as e:
        run(mod, "two_counts", 128, np.zeros(1, np.int32))
    msg = str(e.value)
    assert f"bar.sync(2, 96) at named_barriers.cu:{line_of('TWO_B')}" in msg and "in use with 64 threads" in msg


def test_a_barrier_never_complete_is_a_deadlock(mod):
    with pytest.raises(KernelError) as e:
        run(mod, "waits_forever", 64, np.zeros(64, np.int32))
    msg = str(e.value)
    assert "deadlock" in msg
    assert f"threads 0-31 wait at bar.sync(4, 64) named_barriers.cu:{line_of('FOREVER')} (32 of 64" in msg
    # the pool runs the next launch
    log = np.full(4, -1, np.int32)
    run(mod, "pingpong", 256, log, np.int32(2))
    assert log.tolist() == [0, 1, 0, 1]
