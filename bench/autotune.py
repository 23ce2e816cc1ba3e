"""Horovod's autotuner and algorithm="auto" beside fixed settings (issue 40, "How it is shown").

    python bench/autotune.py              # loopback, then 2 hosts x 2 ranks at 1gbit (root)
    python bench/autotune.py --no-hosts   # loopback only (no root needed)
    python bench/autotune.py --quick      # a smoke run (loopback ~1 min, the 2 hosts ~3 min)
    python bench/autotune.py --rate 100mbit --steps 8

Model: a stack of LAYERS Linear(WIDTH, WIDTH) + ReLU (100 x 128 x 128: 200 parameter tensors,
1.65M float32 parameters, 6.6 MB of gradients), a fixed random batch of 32 samples per rank,
SGD, cross-entropy on WIDTH classes, 1 torch thread per rank. Many small tensors and little
compute: the regime where Horovod's fusion threshold and cycle time decide the step time.

Networks (each one job of bagua-run, every mode in the same processes):
  loopback  one host, 2 ranks (shared memory)
  hosts     2 hosts x 2 ranks, network namespaces on a bridge, each host's egress shaped by
            tc tbf to --rate (bench/_netns.py; its TCP goodput is measured first); there the
            hierarchical allreduce is tunable too
Every mode runs between an hvd.init() and an hvd.shutdown() of its own, with its variables set
in the ranks' environment just before hvd.init() (the core and the tuner read them there); the
modes are interleaved in blocks A-B-C then C-B-A (--rounds such pairs), each block: warm-up
steps, then its share of the timed steps.

Modes:
  default      no HOROVOD_* variable (the core's defaults: fusion 128 MB, cycle 1 ms, response
               cache on, flat allreduce)
  default2     the same again, its own blocks: the run-to-run noise of one configuration
  fF_cC[_hH]   HOROVOD_FUSION_THRESHOLD = F MB, HOROVOD_CYCLE_TIME = C ms (hosts: and
               HOROVOD_HIERARCHICAL_ALLREDUCE = H): the grid
  autotune     HOROVOD_AUTOTUNE=1 with HOROVOD_AUTOTUNE_LOG, _WARMUP_SAMPLES, _STEPS_PER_SAMPLE,
               _BAYES_OPT_MAX_SAMPLES small enough (--at-*) that tuning ends within the block.
               Each block tunes afresh: it trains until rank 0 sees the CSV's "best" row (the
               last row, whose score repeats the highest score before it; rank 0 reads the CSV
               after every step and broadcasts "done" every CHECK_EVERY steps), then runs its
               warm-up and timed steps: the steady state after tuning. A block whose tuning has
               not ended after --tune-steps steps is timed anyway and reported as not ended.
  tuned_fixed  the setting the autotune block just before chose, set by the variables (fusion, cycle,
               HOROVOD_CACHE_CAPACITY=0 if it turned the cache off, hierarchical): what the
               tuner leaves behind after it ended, beside the same setting fixed
  gradient_allreduce, bytegrad, auto
               DistributedOptimizer(algorithm=GradientAllReduce() / ByteGrad() / Auto()), BAGUA's
               bucket size (10 MiB); auto measures both in each of its blocks (its schedule: 2 +
               2 rounds x 2 x 4 steps, untimed) and is timed after its choice; the two alone
               run as many untimed steps first
The fusion/cycle modes run with BAGUA_HVD_BUCKET_MB=0: DistributedOptimizer enqueues one
allreduce per parameter as it is ready, as Horovod does, and the core fuses them (with
buckets, the frontend would fuse them itself and the fusion threshold would matter little).

Figures: a rank's step time is the time from the start of one step to the start of the next;
per step the slowest rank's; per mode the median over its timed steps; samples/s = ranks x
batch / median step.
Goals (issue 40):
  autotune / best grid point >= 0.95 (samples/s; the best of the grid by its own median, so
    the grid's maximum is biased upward by the noise of each point)
  autotune / default >= 1.0
  scores the tuner used (CSV rows before the best row) = HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES
    x the settings of the categorical tunables (cache on/off; hosts: x hierarchical off/on)
  auto chooses the faster of gradient_allreduce and bytegrad as they ran alone, and its steady
    state is within 3 % of the chosen one run alone
  autotune off costs nothing: it is the default path (one boolean per optimizer step in the
    torch frontend, one relaxed atomic load per cycle in the core); what is measured is
    default2 / default (the noise floor of this run) and autotune / tuned_fixed (after tuning,
    nothing is left running: both within the noise)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _netns  # noqa: E402
from _launch import run_ranks  # noqa: E402
from train import STEADY_MALLOC  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_FLAG = "--_worker"
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"  # a directory: each rank writes its JSON there
NS_PORT = 29700  # fresh namespaces: free
MB = 1 << 20
LAYERS, WIDTH = 100, 128
LR = 0.01
CHECK_EVERY = 5  # tuning: rank 0's "done" is broadcast every this many steps
# Every variable a mode may set; each is removed before the next mode's hvd.init().
MODE_VARS = (
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "BAGUA_HVD_BUCKET_MB",
)
ALGORITHMS = ("gradient_allreduce", "bytegrad", "auto")
MIN_VS_GRID, MIN_VS_DEFAULT, AUTO_TOLERANCE = 0.95, 1.0, 0.03


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: a 2 x 2 grid, few steps, a short tuning")  # fmt: skip
    p.add_argument("--no-hosts", action="store_true", help="loopback only")
    p.add_argument("--no-loopback", action="store_true", help="the 2 hosts only")
    p.add_argument("--rate", default="1gbit", help="tc rate of each host's egress")
    p.add_argument("--steps", type=int, help="timed steps per mode (default 30; hosts 12)")
    p.add_argument("--warmup", type=int, help="warm-up steps per block (default 3; hosts 2)")
    p.add_argument("--rounds", type=int, default=1, help="A-B-C C-B-A rounds")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--at-warmup", type=int, default=1,
                   help="HOROVOD_AUTOTUNE_WARMUP_SAMPLES")  # fmt: skip
    p.add_argument("--at-steps-per-sample", type=int,
                   help="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE (default 3; --quick 2)")  # fmt: skip
    p.add_argument("--at-max-samples", type=int,
                   help="HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES (default 8; --quick 4)")  # fmt: skip
    p.add_argument("--tune-steps", type=int,
                   help="the most steps an autotune block trains before its timed steps "
                   "(default: 3 x the steps the tuning needs + 50)")  # fmt: skip
    p.add_argument("--no-grid", action="store_true", help="default, autotune and tuned_fixed only")
    p.add_argument("--no-auto", action="store_true", help="no gradient_allreduce/bytegrad/auto")
    p.add_argument("--timeout", type=float,
                   help="seconds per network (default: 900 + 0.25 s per tuning step of every "
                   "autotune block, so that Horovod's full budget on 2 hosts fits)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument(WORKER_FLAG, choices=("loopback", "hosts"), help=argparse.SUPPRESS)
    p.add_argument("--_plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.at_steps_per_sample is None:
        args.at_steps_per_sample = 2 if args.quick else 3
    if args.at_max_samples is None:
        args.at_max_samples = 4 if args.quick else 8
    if args.no_hosts and args.no_loopback:
        p.error("--no-hosts and --no-loopback leave nothing to run")
    for name in ("steps", "rounds", "batch_size", "at_steps_per_sample", "at_max_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---- the plan: modes and their variables ---------------------------------------------------


def grid(net: str, quick: bool) -> list[tuple[int, int, int | None]]:
    """(fusion MB, cycle ms, hierarchical or None) of the grid's points."""
    if net == "loopback":
        fusions, cycles, hiers = ((0, 64), (1, 25), (None,)) if quick else (
            (0, 1, 4, 16, 64), (1, 5, 25), (None,))  # fmt: skip
    else:
        fusions, cycles, hiers = ((0, 64), (1, 25), (0, 1)) if quick else (
            (0, 4, 64), (1, 5, 25), (0, 1))  # fmt: skip
    return [(f, c, h) for h in hiers for f in fusions for c in cycles]


