"""cupaged: framework-free paged attention on plain CuPy arrays.

NumPy arrays run the same CUDA C kernels on the CPU backend; CuPy arrays run
them on the GPU. See README.md and docs/layout.md.
"""
from .errors import CompileError, KernelError, PagedAttentionError
from .plan import MAX_SPLITS, DevicePlan, HostPlan, SplitWorkspace, choose_splits
from .stream import Graph, Stream, stream_for

__version__ = "0.1.0"


def argmax_into(logits, out):
    """Row-wise argmax of logits [batch, vocab] into out int64 [batch]."""
    from .rowwise import argmax_into as _argmax_into
    return _argmax_into(logits, out)


__all__ = [
    "CompileError", "KernelError", "PagedAttentionError", "MAX_SPLITS", "DevicePlan", "HostPlan",
    "SplitWorkspace", "choose_splits", "Graph", "Stream", "stream_for", "argmax_into",
]
