"""Negotiation, fusion and the response cache, seen from the frontend.

Run by tests/test_core.py with HOROVOD_CYCLE_TIME=100 (ms), HOROVOD_FUSION_THRESHOLD=4096 and
HOROVOD_CACHE_CAPACITY=4, so that fusion windows are wide and the cache evicts often.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common._native import lib


def stat(key: str) -> int:
    return int(lib().bhvd_stat(key.encode()))


def inputs(size: int, n: int, numel: int) -> list[list[np.ndarray]]:
    """inputs[rank][i]: deterministic per rank, so each rank can compute the reference."""
    return [
        [np.random.default_rng(1000 * r + i).integers(-50, 50, numel).astype(np.float32)
         for i in range(n)]
        for r in range(size)
    ]


def wait_by_polling(handles: list[int], limit_s: float = 30.0) -> None:
    """Waits without synchronize(): a blocked caller would flush the fusion window early."""
    deadline = time.monotonic() + limit_s
    while not all(hvd.poll(h) for h in handles):
        assert time.monotonic() < deadline, "ops did not complete"
        time.sleep(0.001)


def test_async_ops_within_a_cycle_are_fused():
    size, rank = hvd.size(), hvd.rank()
    data = inputs(size, 10, 64)  # 10 x 256 bytes: all fit under the 4096-byte threshold
    hvd.barrier()
    responses, fused = stat("responses"), stat("fused_tensors")
    t0 = time.monotonic()
    handles = [hvd.allreduce_async(torch.from_numpy(data[rank][i]), name=f"fuse.{i}", op=hvd.Sum)
               for i in range(10)]
    wait_by_polling(handles)
    held = time.monotonic() - t0
    outs = [hvd.synchronize(h) for h in handles]
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out.numpy(), sum(data[r][i] for r in range(size)))
    assert stat("responses") - responses == 1, "the ten tensors were not fused into one response"
    assert stat("fused_tensors") - fused == 10
    # Nobody blocked, so the coordinator held them for (most of) the 100 ms cycle.
    assert held >= 0.05, f"completed after {held * 1000:.1f} ms, before the cycle time"


def test_fusion_respects_the_threshold():
    size, rank = hvd.size(), hvd.rank()
    data = inputs(size, 10, 256)  # 10 x 1024 bytes under a 4096-byte threshold: 4 + 4 + 2
    hvd.barrier()
    responses, fused = stat("responses"), stat("fused_tensors")
    handles = [hvd.allreduce_async(torch.from_numpy(data[rank][i]), name=f"thr.{i}", op=hvd.Sum)
               for i in range(10)]
    wait_by_polling(handles)
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(hvd.synchronize(h).numpy(),
                                      sum(data[r][i] for r in range(size)))
    # At most 4 tensors fit in one fused buffer, so at least 3 responses; a full buffer is sent
    # at once, so how the rest group depends on arrival (4+4+2 or 4+1+4+1 ...), but fusion
    # must have happened.
    assert 3 <= stat("responses") - responses < 10
    assert stat("fused_tensors") - fused >= 4


def test_blocking_caller_is_not_held_for_the_cycle():
    """synchronize() marks its tensors urgent: the result must not wait for the 100 ms window.
    (Correctness check with a generous bound; speed is measured by bench/allreduce.py.)"""
    x = torch.ones(16)
    hvd.allreduce(x, name="urgent.warm")
    t0 = time.monotonic()
    for _ in range(5):
        hvd.allreduce(x, name="urgent")
    assert (time.monotonic() - t0) / 5 < 0.09


def test_ranks_submitting_in_different_orders_run_the_same_ops():
    size, rank = hvd.size(), hvd.rank()
    names = [f"order.{i}" for i in range(6)]
    data = inputs(size, 6, 1000)
    order = list(range(6)) if rank % 2 == 0 else list(reversed(range(6)))
    handles = {i: hvd.allreduce_async(torch.from_numpy(data[rank][i]), name=names[i],
                                      op=hvd.Sum) for i in order}
    for i in range(6):
        np.testing.assert_array_equal(hvd.synchronize(handles[i]).numpy(),
                                      sum(data[r][i] for r in range(size)))


def test_cached_requests_hit_and_evict_correctly():
    """Capacity 4 with 12 names, three rounds: hits, evictions and re-insertions must all give
    correct results."""
    size, rank = hvd.size(), hvd.rank()
    data = inputs(size, 12, 33)
    hits = stat("cache_hits")
    for _ in range(3):
        for i in range(12):
            out = hvd.allreduce(torch.from_numpy(data[rank][i]), name=f"cache.{i}", op=hvd.Sum)
            np.testing.assert_array_equal(out.numpy(), sum(data[r][i] for r in range(size)))
    for _ in range(3):
        out = hvd.allreduce(torch.from_numpy(data[rank][0]), name="cache.hot", op=hvd.Sum)
    assert stat("cache_hits") - hits >= 2, "a repeated request never hit the response cache"


def test_changed_parameters_under_a_cached_name_are_still_checked():
    """Rank 0 changes the shape under a name the others send from the cache: the coordinator
    must still report the mismatch (from the cached template), and the job keeps working."""
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    for _ in range(2):
        hvd.allreduce(torch.ones(17), name="cached.shape")
    shape = 18 if hvd.rank() == 0 else 17
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(torch.ones(shape), name="cached.shape")
    out = hvd.allreduce(torch.ones(5), name="cached.after", op=hvd.Sum)
    np.testing.assert_array_equal(out.numpy(), np.full(5, hvd.size(), np.float32))


def test_completion_callbacks():
    """bhvd_on_done (what the TensorFlow kernel waits with): the callback gets the handle and
    its final status once, on the core's thread for a pending handle and at once on the
    caller's for a completed one; a second callback or an unknown handle is refused; an error
    status and its message reach it."""
    import threading

    from bagua_hvd.common import ops
    from bagua_hvd.common._native import ffi

    size, rank = hvd.size(), hvd.rank()
    n = lib()
    calls: list = []
    event = threading.Event()

    @ffi.callback("void(int64_t, int32_t, void*)")
    def on_done(handle, status, arg):
        message = ffi.string(n.bhvd_handle_error(handle)).decode()
        calls.append((handle, status, message, threading.get_ident()))
        event.set()

    x = np.full(8, rank + 1.0, np.float32)
    out = np.empty_like(x)

    def enqueue(name: str, data: np.ndarray, result: np.ndarray) -> int:
        h, _ = ops.enqueue(
            ops.OP_ALLREDUCE, [(data.ctypes.data, ops.FLOAT32, data.shape)],
            [(result.ctypes.data, ops.FLOAT32, result.shape)], name=name, reduce_op=ops.Sum,
        )  # fmt: skip
        return h

    hvd.barrier()
    h = enqueue("cb.pending", x, out)  # not urgent: held for the 100 ms cycle
    assert n.bhvd_on_done(h, on_done, ffi.NULL) == ops.OK
    assert n.bhvd_on_done(h, on_done, ffi.NULL) == ops.INVALID_ARGUMENT
    assert "already has a completion callback" in ffi.string(n.bhvd_last_error()).decode()
    assert event.wait(30), "the completion callback did not run"
    assert calls == [(h, ops.OK, "", calls[0][3])]
    assert calls[0][3] != threading.get_ident(), "a pending handle's callback ran on the caller"
    np.testing.assert_array_equal(out, np.full(8, sum(r + 1.0 for r in range(size))))
    # Completed already: at once, on this thread.
    calls.clear()
    assert n.bhvd_on_done(h, on_done, ffi.NULL) == ops.OK
    assert calls == [(h, ops.OK, "", threading.get_ident())]
    ops.release(h)
    assert n.bhvd_on_done(h, on_done, ffi.NULL) == ops.INVALID_ARGUMENT  # released: unknown
    if size > 1:  # a mismatch: the error status and Horovod's text
        y = np.zeros(4 + rank, np.float32)
        yo = np.empty_like(y)
        calls.clear()
        event.clear()
        h = enqueue("cb.mismatch", y, yo)
        assert n.bhvd_on_done(h, on_done, ffi.NULL) == ops.OK
        assert event.wait(30), "the completion callback did not run"
        assert calls[0][1] == ops.PRECONDITION_ERROR, calls
        assert "Mismatched ALLREDUCE tensor shapes" in calls[0][2], calls
        ops.release(h)
