"""bench/train.py --framework tf: bagua_hvd's TensorFlow frontend beside MultiWorkerMirroredStrategy.

    python bench/train.py --framework tf               # 2 ranks, one invocation
    python bench/train.py --framework tf --repeat 3    # three invocations, medians

The model is bench/train.py's MLP (1024 -> 2048 x6 -> 1000, ReLU, 25.13M float32 parameters,
100.5 MB of gradients) built with keras.layers, the same initial weights everywhere
(keras.utils.set_random_seed(0)); a fixed random batch of --batch-size samples per rank, Keras
SGD with momentum, softmax cross-entropy; 1 TensorFlow intra-op thread per rank.

Throughput: the launcher starts --np ranks through bagua-run; each rank first creates a
tf.distribute.MultiWorkerMirroredStrategy (TF_CONFIG: one worker per rank on 127.0.0.1, RING
collectives on CPU; it must exist before any other TensorFlow op), then hvd.init(), and builds
one replica per mode. The modes run in the same processes in A-B-C-C-B-A blocks (--rounds
times; warm-up steps, then timed steps per block), so that drifts of the machine hit every mode
alike. Each step is one tf.function call:
  bagua_hvd  tf.GradientTape wrapped by hvd.DistributedGradientTape (Average), then
             optimizer.apply_gradients; the replica lives outside the strategy's scope
  mwms       strategy.run of the same step on the strategy's replica: the loss is divided by
             the global batch and Keras' optimizer SUM-allreduces the gradients through the
             strategy (Keras' own distributed path), then applies them
  no-comm    the bagua_hvd step with a plain tf.GradientTape on a third replica: compute only
Same global batch (--np x --batch-size) and number of steps in every mode. Step time = the
slowest rank's time of the step; median over the timed steps; samples/s = np x batch / step.

Reduction cost (the frontend's per-step overhead over the torch frontend for the same bytes):
after the training blocks, in the same processes, one step's gradient reduction alone -- a
grouped Average-allreduce of 14 float32 tensors shaped like the model's gradients (100.5 MB) --
is timed --reduce-reps times through each path (after 2 warm-up rounds), a barrier before each
call; bagua_hvd's paths in a random order per round (the same on every rank), then mwms apart:
  tf         hvd.grouped_allreduce(list of tf tensors) inside a tf.function (what
             DistributedGradientTape runs in the bagua_hvd step): the asynchronous
             BaguaHvdCollective kernel (bagua_hvd/tensorflow/kernels.cc)
  tf_numpy   the same through tf.numpy_function (the path before the kernel, and its fallback
             where it cannot be built); also the part of it spent inside the callback
             (mpi_ops._collective)
  tf_copy    tf_numpy with the outputs allocated by plain np.empty, as the frontend did before
             its outputs were aligned and pooled (TensorFlow then copies them)
  tf_floor   a tf.function returning tf.identity of the same 14 tensors: TensorFlow's own
             cost of calling a function with those outputs, no collective
  numpy      the same request at the frontend's numpy level (mpi_ops._collective on the
             tensors' numpy views, from the main thread): the core's cost without TensorFlow
  torch      bagua_hvd.torch.grouped_allreduce(list of torch tensors) (out of place, as tf)
  torch_inplace  bagua_hvd.torch.grouped_allreduce_ (in place, as DistributedOptimizer does)
  mwms       the strategy's replica_context.all_reduce(SUM, list) inside strategy.run in a
             tf.function (what the mwms step runs)
Per call: wall time, CPU time of the whole process (time.process_time: every thread, the core's
included) and minor page faults, each the slowest rank's; medians over the calls. The overhead
figure is wall(tf) / wall(torch) - 1 (the same out-of-place operation; goal < 10 %), printed
also against torch_inplace, and the CPU ratios beside (wall times on 2 shared cores move with
the machine's load).

Allocator: --malloc steady sets bench/train.py's STEADY_MALLOC (main-arena settings). Large
blocks freed by TensorFlow's own threads (per-thread glibc arenas) still go back to the system;
MALLOC_ARENA_MAX=1 in the environment puts every thread on the main arena (docs/benchmarks.md
has runs with and without it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import free_port, run_ranks  # noqa: E402
from train import (  # noqa: E402
    CLASSES,
    HIDDEN,
    HIDDEN_LAYERS,
    IN_FEATURES,
    LR,
    MOMENTUM,
    STEADY_MALLOC,
    fmt_runs,
    git_commit,
    loadavg,
    minor_faults,
)

PORTS_ENV = "BAGUA_HVD_BENCH_TF_PORTS"
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"
MODES = ("bagua_hvd", "mwms", "no-comm")
REDUCERS = ("tf", "tf_numpy", "tf_copy", "tf_floor", "numpy", "torch", "torch_inplace", "mwms")
# Goals of the issue (docs/benchmarks.md).
MIN_SPEEDUP = 1.2  # bagua_hvd samples/s over MultiWorkerMirroredStrategy's, 2 ranks
MAX_OVERHEAD = 0.10  # TF frontend's gradient reduction over the torch frontend's, same bytes


def add_args(parser: argparse.ArgumentParser) -> None:
    """The TF mode's own flags (bench/train.py adds them to its parser)."""
    parser.add_argument(
        "--reduce-reps",
        type=int,
        default=12,
        help="--framework tf: timed gradient reductions per path after the training blocks",
    )
    parser.add_argument(
        "--tf-inter-threads",
        type=int,
        default=2,
        help="--framework tf: TensorFlow inter-op threads per rank (intra-op: 1)",
    )


