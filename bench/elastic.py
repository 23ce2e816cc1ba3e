"""Elastic (issue 16): recovery and scale-up times of ``bagua-run --min-np/--max-np``, beside
PyTorch's own elastic launcher, torchrun, on the same job.

    python bench/elastic.py                        # 8 cases x 3 runs, a few minutes
    python bench/elastic.py --repeat 5 --cases kill4,torchrun4,add2 --json elastic.json -v

Each run starts the real launcher (``bagua-run``, as ``python -m bagua_hvd.runner.launch``
--verbose) with a host-discovery script that prints a file this script writes, over two "hosts"
of this machine, ``localhost`` and ``127.0.0.1`` (shared memory within a host, TCP between), on
this script's worker: a small MLP (32-64-10) under hvd.DistributedOptimizer inside
``hvd.elastic.run`` with a ``TorchState``, one ``state.commit()`` per step, --step-sleep s of
"compute" per step, 1 torch thread. Every worker process appends to a file of its own one line
per committed step, ``S time generation size rank step`` (wall clock, time.time()), and one per
event of its life (process creation from /proc, its guard's and agent's creation, entry of its
main, torch and bagua_hvd imported, hvd.init() returned, HorovodInternalError or
HostsUpdatedInterrupt caught, reset callback, entry of the elastic function after the sync).
The launcher's lines (``bagua-run: elastic: ...`` on stderr) are stamped as they arrive here.

Cases:

- kill4 (4 -> 2), kill3 (3 -> 2), kill2 (2 -> 1): hosts ``localhost:2,127.0.0.1:2``,
  ``localhost:2,127.0.0.1:1``, ``localhost:1,127.0.0.1:1`` (--min-np 2, 2, 1); the last rank (on
  127.0.0.1) records the time, then SIGKILLs itself at the start of step --kill-step. Its host
  is blacklisted (its other worker stopped); localhost's workers go on. Figure: from the kill to
  the first step committed at the new size (the step the victim died in, replayed from the last
  commit). Parts, each ending at the moment the last survivor passed it:
  detect (HorovodInternalError caught), barrier (the driver's "generation g+1" line: the
  survivors shut down and report READY, the driver blacklists, assigns and answers), re-form
  (the reset callback: the core's rendezvous of the new generation done), sync (the elastic
  function entered: restore and the state's broadcast from rank 0), first step (the step, whose
  DistributedOptimizer agrees on its bucket layout again, and its commit). Beside them: kill ->
  the driver's line saying the victim exited (its agent's report).
- add2 (2 -> 4), add1 (1 -> 2): hosts ``localhost:2`` (``localhost:1``); once every rank has
  committed --kill-step steps, after a random 0-1 s (the phase of the discovery poll), the host
  ``127.0.0.1:2`` (``:1``) is added to the file (the time is taken as it is renamed into
  place). Figure: from that write to the first step committed at the new size. Parts: discover
  (the driver's "hosts changed" line: the poll, every DISCOVER_HOSTS_FREQUENCY_SECS, and the
  script), interrupt (the last old rank caught HostsUpdatedInterrupt at a commit), barrier
  ("generation g+1"), spawn (the new workers' processes exist: the driver starts an agent, the
  agent a guard, the guard the worker; details: agent -> worker), import (the worker's
  interpreter started, torch and bagua_hvd imported), init (hvd.init() returned in the new
  workers: the rendezvous with the old ranks, waiting in theirs), build (model, SGD and
  DistributedOptimizer built in the new workers; the old ranks wait in the sync meanwhile),
  sync (every rank entered the elastic function: the state's broadcast), first step (as above).
- torchrun4, torchrun3, torchrun2 (the peer; paired with kill4, kill3, kill2): torchrun (``python
  -m torch.distributed.run``, torchelastic's agent) on one node, ``--nnodes=1:1 --nproc-per-node=K
  --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:<free port> --max-restarts=3``, its default
  --monitor-interval (0.1 s), LOGLEVEL=INFO so that the agent logs what it does (glog lines, its
  own times to the ms), and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless --torchrun-shared-store:
  by default (torch >= 2.5) the workers' init_process_group shares the agent's rendezvous
  TCPStore, whose keys outlive a restart, so a restarted worker may read a dead worker's gloo
  address (connectFullMesh: connection refused; pytorch#135712, #167288), fail, and cost a restart
  more; on this machine (torch 2.13), at 4 workers every restart failed so and the job failed
  after --max-restarts, at 2 a restart sometimes hung. With the setting, rank 0 of each attempt
  hosts a fresh store (the others' init waits for it). A group that fails again after it recovered
  (seen: a worker aborting at its exit) is restarted by torchrun; counted beside the figure. Its
  worker is written as torchrun's documentation recommends: torch.distributed with gloo
  (GLOO_SOCKET_IFNAME=lo: TCP between every pair), the same MLP, data, learning rate and stop flag
  under DistributedDataParallel, rank 0 saving a checkpoint (model, optimizer, step; written to a
  temporary file, then renamed) after every step, every worker loading it at start. It logs the
  same lines (steps with the restart count in place of the generation; process start, imports,
  init_process_group returned, built, checkpoint loaded). The last rank SIGKILLs itself at the
  start of step --kill-step of the first attempt (TORCHELASTIC_RESTART_COUNT 0). torchrun's
  elasticity: the agent sees the exit, stops every other worker of the node and starts all K anew
  after a new rendezvous, at the same size; they resume from the checkpoint, the step the victim
  died in replayed. Figure: from the kill to the first step committed (rank 0: checkpointed) by
  all K restarted workers. Parts: detect (the agent's first line about it: its SIGTERM to the
  others, or the failure when none was left), stop (its "failed (exitcode: -9)" line: the others
  exited), rendezvous ("Starting worker group": "Worker group FAILED", the c10d rendezvous), spawn
  (the new workers' processes exist), import (torch, torch.distributed, DDP imported), init
  (init_process_group returned), build (model, DDP, SGD), load (the checkpoint loaded), first
  step. What differs from the bagua_hvd kill case it is paired with: torchrun keeps the size and
  restarts every worker, with their interpreters and imports; bagua_hvd drops the failed host and
  keeps the survivors' processes, at the smaller size; here every pair of workers talks TCP
  (gloo), there only across the two hosts. The ratio printed is torchrun's total / bagua_hvd's
  (medians over --repeat runs).

Each part is between the latest process's moments (the slowest worker gates the job), so the
parts add up to the total. Each case runs --repeat times; the table gives the median of each
part and the median and max of the total, in ms. The workers stop together (an allreduce of a
stop flag each step) once --after steps ran at the new size, and the launcher must exit 0. A run
is bounded (--run-timeout; the launcher is then stopped) and anything left of its process tree is
killed and reported; the exit status is 1 when any run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import queue
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos import descendants, proc_table, still_there  # noqa: E402  (the process-table helpers)

WORKER_FLAG = "--_worker"
PEER_FLAG = "--_peer-worker"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_FILE = "stop"
CHECKPOINT = "checkpoint.pt"
LAUNCHER_ARGS = (
    "cases",
    "repeat",
    "seed",
    "kill_step",
    "after",
    "step_sleep",
    "run_timeout",
    "torchrun_shared_store",
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "kill", "add" or "torchrun" (the peer of a kill case)
    hosts: tuple[str, ...]  # the discovery script's lines at the start
    added: tuple[str, ...]  # lines added later ("add")
    np: int
    min_np: int
    max_np: int
    new_size: int
    victim: int = -1  # start rank that kills itself ("kill", "torchrun")
    peer_of: str = ""  # the bagua_hvd case a torchrun case is paired with


CASES = {
    c.name: c
    for c in (
        Case("kill4", "kill", ("localhost:2", "127.0.0.1:2"), (), 4, 2, 4, 2, victim=3),
        Case("kill3", "kill", ("localhost:2", "127.0.0.1:1"), (), 3, 2, 3, 2, victim=2),
        Case("kill2", "kill", ("localhost:1", "127.0.0.1:1"), (), 2, 1, 2, 1, victim=1),
        Case("add2", "add", ("localhost:2",), ("127.0.0.1:2",), 2, 2, 4, 4),
        Case("add1", "add", ("localhost:1",), ("127.0.0.1:1",), 1, 1, 2, 2),
        Case("torchrun4", "torchrun", ("127.0.0.1:4",), (), 4, 4, 4, 4, 3, "kill4"),
        Case("torchrun3", "torchrun", ("127.0.0.1:3",), (), 3, 3, 3, 3, 2, "kill3"),
        Case("torchrun2", "torchrun", ("127.0.0.1:2",), (), 2, 2, 2, 2, 1, "kill2"),
    )
}
KILL_PARTS = ("detect", "barrier", "re-form", "sync", "first step")
ADD_PARTS = (
    "discover",
    "interrupt",
    "barrier",
    "spawn",
    "import",
    "init",
    "build",
    "sync",
    "first step",
)
PEER_PARTS = (
    "detect",
    "stop",
    "rendezvous",
    "spawn",
    "import",
    "init",
    "build",
    "load",
    "first step",
)
# torchrun's agent logs (LOGLEVEL=INFO) as glog: "I1203 05:06:04.294000 <pid> <file>:<line>] msg"
AGENT_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ \S+\] (.*)$")
AGENT_EVENTS = (  # moment -> the agent's message
    # its monitor (every --monitor-interval) saw the exit; it SIGTERMs the others at once (none
    # left: the next line)
    ("detect", re.compile(r"Sending process \d+ closing signal|failed \(exitcode: ")),
    ("stop", re.compile(r"failed \(exitcode: ")),  # the others exited; "Worker group FAILED"
    ("rendezvous", re.compile(r"\[\w+\] Starting worker group")),
)
RESTARTING = re.compile(r"Worker group (FAILED|UNHEALTHY)\. .*will restart worker group")
GENERATION = re.compile(r"bagua-run: elastic: generation (\d+): (\d+) ranks on")
HOSTS_CHANGED = re.compile(r"bagua-run: elastic: hosts changed \((\w+)\): notification (\d+)")
EXITED = re.compile(r"bagua-run: elastic: (\S+)\[(\d+)\] exited with code (-?\d+)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Elastic: time from a rank's death, or a host's appearance, to the next "
        "committed step at the new size",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--repeat", type=int, default=3, help="runs per case")
    p.add_argument("--seed", type=int, default=1, help="seed of the add delays")
    p.add_argument(
        "--kill-step", type=int, default=20, help="the victim dies at this step; hosts are added "
        "once every rank has committed it"
    )  # fmt: skip
    p.add_argument("--after", type=int, default=5, help="steps at the new size before stopping")
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds of 'compute' a step")
    p.add_argument("--run-timeout", type=float, default=150.0, help="bound on one run, s")
    p.add_argument(
        "--torchrun-shared-store", action="store_true", help="keep torchrun's default of "
        "sharing the rendezvous TCPStore with the workers across restarts (pytorch#135712: a "
        "restart may read the previous attempt's gloo addresses, fail and restart again); "
        "by default TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the documented workaround"
    )  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write every run's moments to FILE")
    p.add_argument("-v", "--verbose", action="store_true", help="print each run's timeline")
    # worker side
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    p.add_argument(PEER_FLAG, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--logdir", help=argparse.SUPPRESS)
    p.add_argument("--victim", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--worker-seconds", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.case_list = [CASES[c] for c in args.cases.split(",") if c]
    if args.repeat < 1:
        p.error("--repeat must be positive")
    return args


# ---- worker side ----------------------------------------------------------------------------


def proc_start(pid: int | str = "self") -> tuple[float, int]:
    """(wall-clock creation time, parent pid) of a process, from /proc (in 1/CLK_TCK s steps:
    its start time counts from boot on CLOCK_BOOTTIME; /proc/stat's btime is whole seconds)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK"), int(fields[1])


def worker(args: argparse.Namespace) -> int:
    t_main = time.time()
    import torch

    import bagua_hvd.torch as hvd
    from bagua_hvd.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    t_imported = time.time()
    start_rank = int(os.environ["HOROVOD_RANK"])
    out = open(os.path.join(args.logdir, f"w{os.getpid()}.log"), "a", buffering=1)

    def ids() -> str:
        gen = os.environ.get("BAGUA_HVD_ELASTIC_GENERATION", "0")
        try:
            return f"{gen} {hvd.size()} {hvd.rank()}"
        except ValueError:  # between a shutdown and the next init
            return f"{gen} -1 -1"

    def event(name: str, at: float | None = None) -> None:
        out.write(f"E {at if at is not None else time.time():.6f} {name} {ids()}\n")

    created, guard = proc_start()
    guard_created, agent = proc_start(guard)
    agent_created, _ = proc_start(agent)
    torch.set_num_threads(1)
    hvd.init()
    t_init = time.time()
    out.write(f"I {start_rank} {os.environ.get('HOROVOD_HOSTNAME', '?')}\n")
    for name, at in (("agent", agent_created), ("guard", guard_created), ("proc", created),
                     ("main", t_main), ("imported", t_imported), ("init", t_init)):  # fmt: skip
        event(name, at)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    lr = 0.01
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
        named_parameters=model.named_parameters(),
    )
    stop_path = os.path.join(args.logdir, STOP_FILE)
    end = time.monotonic() + args.worker_seconds  # bounded even if the bench vanished

    @hvd.elastic.run
    def train(state):
        event("enter")
        try:
            while True:
                if start_rank == args.victim and state.step == args.kill_step:
                    event("kill")
                    out.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                g = torch.Generator().manual_seed(100000 * hvd.rank() + state.step)
                x = torch.randn(16, 32, generator=g)
                y = torch.randint(0, 10, (16,), generator=g)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                done = os.path.exists(stop_path) or time.monotonic() > end
                stop = hvd.allreduce(torch.tensor([float(done)]), op=hvd.Sum, name="bench.stop")
                state.step += 1
                state.commit()
                out.write(f"S {time.time():.6f} {ids()} {state.step}\n")
                if stop.item() > 0:
                    return
                time.sleep(args.step_sleep)
        except HorovodInternalError:
            event("error")
            raise
        except HostsUpdatedInterrupt:
            event("interrupt")
            raise

    def on_reset() -> None:
        event("reset")
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([on_reset])
    event("built")
    train(state)
    event("end")
    out.close()
    return 0


