"""BAGUA's algorithms in bagua_hvd beside torch DistributedDataParallel (gloo), by network.

    python bench/algorithms.py                          # loopback, 1gbit, 100mbit (root)
    python bench/algorithms.py --nets loopback          # no root needed
    python bench/algorithms.py --nets 1gbit --modes ddp,bytegrad --steps 6

The model is bench/train.py's (the previous issue's): an MLP 1024 -> 2048 x6 -> 1000 with ReLU
(25.13M float32 parameters), a fixed random batch of 32 samples per rank, cross-entropy, 1 torch
thread per rank, 2 ranks.

Networks:
  loopback  one bagua-run with -np 2 on this host (bagua_hvd uses shared memory; gloo TCP on lo)
  1gbit     two hosts: network namespaces on a bridge, each host's egress shaped by tc tbf
  100mbit   (bench/_netns.py sets them up and tears them down; needs root), one bagua-run per
            host (--num-nodes 2), so bagua_hvd talks TCP between them; gloo too
Before a shaped network runs, a bulk TCP transfer between the namespaces measures the link's
goodput in both directions; the slower one is the link rate of the bounds below.

Modes (--modes; each with its own replica of the model, the same initial weights):
  ddp                          DistributedDataParallel(gloo, bucket_cap_mb=25) + SGD
  ddp_adam                     the same with torch.optim.Adam (QAdam's baseline)
  gradient_allreduce           DistributedOptimizer(SGD, algorithm=GradientAllReduce())
  bytegrad                     ... algorithm=ByteGrad()
  qadam                        DistributedOptimizer(QAdamOptimizer, algorithm=QAdamAlgorithm(.))
                               (its full-precision warm-up steps run before any block)
  decentralized                ... algorithm=Decentralized(peer_selection_mode="shift_one")
  decentralized_all            ... Decentralized(peer_selection_mode="all")
  decentralized_ring           ... Decentralized(peer_selection_mode="ring")
  low_precision_decentralized  ... LowPrecisionDecentralized()
  async                        ... AsyncModelAverage(sync_interval_ms=500): resumed at the start
                               of each of its blocks, abort()ed at the end (no background
                               traffic while other modes run); its blocks are longer: warm-up
                               covers one averaging round and the timed steps at least 4
                               (a round every 500 ms + an allreduce of the model at the link
                               rate, estimated with the warm-up's step time)
A mode that cannot be built (its class does not exist yet, or its first step fails) shows
"not available" with the error instead of a row. ddp (and ddp_adam with qadam) is always run: it
is the baseline. ddp runs with a twin, the same replica under ddp.no_sync() (no communication).

All modes of a network run in the same pair of processes, in blocks of A-B-C then C-B-A
(--rounds such pairs; each block: warm-up steps, then its share of the timed steps), so that
slow drifts of the machine hit every mode alike. Step time = the slowest rank's; per mode the
median over timed steps; samples/s = 2 x 32 / median step; ratio = samples/s over the
baseline's (ddp; ddp_adam for qadam) in the same run.

Communication per step, per rank (the table shows the maximum over ranks):
  comm ms   bagua_hvd: core counter exec_ns (wall time its background thread spent executing
            collectives) over the timed steps / steps; DDP: t(ddp) - t(ddp no_sync) (medians)
  sent MB   bagua_hvd: core counter bytes_sent (payload this rank sent to peers) / steps
  analytic  what the algorithm must send (N float32 parameters, n = 2 ranks; buckets of 25 MiB
            in reverse registration order, padding per bucket): allreduce 2(n-1)/n 4N; ByteGrad
            and QAdam sum_b 2(n-1)/n (N'_b + 32n), N'_b = N_b padded to a multiple of n;
            shift_one 4N; ring 4N per distinct neighbour; low precision sum_b (N_b + 32) per
            distinct neighbour; async 2(n-1)/n 4N per averaging round x rounds per step, a
            round every 500 ms + the allreduce's time at the link rate (BAGUA sleeps
            sync_interval_ms between rounds)
  wire MB   bytes the host's interface transmitted (shaped networks: /proc/net/dev of the
            namespace; every mode, DDP too; headers count once per GSO packet of up to
            64 KiB, so this is ~0.2 % above the payload)
  bound ms  sent bytes (measured if the counter exists, else analytic) / link rate
  comm/bnd  comm ms / bound ms: goal <= 1.2 on the shaped links (printed on loopback too,
            where the bound uses the TCP loopback rate but bagua_hvd uses shared memory)
The goals also show each mode's CPU time per step (a rank's process, every thread: the
training thread, the core's; less sensitive to other load than wall time) and, per bagua_hvd
mode on a shaped link, step ms / max(the no-communication
step of its baseline's twin, the bound of the larger of sent and analytic bytes): goal <= 1.15
(communication overlapped with compute); with a core or less per rank also step / (CPU ms per
step / cores per rank), for information: a step cannot be shorter than its process's CPU time
on its share of the cores, which the goal's bound does not count.
--timeline N adds N traced steps per bagua_hvd mode after the blocks and prints their per-step
timeline (bench/_timeline.py; bench/timeline.py runs it for the three modes of interest).
Counters the core does not have yet read -1 and show as n/a.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
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
from _launch import free_port, run_ranks  # noqa: E402
from train import (  # noqa: E402  (the previous issue's model and settings)
    CLASSES,
    DDP_BUCKET_MB,
    HIDDEN,
    HIDDEN_LAYERS,
    IN_FEATURES,
    LR,
    MOMENTUM,
    STEADY_MALLOC,
    make_model,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_FLAG = "--_worker"
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"  # a directory: each rank writes its JSON there
GLOO_ADDR_ENV = "BAGUA_HVD_BENCH_GLOO_ADDR"
GLOO_PORT_ENV = "BAGUA_HVD_BENCH_GLOO_PORT"
WIRE_IFACE_ENV = "BAGUA_HVD_BENCH_WIRE_IFACE"  # interface whose tx bytes a rank reads
LINK_ENV = "BAGUA_HVD_BENCH_LINK_BPS"  # the measured link rate, bytes/s
GLOO_TIMEOUT = datetime.timedelta(seconds=600)
ADAM_LR = 1e-4
QADAM_WARMUP = 3  # full-precision steps of QAdam, all run before the first block
ASYNC_INTERVAL_MS = 500
ASYNC_MIN_ROUNDS = 4  # averaging rounds (at least) in each timed block of async
BUCKET_BYTES = 25 << 20  # BAGUA_HVD_BUCKET_MB's default
NS_PORT_BASE = 29500  # fresh namespaces: every port is free
DOCS_PLOT = os.path.join(ROOT, "docs", "algorithms-throughput.png")

NETS = ("loopback", "1gbit", "100mbit")
MODES = (
    "ddp",
    "ddp_adam",
    "gradient_allreduce",
    "bytegrad",
    "qadam",
    "decentralized",
    "decentralized_all",
    "decentralized_ring",
    "low_precision_decentralized",
    "async",
)
DDP_MODES = ("ddp", "ddp_adam")
NO_SYNC = ":no_sync"  # suffix of a DDP mode's twin without communication
# Per network: warm-up steps per block, timed steps per mode, default modes. At 100mbit a DDP
# step takes ~9 s: only the goal's modes, few steps (the whole default run: ~8 min here).
NET_DEFAULTS = {
    "loopback": (3, 20, MODES),
    "1gbit": (2, 12, MODES),
    "100mbit": (2, 4, ("ddp", "bytegrad")),
}
# Goals of the issue: samples/s over the baseline's, per network; comm time over the bound.
GOALS = {
    "1gbit": {
        "gradient_allreduce": 1.0,
        "bytegrad": 2.5,
        "qadam": 2.5,
        "low_precision_decentralized": 2.5,
        "async": 4.0,
    },
    "100mbit": {"bytegrad": 3.5},
}
MAX_BOUND_RATIO = 1.2
# Issue 12.7: a step within this factor of max(the step without communication, the bound).
MAX_OVERLAP_RATIO = 1.15
RANKS = 2  # every network runs 2 ranks on this machine's cores


def baseline_of(mode: str) -> str:
    return "ddp_adam" if mode == "qadam" else "ddp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Throughput of BAGUA's algorithms beside DDP (gloo), 2 ranks, per network",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="defaults per network (warm-up per block / timed steps / modes): "
        + "; ".join(
            f"{n}: {w} / {s} / {'all' if m == MODES else ','.join(m)}"
            for n, (w, s, m) in NET_DEFAULTS.items()
        ),
    )
    parser.add_argument(
        "--nets", default=",".join(NETS), help=f"comma-separated, of {', '.join(NETS)}"
    )
    parser.add_argument(
        "--modes",
        help=f"comma-separated, of {', '.join(MODES)} (default: per network, see below); "
        "ddp, and ddp_adam with qadam, are added as baselines",
    )
    parser.add_argument("--warmup", type=int, help="warm-up steps per block (all networks)")
    parser.add_argument("--steps", type=int, help="timed steps per mode (all networks)")
    parser.add_argument("--rounds", type=int, default=1, help="A-B-B-A rounds (2 blocks each)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument(
        "--timeout", type=float, default=1500.0, help="seconds before a network's run is stopped"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="PNG of samples/s per mode per network written at the end (default: "
        "docs/algorithms-throughput.png when every network ran, else none)",
    )
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--json", metavar="FILE", help="also write all results to FILE (JSON)")
    parser.add_argument(
        "--timeline",
        type=int,
        default=0,
        metavar="N",
        help="after the timed blocks, N traced steps per bagua_hvd mode: prints the per-step "
        "timeline of each rank's last one (bucket launches, the core's collectives, waits, "
        "updates; bench/_timeline.py)",
    )
    parser.add_argument(WORKER_FLAG, choices=NETS, help=argparse.SUPPRESS)
    parser.add_argument("--_modes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.net_list = [n.strip() for n in args.nets.split(",") if n.strip()]
    for n in args.net_list:
        if n not in NETS:
            parser.error(f"unknown network {n!r}; choose from {', '.join(NETS)}")
    if args.modes is not None:
        args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
        for m in args.mode_list:
            if m not in MODES:
                parser.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    for name in ("warmup", "steps", "rounds", "batch_size", "timeline"):
        value = getattr(args, name)
        low = 0 if name in ("warmup", "timeline") else 1
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    return args


def plan(args: argparse.Namespace, net: str) -> tuple[int, int, list[str]]:
    """(warm-up per block, timed steps per mode, modes in block order) of one network."""
    warmup, steps, modes = NET_DEFAULTS[net]
    modes = list(args.mode_list if args.modes is not None else modes)
    for mode in list(modes):
        base = baseline_of(mode)
        if base not in modes:
            modes.insert(0, base)
    order = [m for m in MODES if m in modes]
    return (
        warmup if args.warmup is None else args.warmup,
        steps if args.steps is None else args.steps,
        order,
    )


# ---- analytic bytes -------------------------------------------------------------------------


def model_param_sizes() -> list[int]:
    """Element counts of the model's parameters in registration order (weight, bias, ...)."""
    dims = [IN_FEATURES] + [HIDDEN] * HIDDEN_LAYERS + [CLASSES]
    sizes = []
    for a, b in zip(dims, dims[1:]):
        sizes += [a * b, b]
    return sizes


