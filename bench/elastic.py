"""Elastic (issue 16): recovery and scale-up times of ``bagua-run --min-np/--max-np``.

    python bench/elastic.py                        # 5 cases x 3 runs, a few minutes
    python bench/elastic.py --repeat 5 --cases kill4,add2 --json elastic.json -v

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
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORKER_FLAG = "--_worker"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_FILE = "stop"
LAUNCHER_ARGS = ("cases", "repeat", "seed", "kill_step", "after", "step_sleep", "run_timeout")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "kill" or "add"
    hosts: tuple[str, ...]  # the discovery script's lines at the start
    added: tuple[str, ...]  # lines added later ("add")
    np: int
    min_np: int
    max_np: int
    new_size: int
    victim: int = -1  # start rank that kills itself ("kill")


CASES = {
    c.name: c
    for c in (
        Case("kill4", "kill", ("localhost:2", "127.0.0.1:2"), (), 4, 2, 4, 2, victim=3),
        Case("kill3", "kill", ("localhost:2", "127.0.0.1:1"), (), 3, 2, 3, 2, victim=2),
        Case("kill2", "kill", ("localhost:1", "127.0.0.1:1"), (), 2, 1, 2, 1, victim=1),
        Case("add2", "add", ("localhost:2",), ("127.0.0.1:2",), 2, 2, 4, 4),
        Case("add1", "add", ("localhost:1",), ("127.0.0.1:1",), 1, 1, 2, 2),
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
    p.add_argument("--json", metavar="FILE", help="also write every run's moments to FILE")
    p.add_argument("-v", "--verbose", action="store_true", help="print each run's timeline")
    # worker side
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
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
    for key in [k for k in env if k.startswith(("HOROVOD_", "BAGUA_HVD_"))]:
        del env[key]  # an outer job's settings must not leak in
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def write_hosts(path: str, hosts: tuple[str, ...]) -> float:
    """Writes the discovery file atomically; returns the wall-clock time it became visible."""
    with open(path + ".tmp", "w") as f:
        f.write("".join(h + "\n" for h in hosts))
    os.replace(path + ".tmp", path)
    return time.time()


def tree_of(root: int) -> dict[int, str]:
    """The processes under root (root included): pid -> start time in ticks."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), fields[19].decode())
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return out


def alive(pid: int, start: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return False
    return fields[19].decode() == start and fields[0] not in (b"Z", b"X")


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
        script = os.path.join(tmp, "discover.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\ncat '{hosts_file}'\n")
        os.chmod(script, 0o755)
        cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "--verbose",
               "-np", str(case.np), "--min-np", str(case.min_np), "--max-np", str(case.max_np),
               "--host-discovery-script", script, "--elastic-timeout", "60",
               sys.executable, os.path.abspath(__file__), WORKER_FLAG, "--logdir", logdir,
               "--victim", str(case.victim), "--kill-step", str(args.kill_step),
               "--step-sleep", str(args.step_sleep),
               "--worker-seconds", str(args.run_timeout + 30)]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            env=job_env(),
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
                tree.update(tree_of(proc.pid))
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
            if case.kind == "kill" or "write" in moments:
                at_new = [w for w in workers if w.steps and w.steps[-1][2] == case.new_size]
                if len(at_new) == case.new_size and all(
                    sum(s[2] == case.new_size for s in w.steps) >= args.after for w in at_new
                ):
                    open(os.path.join(logdir, STOP_FILE), "w").close()
                    stopped = True
        code = proc.poll()
        if code is None:
            tree.update(tree_of(proc.pid))
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
            left = [p for p, s in tree.items() if p != proc.pid and alive(p, s)]
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
    run = analyse(case, workers, output, moments, problems)
    run.code = code
    run.wall_s = time.monotonic() - started
    return run, [f"{t:.3f} {text}" for t, text in output]


def latest(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else max(values)


def analyse(case: Case, workers: dict, output: list, moments: dict, problems: list[str]) -> Run:
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
    at_new = [w.first_step_at(case.new_size, t0) for w in ws if w.first_step_at(case.new_size, t0)]
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


def table(runs: list[Run], cases: list[Case], repeat: int) -> list[str]:
    from bagua_hvd.runner.elastic import driver

    out = []
    for kind, parts, head in (
        ("kill", KILL_PARTS, "death -> next committed step at the new size"),
        ("add", ADD_PARTS, "host appearance -> first committed step that includes it"),
    ):
        group = [c for c in cases if c.kind == kind]
        if not group:
            continue
        note = ""
        if kind == "add":
            note = f" (discovery poll period {driver.DISCOVER_HOSTS_FREQUENCY_SECS:g} s)"
        out.append(f"{head}{note}: ms, median of each part; total median / max over {repeat} runs")
        out.append("")
        out.append("| case | runs ok | " + " | ".join(parts) + " | **total** median / max |")
        out.append("|---|---:|" + "---:|" * len(parts) + "---:|")
        for c in group:
            rs = [r for r in runs if r.case == c.name and r.total is not None]
            cells = [fmt([r.parts[p] for r in rs if r.parts.get(p) is not None]) for p in parts]
            tot = [r.total for r in rs]
            total = f"**{fmt(tot)}** / {max(tot) * 1000:.0f}" if tot else "-"
            ok = sum(r.ok for r in runs if r.case == c.name)
            label = f"{c.name}: {c.np} -> {c.new_size} ({','.join(c.hosts + c.added)})"
            out.append(f"| {label} | {ok}/{repeat} | " + " | ".join(cells) + f" | {total} |")
        names = {c.name for c in group}
        asides = sorted({k for r in runs if r.case in names for k in r.aside})
        out.append("")
        for key in asides:
            vals = [
                f"{c.name} {fmt([r.aside[key] for r in runs if r.case == c.name and key in r.aside])}"
                for c in group
            ]
            out.append(f"{key}, median ms: {', '.join(vals)}  ")
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker:
        return worker(args)
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
