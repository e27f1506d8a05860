"""Backend dispatch: the compiled kernel for an array's backend and device,
and the stream its work goes to. The only place that chooses between the
CPU backend (``cpu``) and the GPU backend (``gpu``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import PagedAttentionError
from . import cpu, gpu, source
from .arrays import CPU, GPU, Array, array_backend, device_id
from .stream import CpuStream, Stream

_kernels: dict[tuple, Any] = {}


def get_kernel(like: Array, source_path: str | Path, kernel: str, defines: dict | None = None) -> Any:
    """The compiled kernel ``kernel`` of ``source_path`` (a ``kernels_cu`` stem
    such as ``"attention/decode"``, or a path) with ``defines``, for the
    backend and device of ``like``.

    Cached in process per (backend, device, variant); each backend also
    caches compiled variants on disk. Returns an object with
    ``bind(grid, block, shared_mem, args)`` (CPU) or ``launch(...)`` (GPU);
    use it through a Stream, not directly.
    """
    backend = array_backend(like)
    dev = device_id(like)
    key = (backend, dev, str(source_path), tuple(sorted((defines or {}).items())), kernel)
    fn = _kernels.get(key)
    if fn is not None:
        return fn
    stem = source.stem_of(source_path)
    variant = source.variant_name(stem, defines)
    text = source.assemble(source_path, defines)
    if backend == CPU:
        fn = cpu.load_module(text, variant).get_function(kernel)
    elif backend == GPU:
        target = str((defines or {}).get("CP_TARGET", "")) or None  # an arch-specific build (sm_90a)
        fn = gpu.load_module(text, variant, dev, target).get_function(kernel)
    else:
        raise PagedAttentionError(f"like: expected a NumPy or CuPy array, got {type(like).__name__}")
    _kernels[key] = fn
    return fn


_cpu_stream: CpuStream | None = None


def stream_for(like: Array) -> Stream:
    """The stream work on ``like``'s backend goes to: the CPU stream for a
    NumPy array, CuPy's current stream on ``like``'s device for a CuPy array."""
    global _cpu_stream
    backend = array_backend(like)
    if backend == CPU:
        if _cpu_stream is None:
            _cpu_stream = CpuStream()
        return _cpu_stream
    if backend == GPU:
        return gpu.current_stream(like)
    raise PagedAttentionError(f"like: expected a NumPy or CuPy array, got {type(like).__name__}")


def multiprocessor_count(like: Array) -> int:
    """SMs of ``like``'s GPU, or the CPU backend's worker count."""
    if array_backend(like) == GPU:
        return gpu.multiprocessor_count(device_id(like))
    return cpu.configured_workers()
