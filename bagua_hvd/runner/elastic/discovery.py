"""Where an elastic job's hosts come from (Horovod's ``horovod.runner.elastic.discovery``).

The driver polls a :class:`HostDiscovery` about once a second for ``{hostname: slots}``.
:class:`HostDiscoveryScript` runs the user's ``--host-discovery-script`` and reads one host per
line, ``host`` or ``host:slots``; :class:`FixedHosts` serves a fixed ``-H`` list.

Unlike Horovod, the script's output is checked line by line instead of being split blindly: a
bare host without ``--slots-per-host``, a slot count that is not a positive integer, one host
given two different slot counts, and a line that is not ``host[:slots]`` are errors naming the
line (Horovod turned them into a TypeError later on, an arbitrary choice, or a crash). IPv6
literals go in brackets, ``[::1]:2``. The script runs in its own process group, with a bound of
:data:`DISCOVERY_TIMEOUT_S` and of :data:`DISCOVERY_OUTPUT_LIMIT` bytes of output, so a hung or
runaway script cannot stall the driver's polling forever nor take its memory; the group is
killed at the end of each poll, by :meth:`HostDiscoveryScript.close`, and when the launcher
dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import selectors
import signal
import subprocess
import threading
import time
from typing import Callable, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

# How long one run of the discovery script may take before it is killed (seconds). Read at each
# run, so tests (and users who know better) can patch it.
DISCOVERY_TIMEOUT_S = 60.0
# The most a script may print to stdout in one run (bytes): past it, it is killed and the poll
# fails, so a runaway script cannot take the launcher's memory.
DISCOVERY_OUTPUT_LIMIT = 1 << 20
_STDERR_TAIL = 64 * 1024  # the end of stderr kept for the error message
_POLL_S = 0.05  # how often the wrapper's exit is checked while its pipes stay open

_SLOTS_RE = re.compile(r"[0-9]+")
# Characters that cannot appear in a hostname as the script prints it.
_BAD_HOST_CHARS = re.compile(r"[\s\[\]]")


class HostDiscovery:
    """A source of the hosts an elastic job may use right now."""

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """Returns ``{hostname: number of slots}`` for the hosts available now."""
        raise NotImplementedError()

    def close(self) -> None:
        """Stops what discovery still runs; the driver calls it when the job ends."""


def _split_host_line(line: str) -> Tuple[str, Optional[str]]:
    """Splits a stripped ``host``, ``host:slots``, ``[ipv6]`` or ``[ipv6]:slots`` line into the
    host and the slot text (None when absent). Raises ValueError with the reason otherwise."""
    if line.startswith("["):
        close = line.find("]")
        if close < 0:
            raise ValueError("'[' without a closing ']'")
        host, rest = line[1:close], line[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("expected ':slots' after ']'")
        slots_text = rest[1:] if rest else None
    else:
        host, sep, slots_text_or_empty = line.partition(":")
        if ":" in slots_text_or_empty:
            raise ValueError(
                "more than one ':'; write an IPv6 address in brackets, as [addr] or [addr]:slots"
            )
        slots_text = slots_text_or_empty if sep else None
    # Spaces around the ':' are tolerated, as Horovod's int() did for the slot count.
    host = host.strip()
    if slots_text is not None:
        slots_text = slots_text.strip()
    if not host:
        raise ValueError("empty hostname")
    if _BAD_HOST_CHARS.search(host):
        raise ValueError("a hostname cannot contain spaces or brackets")
    return host, slots_text


def parse_discovery_output(
    output: str, default_slots: Optional[int], source: str = "discovery script"
) -> Dict[str, int]:
    """Reads a discovery script's stdout into ``{hostname: slots}``.

    One host per line, ``host`` or ``host:slots`` (``[addr]``/``[addr]:slots`` for IPv6); lines
    are stripped and blank ones skipped (a script may print nothing while no host is ready). A bare
    host gets ``default_slots`` (``--slots-per-host``). ``source`` names the script in errors.
    """
    host_slots: Dict[str, int] = {}
    for number, raw in enumerate(output.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source}: line {number} ({line!r})"
        try:
            host, slots_text = _split_host_line(line)
        except ValueError as e:
            raise ValueError(f"{where} is not 'host' or 'host:slots': {e}") from None
        if slots_text is None:
            if default_slots is None:
                raise ValueError(
                    f"{where} gives no slot count; print it as 'host:slots' or pass "
                    "--slots-per-host"
                )
            slots = default_slots
        else:
            if not _SLOTS_RE.fullmatch(slots_text) or int(slots_text) < 1:
                raise ValueError(
                    f"{where} has slot count {slots_text!r}; it must be a positive integer"
                )
            slots = int(slots_text)
        previous = host_slots.get(host)
        if previous is not None and previous != slots:
            raise ValueError(
                f"{where}: host {host!r} is listed twice, with {previous} and {slots} slots"
            )
        host_slots[host] = slots
    return host_slots


def _kill_process_group(proc: subprocess.Popen) -> None:
    """Kills the script's whole process group (it runs in its own session), so that commands it
    started do not outlive it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass  # the group is gone already


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# The script runs under this shell: it is the process group's leader and waits for the script
# only (commands the script leaves running in the background do not keep the poll waiting); when
# the launcher dies, even by SIGKILL, the kernel sends it SIGTERM (PR_SET_PDEATHSIG) and it kills
# its whole group, the script's children included.
_WRAPPER = 'trap "kill -KILL 0" TERM; (eval "$1") & wait $!'
_PR_SET_PDEATHSIG = 1


