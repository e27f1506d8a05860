"""GGUF checkpoints (llama.cpp's one-file format) through the ``gguf``
package (the ``gguf`` extra): the metadata as a ``ModelConfig``, the tensors
as a ``Checkpoint`` under transformers' names, dequantized at load, and the
tokenizer as a ``tokenizers.Tokenizer``.

    engine = cupaged.Engine.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf", like=np.zeros(1, np.float32))

What is read (everything else that affects the forward pass is refused with
a ConfigError or CheckpointError naming the key or tensor):

* architectures: ``general.architecture`` llama (Llama 2/3, SmolLM2, ...),
  qwen2 and qwen3 (``ARCHITECTURES``), run as transformers'
  LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM; the config is the
  ``<arch>.*`` keys transformers' GGUF loader reads (``CONFIG_KEYS``), the
  head dim from ``attention.key_length`` (else ``rope.dimension_count``, else
  hidden / heads), rope scaling none or linear, tied embeddings when there is
  no ``output.weight``, biases and q/k norms from the tensors present, the
  stop token ``tokenizer.ggml.eos_token_id``. Refused: mixture-of-experts,
  sliding windows, soft-capping and the other keys of ``REFUSED_KEYS``, yarn
  rope scaling, a ``rope_freqs`` tensor (Llama 3.1's rope scaling), per-layer
  head counts that differ, a rotary dim below the head dim;
* tensor types: ``DEQUANTIZED`` (F32, F16, BF16 as stored; Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1, Q4_K, Q5_K, Q6_K dequantized to float32 through
  ``gguf.quants.dequantize``: the types of llama.cpp's Q8_0, Q4_0 / Q4_1,
  Q5_0 / Q5_1, Q4_K_S/M, Q5_K_S/M and Q6_K files), each
  tensor when the engine reads it; any other type is refused when the file is
  opened, before any weight is read;
* llama.cpp's converter permutes the rows of Llama's q and k projections
  (weights and biases) from transformers' half-split rotary layout to
  interleaved pairs; the reader undoes it (``unpermute``), as transformers'
  GGUF loader does;
* the tokenizer: ``tokenizer.ggml.model`` gpt2 (byte-level BPE with the
  file's merges, as transformers' GGUF converter builds it: byte-level
  pre-tokenizer, or the split regex of ``tokenizer.ggml.pre`` for the kinds
  in ``PRE_TOKENIZER_SPLITS``; control tokens special, user-defined tokens
  added; a BOS prepended with ``tokenizer.ggml.add_bos_token``).
  Sentencepiece vocabularies (``llama``) are not converted.

Opened files are kept (``open_gguf``, the last two): the command line reads
the metadata, the tokenizer and the weights of one file once.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import KeysView
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import CheckpointError, ConfigError, SetupError
from .checkpoint import Checkpoint
from .config import ModelConfig, parse_config, token_ids

#: general.architecture -> the transformers architecture it runs as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: Architectures whose q / k rows llama.cpp's converter permutes.
PERMUTED = ("llama",)
#: GGML tensor types read, and the dtype each is returned in.
DEQUANTIZED = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bf16",
    "Q8_0": "float32",
    "Q4_0": "float32",
    "Q4_1": "float32",
    "Q5_0": "float32",
    "Q5_1": "float32",
    "Q4_K": "float32",
    "Q5_K": "float32",
    "Q6_K": "float32",
}
#: ``<arch>.`` metadata keys -> config.json fields (transformers' GGUF names).
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
#: ``<arch>.`` keys of features the engine does not run (refused when set).
REFUSED_KEYS = (
    "expert_count",
    "expert_used_count",
    "attention.sliding_window",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "attention.clamp_kqv",
    "logit_scale",
    "residual_scale",
    "embedding_scale",
    "attention.scale",
)
#: GGUF tensor names -> transformers names: the model's, and each layer's
#: (``blk.N.<key>.weight|bias`` -> ``model.layers.N.<value>.weight|bias``).
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: tokenizer.ggml.pre -> the split regex before the byte-level step (others:
#: GPT-2's byte-level regex), as transformers' GGUF converter.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
#: llama.cpp's token types: control tokens are special, user-defined ones added.
CONTROL, USER_DEFINED = 3, 4


def _gguf_module():
    try:
        import gguf  # the optional `gguf` extra
    except ImportError:
        raise SetupError(
            "reading a GGUF file needs the gguf package: pip install 'cupaged[gguf]' (or pip install gguf)"
        ) from None
    return gguf


class GGUFFile:
    """One GGUF file, parsed (``gguf.GGUFReader``, memory-mapped):
    ``metadata`` (key -> value: ints, floats, strings, lists),
    ``tensors`` (name -> the reader's tensor), ``arch`` (general.architecture)."""

    def __init__(self, path: str | os.PathLike[str]):
        gguf = _gguf_module()
        self.path = Path(path)
        self.name = self.path.name
        if not self.path.is_file():
            raise CheckpointError(f"path: expected a .gguf file, got {str(path)!r} (no such file)")
        try:
            with open(self.path, "rb") as fh:
                magic = fh.read(4)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e}") from None
        if magic != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file: expected the magic b'GGUF', got {magic!r}")
        try:
            reader = gguf.GGUFReader(self.path, "r")
            self.metadata = {k: f.contents() for k, f in reader.fields.items()}
        except Exception as e:  # noqa: BLE001 -- the reader raises ValueError / IndexError / struct errors
            raise CheckpointError(f"{self.path}: not a readable GGUF file: {type(e).__name__}: {e}") from None
        self.tensors = {t.name: t for t in reader.tensors}
        arch = self.metadata.get("general.architecture")
        self.arch = arch if isinstance(arch, str) else None
        self._types = {n: t.tensor_type.name for n, t in self.tensors.items()}

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def type_of(self, name: str) -> str:
        """The GGML type name of tensor ``name`` (F32, Q4_1, ...)."""
        return self._types[name]


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The parsed GGUF file at ``path`` (the last two opened are kept while
    unchanged on disk)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return GGUFFile(p)  # (its error)
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


