"""Fixtures of the attention tests: which kernels a test launched."""
from __future__ import annotations

import pytest

from cupaged.ops import attention
from cupaged.ops.attention import launch

@pytest.fixture
def kernels_used(monkeypatch):
    """Names of the kernels launch_attention fetches while the test runs."""
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
    real = attention.launch_attention

    class Spy:
        def __init__(self, stream):
            self.stream = stream

        def launch(self, kernel, grid, block, args, shared_mem=0):
            attn = kernel.name != "attention_split_merge"
            params = args[0]    # the AttentionParams struct (ops/attention/params.py)
            log.append((kernel.name, int(params["q_begin"]) if attn else None,
                        int(params["q_count"]) if attn else None, grid[0] if isinstance(grid, tuple) else grid))
            return self.stream.launch(kernel, grid, block, args, shared_mem=shared_mem)

    monkeypatch.setattr(attention, "launch_attention", lambda stream, *a, **k: real(Spy(stream), *a, **k))
    return log