# ---- launcher side --------------------------------------------------------------------------


def launch_script(
    args: argparse.Namespace, script: str, extra: list[str], env_extra: dict | None = None
) -> dict:
    """Runs ``script --_worker`` as --np ranks through bagua-run (the common flags, then
    ``extra``; ``env_extra`` added to the environment); returns rank 0's JSON result."""
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_tf_") as tmp:
        env = dict(os.environ)
        if args.malloc == "steady":
            for key, value in STEADY_MALLOC.items():
                env.setdefault(key, value)
        env.update(env_extra or {})
        env[RESULT_ENV] = tmp
        env["OMP_NUM_THREADS"] = "1"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        cmd = [sys.executable, os.path.abspath(script), "--_worker"]
        cmd += [
            "--np", str(args.np), "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--rounds", str(args.rounds), *extra,
        ]  # fmt: skip
        rc = run_ranks(args.np, cmd, env, args.timeout)
        if rc is None:
            raise RuntimeError(f"no result after --timeout {args.timeout:g} s")
        if rc != 0:
            raise RuntimeError(f"the ranks failed (launcher exit status {rc})")
        with open(os.path.join(tmp, "rank00000.json")) as f:
            return json.load(f)


def launch(args: argparse.Namespace) -> dict:
    extra = [
        "--reduce-reps",
        str(args.reduce_reps),
        "--tf-inter-threads",
        str(args.tf_inter_threads),
    ]
    ports = ",".join(str(free_port()) for _ in range(args.np))
    return launch_script(args, __file__, extra, {PORTS_ENV: ports})


def repeat_runs(args: argparse.Namespace, launch_fn, label: str) -> list[dict] | None:
    """``args.repeat`` launches of ``launch_fn(args)``, each with the load average before and
    after; None (the error printed) when one fails."""
    runs = []
    for i in range(args.repeat):
        load = loadavg()
        print(f"train bench ({label}): run {i + 1}/{args.repeat} (load average {load})", flush=True)
        try:
            run = launch_fn(args)
        except RuntimeError as exc:
            print(f"train bench: {exc}", file=sys.stderr)
            return None
        run["load_before"] = load
        run["load_after"] = loadavg()
        runs.append(run)
    return runs