def buckets(sizes: list[int], cap_bytes: int = BUCKET_BYTES, elem: int = 4) -> list[int]:
    """Element counts of the buckets: reverse registration order, a bucket closes before it would
    exceed the cap (a bigger tensor gets its own), as DistributedOptimizer forms them."""
    out: list[int] = []
    cur = 0
    for n in reversed(sizes):
        if cur and (cur + n) * elem > cap_bytes:
            out.append(cur)
            cur = 0
        cur += n
    if cur:
        out.append(cur)
    return out


def analytic_bytes(mode: str, n: int, step_s: float | None, rate_Bps: float | None) -> float:
    """Bytes one rank must send per step in ``mode`` (module docstring)."""
    sizes = model_param_sizes()
    total = sum(sizes)
    bks = buckets(sizes)
    ring = 2 * (n - 1) / n
    neighbours = 1 if n == 2 else 2
    if mode in ("ddp", "ddp_adam", "gradient_allreduce", "decentralized_all"):
        return ring * 4 * total
    if mode in ("bytegrad", "qadam"):
        return sum(ring * (n * math.ceil(b / n) + 32 * n) for b in bks)
    if mode == "decentralized":
        return 4 * total
    if mode == "decentralized_ring":
        return 4 * total * neighbours
    if mode == "low_precision_decentralized":
        return sum((b + 32) * neighbours for b in bks)
    if mode == "async":
        per_round = ring * 4 * total
        if step_s is None:
            return math.nan
        round_s = ASYNC_INTERVAL_MS / 1e3 + (per_round / rate_Bps if rate_Bps else 0.0)
        return per_round * step_s / round_s
    raise ValueError(f"unknown mode {mode}")


