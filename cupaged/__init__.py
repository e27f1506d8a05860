"""cupaged: framework-free paged attention on plain CuPy arrays.

NumPy arrays run the same CUDA C kernels on the CPU backend; CuPy arrays run
them on the GPU. See README.md and docs/layout.md (its "Where things are"
section maps the package).
"""

from ._runtime import Graph, Stream, stream_for
from .batch import DecodeBatch, Readback
from .cache import PagedKVCache, Sequence, StepReport
from .errors import CheckpointError, CompileError, ConfigError, KernelError, PagedAttentionError, SetupError
from .graph import DecodeLoop, DeviceScalars, PagedDecodeLoop, capture_count, capture_graph
from .layout import MAX_SPLITS
from .ops.append import Rotary
from .ops.attention import AttentionOptions, KVLayer
from .ops.sampling import argmax_into
from .ops.slots import copy_pages, write_slots
from .plan import DevicePlan, DevicePlanBuilder, HostPlan, SplitWorkspace, choose_splits
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "CompileError",
    "KernelError",
    "PagedAttentionError",
    "MAX_SPLITS",
    "DevicePlan",
    "DevicePlanBuilder",
    "HostPlan",
    "SplitWorkspace",
    "choose_splits",
    "AttentionOptions",
    "KVLayer",
    "Rotary",
    "Graph",
    "Stream",
    "stream_for",
    "argmax_into",
    "PagedKVCache",
    "DecodeLoop",
    "DeviceScalars",
    "PagedDecodeLoop",
    "capture_graph",
    "capture_count",
    "DecodeBatch",
    "Readback",
    "SamplingParams",
    "Sequence",
    "StepReport",
    "write_slots",
    "copy_pages",
    "Engine",
    "ConfigError",
    "CheckpointError",
    "SetupError",
]


def __getattr__(name):
    # cupaged.Engine on first use: the engine (config checks, safetensors,
    # the forward passes) stays out of ``import cupaged``.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'cupaged' has no attribute {name!r}")
