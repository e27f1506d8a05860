"""The runtime under every op: which backend an array lives on, compiled
kernels for it, and the stream its work goes to. ``dispatch`` is the only
place that chooses between the CPU backend (``cpu``: g++ through the shim,
fibers) and the GPU backend (``gpu``: NVRTC through CuPy, cuda-python driver
streams).

Ops import from here; nothing here imports an op or a public concept.
"""

from __future__ import annotations

from . import archs, checks, registry
from .archs import cpu_arch, cpu_arch_override, device_arch, launchable
from .arrays import CPU, GPU, address, array_backend, backend_of, device_id, empty, xp_of, zeros
from .dispatch import get_kernel, multiprocessor_count, stream_for
from .registry import register
from .stream import CpuStream, Graph, Stream, check_not_capturing

__all__ = [
    "CPU",
    "GPU",
    "address",
    "array_backend",
    "backend_of",
    "device_id",
    "empty",
    "xp_of",
    "zeros",
    "checks",
    "registry",
    "register",
    "get_kernel",
    "multiprocessor_count",
    "stream_for",
    "Stream",
    "Graph",
    "CpuStream",
    "check_not_capturing",
    "archs",
    "cpu_arch",
    "cpu_arch_override",
    "device_arch",
    "launchable",
]
