"""``algorithm="auto"``: measure a few steps of each candidate algorithm, keep the fastest
(docs/algorithms.md, "Auto").

Written once for every frontend (the declaration, :class:`~bagua_hvd.common.algorithms.Auto`,
with its validated candidates, is in ``algorithms.py``): :class:`AutoSchedule`, the state of
one training loop: which candidate runs at
each step, the step times measured, the decision (the ranks' medians averaged by an allreduce,
then rank 0's choice broadcast, so every rank switches to the same candidate at the same
step), the table printed once by rank 0, and the state kept by checkpoints. A frontend calls
:meth:`AutoSchedule.begin_step` at the start of every step and runs the candidate it names,
each candidate with an implementation of its own (the chosen one with a fresh one: its state,
e.g. ByteGrad's error-feedback residuals, starts at the decision, as if it had run alone from
there).

This module imports no framework.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from bagua_hvd.common import config
from bagua_hvd.common import ops as _ops

__all__ = ["AutoSchedule", "TEST_DELAY_ENV", "test_delays"]

#: the test hook: ``"ByteGrad:0.05"`` makes each step of that candidate sleep 0.05 s
TEST_DELAY_ENV = config.TEST_ALGORITHM_DELAY_ENV


# ---- the test hook ---------------------------------------------------------------------------
_parsed: Tuple[str, Dict[str, float]] = ("", {})


def test_delays() -> Dict[str, float]:
    """``BAGUA_HVD_TEST_ALGORITHM_DELAY`` parsed: ``"Name:seconds[,Name:seconds]"``, Name a
    class name (``ByteGrad``) or a ``bagua-run --algorithm`` name (``bytegrad``), matched
    without case; ValueError for a malformed value."""
    global _parsed
    text = config.test_algorithm_delay()
    if text == _parsed[0]:
        return _parsed[1]
    out: Dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, secs = part.partition(":")
        try:
            value = float(secs)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or value < 0:
            raise ValueError(
                f"{TEST_DELAY_ENV}={text!r}: expected Name:seconds[,Name:seconds], e.g. "
                "ByteGrad:0.05"
            )
        out[name.strip().lower().replace("_", "")] = value
    _parsed = (text, out)
    return out


def _test_delay(alg: Any) -> float:  # a candidate: an Algorithm (common/algorithms.py)
    delays = test_delays()
    return delays.get(type(alg).__name__.lower(), 0.0) if delays else 0.0


# ---- the schedule of one training loop --------------------------------------------------------
_uids = itertools.count()


def _host_collective(
    op_type: int, values: List[Any], ctype: str, dtype: int, name: str, ps_id: int, **kw: Any
) -> List[Any]:
    """One collective of the core over a small host array, in place; returns the result."""
    n = _ops.native()
    buf = n.ffi.new(f"{ctype}[]", values)
    desc = (int(n.ffi.cast("uintptr_t", buf)), dtype, (len(values),))
    handle, keep = _ops.enqueue(op_type, [desc], [desc], name=name, process_set_id=ps_id, **kw)
    try:
        _ops.wait(handle, name)
    finally:
        _ops.release(handle)
    del keep
    return list(buf)


class AutoSchedule:
    """One training loop's measurement and choice (see :class:`Auto`).

    Steps are counted by :meth:`begin_step`. ``chosen`` is None until the decision, then the
    index of the chosen candidate; ``step_times`` the agreed seconds per step of each candidate
    (what the table shows). Its state goes into checkpoints (:meth:`state_dict`). At the first
    step and after an elastic reset (:meth:`reset`) every rank takes rank 0's state: a choice
    made is kept (a worker that joins takes it too); an undecided measurement starts again."""

    def __init__(self, alg: Any, process_set: Any) -> None:  # alg: algorithms.Auto
        self.alg = alg
        self.process_set = process_set
        self.uid = next(_uids)  # the collectives' names: schedules are made in the same order
        self.step = 0  #: steps begun
        self.current = 0  #: the candidate of the step in progress
        self.chosen: Optional[int] = None
        self.chosen_step: Optional[int] = None  #: the first step of the chosen candidate
        self.step_times: Optional[List[float]] = None
        self._times = self._no_times()  # this rank's, per candidate and round
        self._origin = 0  # the step the schedule (re)started at
        self._timed: Optional[Tuple[int, int]] = None  # (candidate, round) of the step timed
        self._last = 0.0
        self._agree = True
        self._printed = False
        _LIVE.add(self)

    # -- the schedule ------------------------------------------------------------------------------
    def _planned(self, step: int) -> Tuple[int, Optional[int]]:
        """``(candidate, the round its step is timed in, or None)`` of ``step`` before the
        decision; candidate -1: decide now."""
        alg = self.alg
        m = step - self._origin - alg.warmup_steps
        if m < 0:
            return 0, None
        per = alg.steps_per_candidate + 1
        r, rest = divmod(m, per * len(alg.candidates))
        if r >= alg.rounds:
            return -1, None
        c, pos = divmod(rest, per)
        return c, (r if pos >= 1 else None)

    def begin_step(self) -> Tuple[int, bool]:
        """A step begins (before any of its communication; called once per step on every
        rank). Returns ``(candidate index, final)``: ``final`` once the choice is made (the
        frontend then runs the chosen candidate's own implementation, fresh at the decision).
        Sleeps for the test hook (:data:`TEST_DELAY_ENV`) in the candidate's steps."""
        now = time.perf_counter()
        if self._timed is not None:
            c, r = self._timed
            self._times[c][r].append(now - self._last)
            self._timed = None
        if self._agree:
            self._agree_with_root()
        if self.chosen is None:
            c, r = self._planned(self.step)
            if c < 0:
                self._decide()
            else:
                self.current = c
                if r is not None:
                    self._timed = (c, r)
        if self.chosen is not None:
            self.current = self.chosen
        self.step += 1
        self._last = now
        delay = _test_delay(self.alg.candidates[self.current])
        if delay:
            time.sleep(delay)
        return self.current, self.chosen is not None

    @property
    def ps_id(self) -> int:
        return _ops.process_set_id(self.process_set)

    def _rank(self) -> int:
        return _ops.process_set_rank(self.ps_id)

    def _agree_with_root(self) -> None:
        """Every rank takes rank 0's step count and choice (or, undecided there, starts
        measuring again)."""
        self._agree = False
        mine = [self.step, -1 if self.chosen is None else self.chosen, self.chosen_step or 0]
        root = _host_collective(
            _ops.OP_BROADCAST, mine, "int64_t", _ops.INT64, f"auto.{self.uid}.state", self.ps_id
        )
        self.step = int(root[0])
        if root[1] >= 0:
            self.chosen, self.chosen_step = int(root[1]), int(root[2])
        else:
            self.chosen = self.chosen_step = None
            self._origin = self.step
            self._times = self._no_times()
        self._timed = None

    def _no_times(self) -> List[List[List[float]]]:
        return [[[] for _ in range(self.alg.rounds)] for _ in self.alg.candidates]

    @property
    def measured(self) -> int:
        """Steps this rank measured since the schedule (re)started."""
        return sum(len(t) for rounds in self._times for t in rounds)

    def _decide(self) -> None:
        """Averages each candidate's step time (the smallest of its rounds' medians) over the
        ranks; every rank takes rank 0's argmin."""
        medians = [
            min((statistics.median(t) for t in rounds if t), default=float("inf"))
            for rounds in self._times
        ]
        times = _host_collective(
            _ops.OP_ALLREDUCE,
            medians,
            "double",
            _ops.FLOAT64,
            f"auto.{self.uid}.times",
            self.ps_id,
            reduce_op=_ops.Average,
        )
        best = min(range(len(times)), key=lambda i: times[i])
        best = _host_collective(
            _ops.OP_BROADCAST, [best], "int64_t", _ops.INT64, f"auto.{self.uid}.choice", self.ps_id
        )[0]
        self.chosen, self.chosen_step, self.step_times = int(best), self.step, times
        if self.alg.verbose and self._rank() == 0 and not self._printed:
            self._printed = True
            print(self.table(), file=sys.stdout, flush=True)

    def table(self) -> str:
        """The measurements and the choice, as rank 0 prints them."""
        labels = self.alg.labels()
        width = max(len(s) for s in labels + ["candidate"])
        alg = self.alg
        rounds = f", the best of {alg.rounds} rounds" if alg.rounds > 1 else ""
        lines = [
            f"bagua_hvd auto: median step time of {alg.steps_per_candidate} steps per "
            f"candidate{rounds}, averaged over {_ops.process_set_size(self.ps_id)} ranks",
            f"  {'candidate':<{width}}  step (ms)",
        ]
        for i, label in enumerate(labels):
            t = (self.step_times or [])[i] if self.step_times else float("nan")
            mark = "  <- chosen" if i == self.chosen else ""
            lines.append(f"  {label:<{width}}  {t * 1e3:9.2f}{mark}")
        lines.append(f"bagua_hvd auto: chose {labels[self.chosen]} from step {self.chosen_step}")
        return "\n".join(lines)

    # -- elastic jobs and checkpoints --------------------------------------------------------------
    def reset(self) -> None:
        """A new job was formed (an elastic reset): the next step agrees with rank 0 again
        (a choice made is kept, nothing is measured again)."""
        self._agree = True
        self._timed = None

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps: the candidates' labels, the choice, the agreed times."""
        return {
            "candidates": self.alg.labels(),
            "chosen": self.chosen,
            "chosen_step": self.chosen_step,
            "step_times": None if self.step_times is None else list(self.step_times),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`: a saved choice is taken (nothing is measured); a state
        saved before the choice leaves this one as it is. ValueError when the candidates
        differ. Every rank loads the same state (or rank 0 loads it before the first step:
        the first step takes rank 0's)."""
        labels = self.alg.labels()
        if list(state.get("candidates", [])) != labels:
            raise ValueError(
                f"Auto: the checkpoint's candidates {state.get('candidates')} are not this "
                f"algorithm's {labels}"
            )
        if state.get("chosen") is not None:
            self.chosen = int(state["chosen"])
            self.chosen_step = state.get("chosen_step")
            self.step_times = state.get("step_times")
            self._timed = None


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _reset_all() -> None:
    for s in list(_LIVE):
        s.reset()


def _register_reset() -> None:
    from bagua_hvd.common.basics import after_init

    after_init(_reset_all)


_register_reset()
