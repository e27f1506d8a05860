"""The ops: checks and launches of each kernel family, on any backend.

Each module registers the kernel variants it may build (the NVRTC gate
compiles them all) and exposes functions that check their inputs, then
launch on a stream; none allocates on a hot path or synchronizes.

* ``attention``: paged attention and MLA (decode, chunked prefill, split-KV)
* ``append``: writing K/V rows into pages; copying pages
* ``slots``: engine-level writes by slot mapping and page copies (vLLM semantics)
* ``advance``: moving a plan forward on the device (decode graphs)
* ``plan_build``: a step's plan words built on the device from an engine's device metadata
* ``sampling``: argmax over logits
* ``sample``: per-slot sampling (temperature, top-k/p, min-p, penalties, seeds, logprobs)
* ``layers``: embedding, RMSNorm, linear, RoPE, SwiGLU
"""

from __future__ import annotations

from . import advance, append, attention, layers, plan_build, sample, sampling, slots

__all__ = ["advance", "append", "attention", "layers", "plan_build", "sample", "sampling", "slots"]