def peer_worker(args: argparse.Namespace) -> int:
    """The same training under torchrun, written as its documentation recommends: gloo, DDP, a
    checkpoint saved by rank 0 after every step and loaded by every worker at its start."""
    t_main = time.time()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    t_imported = time.time()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = open(os.path.join(args.logdir, f"w{os.getpid()}.log"), "a", buffering=1)

    def event(name: str, at: float | None = None) -> None:
        out.write(f"E {at if at is not None else time.time():.6f} {name} {restart} {size} {rank}\n")

    created, _ = proc_start()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t_init = time.time()
    out.write(f"I {rank} {socket.gethostname()}\n")
    for name, at in (("proc", created), ("main", t_main), ("imported", t_imported),
                     ("init", t_init)):  # fmt: skip
        event(name, at)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = DistributedDataParallel(model)
    lr = 0.01
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr * size)
    event("built")
    path = os.path.join(args.logdir, CHECKPOINT)
    step = 0
    if os.path.exists(path):
        checkpoint = torch.load(path, map_location="cpu")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        step = checkpoint["step"]
    event("loaded")
    stop_path = os.path.join(args.logdir, STOP_FILE)
    end = time.monotonic() + args.worker_seconds  # bounded even if the bench vanished
    while True:
        if rank == args.victim and restart == 0 and step == args.kill_step:
            event("kill")
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(100000 * rank + step)
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        done = os.path.exists(stop_path) or time.monotonic() > end
        stop = torch.tensor([float(done)])
        dist.all_reduce(stop)
        step += 1
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
        out.write(f"S {time.time():.6f} {restart} {size} {rank} {step}\n")
        if stop.item() > 0:
            break
        time.sleep(args.step_sleep)
    event("end")
    dist.destroy_process_group()
    out.close()
    return 0


