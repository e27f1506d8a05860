"""Shared test setup.

* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, when CuPy
  cannot be imported or sees no usable CUDA device; on a GPU machine they run
  unchanged.
* ``xp_backend``: a fixture parametrized over the CPU backend (NumPy) and the
  GPU backend (CuPy, marked ``gpu``), giving an object with ``name``, ``xp``
  (the array module), ``asarray(x)`` (NumPy -> that backend) and
  ``to_numpy(a)``.
* ``CUPAGED_QUIET=1``: no progress notices on stderr (unless a test asks).
* ``CUPAGED_BLAS_ONE_THREAD_ROWS=32``: the engine's small host products on one
  BLAS thread (the CPUs are busy with one pytest worker each).
* ``CUPAGED_CPU_SPIN_US=0``: idle CPU worker threads sleep at once (a polling one
  would take a core from the other pytest worker).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import pytest

# Progress notices and bars (cupaged._runtime.progress) stay off in the tests, so
# that what a test reads from stderr does not depend on which test built a kernel
# first; tests/runtime/test_progress.py turns them on where it checks them.
os.environ.setdefault("CUPAGED_QUIET", "1")
os.environ.setdefault("CUPAGED_BLAS_ONE_THREAD_ROWS", "32")
os.environ.setdefault("CUPAGED_CPU_SPIN_US", "0")


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when CuPy imports and sees a CUDA device, else why not."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return f"CuPy cannot be imported ({type(e).__name__}: {e})"
    try:
        if not cupy.cuda.is_available():
            return "no CUDA GPU visible to CuPy (cupy.cuda.is_available() is False)"
    except Exception as e:
        return f"CuPy cannot query CUDA devices ({type(e).__name__}: {e})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if reason is None:
            reason = gpu_unavailable_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "gpu"
    xp: object

    def asarray(self, x):
        return self.xp.asarray(x)

    def to_numpy(self, a):
        return a.get() if self.name == "gpu" else np.asarray(a)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def xp_backend(request) -> Backend:
    if request.param == "gpu":
        import cupy

        return Backend("gpu", cupy)
    return Backend("cpu", np)
