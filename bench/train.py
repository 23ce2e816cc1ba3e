"""Training throughput: bagua_hvd DistributedOptimizer beside torch DistributedDataParallel (gloo).

    python bench/train.py                 # 2 ranks: bagua_hvd vs DDP, same invocation
    python bench/train.py --repeat 3      # three runs, per-run figures and their medians
    python bench/train.py --np 1          # 1 rank: DistributedOptimizer vs the plain optimizer
    python bench/train.py --timeline      # also bagua_hvd with Horovod's timeline recording:
                                          # the cost of tracing (goal < 5 %)
    python bench/train.py --framework tf  # TensorFlow: bagua_hvd vs MultiWorkerMirroredStrategy
                                          # (bench/_tf_train.py describes that mode)
    python bench/train.py --framework tf --algorithms bytegrad,low_precision_decentralized
                                          # BAGUA's algorithms, TF frontend vs torch frontend
                                          # (bench/_tf_algorithms.py)

The model is the peers' reference (/work/shared/reference/peers-on-this-machine.md, section 4):
an MLP 1024 -> 2048 x6 -> 1000 with ReLU (25.13M float32 parameters, 100.5 MB of gradients),
a fixed random batch of 32 samples per rank, SGD with momentum, cross-entropy, 1 torch thread
per rank.

Throughput: the script launches itself through bagua-run; every rank initializes bagua_hvd and
a gloo process group, builds one replica per mode and runs the modes one after the other in
the same processes, in blocks of A-B-C-C-B-A order (--rounds times; each block: warm-up
steps, then timed steps), so that slow drifts of the machine hit every mode alike:
  bagua_hvd  hvd.DistributedOptimizer(SGD)  (step = synchronize() + the update)
  ddp        DistributedDataParallel(gloo, bucket_cap_mb=25) + SGD
  no-comm    the DDP replica under ddp.no_sync(): the same step without communication
At --np 1 the modes are the plain SGD optimizer and DistributedOptimizer wrapping it.
--timeline adds, after bagua_hvd, the mode
  bagua_hvd+timeline  the same step on its own replica, with HOROVOD_TIMELINE=DYNAMIC and
                      hvd.start_timeline() before each of its blocks, hvd.stop_timeline() after

Memory: the peak resident set (VmHWM of /proc/self/status) of each mode is measured in a fresh
set of processes per mode (one more launcher invocation each), which build only what that mode
needs (bagua_hvd: hvd.init() and DistributedOptimizer; ddp: a gloo group and DDP) and run the
same warm-up and timed steps.

Allocator: by default (--malloc steady) the throughput run sets MALLOC_MMAP_THRESHOLD_=32 MiB
and a huge MALLOC_TRIM_THRESHOLD_, so that glibc reuses freed memory instead of returning it to
the system. With glibc's defaults, whether a step's ~100 MB of fresh gradients and activations
come from mmap (page faults: +40 ms per step here) depends on what the process allocated before,
which would bill one mode for another's set-up (measured at 1 rank: a plain SGD replica trained
about 30 % slower after Horovod's optimizer-state initialization than its twin without it).
--malloc default measures glibc's behaviour as is.

Figures: step time = the slowest rank's time of a step; per mode the median over the timed
steps; samples/s = size * batch / median step. Communication share: bagua_hvd, the median time
blocked in synchronize() over the median step; ddp, 1 - t(no-comm) / t(ddp) (DDP's allreduces
run inside backward); both also against no-comm.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import free_port, read_status_kib, run_ranks  # noqa: E402

PORT_ENV = "BAGUA_HVD_BENCH_GLOO_PORT"
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"  # a directory: each rank writes its JSON there
WORKER_FLAG = "--_worker"
TUNING_ENV = (
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_FUSION_THRESHOLD",
    "BAGUA_HVD_TRANSPORT",
    "BAGUA_HVD_BUCKET_MB",
    "BAGUA_HVD_SPIN_US",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
)
# --malloc steady: glibc keeps freed memory for reuse (no mmap below its 32 MiB maximum, no
# trimming), so a step does not pay page faults for its ~100 MB of fresh gradients depending on
# what the process allocated before (docs/benchmarks.md).
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
GLOO_TIMEOUT = datetime.timedelta(seconds=300)
# The model (peers' section 4) and its training setup.
IN_FEATURES, HIDDEN, HIDDEN_LAYERS, CLASSES = 1024, 2048, 6, 1000
LR, MOMENTUM = 0.01, 0.9
DDP_BUCKET_MB = 25
# Goals of the issue (docs/benchmarks.md).
MIN_SPEEDUP = 1.3  # bagua_hvd samples/s over DDP's, 2 ranks
MAX_OVERHEAD = 0.03  # DistributedOptimizer at 1 rank over the plain optimizer
MAX_TIMELINE_COST = 0.05  # bagua_hvd with the timeline recording over bagua_hvd (issue 15)

MODES_MULTI = ("bagua_hvd", "ddp", "no-comm")
MODES_SINGLE = ("plain", "bagua_hvd")
TIMELINE_MODE = "bagua_hvd+timeline"


def throughput_modes(np_: int, timeline: bool) -> tuple[str, ...]:
    modes = MODES_MULTI if np_ > 1 else MODES_SINGLE
    if timeline:
        i = modes.index("bagua_hvd") + 1
        modes = modes[:i] + (TIMELINE_MODE,) + modes[i:]
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Training benchmark: bagua_hvd DistributedOptimizer vs torch DDP (gloo)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--framework",
        choices=("torch", "tf"),
        default="torch",
        help="torch: DistributedOptimizer vs DDP(gloo); tf: bagua_hvd.tensorflow's "
        "DistributedGradientTape vs tf.distribute.MultiWorkerMirroredStrategy "
        "(bench/_tf_train.py; no memory runs)",
    )
    parser.add_argument("--np", type=int, default=2, help="number of ranks on this host")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument(
        "--warmup", type=int, default=3, help="warm-up steps at the start of every block"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per mode, split evenly over the blocks (default 20; 40 at --np 1)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="A-B-B-A rounds: each mode runs 2 x ROUNDS blocks (default 1; 2 at --np 1, "
        "where the goal is a 3 %% difference)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="independent runs (invocations)")
    parser.add_argument(
        "--malloc",
        choices=("steady", "default"),
        default="steady",
        help="glibc malloc settings of the throughput run: 'steady' sets "
        + " ".join(f"{k}={v}" for k, v in STEADY_MALLOC.items())
        + " (unless set already); 'default' leaves glibc's. Memory runs always use the "
        "environment as given",
    )
    parser.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the per-mode peak-memory invocations",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before one invocation is killed"
    )
    parser.add_argument("--json", metavar="FILE", help="also write all results to FILE (JSON)")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also run bagua_hvd with Horovod's timeline recording (HOROVOD_TIMELINE=DYNAMIC, "
        "hvd.start_timeline/stop_timeline around each block) and report its cost",
    )
    parser.add_argument(
        "--algorithms",
        metavar="NAMES",
        help="with --framework tf: BAGUA's algorithms (comma-separated bagua-run names, e.g. "
        "bytegrad,low_precision_decentralized) in the TensorFlow and the torch frontend on "
        "the same model, and the TF/torch ratio of their communication part "
        "(bench/_tf_algorithms.py)",
    )
    from _tf_train import add_args as add_tf_args

    add_tf_args(parser)
    parser.add_argument(WORKER_FLAG, choices=("throughput", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--_mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.np < 1:
        parser.error(f"--np must be >= 1, got {args.np}")
    if args.steps is None:
        args.steps = 20 if args.np > 1 else 40
    if args.rounds is None:
        args.rounds = 1 if args.np > 1 else 2
    for name in ("batch_size", "steps", "repeat", "rounds", "reduce_reps", "tf_inter_threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


# ---- launcher side --------------------------------------------------------------------------


def launch(args: argparse.Namespace, worker_args: list[str], steady: bool = False) -> list[dict]:
    """Runs this script as --np ranks through bagua-run; returns every rank's JSON result."""
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_train_") as tmp:
        env = dict(os.environ)
        if steady:
            for key, value in STEADY_MALLOC.items():
                env.setdefault(key, value)
        env[PORT_ENV] = str(free_port())
        env[RESULT_ENV] = tmp
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), *worker_args]
        cmd += [
            "--np", str(args.np), "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--rounds", str(args.rounds),
        ]  # fmt: skip
        if args.timeline and "throughput" in worker_args:
            env["HOROVOD_TIMELINE"] = "DYNAMIC"  # as Horovod: start_timeline needs it at init
            cmd.append("--timeline")
        rc = run_ranks(args.np, cmd, env, args.timeout)
        if rc is None:
            raise RuntimeError(f"no result after --timeout {args.timeout:g} s")
        if rc != 0:
            raise RuntimeError(f"the ranks failed (launcher exit status {rc})")
        results = []
        for path in sorted(glob.glob(os.path.join(tmp, "rank*.json"))):
            with open(path) as f:
                results.append(json.load(f))
    if len(results) != args.np:
        raise RuntimeError(f"expected {args.np} rank results, got {len(results)}")
    return sorted(results, key=lambda r: r["rank"])


