"""Checkpoints: a Hugging Face model folder (``config.json`` and the
``*.safetensors`` files ``save_pretrained`` writes, sharded or not) or an
in-memory state dict, as one name -> host array mapping.

Safetensors files are read through a NumPy memory map: the format is an
8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range) and the raw little-endian data, so every tensor is a
zero-copy view of the mapped file (bfloat16 as ``ml_dtypes.bfloat16``, which
the safetensors package's NumPy API cannot return). The header is checked in
full before anything is mapped (``SafetensorsFile``): a sane length, a JSON
object without duplicate keys, ``__metadata__`` a str -> str map, and per
tensor a known dtype name, a list of int dims, a byte range of exactly
shape x itemsize (Python ints: no overflow) inside the file and shared with
no other tensor; a truncated file names the tensor that runs past its end.
Every tensor the engine reads is a weight and must be floating point
(``float_dtypes()``): an integer or bool tensor in a weight's place is refused,
not cast. A ``model.safetensors.index.json`` decides which file holds each
tensor it names. A GGUF file's tensors come through ``gguf.GGUFTensors``
(dequantized as they are read), a ``TensorFile`` as ``SafetensorsFile`` is.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, KeysView, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import dtypes
from ..errors import CheckpointError

#: safetensors dtype names -> cupaged dtype tokens / NumPy dtype names (the
#: NumPy dtypes through ``safetensors_dtypes()``, which imports ml_dtypes
#: only when a checkpoint is first read).
_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bf16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "e4m3",
    "F8_E5M2": "e5m2",
}
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@functools.cache
def safetensors_dtypes() -> dict[str, np.dtype]:
    """safetensors dtype names -> NumPy dtypes."""
    return {k: dtypes.np_dtype(v) if dtypes.lookup(v) else np.dtype(v) for k, v in _NAMES.items()}


@functools.cache
def _name_of() -> dict[np.dtype, str]:
    return {v: k for k, v in safetensors_dtypes().items()}


@functools.cache
def float_dtypes() -> tuple[np.dtype, ...]:
    """The dtypes a weight may be stored in (converted to the engine's dtype on load)."""
    return tuple(safetensors_dtypes()[k] for k in _FLOATS)


#: Largest JSON header read (the format's own limit is 100 MB).
MAX_HEADER = 100 << 20
#: Most dims of a tensor (NumPy 1's limit), and the largest dim (NumPy's intp).
MAX_DIMS, MAX_DIM = 32, (1 << 63) - 1


class SafetensorsFile:
    """One safetensors file, checked and memory-mapped: ``names``,
    ``info(name)`` -> (dtype, shape), ``get(name)`` -> a read-only view."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise CheckpointError(
                        f"{self.path}: truncated: {size} bytes; a safetensors file starts with an 8-byte header length"
                    )
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER:
                    raise CheckpointError(
                        f"{self.path}: not a safetensors file: header length {n} bytes (at most {MAX_HEADER})"
                    )
                if 8 + n > size:
                    raise CheckpointError(
                        f"{self.path}: truncated: the header needs {8 + n} bytes, the file has {size}"
                    )
                text = fh.read(n)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e}") from None
        header = _header_json(self.path, text)
        self.metadata = _metadata(self.path, header.pop("__metadata__", None))
        data = size - 8 - n
        self._start = 8 + n
        self._tensors: dict[str, tuple] = {}
        for name, info in header.items():
            self._tensors[name] = _tensor_entry(self.path, name, info, data, size)
        _no_overlap(self.path, self._tensors)
        self._map: np.memmap | None = None

    @property
    def names(self) -> KeysView[str]:
        return self._tensors.keys()

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        dt, shape, _, _ = self._tensors[name]
        return dt, shape

    def get(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` in the memory-mapped file (a
        copy only when its bytes are not aligned to its item size)."""
        dt, shape, a, b = self._tensors[name]
        if b == a:
            return np.zeros(shape, dt)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self._start + a : self._start + b]
        if (self._start + a) % dt.itemsize:
            raw = raw.copy()
        return raw.view(dt).reshape(shape)


class _Duplicate(Exception):
    pass


def _pairs(pairs) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _constant(c):
    raise ValueError(f"{c} is not JSON")


