"""bench/train.py --framework tf --algorithms NAMES: BAGUA's algorithms in the TensorFlow
frontend beside the torch frontend, on the same model and bytes, in one invocation.

    python bench/train.py --framework tf --algorithms bytegrad,low_precision_decentralized

The model is bench/train.py's MLP (1024 -> 2048 x6 -> 1000, ReLU; 14 float32 tensors, 25.13M
parameters, 100.5 MB), built twice with the same shapes: keras.layers for TensorFlow
(_tf_train.make_model), torch.nn for torch (train.make_model); a fixed random batch of
--batch-size samples per rank, SGD with momentum, softmax cross-entropy; 1 intra-op thread per
framework. Both frontends bucket the same tensors the same way (the engine's bucket_layout,
BAGUA_HVD_BUCKET_MB), so each algorithm communicates the same bytes in both.

Every rank runs, in the same processes and in A-B-...-B-A blocks (--rounds times; warm-up
steps, then timed steps per block), the modes
  tf:no-comm, torch:no-comm   the frontend's step without communication (compute only)
  tf:NAME     tf.function: tf.GradientTape wrapped by hvd.DistributedGradientTape(algorithm=
              NAME), optimizer.apply_gradients, tape.step_done() (the kernel path,
              bagua_hvd/tensorflow/algorithm_kernels.py)
  torch:NAME  hvd.DistributedOptimizer(SGD, named_parameters, algorithm=NAME): backward, step
Step time = the slowest rank's wall time of a step; per mode the median over the timed steps.

Communication part of a step (the figure compared): step(NAME) - step(no-comm) of the same
frontend (medians), i.e. what the algorithm adds to that frontend's own compute. Printed
beside: the core's busy time per step (bhvd_stat("exec_ns"): wall time its background thread
spent executing operations, the slowest rank's), which leaves out the frontend's own work
(packing buckets, the low-precision local half on the caller's thread). Ratio = TF / torch;
goal <= 1.1 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import (  # noqa: E402
    CLASSES,
    IN_FEATURES,
    LR,
    MOMENTUM,
    RESULT_ENV,
    git_commit,
    minor_faults,
)

GOAL = 1.1  # TF's communication part over torch's


def launch(args: argparse.Namespace) -> dict:
    from _tf_train import launch_script

    os.environ.pop("BAGUA_HVD_ALGORITHM", None)  # each mode names its own algorithm
    extra = ["--tf-inter-threads", str(args.tf_inter_threads), "--algorithms", args.algorithms]
    return launch_script(args, __file__, extra)


def main_launcher(args: argparse.Namespace) -> int:
    if args.np < 2:
        print("train bench: --algorithms needs --np >= 2", file=sys.stderr)
        return 2
    from _tf_train import repeat_runs

    runs = repeat_runs(args, launch, "algorithms")
    if runs is None:
        return 1
    meta = {
        "framework": "tf+torch",
        "algorithms": args.algorithms,
        "np": args.np,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "malloc": args.malloc,
        "bucket_mb": os.environ.get("BAGUA_HVD_BUCKET_MB", "default"),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    return print_report(meta, runs)


def print_report(meta: dict, runs: list[dict]) -> int:
    print(
        f"\nBAGUA's algorithms, TensorFlow vs torch frontend: {meta['np']} ranks, batch "
        f"{meta['batch_size']}/rank, {meta['steps']} timed steps per mode, "
        f"{meta['rounds']} round(s), commit {meta['commit']}, {meta['cpus']} CPUs, bucket MB "
        f"{meta['bucket_mb']}"
    )
    ok = True
    for i, run in enumerate(runs):
        print(f"run {i + 1} (load {run['load_before']} -> {run['load_after']}): "
              f"{run['params'] / 1e6:.2f}M params, {run['bytes'] / 1e6:.1f} MB")  # fmt: skip
        modes = run["modes"]
        print(f"  {'mode':<34} {'step ms':>9} {'core exec ms':>13} {'page faults':>12}")
        for mode, m in modes.items():
            faults = m.get("faults", float("nan"))
            print(f"  {mode:<34} {m['step_ms']:9.1f} {m['exec_ms']:13.1f} {faults:12.0f}")
        for name in meta["algorithms"].split(","):
            comm = {}
            for fw in ("tf", "torch"):
                comm[fw] = modes[f"{fw}:{name}"]["step_ms"] - modes[f"{fw}:no-comm"]["step_ms"]
            ratio = comm["tf"] / comm["torch"] if comm["torch"] > 0 else float("inf")
            exec_ratio = modes[f"tf:{name}"]["exec_ms"] / max(
                modes[f"torch:{name}"]["exec_ms"], 1e-9
            )
            verdict = "ok" if ratio <= GOAL else "above goal"
            ok = ok and ratio <= GOAL
            print(
                f"  {name}: communication part of a step (step - no-comm): tf {comm['tf']:.1f} "
                f"ms, torch {comm['torch']:.1f} ms, tf/torch {ratio:.2f} (goal <= {GOAL}: "
                f"{verdict}); core exec tf/torch {exec_ratio:.2f}"
            )
    if len(runs) > 1:
        print(f"median over the {len(runs)} runs:")
        for name in meta["algorithms"].split(","):
            comm = {fw: statistics.median(r["modes"][f"{fw}:{name}"]["step_ms"]
                                          - r["modes"][f"{fw}:no-comm"]["step_ms"] for r in runs)
                    for fw in ("tf", "torch")}  # fmt: skip
            execs = {fw: statistics.median(r["modes"][f"{fw}:{name}"]["exec_ms"] for r in runs)
                     for fw in ("tf", "torch")}  # fmt: skip
            ratios = [
                (r["modes"][f"tf:{name}"]["step_ms"] - r["modes"]["tf:no-comm"]["step_ms"])
                / max(
                    r["modes"][f"torch:{name}"]["step_ms"] - r["modes"]["torch:no-comm"]["step_ms"],
                    1e-9,
                )
                for r in runs
            ]
            # The ratio within each run (its modes ran interleaved), then the median of those.
            ratio = statistics.median(ratios)
            verdict = "ok" if ratio <= GOAL else "above goal"
            print(
                f"  {name}: tf/torch {ratio:.2f} (goal <= {GOAL}: {verdict}; per run: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}); communication part tf "
                f"{comm['tf']:.1f} ms, torch {comm['torch']:.1f} ms; core exec tf "
                f"{execs['tf']:.1f} ms, torch {execs['torch']:.1f} ms"
            )
    return 0 if ok else 3


# ---- worker side ----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.tf_inter_threads)
    import keras
    import torch
    from _tf_train import make_model as keras_model
    from train import make_model as torch_model

    import bagua_hvd.tensorflow as hvd
    import bagua_hvd.torch as hvd_torch
    from bagua_hvd.common._native import lib
    from bagua_hvd.tensorflow import algorithms as tf_alg
    from bagua_hvd.torch import algorithms as torch_alg

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    perf = time.perf_counter

    def exec_ns() -> int:
        return int(lib().bhvd_stat(b"exec_ns"))

    rng = np.random.default_rng(1234 + rank)
    xs = rng.standard_normal((args.batch_size, IN_FEATURES), dtype=np.float32)
    ys = rng.integers(0, CLASSES, args.batch_size, dtype=np.int64)
    x, y = tf.constant(xs), tf.constant(ys.astype(np.int32))
    tx, ty = torch.from_numpy(xs), torch.from_numpy(ys)
    names = args.algorithms.split(",")

    def tf_mode(name: str | None):
        model = keras_model(keras)
        opt = keras.optimizers.SGD(LR, momentum=MOMENTUM)
        opt.build(model.trainable_variables)
        tvars = [v.value for v in model.trainable_variables]
        alg = tf_alg.BY_NAME[name]() if name else None

        @tf.function
        def step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            if alg is not None:
                tape = hvd.DistributedGradientTape(tape, algorithm=alg)
            grads = tape.gradient(loss, tvars)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if alg is not None:
                tape.step_done()
            return loss

        return lambda: float(step().numpy()), model

    def torch_mode(name: str | None):
        model = torch_model(torch)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        if name:
            opt = hvd_torch.DistributedOptimizer(
                opt, named_parameters=model.named_parameters(),
                algorithm=torch_alg.BY_NAME[name](),
            )  # fmt: skip
        loss_fn = torch.nn.CrossEntropyLoss()

        def step() -> float:
            opt.zero_grad()
            loss = loss_fn(model(tx), ty)
            loss.backward()
            opt.step()
            return float(loss.item())

        return step, model

    steps = {}
    for fw, make in (("tf", tf_mode), ("torch", torch_mode)):
        steps[f"{fw}:no-comm"], model = make(None)
        for name in names:
            steps[f"{fw}:{name}"], _ = make(name)
    params = int(sum(int(np.prod(v.shape)) for v in model.parameters()))
    modes = list(steps)
    rows: dict = {m: [] for m in modes}
    blocks = 2 * args.rounds
    for b in range(blocks):
        n = args.steps * (b + 1) // blocks - args.steps * b // blocks
        for mode in modes if b % 2 == 0 else list(reversed(modes)):
            step = steps[mode]
            hvd_torch.barrier()
            for _ in range(args.warmup):
                step()
            hvd_torch.barrier()
            for _ in range(n):
                f0, e0, t0 = minor_faults(), exec_ns(), perf()
                step()
                rows[mode].append([perf() - t0, (exec_ns() - e0) * 1e-9, minor_faults() - f0])

    def slowest(table: list) -> list:
        t = torch.tensor(table, dtype=torch.float64)
        return hvd_torch.allreduce(t, op=hvd_torch.Max, name=f"bench.alg.{len(table)}").tolist()

    out = {}
    for mode in modes:
        t = slowest(rows[mode])
        out[mode] = {
            "step_ms": statistics.median(r[0] for r in t) * 1e3,
            "exec_ms": statistics.median(r[1] for r in t) * 1e3,
            "faults": statistics.median(r[2] for r in t),
            "steps": len(t),
        }
    result = {
        "rank": rank,
        "size": size,
        "tf_version": tf.__version__,
        "torch_version": torch.__version__,
        "params": params,
        "bytes": 4 * params,
        "modes": out,
    }
    path = os.environ.get(RESULT_ENV)
    if path:
        with open(os.path.join(path, f"rank{rank:05d}.json"), "w") as f:
            json.dump(result, f)
    hvd_torch.barrier()
    hvd.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bench/train.py --algorithms (worker)")
    parser.add_argument("--_worker", action="store_true", required=True)
    for name in ("--np", "--batch-size", "--warmup", "--steps", "--rounds", "--tf-inter-threads"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--algorithms", required=True)
    return worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