def one_run(args: argparse.Namespace) -> dict:
    """One throughput invocation and, unless --no-memory, one invocation per mode for memory."""
    throughput = launch(args, [WORKER_FLAG, "throughput"], steady=args.malloc == "steady")[0]
    memory = {}
    if not args.no_memory:
        for mode in MODES_MULTI[:2] if args.np > 1 else MODES_SINGLE:
            ranks = launch(args, [WORKER_FLAG, "memory", "--_mode", mode])
            memory[mode] = {
                "peak_mib": max(r["vm_hwm_kib"] for r in ranks) / 1024,
                "base_mib": max(r["base_rss_kib"] for r in ranks) / 1024,
                "setup_mib": max(r["setup_hwm_kib"] for r in ranks) / 1024,
                "anon_mib": max(r["rss_anon_kib"] for r in ranks) / 1024,
                "shmem_mib": max(r["rss_shmem_kib"] for r in ranks) / 1024,
                "per_rank_peak_mib": [r["vm_hwm_kib"] / 1024 for r in ranks],
                "step_ms": max(r["median_step_s"] for r in ranks) * 1e3,
                "faults": max(r["median_faults"] for r in ranks),
                "marks": ranks[0]["marks"],  # rank 0's (after what, VmHWM, VmRSS) KiB
            }
    return {"throughput": throughput, "memory": memory}


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main_launcher(args: argparse.Namespace) -> int:
    runs = []
    for i in range(args.repeat):
        load = loadavg()
        print(f"train bench: run {i + 1}/{args.repeat} (load average {load})", flush=True)
        try:
            run = one_run(args)
        except RuntimeError as exc:
            print(f"train bench: {exc}", file=sys.stderr)
            return 1
        run["load_before"] = load
        runs.append(run)
    import torch

    meta = {
        "np": args.np,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k in TUNING_ENV},
        "malloc": args.malloc,
        "timeline": args.timeline,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print_report(meta, runs)
    return 0