def _header_json(path: Path, text: bytes) -> dict:
    """The header: a JSON object (strict JSON: no NaN / Infinity, no key twice)."""
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_pairs, parse_constant=_constant)
    except _Duplicate as e:
        raise CheckpointError(
            f"{path}: not a safetensors file: key {e.args[0]!r} appears twice in its header"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        raise CheckpointError(f"{path}: not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: not a safetensors file: its header is not a JSON object, got {type(header).__name__}"
        )
    return header


def _metadata(path: Path, meta) -> dict:
    """``__metadata__``: absent, null or a str -> str map."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: __metadata__: expected a map of strings to strings, got {meta!r}"[:300])
    return meta


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor_entry(path: Path, name: str, info, data: int, size: int) -> tuple:
    """(dtype, shape, begin, end) of one header entry, every field checked:
    begin / end are offsets into the ``data`` bytes after the header."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(
            f"{path}: tensor {name!r}: expected dtype, shape and data_offsets in the header, got {info!r}"[:300]
        )
    kind, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    dt = safetensors_dtypes().get(kind) if isinstance(kind, str) else None
    if dt is None:
        raise CheckpointError(f"{path}: tensor {name!r}: dtype {kind!r} is not supported (known: {', '.join(_NAMES)})")
    if not (
        isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise CheckpointError(
            f"{path}: tensor {name!r}: shape: expected a list of at most {MAX_DIMS} ints in "
            f"0..{MAX_DIM}, got {shape!r}"[:300]
        )
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs) and 0 <= offs[0] <= offs[1]):
        raise CheckpointError(
            f"{path}: tensor {name!r}: data_offsets: expected [begin, end] ints with 0 <= begin <= end, got {offs!r}"[
                :300
            ]
        )
    nbytes = math.prod(shape) * dt.itemsize  # Python ints: no overflow
    if offs[1] - offs[0] != nbytes:
        raise CheckpointError(
            f"{path}: tensor {name!r}: {kind} {shape} needs {nbytes} bytes, its data_offsets "
            f"{offs} span {offs[1] - offs[0]}"
        )
    if offs[1] > data:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} ends at data byte {offs[1]}, the file holds "
            f"{data} data bytes ({size} bytes in all)"
        )
    return dt, tuple(shape), offs[0], offs[1]


def _no_overlap(path: Path, tensors: dict) -> None:
    """No two tensors' [begin, end) byte ranges intersect (empty ones never do)."""
    spans = sorted((a, b, name) for name, (_, _, a, b) in tensors.items() if b > a)
    reach, owner = 0, None
    for a, b, name in spans:
        if owner is not None and a < reach:
            oa, ob = tensors[owner][2:]
            raise CheckpointError(
                f"{path}: tensors {owner!r} and {name!r}: overlapping data_offsets [{oa}, {ob}) "
                f"and [{a}, {b}); each tensor needs bytes of its own"
            )
        if b > reach:
            reach, owner = b, name


class TensorFile(Protocol):
    """A file of tensors the Checkpoint reads: ``path``, ``info(key)`` ->
    (dtype, shape) without reading data, ``get(key)`` -> a host array
    (``SafetensorsFile``; ``gguf.GGUFTensors``)."""

    path: Path

    def info(self, key: str) -> tuple[np.dtype, tuple[int, ...]]: ...

    def get(self, key: str) -> np.ndarray: ...


