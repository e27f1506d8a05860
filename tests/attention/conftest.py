"""Fixtures of the attention tests: which kernels a test launched."""

from __future__ import annotations

import pytest

from cupaged.ops import attention
from cupaged.ops.attention import launch


@pytest.fixture
def kernels_used(monkeypatch):
    """Names of the kernels the attention launch fetches while the test runs."""
    names = []
    real = launch.get_kernel

    def spy(like, source, kernel, defines=None):
        names.append(kernel)
        return real(like, source, kernel, defines)

    monkeypatch.setattr(launch, "get_kernel", spy)
    return names


@pytest.fixture
def launches(monkeypatch):
    """(kernel, q_begin, q_count, blocks along x) of every launch
    launch_attention issues (q_begin and q_count None for the merge), in
    launch order: its stream is wrapped for the test."""
    log = []
    real = attention.launch_call

    class Spy:
        def __init__(self, stream):
            self.stream = stream
            self.backend = stream.backend

        def launch(self, kernel, grid, block, args, shared_mem=0, dependent=False):
            attn = kernel.name != "attention_split_merge"
            params = args[0]  # the AttentionParams struct (ops/attention/params.py)
            log.append(
                (
                    kernel.name,
                    int(params["q_begin"]) if attn else None,
                    int(params["q_count"]) if attn else None,
                    grid[0] if isinstance(grid, tuple) else grid,
                )
            )
            return self.stream.launch(kernel, grid, block, args, shared_mem=shared_mem, dependent=dependent)

    monkeypatch.setattr(attention, "launch_call", lambda call, stream=None: real(call, Spy(stream or call.plan.stream)))
    return log


@pytest.fixture(params=["sm_90", "sm_80"])
def mla_arch(request, xp_backend):
    """Each MLA tensor-core build on its arch: sm_90 runs paged_mla_wgmma
    (wgmma, sm_90a), sm_80 paged_mla_tc (mma.sync). The CPU backend stands in
    for the arch (cupaged._runtime.cpu_arch_override); on a GPU the device's
    own arch decides, and the other parameter is skipped. Yields the kernel
    name the step should launch."""
    from cupaged._runtime import archs

    kernel = {"sm_90": "paged_mla_seesaw", "sm_80": "paged_mla_tc"}[request.param]
    if xp_backend.name == "gpu":
        import cupy

        if archs.device_arch(cupy.zeros(1)) != request.param:
            pytest.skip(f"the GPU is not {request.param}")
        yield kernel
        return
    with archs.cpu_arch_override(request.param):
        yield kernel


@pytest.fixture
def mma_sync_arch(xp_backend):
    """The CPU backend as sm_80 (cupaged._runtime.cpu_arch_override), where
    the tensor-core kernels are the mma.sync ones (paged_prefill_tc,
    paged_mla_tc; sm_90 selects paged_prefill_wgmma and paged_mla_wgmma); on
    a GPU only a device below sm_90 runs the test."""
    from cupaged._runtime import archs

    if xp_backend.name == "gpu":
        import cupy

        if archs.device_arch(cupy.zeros(1)) == "sm_90":
            pytest.skip("sm_90 selects the wgmma kernels")
        yield
        return
    with archs.cpu_arch_override("sm_80"):
        yield