# ---- report ---------------------------------------------------------------------------------


def fmt_runs(values: list[float], fmt: str) -> str:
    """The single value, or 'a / b / c **median**' (runs, then their median in bold)."""
    text = " / ".join(format(v, fmt) for v in values)
    if len(values) > 1:
        text += f" **{format(statistics.median(values), fmt)}**"
    return text


def print_report(meta: dict, runs: list[dict]) -> None:
    np_, batch = meta["np"], meta["batch_size"]
    modes = throughput_modes(np_, meta["timeline"])
    print(
        f"\nMLP {IN_FEATURES}->{HIDDEN}x{HIDDEN_LAYERS}->{CLASSES} "
        f"({runs[0]['throughput']['params'] / 1e6:.2f}M params), batch {batch}/rank, "
        f"{np_} rank(s) on one host, 1 torch thread per rank, torch {meta['torch']}, "
        f"bagua_hvd {meta['commit']}; per mode {meta['steps']} timed steps over "
        f"{2 * meta['rounds']} blocks in A-B-B-A order, {meta['warmup']} warm-up steps per block; "
        f"step = slowest rank; medians over steps"
    )
    print(f"environment: {' '.join(f'{k}={v}' for k, v in meta['env'].items()) or 'defaults'}")
    if meta["malloc"] == "steady":
        steady = " ".join(f"{k}={v}" for k, v in STEADY_MALLOC.items() if k not in meta["env"])
        print(f"throughput run (--malloc steady): {steady or 'as above'}; memory runs: as above")
    print(f"load average before each run: {', '.join(r['load_before'] for r in runs)}\n")
    med = statistics.median
    header = (
        "| mode | step ms | fwd ms | bwd ms | step() ms | comm wait ms | samples/s | "
        "comm share % | vs no-comm % | page faults/step | peak RSS MiB |"
    )
    print(header)
    print("|---" + "|---:" * 10 + "|")
    summary: dict[str, dict[str, float]] = {}
    for mode in modes:
        per = [r["throughput"]["modes"][mode] for r in runs]
        steps = [p["step_ms"] for p in per]
        sps = [np_ * batch / (s / 1e3) for s in steps]
        cells = [
            fmt_runs(steps, ".1f"),
            fmt_runs([p["fwd_ms"] for p in per], ".1f"),
            fmt_runs([p["bwd_ms"] for p in per], ".1f"),
            fmt_runs([p["opt_ms"] for p in per], ".1f"),
        ]
        summary[mode] = {"step_ms": med(steps), "samples_s": med(sps)}
        if mode.startswith("bagua_hvd") and np_ > 1:
            waits = [p["sync_ms"] for p in per]
            cells.append(fmt_runs(waits, ".1f"))
        elif mode == "ddp":
            nocomm = [r["throughput"]["modes"]["no-comm"]["step_ms"] for r in runs]
            cells.append(fmt_runs([s - n for s, n in zip(steps, nocomm)], ".1f"))
        else:
            cells.append("-")
        cells.append(fmt_runs(sps, ".1f"))
        if mode.startswith("bagua_hvd") and np_ > 1:
            cells.append(fmt_runs([100 * p["sync_ms"] / s for p, s in zip(per, steps)], ".1f"))
        elif mode == "ddp":
            cells.append(fmt_runs([100 * (1 - n / s) for s, n in zip(steps, nocomm)], ".1f"))
        else:
            cells.append("-")
        if np_ > 1 and mode != "no-comm":
            nocomm = [r["throughput"]["modes"]["no-comm"]["step_ms"] for r in runs]
            cells.append(fmt_runs([100 * (1 - n / s) for s, n in zip(steps, nocomm)], ".1f"))
        else:
            cells.append("-")
        cells.append(fmt_runs([p["faults"] for p in per], ".0f"))
        mems = [r["memory"][mode]["peak_mib"] for r in runs if mode in r.get("memory", {})]
        if mems:
            summary[mode]["peak_mib"] = med(mems)
        cells.append(fmt_runs(mems, ".0f") if mems else "-")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print()
    for r_i, r in enumerate(runs):
        t = r["throughput"]
        print(
            f"run {r_i + 1}: replicas identical after training: "
            f"{'yes' if t['replicas_identical'] else 'NO'}; final losses "
            + ", ".join(f"{m} {v:.4g}" for m, v in t["final_loss"].items())
        )
    if any(r["memory"] for r in runs):
        print("memory (max over ranks, median of runs), MiB:")
        for m in runs[0]["memory"]:
            got = {
                k: med([r["memory"][m][k] for r in runs if m in r["memory"]])
                for k in ("base_mib", "setup_mib", "peak_mib", "anon_mib", "shmem_mib")
            }
            fresh = [(r["memory"][m]["step_ms"], r["memory"][m]["faults"]) for r in runs]
            print(
                f"  {m}: step in its own processes "
                + " / ".join(f"{s:.1f} ms ({f:.0f} faults)" for s, f in fresh)
            )
            print(
                f"  {m}: after imports and init {got['base_mib']:.0f}, peak by the end of setup "
                f"(model, optimizer, broadcasts) {got['setup_mib']:.0f}, peak {got['peak_mib']:.0f}"
                f"; at the end anonymous {got['anon_mib']:.0f}, shared memory "
                f"{got['shmem_mib']:.0f}"
            )
            marks = runs[-1]["memory"][m]["marks"]
            if marks:
                print(
                    "    setup on rank 0, last run (peak / resident after each): "
                    + ", ".join(f"{w} {h / 1024:.0f}/{r / 1024:.0f}" for w, h, r in marks)
                )
    print()
    if meta["timeline"]:
        costs = [
            r["throughput"]["modes"][TIMELINE_MODE]["step_ms"]
            / r["throughput"]["modes"]["bagua_hvd"]["step_ms"]
            - 1
            for r in runs
        ]
        events = [r["throughput"]["timeline_events"] for r in runs]
        cost = med(costs)
        print(
            f"timeline cost, step {TIMELINE_MODE} / bagua_hvd - 1: "
            f"{fmt_runs([100 * c for c in costs], '+.1f')} % (runs, median); "
            f"goal < {100 * MAX_TIMELINE_COST:.0f} %: "
            f"{'met' if cost < MAX_TIMELINE_COST else 'NOT met'}; rank 0 wrote "
            + ", ".join(f"{e} events" for e in events)
            + " (per run, every block's file)"
        )
    if np_ > 1:
        ratios = [
            r["throughput"]["modes"]["ddp"]["step_ms"]
            / r["throughput"]["modes"]["bagua_hvd"]["step_ms"]
            for r in runs
        ]
        ratio = med(ratios)
        print(
            f"samples/s bagua_hvd / ddp: {fmt_runs(ratios, '.2f')} (runs, median); "
            f"goal >= {MIN_SPEEDUP}x: {'met' if ratio >= MIN_SPEEDUP else 'NOT met'}"
        )
        if "peak_mib" in summary["bagua_hvd"] and "peak_mib" in summary["ddp"]:
            h, d = summary["bagua_hvd"]["peak_mib"], summary["ddp"]["peak_mib"]
            print(
                f"peak RSS bagua_hvd {h:.0f} MiB vs ddp {d:.0f} MiB (max over ranks, median of "
                f"runs); goal <= ddp: {'met' if h <= d else 'NOT met'}"
            )
    else:
        overheads = [
            r["throughput"]["modes"]["bagua_hvd"]["step_ms"]
            / r["throughput"]["modes"]["plain"]["step_ms"]
            - 1
            for r in runs
        ]
        over = med(overheads)
        print(
            f"1-rank overhead of DistributedOptimizer over the plain optimizer: "
            f"{fmt_runs([100 * o for o in overheads], '+.1f')} % (runs, median); "
            f"goal < {100 * MAX_OVERHEAD:.0f} %: {'met' if over < MAX_OVERHEAD else 'NOT met'}"
        )
        clean = [
            r["throughput"]["modes"]["bagua_hvd"]["step_ms_nofault"]
            / r["throughput"]["modes"]["plain"]["step_ms_nofault"]
            - 1
            for r in runs
            if r["throughput"]["modes"]["bagua_hvd"].get("step_ms_nofault")
            and r["throughput"]["modes"]["plain"].get("step_ms_nofault")
        ]
        if clean:
            print(
                "  over the steps without page faults only (the allocator's share removed): "
                f"{fmt_runs([100 * o for o in clean], '+.1f')} % (runs with >= 5 such steps "
                "per mode)"
            )
        if "peak_mib" in summary["bagua_hvd"] and "peak_mib" in summary["plain"]:
            print(
                f"peak RSS bagua_hvd {summary['bagua_hvd']['peak_mib']:.0f} MiB vs plain "
                f"{summary['plain']['peak_mib']:.0f} MiB"
            )


