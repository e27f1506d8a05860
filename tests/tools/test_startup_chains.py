"""The dependent round trips the decode kernels and the split merge wait
before their first K / V bytes, read from their real sm_90 SASS
(NVRTC + the disassembler; skipped with the reason without them): what
the kernels' opening comments promise and the performance model charges
(docs/performance.md), pinned so a source change or a scheduler that
serializes them again fails here."""

import pytest

from cupaged.ops.attention.kernels.merge import merge_defines
from cupaged.tools import model, sass


def _hot(source, defines, kernel):
    try:
        facts = model.kernel_facts(source, defines, kernel, "sm_90")
    except Exception as e:  # no cuda-python / NVRTC / headers
        pytest.skip(f"NVRTC unavailable: {e}")
    assert facts.compiled and facts.spill_stores == 0, facts.log
    if facts.hot is None:
        pytest.skip(facts.sass_note or "no SASS")
    return facts.hot


@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
def test_a_decode_tc_block_waits_two_round_trips_for_its_first_tile(kv):
    """Q's copies, the query's words and its share's first page word (guessed
    from kv_len_hint) in one round trip; then the tile. fp8: the K scale's
    use waits until after Q's wait (before the first copies it cost one more)."""
    d = {"CP_DTYPE": "bf16", "CP_KV_DTYPE": kv, "CP_SCORE": "plain", "HEAD_DIM": 128}
    assert _hot("attention/decode_tc", d, "paged_decode_tc").startup_levels == 2


def test_the_cuda_core_decode_loads_a_lane_s_page_words_together():
    """paged_attention (the decode loop's f32 kernel): q's slice, the query's
    words and every row's page word of the guessed share (kv_len_hint) load
    together and are checked after, so the first rows issue one round trip
    in; in the loop the page words wait beside the rows' 16-byte loads
    (ptxas had put each page word's check beside its load: five round trips
    before the first rows, four waits a step)."""
    d = {"CP_DTYPE": "f32", "CP_KV_DTYPE": "f32", "CP_SCORE": "plain", "DIM_CAP": 64, "GROUP_TILE": 4, "VEC_LOADS": 1}
    hot = _hot("attention/decode", d, "paged_attention")
    assert hot.startup_levels == 1
    own = hot.regions[0]
    assert own.dep_levels == 1 and own.dep_gaps == [sass.SHARED]


def test_the_split_merge_issues_every_load_before_any_use():
    """A lane's eight LSEs and chunks all issue before the first is used: the
    merge is one L2 round trip deep, the LSEs' wait that of the chunks."""
    hot = _hot("attention/merge", merge_defines("bf16", False), "attention_split_merge")
    own = hot.regions[0]
    assert hot.startup_levels == 0 and own.dep_levels == 1 and own.dep_gaps == [sass.SHARED]