def grid_name(f: int, c: int, h: int | None) -> str:
    return f"f{f}_c{c}" + ("" if h is None else f"_h{h}")


def plan(args: argparse.Namespace, net: str) -> dict:
    """What the worker runs on one network: modes (name, kind, variables) in block order."""
    per_param = {"BAGUA_HVD_BUCKET_MB": "0"}
    modes = [("default", "fixed", per_param), ("default2", "fixed", per_param)]
    if not args.no_grid:
        for f, c, h in grid(net, args.quick):
            env = dict(per_param, HOROVOD_FUSION_THRESHOLD=str(f * MB), HOROVOD_CYCLE_TIME=str(c))
            if h is not None:
                env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = str(h)
            modes.append((grid_name(f, c, h), "fixed", env))
    modes.append(("autotune", "autotune", dict(per_param, HOROVOD_AUTOTUNE="1",
        HOROVOD_AUTOTUNE_WARMUP_SAMPLES=str(args.at_warmup),
        HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=str(args.at_steps_per_sample),
        HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES=str(args.at_max_samples))))  # fmt: skip
    modes.append(("tuned_fixed", "tuned_fixed", per_param))
    if not args.no_auto:
        modes += [(a, "algorithm", {}) for a in ALGORITHMS]
    combos = 2 * (2 if net == "hosts" else 1)  # cache on/off (x hierarchical off/on)
    scores = args.at_warmup + args.at_max_samples * combos
    # a score: 5 samples of steps_per_sample steps, +1 step for the pause before the next
    need = scores * (5 * args.at_steps_per_sample + 1)
    quick_steps, quick_warm = (6, 1) if args.quick else (None, None)
    default_steps, default_warm = (30, 3) if net == "loopback" else (12, 2)
    return {
        "modes": modes,
        "expected_scores": args.at_max_samples * combos,
        "combos": combos,
        "tune_steps": args.tune_steps or 3 * need + 50,
        "steps": args.steps or quick_steps or default_steps,
        "warmup": args.warmup if args.warmup is not None else quick_warm or default_warm,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "at_warmup": args.at_warmup,
        "at_max_samples": args.at_max_samples,
    }


