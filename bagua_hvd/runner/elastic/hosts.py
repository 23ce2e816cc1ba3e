"""The elastic driver's host bookkeeping (Horovod's ``HostManager``, ``HostState``,
``DiscoveredHosts`` and ``get_host_assignments``).

:class:`HostManager` polls a discovery source, keeps the order in which hosts get ranks (hosts
that stay keep their place and new ones go last, so rank 0 is always an old worker that holds the
training state), reports what each poll changed as a ``HostUpdateResult`` and blacklists hosts
whose workers failed. With ``--blacklist-cooldown-range MIN MAX`` a blacklisted host may come back
after an exponentially growing cooldown; without it, it never does.

Differences from Horovod, on purpose: the cooldown range is checked when the launcher reads it
(:func:`check_cooldown_range`, also checking ``MIN <= MAX``), not lazily in the discovery thread;
a view of the hosts (:class:`DiscoveredHosts`) is never changed once handed out, where Horovod's
``current_hosts`` edits the one shared object; new hosts are appended in sorted order, not in set
order; the clock is monotonic and replaceable (``_now``), as is the jitter (``_jitter``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from bagua_hvd.common.elastic import HostUpdateResult
from bagua_hvd.runner.elastic.discovery import HostDiscovery

logger = logging.getLogger(__name__)

# Bounds on --blacklist-cooldown-range (seconds), as in Horovod.
DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS = 1
DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS = 60 * 60

# The clock for cooldown periods, and the source of their jitter (uniform in [0, 1]); module
# attributes so that tests can replace them instead of sleeping.
_now: Callable[[], float] = time.monotonic
_jitter: Callable[[], float] = random.random


# ---- rank assignment -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """The ranks of the worker in one slot of one host."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_response_string(self) -> str:
        """The rendezvous answer to ``rank_and_size``: ``rank,size,local_rank,local_size,
        cross_rank,cross_size``."""
        fields = (
            self.rank,
            self.size,
            self.local_rank,
            self.local_size,
            self.cross_rank,
            self.cross_size,
        )
        return ",".join(str(v) for v in fields)


# What a slot of a blacklisted host, or a slot beyond the new world, is told: it was removed.
INVALID_SLOT_INFO = SlotInfo(
    hostname="", rank=-1, local_rank=-1, cross_rank=-1, size=-1, local_size=-1, cross_size=-1
)


def get_host_assignments(
    hosts: List[Tuple[str, int]], min_num_proc: int, max_num_proc: Optional[int] = None
) -> List[SlotInfo]:
    """Gives ranks to the slots of ``hosts`` (``(hostname, slots)`` in assignment order).

    Ranks fill one host after the other, local ranks 0, 1, ... on each, until ``max_num_proc``
    ranks are given (so the last host used may be used in part; None means no bound). The cross
    rank of a slot is the index of its host among the hosts that have a slot with the same local
    rank. Raises ValueError when fewer than ``min_num_proc`` slots are available.
    """
    # How many ranks each host gets, in order.
    used: List[Tuple[str, int]] = []
    world_size = 0
    for hostname, slots in hosts:
        take = slots
        if max_num_proc is not None:
            take = max(0, min(slots, max_num_proc - world_size))
        if take > 0:
            used.append((hostname, take))
            world_size += take

    if world_size < min_num_proc:
        raise ValueError(
            f"Requested more processes ({min_num_proc}) than there are available slots "
            f"({world_size})"
        )

    # The hosts that have local rank l are those with more than l ranks, in assignment order.
    cross_sizes: Dict[int, int] = {}
    for _, local_size in used:
        for local_rank in range(local_size):
            cross_sizes[local_rank] = cross_sizes.get(local_rank, 0) + 1

    assignments: List[SlotInfo] = []
    seen_at_local_rank: Dict[int, int] = {}
    rank = 0
    for hostname, local_size in used:
        for local_rank in range(local_size):
            cross_rank = seen_at_local_rank.get(local_rank, 0)
            seen_at_local_rank[local_rank] = cross_rank + 1
            assignments.append(
                SlotInfo(
                    hostname=hostname,
                    rank=rank,
                    local_rank=local_rank,
                    cross_rank=cross_rank,
                    size=world_size,
                    local_size=local_size,
                    cross_size=cross_sizes[local_rank],
                )
            )
            rank += 1
    return assignments


# ---- blacklisting and cooldown -------------------------------------------------------------


