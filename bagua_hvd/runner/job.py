"""Starts the ranks of one node, forwards their output and supervises them.

Policy (shared by ``bagua-run`` and ``bagua_hvd.run``):

- Every rank runs in its own session and process group, so signals reach its grandchildren too.
  Ranks read stdin from /dev/null.
- Each rank is started by a guard (bagua_hvd.runner.guard), the leader of its group, which
  reports the rank's exit status as its own and stops the group (SIGTERM, then SIGKILL
  ``KILL_AFTER_S`` seconds later) when the launcher exits in any way, even by SIGKILL: ranks
  never outlive their launcher.
- Output is forwarded a line at a time as ``[<rank>]<stdout>:line`` / ``[<rank>]<stderr>:line`` (the
  launcher's stdout / stderr); a line is written whole, never interleaved with another.
  ``output_dir`` also receives the raw lines in ``<dir>/rank.<padded rank>/stdout|stderr``.
- When a rank exits non-zero, the others get ``FAILURE_GRACE_S`` seconds to exit on their own,
  then SIGTERM, then SIGKILL ``KILL_AFTER_S`` seconds later: all are gone within 10 seconds.
- SIGINT / SIGTERM / SIGHUP to the launcher send SIGTERM to every rank at once (SIGKILL after
  ``KILL_AFTER_S``; a second signal kills at once).
- Exit codes follow the shell: a rank killed by signal N counts as 128 + N. The launcher's code is
  that of the first rank that failed, or 128 + N when the launcher itself got signal N. The
  failure report names that rank in Horovod's words and lists the other non-zero exits too.
- When every rank has exited, whatever is left in their process groups (background children)
  gets SIGTERM, then SIGKILL: a job leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Dict, List, Mapping, Optional, Sequence, Set

from bagua_hvd.runner.hosts import Slot

FAILURE_GRACE_S = 2.0
KILL_AFTER_S = 3.0
# Bound on waits for pipes to drain / groups to empty once the ranks have exited.
DRAIN_TIMEOUT_S = 2.0
_POLL_S = 0.1
_MAX_LINE = 1 << 16
# Bound on the wait for a guard to start its rank's command (a fresh interpreter: ~20 ms).
GUARD_START_TIMEOUT_S = 60.0
_GUARD = str(Path(__file__).resolve().with_name("guard.py"))

FAILURE_MESSAGE = (
    "Horovod detected that one or more processes exited with non-zero status, thus causing the "
    "job to be terminated. The first process to do so was:\nProcess name: {name}\n"
    "Exit code: {code}\n"
)


class LaunchError(RuntimeError):
    """The job could not be started (bad command, unreachable rendezvous...)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass
class JobResult:
    """How a job ended."""

    exit_code: int  # what the launcher exits with (0: every rank succeeded)
    codes: Dict[int, int]  # rank -> exit code (shell convention), for every rank that exited
    failed_rank: Optional[int] = None  # the first rank that exited non-zero
    signal: Optional[int] = None  # the signal that stopped the launcher, if any
    stopped: Set[int] = dataclasses.field(default_factory=set)  # ranks the launcher signalled
    note: Optional[str] = None  # why the first failure happened, when no rank's code tells it

    @classmethod
    def ended(
        cls,
        codes: Dict[int, int],
        failed_rank: Optional[int],
        got_signal: Optional[int],
        stopped: Set[int],
        note: Optional[str] = None,
    ) -> JobResult:
        """The result of a job whose ranks have all exited: the launcher's exit code is the
        first failed rank's, else 128 + the signal that stopped it, else any non-zero code."""
        if failed_rank is not None:
            exit_code = codes[failed_rank]
        elif got_signal is not None:
            exit_code = 128 + got_signal
        else:
            exit_code = next((c for c in codes.values() if c != 0), 0)
        return cls(exit_code, codes, failed_rank, got_signal, stopped, note)

    def failure_message(self) -> str:
        """Horovod's text naming the first failed rank ("" when none failed), then the other
        failures: the first to exit is not always the cause (a failing rank may take longer to
        exit than the peers its failure brought down)."""
        if self.failed_rank is None:
            return ""
        code = self.codes[self.failed_rank]
        text = FAILURE_MESSAGE.format(name=self.failed_rank, code=code)
        if self.note:
            text += f"({self.note})\n"
        if code > 128 and code - 128 in _SIGNAL_NAMES:
            text += f"(exit code {code} = 128 + signal {code - 128}, {_SIGNAL_NAMES[code - 128]})\n"
        others = [
            f"{rank} (exit code {c}{', stopped by the launcher' if rank in self.stopped else ''})"
            for rank, c in sorted(self.codes.items())
            if c != 0 and rank != self.failed_rank
        ]
        if others:
            text += f"Other processes that exited with non-zero status: {', '.join(others)}\n"
        return text


_SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


def shell_exit_code(returncode: int) -> int:
    """Popen's return code in shell convention (-N for signal N becomes 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def pad_rank(rank: int, size: int) -> str:
    """Horovod's zero padding of rank directory names (width of the largest rank)."""
    return str(rank).zfill(len(str(max(size - 1, 0))))


def output_rank_dir(output_dir: str, rank: int, size: int) -> Path:
    """Creates ``--output-filename``'s directory for ``rank`` (``DIR/rank.<padded rank>``, as
    horovodrun) and returns it; LaunchError naming the directory when it cannot be created or
    written. Every launch path (one host, ``-H``, elastic) checks it before any rank starts, so
    that no rank's output is lost to a directory that cannot hold it."""
    rank_dir = Path(output_dir) / f"rank.{pad_rank(rank, size)}"
    try:
        rank_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(rank_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise LaunchError(
            f"cannot write --output-filename files in {rank_dir}: {e.strerror or e}"
        ) from e
    return rank_dir


class _Output:
    """Writes whole prefixed lines to the launcher's stdout/stderr under one lock; with
    ``timestamp`` (``bagua-run --prefix-output-with-timestamp``) each line starts with the local
    time, as horovodrun writes it (``time.asctime()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.timestamp = False

    def write(self, kind: str, data: bytes) -> None:
        # Looked up per write so that redirection (pytest capture, notebooks) is honoured.
        stream = sys.stdout if kind == "stdout" else sys.stderr
        if stream is None:
            return
        if self.timestamp:
            data = time.asctime().encode() + data
        with self._lock:
            try:
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    stream.flush()  # keep order with text already written to the stream
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (closed pipe): keep draining the rank anyway


# One writer per process: the ranks' lines and an agent's reports (bagua_hvd.runner.agent) never
# interleave.
OUTPUT = _Output()


def _pump(pipe: IO[bytes], prefix: bytes, kind: str, out: _Output, copy: Optional[IO[bytes]]):
    try:
        while True:
            line = pipe.readline(_MAX_LINE)
            if not line:
                break
            if copy is not None:  # the raw bytes, unprefixed
                copy.write(line)
                copy.flush()
            out.write(kind, prefix + (line if line.endswith(b"\n") else line + b"\n"))
    except (OSError, ValueError):
        pass
    finally:
        pipe.close()
        if copy is not None:
            copy.close()


def _signal_group(pgid: int, sig: int) -> bool:
    """Sends sig to a process group; False when the group is empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by someone else's process: not ours to signal
        return False


def _terminate_group(pgid: int) -> bool:
    """SIGTERM to a process group, then SIGCONT: a stopped (SIGSTOP) rank acts on the SIGTERM at
    once instead of waiting for the SIGKILL (as shells' kill and systemd do). False when the
    group is empty."""
    if not _signal_group(pgid, signal.SIGTERM):
        return False
    _signal_group(pgid, signal.SIGCONT)
    return True


def _group_alive(pgid: int) -> bool:
    """True while the process group has a member that is not a zombie.

    Orphaned grandchildren are reaped by init, which may take a while (or never happen in some
    containers); zombies hold nothing, so on Linux they do not count.
    """
    if not _signal_group(pgid, 0):
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


@dataclasses.dataclass
class _Rank:
    slot: Slot
    proc: subprocess.Popen  # the rank's guard, the leader of its process group
    threads: List[threading.Thread]
    status_fd: int  # the guard's report on starting the command (closed once read)


class SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP while a job runs (main thread only); restores on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: List[int] = []
        self._previous: Dict[int, object] = {}

    def __enter__(self) -> SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        # Only record: the supervision loop acts on it (a handler must not take locks).
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # None: the handler was installed outside Python; the default is the best we can do.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def run_job(
    command: Sequence[str],
    slots: Sequence[Slot],
    env: Mapping[str, str],
    output_dir: Optional[str] = None,
    verbose: bool = False,
    cwd: Optional[str] = None,
    on_exit: Optional[Callable[[int, int], None]] = None,
) -> JobResult:
    """Runs ``command`` once per slot with ``os.environ + env + slot.env()`` and waits for all.

    ``on_exit(rank, code)`` is called as each rank exits (shell convention codes), from the
    supervising thread. Raises LaunchError if a rank cannot be started (after stopping those
    already started).
    """
    out = OUTPUT
    ranks: List[_Rank] = []
    events: queue.Queue = queue.Queue()
    # The guards watch watch_r: only this process holds watch_w (os.pipe's descriptors are not
    # inherited), so it reaches end of file exactly when this process exits, or below.
    watch_r, watch_w = os.pipe()
    try:
        with SignalTrap() as trap:
            try:
                for slot in slots:
                    ranks.append(
                        _start_rank(command, slot, env, output_dir, out, events, cwd, watch_r)
                    )
                for r in ranks:
                    pid = _confirm_start(r, command)
                    if verbose:
                        _log(f"rank {r.slot.rank} started (pid {pid})")
                result = _supervise(ranks, events, trap, verbose, on_exit)
            except BaseException:  # a rank that cannot start, or a bug here: leave nothing running
                _stop(ranks)
                raise
        _cleanup(ranks)
    finally:
        os.close(watch_r)
        os.close(watch_w)  # every rank is gone by now: nothing for the guards to stop
    return result