# ---- launcher side --------------------------------------------------------------------------


def run_network(args: argparse.Namespace, net: str, the_plan: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_autotune_") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", **{RESULT_ENV: tmp})
        for key, value in STEADY_MALLOC.items():
            env.setdefault(key, value)
        for key in MODE_VARS:
            env.pop(key, None)
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(the_plan, f)
        worker = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, net, "--_plan",
                  plan_path]  # fmt: skip
        # A bound, not an estimate: 0.25 s is above the slowest tuning step measured (2 hosts
        # beside other jobs, 0.23 s); a tuning block never runs past its tune_steps.
        blocks = 2 * the_plan["rounds"]
        timeout = args.timeout or 900.0 + 0.25 * blocks * the_plan["tune_steps"]
        if net == "loopback":
            rc = run_ranks(2, worker, env, timeout)
            codes = None if rc is None else [rc]
        else:
            env["BAGUA_HVD_SECRET"] = secrets.token_hex(32)
            codes = _netns.run_job(worker, env, NS_PORT, timeout, cwd=ROOT)
        if codes is None:
            raise RuntimeError(f"no result after --timeout {timeout:g} s")
        if any(codes):
            raise RuntimeError(f"the ranks failed (launcher exit statuses {codes})")
        ranks = []
        for name in sorted(os.listdir(tmp)):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(tmp, name)) as f:
                    ranks.append(json.load(f))
    if not ranks:
        raise RuntimeError("the ranks wrote no result")
    return merge(ranks)


def merge(ranks: list[dict]) -> dict:
    """Per mode: per step the slowest rank's time, the median; rank 0's notes."""
    ranks.sort(key=lambda r: r["rank"])
    out = {"size": ranks[0]["size"], "modes": {}}
    for mode, m0 in ranks[0]["modes"].items():
        per_step = [max(r["modes"][mode]["step_s"][i] for r in ranks)
                    for i in range(len(m0["step_s"]))]  # fmt: skip
        start = 0
        for block in m0["blocks"]:  # each block's own median too
            part = per_step[start : start + block["timed"]]
            block["step_ms"] = statistics.median(part) * 1e3 if part else None
            start += block["timed"]
        out["modes"][mode] = {"step_ms": statistics.median(per_step) * 1e3,
                              "steps": len(per_step), "blocks": m0["blocks"],
                              "step_s": per_step}  # fmt: skip
    return out


