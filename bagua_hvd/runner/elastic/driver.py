"""The elastic driver: ``bagua-run --min-np/--max-np/--host-discovery-script`` (Horovod's
``horovod.runner.elastic.driver.ElasticDriver`` and its worker registry, over bagua_hvd's
rendezvous store and agents).

What it does, in Horovod's terms:

- Discovery: the hosts and their slots come from ``--host-discovery-script`` (polled every
  ``DISCOVER_HOSTS_FREQUENCY_SECS``) or ``-H`` (fixed); hosts.HostManager keeps their order
  (the oldest hosts get the lowest ranks, so rank 0 always holds the state) and the blacklist.
- Generations: the job starts once ``-np`` slots are there (waiting at most the elastic
  timeout), with every available slot up to ``--max-np``: generation 1. A generation ends when
  every one of its workers has recorded READY (it reset: a peer failed, or hosts changed), SUCCESS
  (exited 0) or FAILURE (exited non-zero). Then, in Horovod's order: any SUCCESS ends the job;
  all FAILURE fails it; the hosts of the failures are blacklisted (their other workers stopped);
  no host left, or more resets than ``--reset-limit``, fails it; otherwise the driver waits for
  ``--min-np`` slots (at most the elastic timeout), assigns ranks again, answers every READY
  worker (its new rank, or -1: removed), and starts workers for the new slots.
- Notifications: when the discovered hosts would give a different assignment, the driver
  publishes a numbered update in the store; the workers' states raise HostsUpdatedInterrupt
  at their next commit (bagua_hvd.common.elastic).
- Each worker runs under its own agent (bagua_hvd.runner.agent; over ssh for other machines):
  closing the agent's stdin stops the worker, as for fixed jobs. That is the default launcher
  (bagua_hvd.runner.elastic.launcher.AgentLauncher); another one (bagua_hvd.ray's actors) may
  start and stop the workers instead.

Bounded where Horovod waits forever: once a worker of a generation has reset, the others have
the elastic timeout to record too; the ones that did not are stopped (and so fail).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import queue
import secrets
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from bagua_hvd.common import config
from bagua_hvd.common import elastic as worker_api
from bagua_hvd.runner.elastic.discovery import HostDiscovery
from bagua_hvd.runner.elastic.hosts import (
    INVALID_SLOT_INFO,
    HostManager,
    SlotInfo,
    get_host_assignments,
)
from bagua_hvd.runner.elastic.launcher import AgentLauncher, WorkerLauncher, slot_of
from bagua_hvd.runner.job import FAILURE_MESSAGE, LaunchError, SignalTrap, shell_exit_code

# Horovod's module constants (its tests patch them; so may ours).
DISCOVER_HOSTS_FREQUENCY_SECS = 1.0
ELASTIC_TIMEOUT_SECS = 600

RESET_LIMIT_EXCEEDED_MESSAGE = (
    "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
)
SLOTS_TIMEOUT_MESSAGE = (
    "Timed out waiting for minimum number of slots to become available. Please check that you "
    "have enough resources to run at least {} Horovod processes. Timeout after {} seconds."
)
NO_HOSTS_REMAINING_MESSAGE = "No hosts from previous set remaining, unable to broadcast state."
# Beyond the elastic timeout, how long a reset worker waits for the driver's answer.
ANSWER_MARGIN_S = 60.0
_POLL_S = 0.05
# The key under which the core's rank publishes its address in a generation's rendezvous
# (rank_key in native/src/transport/transport.cc, docs/protocol.md).
_CORE_RANK_KEY = "bhvd/e{}/rank/{}"

SlotKey = Tuple[str, int]  # (host, local rank): a worker's identity across generations


class Record(enum.Enum):
    READY = "ready"
    SUCCESS = "success"
    FAILURE = "failure"


@dataclasses.dataclass
class ElasticSettings:
    """What bagua-run's elastic flags say (horovodrun's meaning)."""

    num_proc: int
    min_num_proc: int
    max_num_proc: Optional[int] = None
    elastic_timeout: Optional[float] = None  # None or 0: HOROVOD_ELASTIC_TIMEOUT, else 600 s
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[int, int]] = None
    ssh_port: Optional[int] = None
    ssh_identity: Optional[str] = None
    start_timeout: float = 30.0
    output_dir: Optional[str] = None
    verbose: bool = False
    nic: Optional[str] = None

    def timeout_s(self) -> float:
        if self.elastic_timeout:
            return float(self.elastic_timeout)
        return float(os.environ.get("HOROVOD_ELASTIC_TIMEOUT", "") or ELASTIC_TIMEOUT_SECS)


@dataclasses.dataclass
class ElasticResult:
    """How an elastic job ended: the launcher's exit code and, on failure, why."""

    exit_code: int
    message: str = ""
    resets: int = 0
    generation: int = 0