# ---- worker side ----------------------------------------------------------------------------


def make_model(torch):
    """The benchmark's MLP, the same initial weights in every mode and on every rank."""
    nn = torch.nn
    torch.manual_seed(0)
    dims = [IN_FEATURES] + [HIDDEN] * HIDDEN_LAYERS
    layers: list = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(dims[-1], CLASSES))


def minor_faults() -> int:
    """This process's minor page faults so far: a step that faults its fresh gradients in anew
    (glibc returned them to the system) shows thousands."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Worker:
    """One rank. Builds what its modes need, runs timed blocks, writes its JSON result."""

    def __init__(self, args: argparse.Namespace, modes: tuple[str, ...]) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch, self.args = torch, args
        self.rank = int(os.environ.get("HOROVOD_RANK", "0"))
        self.size = int(os.environ.get("HOROVOD_SIZE", "1"))
        self.hvd = self.dist = None
        if any(m.startswith("bagua_hvd") for m in modes):
            import bagua_hvd.torch as hvd

            hvd.init()
            self.hvd = hvd
            self.rank, self.size = hvd.rank(), hvd.size()
        if {"ddp", "no-comm"} & set(modes) or (self.size > 1 and args._worker == "throughput"):
            import torch.distributed as dist

            port = os.environ.get(PORT_ENV)
            if port is None:
                raise RuntimeError(f"{PORT_ENV} is not set: run bench/train.py, it launches itself")
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=self.rank,
                world_size=self.size,
                timeout=GLOO_TIMEOUT,
            )
            self.dist = dist
        self.base_rss_kib = read_status_kib("VmRSS")
        self.marks: list[tuple[str, int, int]] = []  # (after what, VmHWM, VmRSS) in KiB
        gen = torch.Generator().manual_seed(1234 + self.rank)
        self.x = torch.randn(args.batch_size, IN_FEATURES, generator=gen)
        self.y = torch.randint(0, CLASSES, (args.batch_size,), generator=gen)
        self.steps: dict[str, object] = {}  # mode -> step function
        self.timeline_files: list[str] = []
        self.models: dict[str, object] = {}
        for mode in modes:
            self.build(mode)
        self.setup_hwm_kib = read_status_kib("VmHWM")

    def mark(self, what: str) -> None:
        self.marks.append((what, read_status_kib("VmHWM"), read_status_kib("VmRSS")))

    def make_model(self):
        return make_model(self.torch)

    def build(self, mode: str) -> None:
        torch = self.torch
        F = torch.nn.functional
        perf = time.perf_counter
        model = self.make_model()
        self.mark("model")
        x, y = self.x, self.y
        if mode in ("bagua_hvd", TIMELINE_MODE):
            hvd = self.hvd
            # The first optimizer of a process costs ~70 MiB of torch's own lazy imports: marked
            # apart so that it is not billed to DistributedOptimizer.
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            self.mark("SGD")
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            self.mark("DistributedOptimizer")
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            self.mark("broadcast_parameters")
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            self.mark("broadcast_optimizer_state")

            def step() -> tuple:
                t0 = perf()
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                t1 = perf()
                loss.backward()
                t2 = perf()
                opt.synchronize()  # what step() would do first: wait for the allreduces
                t3 = perf()
                with opt.skip_synchronize():
                    opt.step()
                t4 = perf()
                return t4 - t0, t1 - t0, t2 - t1, t4 - t2, t3 - t2, loss

            self.models[mode] = model
        elif mode in ("ddp", "no-comm"):
            if "ddp" not in self.models:
                ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
                self.mark("DistributedDataParallel")
                self.models["ddp"] = ddp
                self.ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
            ddp, opt = self.models["ddp"], self.ddp_opt
            no_sync = mode == "no-comm"

            def step() -> tuple:
                t0 = perf()
                opt.zero_grad()
                ctx = ddp.no_sync() if no_sync else _null()
                with ctx:
                    loss = F.cross_entropy(ddp(x), y)
                    t1 = perf()
                    loss.backward()
                t2 = perf()
                opt.step()
                t3 = perf()
                return t3 - t0, t1 - t0, t2 - t1, t3 - t2, 0.0, loss

        elif mode == "plain":
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            self.mark("SGD")

            def step() -> tuple:
                t0 = perf()
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                t1 = perf()
                loss.backward()
                t2 = perf()
                opt.step()
                t3 = perf()
                return t3 - t0, t1 - t0, t2 - t1, t3 - t2, 0.0, loss

            self.models[mode] = model
        else:
            raise ValueError(f"unknown mode {mode}")
        self.steps[mode] = step

    def barrier(self) -> None:
        if self.hvd is not None:
            self.hvd.barrier()
        if self.dist is not None:
            self.dist.barrier()

    def block(self, mode: str, n: int, out: list, losses: dict) -> None:
        """Warm-up then n timed steps of one mode; appends (step, fwd, bwd, opt, sync, minor
        page faults) rows. The timeline mode records its warm-up and timed steps."""
        self.barrier()
        step = self.steps[mode]
        if mode == TIMELINE_MODE:
            self.timeline_files.append(
                os.path.join(os.environ[RESULT_ENV], f"timeline{len(self.timeline_files)}.json")
            )
            self.hvd.start_timeline(self.timeline_files[-1])
        for _ in range(self.args.warmup):
            step()
        self.barrier()
        for _ in range(n):
            faults = minor_faults()
            *times, loss = step()
            out.append([*times, minor_faults() - faults])
        if mode == TIMELINE_MODE:
            self.hvd.stop_timeline()  # the file is complete when this returns (rank 0)
        losses[mode] = loss.item()

    def timeline_events(self) -> int:
        """Events in rank 0's timeline files (each must be one valid JSON array); 0 elsewhere."""
        if self.rank != 0:
            return 0
        count = 0
        for path in self.timeline_files:
            with open(path) as f:
                count += len(json.load(f))
        return count

    def slowest(self, rows: list) -> list:
        """Per step and column, the maximum over ranks (gloo, outside the timed region)."""
        t = self.torch.tensor(rows, dtype=self.torch.float64)
        if self.dist is not None and self.size > 1:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def replicas_identical(self) -> bool:
        torch = self.torch
        model = self.models.get("bagua_hvd")
        if model is None or self.size == 1 or self.dist is None:
            return True
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref = flat.clone()
        self.dist.broadcast(ref, src=0)
        diff = torch.tensor([float((flat - ref).abs().max())], dtype=torch.float64)
        self.dist.all_reduce(diff, op=self.dist.ReduceOp.MAX)
        return diff.item() == 0.0

    def write(self, result: dict) -> None:
        path = os.environ.get(RESULT_ENV)
        if path is None:
            print(json.dumps(result))
            return
        with open(os.path.join(path, f"rank{self.rank:05d}.json"), "w") as f:
            json.dump(result, f)

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()
        if self.hvd is not None:
            self.hvd.shutdown()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def summarize(rows: list) -> dict:
    med = statistics.median
    cols = list(zip(*rows))
    return {
        "step_ms": med(cols[0]) * 1e3,
        "fwd_ms": med(cols[1]) * 1e3,
        "bwd_ms": med(cols[2]) * 1e3,
        "opt_ms": med(cols[3]) * 1e3,
        "sync_ms": med(cols[4]) * 1e3,
        "faults": med(cols[5]),
        # Steps that faulted no page in: the optimizer's own cost without the allocator's.
        "step_ms_nofault": (
            med([r[0] for r in rows if r[5] == 0]) * 1e3
            if sum(1 for r in rows if r[5] == 0) >= 5
            else None
        ),
        "steps": len(rows),
    }


