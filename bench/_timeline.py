"""Per-step timeline of one rank (bench/algorithms.py --timeline, bench/timeline.py).

Two sources, on one clock (CLOCK_MONOTONIC: Python's ``time.monotonic_ns`` and the core's):

* Python, around the primitives (installed by :func:`install`): a bucket's launch (the engine's
  ``primitives.allreduce``; Horovod's allreduce of a host bucket, from its descriptions
  (``mpi_ops.host_allreduce_descs``) to its handle (``mpi_ops.track``), or
  ``bucket_allreduce_async`` for CUDA tensors), the
  return of its wait (``Request.wait``, ``mpi_ops.synchronize``), the optimizer's updates
  (the wrapped ``torch.optim`` class's ``step``), and the step's own phases (forward, backward,
  ``step()``), which the benchmark marks.
* The core (``bhvd_trace_read``, native/include/bagua_hvd/c_api.h, when the library has
  it): begin and end of each collective on the core's thread (ByteGrad's compressed allreduce
  also marks the end of its alltoall half), and the low-precision step on the training thread:
  the core's ring marks each bucket's "wait returns" (the previous step's exchange) and
  "exchange launch", around its local half.

Events are (t_ns, what, bucket, elements). A bucket is numbered in launch order within the step;
core events are matched to buckets by element count, in order.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Optional, Tuple

Event = Tuple[int, str, str, int]  # t_ns, what, bucket label ("" if none), elements

_CORE_OPS = {1: "bytegrad", 2: "bytegrad", 3: "allreduce", 4: "lp exchange", 5: "lp local"}
_RING_LAUNCH, _RING_WAITED = 6, 7  # the core's low-precision ring: marks named as Python's
_CORE_PHASES = {0: "begin", 1: "alltoall done", 2: "end"}
PREV = " (prev. step)"  # a bucket launched by the step before


class Tracer:
    """Collects one rank's events; :meth:`begin_step` / :meth:`end_step` delimit a step."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self.on = False
        self._core = _core_trace()
        self._label: Dict[int, str] = {}  # id(request or handle) -> bucket label, until waited
        self._pending: List[List[Any]] = []  # launches not matched to a core begin: t, n, label
        self._open: Dict[Tuple[int, int], List[str]] = {}  # core ops begun, not ended: labels
        self._carry: List[Event] = []  # core events after the last step's end
        self._early: List[Event] = []  # core events of this step drained at its start
        self._launches = 0  # this step's
        self.t0 = 0
        self.cpu0 = self.cpu_ns = 0  # CPU time of the process (all its threads) in the step

    @property
    def has_core(self) -> bool:
        return self._core is not None

    def mark(self, what: str, bucket: str = "", elements: int = 0) -> None:
        if self.on:
            self.events.append((time.monotonic_ns(), what, bucket, elements))

    def launched(self, key: Any, elements: int, t_ns: int, what: str = "launch") -> None:
        """A bucket was submitted at ``t_ns`` (taken before the call: the core may begin its
        collective before the call returns)."""
        if self.on:
            label = str(self._launches)
            self._launches += 1
            self._label[id(key)] = label
            self._pending.append([t_ns, elements, label])
            self.events.append((t_ns, what, label, elements))

    def waited(self, key: Any) -> None:
        if self.on:
            self.mark("wait returns", self._label.pop(id(key), "?"))

    def begin_step(self) -> None:
        self.cpu0 = time.process_time_ns()
        self.t0 = time.monotonic_ns()
        # Core events since the last step's end, labelled with that step's buckets, are shown
        # in this step (those between the two steps with negative times).
        late = self._carry + (
            self._label_core(self._drain(), ring=False) if self._core is not None else []
        )
        self._carry = []
        self.events = [(self.t0, "step begins", "", 0)]
        self._launches = 0
        # What the previous step launched and this one may still see.
        for key in list(self._label):
            if not self._label[key].endswith(PREV):
                self._label[key] += PREV
            else:
                del self._label[key]
        self._pending = [[t, n, lab + PREV] for t, n, lab in self._pending if PREV not in lab]
        self._open = {k: [_prev(lab) for lab in v] for k, v in self._open.items()}
        self._early = [(t, w, _prev(lab), n) for t, w, lab, n in late]
        if self._core is not None:
            self._core[1].bhvd_trace_enable(1)
        self.on = True

    def end_step(self) -> List[Event]:
        """The step's events, sorted, core events included (an exchange launched by the
        previous step shows with its label + PREV)."""
        t_end = time.monotonic_ns()
        self.events.append((t_end, "step ends", "", 0))
        self.cpu_ns = time.process_time_ns() - self.cpu0
        self.on = False
        core = self._label_core(self._drain(), ring=True)
        self._carry = [e for e in core if e[0] > t_end]  # the next step's
        events = self.events + self._early + [e for e in core if self.t0 <= e[0] <= t_end]
        events.sort(key=lambda e: e[0])  # stable: "step ends" last
        return events

    def _drain(self) -> List[Tuple[int, int, int, int]]:
        if self._core is None:
            return []
        ffi, lib = self._core
        out: List[Tuple[int, int, int, int]] = []
        buf = ffi.new("int64_t[]", 4 * 1024)
        while True:
            n = lib.bhvd_trace_read(buf, 1024)
            out += [tuple(buf[4 * i : 4 * i + 4]) for i in range(n)]
            if n < 1024:
                return out

    def _label_core(self, core: List[Tuple[int, int, int, int]], ring: bool) -> List[Event]:
        """Core events named and matched to buckets: a collective's begin to the earliest
        launch of its element count before it; the local halves (no launch) by their order;
        the ring's launches and waits (``ring``: within a traced step, else dropped) by theirs."""
        open_ = self._open
        local = waited = 0
        out: List[Event] = []
        for t, op, phase, count in core:
            if op in (_RING_LAUNCH, _RING_WAITED) and not ring:
                continue  # between traced steps: Python's own marks would not be recorded
            if op == _RING_LAUNCH:  # a launch as Python's, in the ring's bucket order
                label = str(self._launches)
                self._launches += 1
                self._pending.append([t, count, label])
                out.append((t, "exchange launch", label, count))
                continue
            if op == _RING_WAITED:  # the previous step's exchange of the next bucket
                out.append((t, "wait returns", _prev(str(waited)), count))
                waited += 1
                continue
            name = _CORE_OPS.get(op, f"op{op}")
            key = (1 if op == 2 else op, count)
            if op == 5:
                label = str(local)
                local += phase == 2
            elif phase == 0:
                label = "?"
                for i, (tl, n, lab) in enumerate(self._pending):
                    if n == count and tl <= t:
                        label = lab
                        del self._pending[i]
                        break
                open_.setdefault(key, []).append(label)
            else:
                stack = open_.get(key, [])
                label = stack[0] if stack else "?"
                if phase == 2 and stack:
                    stack.pop(0)
            out.append((t, f"core {name} {_CORE_PHASES.get(phase, phase)}", label, count))
        return out


