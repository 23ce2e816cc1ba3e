"""The elastic driver's host bookkeeping: discovery, host manager, blacklist and cooldown, rank
assignment (bagua_hvd.runner.elastic.discovery and .hosts).

Ports the tables and scenarios of Horovod's test_elastic_discovery.py, the host-manager parts of
test_elastic_driver.py and test_run.py's get_host_assignments tests; the expected values follow
Horovod's semantics, worked out by hand. No workers are started; discovery scripts run for real.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from bagua_hvd.common.elastic import HostUpdateResult
from bagua_hvd.runner.elastic import discovery as discovery_mod
from bagua_hvd.runner.elastic import hosts as hosts_mod
from bagua_hvd.runner.elastic.discovery import (
    FixedHosts,
    HostDiscovery,
    HostDiscoveryScript,
    parse_discovery_output,
)
from bagua_hvd.runner.elastic.hosts import (
    INVALID_SLOT_INFO,
    DiscoveredHosts,
    HostManager,
    HostState,
    SlotInfo,
    check_cooldown_range,
    get_host_assignments,
    order_available_hosts,
)

DEFAULT_SLOTS = 3


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Replaces the cooldown clock, and fixes the jitter at 0.5."""
    fake = FakeClock()
    monkeypatch.setattr(hosts_mod, "_now", fake)
    monkeypatch.setattr(hosts_mod, "_jitter", lambda: 0.5)
    return fake


class SequenceDiscovery(HostDiscovery):
    """Returns the given results one after the other, the last one for ever."""

    def __init__(self, results: List[Dict[str, int]]) -> None:
        self._results = list(results)

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        if len(self._results) > 1:
            return self._results.pop(0)
        return dict(self._results[0])


def write_script(tmp_path: Path, body: str, name: str = "discover.sh") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# ---- discovery script output (Horovod's test_elastic_discovery.py table, and more) -----------


@pytest.mark.parametrize(
    "output, expected",
    [
        ("", {}),
        ("host-1", {"host-1": DEFAULT_SLOTS}),
        ("host-1:2", {"host-1": 2}),
        ("host-1\nhost-5", {"host-1": DEFAULT_SLOTS, "host-5": DEFAULT_SLOTS}),
        ("host-1:2\nhost-4:3", {"host-1": 2, "host-4": 3}),
        ("\nhost-1:2\nhost-4:3", {"host-1": 2, "host-4": 3}),
        ("host-1:2\n\nhost-4:3", {"host-1": 2, "host-4": 3}),
        ("host-1:2\nhost-4:3\n", {"host-1": 2, "host-4": 3}),
        # Beyond Horovod's table: stripped lines, CRLF, addresses, IPv6 in brackets.
        ("  host-1:2  \n\t\n host-2 \n", {"host-1": 2, "host-2": DEFAULT_SLOTS}),
        ("host-1:2\r\nhost-2:1\r\n", {"host-1": 2, "host-2": 1}),
        ("host-1 : 2", {"host-1": 2}),
        ("10.0.0.1:4\n10.0.0.2", {"10.0.0.1": 4, "10.0.0.2": DEFAULT_SLOTS}),
        ("[::1]:2", {"::1": 2}),
        ("[fe80::1]\n[::1]:1", {"fe80::1": DEFAULT_SLOTS, "::1": 1}),
        ("host-1:12", {"host-1": 12}),
        # The same host twice with the same count is one host (Horovod's set() did the same).
        ("host-1:2\nhost-1:2", {"host-1": 2}),
        ("host-1\nhost-1:3", {"host-1": 3}),
    ],
)
def test_parse_discovery_output(output: str, expected: Dict[str, int]) -> None:
    assert parse_discovery_output(output, DEFAULT_SLOTS) == expected