@dataclasses.dataclass
class _Worker:
    key: SlotKey
    generation: int  # the generation it was started in
    handle: object  # the launcher's handle (bagua-run's: the agent)
    code: Optional[int] = None  # its exit code once known
    stopped: bool = False  # the driver stopped it


class ElasticDriver:
    """Runs one elastic job of ``command`` to its end (see the module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        settings: ElasticSettings,
        discovery: HostDiscovery,
        env: Mapping[str, str],
        on_store: Optional[Callable[[Any], None]] = None,
        launcher: Optional[WorkerLauncher] = None,
        store: Optional[Tuple[Any, bytes]] = None,
    ) -> None:
        self.command = list(command)
        self.on_store = on_store  # called with the store before the first worker starts
        self.log_name = "bagua-run"  # who speaks in the log lines
        self.settings = settings
        self.discovery = discovery
        self.hosts = HostManager(discovery, settings.cooldown_range)
        self.env = dict(env)
        self.events: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # guards self.hosts between the discovery thread and us
        self.stop_event = threading.Event()
        self.generation = 0
        self.assignment: Dict[SlotKey, SlotInfo] = {}
        self.records: Dict[SlotKey, Tuple[Record, float]] = {}
        self.workers: Dict[SlotKey, _Worker] = {}
        self.retired: List[_Worker] = []  # removed or stopped workers not yet gone
        self.reset_count = 0
        self.update_seq = 1  # the number of the next host-update notification
        self.pending_update = worker_api.HostUpdateResult.no_update
        self.notified: Optional[Dict[SlotKey, SlotInfo]] = None
        self.resuming_since: Optional[float] = None
        self.barrier_deadline: Optional[float] = None
        # Who starts the workers: by default ``command`` under agents (bagua-run).
        self.launcher = launcher or AgentLauncher(command, settings, self.log)
        # A started StoreServer and its secret that the launcher's workers already reach (the
        # caller forwards its SETs to on_set and stops it); None: the driver serves its own.
        self.served = store
        self.store = None
        self.addr = "127.0.0.1"
        self._results: Dict[SlotKey, int] = {}  # exit codes of the current generation's workers
        self.hosts_dirty = False  # the hosts changed since the last notification check

    # ---- logging ------------------------------------------------------------------------

    def log(self, message: str, always: bool = False) -> None:
        if always or self.settings.verbose:
            print(f"{self.log_name}: elastic: {message}", file=sys.stderr, flush=True)

    # ---- discovery ----------------------------------------------------------------------

    def _discover_forever(self) -> None:
        failures = 0
        while not self.stop_event.wait(DISCOVER_HOSTS_FREQUENCY_SECS):
            try:
                # Not under self.lock: the script may take up to its timeout, and the driver
                # must meanwhile go on (resets, signals). HostManager is thread-safe.
                res = self.hosts.update_available_hosts()
                failures = 0
            except Exception as e:  # noqa: BLE001 - a flaky script must not end the job
                if self.stop_event.is_set():
                    return  # the job ended while the script ran (and was killed): no news
                failures += 1
                if failures == 1 or self.settings.verbose:
                    self.log(f"host discovery failed (will retry): {e}", always=True)
                continue
            if res != worker_api.HostUpdateResult.no_update:
                self.events.put(("hosts", res, None))

    def _available(self) -> Tuple[int, List[Tuple[str, int]]]:
        with self.lock:
            current = self.hosts.current_hosts
            hosts = [(h, current.get_slots(h)) for h in current.host_assignment_order]
        return sum(n for _, n in hosts), hosts

    def _assign(self, min_np: int) -> Dict[SlotKey, SlotInfo]:
        _, hosts = self._available()
        slots = get_host_assignments(hosts, min_np, self.settings.max_num_proc)
        return {(s.hostname, s.local_rank): s for s in slots}

    # ---- the store ----------------------------------------------------------------------

    def on_set(self, key: bytes, value: bytes) -> None:
        """The store's hook: a worker recorded READY."""
        if key.startswith(b"elastic/ready/"):
            self.events.put(("ready", key.decode(errors="replace"), None))

    def _start_store(self, first_hosts: Sequence[str]) -> None:
        from bagua_hvd.rendezvous.store import StoreServer

        self.addr = self.launcher.address(first_hosts)
        if self.served is not None:
            self.store, self.secret = self.served
        else:
            self.secret = secrets.token_bytes(32)
            try:
                self.store = StoreServer(self.secret, host=self.addr, port=0, on_set=self.on_set)
                self.store.start()
            except OSError as e:
                raise LaunchError(f"cannot serve the rendezvous on {self.addr}: {e}") from e
        if self.on_store is not None:
            self.on_store(self.store)
        self.job_id = secrets.token_hex(8)

    # ---- workers ------------------------------------------------------------------------

    def _worker_env(self, info: SlotInfo) -> Dict[str, str]:
        slot = slot_of(info)
        env = dict(self.env)
        env.update(
            {
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.addr,
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.store.port),
                "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": env.get("HOROVOD_CPU_OPERATIONS", "gloo"),
                "BAGUA_HVD_SECRET": self.secret.hex(),
                "BAGUA_HVD_JOB_ID": self.job_id,
                "PYTHONUNBUFFERED": "1",
                "HOROVOD_ELASTIC": "1",
                config.ELASTIC_GENERATION_ENV: str(self.generation),
                config.ELASTIC_UPDATE_ENV: str(self.update_seq),
                config.ELASTIC_WAIT_ENV: repr(self.settings.timeout_s() + ANSWER_MARGIN_S),
            }
        )
        env.update(slot.env())
        return env

    def _start_worker(self, info: SlotInfo) -> None:
        key = (info.hostname, info.local_rank)
        handle = self.launcher.start(info, self.generation, self._worker_env(info), self.events)
        self.workers[key] = _Worker(key=key, generation=self.generation, handle=handle)

    def _stop_worker(self, worker: _Worker) -> None:
        if not worker.stopped:
            worker.stopped = True
            self.launcher.stop(worker.handle)

    def _worker_of(self, handle: object) -> Optional[_Worker]:
        for w in list(self.workers.values()) + self.retired:
            if w.handle is handle:
                return w
        return None

    # ---- generations --------------------------------------------------------------------

    def _new_generation(self, assignment: Dict[SlotKey, SlotInfo]) -> None:
        """Makes ``assignment`` the current one: answers the workers that reset, retires the
        removed ones and starts workers on the new slots."""
        previous = self.generation
        self.generation += 1
        fresh = [k for k in assignment if k not in self.workers]
        for key, (record, _) in self.records.items():
            if record is not Record.READY:
                continue
            info = assignment.get(key, INVALID_SLOT_INFO)
            answer = worker_api.Assignment(
                self.generation,
                (
                    info.rank,
                    info.size,
                    info.local_rank,
                    info.local_size,
                    info.cross_rank,
                    info.cross_size,
                ),
                bool(fresh),
                # Updates from here on are published after these hosts were chosen.
                self.update_seq,
            )
            self.store.set(worker_api.next_key(previous, *key), answer.encode())
        for key in [k for k in self.workers if k not in assignment]:
            worker = self.workers.pop(key)
            self.retired.append(worker)  # told it was removed: it ends by itself
        self.assignment = assignment
        self.records = {}
        self.barrier_deadline = None
        self.notified = None
        self._results = {}
        # Hosts may have changed while the reset ran: compare them with the new assignment.
        self.hosts_dirty = True
        self.pending_update = worker_api.HostUpdateResult.no_update
        size = len(assignment)
        self.log(
            f"generation {self.generation}: {size} ranks on "
            + ", ".join(sorted({h for h, _ in assignment}))
            + (f" ({len(fresh)} new)" if previous else ""),
            always=previous > 0,
        )
        for key in sorted(fresh, key=lambda k: assignment[k].rank):
            self._start_worker(assignment[key])

    def _record(self, key: SlotKey, record: Record) -> None:
        if key not in self.assignment:
            return  # a removed slot: not part of this generation
        old = self.records.get(key)
        if old is not None and not (old[0] is Record.READY and record is Record.FAILURE):
            return
        self.records[key] = (record, time.monotonic())
        if record is Record.READY and self.barrier_deadline is None:
            self.barrier_deadline = time.monotonic() + self.settings.timeout_s()

    def _barrier_done(self) -> bool:
        return self.resuming_since is None and all(k in self.records for k in self.assignment)

    def _on_barrier(self) -> Optional[ElasticResult]:
        """Horovod's barrier action, in its order; returns the result when the job ends."""
        states = {k: r for k, (r, _) in self.records.items()}
        if any(r is Record.SUCCESS for r in states.values()):
            return self._finish()
        failures = [k for k, r in states.items() if r is Record.FAILURE]
        if len(failures) == len(states):
            return self._finish()
        for host in sorted({h for h, _ in failures}):
            self._blacklist(host)
        with self.lock:
            blacklisted = {h for h, _ in states if self.hosts.is_blacklisted(h)}
        if blacklisted >= {h for h, _ in states}:
            return self._finish()
        limit = self.settings.reset_limit
        if limit is not None and self.reset_count >= limit:
            return self._finish(RESET_LIMIT_EXCEEDED_MESSAGE.format(limit))
        self.reset_count += 1
        self.resuming_since = time.monotonic()
        return self._try_resume()

    def _try_resume(self) -> Optional[ElasticResult]:
        available, _ = self._available()
        if available < self.settings.min_num_proc:
            if time.monotonic() - self.resuming_since >= self.settings.timeout_s():
                return self._finish(
                    SLOTS_TIMEOUT_MESSAGE.format(
                        self.settings.min_num_proc, _seconds(self.settings.timeout_s())
                    )
                )
            return None
        assignment = self._assign(self.settings.min_num_proc)
        survivors = [k for k in assignment if k in self.workers]
        if not survivors:
            return self._finish(NO_HOSTS_REMAINING_MESSAGE)
        self.resuming_since = None
        self._new_generation(assignment)
        return None

    def _blacklist(self, host: str) -> None:
        with self.lock:
            if self.hosts.is_blacklisted(host):
                return
            self.hosts.blacklist(host)
        self.log(f"host {host} blacklisted after a failure", always=True)
        for key, worker in list(self.workers.items()):
            if key[0] == host:
                self._stop_worker(worker)

    # ---- notifications ------------------------------------------------------------------

    def _maybe_notify(self) -> None:
        """Publishes a host update when the hosts now give another assignment than the
        current one (once per distinct target)."""
        if not self.hosts_dirty:
            return
        if self.resuming_since is not None or self.records or not self.assignment:
            return  # a reset is under way: it takes the newest hosts anyway
        self.hosts_dirty = False
        available, _ = self._available()
        try:
            enough = available >= self.settings.min_num_proc
            target = self._assign(self.settings.min_num_proc) if enough else {}
        except ValueError:
            target = {}
        if target == self.assignment or target == self.notified:
            return
        res = self.pending_update or worker_api.HostUpdateResult.mixed
        self.store.set(worker_api.update_key(self.update_seq), f"{self.update_seq} {int(res)}")
        self.log(f"hosts changed ({res.name}): notification {self.update_seq}", always=True)
        self.update_seq += 1
        self.pending_update = worker_api.HostUpdateResult.no_update
        self.notified = target

    # ---- the run ------------------------------------------------------------------------

    def run(self) -> ElasticResult:
        timeout = self.settings.timeout_s()
        self.hosts.update_available_hosts()  # a first failure ends the job: raise
        discovery = threading.Thread(
            target=self._discover_forever, name="bagua-run-discovery", daemon=True
        )
        discovery.start()
        try:
            with SignalTrap() as trap:
                start = time.monotonic()
                while True:
                    available, hosts = self._available()
                    if available >= self.settings.num_proc:
                        break
                    if trap.received:
                        return ElasticResult(128 + trap.received[0])
                    if time.monotonic() - start >= timeout:
                        return ElasticResult(
                            1,
                            SLOTS_TIMEOUT_MESSAGE.format(self.settings.num_proc, _seconds(timeout)),
                        )
                    time.sleep(_POLL_S)
                self._start_store([h for h, _ in hosts])
                try:
                    self._new_generation(self._assign(self.settings.num_proc))
                    return self._supervise(trap)
                finally:
                    self._stop_all()
                    if self.served is None:
                        self.store.stop()
        finally:
            self.stop_event.set()
            # A discovery script still running (slow or hung) goes with the job.
            self.discovery.close()
            self.launcher.close()

    def _supervise(self, trap: SignalTrap) -> ElasticResult:
        seen_signals = 0
        while True:
            if len(trap.received) > seen_signals:
                seen_signals = len(trap.received)
                self.log(f"got signal {trap.received[0]}: stopping every worker", always=True)
                return ElasticResult(128 + trap.received[0], resets=self.reset_count)
            try:
                what, subject, value = self.events.get(timeout=_POLL_S)
            except queue.Empty:
                what = None
            if what == "ready":
                self._on_ready(subject)
            elif what == "hosts":
                self.pending_update |= subject
                self.hosts_dirty = True
            elif what == "report":
                if "exit" in value:
                    self._on_exit(subject, int(value["exit"][1]))
                elif "error" in value:
                    self.log(str(value["error"]), always=True)
            elif what == "gone":
                self._on_exit(subject, shell_exit_code(value))
            elif what == "abort":  # the launcher cannot go on (bagua_hvd.spark: its Spark job)
                self.log(subject, always=True)
                return ElasticResult(1, subject, self.reset_count, self.generation)
            if self.resuming_since is not None:
                result = self._try_resume()
                if result is not None:
                    return result
            elif self._barrier_done():
                result = self._on_barrier()
                if result is not None:
                    return result
            if self.barrier_deadline is not None and time.monotonic() >= self.barrier_deadline:
                self.barrier_deadline = None
                for key in self.assignment:
                    if key not in self.records and key in self.workers:
                        self.log(
                            f"{key[0]}[{key[1]}] did not reset within the elastic timeout "
                            "while others did: stopping it",
                            always=True,
                        )
                        self._stop_worker(self.workers[key])
            self._maybe_notify()

    def _on_ready(self, key_text: str) -> None:
        # elastic/ready/<generation>/<host>:<local rank>
        try:
            _, _, gen, slot = key_text.split("/", 3)
            host, _, local_rank = slot.rpartition(":")
            key = (host, int(local_rank))
            generation = int(gen)
        except ValueError:
            return
        if generation != self.generation or key not in self.workers:
            return
        self._record(key, Record.READY)

    def _on_exit(self, handle: object, code: int) -> None:
        worker = self._worker_of(handle)
        if worker is None or worker.code is not None:
            return
        worker.code = code
        if worker in self.retired:
            self.retired.remove(worker)
            return
        self.workers.pop(worker.key, None)
        self._results[worker.key] = code
        if code != 0:
            self.log(f"{worker.key[0]}[{worker.key[1]}] exited with code {code}")
            self._release_rendezvous(worker.key, code)
        self._record(worker.key, Record.SUCCESS if code == 0 else Record.FAILURE)
        if self.resuming_since is not None and code != 0:
            self._blacklist(worker.key[0])

    def _release_rendezvous(self, key: SlotKey, code: int) -> None:
        """A worker of the current generation that failed before it published its address (its
        host unreachable, its command broken) would keep the others waiting in the core's
        rendezvous for the whole start timeout: publish a mark in its place, which makes their
        rendezvous fail at once, so they reset and the generation ends (its host blacklisted)."""
        info = self.assignment.get(key)
        if info is None or self.resuming_since is not None:
            return
        mark = (
            f"gone\nits worker on {key[0]}[{key[1]}] exited with code {code} before it joined "
            f"generation {self.generation} (bagua-run's elastic driver)"
        )
        if self.store.set_if_absent(_CORE_RANK_KEY.format(self.generation, info.rank), mark):
            self.log(f"{key[0]}[{key[1]}] never joined generation {self.generation}: released "
                     "the others' rendezvous", always=True)  # fmt: skip

    def _finish(self, message: Optional[str] = None) -> ElasticResult:
        """Ends the job: stops what still runs. Success when every worker of the last
        generation exited 0; else the result names the first of them that exited non-zero, or
        says ``message``."""
        self._stop_all()
        exits = [
            (t, key, self._results.get(key, 1))
            for key, (r, t) in self.records.items()
            if r is not Record.READY
        ]
        failed = sorted((t, k, c) for t, k, c in exits if c != 0)
        if message is not None:
            return ElasticResult(1, message, self.reset_count, self.generation)
        if not failed and all(r is Record.SUCCESS for r, _ in self.records.values()):
            return ElasticResult(0, "", self.reset_count, self.generation)
        if failed:
            _, key, code = failed[0]
        else:
            key, code = next(k for k, (r, _) in self.records.items() if r is Record.READY), 1
        return ElasticResult(
            code,
            FAILURE_MESSAGE.format(name=f"{key[0]}[{key[1]}]", code=code),
            self.reset_count,
            self.generation,
        )

    def _stop_all(self) -> None:
        everyone = list(self.workers.values()) + self.retired
        for w in everyone:
            self._stop_worker(w)
        self.launcher.end([w.handle for w in everyone])


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