# ---- launcher side --------------------------------------------------------------------------


@dataclasses.dataclass
class Worker:
    """One worker process's log: its start rank and host, events and committed steps."""

    start_rank: int = -1
    host: str = "?"
    events: dict = dataclasses.field(default_factory=dict)  # name -> [(time, gen, size, rank)]
    steps: list = dataclasses.field(default_factory=list)  # (time, gen, size, rank, step)

    def first(self, name: str, after: float = 0.0) -> float | None:
        times = [e[0] for e in self.events.get(name, []) if e[0] >= after]
        return min(times) if times else None

    def first_step_at(self, size: int, after: float = 0.0) -> float | None:
        times = [s[0] for s in self.steps if s[2] == size and s[0] >= after]
        return min(times) if times else None


def read_workers(logdir: str) -> dict[str, Worker]:
    workers = {}
    for name in sorted(os.listdir(logdir)):
        if not name.startswith("w"):
            continue
        w = Worker()
        with open(os.path.join(logdir, name)) as f:
            for line in f:
                parts = line.split()
                if not line.endswith("\n") or not parts:
                    continue  # a line being written
                if parts[0] == "I":
                    w.start_rank, w.host = int(parts[1]), parts[2]
                elif parts[0] == "E":
                    ids = tuple(int(v) for v in parts[3:6])
                    w.events.setdefault(parts[2], []).append((float(parts[1]), *ids))
                elif parts[0] == "S":
                    w.steps.append((float(parts[1]), *(int(v) for v in parts[2:6])))
        workers[name] = w
    return workers