def check_cooldown_range(cooldown_range: Optional[Sequence[float]]) -> Optional[Tuple[int, int]]:
    """Checks ``--blacklist-cooldown-range MIN MAX`` and returns it as a tuple (None when unset:
    blacklisted hosts never come back). Called when the launcher parses its arguments, so a bad
    range fails at once instead of in the driver's discovery thread."""
    if not cooldown_range:
        return None
    try:
        lower, upper = cooldown_range
    except (TypeError, ValueError):
        raise ValueError(
            f"--blacklist-cooldown-range takes two numbers of seconds, MIN MAX; got "
            f"{cooldown_range!r}"
        ) from None
    for value in (lower, upper):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"--blacklist-cooldown-range takes two numbers of seconds, MIN MAX; got "
                f"{cooldown_range!r}"
            )
    if lower < DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS:
        raise ValueError(
            f"--blacklist-cooldown-range: the lower limit {lower} is below the smallest allowed, "
            f"{DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS} second(s)"
        )
    if upper > DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS:
        raise ValueError(
            f"--blacklist-cooldown-range: the upper limit {upper} is above the largest allowed, "
            f"{DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS} seconds"
        )
    if lower > upper:
        raise ValueError(
            f"--blacklist-cooldown-range: the lower limit {lower} is above the upper limit {upper}"
        )
    return (lower, upper)


class HostState:
    """Whether one host is blacklisted, its cooldown, and the event that stops its workers."""

    def __init__(self, cooldown_range: Optional[Tuple[int, int]] = None) -> None:
        self._cooldown_range = check_cooldown_range(cooldown_range)
        self._event = threading.Event()
        self._blacklisted = False
        self._blacklist_count = 0
        # When the current cooldown period ends (on the _now clock); None outside any period.
        self._cooldown_end: Optional[float] = None

    def get_event(self) -> threading.Event:
        """The event that stops this host's workers; a new one once the old one was set, so
        workers started on the host after it comes back are not stopped at once."""
        if self._event.is_set():
            self._event = threading.Event()
        return self._event

    def set_event(self) -> None:
        self._event.set()

    def _in_cooldown_period(self, now: float) -> bool:
        return self._cooldown_end is not None and now < self._cooldown_end

    def _set_cooldown_period(self, now: float) -> None:
        """Starts a cooldown: ``lower * 2**n + U(0,1) * lower`` seconds for the n-th blacklisting,
        clamped to the range (so the first one already lasts 2 to 3 times ``lower``)."""
        if self._cooldown_range is None:
            return
        lower, upper = self._cooldown_range
        self._blacklist_count += 1
        delay = lower * 2**self._blacklist_count + _jitter() * lower
        delay = max(lower, min(upper, delay))
        self._cooldown_end = now + delay
        logger.debug("cooldown %d of the host: %.1f s", self._blacklist_count, delay)

    def blacklist(self) -> None:
        """Blacklists the host and stops its workers; inside a running cooldown it only marks
        the host (no new period, no event), as Horovod."""
        self._blacklisted = True
        now = _now()
        if self._in_cooldown_period(now):
            return
        self._set_cooldown_period(now)
        self.set_event()

    def whitelist(self) -> None:
        """Takes the host off the blacklist and ends its cooldown."""
        self._blacklisted = False
        self._cooldown_end = None

    def is_blacklisted(self) -> bool:
        return self._blacklisted

    def is_resurrected(self) -> bool:
        """Whether the host's cooldown period is over (never true without a cooldown range)."""
        return self._cooldown_end is not None and not self._in_cooldown_period(_now())


# ---- the discovered hosts ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DiscoveredHosts:
    """One view of the hosts: ``host_slots`` as discovery reported them (blacklisted hosts
    included) and ``host_assignment_order``, the usable hosts in the order they get ranks.

    A view is never changed after it is made (do not mutate its dict or list);
    :meth:`filter_blacklisted` makes a new one.
    """

    host_slots: Dict[str, int]
    host_assignment_order: List[str]

    @property
    def available_hosts(self) -> Set[str]:
        return set(self.host_assignment_order)

    def get_slots(self, host: str) -> int:
        return self.host_slots.get(host, 0)

    def count_available_slots(self) -> int:
        """Slots of the usable hosts (those in the assignment order)."""
        return sum(self.get_slots(host) for host in self.host_assignment_order)

    def filter_blacklisted(self, is_blacklisted: Callable[[str], bool]) -> DiscoveredHosts:
        """A new view without the hosts for which ``is_blacklisted`` is true (Horovod's
        ``update``, which edits the view in place instead)."""
        order = [host for host in self.host_assignment_order if not is_blacklisted(host)]
        return DiscoveredHosts(host_slots=dict(self.host_slots), host_assignment_order=order)

    def __str__(self) -> str:
        return f"slots: {self.host_slots} order: {self.host_assignment_order}"