# ---------------------------------------------------------------------------
# Config


def _scalar(g: GGUFFile, key: str, value: Any) -> Any:
    """A per-layer list that repeats one value -> that value (else refused)."""
    if isinstance(value, list):
        if value and all(v == value[0] for v in value):
            return value[0]
        raise ConfigError(f"{g.name}: {key}: expected one value for every layer, got {value!r}"[:300])
    return value


def gguf_config_dict(g: GGUFFile) -> dict:
    """The config.json dict the file's metadata describes (transformers'
    field names), every refused feature checked."""
    arch = g.arch
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{g.name}: general.architecture: expected one of {', '.join(map(repr, ARCHITECTURES))}, got {arch!r}"
        )
    for key in REFUSED_KEYS:
        v = g.value(f"{arch}.{key}")
        if v not in (None, 0, 0.0, False, []):
            raise ConfigError(f"{g.name}: {arch}.{key}: not supported by the engine; expected it unset, got {v!r}")
    raw: dict[str, Any] = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu"}
    for key, field in CONFIG_KEYS.items():
        v = g.value(f"{arch}.{key}")
        if v is not None:
            raw[field] = _scalar(g, f"{arch}.{key}", v)
    if "vocab_size" not in raw:
        tokens = g.value("tokenizer.ggml.tokens")
        emb = g.tensors.get("token_embd.weight")
        if isinstance(tokens, list) and tokens:
            raw["vocab_size"] = len(tokens)
        elif emb is not None:
            raw["vocab_size"] = int(emb.shape[-1])
    value_len = g.value(f"{arch}.attention.value_length")
    if value_len is not None and value_len != raw.get("head_dim", value_len):
        raise ConfigError(
            f"{g.name}: {arch}.attention.value_length: expected the key length {raw['head_dim']}, got {value_len!r}"
        )
    rot = g.value(f"{arch}.rope.dimension_count")
    if rot is not None:
        if arch == "llama" and "head_dim" not in raw:
            raw["head_dim"] = rot  # (transformers reads Llama's head_dim from rope.dimension_count)
        heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
        head_dim = raw.get("head_dim")
        if head_dim is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
            head_dim = hidden // heads
        if rot != head_dim:
            raise ConfigError(
                f"{g.name}: {arch}.rope.dimension_count: partial rotary embeddings are not supported; "
                f"expected the head dim {head_dim}, got {rot!r}"
            )
    raw["rope_scaling"] = _rope_scaling(g, arch)
    if "rope_freqs.weight" in g.tensors:
        raise ConfigError(
            f"{g.name}: tensor 'rope_freqs.weight': per-dim rope frequency factors (Llama 3.1's rope scaling) "
            f"are not supported; expected no rope_freqs tensor"
        )
    names = g.tensors.keys()
    raw["tie_word_embeddings"] = "output.weight" not in names
    if arch in ("llama", "qwen3"):  # (Qwen2's q / k / v always have biases, its o none)
        raw["attention_bias"] = "blk.0.attn_q.bias" in names
    raw["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    if arch == "qwen2" and "blk.0.attn_output.bias" in names:
        raise CheckpointError(f"{g.name}: tensor 'blk.0.attn_output.bias': Qwen2's o projection has no bias")
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = g.value(f"tokenizer.ggml.{key}")
        if v is not None:
            raw[field] = v
    return raw


def _rope_scaling(g: GGUFFile, arch: str) -> dict | None:
    kind = g.value(f"{arch}.rope.scaling.type")
    factor = g.value(f"{arch}.rope.scaling.factor", g.value(f"{arch}.rope.scale_linear"))
    if kind is None:
        kind = "linear" if factor not in (None, 1, 1.0) else "none"
    if kind == "none":
        return None
    if kind != "linear":
        raise ConfigError(
            f"{g.name}: {arch}.rope.scaling.type: expected 'none' or 'linear' (the rope scalings read from "
            f"GGUF), got {kind!r}"
        )
    return {"rope_type": "linear", "factor": factor}


def gguf_config(g: GGUFFile) -> ModelConfig:
    """The file's ModelConfig; ConfigError naming the GGUF key (and the
    config.json field it becomes) on anything the engine cannot run."""
    raw = gguf_config_dict(g)
    try:
        return parse_config(raw)
    except ConfigError as e:
        msg = str(e).replace("config.json: ", f"{g.name}: ", 1)
        for key, field in CONFIG_KEYS.items():
            msg = msg.replace(f": {field}:", f": {g.arch}.{key} ({field}):", 1)
        msg = msg.replace(": eos_token_id:", ": tokenizer.ggml.eos_token_id:", 1)
        raise ConfigError(msg) from None


def gguf_eos(g: GGUFFile) -> tuple[int, ...]:
    """The stop token: tokenizer.ggml.eos_token_id (none: ())."""
    return token_ids(f"{g.name}: tokenizer.ggml.eos_token_id", g.value("tokenizer.ggml.eos_token_id"))


# ---------------------------------------------------------------------------
# Tensors


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q / k row permutation: rows [n_head * D, ...] of
    interleaved rotary pairs (row h*D + 2i + s) back to transformers'
    half-split layout (row h*D + s*D/2 + i)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor name (None: not one the engine reads)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS and suffix == "weight":
        return f"{GLOBAL_TENSORS[base]}.weight"
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{int(m.group(1))}.{LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


class GGUFTensors:
    """The file's tensors under transformers' names, as the Checkpoint reads
    them: ``names``, ``info(name)`` -> (dtype, shape) without reading data,
    ``get(name)`` -> the dequantized (and for Llama's q / k, unpermuted) host
    array [out, in] (as transformers' weights)."""

    def __init__(self, g: GGUFFile, cfg: ModelConfig):
        self.g, self.path = g, g.path
        layers = cfg.layers
        self._map: dict[str, str] = {}
        supported = ", ".join(DEQUANTIZED)
        for name in g.tensors:
            hf = hf_name(name)
            m = _LAYER_NAME.fullmatch(name)
            if hf is None or (m and int(m.group(1)) >= layers):
                why = f" (block_count is {layers})" if hf is not None else ""
                raise CheckpointError(
                    f"{g.name}: tensor {name!r}: not a tensor of the {g.arch} models the engine runs{why}"
                )
            kind = g.type_of(name)
            if kind not in DEQUANTIZED:
                raise CheckpointError(
                    f"{g.name}: tensor {name!r}: type {kind} is not supported; expected one of {supported}"
                )
            self._map[hf] = name
        self._heads: dict[str, int] = {}
        if g.arch in PERMUTED:
            for i in range(layers):
                for proj, n in (("q_proj", cfg.heads), ("k_proj", cfg.kv_heads)):
                    for s in ("weight", "bias"):
                        self._heads[f"model.layers.{i}.self_attn.{proj}.{s}"] = n

    @property
    def names(self) -> KeysView[str]:
        return self._map.keys()

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        t = self.g.tensors[self._map[name]]
        kind = self.g.type_of(self._map[name])
        return dtypes.np_dtype(DEQUANTIZED[kind]) if kind == "BF16" else np.dtype(DEQUANTIZED[kind]), tuple(
            int(d) for d in reversed(t.shape.tolist())
        )

    def get(self, name: str) -> np.ndarray:
        gguf = _gguf_module()
        src = self._map[name]
        t, kind = self.g.tensors[src], self.g.type_of(src)
        dt, shape = self.info(name)
        if kind in ("F32", "F16"):
            a = np.asarray(t.data).reshape(shape)
        elif kind == "BF16":
            a = np.asarray(t.data).view(dt).reshape(shape)
        else:
            a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        n_head = self._heads.get(name)
        if n_head is not None:
            if shape[0] % (2 * n_head):
                raise CheckpointError(
                    f"{self.g.name}: tensor {src!r}: expected rows a multiple of 2 x {n_head} heads, got {shape[0]}"
                )
            a = unpermute(a, n_head)
        return a


def gguf_checkpoint(g: GGUFFile, cfg: ModelConfig) -> Checkpoint:
    """The file's tensors as a Checkpoint (transformers' names); each tensor's
    type is checked here, its data read when the engine gets it."""
    src = GGUFTensors(g, cfg)
    return Checkpoint({n: (src, n) for n in src.names}, str(g.path), [g.path])


def read_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, Checkpoint, tuple[int, ...]]:
    """(config, checkpoint, eos token ids) of the GGUF file at ``path``."""
    g = open_gguf(path)
    cfg = gguf_config(g)
    return cfg, gguf_checkpoint(g, cfg), gguf_eos(g)


# ---------------------------------------------------------------------------
# Tokenizer


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gguf_tokenizer(path: str | os.PathLike[str]):
    """The file's tokenizer as a ``tokenizers.Tokenizer`` (the ``tokenizers``
    package): byte-level BPE (tokenizer.ggml.model 'gpt2'). SetupError
    without the package, CheckpointError for another tokenizer model or
    broken tokenizer metadata."""
    g = open_gguf(path)
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        raise SetupError(
            "the GGUF file's tokenizer needs the tokenizers package: pip install 'cupaged[tokenizers]'"
        ) from None
    model = g.value("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"{g.name}: tokenizer.ggml.model: expected 'gpt2' (byte-level BPE, the tokenizer read from GGUF), "
            f"got {model!r}"
        )
    tokens, merges = g.value("tokenizer.ggml.tokens"), g.value("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(
            f"{g.name}: tokenizer.ggml.tokens: expected a list of strings, got {type(tokens).__name__}"
        )
    if not isinstance(merges, list) or not all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges):
        raise CheckpointError(f"{g.name}: tokenizer.ggml.merges: expected a list of 'left right' strings")
    types = g.value("tokenizer.ggml.token_type") or []
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        spelled = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(spelled, i)
    pairs = [tuple(m.split(" ")) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(g.value("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, k in zip(tokens, types)
        if k == CONTROL and set(t) <= alphabet
    ]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    bos = g.value("tokenizer.ggml.bos_token_id")
    if g.value("tokenizer.ggml.add_bos_token") and isinstance(bos, int) and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return tok


def gguf_chat_template(path: str | os.PathLike[str]) -> str | None:
    """The file's chat template (tokenizer.chat_template, a Jinja string; None: none)."""
    t = open_gguf(path).value("tokenizer.chat_template")
    return t if isinstance(t, str) else None
