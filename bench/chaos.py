"""Chaos (issue 15): SIGKILL or SIGSTOP a random rank at a random moment of a training loop.

    python bench/chaos.py                         # 50 runs, np 2 and 3, shm and TCP, default timeouts
    python bench/chaos.py --runs 10 --seed 7 --timeout 5
    python bench/chaos.py --cover --timeout 3     # 4 runs: kill/stop x shm/TCP x rank 0/other

Each run starts the real launcher (``bagua-run -np N``, as ``python -m bagua_hvd.runner.launch``)
on this script's worker: a small MLP trained under hvd.DistributedOptimizer, plus an allreduce of
the loss and one of --payload-kib every step and an allgather every 4th, each rank printing a line
per step. The
transport is shared memory (the default within a host) or TCP (BAGUA_HVD_TRANSPORT=tcp). Once
every rank has passed a random step, one rank (rank 0 included) gets SIGKILL or SIGSTOP. Then:

- the launcher must exit non-zero within HOROVOD_GLOO_TIMEOUT_SECONDS (--timeout; the core's
  bound on a silent peer, a stopped one included) + --slack seconds of the signal;
- every surviving rank must raise an error whose text names the failed rank ("rank V");
- afterwards no process of the job's tree (recorded while it ran, the stopped rank included) may
  be left, nor a shared-memory segment of the job (/dev/shm/bhvd_*).

Detection time = from the signal to the survivor's error line reaching this script. Each run
prints a line; the end prints the distribution (min/median/p90/max) of detection times per
(kind, transport) and a verdict; the exit status is 1 when any run broke a rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

WORKER_FLAG = "--_worker"
KINDS = ("kill", "stop")
TRANSPORTS = ("shm", "tcp")
SEGMENT_PREFIX = "bhvd_"  # the core's shared-memory names (native/src/transport/transport.cc)
LINE = re.compile(r"^\[(\d+)\]<std(?:out|err)>:CHAOS (pid|step|error) (.*)$")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Chaos: SIGKILL/SIGSTOP a random rank of a training job, check the ending",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=50, help="runs (ignored with --cover)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the draws")
    parser.add_argument("--np", default="2,3", help="rank counts to draw from")
    parser.add_argument(
        "--cover",
        action="store_true",
        help="4 fixed runs instead of random ones: each pair of kill/stop, shm/TCP and "
        "rank 0/last rank appears once",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="HOROVOD_GLOO_TIMEOUT_SECONDS of the jobs (the product's default: 30)",
    )
    parser.add_argument(
        "--slack", type=float, default=10.0, help="seconds allowed past the relevant timeout"
    )
    parser.add_argument(
        "--steps", default="3,150", help="the signal comes after a step drawn from this range"
    )
    parser.add_argument(
        "--step-sleep", type=float, default=0.01, help="seconds of 'compute' per step"
    )
    parser.add_argument(
        "--payload-kib",
        type=int,
        default=4096,
        help="KiB of one more allreduce per step, the gradient volume of a bigger model: with "
        "it a signal often lands inside a collective's data phase (0: none)",
    )
    parser.add_argument(
        "--start-timeout", type=float, default=90.0, help="seconds for a job to reach its step"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print the job's output of failed runs"
    )
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-seconds", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.nps = [int(n) for n in args.np.split(",")]
    if any(n < 2 for n in args.nps):
        parser.error("--np values must be >= 2")
    lo, _, hi = args.steps.partition(",")
    args.step_range = (int(lo), int(hi or lo))
    if args.runs < 1 or args.timeout <= 0:
        parser.error("--runs and --timeout must be positive")
    return args


# ---- worker side ----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import torch

    import bagua_hvd.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    print(f"CHAOS pid {rank} {os.getpid()}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    payload = torch.ones(args.payload_kib * 256)
    end = time.monotonic() + args.worker_seconds  # bounded even if the driver vanished
    step = 0
    try:
        while time.monotonic() < end:
            step += 1
            x = torch.randn(16, 32, generator=gen)
            y = torch.randint(0, 10, (16,), generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            hvd.allreduce(loss.detach(), name="chaos.loss")
            if payload.numel():
                hvd.allreduce(payload, name="chaos.payload")
            if step % 4 == 0:
                hvd.allgather(torch.tensor([[float(step)]]), name="chaos.steps")
            print(f"CHAOS step {rank} {step}", flush=True)
            time.sleep(args.step_sleep)
    except Exception as e:  # what a training script would die of: report it on one line
        text = " ".join(str(e).split())
        print(f"CHAOS error {rank} {type(e).__name__} at step {step}: {text}", flush=True)
        return 1
    return 0


# ---- driver side ----------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    kind: str
    transport: str
    np: int
    victim: int
    step: int
    delay: float  # seconds after every rank passed `step`


@dataclasses.dataclass
class Result:
    plan: Plan
    detect: dict[int, float]  # survivor -> seconds from the signal to its error line
    exit_s: float | None  # seconds from the signal to the launcher's exit (None: past the bound)
    code: int | None
    problems: list[str]
    output: list[str]
    wall_s: float  # the whole run, start-up included


def plans(args: argparse.Namespace) -> list[Plan]:
    rng = random.Random(args.seed)

    def moment() -> tuple[int, float]:
        return rng.randint(*args.step_range), rng.uniform(0, args.step_sleep * 2)

    if args.cover:
        # A half fraction of the 2^3 design: every pair of factor values appears once.
        combos = [("kill", "shm", True), ("kill", "tcp", False), ("stop", "shm", False),
                  ("stop", "tcp", True)]  # fmt: skip
        out = []
        for i, (kind, transport, first) in enumerate(combos):
            np_ = args.nps[i % len(args.nps)]
            out.append(Plan(kind, transport, np_, 0 if first else np_ - 1, *moment()))
        return out
    out = []
    for _ in range(args.runs):
        np_ = rng.choice(args.nps)
        out.append(Plan(rng.choice(KINDS), rng.choice(TRANSPORTS), np_, rng.randrange(np_),
                        *moment()))  # fmt: skip
    return out


def stat_fields(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat after the command name: [state, ppid, ..., starttime at 19], or None when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time in ticks) of every process (a pid with its start time
    names one process even if the pid is reused)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(entry)) is not None:
            table[int(entry)] = (int(fields[1]), fields[19].decode())
    return table


def descendants(root: int, table: dict[int, tuple[int, str]]) -> dict[int, str]:
    """The processes under root (root included): pid -> start time."""
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


def still_there(pid: int, start: str) -> bool:
    """True while the process (pid, start) exists and is not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[19].decode() == start and fields[0] not in (b"Z", b"X")


def segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SEGMENT_PREFIX)}


def job_env(transport: str, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]  # an outer job's settings must not leak in
    env.pop("BAGUA_HVD_TRANSPORT", None)
    env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = f"{timeout:g}"
    if transport == "tcp":
        env["BAGUA_HVD_TRANSPORT"] = "tcp"  # TCP between the ranks of one host too
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class Job:
    """One launcher and its output, each line stamped on arrival."""

    def __init__(self, plan: Plan, args: argparse.Namespace, bound: float) -> None:
        worker_s = args.start_timeout + bound + 60  # the worker's own end, should all else fail
        cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(plan.np),
               sys.executable, os.path.abspath(__file__), WORKER_FLAG,
               "--step-sleep", str(args.step_sleep), "--payload-kib", str(args.payload_kib),
               "--worker-seconds", str(worker_s)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            env=job_env(plan.transport, args.timeout),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.tree: dict[int, str] = {}  # every process seen under the launcher: pid -> start
        self._next_scan = 0.0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic(), raw.decode("utf-8", "replace").rstrip("\n")))
        self.lines.put(None)

    def scan(self, now: float, force: bool = False) -> None:
        """Records the launcher's process tree (at most every 0.2 s unless forced)."""
        if (force or now >= self._next_scan) and self.proc.poll() is None:
            self.tree.update(descendants(self.proc.pid, proc_table()))
            self._next_scan = now + 0.2

    def next_line(self, timeout: float) -> tuple[float, str] | None:
        """The next (arrival, line), or None when none came within timeout or the output ended."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        """Stops the job as a user would (SIGTERM to the launcher), SIGKILL if that fails."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


def run_one(plan: Plan, args: argparse.Namespace) -> Result:
    started = time.monotonic()
    bound = args.timeout + args.slack
    shm_before = segments()
    job = Job(plan, args, bound)
    output: list[str] = []
    problems: list[str] = []
    pids: dict[int, int] = {}  # rank -> worker pid
    steps = dict.fromkeys(range(plan.np), 0)
    errors: dict[int, tuple[float, str]] = {}  # rank -> (arrival, text)
    sent_at: float | None = None
    fire_at: float | None = None
    exited_at: float | None = None
    deadline = time.monotonic() + args.start_timeout
    while True:
        now = time.monotonic()
        job.scan(now)
        if sent_at is None and fire_at is None and len(pids) == plan.np:
            if min(steps.values()) >= plan.step:  # every rank is training
                fire_at = now + plan.delay
        if sent_at is None and fire_at is not None and now >= fire_at:
            job.scan(now, force=True)  # the tree as it is at the signal
            os.kill(pids[plan.victim], signal.SIGKILL if plan.kind == "kill" else signal.SIGSTOP)
            sent_at = time.monotonic()
            deadline = sent_at + bound
        if exited_at is None and job.proc.poll() is not None:
            exited_at = now
            deadline = min(deadline, now + 5)  # the rest of its output, then stop reading
        if now >= deadline:
            break
        item = job.next_line(0.05)
        if item is None:
            if not job.reader.is_alive() and job.lines.empty() and exited_at is not None:
                break
            continue
        at, text = item
        m = LINE.match(text)
        if not (m and m.group(2) == "step"):  # -v shows all but the step lines
            output.append(f"{at - sent_at:+8.3f} {text}" if sent_at else f"  before {text}")
        if not m:
            continue
        rank, what, rest = int(m.group(1)), m.group(2), m.group(3)
        if what == "pid":
            pids[rank] = int(rest.split()[-1])
        elif what == "step":
            steps[rank] = int(rest.split()[-1])
        elif rank not in errors:
            errors[rank] = (at, rest)

    code = job.proc.poll()
    exit_s = None
    if sent_at is None:
        problems.append(
            f"the job ended (exit {code}) before the signal" if code is not None
            else f"the job did not pass step {plan.step} within {args.start_timeout:g} s"
        )  # fmt: skip
    elif code is None:
        problems.append(f"the launcher did not exit within {bound:g} s of the signal")
    else:
        exit_s = (exited_at or time.monotonic()) - sent_at  # at most one poll late
        if exit_s > bound:
            problems.append(f"the launcher exited {exit_s:.1f} s after the signal (> {bound:g} s)")
        if code == 0:
            problems.append("the launcher exited 0")
    if code is None:  # only now, after recording it
        job.stop()
    job.reader.join(timeout=5)

    detect: dict[int, float] = {}
    for rank in range(plan.np):
        if rank == plan.victim or sent_at is None:
            continue
        if rank not in errors:
            problems.append(f"rank {rank} raised no error")
            continue
        at, text = errors[rank]
        detect[rank] = at - sent_at
        if not re.search(rf"\brank {plan.victim}\b", text):
            problems.append(f"rank {rank}'s error does not name rank {plan.victim}: {text}")
    problems += leftovers(job, shm_before)
    return Result(plan, detect, exit_s, code, problems, output, time.monotonic() - started)