def _log(message: str) -> None:
    print(f"bagua-run: {message}", file=sys.stderr, flush=True)


def _start_rank(command, slot, env, output_dir, out, events, cwd, watch_fd) -> _Rank:
    full_env = dict(os.environ)
    full_env.update(env)
    full_env.update(slot.env())
    copies: Dict[str, Optional[IO[bytes]]] = {"stdout": None, "stderr": None}
    if output_dir is not None:
        rank_dir = output_rank_dir(output_dir, slot.rank, slot.size)
        try:
            copies = {kind: open(rank_dir / kind, "wb") for kind in copies}
        except OSError as e:
            raise LaunchError(f"cannot write --output-filename files in {rank_dir}: {e}") from e
    try:
        proc, status_r = start_guarded(command, full_env, watch_fd, cwd)
    except OSError as e:
        for copy in copies.values():
            if copy is not None:
                copy.close()
        raise LaunchError(
            f"cannot start rank {slot.rank}: {sys.executable!r} (the rank's guard): "
            f"{e.strerror or e}",
        ) from e
    threads = []
    for kind, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        prefix = f"[{slot.rank}]<{kind}>:".encode()
        thread = threading.Thread(
            target=_pump,
            args=(pipe, prefix, kind, out, copies[kind]),
            name=f"bagua-run-{kind}-{slot.rank}",
            daemon=True,
        )
        thread.start()
        threads.append(thread)

    def wait() -> None:
        events.put((slot.rank, proc.wait()))

    waiter = threading.Thread(target=wait, name=f"bagua-run-wait-{slot.rank}", daemon=True)
    waiter.start()
    return _Rank(slot=slot, proc=proc, threads=threads, status_fd=status_r)


def _confirm_start(rank: _Rank, command: Sequence[str]) -> Optional[int]:
    """Waits for the guard's report on starting the command; returns the rank's pid (None when
    the guard died before it could tell). Raises LaunchError when the command cannot run."""
    pid, error = guard_report(rank.status_fd)
    if error is not None:
        code, message = error
        raise LaunchError(
            f"cannot start rank {rank.slot.rank} command {command[0]!r}: {message}",
            exit_code=127 if code == errno.ENOENT else 126,
        )
    return pid


def start_guarded(
    command: Sequence[str], env: Mapping[str, str], watch_fd: int, cwd: Optional[str] = None
) -> tuple[subprocess.Popen, int]:
    """Starts ``command`` under a guard (bagua_hvd.runner.guard) that stops it once
    ``watch_fd``'s pipe reaches end of file; its stdout and stderr are pipes. Returns the guard
    and the read end of its start report (for :func:`guard_report`). OSError when the guard
    cannot start."""
    status_r, status_w = os.pipe()
    guard = [sys.executable, "-I", "-S", _GUARD, str(watch_fd), str(status_w), str(KILL_AFTER_S)]
    try:
        proc = subprocess.Popen(
            guard + list(command),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(watch_fd, status_w),
        )
    except OSError:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    return proc, status_r