def _prev(label: str) -> str:
    """A label of the previous step's bucket as this step shows it."""
    return label if not label or label == "?" or label.endswith(PREV) else label + PREV


def _core_trace() -> Optional[Tuple[Any, Any]]:
    """cffi handle of the core library's trace functions (c_api.h), or None when the library or
    its header has none (an older build, measured for comparison)."""
    try:
        from bagua_hvd.common import _native

        lib = _native.lib()
        lib.bhvd_trace_enable  # noqa: B018 - raises AttributeError when the symbol is absent
        return _native.ffi, lib
    except (AttributeError, ImportError, OSError):
        return None


def install(tracer: Tracer) -> None:
    """Wraps the primitives, waits and optimizer updates so that they report to ``tracer``."""
    import torch

    from bagua_hvd.common import primitives
    from bagua_hvd.torch import mpi_ops

    def numel_of(buf: Any) -> int:
        return int(getattr(buf, "numel", 0) or 0)

    orig_allreduce = primitives.allreduce

    @functools.wraps(orig_allreduce)
    def allreduce(buf: Any, *a: Any, **k: Any) -> Any:
        t = time.monotonic_ns()
        req = orig_allreduce(buf, *a, **k)
        tracer.launched(req, numel_of(buf), t)
        return req

    orig_wait = primitives.Request.wait

    @functools.wraps(orig_wait)
    def wait(self: Any) -> None:
        done = self.done
        orig_wait(self)
        if not done:
            tracer.waited(self)

    orig_bucket = mpi_ops.bucket_allreduce_async

    @functools.wraps(orig_bucket)
    def bucket_allreduce_async(tensors: Any, *a: Any, **k: Any) -> Any:
        t = time.monotonic_ns()
        handle = orig_bucket(tensors, *a, **k)
        tracer.launched(handle, sum(x.numel() for x in tensors), t)
        return handle

    # A host bucket: described just before its enqueue, tracked just after.
    orig_descs, orig_track = mpi_ops.host_allreduce_descs, mpi_ops.track
    described: List[Tuple[int, int]] = []

    @functools.wraps(orig_descs)
    def host_allreduce_descs(tensors: Any, *a: Any, **k: Any) -> Any:
        described.append((time.monotonic_ns(), sum(x.numel() for x in tensors)))
        return orig_descs(tensors, *a, **k)

    @functools.wraps(orig_track)
    def track(handle: Any, *a: Any, **k: Any) -> Any:
        out = orig_track(handle, *a, **k)
        if described:
            t, n = described.pop()
            tracer.launched(handle, n, t)
        return out

    orig_sync = mpi_ops.synchronize

    @functools.wraps(orig_sync)
    def synchronize(handle: Any) -> Any:
        out = orig_sync(handle)
        tracer.waited(handle)
        return out

    primitives.allreduce = allreduce
    primitives.Request.wait = wait
    mpi_ops.bucket_allreduce_async = bucket_allreduce_async
    mpi_ops.host_allreduce_descs = host_allreduce_descs
    mpi_ops.track = track
    mpi_ops.synchronize = synchronize

    for cls in (torch.optim.SGD,):
        orig_step = cls.step

        def step(self: Any, *a: Any, _orig: Any = orig_step, **k: Any) -> Any:
            n = sum(p.numel() for g in self.param_groups for p in g["params"])
            tracer.mark("update begins", "", n)
            out = _orig(self, *a, **k)
            tracer.mark("update ends", "", n)
            return out

        step.hooked = True  # type: ignore[attr-defined]  (torch's profiling wrapper: once)
        cls.step = step


def format_step(events: List[Event], t0: int, title: str) -> List[str]:
    """Lines of one step's timeline, times in ms from ``t0``."""
    lines = [title, "|     ms | event | bucket | elements |", "|---:|---|---:|---:|"]
    for t, what, b, n in events:
        bucket = b or "-"
        elems = f"{n / 1e6:.2f}M" if n else "-"
        lines.append(f"| {(t - t0) / 1e6:6.1f} | {what} | {bucket} | {elems} |")
    return lines


def summary(events: List[Event], t0: int) -> Dict[str, float]:
    """A few figures of one step (ms from its start): when forward and backward ended, the
    first launch, the last wait's return, the step's end, and the core's busy time."""
    first = {}
    last = {}
    for t, what, _b, _n in events:
        first.setdefault(what, t)
        last[what] = t
    out = {}
    for key, what, src in (
        ("forward_end", "forward ends", first),
        ("backward_end", "backward ends", first),
        ("first_launch", "launch", first),
        ("last_wait", "wait returns", last),
        ("step_end", "step ends", last),
    ):
        if what in src:
            out[key] = (src[what] - t0) / 1e6
    return out