def block_steps(mode: dict, blocks: set[int]) -> list[float]:
    """The mode's step times (the slowest rank's) in the given blocks (0-based)."""
    out, start = [], 0
    for i, block in enumerate(mode["blocks"]):
        if i in blocks:
            out += mode["step_s"][start : start + block["timed"]]
        start += block["timed"]
    return out


def held_out_best(modes: dict, grid_modes: list[str], rounds: int) -> list[tuple[str, float]]:
    """The best grid point without the winner's curse: per round, the point with the fastest
    median in that round's two blocks, then autotune / that point on the other rounds' blocks
    (samples/s). The best of 15 noisy medians, judged on the same steps, is biased upward by
    their noise; judged on other steps it is not."""
    out = []
    for r in range(rounds):
        pick, rest = {2 * r, 2 * r + 1}, set(range(2 * rounds)) - {2 * r, 2 * r + 1}
        top = min(grid_modes, key=lambda m: statistics.median(block_steps(modes[m], pick)))
        ratio = statistics.median(block_steps(modes[top], rest)) / statistics.median(
            block_steps(modes["autotune"], rest)
        )
        out.append((top, ratio))
    return out


def settings_text(name: str) -> str:
    if name.startswith("f") and "_c" in name:
        parts = dict((p[0], p[1:]) for p in name.split("_"))
        text = f"fusion {parts['f']} MB, cycle {parts['c']} ms"
        return text + (f", hierarchical {parts['h']}" if "h" in parts else "")
    return {"default": "no variables", "default2": "no variables (again)",
            "autotune": "HOROVOD_AUTOTUNE=1, timed after tuning",
            "tuned_fixed": "autotune's choice, set by variables",
            "gradient_allreduce": "GradientAllReduce, 10 MiB buckets",
            "bytegrad": "ByteGrad, 10 MiB buckets",
            "auto": "Auto([GradientAllReduce, ByteGrad]), timed after its choice"}[name]  # fmt: skip