def worker_throughput(args: argparse.Namespace) -> int:
    modes = throughput_modes(args.np, args.timeline)
    w = Worker(args, modes)
    rows: dict[str, list] = {m: [] for m in modes}
    losses: dict[str, float] = {}
    blocks = 2 * args.rounds
    for b in range(blocks):
        # A-B-C, C-B-A, A-B-C, ...: the timed steps of a mode are spread evenly over its blocks.
        n = args.steps * (b + 1) // blocks - args.steps * b // blocks
        for mode in modes if b % 2 == 0 else tuple(reversed(modes)):
            w.block(mode, n, rows[mode], losses)
    result = {
        "rank": w.rank,
        "size": w.size,
        "params": sum(p.numel() for p in w.make_model().parameters()),
        "modes": {m: summarize(w.slowest(r)) for m, r in rows.items()},
        "replicas_identical": w.replicas_identical(),
        "final_loss": losses,
        "timeline_events": w.timeline_events(),
    }
    w.write(result)
    w.close()
    return 0


def worker_memory(args: argparse.Namespace) -> int:
    """A fresh set of processes for one mode: warm-up and timed steps, then VmHWM."""
    mode = args._mode
    w = Worker(args, (mode,))
    rows: list = []
    w.block(mode, args.steps, rows, {})
    result = {
        "rank": w.rank,
        "mode": mode,
        "vm_hwm_kib": read_status_kib("VmHWM"),
        "base_rss_kib": w.base_rss_kib,
        "setup_hwm_kib": w.setup_hwm_kib,
        "marks": w.marks,
        "rss_anon_kib": read_status_kib("RssAnon"),
        "rss_shmem_kib": read_status_kib("RssShmem"),
        "median_step_s": statistics.median(r[0] for r in rows),
        "median_faults": statistics.median(r[5] for r in rows),
    }
    w.write(result)
    w.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker == "throughput":
        return worker_throughput(args)
    if args._worker == "memory":
        return worker_memory(args)
    if args.framework == "tf" and args.algorithms:
        from _tf_algorithms import main_launcher as algorithms_main_launcher

        return algorithms_main_launcher(args)
    if args.framework == "tf":
        from _tf_train import main_launcher as tf_main_launcher

        return tf_main_launcher(args)
    return main_launcher(args)


if __name__ == "__main__":
    sys.exit(main())