def _die_with_parent_fn() -> Optional[Callable[[], None]]:
    """The child-side setup that makes the wrapper get SIGTERM when the launcher dies (Linux's
    prctl; None where it is not available)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class HostDiscoveryScript(HostDiscovery):
    """Hosts printed by the user's ``--host-discovery-script``, run through the shell at each
    poll; ``slots`` (``--slots-per-host``) is the count for lines without ``:slots``."""

    def __init__(self, discovery_script: str, slots: Optional[int]) -> None:
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)):
            raise ValueError(f"--slots-per-host must be a positive integer, got {slots!r}")
        if slots is not None and slots < 1:
            raise ValueError(f"--slots-per-host must be a positive integer, got {slots}")
        self._discovery_script = discovery_script
        self._default_slots = slots
        self._lock = threading.Lock()
        self._running: Optional[subprocess.Popen] = None
        self._closed = False

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        output = self._execute_discovery_script()
        return parse_discovery_output(
            output, self._default_slots, source=f"discovery script {self._discovery_script}"
        )

    def close(self) -> None:
        """Kills the script's process group if it is running, and refuses to run it again."""
        with self._lock:
            self._closed = True
            if self._running is not None:
                _kill_process_group(self._running)

    def _execute_discovery_script(self) -> str:
        """Runs the script and returns its stdout; RuntimeError when it fails, hangs, prints
        more than :data:`DISCOVERY_OUTPUT_LIMIT` bytes or the launcher is ending."""
        script = self._discovery_script
        timeout = DISCOVERY_TIMEOUT_S
        limit = DISCOVERY_OUTPUT_LIMIT
        with self._lock:
            if self._closed:
                raise RuntimeError(f"discovery script {script}: the launcher is ending")
            try:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, "sh", script],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=_die_with_parent_fn(),  # noqa: PLW1509 - only prctl and getppid
                )
            except OSError as e:
                raise RuntimeError(f"Failed to execute discovery script: {script}. {e}") from e
            self._running = proc
        try:
            out, err, why = _collect(proc, time.monotonic() + timeout, limit)
        finally:
            # Whatever the script left running (a child holding its output) goes with it.
            _kill_process_group(proc)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
            with self._lock:
                self._running = None
        if why == "timeout":
            raise RuntimeError(
                f"Failed to execute discovery script: {script}. It did not finish within "
                f"{timeout:g} seconds and was killed."
            )
        if why == "limit":
            raise RuntimeError(
                f"Failed to execute discovery script: {script}. It printed more than {limit} "
                "bytes to stdout (one host per line is expected) and was killed."
            )
        if self._closed:
            raise RuntimeError(f"discovery script {script}: the launcher is ending")
        stderr = err.decode("utf-8", errors="replace")
        try:
            stdout = out.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RuntimeError(
                f"discovery script {script} printed output that is not UTF-8 text: byte "
                f"{e.object[e.start]:#04x} at offset {e.start}"
            ) from None
        if proc.returncode != 0:
            message = f"Failed to execute discovery script: {script}. Exit code: {proc.returncode}"
            last = _last_line(stderr)
            if last:
                message += f". Last line of its stderr: {last}"
            raise RuntimeError(message)
        if stderr.strip():
            logger.debug("discovery script %s wrote to stderr: %s", script, stderr.rstrip())
        return stdout


def _collect(proc: subprocess.Popen, deadline: float, limit: int) -> Tuple[bytes, bytes, str]:
    """Reads the script's stdout and stderr until both close, or until the wrapper exited and
    what the script wrote is read (a child it left may hold the pipes open), the deadline passes
    or stdout exceeds ``limit`` bytes. Returns (stdout, stderr tail, why): why is "" when the
    script ended, else "timeout" or "limit"."""
    out, err = bytearray(), bytearray()
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in sinks:
        os.set_blocking(fd, False)
    with selectors.DefaultSelector() as sel:
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            exited = proc.poll() is not None
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not exited:
                return bytes(out), bytes(err), "timeout"
            # After the wrapper exited, the script's own output is all in the pipes already:
            # read what is there without waiting for an EOF that a leftover child may withhold.
            ready = sel.select(0 if exited else min(remaining, _POLL_S))
            if exited and not ready:
                break
            for key, _ in ready:
                sink = sinks[key.fd]
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                sink += chunk
                if sink is err and len(err) > _STDERR_TAIL:
                    del err[: len(err) - _STDERR_TAIL]
            if len(out) > limit:
                return bytes(out), bytes(err), "limit"
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # the script closed its output but goes on
        return bytes(out), bytes(err), "timeout"
    return bytes(out), bytes(err), ""


class FixedHosts(HostDiscovery):
    """A fixed host list (``-H host:slots,...``); :meth:`set` replaces it (used by tests)."""

    def __init__(self, host_slots: Dict[str, int]) -> None:
        self._host_slots = dict(host_slots)

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        return dict(self._host_slots)

    def set(self, host_slots: Dict[str, int]) -> None:
        self._host_slots = dict(host_slots)