# ---- launcher side --------------------------------------------------------------------------


def worker_cmd(args: argparse.Namespace, net: str, warmup: int, steps: int, modes: list[str]):
    return [
        sys.executable, os.path.abspath(__file__), WORKER_FLAG, net,
        "--_modes", ",".join(modes), "--warmup", str(warmup), "--steps", str(steps),
        "--rounds", str(args.rounds), "--batch-size", str(args.batch_size),
        "--timeline", str(args.timeline),
    ]  # fmt: skip


def base_env(result_dir: str, link_Bps: float) -> dict:
    env = dict(os.environ)
    env[LINK_ENV] = repr(link_Bps)
    for key, value in STEADY_MALLOC.items():
        env.setdefault(key, value)
    env["OMP_NUM_THREADS"] = "1"
    env[RESULT_ENV] = result_dir
    return env


def read_results(result_dir: str) -> dict:
    paths = sorted(glob.glob(os.path.join(result_dir, "rank*.json")))
    if not paths:
        raise RuntimeError("the ranks wrote no result")
    with open(paths[0]) as f:
        return json.load(f)  # rank 0's holds everything (gathered)


def run_loopback(
    args: argparse.Namespace, link_Bps: float, warmup: int, steps: int, modes: list[str]
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_alg_") as tmp:
        env = base_env(tmp, link_Bps)
        env[GLOO_ADDR_ENV] = "127.0.0.1"
        env[GLOO_PORT_ENV] = str(free_port())
        env["GLOO_SOCKET_IFNAME"] = "lo"
        rc = run_ranks(2, worker_cmd(args, "loopback", warmup, steps, modes), env, args.timeout)
        if rc is None:
            raise RuntimeError(f"no result after --timeout {args.timeout:g} s")
        if rc != 0:
            raise RuntimeError(f"the ranks failed (launcher exit status {rc})")
        return read_results(tmp)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()  # a launcher stops its ranks on SIGTERM
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_netns(
    args: argparse.Namespace,
    net: str,
    index: int,
    link_Bps: float,
    warmup: int,
    steps: int,
    modes: list[str],
) -> dict:
    """One bagua-run per namespace (--num-nodes 2), node 0 serving the rendezvous."""
    port = NS_PORT_BASE + 10 * index
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_alg_") as tmp:
        env = base_env(tmp, link_Bps)
        env["BAGUA_HVD_SECRET"] = secrets.token_hex(32)
        env[GLOO_ADDR_ENV] = _netns.address(0)
        env[GLOO_PORT_ENV] = str(port + 1)
        procs = []
        try:
            for i in range(_netns.HOSTS):
                env_i = dict(env)
                env_i["GLOO_SOCKET_IFNAME"] = _netns.ns_iface(i)
                env_i[WIRE_IFACE_ENV] = _netns.ns_iface(i)
                cmd = [
                    sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2",
                    "--num-nodes", "2", "--node-rank", str(i),
                    "--rendezvous-addr", f"{_netns.address(0)}:{port}",
                    "--network-interfaces", _netns.ns_iface(i),
                    *worker_cmd(args, net, warmup, steps, modes),
                ]  # fmt: skip
                procs.append(subprocess.Popen(_netns.ns_exec(i, cmd), env=env_i, cwd=ROOT))
            deadline = time.monotonic() + args.timeout
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"no result after --timeout {args.timeout:g} s") from None
            codes = [p.returncode for p in procs]
            if any(codes):
                raise RuntimeError(f"the ranks failed (launcher exit statuses {codes})")
        finally:
            stop(procs)
        return read_results(tmp)


def loopback_rate() -> float:
    """Goodput of one TCP stream over lo (the loopback bound's rate; bagua_hvd uses shared
    memory there, so that bound is for scale only)."""
    port = free_port()
    return _netns.measure_between([], [], "127.0.0.1", port, 500_000_000, 60.0)


