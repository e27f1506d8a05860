"""A small inference engine on the stack: Hugging Face checkpoints of
supported architectures run on cupaged's page manager (``PagedKVCache``:
layers, reservations, prefix reuse), its decode graphs (``DecodeBatch``: one
captured graph per batch bucket) and its kernels, token for token as
transformers' greedy ``generate``.

    engine = cupaged.Engine.from_pretrained("path/to/model", like=cupy.zeros(1))
    outs = engine.generate([[1, 15043, 29892], [1, 450]], max_new_tokens=32)

Modules, one per concern:

* ``config``: config.json per architecture: checks, ``ModelConfig``
  (``ARCHITECTURES`` lists what runs and each check's docstring says what it
  refuses);
* ``rope``: rotary tables (default, linear, llama3, yarn);
* ``checkpoint``: safetensors files through memory maps, state dicts;
* ``gguf``: GGUF files (metadata as the config, dequantized tensors, the
  byte-level BPE tokenizer);
* ``text``: the tokenizer and chat template, incremental detokenizing,
  ``Completion``;
* ``projections``: the matrix products (cuBLAS on the GPU, the CPU kernels
  on the CPU backend);
* ``model``, ``dense``, ``mla``: the forward pass per architecture family
  (GQA: Llama, Mistral, Qwen2, Qwen3; MLA: DeepSeek-V2/V3 in absorbed form);
* ``scheduler``: continuous batching (chunked prefill between decode rounds);
* ``engine``: ``Engine`` (construction, ``generate``).
"""

from __future__ import annotations

from ..errors import CheckpointError, ConfigError
from .checkpoint import Checkpoint, SafetensorsFile
from .config import ARCHITECTURES, ModelConfig, RopeSpec, parse_config
from .engine import Engine

__all__ = [
    "Engine",
    "ConfigError",
    "CheckpointError",
    "ARCHITECTURES",
    "ModelConfig",
    "RopeSpec",
    "parse_config",
    "Checkpoint",
    "SafetensorsFile",
]
