"""Checkpoints that lie (issue #19, items 6 and 9): safetensors headers whose
fields have the wrong JSON type, sizes that overflow int64, byte ranges
outside the file or shared by two tensors, non-float tensors in weight
slots, and model.safetensors.index.json files of the wrong shape. Each is
refused with a CheckpointError naming the file and the tensor (or field)
before any tensor data is read."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import CheckpointError
from cupaged.engine import parse_config
from cupaged.engine.checkpoint import MAX_HEADER, Checkpoint, SafetensorsFile
from cupaged.testing import random_weights, save_safetensors, tiny_config, write_random_checkpoint
from cupaged.testing.checkpoints import save_raw_safetensors

LIKE = np.zeros(1, np.float32)


def _entry(dtype="F32", shape=(4,), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("faults"), "LlamaForCausalLM", eos_token_id=None)


# ---------------------------------------------------------------------------
# item 9: every header field checked


@pytest.mark.parametrize(
    "entry, match",
    [
        # sizes that overflow int64 (NumPy's product wraps: [2**62, 4] x 4 bytes is 0 mod 2**64)
        (
            _entry(shape=(2**62, 4), offsets=(0, 0)),
            r"tensor 'w': F32 \[4611686018427387904, 4\] needs "
            r"73786976294838206464 bytes, its data_offsets \[0, 0\] span 0",
        ),
        (_entry(shape=(2**32, 2**32), offsets=(0, 0)), r"needs 73786976294838206464 bytes"),
        (_entry("I8", shape=(2**62, 4), offsets=(0, 0)), r"needs 18446744073709551616 bytes"),
        (
            _entry(shape=(2**64,), offsets=(0, 0)),
            r"shape: expected a list of at most 32 ints in 0..9223372036854775807",
        ),
        (_entry(shape=(0, 2**70), offsets=(0, 0)), r"shape: expected a list .*got \[0, 1180591620717411303424\]"),
        # wrong JSON types
        (_entry(shape=(True, 4), offsets=(0, 16)), r"shape: expected a list of at most 32 ints .*got \[True, 4\]"),
        (_entry(shape=(4.0,), offsets=(0, 16)), r"shape: expected a list"),
        ({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}, r"shape: expected a list"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}, r"shape: expected a list"),
        ({"dtype": "F32", "shape": [1] * 33, "data_offsets": [0, 4]}, r"shape: expected a list of at most 32"),
        (_entry(offsets=(0, True)), r"data_offsets: expected \[begin, end\] ints with 0 <= begin <= end"),
        (_entry(offsets=(0.0, 16)), r"data_offsets: expected \[begin, end\] ints"),
        (_entry(offsets=(0, 8, 16)), r"data_offsets: expected \[begin, end\]"),
        (_entry(offsets=(16, 0)), r"data_offsets: expected \[begin, end\] ints with 0 <= begin <= end, got \[16, 0\]"),
        (_entry(offsets=(-16, 0)), r"data_offsets: .*got \[-16, 0\]"),
        ({"dtype": "F32", "shape": [4], "data_offsets": "0-16"}, r"data_offsets: expected"),
        ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, r"dtype \['F32'\] is not supported \(known: F64"),
        ({"dtype": 7, "shape": [4], "data_offsets": [0, 16]}, r"dtype 7 is not supported"),
        ({"dtype": "F128", "shape": [4], "data_offsets": [0, 16]}, r"dtype 'F128' is not supported"),
        ({"dtype": "f32", "shape": [4], "data_offsets": [0, 16]}, r"dtype 'f32' is not supported"),
        ({"dtype": "F32", "shape": [4]}, r"expected dtype, shape and data_offsets"),
        ([1, 2], r"expected dtype, shape and data_offsets"),
        # offsets inside the file
        (
            _entry(shape=(8,), offsets=(0, 32)),
            r"truncated: tensor 'w' ends at data byte 32, the file holds 16 data bytes",
        ),
        (_entry(shape=(4,), offsets=(16, 32)), r"truncated: tensor 'w' ends at data byte 32"),
    ],
)
def test_header_fields_are_checked(tmp_path, entry, match):
    path = save_raw_safetensors(tmp_path / "x.safetensors", {"w": entry}, bytes(16))
    with pytest.raises(CheckpointError, match=match) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "header, match",
    [
        (b"[]", r"its header is not a JSON object, got list"),
        (b"7", r"its header is not a JSON object, got int"),
        (b"", r"its header is not JSON"),
        (b"\xff\xfe{}", r"its header is not JSON"),
        (
            b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 0]}}',
            r"its header is not JSON \(NaN is not JSON",
        ),
        (b'{"__metadata__": {"x": Infinity}}', r"its header is not JSON \(Infinity is not JSON"),
        (
            b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
            b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
            r"key 'w' appears twice in its header",
        ),
        (
            b'{"w": {"dtype": "F32", "dtype": "I32", "shape": [4], "data_offsets": [0, 16]}}',
            r"key 'dtype' appears twice",
        ),
        (b'{"__metadata__": ["pt"]}', r"__metadata__: expected a map of strings to strings, got \['pt'\]"),
        (
            b'{"__metadata__": {"format": 1}}',
            r"__metadata__: expected a map of strings to strings, got \{'format': 1\}",
        ),
        (b'{"__metadata__": {"format": {"a": "b"}}}', r"__metadata__: expected a map of strings to strings"),
        (b'{"__metadata__": "pt"}', r"__metadata__: expected a map"),
    ],
)
def test_header_must_be_a_strict_json_object(tmp_path, header, match):
    path = save_raw_safetensors(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(CheckpointError, match=match):
        SafetensorsFile(path)


def test_header_length_must_be_sane(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes((MAX_HEADER + 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=rf"not a safetensors file: header length {MAX_HEADER + 1} bytes"):
        SafetensorsFile(path)
    path.write_bytes((2**64 - 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=r"header length 18446744073709551615 bytes"):
        SafetensorsFile(path)


def test_good_headers_still_load(tmp_path):
    """Metadata null or absent, empty tensors anywhere, ranges listed out of
    order, gaps between ranges, extra keys in an entry: all as the
    safetensors package reads them."""
    data = np.arange(8, dtype=np.float32).tobytes() + bytes(8) + np.arange(4, dtype=np.float16).tobytes()
    header = {
        "__metadata__": None,
        "late": _entry("F16", (2, 2), (40, 48)),
        "early": _entry("F32", (8,), (0, 32)),
        "empty": _entry("BF16", (0, 3), (4, 4)),
        "empty2": _entry("F32", (0,), (4, 4)),
        "odd": {**_entry("F32", (2,), (32, 40)), "note": "ignored"},
    }
    st = SafetensorsFile(save_raw_safetensors(tmp_path / "x.safetensors", header, data))
    assert st.metadata == {}
    np.testing.assert_array_equal(st.get("early"), np.arange(8, dtype=np.float64))
    np.testing.assert_array_equal(st.get("late").astype(np.float64), np.arange(4.0).reshape(2, 2))
    assert st.get("empty").shape == (0, 3) and st.get("empty").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(st.get("odd"), np.zeros(2))


# ---------------------------------------------------------------------------
# item 6: two tensors sharing bytes


@pytest.mark.parametrize(
    "spans, pair",
    [
        ({"a": (0, 16), "b": (0, 16)}, ("a", "b")),  # one byte range, twice
        ({"a": (0, 16), "b": (8, 24)}, ("a", "b")),  # partial
        ({"b": (8, 24), "a": (0, 16)}, ("a", "b")),  # listed out of order
        ({"a": (0, 32), "b": (8, 16)}, ("a", "b")),  # one inside the other
        ({"a": (0, 40), "b": (4, 8), "c": (24, 32)}, ("a", "b")),  # the first overlap found
        ({"a": (0, 16), "b": (16, 32), "c": (28, 32)}, ("b", "c")),
        ({"a": (0, 16), "b": (16, 40), "c": (24, 28)}, ("b", "c")),  # not neighbours once sorted by end
    ],
)
def test_overlapping_byte_ranges_are_refused(tmp_path, spans, pair):
    header = {n: _entry("F32", ((b - a) // 4,), (a, b)) for n, (a, b) in spans.items()}
    path = save_raw_safetensors(tmp_path / "x.safetensors", header, bytes(40))
    with pytest.raises(
        CheckpointError,
        match=rf"tensors '{pair[0]}' and '{pair[1]}': overlapping data_offsets "
        rf"\[{spans[pair[0]][0]}, {spans[pair[0]][1]}\) and "
        rf"\[{spans[pair[1]][0]}, {spans[pair[1]][1]}\)",
    ):
        SafetensorsFile(path)


def test_adjacent_and_empty_ranges_do_not_overlap(tmp_path):
    header = {
        "a": _entry("F32", (4,), (0, 16)),
        "b": _entry("F32", (4,), (16, 32)),
        "e1": _entry("F32", (0,), (16, 16)),
        "e2": _entry("F32", (0,), (16, 16)),
        "e3": _entry("F32", (0,), (8, 8)),
    }
    st = SafetensorsFile(save_raw_safetensors(tmp_path / "x.safetensors", header, bytes(32)))
    assert sorted(st.names) == ["a", "b", "e1", "e2", "e3"]


def test_overlap_in_a_model_folder_names_both_tensors(llama, tmp_path):
    """A folder whose two weights alias one byte range (each of the right
    size) is refused at load, not run with one weight read twice."""
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    st = SafetensorsFile(llama / "model.safetensors")
    w = {n: np.asarray(st.get(n)) for n in st.names}
    save_safetensors(tmp_path / "model.safetensors", w)
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["model.layers.1.self_attn.k_proj.weight"]["data_offsets"] = header["model.layers.1.self_attn.v_proj.weight"][
        "data_offsets"
    ]
    save_raw_safetensors(tmp_path / "model.safetensors", header, raw[8 + n :])
    with pytest.raises(
        CheckpointError,
        match=r"tensors 'model.layers.1.self_attn.(k|v)_proj.weight' and "
        r"'model.layers.1.self_attn.(k|v)_proj.weight': overlapping",
    ):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


# ---------------------------------------------------------------------------
# item 6: non-float tensors in weight slots


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "lm_head.weight",
    ],
)
@pytest.mark.parametrize(
    "dtype, st_name",
    [(np.int32, "I32"), (np.bool_, "BOOL"), (np.int64, "I64"), (np.uint8, "U8"), (np.int8, "I8"), (np.int16, "I16")],
)
def test_integer_or_bool_weight_is_refused(tmp_path, name, dtype, st_name):
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = random_weights(cfg)
    w[name] = (w[name] > 0).astype(dtype)
    save_safetensors(tmp_path / "model.safetensors", w)
    for kw in ({}, {"dtype": "float32"}, {"dtype": "bfloat16"}):
        with pytest.raises(
            CheckpointError,
            match=rf"{tmp_path}: tensor '{name}': expected a floating-point weight "
            rf"\(F64, F32, F16, BF16, F8_E4M3, F8_E5M2\), got {st_name}",
        ):
            cupaged.Engine.from_pretrained(tmp_path, like=LIKE, **kw)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_integer_embedding_is_refused_naming_it(tmp_path, dtype):
    """The embedding decides the default dtype: an int32 one is a checkpoint
    error naming it (not 'pass dtype=', which would cast it)."""
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = random_weights(cfg)
    w["model.embed_tokens.weight"] = np.arange(w["model.embed_tokens.weight"].size, dtype=np.int32).reshape(256, 64)
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model.embed_tokens.weight': expected a floating-point "
        r"weight .*got I32",
    ):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE, dtype=dtype)


def test_integer_weight_in_a_state_dict_is_refused():
    cfg = tiny_config()
    w = random_weights(cfg)
    w["model.layers.0.post_attention_layernorm.weight"] = np.ones(64, np.int64)
    ckpt = Checkpoint.from_state_dict(w)
    with pytest.raises(
        CheckpointError,
        match=r"state dict: tensor 'model.layers.0.post_attention_layernorm.weight': "
        r"expected a floating-point weight .*got I64",
    ):
        cupaged.Engine(parse_config(cfg), ckpt, like=LIKE)
    assert ckpt.get("model.norm.weight").dtype == np.float32


@pytest.mark.parametrize("stored", ["float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_float_weights_of_every_stored_dtype_load(tmp_path, stored):
    """Every floating-point storage type is converted to the engine's dtype
    (fp8 exactly: each code is a float32 value)."""
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = random_weights(cfg)
    name = "model.layers.0.mlp.up_proj.weight"
    w[name] = w[name].astype(np.dtype(getattr(ml_dtypes, stored, stored)))
    save_safetensors(tmp_path / "model.safetensors", w)
    e = cupaged.Engine.from_pretrained(tmp_path, like=LIKE, num_pages=8)
    gate_up = e.model.layers[0]["gate_up"]
    np.testing.assert_array_equal(
        np.asarray(gate_up[cfg["intermediate_size"] :], np.float64), w[name].astype(np.float64).astype(np.float32)
    )
    assert len(e.generate([[1, 2]], 3, stop_token_ids=())[0]) == 3


# ---------------------------------------------------------------------------
# item 9: model.safetensors.index.json


def _sharded(src, dst):
    """``src``'s weights in two shards with an index, as save_pretrained writes them."""
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    st = SafetensorsFile(src / "model.safetensors")
    names = sorted(st.names)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in shards.items():
        save_safetensors(dst / f, {n: np.asarray(st.get(n)) for n in ns})
    wm = {n: f for f, ns in shards.items() for n in ns}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return wm


