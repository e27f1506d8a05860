"""What tests and standalone kernel scripts need: float64 NumPy references
(``reference``, the independent oracle) and random paged cases with
per-dtype tolerances (``cases``); small random Hugging Face-style
checkpoints written with NumPy (``checkpoints``)."""

from __future__ import annotations

from . import reference
from .cases import (
    PAGE_SENTINEL,
    MlaCase,
    PagedCase,
    PagedLayout,
    as_dtype,
    assert_close,
    make_layout,
    make_mla_case,
    make_paged_case,
    random_lengths,
    random_page_table,
    tolerance,
)
from .checkpoints import random_weights, save_safetensors, tiny_config, write_random_checkpoint

__all__ = [
    "reference",
    "PAGE_SENTINEL",
    "MlaCase",
    "PagedCase",
    "PagedLayout",
    "as_dtype",
    "assert_close",
    "make_layout",
    "make_mla_case",
    "make_paged_case",
    "random_lengths",
    "random_page_table",
    "tolerance",
    "random_weights",
    "save_safetensors",
    "tiny_config",
    "write_random_checkpoint",
]
