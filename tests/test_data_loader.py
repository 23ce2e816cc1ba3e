"""``bagua_hvd.data`` (Horovod's ``horovod.data``): ``BaseDataLoader`` and
``AsyncDataLoaderMixin``, used as Horovod's Spark data loaders use them
(``class AsyncLoader(AsyncDataLoaderMixin, Loader)``)."""

from __future__ import annotations

import threading

import pytest

from bagua_hvd.data import AsyncDataLoaderMixin, BaseDataLoader

WAIT_S = 30.0  # a bound on waits for signals (never reached when the code works)


class ListLoader(BaseDataLoader):
    """Batches of ``batch_size`` consecutive items of ``data``; records the thread it ran in
    and how many batches it produced."""

    def __init__(self, data, batch_size, fail_at=None):
        self.data = list(data)
        self.batch_size = batch_size
        self.fail_at = fail_at
        self.threads = set()
        self.produced = 0
        self.produced_event = threading.Condition()

    def __len__(self):
        return (len(self.data) + self.batch_size - 1) // self.batch_size

    def _iterate(self):
        self.threads.add(threading.current_thread())
        for start in range(0, len(self.data), self.batch_size):
            if self.fail_at is not None and start >= self.fail_at:
                raise KeyError(f"bad record at {start}")
            with self.produced_event:
                self.produced += 1
                self.produced_event.notify_all()
            yield self.data[start : start + self.batch_size]

    def wait_produced(self, n):
        with self.produced_event:
            assert self.produced_event.wait_for(lambda: self.produced >= n, timeout=WAIT_S), (
                f"only {self.produced} batches produced, waited for {n}"
            )


class AsyncLoader(AsyncDataLoaderMixin, ListLoader):
    def __init__(self, data, batch_size, async_loader_queue_size=2, **kwargs):
        super().__init__(async_loader_queue_size, False, data, batch_size, **kwargs)


class Doubled(ListLoader):
    def _process_batch(self, batch):
        return [2 * x for x in batch]


class AsyncDoubled(AsyncDataLoaderMixin, Doubled):
    pass


def test_base_data_loader_yields_processed_batches_in_order():
    loader = Doubled(range(7), 3)
    assert len(loader) == 3
    assert list(loader) == [[0, 2, 4], [6, 8, 10], [12]]
    assert list(loader) == [[0, 2, 4], [6, 8, 10], [12]]  # a second pass
    base = BaseDataLoader()
    with pytest.raises(NotImplementedError):
        len(base)
    with pytest.raises(NotImplementedError):
        list(base)


def test_async_batches_in_order_over_passes_in_a_background_thread():
    loader = AsyncDoubled(3, False, range(7), 3)
    try:
        for _ in range(3):  # epochs
            assert list(loader) == [[0, 2, 4], [6, 8, 10], [12]]
        assert loader.threads and threading.current_thread() not in loader.threads
    finally:
        loader.close_async_loader()


def test_async_reads_ahead_within_the_queue_bound():
    """With a queue of 2, the worker produces batches 2.. while the consumer holds batch 1,
    and never more than queue size + 1 (the one being put) ahead of the consumer."""
    size = 2
    loader = AsyncLoader(range(20), 1, async_loader_queue_size=size)
    consumed = 0
    try:
        it = iter(loader)
        assert next(it) == [0]
        consumed = 1
        loader.wait_produced(1 + size)  # read ahead while batch 1 is in use
        for batch in it:
            assert loader.produced - consumed <= size + 2, (loader.produced, consumed)
            assert batch == [consumed]
            consumed += 1
        assert consumed == 20
    finally:
        loader.close_async_loader()


def test_close_stops_a_worker_blocked_on_a_full_queue():
    loader = AsyncLoader(range(50), 1, async_loader_queue_size=2)
    it = iter(loader)
    assert next(it) == [0]
    loader.wait_produced(3)  # the queue is full: the worker waits for room
    loader.close_async_loader()
    assert not loader.thread.is_alive()
    assert loader.queue.empty()
    with pytest.raises(RuntimeError, match="closed"):
        list(loader)
    loader.close_async_loader()  # closing twice is harmless


def test_close_before_iteration_and_with_a_synchronous_loader():
    AsyncLoader(range(3), 1).close_async_loader()
    sync = AsyncLoader(range(5), 2, async_loader_queue_size=0)
    assert list(sync) == [[0, 1], [2, 3], [4]]
    assert sync.threads == {threading.current_thread()}
    sync.close_async_loader()


def test_an_iterate_error_reaches_the_consumer():
    loader = AsyncLoader(range(10), 2, fail_at=4)
    try:
        it = iter(loader)
        assert next(it) == [0, 1] and next(it) == [2, 3]
        with pytest.raises(KeyError, match="bad record at 4"):
            next(it)
        with pytest.raises(RuntimeError, match="stopped after its _iterate\\(\\) raised"):
            list(loader)
    finally:
        loader.close_async_loader()


def test_bad_queue_size():
    with pytest.raises(ValueError, match="async_loader_queue_size must be an int >= 0"):
        AsyncLoader(range(3), 1, async_loader_queue_size=-1)
