"""Adapters that run cupaged's kernels inside other engines.

* ``cupaged.integrations.vllm``: a vLLM attention backend plugin
  (``attention_backend="CUSTOM"``; docs/vllm.md). Needs the ``vllm`` extra.

Nothing here is imported by ``import cupaged``.
"""