@pytest.mark.parametrize(
    "output, default_slots, match",
    [
        # A bare host without --slots-per-host (Horovod: None slots, a TypeError later).
        ("host-1:2\nhost-2", None, r"line 2 \('host-2'\).*'host:slots'.*--slots-per-host"),
        ("host-1:0", 3, r"'host-1:0'.*'0'.*positive integer"),
        ("host-1:-1", 3, r"'host-1:-1'.*positive integer"),
        ("host-1:x", 3, r"'host-1:x'.*positive integer"),
        ("host-1:", 3, r"'host-1:'.*positive integer"),
        ("host-1:2.5", 3, r"'host-1:2.5'.*positive integer"),
        # Differing counts for one host (Horovod: whichever came last out of a set).
        ("host-1:2\nhost-1:4", 3, r"'host-1' is listed twice, with 2 and 4 slots"),
        ("host-1\nhost-1:2", 3, r"'host-1' is listed twice, with 3 and 2 slots"),
        # Bare IPv6 and extra colons (Horovod: ValueError from unpacking).
        ("::1:2", 3, r"'::1:2'.*IPv6.*brackets"),
        ("host-1:2:3", 3, r"more than one ':'"),
        ("[::1", 3, r"closing"),
        ("[::1]2", 3, r"':slots' after"),
        ("[]:2", 3, r"empty hostname"),
        (":2", 3, r"empty hostname"),
        ("host 1:2", 3, r"spaces"),
    ],
)
def test_parse_discovery_output_errors(
    output: str, default_slots: Optional[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        parse_discovery_output(output, default_slots)


def test_discovery_script_parses_via_execute(monkeypatch: pytest.MonkeyPatch) -> None:
    """As Horovod's test: the script's output is what _execute_discovery_script returns."""
    discovery = HostDiscoveryScript("unused", slots=DEFAULT_SLOTS)
    monkeypatch.setattr(discovery, "_execute_discovery_script", lambda: "\nhost-1:2\n\nhost-4\n")
    assert discovery.find_available_hosts_and_slots() == {"host-1": 2, "host-4": DEFAULT_SLOTS}


@pytest.mark.parametrize("slots", [0, -1, True, 1.5])
def test_discovery_script_rejects_bad_slots_per_host(slots: object) -> None:
    with pytest.raises(ValueError, match="--slots-per-host"):
        HostDiscoveryScript("true", slots=slots)  # type: ignore[arg-type]


# ---- discovery scripts run for real ----------------------------------------------------------


def test_discovery_script_runs(tmp_path: Path) -> None:
    script = write_script(tmp_path, "echo host-1:2\necho\necho '  host-2  '\necho '[::1]:1'\n")
    discovery = HostDiscoveryScript(script, slots=4)
    assert discovery.find_available_hosts_and_slots() == {"host-1": 2, "host-2": 4, "::1": 1}


def test_discovery_script_through_shell(tmp_path: Path) -> None:
    """The script is a shell command line: arguments and pipes work."""
    script = write_script(tmp_path, 'for h in "$@"; do echo "$h"; done\n')
    discovery = HostDiscoveryScript(f"{script} a:1 b:2 | sort -r", slots=None)
    assert discovery.find_available_hosts_and_slots() == {"a": 1, "b": 2}


def test_discovery_script_empty_output(tmp_path: Path) -> None:
    script = write_script(tmp_path, "exit 0\n")
    assert HostDiscoveryScript(script, slots=None).find_available_hosts_and_slots() == {}


def test_discovery_script_failure_message(tmp_path: Path) -> None:
    script = write_script(tmp_path, "echo host-1:2\nexit 1\n")
    with pytest.raises(RuntimeError) as info:
        HostDiscoveryScript(script, slots=None).find_available_hosts_and_slots()
    # Horovod's text, nothing added when the script wrote no stderr.
    assert str(info.value) == f"Failed to execute discovery script: {script}. Exit code: 1"


def test_discovery_script_failure_with_stderr(tmp_path: Path) -> None:
    script = write_script(tmp_path, "echo first >&2\necho 'cannot reach scheduler' >&2\nexit 3\n")
    with pytest.raises(RuntimeError) as info:
        HostDiscoveryScript(script, slots=None).find_available_hosts_and_slots()
    message = str(info.value)
    assert message.startswith(f"Failed to execute discovery script: {script}. Exit code: 3")
    assert "cannot reach scheduler" in message
    assert "first" not in message


def test_discovery_script_missing(tmp_path: Path) -> None:
    script = str(tmp_path / "no-such-script.sh")
    with pytest.raises(RuntimeError, match=r"Failed to execute discovery script: .*Exit code: 127"):
        HostDiscoveryScript(script, slots=1).find_available_hosts_and_slots()


def test_discovery_script_bad_output_names_script(tmp_path: Path) -> None:
    script = write_script(tmp_path, "echo host-1\n")
    with pytest.raises(ValueError, match=r"discover\.sh: line 1 \('host-1'\).*--slots-per-host"):
        HostDiscoveryScript(script, slots=None).find_available_hosts_and_slots()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to an init that does not reap counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_discovery_script_timeout_kills_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery_mod, "DISCOVERY_TIMEOUT_S", 0.5)
    pidfile = tmp_path / "child.pid"
    script = write_script(tmp_path, f"sleep 30 &\necho $! > {pidfile}\nwait\n")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        HostDiscoveryScript(script, slots=1).find_available_hosts_and_slots()
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert message.startswith(f"Failed to execute discovery script: {script}.")
    assert "0.5 seconds" in message
    # The script's own child went with it.
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_fixed_hosts() -> None:
    given = {"a": 2, "b": 1}
    fixed = FixedHosts(given)
    given["c"] = 5  # the caller's dict is not shared
    assert fixed.find_available_hosts_and_slots() == {"a": 2, "b": 1}
    fixed.find_available_hosts_and_slots()["d"] = 1
    assert fixed.find_available_hosts_and_slots() == {"a": 2, "b": 1}
    fixed.set({"b": 4})
    assert fixed.find_available_hosts_and_slots() == {"b": 4}


def test_host_discovery_base_is_abstract() -> None:
    with pytest.raises(NotImplementedError):
        HostDiscovery().find_available_hosts_and_slots()


# ---- SlotInfo and get_host_assignments (test_run.py) -------------------------------------------


def test_slot_info_response_string() -> None:
    slot = SlotInfo(
        hostname="h", rank=3, local_rank=1, cross_rank=2, size=8, local_size=4, cross_size=5
    )
    # rank, size, local_rank, local_size, cross_rank, cross_size
    assert slot.to_response_string() == "3,8,1,4,2,5"
    with pytest.raises(AttributeError):
        slot.rank = 0  # type: ignore[misc]


def test_invalid_slot_info() -> None:
    assert INVALID_SLOT_INFO.hostname == ""
    assert INVALID_SLOT_INFO.to_response_string() == "-1,-1,-1,-1,-1,-1"
    assert (
        INVALID_SLOT_INFO.rank
        == INVALID_SLOT_INFO.local_rank
        == INVALID_SLOT_INFO.cross_rank
        == INVALID_SLOT_INFO.size
        == INVALID_SLOT_INFO.local_size
        == INVALID_SLOT_INFO.cross_size
        == -1
    )


def test_get_host_assignments() -> None:
    assignments = get_host_assignments([("worker-0", 2), ("worker-1", 2)], 4)
    sizes = dict(size=4, local_size=2, cross_size=2)
    assert assignments == [
        SlotInfo(hostname="worker-0", rank=0, local_rank=0, cross_rank=0, **sizes),
        SlotInfo(hostname="worker-0", rank=1, local_rank=1, cross_rank=0, **sizes),
        SlotInfo(hostname="worker-1", rank=2, local_rank=0, cross_rank=1, **sizes),
        SlotInfo(hostname="worker-1", rank=3, local_rank=1, cross_rank=1, **sizes),
    ]


def test_get_host_assignments_elastic() -> None:
    assignments = get_host_assignments(
        [("worker-0", 2), ("worker-1", 2)], min_num_proc=1, max_num_proc=2
    )
    sizes = dict(size=2, local_size=2, cross_size=1)
    assert assignments == [
        SlotInfo(hostname="worker-0", rank=0, local_rank=0, cross_rank=0, **sizes),
        SlotInfo(hostname="worker-0", rank=1, local_rank=1, cross_rank=0, **sizes),
    ]


def test_get_host_assignments_heterogeneous() -> None:
    assignments = get_host_assignments([("worker-0", 1), ("worker-1", 2)], 3)
    assert assignments == [
        SlotInfo(
            "worker-0", rank=0, local_rank=0, cross_rank=0, size=3, local_size=1, cross_size=2
        ),
        SlotInfo(
            "worker-1", rank=1, local_rank=0, cross_rank=1, size=3, local_size=2, cross_size=2
        ),
        SlotInfo(
            "worker-1", rank=2, local_rank=1, cross_rank=0, size=3, local_size=2, cross_size=1
        ),
    ]


def test_get_host_assignments_max_cuts_a_host() -> None:
    """max_num_proc=5 over a:3, b:3, c:1: b is used in part and c not at all."""
    assignments = get_host_assignments([("a", 3), ("b", 3), ("c", 1)], 1, 5)
    assert assignments == [
        SlotInfo("a", rank=0, local_rank=0, cross_rank=0, size=5, local_size=3, cross_size=2),
        SlotInfo("a", rank=1, local_rank=1, cross_rank=0, size=5, local_size=3, cross_size=2),
        SlotInfo("a", rank=2, local_rank=2, cross_rank=0, size=5, local_size=3, cross_size=1),
        SlotInfo("b", rank=3, local_rank=0, cross_rank=1, size=5, local_size=2, cross_size=2),
        SlotInfo("b", rank=4, local_rank=1, cross_rank=1, size=5, local_size=2, cross_size=2),
    ]


def test_get_host_assignments_unbounded_uses_every_slot() -> None:
    """Without max_num_proc every slot gets a rank, even beyond min_num_proc (-np 2 on a:2,b:2
    gives a world of 4)."""
    assignments = get_host_assignments([("a", 2), ("b", 2)], 2)
    assert [s.rank for s in assignments] == [0, 1, 2, 3]
    assert {s.size for s in assignments} == {4}


def test_get_host_assignments_three_hosts_cross_ranks() -> None:
    """a:2, b:1, c:2: local rank 0 is on a, b, c (cross 0, 1, 2 of 3), local rank 1 on a, c."""
    assignments = get_host_assignments([("a", 2), ("b", 1), ("c", 2)], 5)
    assert [
        (s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
        for s in assignments
    ] == [
        ("a", 0, 0, 2, 0, 3),
        ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 1, 1, 3),
        ("c", 3, 0, 2, 2, 3),
        ("c", 4, 1, 2, 1, 2),
    ]


def test_get_host_assignments_skips_empty_hosts() -> None:
    assignments = get_host_assignments([("a", 0), ("b", 2)], 2)
    assert assignments == [
        SlotInfo("b", rank=0, local_rank=0, cross_rank=0, size=2, local_size=2, cross_size=1),
        SlotInfo("b", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2, cross_size=1),
    ]


def test_get_host_assignments_empty() -> None:
    assert get_host_assignments([], 0) == []
    assert get_host_assignments([("a", 2)], 0, 0) == []


def test_get_host_assignments_too_few_slots() -> None:
    with pytest.raises(ValueError) as info:
        get_host_assignments([("a", 2), ("b", 1)], 4)
    assert str(info.value) == "Requested more processes (4) than there are available slots (3)"
    # min > max surfaces here, counting only the slots within max.
    with pytest.raises(ValueError) as info:
        get_host_assignments([("a", 4)], 3, 2)
    assert str(info.value) == "Requested more processes (3) than there are available slots (2)"


# ---- order_available_hosts and update_available_hosts (test_elastic_driver.py) ----------------


def test_order_available_hosts() -> None:
    ordered = order_available_hosts(["a", "b", "c"], [])
    assert ordered == ["a", "b", "c"]
    # A host removed, one added, the input order shuffled: survivors keep their relative order.
    ordered = order_available_hosts(["d", "c", "b"], ordered)
    assert ordered == ["b", "c", "d"]
    # Also reachable through the class, as Horovod's tests call it.
    assert HostManager.order_available_hosts(["d", "c", "b"], ["c", "b"]) == ["c", "b", "d"]


def test_order_available_hosts_new_ones_in_discovery_order() -> None:
    assert order_available_hosts(["z", "a", "m"], []) == ["z", "a", "m"]
    assert order_available_hosts(["z", "a", "m"], ["m"]) == ["m", "z", "a"]
    assert order_available_hosts(["z", "a"], ["m", "z"]) == ["z", "a"]


def test_update_available_hosts() -> None:
    """Horovod's sequence: added, added, removed, mixed, no_update; views are not changed."""
    manager = HostManager(
        SequenceDiscovery(
            [{"a": 2}, {"a": 2, "b": 2}, {"b": 2}, {"b": 1, "c": 1}, {"b": 1, "c": 1}]
        )
    )
    current = manager.current_hosts
    assert current.available_hosts == set()
    assert current.count_available_slots() == 0

    assert manager.update_available_hosts() == HostUpdateResult.added
    # The view taken before is unchanged.
    assert current.available_hosts == set()
    assert current.count_available_slots() == 0
    current = manager.current_hosts
    assert current.available_hosts == {"a"}
    assert current.count_available_slots() == 2

    assert manager.update_available_hosts() == HostUpdateResult.added
    current = manager.current_hosts
    assert current.available_hosts == {"a", "b"}
    assert current.host_assignment_order == ["a", "b"]
    assert current.count_available_slots() == 4

    assert manager.update_available_hosts() == HostUpdateResult.removed
    current = manager.current_hosts
    assert current.available_hosts == {"b"}
    assert current.count_available_slots() == 2

    assert manager.update_available_hosts() == HostUpdateResult.mixed
    current = manager.current_hosts
    assert current.available_hosts == {"b", "c"}
    assert current.host_assignment_order == ["b", "c"]
    assert current.count_available_slots() == 2

    assert manager.update_available_hosts() == HostUpdateResult.no_update
    current = manager.current_hosts
    assert current.available_hosts == {"b", "c"}
    assert current.count_available_slots() == 2


def test_update_available_hosts_slot_changes() -> None:
    """More slots on a host is an addition, fewer a removal, both at once mixed."""
    fixed = FixedHosts({"a": 2, "b": 2})
    manager = HostManager(fixed)
    assert manager.update_available_hosts() == HostUpdateResult.added
    fixed.set({"a": 2, "b": 3})
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.count_available_slots() == 5
    fixed.set({"a": 1, "b": 3})
    assert manager.update_available_hosts() == HostUpdateResult.removed
    fixed.set({"a": 2, "b": 1})
    assert manager.update_available_hosts() == HostUpdateResult.mixed
    assert manager.current_hosts.get_slots("b") == 1
    assert manager.current_hosts.get_slots("zzz") == 0
    assert manager.update_available_hosts() == HostUpdateResult.no_update


def test_update_keeps_oldest_hosts_first() -> None:
    """A new host that sorts first still goes last: rank 0 stays on an old host."""
    fixed = FixedHosts({"c": 1})
    manager = HostManager(fixed)
    manager.update_available_hosts()
    fixed.set({"a": 1, "c": 1, "b": 1})
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.host_assignment_order == ["c", "a", "b"]
    fixed.set({"b": 1, "d": 1})
    assert manager.update_available_hosts() == HostUpdateResult.mixed
    assert manager.current_hosts.host_assignment_order == ["b", "d"]


def test_update_available_hosts_discovery_error_propagates() -> None:
    class Broken(HostDiscovery):
        def find_available_hosts_and_slots(self) -> Dict[str, int]:
            raise RuntimeError("discovery broke")

    manager = HostManager(Broken())
    with pytest.raises(RuntimeError, match="discovery broke"):
        manager.update_available_hosts()
    assert manager.current_hosts.host_slots == {}


def test_host_manager_with_discovery_script(tmp_path: Path) -> None:
    """Horovod's test_hosts_added_and_removed schedule, through a real script."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost:2\n")
    manager = HostManager(HostDiscoveryScript(f"cat {hostfile}", slots=None))
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.host_assignment_order == ["localhost"]
    hostfile.write_text("localhost:2\n127.0.0.1:2\n")
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.host_assignment_order == ["localhost", "127.0.0.1"]
    assert manager.current_hosts.count_available_slots() == 4
    hostfile.write_text("127.0.0.1:2\n")
    assert manager.update_available_hosts() == HostUpdateResult.removed
    assert manager.current_hosts.host_assignment_order == ["127.0.0.1"]
    assert manager.update_available_hosts() == HostUpdateResult.no_update


# ---- blacklisting --------------------------------------------------------------------------


def test_blacklist_host() -> None:
    manager = HostManager(FixedHosts({"a": 2, "b": 2}))
    manager.update_available_hosts()
    current = manager.current_hosts
    assert current.available_hosts == {"a", "b"}
    assert current.count_available_slots() == 4

    manager.blacklist("a")
    # The view taken before is unchanged (Horovod's current_hosts edits it in place).
    assert current.available_hosts == {"a", "b"}
    assert current.count_available_slots() == 4

    current = manager.current_hosts
    assert current.available_hosts == {"b"}
    assert current.host_assignment_order == ["b"]
    assert current.count_available_slots() == 2
    # host_slots is what discovery reported, blacklisted hosts included.
    assert current.host_slots == {"a": 2, "b": 2}
    assert manager.is_blacklisted("a")
    assert not manager.is_blacklisted("b")
    assert not manager.is_blacklisted("never-seen")


def test_blacklisted_host_without_cooldown_never_returns(clock: FakeClock) -> None:
    fixed = FixedHosts({"a": 2, "b": 2})
    manager = HostManager(fixed)
    manager.update_available_hosts()
    manager.blacklist("a")
    clock.t += 1e9
    # Still discovered, still blacklisted: nothing changed.
    assert manager.update_available_hosts() == HostUpdateResult.no_update
    assert manager.current_hosts.available_hosts == {"b"}
    # Gone from discovery: a removal (as Horovod, although no rank was on it).
    fixed.set({"b": 2})
    assert manager.update_available_hosts() == HostUpdateResult.removed
    # Back in discovery: an addition, but it stays out of the assignment order.
    fixed.set({"a": 2, "b": 2})
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.host_assignment_order == ["b"]
    assert manager.current_hosts.count_available_slots() == 2
    assert manager.is_blacklisted("a")


def test_assignments_after_host_failure() -> None:
    """test_rank_and_size_with_host_failure: host-2 fails, host-1's slots keep ranks 0 and 1 in
    a world of 2 (rank % 2, cross_size 1)."""
    manager = HostManager(FixedHosts({"host-1": 2, "host-2": 2}))
    manager.update_available_hosts()
    manager.blacklist("host-2")
    view = manager.current_hosts
    slots = [(host, view.get_slots(host)) for host in view.host_assignment_order]
    assert get_host_assignments(slots, 2, 4) == [
        SlotInfo("host-1", rank=0, local_rank=0, cross_rank=0, size=2, local_size=2, cross_size=1),
        SlotInfo("host-1", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2, cross_size=1),
    ]


def test_assignments_after_host_added() -> None:
    """test_rank_and_size_with_host_added: host-1 keeps ranks 0, 1; cross_size becomes 2."""
    fixed = FixedHosts({"host-1": 2})
    manager = HostManager(fixed)
    manager.update_available_hosts()
    fixed.set({"host-2": 2, "host-1": 2})
    assert manager.update_available_hosts() == HostUpdateResult.added
    view = manager.current_hosts
    slots = [(host, view.get_slots(host)) for host in view.host_assignment_order]
    sizes = dict(size=4, local_size=2, cross_size=2)
    assert get_host_assignments(slots, 2, 4) == [
        SlotInfo("host-1", rank=0, local_rank=0, cross_rank=0, **sizes),
        SlotInfo("host-1", rank=1, local_rank=1, cross_rank=0, **sizes),
        SlotInfo("host-2", rank=2, local_rank=0, cross_rank=1, **sizes),
        SlotInfo("host-2", rank=3, local_rank=1, cross_rank=1, **sizes),
    ]


def test_host_event() -> None:
    manager = HostManager(FixedHosts({"a": 2}))
    first = manager.get_host_event("a")
    assert manager.get_host_event("a") is first
    assert not first.is_set()
    manager.blacklist("a")
    assert first.is_set()
    # A fresh event once the old one is set, so later workers on the host are not stopped.
    second = manager.get_host_event("a")
    assert second is not first
    assert not second.is_set()
    # Without a cooldown range there is no period: blacklisting again sets the event again.
    manager.blacklist("a")
    assert second.is_set()


def test_blacklist_does_not_wait_for_discovery() -> None:
    """A slow discovery (a script) does not hold up blacklisting from a worker thread."""
    entered, release = threading.Event(), threading.Event()

    class Slow(HostDiscovery):
        def find_available_hosts_and_slots(self) -> Dict[str, int]:
            entered.set()
            release.wait(10)
            return {"a": 1, "b": 1}

    manager = HostManager(Slow())
    poller = threading.Thread(target=manager.update_available_hosts)
    poller.start()
    try:
        assert entered.wait(10)
        done = threading.Event()
        threading.Thread(target=lambda: (manager.blacklist("a"), done.set())).start()
        assert done.wait(5)
    finally:
        release.set()
        poller.join(10)
    assert manager.current_hosts.host_assignment_order == ["b"]


# ---- cooldown and resurrection -------------------------------------------------------------


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, None),
        ((1, 3600), (1, 3600)),
        ([120, 600], (120, 600)),
        ((5, 5), (5, 5)),
    ],
)
def test_check_cooldown_range(given: object, expected: object) -> None:
    assert check_cooldown_range(given) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given, match",
    [
        ((0, 10), r"--blacklist-cooldown-range.*lower limit 0.*1 second"),
        ((1, 3601), r"--blacklist-cooldown-range.*upper limit 3601.*3600 seconds"),
        ((20, 10), r"--blacklist-cooldown-range.*lower limit 20 is above the upper limit 10"),
        ((5,), r"--blacklist-cooldown-range takes two numbers"),
        ((1, 2, 3), r"--blacklist-cooldown-range takes two numbers"),
        (("1", "2"), r"--blacklist-cooldown-range takes two numbers"),
        ((True, 2), r"--blacklist-cooldown-range takes two numbers"),
    ],
)
def test_check_cooldown_range_errors(given: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_cooldown_range(given)  # type: ignore[arg-type]


def test_cooldown_range_checked_eagerly() -> None:
    with pytest.raises(ValueError, match="--blacklist-cooldown-range"):
        HostState((0, 10))
    # The manager checks at construction, not when the first host shows up.
    with pytest.raises(ValueError, match="--blacklist-cooldown-range"):
        HostManager(FixedHosts({}), cooldown_range=(10, 5))


def test_cooldown_exponential_backoff(clock: FakeClock) -> None:
    """Range (10, 100), jitter 0.5: the n-th cooldown is 10 * 2**n + 5, clamped to 100."""
    state = HostState((10, 100))
    assert not state.is_blacklisted()
    assert not state.is_resurrected()

    clock.t = 1000.0
    state.blacklist()  # 1st: 20 + 5 = 25 s
    assert state.is_blacklisted()
    assert not state.is_resurrected()
    clock.t = 1024.9
    assert not state.is_resurrected()
    clock.t = 1025.0
    assert state.is_resurrected()
    state.whitelist()
    assert not state.is_blacklisted()
    assert not state.is_resurrected()

    clock.t = 1030.0
    state.blacklist()  # 2nd: 40 + 5 = 45 s
    clock.t = 1074.9
    assert not state.is_resurrected()
    clock.t = 1075.0
    assert state.is_resurrected()
    state.whitelist()

    clock.t = 1100.0
    state.blacklist()  # 3rd: 80 + 5 = 85 s
    clock.t = 1184.9
    assert not state.is_resurrected()
    clock.t = 1185.0
    assert state.is_resurrected()
    state.whitelist()

    clock.t = 1200.0
    state.blacklist()  # 4th: 160 + 5 = 165, clamped to 100 s
    clock.t = 1299.9
    assert not state.is_resurrected()
    clock.t = 1300.0
    assert state.is_resurrected()


def test_cooldown_first_period_is_twice_lower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Range (1, 2): 1 * 2 + U * 1 is clamped to 2, whatever the jitter (not 1 as the docs)."""
    clock = FakeClock(50.0)
    monkeypatch.setattr(hosts_mod, "_now", clock)
    for jitter in (0.0, 0.999):
        monkeypatch.setattr(hosts_mod, "_jitter", lambda j=jitter: j)
        state = HostState((1, 2))
        clock.t = 50.0
        state.blacklist()
        clock.t = 51.999
        assert not state.is_resurrected()
        clock.t = 52.0
        assert state.is_resurrected()


def test_blacklist_inside_cooldown_starts_no_new_period(clock: FakeClock) -> None:
    state = HostState((10, 100))
    clock.t = 0.0
    first = state.get_event()
    state.blacklist()  # 1st: 25 s, ends at 25
    assert first.is_set()
    event = state.get_event()
    assert event is not first
    clock.t = 10.0
    state.blacklist()  # inside the period: no new period, no event
    assert not event.is_set()
    assert state.is_blacklisted()
    clock.t = 25.0
    assert state.is_resurrected()
    # The count did not move: once the period is over, the next is the 2nd (45 s), not the 3rd.
    state.blacklist()  # not inside a period any more: a new one, and the event
    assert event.is_set()
    clock.t = 69.9
    assert not state.is_resurrected()
    clock.t = 70.0
    assert state.is_resurrected()


def test_no_cooldown_range_never_resurrects(clock: FakeClock) -> None:
    state = HostState()
    state.blacklist()
    assert state.is_blacklisted()
    assert state.get_event().is_set() is False  # a fresh one after the set
    clock.t += 1e9
    assert not state.is_resurrected()


def test_resurrection(clock: FakeClock) -> None:
    """A blacklisted host comes back after its cooldown, as an addition, behind the survivors."""
    fixed = FixedHosts({"a": 2, "b": 2})
    manager = HostManager(fixed, cooldown_range=(10, 100))
    clock.t = 100.0
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.host_assignment_order == ["a", "b"]

    event = manager.get_host_event("a")
    manager.blacklist("a")  # 1st cooldown: 25 s, until 125
    assert event.is_set()
    assert manager.current_hosts.host_assignment_order == ["b"]

    clock.t = 110.0
    assert manager.update_available_hosts() == HostUpdateResult.no_update
    assert manager.is_blacklisted("a")

    clock.t = 125.0
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert not manager.is_blacklisted("a")
    view = manager.current_hosts
    # b, the survivor, keeps rank 0; a comes back last.
    assert view.host_assignment_order == ["b", "a"]
    assert view.count_available_slots() == 4
    assert not manager.get_host_event("a").is_set()

    clock.t = 126.0
    assert manager.update_available_hosts() == HostUpdateResult.no_update

    clock.t = 130.0
    manager.blacklist("a")  # 2nd cooldown: 45 s, until 175
    clock.t = 174.0
    assert manager.update_available_hosts() == HostUpdateResult.no_update
    assert manager.current_hosts.host_assignment_order == ["b"]
    clock.t = 175.0
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.host_assignment_order == ["b", "a"]


def test_resurrection_with_removal_is_mixed(clock: FakeClock) -> None:
    fixed = FixedHosts({"a": 2, "b": 2})
    manager = HostManager(fixed, cooldown_range=(10, 100))
    clock.t = 0.0
    manager.update_available_hosts()
    manager.blacklist("a")  # until 25
    clock.t = 30.0
    fixed.set({"a": 2})
    assert manager.update_available_hosts() == HostUpdateResult.mixed
    assert manager.current_hosts.host_assignment_order == ["a"]


def test_resurrected_host_absent_from_discovery_stays_blacklisted(clock: FakeClock) -> None:
    fixed = FixedHosts({"a": 2, "b": 2})
    manager = HostManager(fixed, cooldown_range=(10, 100))
    clock.t = 0.0
    manager.update_available_hosts()
    manager.blacklist("a")  # until 25
    fixed.set({"b": 2})
    clock.t = 5.0
    assert manager.update_available_hosts() == HostUpdateResult.removed
    clock.t = 30.0
    # Its cooldown is over, but it is not discovered: nothing to report.
    assert manager.update_available_hosts() == HostUpdateResult.no_update
    assert manager.is_blacklisted("a")
    fixed.set({"a": 2, "b": 2})
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert not manager.is_blacklisted("a")
    assert manager.current_hosts.host_assignment_order == ["b", "a"]


def test_discovered_hosts_filter_is_a_new_view() -> None:
    view = DiscoveredHosts(host_slots={"a": 1, "b": 2}, host_assignment_order=["a", "b"])
    filtered = view.filter_blacklisted(lambda host: host == "a")
    assert filtered is not view
    assert filtered.host_assignment_order == ["b"]
    assert filtered.count_available_slots() == 2
    assert view.host_assignment_order == ["a", "b"]
    assert view.count_available_slots() == 3
    assert str(view) == "slots: {'a': 1, 'b': 2} order: ['a', 'b']"