def test_sharded_folder_generates_as_the_single_file(llama, tmp_path):
    _sharded(llama, tmp_path)
    (tmp_path / "notes.safetensors").write_bytes(b"not named by the index: never opened")
    one = cupaged.Engine.from_pretrained(llama, like=LIKE, num_pages=8, max_batch=1)
    two = cupaged.Engine.from_pretrained(tmp_path, like=LIKE, num_pages=8, max_batch=1)
    assert two.generate([[5, 6, 7]], 6) == one.generate([[5, 6, 7]], 6)


@pytest.mark.parametrize(
    "index, match",
    [
        (
            {"weight_map": ["model.norm.weight"]},
            r"weight_map: expected a JSON object of tensor name -> file name, got "
            r"list \['model.norm.weight'\]",
        ),
        ({"weight_map": "model.safetensors"}, r"weight_map: expected a JSON object .*got str"),
        ({"weight_map": None}, r"weight_map: expected a JSON object .*got NoneType"),
        ({"metadata": {}}, r"weight_map: expected a JSON object .*got nothing \(missing\)"),
        ({"weight_map": {}}, r"weight_map: expected a JSON object .*got an empty one"),
        ([{"weight_map": {}}], r"expected a JSON object with a weight_map, got list"),
        ("model.safetensors", r"expected a JSON object with a weight_map, got str"),
        (
            {"weight_map": {"model.norm.weight": 3}},
            r"weight_map\['model.norm.weight'\]: expected a \*.safetensors file "
            r"name in the folder, got 3",
        ),
        ({"weight_map": {"model.norm.weight": "../model.safetensors"}}, r"got '../model.safetensors'"),
        ({"weight_map": {"model.norm.weight": "/tmp/model.safetensors"}}, r"got '/tmp/model.safetensors'"),
        ({"weight_map": {"model.norm.weight": "config.json"}}, r"got 'config.json'"),
        ({"weight_map": {"model.norm.weight": ["model.safetensors"]}}, r"got \['model.safetensors'\]"),
    ],
)
def test_index_of_the_wrong_shape(llama, tmp_path, index, match):
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    shutil.copy(llama / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: .*" + match):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


def test_index_and_files_must_agree(llama, tmp_path):
    wm = _sharded(llama, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    name = "model.norm.weight"
    other = next(f for f in sorted(set(wm.values())) if f != wm[name])
    index.write_text(json.dumps({"weight_map": {**wm, name: other}}))
    with pytest.raises(
        CheckpointError,
        match=rf"{other}: missing tensor '{name}' \(model.safetensors.index.json "
        rf"puts it there\)",
    ):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: not a readable index"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)


def test_a_tensor_in_two_files_is_refused(llama, tmp_path):
    """Without an index nothing says which copy is meant; with one, the file
    it names is read."""
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    shutil.copy(llama / "model.safetensors", tmp_path / "model.safetensors")
    save_safetensors(tmp_path / "extra.safetensors", {"model.norm.weight": np.zeros(64, np.float32)})
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model.norm.weight' is in both extra.safetensors and "
        r"model.safetensors",
    ):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    st = SafetensorsFile(tmp_path / "model.safetensors")
    wm = {n: "model.safetensors" for n in st.names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**wm, "x": "extra.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"extra.safetensors: missing tensor 'x'"):
        cupaged.Engine.from_pretrained(tmp_path, like=LIKE)
    save_safetensors(
        tmp_path / "extra.safetensors", {"model.norm.weight": np.zeros(64, np.float32), "x": np.zeros(1, np.float32)}
    )
    e = cupaged.Engine.from_pretrained(tmp_path, like=LIKE, num_pages=8)
    np.testing.assert_array_equal(e.model.final_norm, st.get("model.norm.weight"))  # the index's copy