class Checkpoint:
    """Tensors by name from safetensors files, a GGUF file or a state dict,
    all host (NumPy) arrays. ``get(name, shape)`` checks presence, a
    floating-point dtype and the shape."""

    def __init__(
        self,
        tensors: Mapping[str, tuple[TensorFile | Mapping[str, Any], str]],
        where: str,
        files: Iterable[Path] = (),
    ):
        self._tensors = tensors  # name -> (source, key): a TensorFile or a dict of arrays
        #: Called after each ``get`` (a progress bar's ``update``), or None.
        self.on_read: Callable[[], object] | None = None
        self.where = where
        self.files = tuple(files)

    @staticmethod
    def read_config(path: str | os.PathLike[str]) -> dict:
        """The ``config.json`` dict of a model folder."""
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(
                f"path: expected a model folder (config.json and *.safetensors) or a .gguf file, got {str(path)!r}"
                f"{' (no such folder)' if not root.exists() else ' (not a folder)'}"
            )
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{root}: missing config.json (a folder written by save_pretrained has one)")
        return read_json(cfg_path)  # type: ignore[return-value]  # (config.parse_config refuses a non-object)

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> "Checkpoint":
        """The tensors of a model folder's ``*.safetensors`` files; with a
        ``model.safetensors.index.json``, the files its weight_map names (each
        must exist and hold the tensors mapped to it). Each file's header is
        checked, no data is read; a tensor in two files is refused."""
        root = Path(path)
        weight_map = _weight_map(root / "model.safetensors.index.json")
        if weight_map is not None:
            missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
            if missing:
                raise CheckpointError(
                    f"{root}: missing safetensors shard(s) {', '.join(missing)} named by model.safetensors.index.json"
                )
            files = [root / f for f in sorted(set(weight_map.values()))]
        else:
            files = sorted(root.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            ggufs = [n for n in others if n.endswith(".gguf")]
            hint = (
                f" (found {', '.join(ggufs)}: pass the .gguf file itself)"
                if ggufs
                else f" (found {', '.join(others)}: save with save_pretrained(safe_serialization=True))"
                if others
                else ""
            )
            raise CheckpointError(f"{root}: missing weights: no *.safetensors file{hint}")
        tensors: dict = {}
        for p in files:
            st = SafetensorsFile(p)
            for name in st.names:
                if name in tensors and (weight_map is None or name not in weight_map):
                    raise CheckpointError(
                        f"{root}: tensor {name!r} is in both {tensors[name][0].path.name} and "
                        f"{p.name}" + ("" if weight_map is None else " and model.safetensors.index.json names neither")
                    )
                if weight_map is None or weight_map.get(name, p.name) == p.name:
                    tensors[name] = (st, name)
        for name, f in (weight_map or {}).items():
            if name not in tensors:
                raise CheckpointError(
                    f"{root / f}: missing tensor {name!r} (model.safetensors.index.json puts it there)"
                )
        return cls(tensors, str(root), files)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], where: str = "state dict") -> "Checkpoint":
        """A checkpoint of host arrays (NumPy arrays, or torch tensors, which
        are copied to the host; bfloat16 through its int16 view)."""
        arrays = {}
        for name, t in state.items():
            arrays[name] = ({name: t}, name)
        return cls(arrays, where)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> KeysView[str]:
        return self._tensors.keys()

    def get(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray:
        """The host array of weight ``name``; CheckpointError when it is
        missing, not floating point or not of ``shape``."""
        a = self._array(name)
        _float_weight(self.where, name, a.dtype)
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {name!r}: expected shape {list(shape)}, got {list(a.shape)}")
        if self.on_read is not None:
            self.on_read()
        return a

    def num_parameters(self) -> int:
        """Elements of every tensor, from the headers (nothing is read)."""
        total = 0
        for src, key in self._tensors.values():
            shape = getattr(src[key], "shape", ()) if isinstance(src, Mapping) else src.info(key)[1]
            total += int(np.prod(shape, dtype=np.int64))
        return total

    def dtype_of(self, name: str) -> np.dtype:
        """The stored dtype of weight ``name`` (floating point, else CheckpointError)."""
        entry = self._entry(name)
        src, key = entry
        dt = self._array(name).dtype if isinstance(src, Mapping) else src.info(key)[0]
        _float_weight(self.where, name, dt)
        return dt

    def _entry(self, name: str) -> tuple:
        entry = self._tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.where}: missing tensor {name!r}")
        return entry

    def _array(self, name: str) -> np.ndarray:
        src, key = self._entry(name)
        return _host(src[key]) if isinstance(src, Mapping) else src.get(key)


def _float_weight(where: str, name: str, dt: np.dtype) -> None:
    if np.dtype(dt) not in float_dtypes():
        known = ", ".join(_name_of()[d] for d in float_dtypes())
        raise CheckpointError(
            f"{where}: tensor {name!r}: expected a floating-point weight ({known}), got "
            f"{_name_of().get(np.dtype(dt), np.dtype(dt).name)}; an integer or bool tensor is "
            f"not cast into a weight"
        )


def read_json(path: Path, readable: str = "readable JSON") -> object:
    """The JSON value in ``path``; a file that cannot be read or parsed is a
    CheckpointError "<path>: not <readable>: <why>"."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not {readable}: {e}") from None


def _weight_map(index: Path) -> dict | None:
    """The ``weight_map`` of a model.safetensors.index.json (None: no index):
    a JSON object of tensor names -> file names in the folder."""
    if not index.is_file():
        return None
    raw = read_json(index, "a readable index")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{index}: expected a JSON object with a weight_map, got {type(raw).__name__}")
    wm = raw.get("weight_map")
    if not isinstance(wm, dict):
        shown = "nothing (missing)" if "weight_map" not in raw else f"{type(wm).__name__} {wm!r}"[:200]
        raise CheckpointError(f"{index}: weight_map: expected a JSON object of tensor name -> file name, got {shown}")
    if not wm:
        raise CheckpointError(
            f"{index}: weight_map: expected a JSON object of tensor name -> file name, got an empty one"
        )
    for name, f in wm.items():
        if not (isinstance(f, str) and f.endswith(".safetensors") and Path(f).name == f and f not in (".", "..")):
            raise CheckpointError(
                f"{index}: weight_map[{name!r}]: expected a *.safetensors file name in the folder, got {f!r}"[:300]
            )
    return wm


def _host(t) -> np.ndarray:
    """A NumPy view or copy of a NumPy array or torch tensor."""
    if isinstance(t, np.ndarray):
        return t
    mod = type(t).__module__
    if mod.startswith("torch"):
        import torch  # only reached with a torch tensor in hand

        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(dtypes.np_dtype("bf16"))
        fp8 = {
            getattr(torch, "float8_e4m3fn", None): dtypes.np_dtype("e4m3"),
            getattr(torch, "float8_e5m2", None): dtypes.np_dtype("e5m2"),
        }.get(t.dtype)
        if fp8 is not None:  # (torch's .numpy() has no fp8)
            return t.view(torch.uint8).numpy().view(fp8)
        return t.numpy()
    return np.asarray(t)