def job_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torch_keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    for key in [k for k in env if k.startswith(("HOROVOD_", "BAGUA_HVD_", "TORCHELASTIC_"))]:
        del env[key]  # an outer job's settings must not leak in
    for key in [k for k in env if k in torch_keys]:
        del env[key]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (torchrun's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(case: Case, args: argparse.Namespace, tmp: str, logdir: str) -> list[str]:
    worker = [os.path.abspath(__file__), "--logdir", logdir, "--victim", str(case.victim),
              "--kill-step", str(args.kill_step), "--step-sleep", str(args.step_sleep),
              "--worker-seconds", str(args.run_timeout + 30)]  # fmt: skip
    if case.kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1",
                f"--nproc-per-node={case.np}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=bench-elastic",
                "--max-restarts=3", *worker[:1], PEER_FLAG, *worker[1:]]  # fmt: skip
    hosts_file = os.path.join(tmp, "hosts")
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat '{hosts_file}'\n")
    os.chmod(script, 0o755)
    return [sys.executable, "-m", "bagua_hvd.runner.launch", "--verbose",
            "-np", str(case.np), "--min-np", str(case.min_np), "--max-np", str(case.max_np),
            "--host-discovery-script", script, "--elastic-timeout", "60",
            sys.executable, *worker[:1], WORKER_FLAG, *worker[1:]]  # fmt: skip


