"""Horovod's ``horovod.data.data_loader_base``.

A data loader implements ``__len__`` (number of batches) and ``_iterate()`` (a generator of
batches); iterating the loader yields ``_process_batch(batch)`` for each. Mixing in
``AsyncDataLoaderMixin`` first (``class Loader(AsyncDataLoaderMixin, MyLoader)``) moves
``_iterate()`` to a background thread that fills a bounded queue, so the next batches (and
the next epoch's first ones) are read while the current ones are used.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

__all__ = ["AsyncDataLoaderMixin", "BaseDataLoader"]

# The worker gives up a blocked put this often to see whether the loader was closed.
_PUT_POLL_S = 0.05


class BaseDataLoader:
    """The data loader interface: subclasses implement ``__len__`` and ``_iterate``."""

    def __len__(self) -> int:
        """Number of batches the loader yields per pass."""
        raise NotImplementedError()

    def _iterate(self) -> Iterator[Any]:
        """Yields the batches of one pass over the data."""
        raise NotImplementedError()

    def __iter__(self) -> Iterator[Any]:
        """Yields ``_process_batch(batch)`` for each batch of ``_iterate()``."""
        for batch in self._iterate():
            yield self._process_batch(batch)

    def _process_batch(self, batch: Any) -> Any:
        """Hook a trainer may override to reshape each batch; returns it unchanged."""
        return batch


class _EndOfPass:
    """Queue marker: the worker finished one pass of ``_iterate()``."""


class _Failed:
    """Queue marker: ``_iterate()`` raised ``error`` in the worker."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class AsyncDataLoaderMixin:
    """Loads the batches of a ``BaseDataLoader`` in a background thread (Horovod's mixin).

    The thread starts at the first iteration and runs ``_iterate()`` pass after pass, putting
    the batches into a queue of ``async_loader_queue_size`` entries (it blocks when the queue
    is full, so at most that many batches are read ahead); each iteration of the loader
    yields one pass, in ``_iterate()``'s order. An exception raised by ``_iterate()`` is
    raised by the iteration that reaches it (and by any later one: the thread has stopped).
    ``close_async_loader()`` stops and joins the thread and discards what was read ahead;
    the loader cannot be iterated afterwards (RuntimeError).

    Args:
        async_loader_queue_size: batches read ahead (default 64); 0 loads synchronously in
            the iterating thread.
        debug_data_loader: print what the loader does (default False).
        *args, **kwargs: passed on to the next class's ``__init__``.
    """

    def __init__(
        self,
        async_loader_queue_size: int = 64,
        debug_data_loader: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if not isinstance(async_loader_queue_size, int) or async_loader_queue_size < 0:
            raise ValueError(
                "async_loader_queue_size must be an int >= 0 (0: no background loading), "
                f"got {async_loader_queue_size!r}"
            )
        self.async_loader_queue_size = async_loader_queue_size
        self.debug_data_loader = debug_data_loader
        super().__init__(*args, **kwargs)
        self.started = False
        self._closed = False
        self._error: BaseException | None = None
        if self.async_loader_queue_size > 0:
            self.finished_event = threading.Event()
            self.queue: queue.Queue = queue.Queue(self.async_loader_queue_size)
            self.thread = threading.Thread(
                target=self._async_worker, name="bagua_hvd-async-data-loader", daemon=True
            )

    def _debug(self, message: str) -> None:
        if self.debug_data_loader:
            print(f"AsyncDataLoaderMixin[{self.async_loader_queue_size}]: {message}", flush=True)

    def _put(self, item: Any) -> bool:
        """Puts ``item``, waiting for room; False when the loader was closed meanwhile."""
        while not self.finished_event.is_set():
            try:
                self.queue.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _async_worker(self) -> None:
        """The background thread: passes of ``_iterate()`` into the queue until closed."""
        passes = 0
        try:
            while not self.finished_event.is_set():
                for batch in self._iterate():
                    if not self._put(batch):
                        return
                if not self._put(_EndOfPass()):
                    return
                passes += 1
                self._debug(f"pass {passes} read")
        except BaseException as e:  # handed to the iterating thread, which raises it
            self._put(_Failed(e))
        finally:
            self._debug("worker stopped")

    def close_async_loader(self) -> None:
        """Stops the background thread, waits for it and discards the batches read ahead."""
        self._closed = True
        if self.async_loader_queue_size > 0 and self.started:
            self.finished_event.set()
            self.thread.join()
            discarded = 0
            while True:
                try:
                    self.queue.get_nowait()
                    discarded += 1
                except queue.Empty:
                    break
            self._debug(f"closed ({discarded} entries discarded)")

    def __iter__(self) -> Iterator[Any]:
        """Yields one pass of ``_process_batch(batch)``, read by the background thread."""
        if self._closed:
            raise RuntimeError("the async data loader was closed (close_async_loader())")
        if self.async_loader_queue_size == 0:
            yield from super().__iter__()  # type: ignore[misc]
            return
        if self._error is not None:
            raise RuntimeError(
                f"the async data loader stopped after its _iterate() raised: {self._error!r}"
            ) from self._error
        if not self.started:
            self.started = True
            self.thread.start()
        while True:
            item = self.queue.get()
            if isinstance(item, _EndOfPass):
                return
            if isinstance(item, _Failed):
                self._error = item.error
                raise item.error
            yield self._process_batch(item)  # type: ignore[attr-defined]