def best_text(best: dict | None) -> str:
    if not best:
        return "-"
    return (f"fusion {best['fusion_mb']:g} MB, cycle {best['cycle_ms']:g} ms, "
            f"cache {best['cache']}, hierarchical {best['hierarchical']}")  # fmt: skip


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(net: str, result: dict, the_plan: dict) -> list[str]:
    size, batch = result["size"], the_plan["batch_size"]
    modes = result["modes"]
    sps = {m: size * batch / (v["step_ms"] / 1e3) for m, v in modes.items()}
    lines = ["| mode | settings | step ms (median) | samples/s | vs default |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for m, v in modes.items():
        lines.append(f"| {m} | {settings_text(m)} | {v['step_ms']:.1f} | {sps[m]:.0f} | "
                     f"{sps[m] / sps['default']:.2f} |")  # fmt: skip
    for i, b in enumerate(modes["autotune"]["blocks"]):
        ended = "ended" if b["ended"] else "NOT ended"
        lines.append(
            f"autotune block {i + 1}: tuning {ended} after {b['tune_steps']} steps "
            f"({b['tune_s']:.1f} s); {b['scores']} scores in the CSV (+ best row: "
            f"{'yes' if b['ended'] else 'no'}); chose {best_text(b['best'])}; then "
            f"{b['step_ms']:.1f} ms per step"
        )
    for i, b in enumerate(modes.get("tuned_fixed", {}).get("blocks", [])):
        lines.append(f"tuned_fixed block {i + 1}: {best_text(b['best'])}: {b['step_ms']:.1f} ms")
    lines.append("goals:")
    grid_modes = [m for m in modes if m.startswith("f") and "_c" in m]
    if grid_modes:
        top = max(grid_modes, key=lambda m: sps[m])
        r = sps["autotune"] / sps[top]
        lines.append(f"  autotune / best grid point ({top}) samples/s = {r:.2f} "
                     f"(goal >= {MIN_VS_GRID}): {met(r >= MIN_VS_GRID)}")  # fmt: skip
        rounds = the_plan["rounds"]
        if rounds >= 2 and all(len(modes[m]["blocks"]) == 2 * rounds for m in grid_modes):
            folds = held_out_best(modes, grid_modes, rounds)
            r = statistics.geometric_mean([ratio for _, ratio in folds])
            each = ", ".join(f"round {i + 1}: {top} {ratio:.2f}"
                             for i, (top, ratio) in enumerate(folds))  # fmt: skip
            lines.append(f"  autotune / best grid point, held out ({each}; picked on one "
                         f"round, timed on the others) = {r:.2f} (goal >= {MIN_VS_GRID}): "
                         f"{met(r >= MIN_VS_GRID)}")  # fmt: skip
    r = sps["autotune"] / sps["default"]
    lines.append(f"  autotune / default samples/s = {r:.2f} (goal >= {MIN_VS_DEFAULT}): "
                 f"{met(r >= MIN_VS_DEFAULT)}")  # fmt: skip
    expected = the_plan["expected_scores"]
    for i, b in enumerate(modes["autotune"]["blocks"]):
        lines.append(
            f"  block {i + 1}: scores used {b['scores']} (+ {the_plan['at_warmup']} warm-up, not "
            f"in the CSV) vs BAYES_OPT_MAX_SAMPLES x categorical settings = "
            f"{the_plan['at_max_samples']} x {the_plan['combos']} = {expected}: "
            f"{met(b['ended'] and b['scores'] == expected)}"
        )
    lines.append(f"  default2 / default samples/s = {sps['default2'] / sps['default']:.2f} "
                 "(the same configuration twice: the noise floor)")  # fmt: skip
    if "tuned_fixed" in sps:
        r = sps["autotune"] / sps["tuned_fixed"]
        lines.append(f"  autotune / tuned_fixed samples/s = {r:.2f} (after tuning ended, "
                     "beside its choice set by variables)")  # fmt: skip
    if "auto" in modes:
        lines += auto_report(modes, sps)
    return lines


def auto_report(modes: dict, sps: dict) -> list[str]:
    names = {"GradientAllReduce": "gradient_allreduce", "ByteGrad": "bytegrad"}
    lines = []
    chosen = []
    for i, b in enumerate(modes["auto"]["blocks"]):
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in (b["step_times"] or {}).items())
        lines.append(f"  auto block {i + 1}: chose {b['chosen']} (its measurement: {times})")
        chosen.append(names.get(b["chosen"], b["chosen"]))
    faster = max(("gradient_allreduce", "bytegrad"), key=lambda m: sps[m])
    picked = [c == faster for c in chosen]
    margin = sps[faster] / sps[_other(faster)]
    close = " (within 3 %: either choice is as good)" if margin - 1 <= AUTO_TOLERANCE else ""
    lines.append(f"  faster alone: {faster} ({margin:.2f}x the other{close}); auto chose it in "
                 f"{sum(picked)} of {len(picked)} blocks: {met(all(picked))}")  # fmt: skip
    if len(set(chosen)) == 1 and chosen[0] in sps:
        r = sps["auto"] / sps[chosen[0]]
        lines.append(f"  auto / {chosen[0]} alone samples/s = {r:.3f} (goal within "
                     f"{AUTO_TOLERANCE:.0%}): {met(abs(r - 1) <= AUTO_TOLERANCE)}")  # fmt: skip
    else:
        lines.append("  auto chose differently between blocks: its steady state mixes both")
    r = sps["auto"] / sps[faster]
    lines.append(f"  auto / faster alone ({faster}) samples/s = {r:.3f}")
    return lines


def _other(mode: str) -> str:
    return "bytegrad" if mode == "gradient_allreduce" else "gradient_allreduce"