def at_new_size(w: Worker, case: Case) -> list:
    """A worker's steps in the job's new shape: at the new size, or (torchrun) after a restart."""
    if case.kind == "torchrun":
        return [s for s in w.steps if s[1] >= 1]
    return [s for s in w.steps if s[2] == case.new_size]


def write_hosts(path: str, hosts: tuple[str, ...]) -> float:
    """Writes the discovery file atomically; returns the wall-clock time it became visible."""
    with open(path + ".tmp", "w") as f:
        f.write("".join(h + "\n" for h in hosts))
    os.replace(path + ".tmp", path)
    return time.time()


@dataclasses.dataclass
class Run:
    case: str
    ok: bool
    problems: list
    total: float | None
    parts: dict  # part -> seconds
    moments: dict  # name -> wall-clock time
    aside: dict  # figures beside the path
    code: int | None
    wall_s: float


def run_one(case: Case, args: argparse.Namespace, rng: random.Random) -> tuple[Run, list[str]]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bhvd-elastic-") as tmp:
        logdir = os.path.join(tmp, "logs")
        os.mkdir(logdir)
        hosts_file = os.path.join(tmp, "hosts")
        write_hosts(hosts_file, case.hosts)
        cmd = launch_command(case, args, tmp, logdir)
        env = job_env()
        if case.kind == "torchrun":
            env.update(LOGLEVEL="INFO", GLOO_SOCKET_IFNAME="lo")
            if not args.torchrun_shared_store:
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        lines: queue.Queue = queue.Queue()
        output: list[tuple[float, str]] = []

        def read() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                lines.put((time.time(), raw.decode("utf-8", "replace").rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        tree: dict[int, str] = {}
        problems: list[str] = []
        moments: dict[str, float] = {}
        deadline = time.monotonic() + args.run_timeout
        add_at: float | None = None
        stopped = False
        next_scan = 0.0
        while True:
            now = time.monotonic()
            if now >= next_scan and proc.poll() is None:
                tree.update(descendants(proc.pid, proc_table()))
                next_scan = now + 0.5
            while not lines.empty():
                output.append(lines.get())
            if proc.poll() is not None:
                break
            if now >= deadline:
                problems.append(f"run past {args.run_timeout:g} s: launcher stopped")
                break
            time.sleep(0.05)
            if stopped:
                continue
            workers = read_workers(logdir).values()
            if case.kind == "add" and "write" not in moments:
                old = [w for w in workers if w.steps]
                if len(old) == case.np and all(
                    w.steps[-1][4] >= args.kill_step for w in old
                ):  # fmt: skip
                    if add_at is None:
                        add_at = now + rng.uniform(0.0, 1.0)
                    elif now >= add_at:
                        moments["write"] = write_hosts(hosts_file, case.hosts + case.added)
            if case.kind != "add" or "write" in moments:
                at_new = [len(at_new_size(w, case)) for w in workers]
                at_new = [n for n in at_new if n]
                if len(at_new) == case.new_size and min(at_new) >= args.after:
                    open(os.path.join(logdir, STOP_FILE), "w").close()
                    stopped = True
        code = proc.poll()
        if code is None:
            tree.update(descendants(proc.pid, proc_table()))
            proc.terminate()  # the launcher stops its workers on SIGTERM
            try:
                code = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=10)
            code = None
        reader.join(timeout=5)
        while not lines.empty():
            output.append(lines.get())
        if code not in (0, None):
            problems.append(f"launcher exit {code}")
        settle = time.monotonic() + 3.0
        while True:
            left = [p for p, s in tree.items() if p != proc.pid and still_there(p, s)]
            if not left or time.monotonic() >= settle:
                break
            time.sleep(0.1)
        if left:
            problems.append(f"processes left behind (killed): {sorted(left)}")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        workers = read_workers(logdir)
    run = analyse(case, workers, output, moments, problems, args.torchrun_shared_store)
    run.code = code
    run.wall_s = time.monotonic() - started
    return run, [f"{t:.3f} {text}" for t, text in output]


def agent_lines(output: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """torchrun's log lines with the agent's own times (glog's local time, to the ms; the time
    the line arrived here when the two disagree by a minute: a year's turn)."""
    out = []
    for arrived, text in output:
        m = AGENT_LINE.match(text)
        if m:
            month, day, hour, minute, sec, us = (int(v) for v in m.groups()[:6])
            year = datetime.datetime.fromtimestamp(arrived).year
            try:
                at = datetime.datetime(year, month, day, hour, minute, sec, us).timestamp()
            except ValueError:
                at = arrived
            out.append((at if abs(at - arrived) < 60 else arrived, m[7]))
    return out


def latest(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else max(values)


def analyse(
    case: Case,
    workers: dict,
    output: list,
    moments: dict,
    problems: list[str],
    retries_ok: bool = False,
) -> Run:
    aside: dict[str, float] = {}
    ws = list(workers.values())
    if case.kind == "kill":
        victim = [w for w in ws if w.start_rank == case.victim and w.first("kill")]
        t0 = victim[0].first("kill") if victim else None
        moments["kill"] = t0
        if t0 is None:
            problems.append("the victim did not die")
            return Run(case.name, False, problems, None, {}, moments, aside, None, 0.0)
        survivors = [w for w in ws if w.first_step_at(case.new_size, t0) is not None]
        moments["detect"] = latest([w.first("error", t0) for w in survivors])
        gens = [t for t, text in output if t >= t0 and GENERATION.search(text)]
        moments["barrier"] = gens[0] if gens else None
        moments["re-form"] = latest([w.first("reset", t0) for w in survivors])
        moments["sync"] = latest([w.first("enter", t0) for w in survivors])
        exits = [t for t, text in output if t >= t0 and EXITED.search(text)]
        if exits:
            aside["beside the path, kill -> the driver hears of the exit"] = exits[0] - t0
        names = KILL_PARTS
    elif case.kind == "torchrun":
        victim = [w for w in ws if w.start_rank == case.victim and w.first("kill")]
        t0 = victim[0].first("kill") if victim else None
        moments["kill"] = t0
        if t0 is None:
            problems.append("the victim did not die")
            return Run(case.name, False, problems, None, {}, moments, aside, None, 0.0)
        agent = agent_lines(output)
        restarts = sum(1 for t, text in agent if t >= t0 and RESTARTING.search(text))
        # the attempt that recovered: the first that committed a step (the first restart, unless
        # that failed too: the failed ones count in the figure)
        attempts = sorted({s[1] for w in ws for s in w.steps if s[1] >= 1})
        first = attempts[0] if attempts else 0
        if not first:
            problems.append(f"no attempt committed after the kill ({restarts} restarts)")
        elif first > 1:
            aside["restarts: failed ones before the recovery"] = first - 1
            if not retries_ok:
                problems.append(f"attempts 1..{first - 1} failed before committing")
        if first and restarts > first:
            # torchrun restarted the group again after it had recovered (a worker failed later,
            # e.g. at its exit): beside the figure, not in it
            aside["restarts: after the recovery"] = restarts - first
        new = [w for w in ws if first and w.events.get("init") and w.events["init"][0][1] == first]
        spawned = min((w.first("proc") or t0 for w in new), default=t0)
        for name, pattern in AGENT_EVENTS:
            seen = [t for t, text in agent if t >= t0 and pattern.search(text)]
            if name == "rendezvous":  # the one that started the attempt that recovered
                seen = [t for t in seen if t <= spawned + 0.01][-1:]
            moments[name] = seen[0] if seen else None
        for part, event in (
            ("spawn", "proc"), ("import", "imported"), ("init", "init"), ("build", "built"),
            ("load", "loaded"),
        ):  # fmt: skip
            moments[part] = latest([w.first(event) for w in new]) if new else None
        if moments["spawn"] and moments["rendezvous"]:  # /proc's creation time: 10 ms ticks, cut
            moments["spawn"] = max(moments["spawn"], moments["rendezvous"])
        if len(new) != case.new_size:
            problems.append(f"{len(new)} workers in attempt {first}, expected {case.new_size}")
        firsts = [min((s[0] for s in w.steps if s[1] == first), default=None) for w in new]
        firsts = [t for t in firsts if t is not None]
        if len(firsts) != case.new_size:
            problems.append(f"{len(firsts)} workers committed in attempt {first}")
        moments["first step"] = max(firsts) if firsts else None
        resumed = {w.steps[0][4] for w in new if w.steps}
        if new and victim[0].steps and resumed != {victim[0].steps[-1][4] + 1}:  # step replayed
            problems.append(f"first steps after the restart {sorted(resumed)}")
        names = PEER_PARTS
    else:
        t0 = moments.get("write")
        if t0 is None:
            problems.append("the host was never added")
            return Run(case.name, False, problems, None, {}, moments, aside, None, 0.0)
        old = [w for w in ws if w.first("proc") is not None and w.first("proc") < t0]
        new = [w for w in ws if w not in old]
        changed = [t for t, text in output if t >= t0 and HOSTS_CHANGED.search(text)]
        moments["discover"] = changed[0] if changed else None
        moments["interrupt"] = latest([w.first("interrupt", t0) for w in old])
        gens = [t for t, text in output if t >= t0 and GENERATION.search(text)]
        moments["barrier"] = gens[0] if gens else None
        for part, event in (
            ("spawn", "proc"), ("import", "imported"), ("init", "init"), ("build", "built")
        ):  # fmt: skip
            moments[part] = latest([w.first(event) for w in new]) if new else None
        moments["sync"] = latest([w.first("enter", t0) for w in ws if w.first("enter", t0)])
        agents = [w.first("agent") for w in new]
        if new and None not in agents and moments["barrier"]:
            aside["spawn: agent -> worker (agent's and guard's start-up)"] = max(
                w.first("proc") for w in new
            ) - max(agents)
        if len(new) != case.new_size - case.np:
            problems.append(f"{len(new)} new workers, expected {case.new_size - case.np}")
        names = ADD_PARTS
    if case.kind != "torchrun":
        at_new = [w.first_step_at(case.new_size, t0) for w in ws]
        at_new = [t for t in at_new if t]
        if len(at_new) != case.new_size:
            problems.append(f"{len(at_new)} workers committed at size {case.new_size}")
        moments["first step"] = max(at_new) if at_new else None
    parts = {}
    previous = t0
    for name in names:
        at = moments.get(name)
        if at is None or previous is None:
            problems.append(f"no moment '{name}'")
            parts[name] = None
            previous = None
            continue
        parts[name] = at - previous
        previous = at
    total = moments["first step"] - t0 if moments["first step"] is not None else None
    return Run(case.name, not problems, problems, total, parts, moments, aside, None, 0.0)


def fmt(xs: list[float]) -> str:
    """The median of seconds, in ms."""
    return f"{statistics.median(xs) * 1000:.0f}" if xs else "-"


def totals(runs: list[Run], name: str) -> list[float]:
    return [r.total for r in runs if r.case == name and r.total is not None]


def pairs(runs: list[Run], cases: list[Case]) -> list[tuple[Case, Case, float | None]]:
    """(bagua_hvd case, torchrun case, ratio of the median totals torchrun / bagua_hvd)."""
    by_name = {c.name: c for c in cases}
    out = []
    for peer in cases:
        if peer.kind == "torchrun" and peer.peer_of in by_name:
            ours, theirs = totals(runs, peer.peer_of), totals(runs, peer.name)
            ratio = statistics.median(theirs) / statistics.median(ours) if ours and theirs else None
            out.append((by_name[peer.peer_of], peer, ratio))
    return out


def label(c: Case) -> str:
    if c.kind == "torchrun":
        return f"{c.name}: {c.np} -> {c.new_size} (torchrun, 1 node x {c.np}, all restarted)"
    return f"{c.name}: {c.np} -> {c.new_size} ({','.join(c.hosts + c.added)})"


def table(runs: list[Run], cases: list[Case], repeat: int) -> list[str]:
    from bagua_hvd.runner.elastic import driver

    paired = pairs(runs, cases)
    ratio_of = {c.name: (p, r) for c, p, r in paired}
    ratio_of.update({p.name: (c, r) for c, p, r in paired})
    out = []
    for kind, parts, head in (
        ("kill", KILL_PARTS, "bagua_hvd: death -> next committed step at the new size"),
        ("torchrun", PEER_PARTS, "peer, torchrun: death -> next checkpointed step, all restarted"),
        ("add", ADD_PARTS, "bagua_hvd: host appearance -> first committed step that includes it"),
    ):
        group = [c for c in cases if c.kind == kind]
        if not group:
            continue
        note = ""
        if kind == "add":
            note = f" (discovery poll period {driver.DISCOVER_HOSTS_FREQUENCY_SECS:g} s)"
        out.append(f"{head}{note}: ms, median of each part; total median / max over {repeat} runs")
        out.append("")
        extra = ""
        if kind == "kill" and paired:
            extra = " torchrun peer: total median | **ratio** torchrun / bagua_hvd |"
        elif kind == "torchrun" and paired:
            extra = " paired with: total median | **ratio** torchrun / bagua_hvd |"
        out.append(
            "| case | runs ok | " + " | ".join(parts) + " | **total** median / max |" + extra
        )
        out.append("|---|---:|" + "---:|" * len(parts) + "---:|" + "---|---:|" * bool(extra))
        for c in group:
            rs = [r for r in runs if r.case == c.name and r.total is not None]
            cells = [fmt([r.parts[p] for r in rs if r.parts.get(p) is not None]) for p in parts]
            tot = totals(runs, c.name)
            total = f"**{fmt(tot)}** / {max(tot) * 1000:.0f}" if tot else "-"
            ok = sum(r.ok for r in runs if r.case == c.name)
            row = f"| {label(c)} | {ok}/{repeat} | " + " | ".join(cells) + f" | {total} |"
            if extra:
                other, ratio = ratio_of.get(c.name, (None, None))
                if other is None:
                    row += " - | - |"
                else:
                    median = fmt(totals(runs, other.name))
                    cell = f"{other.name} ({other.np} -> {other.new_size}): {median}"
                    row += f" {cell} | **{ratio:.1f}** |" if ratio else f" {cell} | - |"
            out.append(row)
        names = {c.name for c in group}
        asides = sorted({k for r in runs if r.case in names for k in r.aside})
        out.append("")
        for key in asides:
            if key.startswith("restarts"):  # a count
                vals = [
                    f"{c.name} {sum(r.aside.get(key, 0) for r in runs if r.case == c.name):g}"
                    for c in group
                ]
                out.append(f"{key}, over the {repeat} runs: {', '.join(vals)}  ")
                continue
            vals = [
                f"{c.name} {fmt([r.aside[key] for r in runs if r.case == c.name and key in r.aside])}"
                for c in group
            ]
            out.append(f"{key}, median ms: {', '.join(vals)}  ")
        out.append("")
    for ours, peer, ratio in paired:
        text = f"{ratio:.2f}" if ratio else "-"
        out.append(
            f"ratio {peer.name} ({peer.np} -> {peer.new_size}, all restarted) / {ours.name} "
            f"({ours.np} -> {ours.new_size}, survivors kept): {text} (median totals "
            f"{fmt(totals(runs, peer.name))} / {fmt(totals(runs, ours.name))} ms)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker:
        return worker(args)
    if args._peer_worker:
        return peer_worker(args)
    rng = random.Random(args.seed)
    runs: list[Run] = []
    started = time.monotonic()
    for i in range(args.repeat):
        for case in args.case_list:
            run, output = run_one(case, args, rng)
            runs.append(run)
            parts = ", ".join(
                f"{k} {v * 1000:.0f}" if v is not None else f"{k} -" for k, v in run.parts.items()
            )
            total = f"{run.total * 1000:.0f} ms" if run.total is not None else "-"
            verdict = "ok" if run.ok else "FAIL: " + "; ".join(run.problems)
            print(f"run {i + 1}/{args.repeat} {case.name}: total {total} ({parts}); "
                  f"run {run.wall_s:.0f} s: {verdict}", flush=True)  # fmt: skip
            if args.verbose or not run.ok:
                t0 = run.moments.get("kill") or run.moments.get("write") or 0.0
                for name, at in run.moments.items():
                    if at is not None:
                        print(f"    {at - t0:+8.3f} {name}")
                if not run.ok:
                    print("\n".join("    " + line for line in output[-40:]))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nelastic bench, {now}, {time.monotonic() - started:.0f} s, "
          f"--step-sleep {args.step_sleep:g}, kill/add at step {args.kill_step}\n")  # fmt: skip
    print("\n".join(table(runs, args.case_list, args.repeat)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": {k: v for k, v in vars(args).items() if k in LAUNCHER_ARGS},
                 "runs": [dataclasses.asdict(r) for r in runs]},
                f, indent=1,
            )  # fmt: skip
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