def main_launcher(args: argparse.Namespace) -> int:
    shaped = [n for n in args.net_list if n != "loopback"]
    runs: dict[str, dict] = {}
    t_start = time.monotonic()
    # SIGTERM (e.g. from a timeout) must still tear the namespaces down: make it an exception.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if shaped:
            _netns.require_root()
    except _netns.NetnsError as e:
        print(f"algorithms bench: {e} (or choose --nets loopback)", file=sys.stderr)
        return 1
    try:
        if shaped:
            _netns.up()
        for index, net in enumerate(args.net_list):
            warmup, steps, modes = plan(args, net)
            t0 = time.monotonic()
            print(
                f"\n=== {net}: modes {', '.join(modes)}; {warmup} warm-up steps per block, "
                f"{steps} timed steps per mode, {2 * args.rounds} blocks",
                flush=True,
            )
            try:
                if net == "loopback":
                    rates = (loopback_rate(),) * 2
                else:
                    _netns.shape(net)
                    rates = _netns.check_link(net)
                print(
                    f"{net}: measured TCP goodput {rates[0] / 1e6:.1f} / {rates[1] / 1e6:.1f} MB/s"
                    f" (host 0 -> 1 / 1 -> 0), {min(rates) * 8e-6:.0f} Mbit/s",
                    flush=True,
                )
                if net == "loopback":
                    result = run_loopback(args, min(rates), warmup, steps, modes)
                else:
                    result = run_netns(args, net, index, min(rates), warmup, steps, modes)
            except (RuntimeError, _netns.NetnsError, OSError) as exc:
                print(f"{net}: FAILED: {exc}", file=sys.stderr, flush=True)
                runs[net] = {"error": str(exc), "elapsed_s": time.monotonic() - t0}
                continue
            result["link_Bps"] = min(rates)
            result["link_Bps_both"] = list(rates)
            result["elapsed_s"] = time.monotonic() - t0
            result["plan"] = {"warmup": warmup, "steps": steps, "rounds": args.rounds}
            runs[net] = result
            print_network(net, result, args.batch_size)
            if result.get("timeline"):
                print_timeline(net, result)
    except _netns.NetnsError as e:
        print(f"algorithms bench: {e}", file=sys.stderr)
        return 1
    finally:
        if shaped:
            _netns.down()
            print(f"namespaces torn down: ip netns list -> {leftover_text()}", flush=True)
    print_summary(runs, args.batch_size, time.monotonic() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch_size": args.batch_size, "runs": runs}, f, indent=1)
    path = args.plot
    if path is None and set(args.net_list) == set(NETS):
        path = DOCS_PLOT
    if path is not None and not args.no_plot:
        plot(runs, args.batch_size, path)
    elif not args.no_plot:
        print(f"no plot (not every network ran): --plot PATH writes one; {DOCS_PLOT} is kept")
    return 0 if all("error" not in r for r in runs.values()) else 1


def leftover_text() -> str:
    try:
        left = _netns.leftovers()
    except _netns.NetnsError as e:
        return f"? ({e})"
    return ", ".join(left) if left else "none of ours"


# ---- report ---------------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def mode_figures(net: str, result: dict, mode: str, batch: int) -> dict:
    """Derived figures of one mode (see the module docstring)."""
    m = result["modes"][mode]
    n = result["size"]
    rate = result["link_Bps"]
    step_s = m["step_ms"] / 1e3
    sps = n * batch / step_s
    base = result["modes"].get(baseline_of(mode))
    ratio = None
    if base and base.get("status") == "ok":
        ratio = base["step_ms"] / m["step_ms"]
    if mode in DDP_MODES:
        twin = result["modes"].get(mode + NO_SYNC)
        comm_s = (m["step_ms"] - twin["step_ms"]) / 1e3 if twin else None
        sent = None
    else:
        execs = [e for e in m["exec_ns_per_step"] if e is not None]
        comm_s = max(execs) / 1e9 if execs else None
        sents = [b for b in m["bytes_sent_per_step"] if b is not None]
        sent = max(sents) if sents else None
    wires = [w for w in m["wire_bytes_per_step"] if w is not None]
    analytic = analytic_bytes(mode, n, step_s, rate)
    bound_bytes = sent if sent is not None else analytic
    bound_s = bound_bytes / rate if rate and not math.isnan(bound_bytes) else None
    return {
        "samples_s": sps,
        "ratio": ratio,
        "comm_s": comm_s,
        "sent": sent,
        "analytic": analytic,
        "wire": max(wires) if wires else None,
        "bound_s": bound_s,
        "bound_from": "measured" if sent is not None else "analytic",
        "bound_ratio": comm_s / bound_s if comm_s is not None and bound_s else None,
    }


def print_network(net: str, result: dict, batch: int) -> None:
    rate = result["link_Bps"]
    plan_ = result["plan"]
    print(
        f"\n{net}: MLP {IN_FEATURES}->{HIDDEN}x{HIDDEN_LAYERS}->{CLASSES} "
        f"({result['params'] / 1e6:.2f}M params), batch {batch}/rank, {result['size']} ranks, "
        f"1 torch thread each; {plan_['steps']} timed steps per mode over "
        f"{2 * plan_['rounds']} blocks, {plan_['warmup']} warm-up steps per block; link "
        f"{rate / 1e6:.1f} MB/s (measured); took {result['elapsed_s']:.0f} s; peak RSS per rank "
        + " / ".join(f"{v:.0f}" for v in result["peak_rss_mib"])
        + " MiB"
    )
    print(
        "| mode | samples/s | vs baseline | step ms | comm ms/step | sent MB/step | "
        "analytic MB/step | wire MB/step | bound ms | comm/bound | replicas equal | loss |"
    )
    print("|---" + "|---:" * 9 + "|---|---:|")
    for mode, m in result["modes"].items():
        if m.get("status") != "ok":
            print(f"| {mode} | not available: {m.get('error', '?')} |" + " |" * 10)
            continue
        if mode.endswith(NO_SYNC):
            f = {"samples_s": result["size"] * batch / (m["step_ms"] / 1e3)}
            print(
                f"| {mode} (no communication) | {f['samples_s']:.1f} | - | {m['step_ms']:.1f} |"
                + " - |" * 6
                + f" {yes_no(m['replicas_equal'])} | {m['loss']:.4g} |"
            )
            continue
        f = mode_figures(net, result, mode, batch)
        ratio = fmt(f["ratio"], ".2f") + "x" if f["ratio"] is not None else "n/a"
        name = mode + (f" ({m['note']})" if m.get("note") else "")
        if m["steps"] != plan_["steps"]:
            name += f" [{m['steps']} timed steps]"
        bound = fmt(scaled(f["bound_s"], 1e3), ".0f")
        if f["bound_s"] and f["bound_from"] == "analytic":
            bound += " (analytic)"
        cells = [
            name,
            f"{f['samples_s']:.1f}",
            f"{ratio} vs {baseline_of(mode)}",
            f"{m['step_ms']:.1f}",
            fmt(scaled(f["comm_s"], 1e3), ".1f"),
            fmt(scaled(f["sent"], 1e-6), ".2f"),
            fmt(scaled(f["analytic"], 1e-6), ".2f"),
            fmt(scaled(f["wire"], 1e-6), ".2f"),
            bound,
            fmt(f["bound_ratio"], ".2f"),
            yes_no(m["replicas_equal"]),
            f"{m['loss']:.4g}",
        ]
        print("| " + " | ".join(cells) + " |")


def print_timeline(net: str, result: dict) -> None:
    """--timeline: each mode's last traced step on rank 0 as a table, and a summary line per
    rank and traced step (ms from the step's start)."""
    import _timeline

    for mode, ranks in result["timeline"].items():
        f = mode_figures(net, result, mode, 32) if mode in result["modes"] else {}
        bound = f.get("bound_s")
        print(
            f"\n{net} {mode}: timeline (ms from the step's start); step median "
            f"{result['modes'][mode]['step_ms']:.1f} ms, bound "
            + (f"{bound * 1e3:.0f} ms" if bound else "n/a")
        )
        for r, steps in enumerate(ranks):
            for k, st in enumerate(steps):
                s = _timeline.summary(st["events"], st["t0"])
                if "cpu_ms" in st:
                    s["cpu_time"] = st["cpu_ms"]  # the process's, all threads: load-independent
                print(
                    f"  rank {r} step {k}: "
                    + ", ".join(f"{key.replace('_', ' ')} {v:.1f}" for key, v in s.items())
                )
        last = ranks[0][-1]
        for line in _timeline.format_step(
            last["events"], last["t0"], f"rank 0, traced step {len(ranks[0]) - 1}:"
        ):
            print("  " + line)


def print_summary(runs: dict, batch: int, total_s: float) -> None:
    print(f"\nsummary: samples/s per mode and network (whole run {total_s:.0f} s)")
    nets = [n for n in runs if "error" not in runs[n]]
    for net, r in runs.items():
        if "error" in r:
            print(f"  {net}: FAILED after {r['elapsed_s']:.0f} s: {r['error']}")
    if not nets:
        return
    modes = [m for m in MODES if any(m in runs[n]["modes"] for n in nets)]
    print("| mode | " + " | ".join(nets) + " |")
    print("|---" + "|---:" * len(nets) + "|")
    for mode in modes:
        cells = []
        for net in nets:
            m = runs[net]["modes"].get(mode)
            if m is None:
                cells.append("-")
            elif m.get("status") != "ok":
                cells.append("n/a")
            else:
                f = mode_figures(net, runs[net], mode, batch)
                ratio = f" ({f['ratio']:.2f}x)" if f["ratio"] is not None else ""
                cells.append(f"{f['samples_s']:.1f}{ratio}")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print("\ngoals:")
    for net in nets:
        r = runs[net]
        shaped = net != "loopback"
        for mode, goal in GOALS.get(net, {}).items():
            m = r["modes"].get(mode)
            if m is None:
                print(f"  {net} {mode}: >= {goal}x {baseline_of(mode)}: not run")
            elif m.get("status") != "ok":
                print(f"  {net} {mode}: >= {goal}x {baseline_of(mode)}: not available")
            else:
                f = mode_figures(net, r, mode, batch)
                ok = f["ratio"] is not None and f["ratio"] >= goal
                print(
                    f"  {net} {mode}: {fmt(f['ratio'], '.3f')}x {baseline_of(mode)} "
                    f"(goal >= {goal}x): {'met' if ok else 'NOT met'}"
                )
        cpus = [
            f"{mode} {max(m['cpu_ms_per_step']):.0f}"
            for mode, m in r["modes"].items()
            if m.get("status") == "ok" and m.get("cpu_ms_per_step")
        ]
        if cpus:
            print(
                f"  {net}: CPU ms per step (a rank's process, all threads; max over ranks): "
                + ", ".join(cpus)
            )
        if not shaped:
            continue
        for mode, m in r["modes"].items():
            if mode in DDP_MODES or mode.endswith(NO_SYNC) or m.get("status") != "ok":
                continue
            f = mode_figures(net, r, mode, batch)
            twin = r["modes"].get(baseline_of(mode) + NO_SYNC)
            if twin and twin.get("status") == "ok" and f["bound_s"]:
                # What a step must send: the analytic bytes where the counter saw only part
                # (an exchange left running past the timed steps, low precision's).
                bound_ms = max(f["bound_s"], f["analytic"] / r["link_Bps"]) * 1e3
                ratio = m["step_ms"] / max(twin["step_ms"], bound_ms)
                ok = ratio <= MAX_OVERLAP_RATIO
                print(
                    f"  {net} {mode}: step {m['step_ms']:.0f} ms / max(no-communication step "
                    f"{twin['step_ms']:.0f}, bound {bound_ms:.0f}) = {ratio:.2f} "
                    f"(goal <= {MAX_OVERLAP_RATIO}): {'met' if ok else 'NOT met'}"
                )
                cpu = max(m.get("cpu_ms_per_step") or [0])
                share = (os.cpu_count() or 1) / RANKS
                if cpu and share <= 1:
                    # With a core or less per rank, a step cannot take less than the CPU time
                    # its process spends (training thread and core thread together).
                    print(
                        f"  {net} {mode}: step / CPU ms per step on {share:g} core per rank "
                        f"{m['step_ms'] / cpu * share:.2f} (information: >= 1 when CPU-bound)"
                    )
            if f["bound_ratio"] is None:
                print(f"  {net} {mode}: comm time / bound: n/a (no exec_ns counter yet)")
            else:
                ok = f["bound_ratio"] <= MAX_BOUND_RATIO
                print(
                    f"  {net} {mode}: comm time / bound {f['bound_ratio']:.2f} "
                    f"(goal <= {MAX_BOUND_RATIO}): {'met' if ok else 'NOT met'}"
                )


def plot(runs: dict, batch: int, path: str) -> None:
    nets = [n for n in NETS if n in runs and "error" not in runs[n]]
    if not nets:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("no plot: matplotlib is missing (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    xs = range(len(nets))
    for i, mode in enumerate(MODES):
        ys = []
        for net in nets:
            m = runs[net]["modes"].get(mode)
            ok = m is not None and m.get("status") == "ok"
            ys.append(mode_figures(net, runs[net], mode, batch)["samples_s"] if ok else math.nan)
        if all(math.isnan(y) for y in ys):
            continue
        style = "--" if mode in DDP_MODES else "-"
        ax.plot(xs, ys, style, marker="os^vD<>ph*"[i % 10], label=mode)
    ax.set_xticks(list(xs))
    labels = {"loopback": "loopback (one host)", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
    ax.set_xticklabels([labels[n] for n in nets])
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylabel(f"samples/s (2 ranks x batch {batch})")
    ax.set_title(
        "MLP 25M params, 2 ranks, 1 thread each: throughput by algorithm and link\n"
        f"(bench/algorithms.py, {time.strftime('%Y-%m-%d')}; dashed: torch DDP, gloo)",
        fontsize=10,
    )
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


# ---- worker side ----------------------------------------------------------------------------


def core_stat(key: str) -> int | None:
    """A counter of the core (bhvd_stat), or None when the core does not have it (-1)."""
    from bagua_hvd.common._native import lib

    value = int(lib().bhvd_stat(key.encode()))
    return None if value < 0 else value


def wire_tx_bytes() -> int | None:
    """Bytes the host's interface transmitted so far (this network namespace's /proc/net/dev)."""
    iface = os.environ.get(WIRE_IFACE_ENV)
    if not iface:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                return int(rest.split()[8])  # receive: 8 fields, then transmit bytes
    return None


def vm_hwm_kib() -> int:
    """This process's peak resident set (every replica lives in it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


class Unavailable(Exception):
    pass


class Mode:
    """One mode's replica: ``step()`` -> (step, fwd, bwd, opt seconds, loss)."""

    def __init__(self, name: str, model, step, note: str = "") -> None:
        self.name, self.model, self.step, self.note = name, model, step, note
        self.begin = self.end = lambda: None
        self.hvd = True
        self.loss = math.nan
        self.cpu_s = 0.0  # CPU time of the process (all threads) in the timed steps


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        import bagua_hvd.torch as hvd

        torch.set_num_threads(1)
        self.torch, self.dist, self.hvd, self.args = torch, dist, hvd, args
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ[GLOO_ADDR_ENV]}:{os.environ[GLOO_PORT_ENV]}",
            rank=self.rank,
            world_size=self.size,
            timeout=GLOO_TIMEOUT,
        )
        gen = torch.Generator().manual_seed(1234 + self.rank)
        self.x = torch.randn(args.batch_size, IN_FEATURES, generator=gen)
        self.y = torch.randint(0, CLASSES, (args.batch_size,), generator=gen)
        self.modes: dict[str, Mode] = {}
        self.errors: dict[str, str] = {}
        self.tracer = None
        if args.timeline:
            import _timeline

            self.tracer = _timeline.Tracer()
            _timeline.install(self.tracer)
        self.ddp: dict[str, tuple] = {}

    def make_model(self):
        return make_model(self.torch)

    def all_ok(self, ok: bool) -> bool:
        t = self.torch.tensor([1.0 if ok else 0.0])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return t.item() == 1.0

    def barrier(self) -> None:
        self.hvd.barrier()
        self.dist.barrier()

    # -- modes --

    def build_ddp(self, mode: str) -> list[Mode]:
        torch = self.torch
        F = torch.nn.functional
        perf = time.perf_counter
        model = self.make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
        if mode == "ddp_adam":
            opt = torch.optim.Adam(ddp.parameters(), lr=ADAM_LR)
        else:
            opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = self.x, self.y
        out = []
        for no_sync in (False, True):

            def step(no_sync: bool = no_sync) -> tuple:
                t0 = perf()
                opt.zero_grad()
                with ddp.no_sync() if no_sync else _Null():
                    loss = F.cross_entropy(ddp(x), y)
                    t1 = perf()
                    loss.backward()
                t2 = perf()
                opt.step()
                t3 = perf()
                return t3 - t0, t1 - t0, t2 - t1, t3 - t2, loss

            m = Mode(mode + (NO_SYNC if no_sync else ""), model, step)
            m.hvd = False
            out.append(m)
        return out

    def algorithm(self, mode: str, model) -> tuple:
        """(optimizer, algorithm or None, note); ImportError/TypeError/... when unavailable."""
        torch = self.torch
        sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        if mode == "gradient_allreduce":
            try:
                from bagua_hvd.torch.algorithms import GradientAllReduce
            except ImportError:
                return sgd, None, "plain DistributedOptimizer: no bagua_hvd.torch.algorithms yet"
            return sgd, GradientAllReduce(), ""
        import bagua_hvd.torch.algorithms as A

        if mode == "bytegrad":
            return sgd, A.ByteGrad(), ""
        if mode == "qadam":
            qopt = A.QAdamOptimizer(model.parameters(), lr=ADAM_LR, warmup_steps=QADAM_WARMUP)
            return qopt, A.QAdamAlgorithm(qopt), ""
        if mode == "decentralized":
            return sgd, A.Decentralized(peer_selection_mode="shift_one"), ""
        if mode == "decentralized_all":
            return sgd, A.Decentralized(peer_selection_mode="all"), ""
        if mode == "decentralized_ring":
            return sgd, A.Decentralized(peer_selection_mode="ring"), ""
        if mode == "low_precision_decentralized":
            return sgd, A.LowPrecisionDecentralized(), ""
        if mode == "async":
            return sgd, A.AsyncModelAverage(sync_interval_ms=ASYNC_INTERVAL_MS), ""
        raise ValueError(f"unknown mode {mode}")

    def build_hvd(self, mode: str) -> Mode:
        """Builds the mode and runs its first step(s); raises Unavailable (on every rank alike)
        when a rank could not."""
        hvd, torch = self.hvd, self.torch
        F = torch.nn.functional
        perf = time.perf_counter
        model = self.make_model()
        # Names unique per mode: the replicas' gradients must never share a name in the core.
        named = [(f"{mode}.{k}", p) for k, p in model.named_parameters()]
        err = None
        try:
            opt, alg, note = self.algorithm(mode, model)
            kwargs = {} if alg is None else {"algorithm": alg}
            dopt = hvd.DistributedOptimizer(opt, named_parameters=named, **kwargs)
        except (ImportError, AttributeError, TypeError, NotImplementedError) as e:
            err = f"not available yet: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - one mode's failure must not end the run
            err = f"construction failed: {type(e).__name__}: {e}"
        if not self.all_ok(err is None):
            raise Unavailable(err or "not available on another rank")
        x, y = self.x, self.y
        mark = self.tracer.mark if self.tracer is not None else lambda what: None

        def step() -> tuple:
            t0 = perf()
            dopt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            t1 = perf()
            mark("forward ends")
            loss.backward()
            t2 = perf()
            mark("backward ends")
            dopt.step()
            t3 = perf()
            return t3 - t0, t1 - t0, t2 - t1, t3 - t2, loss

        m = Mode(mode, model, step, note)
        if mode == "async":
            m.begin = getattr(alg, "resume", lambda: None)
            m.end = getattr(alg, "abort", lambda: None)
        # First steps (QAdam: its whole full-precision warm-up), so a step that fails on some
        # rank drops the mode here rather than in a timed block. No broadcast: the replicas are
        # identical by construction (same seed), which the checksums below confirm.
        try:
            for _ in range(QADAM_WARMUP if mode == "qadam" else 1):
                step()
            err = None
        except Exception as e:  # noqa: BLE001 - any failure makes the mode unavailable
            err = f"first step failed: {type(e).__name__}: {e}"
        m.end()
        if not self.all_ok(err is None):
            raise Unavailable(err or "first step failed on another rank")
        return m

    def build(self, modes: list[str]) -> None:
        for mode in modes:
            if mode in DDP_MODES:
                for m in self.build_ddp(mode):
                    self.modes[m.name] = m
                continue
            try:
                self.modes[mode] = self.build_hvd(mode)
            except Unavailable as e:
                self.errors[mode] = str(e)
                if self.rank == 0:
                    print(f"mode {mode}: {e}", flush=True)

    # -- timing --

    def async_steps(self, n: int) -> tuple[int, int]:
        """(extra warm-up steps, timed steps) of an async block: its averaging runs in the
        background, rounds at least ASYNC_INTERVAL_MS apart and each as long as an allreduce of
        the model takes on the link, so a block of a few steps could end (abort) before its
        first round did any work. The extra warm-up covers one round, the timed steps at least
        ASYNC_MIN_ROUNDS, estimated from a step's time (the warm-up's, max over ranks) and a
        round's period (the interval + an allreduce of the model at the link rate)."""
        t = [self.modes["async"].step()[0] for _ in range(max(1, self.args.warmup))]
        est = self.torch.tensor([statistics.median(t)], dtype=self.torch.float64)
        self.dist.all_reduce(est, op=self.dist.ReduceOp.MAX)
        rate = float(os.environ.get(LINK_ENV, "0")) or math.inf
        n_params = sum(model_param_sizes())
        ring = 2 * (self.size - 1) / self.size
        round_s = ASYNC_INTERVAL_MS / 1e3 + ring * 4 * n_params / rate
        per_round = math.ceil(round_s / est.item())
        return per_round, max(n, ASYNC_MIN_ROUNDS * per_round)

    def block(self, m: Mode, n: int, rows: list, counters: list) -> None:
        """Warm-up then n timed steps of one mode; appends per-step rows and the counters'
        deltas (exec_ns, bytes_sent, wire tx bytes) of the timed steps."""
        m.begin()
        self.barrier()
        if m.name == "async":
            extra, n = self.async_steps(n)
            for _ in range(extra):
                m.step()
        else:
            for _ in range(self.args.warmup):
                m.step()
        self.barrier()
        before = (core_stat("exec_ns"), core_stat("bytes_sent"), wire_tx_bytes())
        cpu0 = time.process_time()
        for _ in range(n):
            *times, loss = m.step()
            rows.append(times)
            m.loss = loss.item()
        after = (core_stat("exec_ns"), core_stat("bytes_sent"), wire_tx_bytes())
        m.cpu_s += time.process_time() - cpu0
        m.end()
        counters.append([None if a is None or b is None else a - b for a, b in zip(after, before)])

    def slowest(self, rows: list) -> list:
        t = self.torch.tensor(rows, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, values: list, keep_nan: bool = False) -> list[list]:
        """Every rank's list of numbers (None kept as None, unless keep_nan: NaN as NaN)."""
        t = self.torch.tensor([math.nan if v is None else float(v) for v in values])
        out = [self.torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(out, t)
        if keep_nan:
            return [o.tolist() for o in out]
        return [[None if math.isnan(v) else v for v in o.tolist()] for o in out]

    def checksum(self, model) -> list[float]:
        flat = self.torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        return [flat.sum().item(), (flat * flat).sum().item()]

    def run(self) -> dict:
        args = self.args
        order = list(self.modes)
        rows: dict[str, list] = {k: [] for k in order}
        counters: dict[str, list] = {k: [] for k in order}
        blocks = 2 * args.rounds
        for b in range(blocks):
            n = args.steps * (b + 1) // blocks - args.steps * b // blocks
            for name in order if b % 2 == 0 else reversed(order):
                self.block(self.modes[name], n, rows[name], counters[name])
        timeline = self.timeline() if self.tracer is not None else {}
        result_modes: dict[str, dict] = {}
        for name in self.arg_modes_with_twins():
            if name in self.errors:
                result_modes[name] = {"status": "unavailable", "error": self.errors[name]}
                continue
            m = self.modes[name]
            slow = self.slowest(rows[name])
            cols = list(zip(*slow))
            steps = len(slow)
            totals = [
                None if any(c[i] is None for c in counters[name]) else
                sum(c[i] for c in counters[name]) / steps
                for i in range(3)
            ]  # fmt: skip
            per_rank = self.gather(totals)
            sums = self.gather(self.checksum(m.model))
            losses = self.gather([m.loss], keep_nan=True)
            cpu = self.gather([m.cpu_s / steps * 1e3])
            result_modes[name] = {
                "status": "ok",
                "note": m.note,
                "steps": steps,
                "step_ms": statistics.median(cols[0]) * 1e3,
                "fwd_ms": statistics.median(cols[1]) * 1e3,
                "bwd_ms": statistics.median(cols[2]) * 1e3,
                "opt_ms": statistics.median(cols[3]) * 1e3,
                "exec_ns_per_step": [r[0] for r in per_rank],
                "bytes_sent_per_step": [r[1] for r in per_rank],
                "wire_bytes_per_step": [r[2] for r in per_rank],
                "cpu_ms_per_step": [c[0] for c in cpu],
                # A DDP replica also runs its no_sync twin's steps: never equal, not shown.
                "replicas_equal": None
                if name.split(":")[0] in DDP_MODES
                else all(s == sums[0] for s in sums),
                "loss": max((v[0] for v in losses), key=lambda v: (not math.isnan(v), v)),
            }
        return {
            "rank": self.rank,
            "size": self.size,
            "params": sum(model_param_sizes()),
            "modes": result_modes,
            "timeline": timeline,
            "peak_rss_mib": [r[0] / 1024 for r in self.gather([vm_hwm_kib()])],
        }

    def timeline(self) -> dict:
        """--timeline N: per bagua_hvd mode, one warm-up step then N traced steps (no barrier
        between them: an exchange left in flight by a step shows in the next); every rank's
        events, gathered: {mode: [per rank: [per step: {"t0": ns, "events": [...]}]]}."""
        tr = self.tracer
        out: dict[str, list] = {}
        for name, m in self.modes.items():
            if not m.hvd:
                continue
            m.begin()
            self.barrier()
            m.step()
            steps = []
            for _ in range(self.args.timeline):
                tr.begin_step()
                m.step()
                events = tr.end_step()
                steps.append({"t0": tr.t0, "events": events, "cpu_ms": tr.cpu_ns / 1e6})
            m.end()
            gathered: list = [None] * self.size
            self.dist.all_gather_object(gathered, steps)
            out[name] = gathered
        return out

    def arg_modes_with_twins(self) -> list[str]:
        out = []
        for mode in self.args._modes.split(","):
            out.append(mode)
            if mode in DDP_MODES:
                out.append(mode + NO_SYNC)
        return out

    def close(self) -> None:
        self.dist.destroy_process_group()
        self.hvd.shutdown()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def worker(args: argparse.Namespace) -> int:
    w = Worker(args)
    w.build(args._modes.split(","))
    result = w.run()
    path = os.environ.get(RESULT_ENV)
    if path is not None and w.rank == 0:
        with open(os.path.join(path, f"rank{w.rank:05d}.json"), "w") as f:
            json.dump(result, f)
    elif path is None and w.rank == 0:
        print(json.dumps(result))
    w.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker:
        return worker(args)
    return main_launcher(args)


if __name__ == "__main__":
    sys.exit(main())