def main_launcher(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    nets = ([] if args.no_loopback else ["loopback"]) + ([] if args.no_hosts else ["hosts"])
    results, failed = {}, False
    if "hosts" in nets:
        try:
            _netns.require_root()
        except _netns.NetnsError as e:
            print(f"autotune bench: {e} (or choose --no-hosts)", file=sys.stderr)
            return 1
    for net in nets:
        the_plan = plan(args, net)
        t0 = time.monotonic()
        names = [m[0] for m in the_plan["modes"]]
        print(f"\n=== {net}: {len(names)} modes ({', '.join(names)}); {the_plan['steps']} timed "
              f"steps per mode over {2 * args.rounds} blocks, {the_plan['warmup']} warm-up "
              f"steps per block; autotune: warm-up {args.at_warmup}, "
              f"{args.at_steps_per_sample} steps per sample, {args.at_max_samples} samples per "
              f"categorical setting, at most {the_plan['tune_steps']} tuning steps",
              flush=True)  # fmt: skip
        try:
            if net == "hosts":
                _netns.up()
                _netns.shape(args.rate)
                rates = _netns.check_link(args.rate)
                print(f"link {args.rate}: TCP goodput {rates[0] / 1e6:.1f} / "
                      f"{rates[1] / 1e6:.1f} MB/s (host 0 -> 1 / 1 -> 0)", flush=True)  # fmt: skip
                the_plan["link_Bps"] = min(rates)
            result = run_network(args, net, the_plan)
        except (RuntimeError, _netns.NetnsError, OSError) as e:
            print(f"{net}: FAILED: {e}", file=sys.stderr, flush=True)
            failed = True
            continue
        finally:
            if net == "hosts":
                _netns.down()
        result["elapsed_s"] = time.monotonic() - t0
        result["plan"] = the_plan
        results[net] = result
        where = "1 host" if net == "loopback" else f"2 hosts at {args.rate}"
        print(f"\n{net}: {where}, {result['size']} ranks, {LAYERS} x Linear({WIDTH}, {WIDTH}), "
              f"batch {args.batch_size}/rank; took {result['elapsed_s']:.0f} s")  # fmt: skip
        print("\n".join(report(net, result, the_plan)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


# ---- worker side ----------------------------------------------------------------------------


def read_csv(path: str) -> tuple[list[dict], bool]:
    """The tuner's CSV rows, and whether the last one is the best row (tuning ended): its score
    repeats the highest score of the rows before it."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return [], False
    if len(rows) < 2 or any(r.get("score") in (None, "") for r in rows):
        return rows, False
    scores = [float(r["score"]) for r in rows]
    return rows, scores[-1] == max(scores[:-1])


def best_of(row: dict) -> dict:
    return {"fusion_mb": float(row["tensor_fusion_threshold"]),
            "cycle_ms": float(row["cycle_time_ms"]), "cache": int(row["cache_enabled"]),
            "hierarchical": int(row["hierarchical_allreduce"])}  # fmt: skip


def fixed_env(best: dict, hosts: bool) -> dict:
    env = {"HOROVOD_FUSION_THRESHOLD": str(int(best["fusion_mb"] * MB)),
           "HOROVOD_CYCLE_TIME": repr(best["cycle_ms"])}  # fmt: skip
    if not best["cache"]:
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    if hosts:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = str(best["hierarchical"])
    return env


def make_model(torch):
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def block_order(modes: list, b: int) -> list:
    """Block b's order: A-B-C, then C-B-A; tuned_fixed stays right after autotune, so that it
    runs the setting that block's tuning chose."""
    if b % 2 == 0:
        return list(modes)
    order = [m for m in reversed(modes) if m[1] != "tuned_fixed"]
    i = next((i for i, m in enumerate(order) if m[1] == "autotune"), None)
    fixed = [m for m in modes if m[1] == "tuned_fixed"]
    return order if i is None else order[: i + 1] + fixed + order[i + 1 :]


def worker(args: argparse.Namespace) -> int:
    import torch

    import bagua_hvd.torch as hvd
    from bagua_hvd.torch import algorithms as algs

    torch.set_num_threads(1)
    with open(args._plan) as f:
        the_plan = json.load(f)
    tmp = os.environ[RESULT_ENV]
    hosts = args._worker == "hosts"
    rank = int(os.environ["HOROVOD_RANK"])
    gen = torch.Generator().manual_seed(1234 + rank)
    batch = the_plan["batch_size"]
    x = torch.randn(batch, WIDTH, generator=gen)
    y = torch.randint(0, WIDTH, (batch,), generator=gen)
    F = torch.nn.functional
    modes = the_plan["modes"]
    out = {m[0]: {"step_s": [], "blocks": []} for m in modes}
    last_best: dict | None = None
    blocks = 2 * the_plan["rounds"]
    steps = the_plan["steps"]
    for b in range(blocks):
        n = steps * (b + 1) // blocks - steps * b // blocks
        for name, kind, env in block_order(modes, b):
            for key in MODE_VARS:
                os.environ.pop(key, None)
            os.environ.update(env)
            note: dict = {}
            if kind == "tuned_fixed":
                if last_best is None:  # before any autotune block: nothing chosen yet
                    continue
                os.environ.update(fixed_env(last_best, hosts))
                note["best"] = last_best
            log = os.path.join(tmp, f"autotune.{b}.csv")
            if kind == "autotune":
                os.environ["HOROVOD_AUTOTUNE_LOG"] = log
            hvd.init()
            model = make_model(torch)
            algorithm = None
            if kind == "algorithm":
                algorithm = {"gradient_allreduce": algs.GradientAllReduce, "bytegrad": algs.ByteGrad,
                             "auto": lambda: algs.Auto(verbose=False)}[name]()  # fmt: skip
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=LR),
                named_parameters=[(f"{name}.{b}.{k}", p) for k, p in model.named_parameters()],
                algorithm=algorithm,
            )

            def step(model=model, opt=opt) -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

            if kind == "autotune":
                note.update(tune(hvd, torch, step, log, the_plan["tune_steps"]))
                last_best = note["best"] or last_best
            if kind == "algorithm":
                # Auto's schedule: warm-up 2, 2 rounds of 1 + 3 steps per candidate; the choice
                # is made at the start of the next step, which the warm-up (>= 1 step) runs.
                # The candidates alone run as many steps first: both are timed in steady state.
                for _ in range(2 + 2 * 2 * 4):
                    step()
            for _ in range(max(the_plan["warmup"], name == "auto")):
                step()
            if name == "auto":
                state = opt.state_dict()["bagua_hvd_auto"]
                labels = state["candidates"]
                note["chosen"] = None if state["chosen"] is None else labels[state["chosen"]]
                note["step_times"] = dict(zip(labels, state["step_times"] or []))
            marks = [time.perf_counter()]
            for _ in range(n):
                step()
                marks.append(time.perf_counter())
            out[name]["step_s"] += [t1 - t0 for t0, t1 in zip(marks, marks[1:])]
            note["timed"] = n
            out[name]["blocks"].append(note)
            del opt, model, step
            hvd.shutdown()
    out = {k: v for k, v in out.items() if v["step_s"]}
    with open(os.path.join(tmp, f"rank{rank:03d}.json"), "w") as f:
        json.dump({"rank": rank, "size": int(os.environ["HOROVOD_SIZE"]), "modes": out}, f)
    return 0


def tune(hvd, torch, step, log: str, limit: int) -> dict:
    """Trains until rank 0 sees the tuner's best row (agreed by a broadcast every CHECK_EVERY
    steps) or ``limit`` steps; the block's tuning figures."""
    t0 = time.perf_counter()
    done, count = False, 0
    while not done and count < limit:
        step()
        count += 1
        if count % CHECK_EVERY == 0:
            ended = hvd.rank() == 0 and read_csv(log)[1]
            flag = hvd.broadcast(torch.tensor([int(ended)]), 0, name="bench.autotune.done")
            done = bool(flag[0])
    tune_s = time.perf_counter() - t0
    rows, ended = read_csv(log) if hvd.rank() == 0 else ([], False)
    best = best_of(rows[-1]) if ended else None
    best = hvd.broadcast_object(best, 0, name="bench.autotune.best")
    scores = len(rows) - 1 if ended else len(rows)
    return {"ended": done, "tune_steps": count, "tune_s": tune_s, "scores": scores,
            "best": best, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args._worker else main_launcher(args)


if __name__ == "__main__":
    sys.exit(main())