def guard_report(status_fd: int) -> tuple[Optional[int], Optional[tuple[int, str]]]:
    """Reads (and closes) a guard's start report: (the command's pid, None), or (None,
    (errno, message)) when the command could not start; (None, None) when the guard died
    before it could tell."""
    data = b""
    deadline = time.monotonic() + GUARD_START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([status_fd], [], [], deadline - time.monotonic())
            if not ready:
                break
            chunk = os.read(status_fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(status_fd)
    word, _, rest = data.decode("utf-8", "replace").strip().partition(" ")
    if word == "error":
        code, _, message = rest.partition(" ")
        return None, (int(code) if code.isdigit() else errno.EIO, message)
    return (int(rest) if word == "ok" and rest.isdigit() else None), None


def _stop(ranks: Sequence[_Rank]) -> None:
    """Terminates ranks that are still running (SIGTERM, then SIGKILL), then cleans up."""
    alive = [r for r in ranks if r.proc.poll() is None]
    for r in alive:
        _terminate_group(r.proc.pid)
    deadline = time.monotonic() + KILL_AFTER_S
    for r in alive:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(r.proc.pid, signal.SIGKILL)
            r.proc.wait(timeout=KILL_AFTER_S)
    _cleanup(ranks)


def _supervise(
    ranks: Sequence[_Rank],
    events: queue.Queue,
    trap: SignalTrap,
    verbose: bool,
    on_exit: Optional[Callable[[int, int], None]] = None,
) -> JobResult:
    by_rank = {r.slot.rank: r for r in ranks}
    running = set(by_rank)
    codes: Dict[int, int] = {}
    failed_rank: Optional[int] = None
    got_signal: Optional[int] = None
    term_at: Optional[float] = None
    kill_at: Optional[float] = None
    termed = killed = False
    stopped: Set[int] = set()
    seen_signals = 0
    while running:
        now = time.monotonic()
        if len(trap.received) > seen_signals:
            seen_signals = len(trap.received)
            if got_signal is None:
                got_signal = trap.received[0]
                if verbose:
                    _log(f"got {_SIGNAL_NAMES.get(got_signal, got_signal)}: stopping all ranks")
                term_at = now if term_at is None else min(term_at, now)
                kill_at = (
                    now + KILL_AFTER_S if kill_at is None else min(kill_at, now + KILL_AFTER_S)
                )
            if seen_signals > 1:
                kill_at = now  # second Ctrl-C: no more patience
        if term_at is not None and not termed and now >= term_at:
            termed = True
            stopped.update(running)
            for rank in sorted(running):
                _terminate_group(by_rank[rank].proc.pid)
        if kill_at is not None and not killed and now >= kill_at:
            killed = True
            for rank in sorted(running):
                if verbose:
                    _log(f"rank {rank} did not exit after SIGTERM: sending SIGKILL")
                _signal_group(by_rank[rank].proc.pid, signal.SIGKILL)
        if killed and now >= kill_at + KILL_AFTER_S:
            # SIGKILL could not end them (uninterruptible sleep): report instead of hanging.
            _log(f"ranks {sorted(running)} survived SIGKILL for {KILL_AFTER_S:.0f} s; giving up")
            break
        try:
            rank, returncode = events.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        running.discard(rank)
        code = shell_exit_code(returncode)
        codes[rank] = code
        if verbose:
            _log(f"rank {rank} exited with code {code}")
        if on_exit is not None:
            on_exit(rank, code)
        if code != 0 and failed_rank is None and got_signal is None and not termed:
            failed_rank = rank
            if running:
                term_at = time.monotonic() + FAILURE_GRACE_S
                kill_at = term_at + KILL_AFTER_S
    return JobResult.ended(codes, failed_rank, got_signal, stopped)


def end_groups(pgids: Sequence[int]) -> None:
    """Ends what is left in the process groups of exited guards (a rank's daemonized children):
    SIGTERM, then SIGKILL to those still there after DRAIN_TIMEOUT_S."""
    leftover = [g for g in pgids if _terminate_group(g)]
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while leftover and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        leftover = [g for g in leftover if _group_alive(g)]
    for g in leftover:
        _signal_group(g, signal.SIGKILL)


def _cleanup(ranks: Sequence[_Rank]) -> None:
    """Ends what the ranks left in their process groups and drains their output (bounded)."""
    end_groups([r.proc.pid for r in ranks])
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    for r in ranks:
        for thread in r.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
