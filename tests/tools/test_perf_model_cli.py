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
        # every row a range, the pessimistic end quoted, and what would move it
        assert row["quoted_end"] == "pessimistic" and "range" in row["figure"]
        assert 0 < row["optimistic"]["time_us"] <= row["time_us"] * 1.0001
        assert all(m["figure"] and m["time_change"] <= -0.01 for m in row["moves"])
        for lm in row["launches"] + row["launches_optimistic"]:
            assert lm["label"] == "modeled" and lm["end"] in ("opt", "pess")
            assert lm["registers"] > 0 and lm["occupancy"]["blocks_per_sm"] >= 1 and lm["waves"] > 0
            assert 0 <= lm["tail_share"] <= 1
            assert 0 < lm["blocks_per_sm"] <= lm["occupancy"]["blocks_per_sm"]
    by = {row["shape"]: row for row in rows}
    # MLA and prefill run on tensor cores: the counters saw mma.sync
    assert any(lm["mma"] > 0 for lm in by["mla_b64"]["launches"])
    assert any(lm["mma"] > 0 for lm in by["chunk_4k"]["launches"])
    # split-KV at batch 1 splits and merges
    assert by["split_b1"]["splits"] > 1 and len(by["split_b1"]["launches"]) >= 2
    # HBM-bound decode reads below the copy bandwidth (a DRAM efficiency), and says what would move it
    assert by["gqa_g4"]["pct"] < 100 and by["gqa_g4"]["moves"]
    assert any(a["figure"] == "wgmma rate" and " - " in a["value"] for a in doc["assumptions"])


def test_perf_model_text_and_assumptions():
    _nvrtc_or_skip()
    r = subprocess.run(
        [sys.executable, "-m", "cupaged.tools.perf_model", "--shape", "gqa_g4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODELED" in r.stdout and "gqa_g4" in r.stdout and "what would move it" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "cupaged.tools.perf_model", "--assumptions", "--arch", "sm_80"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "A100" in r.stdout and "TB/s" in r.stdout


def test_markdown_without_sass_says_every_row_is_optimistic(monkeypatch, capsys):
    """Without nvdisasm / cuobjdump the rows lack the SASS bounds (issue, the
    serialized tile, startup chains) and come out optimistic: the Markdown
    table (what docs/performance.md quotes) says so in its heading and on
    every row, and the warning goes to stderr."""
    _nvrtc_or_skip()
    from cupaged.tools import perf_model, sass

    monkeypatch.setattr(sass, "available", lambda: False)
    assert perf_model.main(["--markdown", "--shape", "gqa_g1", "--shape", "decode_loop"]) == 0
    out = capsys.readouterr()
    assert "warning: SASS figures need nvdisasm or cuobjdump" in out.err
    assert "every row below is optimistic" in out.out
    rows = [ln for ln in out.out.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")][1:]
    assert len(rows) == 2 and all(perf_model.NO_SASS in ln for ln in rows), rows
