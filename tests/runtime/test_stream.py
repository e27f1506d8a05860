"""CPU stream: memset_d32, copies, capture and replay with frozen arguments.
(Kernel launches under capture are tested with a real kernel in
test_rowwise.py.)"""

import numpy as np
import pytest

from cupaged import PagedAttentionError, stream_for


def test_memset_and_copies_run_at_once():
    a = np.zeros(8, np.uint32)
    s = stream_for(a)
    assert s.backend == "cpu" and not s.capturing
    s.memset_d32(a, 0xDEADBEEF, count=3, offset_bytes=8)
    assert a.tolist() == [0, 0, 0xDEADBEEF, 0xDEADBEEF, 0xDEADBEEF, 0, 0, 0]
    b = np.arange(8, dtype=np.uint32)
    s.copy(a, b, nbytes=8, dst_offset=24, src_offset=4)
    assert a[6:8].tolist() == [1, 2] and a[4] == 0xDEADBEEF and a[5] == 0
    host = np.array([7, 9], np.uint32)
    s.copy_from_host(a, host)
    host[:] = 0  # the stream took its own copy
    assert a[:2].tolist() == [7, 9]
    s.memset_d32(a, -1, count=1)
    assert a[0] == 0xFFFFFFFF


def test_capture_records_and_replay_reruns_in_order():
    a = np.zeros(4, np.uint32)
    b = np.zeros(4, np.uint32)
    s = stream_for(a)
    s.begin_capture()
    try:
        s.memset_d32(a, 5, count=4)
        s.copy(b, a)  # must see the memset: order is kept
        s.memset_d32(a, 6, count=1)
        assert a.tolist() == [0] * 4 and b.tolist() == [0] * 4  # nothing ran yet
    finally:
        g = s.end_capture()
    assert g.num_ops == 3
    g.launch()
    assert a.tolist() == [6, 5, 5, 5] and b.tolist() == [5, 5, 5, 5]
    # a value written from outside before replay is seen by the replayed work
    a[:] = 0
    b[:] = 0
    s.memset_d32(a, 1, count=4)  # eager, before the replay
    g.launch()
    assert b.tolist() == [5, 5, 5, 5]


def test_captured_arguments_are_frozen():
    a = np.zeros(4, np.uint32)
    s = stream_for(a)
    src = np.array([1, 2, 3, 4], np.uint32)
    s.begin_capture()
    s.copy_from_host(a, src)  # host bytes frozen at capture
    g = s.end_capture()
    src[:] = 0
    g.launch()
    assert a.tolist() == [1, 2, 3, 4]


def test_graph_keeps_arrays_alive():
    s = stream_for(np.zeros(1))
    a = np.zeros(1024, np.uint32)
    s.begin_capture()
    s.memset_d32(a, 3)
    g = s.end_capture()
    view = a[:4]
    del a
    for _ in range(3):
        junk = np.ones(1024, np.uint32)  # noqa: F841 (allocations between replays)
        g.launch()
    assert view.tolist() == [3, 3, 3, 3]


def test_stream_errors():
    a = np.zeros(4, np.uint32)
    s = stream_for(a)
    with pytest.raises(PagedAttentionError, match=r"dst: expected bytes \[8, 24\) inside an array of 16 bytes"):
        s.memset_d32(a, 1, count=4, offset_bytes=8)
    with pytest.raises(PagedAttentionError, match="offset_bytes: expected a multiple of 4"):
        s.memset_d32(a, 1, count=1, offset_bytes=2)
    with pytest.raises(PagedAttentionError, match="src"):
        s.copy(a, np.zeros(2, np.uint32), nbytes=16)
    with pytest.raises(PagedAttentionError, match="dst: expected a C-contiguous"):
        s.memset_d32(np.zeros(8, np.uint32)[::2], 1, count=1)
    with pytest.raises(PagedAttentionError, match="end_capture without begin_capture"):
        s.end_capture()
    s.begin_capture()
    with pytest.raises(PagedAttentionError, match="already capturing"):
        s.begin_capture()
    g = s.end_capture()
    assert g.num_ops == 0
    with pytest.raises(PagedAttentionError, match="like: expected a NumPy or CuPy array"):
        stream_for([1, 2])


def test_capture_is_per_thread():
    """While thread A captures the CPU stream, thread B's work on it runs at
    once (it used to be recorded into A's graph, and B's output was never
    written); A's graph holds only A's work, and B cannot end A's capture."""
    import threading

    from cupaged import argmax_into

    stream = stream_for(np.zeros(1, np.float32))
    a_logits = np.array([[0.0, 1.0, 0.0]], np.float32)
    a_out = np.zeros(1, np.int64)
    b_logits = np.array([[5.0, 1.0, 7.0, 2.0]], np.float32)
    b_out = np.full(1, -1, np.int64)
    started, b_done = threading.Event(), threading.Event()
    errors = []

    def thread_b():
        started.wait()
        try:
            assert not stream.capturing
            argmax_into(b_logits, b_out)
            with pytest.raises(PagedAttentionError, match="end_capture without begin_capture"):
                stream.end_capture()
            with pytest.raises(PagedAttentionError, match="another thread is capturing this stream"):
                stream.begin_capture()
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)
        b_done.set()

    t = threading.Thread(target=thread_b)
    t.start()
    stream.begin_capture()
    started.set()
    b_done.wait(60)
    argmax_into(a_logits, a_out)
    graph = stream.end_capture()
    t.join()
    assert not errors, errors
    assert b_out.tolist() == [2]  # B's work ran at once
    assert graph.num_ops == 1 and a_out.tolist() == [0]
    graph.launch()
    assert a_out.tolist() == [1]


def test_gpu_style_streams_refuse_work_during_another_threads_capture():
    """A stream whose driver would fold any thread's work into the open
    capture (the GPU's) refuses another thread's work instead of losing it."""
    import threading

    from cupaged._runtime import CpuStream, Stream

    class DriverLike(CpuStream):
        _work_during_foreign_capture = Stream._work_during_foreign_capture

    s = DriverLike()
    buf = np.zeros(4, np.uint32)
    s.begin_capture()
    errors = []

    def other():
        try:
            s.memset_d32(buf, 7)
        except PagedAttentionError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    s.end_capture()
    assert errors and "another thread is capturing this stream" in errors[0]
    assert buf.tolist() == [0, 0, 0, 0]
    s.memset_d32(buf, 7)  # after the capture: fine
    assert buf.tolist() == [7] * 4
