"""Horovod's autotuner (``HOROVOD_AUTOTUNE=1``, ``bagua-run --autotune``; docs/autotune.md).

The core measures and applies (native/src/core/autotune.h): on rank 0 it scores samples of
``HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE`` steps as Horovod does (bytes reduced per microsecond, the
median of five samples) and sets what this module decides from the next negotiation cycle on,
the same on every rank. This module decides, on rank 0, in a thread of its own, with Horovod's
procedure (horovod/common/parameter_manager.cc): ``HOROVOD_AUTOTUNE_WARMUP_SAMPLES`` scores are
dropped; then the fusion threshold and cycle time (and bagua_hvd's bucket size) are tuned
jointly by Bayesian optimisation, four fixed test points first, for
``HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` scores, under each setting of the categorical
tunables in turn (hierarchical allreduce, response cache); the best setting seen is kept. A
tunable the user set (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``,
``HOROVOD_CACHE_CAPACITY``, ``HOROVOD_HIERARCHICAL_ALLREDUCE``, ``BAGUA_HVD_BUCKET_MB``) stays
as set. The Gaussian process is scikit-learn's, imported only when autotuning is on.

The bucket size is the frontends': rank 0's current value is broadcast at each optimizer step
while tuning goes on (:func:`agree_bucket_bytes`), so that every rank plans its buckets anew at
the same step.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bagua_hvd.common import config

MB = 1 << 20
# Horovod's CSV columns; bagua_hvd's bucket size before the score.
CSV_HEADER = (
    "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
    "cycle_time_ms,tensor_fusion_threshold,bucket_size_mb,score"
)
# The joint numeric tunables: Horovod's bounds and test points (fusion MB, cycle ms), with a
# bucket size (MiB) beside each; the first test point is the one warm-up runs with.
JOINT_BOUNDS = {"fusion_threshold_mb": (0.0, 64.0), "cycle_time_ms": (1.0, 100.0),
                "bucket_size_mb": (1.0, 64.0)}  # fmt: skip
TEST_POINTS = [
    {"fusion_threshold_mb": 4.0, "cycle_time_ms": 5.0, "bucket_size_mb": 10.0},
    {"fusion_threshold_mb": 32.0, "cycle_time_ms": 50.0, "bucket_size_mb": 25.0},
    {"fusion_threshold_mb": 16.0, "cycle_time_ms": 25.0, "bucket_size_mb": 4.0},
    {"fusion_threshold_mb": 8.0, "cycle_time_ms": 10.0, "bucket_size_mb": 1.0},
]
XI = 0.01  # Horovod's exploration term of the expected improvement
CANDIDATES = 2048  # random points where the acquisition is evaluated
RESTARTS = 3  # the best of them, refined by L-BFGS


def _fmt(x: float) -> str:
    """A number as C++'s ostream writes a double (6 significant digits), as Horovod's log."""
    return f"{x:g}"


class Categorical:
    """Horovod's CategoricalParameter: each value in turn, one score each; when all have been
    tried the value returns to the first and the next tunable of the chain moves on."""

    def __init__(self, values: Sequence[Any], fixed: Any = None) -> None:
        self.values = list(values)
        self.tunable = fixed is None
        self.value = self.values[0] if fixed is None else fixed
        self.best_value = self.value
        self.best_score = 0.0
        self.index = 0

    def tune(self, score: float) -> Tuple[bool, float]:
        """(whether this tunable went through all its values, the best score so far)."""
        if score > self.best_score:
            self.best_score, self.best_value = score, self.value
        if not self.tunable:
            return True, self.best_score
        self.index += 1
        if self.index < len(self.values):
            self.value = self.values[self.index]
            return False, self.best_score
        self.index, self.value = 0, self.values[0]
        return True, self.best_score


class Joint:
    """Horovod's BayesianParameter: numeric tunables tuned together, the fixed test points
    first, then the maximum of the expected improvement under a Gaussian process fitted to the
    scores, ``max_samples`` scores per pass of the chain."""

    def __init__(
        self, names: Sequence[str], fixed: Dict[str, float], max_samples: int, noise: float,
        seed: int = 0,
    ) -> None:  # fmt: skip
        self.fixed = {n: v for n, v in fixed.items() if n in names}
        self.free = [n for n in names if n not in self.fixed]
        self.tunable = bool(self.free)
        self.max_samples = max_samples
        self.noise = noise
        self.points = [[p[n] for n in self.free] for p in TEST_POINTS]
        self.value = list(self.points[0])
        self.best_value = list(self.value)
        self.best_score = 0.0
        self.xs: List[List[float]] = []
        self.ys: List[float] = []
        import numpy as np

        self._rng = np.random.default_rng(seed)

    def get(self, name: str, best: bool = False) -> float:
        if name in self.fixed:
            return self.fixed[name]
        return (self.best_value if best else self.value)[self.free.index(name)]

    def tune(self, score: float) -> Tuple[bool, float]:
        if score > self.best_score:
            self.best_score, self.best_value = score, list(self.value)
        if not self.tunable:
            return True, self.best_score
        self.xs.append(list(self.value))
        self.ys.append(score)
        n = len(self.ys)
        if n >= self.max_samples:
            self.value = list(self.points[0])
            self.xs, self.ys = [], []
            return True, self.best_score
        self.value = list(self.points[n]) if n < len(self.points) else self.next_sample()
        return False, self.best_score

    def next_sample(self) -> List[float]:
        """Where the expected improvement is greatest (Horovod's BayesianOptimization)."""
        import numpy as np
        from scipy.optimize import minimize
        from scipy.stats import norm
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel

        bounds = [JOINT_BOUNDS[n] for n in self.free]
        lo = np.array([b[0] for b in bounds])
        hi = np.array([b[1] for b in bounds])
        # The GP works in the unit cube: one length scale then suits every tunable, whatever
        # its unit (Horovod's works in MB and ms, where the fusion threshold's 64 and the cycle
        # time's 100 weigh alike only by chance).
        x = (np.array(self.xs, dtype=float) - lo) / (hi - lo)
        y = np.array(self.ys, dtype=float)
        if len(y) >= 3:  # Horovod normalises the scores from three on
            sigma = float(y.std()) or 1.0
            y = (y - y.mean()) / sigma
        # Horovod's kernel: squared exponential, one length for every dimension, its scale and
        # length fitted by maximum likelihood; the noise on the diagonal is alpha squared.
        gp = GaussianProcessRegressor(
            kernel=ConstantKernel(1.0, (1e-3, 1e3)) * RBF(1.0, (1e-2, 1e3)),
            alpha=max(self.noise, 1e-5) ** 2,
            random_state=0,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a length scale at its bound is no news here
            gp.fit(x, y)
        best_mu = float(gp.predict(x).max())

        def expected_improvement(points: Any) -> Any:
            mu, sd = gp.predict(np.atleast_2d(points), return_std=True)
            imp = mu - best_mu - XI
            with np.errstate(divide="ignore", invalid="ignore"):
                z = np.where(sd > 0, imp / sd, 0.0)
            return np.where(sd > 0, imp * norm.cdf(z) + sd * norm.pdf(z), 0.0)

        # Horovod restarts L-BFGS from 25 random points; the same search costs a tenth when a
        # few thousand random points are scored at once and L-BFGS starts from the best few.
        candidates = self._rng.random((CANDIDATES, len(bounds)))
        ei = expected_improvement(candidates)
        starts = candidates[np.argsort(-ei)[:RESTARTS]]
        best_x, best_ei = starts[0], float(ei.max())
        for s in starts:
            r = minimize(lambda p: -float(expected_improvement(p)[0]), s, method="L-BFGS-B",
                         bounds=[(0.0, 1.0)] * len(bounds), options={"maxiter": 100})  # fmt: skip
            if -r.fun > best_ei:
                best_ei, best_x = -r.fun, r.x
        return [float(v) for v in lo + (hi - lo) * np.clip(best_x, 0.0, 1.0)]


class ParameterManager:
    """Horovod's ParameterManager on rank 0: warm-up, then the chain of tunables (joint numeric
    ones first, then each categorical one), the log and the CSV file."""

    def __init__(
        self, settings: config.AutotuneSettings, hierarchical_tunable: bool,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:  # fmt: skip
        self.settings = settings
        fixed = settings.fixed
        self.log = log
        self.warmup_remaining = settings.warmup_samples
        self.active = True
        self.bucket_tunable = False  # until a bucketed optimizer says so (use_buckets)
        self.hierarchical_allreduce = Categorical(
            [False, True],
            fixed.get("hierarchical_allreduce", None if hierarchical_tunable else False),
        )
        # bagua_hvd's allgather has one algorithm and there is no torus allreduce: both are
        # logged as Horovod logs them, never tuned.
        self.hierarchical_allgather = Categorical([False], False)
        self.torus_allreduce = Categorical([False], False)
        self.cache_enabled = Categorical([True, False], fixed.get("cache_enabled"))
        self.joint: Optional[Joint] = None
        self._joint_fixed = {k: v for k, v in fixed.items() if k in JOINT_BOUNDS}
        self._file: Any = None
        if settings.log_file:
            try:
                self._file = open(settings.log_file, "w")  # noqa: SIM115 - open while tuning
                self._file.write(CSV_HEADER + "\n")
                self._file.flush()
            except OSError as e:
                log(f"Autotuner: cannot write {settings.log_file}: {e}")
                self._file = None
        log(
            "Autotuner: Tunable params [hierarchical_allreduce,hierarchical_allgather,"
            "torus_allreduce,cache_enabled,cycle_time_ms,tensor_fusion_threshold,"
            "bucket_size_mb] score"
        )

    # ---- the values -------------------------------------------------------------------------
    def use_buckets(self, on: bool) -> None:
        """Whether the bucket size is tuned (a bucketed optimizer exists); fixed at the first
        score after warm-up, when the joint tunables are formed."""
        self.bucket_tunable = on and "bucket_size_mb" not in self.settings.fixed

    def _joint_value(self, name: str, best: bool = False) -> float:
        if self.joint is not None and (name in self.joint.free or name in self.joint.fixed):
            return self.joint.get(name, best)
        return self._joint_fixed.get(name, TEST_POINTS[0][name])

    def params(self) -> Dict[str, Any]:
        """The values in effect: the current ones while tuning, the best ones after."""
        best = not self.active
        pick = (lambda p: p.best_value) if best else (lambda p: p.value)  # noqa: E731
        bucket = self._joint_value("bucket_size_mb", best)
        if not self.bucket_tunable:
            bucket = config.bucket_bytes() / MB  # BAGUA_HVD_BUCKET_MB, else BAGUA's default
        return {
            "hierarchical_allreduce": bool(pick(self.hierarchical_allreduce)),
            "hierarchical_allgather": bool(pick(self.hierarchical_allgather)),
            "torus_allreduce": bool(pick(self.torus_allreduce)),
            "cache_enabled": bool(pick(self.cache_enabled)),
            "cycle_time_ms": float(self._joint_value("cycle_time_ms", best)),
            "fusion_threshold_mb": float(self._joint_value("fusion_threshold_mb", best)),
            "bucket_size_mb": float(bucket),
        }

    def _row(self, p: Dict[str, Any], score: float) -> Tuple[str, str]:
        flags = [p["hierarchical_allreduce"], p["hierarchical_allgather"], p["torus_allreduce"],
                 p["cache_enabled"]]  # fmt: skip
        nums = [p["cycle_time_ms"], p["fusion_threshold_mb"], p["bucket_size_mb"]]
        text = (
            "[" + ", ".join(str(int(f)) for f in flags) + f", {_fmt(nums[0])} ms, "
            f"{_fmt(nums[1])} mb, {_fmt(nums[2])} mb] {_fmt(score)}"
        )
        csv = ",".join([str(int(f)) for f in flags] + [_fmt(v) for v in nums] + [_fmt(score)])
        return text, csv

    def _write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    # ---- Horovod's Tune ---------------------------------------------------------------------
    def update(self, score: float) -> bool:
        """One score of the values in effect; returns whether tuning goes on."""
        if not self.active:
            return False
        if self.warmup_remaining > 0:
            self.warmup_remaining -= 1
            self.log(f"Autotuner: Warming up ({self.warmup_remaining} remaining)")
            return True
        if self.joint is None:
            names = [n for n in JOINT_BOUNDS if n != "bucket_size_mb" or self.bucket_tunable]
            self.joint = Joint(names, self._joint_fixed, self.settings.bayes_opt_max_samples,
                               self.settings.gaussian_process_noise)  # fmt: skip
        text, csv = self._row(self.params(), score)
        self.log("Autotuner: " + text)
        self._write(csv)
        best = score
        for param in (self.joint, self.hierarchical_allreduce, self.hierarchical_allgather,
                      self.torus_allreduce, self.cache_enabled):  # fmt: skip
            finished, best = param.tune(best)
            if not finished:
                return True
        self.active = False
        text, csv = self._row(self.params(), self.joint.best_score)
        self.log("Autotuner: Best params " + text)
        self._write(csv)
        self.close()
        return False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---- rank 0's tuner thread, and the frontends' side -------------------------------------------
class _State:
    thread: Optional[threading.Thread] = None
    lock = threading.Lock()  # guards the fields below, never held while the tuner computes
    buckets_used = False
    #: rank 0's (bucket size in bytes or None when not tuned, whether tuning goes on)
    bucket: Tuple[Optional[int], bool] = (None, False)


def _log(line: str) -> None:
    from bagua_hvd.common import _native

    _native.lib().bhvd_log(2, line.encode())


def _propose(lib: Any, ffi: Any, manager: ParameterManager, active: bool) -> None:
    p = manager.params()
    with _State.lock:
        bucket = int(p["bucket_size_mb"] * MB) if manager.bucket_tunable else None
        _State.bucket = (bucket, active)
    params = ffi.new("bhvd_autotune_params*")
    params.hierarchical_allreduce = int(p["hierarchical_allreduce"])
    params.cache_enabled = int(p["cache_enabled"])
    params.cycle_time_ms = p["cycle_time_ms"]
    params.fusion_threshold = int(p["fusion_threshold_mb"] * MB)
    if lib.bhvd_autotune_propose(params, 1 if active else 0) != 0:
        from bagua_hvd.common import _native

        raise RuntimeError(f"autotune: {_native.last_error()}")


def _run(manager: ParameterManager, lib: Any, ffi: Any) -> None:
    score = ffi.new("double*")
    got = ffi.new("int32_t*")
    try:
        while True:
            if lib.bhvd_autotune_next_score(score, 200, got) != 0:
                return  # the job stopped
            if not got[0]:
                continue
            try:
                with _State.lock:
                    buckets_used = _State.buckets_used
                manager.use_buckets(buckets_used)
                active = manager.update(float(score[0]))
            except Exception as e:  # noqa: BLE001 - the job goes on with the values in effect
                lib.bhvd_log(4, f"Autotuner: stopped by an error: {e!r}".encode())
                manager.active = active = False
            _propose(lib, ffi, manager, active)
            if not active:
                return
    finally:
        manager.close()


def check() -> Optional[config.AutotuneSettings]:
    """Before init() forms a job, on every rank: the variables validated (ValueError naming
    one) and scikit-learn importable (ImportError), so that every rank fails alike; None when
    autotuning is off."""
    settings = config.autotune()
    if settings is not None:
        try:
            import sklearn  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "HOROVOD_AUTOTUNE=1 needs scikit-learn for its Gaussian process: "
                f"pip install scikit-learn ({e})"
            ) from None
    return settings


def start(rank: int, hierarchical_tunable: bool) -> None:
    """After init() formed a job: on rank 0, with ``HOROVOD_AUTOTUNE`` set, the tuner starts
    (a job's tuning starts afresh after an elastic reset)."""
    stop()
    settings = config.autotune()
    if settings is None or rank != 0:
        return
    from bagua_hvd.common import _native

    lib, ffi = _native.lib(), _native.ffi
    if lib.bhvd_autotune_start(settings.steps_per_sample) != 0:
        raise ValueError(_native.last_error())
    manager = ParameterManager(settings, hierarchical_tunable, _log)
    _propose(lib, ffi, manager, True)  # warm-up runs with the first test point
    thread = threading.Thread(target=_run, args=(manager, lib, ffi), name="bhvd_autotune",
                              daemon=True)  # fmt: skip
    _State.thread = thread
    thread.start()


def stop() -> None:
    """After shutdown: the previous job's tuner thread has returned (the core ended its wait)."""
    thread, _State.thread = _State.thread, None
    if thread is not None:
        thread.join(timeout=5)
    with _State.lock:
        _State.bucket = (None, False)


def tunes_buckets() -> bool:
    """Whether this job tunes the bucket size: ``HOROVOD_AUTOTUNE`` on and
    ``BAGUA_HVD_BUCKET_MB`` unset. The same answer on every rank."""
    settings = config.autotune()
    return settings is not None and "bucket_size_mb" not in settings.fixed


def use_buckets() -> None:
    """A frontend's optimizer buckets its gradients: the tuner tunes the bucket size too (if
    it has not formed its joint tunables yet)."""
    with _State.lock:
        _State.buckets_used = True


def rank0_bucket_state(default_bytes: int) -> Tuple[int, bool]:
    """On rank 0: (the bucket size in bytes to run now, whether tuning goes on)."""
    with _State.lock:
        bucket, active = _State.bucket
    return (default_bytes if bucket is None else bucket), active