def main_launcher(args: argparse.Namespace) -> int:
    if args.np < 2:
        print("train bench: --framework tf needs --np >= 2", file=sys.stderr)
        return 2
    runs = repeat_runs(args, launch, "tf")
    if runs is None:
        return 1
    meta = {
        "framework": "tf",
        "np": args.np,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "reduce_reps": args.reduce_reps,
        "tf_inter_threads": args.tf_inter_threads,
        "tf": runs[0]["tf_version"],
        "keras": runs[0]["keras_version"],
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "malloc": args.malloc,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print_report(meta, runs)
    return 0


def print_report(meta: dict, runs: list[dict]) -> int:
    med = statistics.median
    np_, batch = meta["np"], meta["batch_size"]
    print(
        f"\nKeras MLP {IN_FEATURES}->{HIDDEN}x{HIDDEN_LAYERS}->{CLASSES} "
        f"({runs[0]['params'] / 1e6:.2f}M params), batch {batch}/rank, {np_} ranks on one host, "
        f"1 intra-op + {meta['tf_inter_threads']} inter-op TF threads per rank, "
        f"TF {meta['tf']}, Keras {meta['keras']}, bagua_hvd {meta['commit']}; per mode "
        f"{meta['steps']} timed steps over {2 * meta['rounds']} blocks in A-B-C-C-B-A order, "
        f"{meta['warmup']} warm-up steps per block; step = slowest rank; medians over steps"
    )
    print(f"malloc: {meta['malloc']}")
    print(
        "load average before / after each run: "
        + ", ".join(f"{r['load_before']} / {r['load_after']}" for r in runs)
        + "\n"
    )
    print("| mode | step ms | samples/s | comm share % (1 - no-comm/step) | page faults/step |")
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        per = [r["modes"][mode] for r in runs]
        steps = [p["step_ms"] for p in per]
        nocomm = [r["modes"]["no-comm"]["step_ms"] for r in runs]
        share = (
            fmt_runs([100 * (1 - n / s) for s, n in zip(steps, nocomm)], ".1f")
            if mode != "no-comm"
            else "-"
        )
        cells = [
            fmt_runs(steps, ".1f"),
            fmt_runs([np_ * batch / (s / 1e3) for s in steps], ".1f"),
            share,
            fmt_runs([p["faults"] for p in per], ".0f"),
        ]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print()
    for i, r in enumerate(runs):
        print(
            f"run {i + 1}: replicas identical after training: bagua_hvd "
            f"{'yes' if r['identical']['bagua_hvd'] else 'NO'}, mwms "
            f"{'yes' if r['identical']['mwms'] else 'NO'}; final losses "
            + ", ".join(f"{m} {v:.4g}" for m, v in r["final_loss"].items())
        )
    print(
        "CPU seconds a rank process used during 1 s of sleep after the training blocks: "
        + ", ".join(f"{r['idle_cpu_s']:.3f}" for r in runs)
    )
    print(
        f"\ngradient reduction alone ({runs[0]['grad_mb']:.1f} MB in {runs[0]['grad_tensors']} "
        f"float32 tensors, Average), ms per call, slowest rank, median of "
        f"{meta['reduce_reps']} calls:"
    )
    print("| path | wall ms | vs torch | process CPU ms | vs torch | page faults |")
    print("|---|---:|---:|---:|---:|---:|")
    labels = {
        "tf": "tf (BaguaHvdCollective kernel)",
        "tf_numpy": "tf through tf.numpy_function (fallback)",
        "tf_callback": "tf_numpy: of which in the numpy_function callback",
        "tf_copy": "tf_numpy with numpy-allocated outputs (before the pool)",
        "tf_floor": "TF floor: a tf.function returning the same 14 tensors, no collective",
    }
    for path in (*REDUCERS[:2], "tf_callback", *REDUCERS[2:]):
        vals = [r["reduce_ms"][path] for r in runs]
        ratios = [r["reduce_ms"][path] / r["reduce_ms"]["torch"] for r in runs]
        cells = [fmt_runs(vals, ".1f"), fmt_runs(ratios, ".2f")]
        if path in runs[0]["reduce_cpu_ms"]:
            vals = [r["reduce_cpu_ms"][path] for r in runs]
            ratios = [r["reduce_cpu_ms"][path] / r["reduce_cpu_ms"]["torch"] for r in runs]
            cells += [fmt_runs(vals, ".1f"), fmt_runs(ratios, ".2f")]
            cells.append(fmt_runs([r["reduce_faults"][path] for r in runs], ".0f"))
        else:
            cells += ["-", "-", "-"]
        print(f"| {labels.get(path, path)} | " + " | ".join(cells) + " |")
    print()
    ratios = [r["modes"]["mwms"]["step_ms"] / r["modes"]["bagua_hvd"]["step_ms"] for r in runs]
    ok_speed = med(ratios) >= MIN_SPEEDUP
    print(
        f"samples/s bagua_hvd / mwms: {fmt_runs(ratios, '.2f')} (runs, median); "
        f"goal >= {MIN_SPEEDUP}x: {'met' if ok_speed else 'NOT met'}"
    )
    over = [r["reduce_ms"]["tf"] / r["reduce_ms"]["torch"] - 1 for r in runs]
    over_cpu = [r["reduce_cpu_ms"]["tf"] / r["reduce_cpu_ms"]["torch"] - 1 for r in runs]
    ok_over = med(over) < MAX_OVERHEAD
    print(
        "gradient reduction, TF frontend over the torch frontend, same operation (out-of-place "
        f"grouped allreduce, same bytes): wall {fmt_runs([100 * o for o in over], '+.1f')} %, "
        f"process CPU {fmt_runs([100 * o for o in over_cpu], '+.1f')} % (runs, median); goal < "
        f"{100 * MAX_OVERHEAD:.0f} %: {'met' if ok_over else 'NOT met'}"
    )
    over = [
        (r["reduce_ms"]["tf"] - r["reduce_ms"]["tf_floor"]) / r["reduce_ms"]["torch"] - 1
        for r in runs
    ]
    print(
        "  the same without TF's function-call floor (which every TF training step pays, with or "
        f"without a collective): wall {fmt_runs([100 * o for o in over], '+.1f')} %"
    )
    over = [r["reduce_ms"]["tf"] / r["reduce_ms"]["torch_inplace"] - 1 for r in runs]
    over_cpu = [r["reduce_cpu_ms"]["tf"] / r["reduce_cpu_ms"]["torch_inplace"] - 1 for r in runs]
    print(
        "  over torch's in-place grouped_allreduce_ (what its DistributedOptimizer runs; the "
        "tf path's inputs are captured constants, which the kernel cannot reduce in place, "
        f"unlike the gradients of a training step): wall {fmt_runs([100 * o for o in over], '+.1f')} %, process "
        f"CPU {fmt_runs([100 * o for o in over_cpu], '+.1f')} %"
    )
    over = [r["reduce_ms"]["tf_numpy"] / r["reduce_ms"]["torch"] - 1 for r in runs]
    print(
        "  the numpy_function path (fallback) over the torch frontend: wall "
        f"{fmt_runs([100 * o for o in over], '+.1f')} %"
    )
    in_step = [r["modes"]["bagua_hvd"]["step_ms"] - r["modes"]["no-comm"]["step_ms"] for r in runs]
    print(
        f"in the training step, bagua_hvd step - no-comm step: {fmt_runs(in_step, '.1f')} ms "
        f"(runs, median) vs the reduction alone through tf: "
        f"{fmt_runs([r['reduce_ms']['tf'] for r in runs], '.1f')} ms"
    )
    return 0


# ---- worker side ----------------------------------------------------------------------------


def make_model(keras):
    """The benchmark's MLP in Keras, the same initial weights in every mode and on every rank."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((IN_FEATURES,))]
    layers += [keras.layers.Dense(HIDDEN, activation="relu") for _ in range(HIDDEN_LAYERS)]
    return keras.Sequential([*layers, keras.layers.Dense(CLASSES)])


def flat_weights(model) -> object:
    import numpy as np

    return np.concatenate([np.asarray(v).ravel() for v in model.trainable_variables])


def worker(args: argparse.Namespace) -> int:
    rank = int(os.environ["HOROVOD_RANK"])
    size = int(os.environ["HOROVOD_SIZE"])
    ports = os.environ[PORTS_ENV].split(",")
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": rank},
        }
    )
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.tf_inter_threads)
    # Before any other TensorFlow op: it sets up the process's collective runtime.
    impl = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=impl)
    )
    import keras
    import torch

    import bagua_hvd.tensorflow as hvd
    import bagua_hvd.torch as hvd_torch
    from bagua_hvd.common import ops as core_ops
    from bagua_hvd.tensorflow import mpi_ops

    torch.set_num_threads(1)
    hvd.init()
    assert hvd.rank() == rank and hvd.size() == size
    perf = time.perf_counter

    rng = np.random.default_rng(1234 + rank)
    x = tf.constant(rng.standard_normal((args.batch_size, IN_FEATURES), dtype=np.float32))
    y = tf.constant(rng.integers(0, CLASSES, args.batch_size, dtype=np.int32))
    global_batch = args.batch_size * size

    def loss_of(model) -> tf.Tensor:
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    def sgd():
        return keras.optimizers.SGD(LR, momentum=MOMENTUM)

    # bagua_hvd: outside the strategy's scope.
    model_b, opt_b = make_model(keras), sgd()
    opt_b.build(model_b.trainable_variables)
    hvd.broadcast_variables(model_b.variables, root_rank=0)
    # DistributedGradientTape needs the tf.Variables behind Keras 3's variables (hashable).
    tvars_b = [v.value for v in model_b.trainable_variables]

    @tf.function
    def step_bagua() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_of(model_b)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, tvars_b)
        opt_b.apply_gradients(zip(grads, model_b.trainable_variables))
        return loss

    # no-comm: the same step without the reduction, on its own replica.
    model_n, opt_n = make_model(keras), sgd()
    opt_n.build(model_n.trainable_variables)

    @tf.function
    def step_nocomm() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_of(model_n)
        grads = tape.gradient(loss, model_n.trainable_variables)
        opt_n.apply_gradients(zip(grads, model_n.trainable_variables))
        return loss

    # MultiWorkerMirroredStrategy: Keras' optimizer SUM-allreduces through the strategy.
    with strategy.scope():
        model_m, opt_m = make_model(keras), sgd()
        opt_m.build(model_m.trainable_variables)

    @tf.function
    def step_mwms() -> tf.Tensor:
        def replica() -> tf.Tensor:
            with tf.GradientTape() as tape:
                logits = model_m(x, training=True)
                per = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
                loss = tf.nn.compute_average_loss(per, global_batch_size=global_batch)
            grads = tape.gradient(loss, model_m.trainable_variables)
            opt_m.apply_gradients(zip(grads, model_m.trainable_variables))
            return loss * size  # this rank's mean loss, as the other modes return

        return strategy.run(replica)

    # Time spent inside the numpy_function callback (the numpy-level collective: enqueue, wait,
    # release) during a bagua_hvd step or tf reduction; the rest is TensorFlow's.
    inner: list = []
    collective = mpi_ops._collective

    def timed_collective(*a, **k):
        t0 = perf()
        try:
            return collective(*a, **k)
        finally:
            inner.append(perf() - t0)

    mpi_ops._collective = timed_collective

    steps = {"bagua_hvd": step_bagua, "mwms": step_mwms, "no-comm": step_nocomm}
    rows: dict[str, list] = {m: [] for m in MODES}
    losses: dict[str, float] = {}
    blocks = 2 * args.rounds
    for b in range(blocks):
        n = args.steps * (b + 1) // blocks - args.steps * b // blocks
        for mode in MODES if b % 2 == 0 else tuple(reversed(MODES)):
            step = steps[mode]
            hvd_torch.barrier()
            for _ in range(args.warmup):
                step().numpy()
            hvd_torch.barrier()
            for _ in range(n):
                faults = minor_faults()
                inner.clear()
                t0 = perf()
                loss = step().numpy()
                rows[mode].append([perf() - t0, minor_faults() - faults, sum(inner)])
            losses[mode] = float(loss)

    def slowest(table: list) -> list:
        t = torch.tensor(table, dtype=torch.float64)
        return hvd_torch.allreduce(t, op=hvd_torch.Max, name=f"bench.slowest.{len(table)}").tolist()

    modes_out = {}
    for mode in MODES:
        t = slowest(rows[mode])
        modes_out[mode] = {
            "step_ms": statistics.median(r[0] for r in t) * 1e3,
            "faults": statistics.median(r[1] for r in t),
            "callback_ms": statistics.median(r[2] for r in t) * 1e3,
            "steps": len(t),
        }

    # CPU time this process burns while idle (the strategy's gRPC and collective threads stay
    # alive in the same process as bagua_hvd's core): over one second of sleep.
    hvd_torch.barrier()
    cpu0 = time.process_time()
    time.sleep(1.0)
    idle_cpu = time.process_time() - cpu0

    def identical(model) -> bool:
        w = flat_weights(model)
        everyone = hvd_torch.allgather(torch.from_numpy(w)[None]).numpy()
        return all(np.array_equal(everyone[r], everyone[0]) for r in range(size))

    result = {
        "rank": rank,
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "params": int(sum(np.prod(v.shape) for v in model_b.trainable_variables)),
        "modes": modes_out,
        "identical": {"bagua_hvd": identical(model_b), "mwms": identical(model_m)},
        "final_loss": losses,
        "idle_cpu_s": idle_cpu,
    }

    # ---- the gradient reduction alone, four paths, same tensors ----
    shapes = [tuple(v.shape) for v in model_b.trainable_variables]
    rng = np.random.default_rng(99 + rank)
    arrays = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    tf_ts = [tf.constant(a) for a in arrays]
    torch_ts = [torch.from_numpy(a.copy()) for a in arrays]
    torch_ts_inplace = [torch.from_numpy(a.copy()) for a in arrays]
    np_ts = [np.asarray(t) for t in tf_ts]  # the views a numpy_function would get
    result["grad_mb"] = sum(a.nbytes for a in arrays) / 1e6
    result["grad_tensors"] = len(arrays)

    def traced(kernel: bool):
        # The path is chosen at trace time (mpi_ops._collective_kernel): trace now.
        mpi_ops._collective_kernel[0] = kernel
        try:
            f = tf.function(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Average))
            f.get_concrete_function(tf_ts)
        finally:
            mpi_ops._collective_kernel[0] = True
        return f

    reduce_tf, reduce_tf_numpy = traced(True), traced(False)

    @tf.function
    def reduce_mwms(ts: list) -> list:
        def replica(*a: tf.Tensor) -> list:
            ctx = tf.distribute.get_replica_context()
            # identity: a tensor made in the replica has the replica's device, which the
            # strategy takes as the reduction's destination (the gradients have one too).
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.identity(t) for t in a])

        return strategy.run(replica, args=tuple(ts))

    def reduce_numpy() -> list:
        return collective(
            core_ops.OP_ALLREDUCE, np_ts, what="bench", name="bench.numpy", ps_id=0,
            reduce_op=hvd.Average,
        )[0]  # fmt: skip

    aligned_empty = mpi_ops._empty

    def reduce_tf_copy() -> list:
        # The frontend before its outputs were 64-byte aligned: numpy's own allocation, which
        # TensorFlow copies into a tensor of its own.
        mpi_ops._empty = lambda shape, dtype: np.empty(shape, dtype)
        try:
            return reduce_tf_numpy(tf_ts)
        finally:
            mpi_ops._empty = aligned_empty

    @tf.function
    def tf_floor() -> list:
        return [tf.identity(t) for t in tf_ts]

    reducers = {
        "tf": lambda: reduce_tf(tf_ts),
        "tf_numpy": lambda: reduce_tf_numpy(tf_ts),
        "tf_floor": tf_floor,
        "tf_copy": reduce_tf_copy,
        "numpy": reduce_numpy,
        "torch": lambda: hvd_torch.grouped_allreduce(torch_ts, op=hvd_torch.Average),
        "torch_inplace": lambda: hvd_torch.grouped_allreduce_(
            torch_ts_inplace, op=hvd_torch.Average
        ),
        "mwms": lambda: reduce_mwms(tf_ts),
    }
    times: dict[str, list] = {p: [] for p in (*REDUCERS, "tf_callback")}
    cpu: dict[str, list] = {p: [] for p in REDUCERS}
    faults: dict[str, list] = {p: [] for p in REDUCERS}
    # bagua_hvd's paths (and TF's floor) in a random order per round (the same on every
    # rank), so that no path always follows the same other one; then the strategy's, apart (its gRPC transfers
    # could leave work behind for whatever runs next).
    order_rng = np.random.default_rng(7)
    rounds = []
    for rep in range(args.reduce_reps + 2):  # 2 warm-up rounds (tracing, first-touch)
        rounds.append((rep, [str(p) for p in order_rng.permutation(REDUCERS[:7])]))
    rounds += [(rep, ["mwms"]) for rep in range(args.reduce_reps + 2)]
    for rep, order in rounds:
        for path in order:
            hvd_torch.barrier()
            inner.clear()
            f0 = minor_faults()
            c0 = time.process_time()
            t0 = perf()
            out = reducers[path]()
            dt = perf() - t0
            if rep >= 2:
                times[path].append(dt)
                cpu[path].append(time.process_time() - c0)
                faults[path].append(minor_faults() - f0)
                if path == "tf_numpy":
                    times["tf_callback"].append(sum(inner))
            del out
    mpi_ops._collective = collective
    names = list(times)
    slow = slowest([times[p] for p in names])
    result["reduce_ms"] = {p: statistics.median(slow[i]) * 1e3 for i, p in enumerate(names)}
    slow = slowest([cpu[p] for p in REDUCERS])
    result["reduce_cpu_ms"] = {p: statistics.median(slow[i]) * 1e3 for i, p in enumerate(REDUCERS)}
    slow = slowest([faults[p] for p in REDUCERS])
    result["reduce_faults"] = {p: statistics.median(slow[i]) for i, p in enumerate(REDUCERS)}

    # The paths must compute the same thing: the mean of the ranks' arrays (mwms: the sum).
    outs = {
        "tf": [np.asarray(t) for t in reduce_tf(tf_ts)],
        "tf_numpy": [np.asarray(t) for t in reduce_tf_numpy(tf_ts)],
        "tf_copy": [np.asarray(t) for t in reduce_tf_copy()],
        "tf_floor_input": [np.asarray(t) for t in tf_floor()],
        "numpy": reduce_numpy(),
        "torch": [t.numpy() for t in hvd_torch.grouped_allreduce(torch_ts, op=hvd_torch.Average)],
        # averaged in place again and again: the ranks' mean is a fixed point
        "torch_inplace": [t.numpy() for t in torch_ts_inplace],
        "mwms": [np.asarray(t) / size for t in reduce_mwms(tf_ts)],
    }
    if not all(np.array_equal(g, a) for g, a in zip(outs.pop("tf_floor_input"), arrays)):
        raise RuntimeError("the tf_floor function does not return its inputs")
    for path, got in outs.items():
        for g, ref in zip(got, outs["torch"]):
            if not np.allclose(g, ref, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"the {path} reduction differs from the torch one")

    path = os.environ.get(RESULT_ENV)
    if path is not None and rank == 0:
        with open(os.path.join(path, f"rank{rank:05d}.json"), "w") as f:
            json.dump(result, f)
    elif path is None and rank == 0:
        print(json.dumps(result))
    hvd_torch.barrier()
    hvd.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bench/train.py --framework tf (worker)")
    parser.add_argument("--_worker", action="store_true", required=True)
    for name in ("--np", "--batch-size", "--warmup", "--steps", "--rounds"):
        parser.add_argument(name, type=int, required=True)
    add_args(parser)
    return worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