def order_available_hosts(available: Iterable[str], prev_order: Sequence[str]) -> List[str]:
    """The assignment order for ``available`` hosts: those in ``prev_order`` keep their relative
    order (so the oldest hosts keep the lowest ranks), then the new ones in the order given (the
    discovery script's lines, -H's order: as a fixed job places them; Horovod's is set order)."""
    available = list(dict.fromkeys(available))
    order = [host for host in prev_order if host in available]
    kept = set(order)
    order.extend(host for host in available if host not in kept)
    return order


def _check_update(
    current: Dict[str, int], previous: Dict[str, int], resurrected: Set[str]
) -> HostUpdateResult:
    """What changed between two polls: a host gone or with fewer slots is a removal; a new host,
    more slots or a host back from its cooldown is an addition."""
    result = HostUpdateResult.no_update
    if any(host not in current for host in previous):
        result |= HostUpdateResult.removed
    for host, slots in current.items():
        if host not in previous or slots > previous[host]:
            result |= HostUpdateResult.added
        elif slots < previous[host]:
            result |= HostUpdateResult.removed
        elif host in resurrected:
            result |= HostUpdateResult.added
    return result


class HostManager:
    """The driver's hosts: polls ``discovery``, keeps the assignment order and the blacklist.

    Thread-safe: the driver's discovery thread updates it while worker threads blacklist hosts.
    """

    # Horovod's tests call it through the class.
    order_available_hosts = staticmethod(order_available_hosts)

    def __init__(
        self, discovery: HostDiscovery, cooldown_range: Optional[Tuple[int, int]] = None
    ) -> None:
        self._discovery = discovery
        self._cooldown_range = check_cooldown_range(cooldown_range)
        self._lock = threading.RLock()
        self._hosts_state: Dict[str, HostState] = {}
        self._current_hosts = DiscoveredHosts(host_slots={}, host_assignment_order=[])

    def _state(self, host: str) -> HostState:
        state = self._hosts_state.get(host)
        if state is None:
            state = self._hosts_state[host] = HostState(self._cooldown_range)
        return state

    def _is_blacklisted(self, host: str) -> bool:
        state = self._hosts_state.get(host)
        return state is not None and state.is_blacklisted()

    def update_available_hosts(self) -> HostUpdateResult:
        """Polls discovery once and returns what changed since the last poll.

        Something changed when the hosts or their slots differ, or when a blacklisted host's
        cooldown is over (it is then taken off the blacklist and counts as added).
        """
        # Discovery may take a while (a script): do not hold the lock meanwhile.
        host_slots = dict(self._discovery.find_available_hosts_and_slots())
        with self._lock:
            previous = self._current_hosts
            resurrected = {
                host
                for host in host_slots
                if host in self._hosts_state and self._hosts_state[host].is_resurrected()
            }
            if host_slots == previous.host_slots and not resurrected:
                return HostUpdateResult.no_update

            available = [
                host for host in host_slots if host in resurrected or not self._is_blacklisted(host)
            ]
            # Blacklisted hosts have lost their place: one coming back now goes last.
            prev_order = [h for h in previous.host_assignment_order if not self._is_blacklisted(h)]
            self._current_hosts = DiscoveredHosts(
                host_slots=host_slots,
                host_assignment_order=order_available_hosts(available, prev_order),
            )
            result = _check_update(host_slots, previous.host_slots, resurrected)
            for host in resurrected:
                logger.info("host %s is back from its blacklist cooldown", host)
                self._hosts_state[host].whitelist()
            return result

    @property
    def current_hosts(self) -> DiscoveredHosts:
        """The hosts of the last poll, blacklisted ones left out of the assignment order."""
        with self._lock:
            return self._current_hosts.filter_blacklisted(self._is_blacklisted)

    def blacklist(self, host: str) -> None:
        """Blacklists ``host`` (all its slots) and stops its workers through its event."""
        with self._lock:
            state = self._state(host)
            if not state.is_blacklisted():
                logger.info("blacklist failing host: %s", host)
            state.blacklist()
            self._current_hosts = self._current_hosts.filter_blacklisted(self._is_blacklisted)

    def is_blacklisted(self, host: str) -> bool:
        with self._lock:
            return self._is_blacklisted(host)

    def get_host_event(self, host: str) -> threading.Event:
        """The event to pass to ``host``'s workers; set when the host is blacklisted."""
        with self._lock:
            return self._state(host).get_event()