def leftovers(job: Job, shm_before: set[str]) -> list[str]:
    """What the job left: processes of its tree and shared-memory segments. Each is reported,
    then removed so that the next run starts clean."""
    problems = []
    # The launcher has exited: its ranks must be gone too (it waits for them); a moment for the
    # kernel to finish the last SIGKILLs.
    settle = time.monotonic() + 2.0
    while True:
        left = [p for p, s in job.tree.items() if p != job.proc.pid and still_there(p, s)]
        if not left or time.monotonic() >= settle:
            break
        time.sleep(0.1)
    if left:
        problems.append(f"processes left behind: {sorted(left)}")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    new_segments = segments() - shm_before
    if new_segments:
        problems.append(f"shared-memory segments left: {sorted(new_segments)}")
        for name in new_segments:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
    return problems


def describe(i: int, n: int, r: Result) -> str:
    p = r.plan
    head = (f"run {i}/{n}: {p.kind} {p.transport} np={p.np} victim={p.victim} "
            f"after step {p.step}")  # fmt: skip
    end = (f"launcher exit {r.code} after {r.exit_s:.2f} s" if r.exit_s is not None
           else "launcher did not exit")  # fmt: skip
    seen = ", ".join(f"rank {k} {v:.2f} s" for k, v in sorted(r.detect.items())) or "none"
    verdict = "ok" if not r.problems else "FAIL: " + "; ".join(r.problems)
    return f"{head}: {end}; detected by {seen}; run {r.wall_s:.0f} s: {verdict}"


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank method."""
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, int(-(-q * len(xs) // 1)) - 1))]


def summary(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        f"chaos: {len(results)} runs, HOROVOD_GLOO_TIMEOUT_SECONDS={args.timeout:g}, "
        f"seed {args.seed}",
        "detection time (signal -> survivor's error), s, over every survivor of every run:",
        f"  {'kind':5} {'transport':9} {'runs':>4} {'errors':>6} {'min':>6} {'median':>6} "
        f"{'p90':>6} {'max':>6}   launcher exit: median / max s",
    ]
    for kind in KINDS:
        for transport in TRANSPORTS:
            group = [r for r in results if (r.plan.kind, r.plan.transport) == (kind, transport)]
            times = [t for r in group for t in r.detect.values()]
            exits = [r.exit_s for r in group if r.exit_s is not None]
            if not group:
                continue
            stats = (f"{min(times):6.2f} {statistics.median(times):6.2f} "
                     f"{percentile(times, 0.9):6.2f} {max(times):6.2f}" if times
                     else f"{'-':>6} {'-':>6} {'-':>6} {'-':>6}")  # fmt: skip
            ex = f"{statistics.median(exits):.2f} / {max(exits):.2f}" if exits else "-"
            lines.append(f"  {kind:5} {transport:9} {len(group):4} {len(times):6} {stats}   {ex}")
    failed = [i for i, r in enumerate(results, 1) if r.problems]
    lines.append(
        "chaos verdict: "
        + (
            f"FAIL ({len(failed)} of {len(results)} runs: {failed})"
            if failed
            else f"pass ({len(results)} runs)"
        )  # fmt: skip
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker:
        return worker(args)
    todo = plans(args)
    results = []
    started = time.monotonic()
    for i, plan in enumerate(todo, 1):
        r = run_one(plan, args)
        results.append(r)
        print(describe(i, len(todo), r), flush=True)
        if r.problems and args.verbose:
            print("\n".join("    " + line for line in r.output), flush=True)
    print(summary(results, args))
    print(f"chaos: {time.monotonic() - started:.0f} s")
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
