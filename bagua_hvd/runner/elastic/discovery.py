"""Where an elastic job's hosts come from (Horovod's ``horovod.runner.elastic.discovery``).

The driver polls a :class:`HostDiscovery` about once a second for ``{hostname: slots}``.
:class:`HostDiscoveryScript` runs the user's ``--host-discovery-script`` and reads one host per
line, ``host`` or ``host:slots``; :class:`FixedHosts` serves a fixed ``-H`` list.

Unlike Horovod, the script's output is checked line by line instead of being split blindly: a
bare host without ``--slots-per-host``, a slot count that is not a positive integer, one host
given two different slot counts, and a line that is not ``host[:slots]`` are errors naming the
line (Horovod turned them into a TypeError later on, an arbitrary choice, or a crash). IPv6
literals go in brackets, ``[::1]:2``. The script runs in its own process group, with a bound of
:data:`DISCOVERY_TIMEOUT_S`, so a hung script cannot stall the driver's polling forever.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from typing import Dict, Optional, Tuple

logger = logging.getLogger(__name__)

# How long one run of the discovery script may take before it is killed (seconds). Read at each
# run, so tests (and users who know better) can patch it.
DISCOVERY_TIMEOUT_S = 60.0

_SLOTS_RE = re.compile(r"[0-9]+")
# Characters that cannot appear in a hostname as the script prints it.
_BAD_HOST_CHARS = re.compile(r"[\s\[\]]")


class HostDiscovery:
    """A source of the hosts an elastic job may use right now."""

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """Returns ``{hostname: number of slots}`` for the hosts available now."""
        raise NotImplementedError()


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
        proc.kill()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


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

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        output = self._execute_discovery_script()
        return parse_discovery_output(
            output, self._default_slots, source=f"discovery script {self._discovery_script}"
        )

    def _execute_discovery_script(self) -> str:
        """Runs the script and returns its stdout; RuntimeError when it fails or hangs."""
        script = self._discovery_script
        timeout = DISCOVERY_TIMEOUT_S
        try:
            proc = subprocess.Popen(
                script,
                shell=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise RuntimeError(f"Failed to execute discovery script: {script}. {e}") from e
        with proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_process_group(proc)
                proc.wait()
                raise RuntimeError(
                    f"Failed to execute discovery script: {script}. It did not finish within "
                    f"{timeout:g} seconds and was killed."
                ) from None
        stdout = out.decode("utf-8", errors="replace")
        stderr = err.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            message = f"Failed to execute discovery script: {script}. Exit code: {proc.returncode}"
            last = _last_line(stderr)
            if last:
                message += f". Last line of its stderr: {last}"
            raise RuntimeError(message)
        if stderr.strip():
            logger.debug("discovery script %s wrote to stderr: %s", script, stderr.rstrip())
        return stdout


class FixedHosts(HostDiscovery):
    """A fixed host list (``-H host:slots,...``); :meth:`set` replaces it (used by tests)."""

    def __init__(self, host_slots: Dict[str, int]) -> None:
        self._host_slots = dict(host_slots)

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        return dict(self._host_slots)

    def set(self, host_slots: Dict[str, int]) -> None:
        self._host_slots = dict(host_slots)
