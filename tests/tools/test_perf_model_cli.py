"""Smoke test of python -m cupaged.tools.perf_model: it runs, every row and
launch is labelled modeled, and the figures hold together."""

import json
import subprocess
import sys

import pytest


def _nvrtc_or_skip():
    try:
        from cupaged._runtime import nvrtc

        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")


def test_perf_model_json_is_all_modeled():
    _nvrtc_or_skip()
    r = subprocess.run(
        [sys.executable, "-m", "cupaged.tools.perf_model", "--json"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["label"] == "modeled" and doc["arch"] == "sm_90" and doc["assumptions"]
    rows = doc["rows"]
    names = {row["shape"] for row in rows}
    assert {"gqa_g4", "gqa_g8", "gqa_g1", "split_b1", "mla_b64", "mla_b128", "chunk_4k", "decode_loop"} <= names
    for row in rows:
        assert row["label"] == "modeled"
        if row["status"] == "skipped":
            assert row["reason"]
            continue
        assert row["status"] == "ok", row
        assert row["time_us"] > 0 and row["figure"] and row["binding"]
        assert row["design_bytes"] >= 0.99 * row["must_bytes"]
        for lm in row["launches"]:
            assert lm["label"] == "modeled"
            assert lm["registers"] > 0 and lm["occupancy"]["blocks_per_sm"] >= 1 and lm["waves"] > 0
            assert 0 <= lm["tail_share"] <= 1
    by = {row["shape"]: row for row in rows}
    # MLA and prefill run on tensor cores: the counters saw mma.sync
    assert any(lm["mma"] > 0 for lm in by["mla_b64"]["launches"])
    assert any(lm["mma"] > 0 for lm in by["chunk_4k"]["launches"])
    # split-KV at batch 1 splits and merges
    assert by["split_b1"]["splits"] > 1 and len(by["split_b1"]["launches"]) >= 2


def test_perf_model_text_and_assumptions():
    _nvrtc_or_skip()
    r = subprocess.run(
        [sys.executable, "-m", "cupaged.tools.perf_model", "--shape", "gqa_g4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODELED" in r.stdout and "gqa_g4" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "cupaged.tools.perf_model", "--assumptions", "--arch", "sm_80"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "A100" in r.stdout and "TB/s" in r.stdout
