"""The one place the Python package reads its configuration from the environment.

Every variable the Python frontends consult is read here, by name, through a function that
parses and validates it; other modules call these functions and never read ``os.environ``
themselves. Writers are elsewhere: the launcher (``bagua_hvd.runner``) builds its workers'
environment, ``bagua_hvd.ray`` applies the driver's to an actor, and ``common.util.env`` sets
variables for a block (Horovod's helper). The core reads its own variables in one C++ place
(native/src/core/config.cc); the TensorFlow kernels (tensorflow/kernels.cc), which run without
Python in the step, read the wait limits and the elastic generation that this module reads
for Python (BAGUA_HVD_OP_TIMEOUT_SECONDS, BAGUA_HVD_WAIT_WARNING_SECONDS,
BAGUA_HVD_ELASTIC_GENERATION) the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Tuple

ALGORITHM_ENV = "BAGUA_HVD_ALGORITHM"
BUCKET_MB_ENV = "BAGUA_HVD_BUCKET_MB"
DEFAULT_BUCKET_MB = 10.0  # BAGUA's default bucket size (BAGUA_DEFAULT_BUCKET_SIZE)
OP_TIMEOUT_ENV = "BAGUA_HVD_OP_TIMEOUT_SECONDS"
WAIT_WARNING_ENV = "BAGUA_HVD_WAIT_WARNING_SECONDS"
GLOO_TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"
DEFAULT_GLOO_TIMEOUT_S = 30.0  # Horovod's default, as native/src/core/config.cc
DEFAULT_WAIT_WARNING_S = 60.0
DYNAMIC_PROCESS_SETS_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"


# ``import horovod`` is bagua_hvd (bagua_hvd.as_horovod; set by ``bagua-run --as-horovod``).
# The start-up hook (bagua_hvd_as_horovod.pth) only tests whether it is in os.environ, by this
# name, before importing anything of the package; its value is read here.
AS_HOROVOD_ENV = "BAGUA_HVD_AS_HOROVOD"


def _text(name: str) -> str:
    return os.environ.get(name, "").strip()


def flag(name: str) -> bool:
    """A boolean variable: unset, empty, ``0``, ``false``, ``no`` and ``off`` mean False."""
    return _text(name).lower() not in ("", "0", "false", "no", "off")


def seconds(name: str, default: float) -> float:
    """A duration in seconds (a number), ``default`` when unset or empty."""
    value = _text(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


def as_horovod() -> bool:
    """``BAGUA_HVD_AS_HOROVOD``: ``import horovod`` resolves to bagua_hvd in this process."""
    return flag(AS_HOROVOD_ENV)


def op_timeout_seconds() -> float:
    """``BAGUA_HVD_OP_TIMEOUT_SECONDS``: a wait on one operation fails after this long (0: no
    limit)."""
    return seconds(OP_TIMEOUT_ENV, 0.0)


def gloo_timeout_seconds() -> float:
    """``HOROVOD_GLOO_TIMEOUT_SECONDS`` (default 30): the core's bound on a wait without
    progress; also the longest :func:`bagua_hvd.common.basics` shutdown waits for work an
    algorithm left in flight."""
    return seconds(GLOO_TIMEOUT_ENV, DEFAULT_GLOO_TIMEOUT_S)


def wait_warning_seconds() -> float:
    """``BAGUA_HVD_WAIT_WARNING_SECONDS``: a wait still blocked after this long warns."""
    return seconds(WAIT_WARNING_ENV, DEFAULT_WAIT_WARNING_S)


def algorithm_name() -> Optional[str]:
    """``BAGUA_HVD_ALGORITHM`` (set by ``bagua-run --algorithm``), None when unset or empty."""
    return _text(ALGORITHM_ENV) or None


def bucket_bytes() -> int:
    """The bucket cap in bytes from ``BAGUA_HVD_BUCKET_MB`` (default 10 MiB; 0: one bucket per
    tensor)."""
    value = _text(BUCKET_MB_ENV)
    try:
        mb = float(value) if value else DEFAULT_BUCKET_MB
    except ValueError:
        raise ValueError(f"{BUCKET_MB_ENV} must be a number of MiB, got {value!r}") from None
    if mb < 0:
        raise ValueError(f"{BUCKET_MB_ENV} must be >= 0, got {value!r}")
    return int(mb * (1 << 20))


# Horovod's autotuner (docs/autotune.md): its variables and defaults
# (horovod/common/parameter_manager.cc).
AUTOTUNE_ENV = "HOROVOD_AUTOTUNE"
DEFAULT_AUTOTUNE_WARMUP_SAMPLES = 3
DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE = 10
DEFAULT_AUTOTUNE_BAYES_OPT_MAX_SAMPLES = 20
DEFAULT_AUTOTUNE_GAUSSIAN_PROCESS_NOISE = 0.8


class AutotuneSettings(NamedTuple):
    """``HOROVOD_AUTOTUNE_*`` as set, and the tunables the user fixed by setting them."""

    log_file: str  #: HOROVOD_AUTOTUNE_LOG ("": none)
    warmup_samples: int  #: HOROVOD_AUTOTUNE_WARMUP_SAMPLES (3)
    steps_per_sample: int  #: HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE (10)
    bayes_opt_max_samples: int  #: HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES (20)
    gaussian_process_noise: float  #: HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE (0.8)
    #: what the user set, which the tuner leaves as set (Horovod's "fixed" parameters): any of
    #: "fusion_threshold_mb", "cycle_time_ms", "cache_enabled", "hierarchical_allreduce",
    #: "bucket_size_mb"
    fixed: dict


def _horovod_text(name: str) -> str:
    """HOROVOD_<name>, else its BAGUA_HVD_<name> alias (the core's order, base/env.cc)."""
    return _text("HOROVOD_" + name) or _text("BAGUA_HVD_" + name)


def _number(name: str, value: str, kind: type, low: float, high: float = float("inf")) -> float:
    try:
        x = kind(value)
    except ValueError:
        x = None
    if x is None or not (low <= x <= high):
        bound = f">= {low}" if high == float("inf") else f"in [{low}, {high}]"
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what} {bound}, got {value!r}")
    return x


def autotune() -> Optional[AutotuneSettings]:
    """``HOROVOD_AUTOTUNE`` (set by ``bagua-run --autotune``) and its companions, validated;
    None when autotuning is off. ValueError naming a variable that is out of range."""
    if not flag(AUTOTUNE_ENV):
        return None

    def read(suffix: str, kind: type, default: float, low: float, high: float = float("inf")):
        name = "HOROVOD_AUTOTUNE_" + suffix
        value = _text(name)
        return default if not value else _number(name, value, kind, low, high)

    fixed: dict = {}
    if value := _horovod_text("FUSION_THRESHOLD"):
        fixed["fusion_threshold_mb"] = int(float(value)) / (1 << 20)
    if value := _horovod_text("CYCLE_TIME"):
        fixed["cycle_time_ms"] = float(value)
    if value := _horovod_text("CACHE_CAPACITY"):
        fixed["cache_enabled"] = int(float(value)) > 0
    if value := _horovod_text("HIERARCHICAL_ALLREDUCE"):
        fixed["hierarchical_allreduce"] = value.lower() not in ("0", "false", "no", "off")
    if _text(BUCKET_MB_ENV):
        fixed["bucket_size_mb"] = bucket_bytes() / (1 << 20)
    return AutotuneSettings(
        log_file=_text("HOROVOD_AUTOTUNE_LOG"),
        warmup_samples=int(read("WARMUP_SAMPLES", int, DEFAULT_AUTOTUNE_WARMUP_SAMPLES, 0)),
        steps_per_sample=int(read("STEPS_PER_SAMPLE", int, DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE, 1)),
        bayes_opt_max_samples=int(
            read("BAYES_OPT_MAX_SAMPLES", int, DEFAULT_AUTOTUNE_BAYES_OPT_MAX_SAMPLES, 1)
        ),
        gaussian_process_noise=read(
            "GAUSSIAN_PROCESS_NOISE", float, DEFAULT_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, 0.0, 1.0
        ),
        fixed=fixed,
    )


TEST_ALGORITHM_DELAY_ENV = "BAGUA_HVD_TEST_ALGORITHM_DELAY"


def test_algorithm_delay() -> str:
    """``BAGUA_HVD_TEST_ALGORITHM_DELAY`` as set (``"ByteGrad:0.05"``: the test hook of
    ``algorithm="auto"``, parsed by :func:`bagua_hvd.common.auto_algorithm.test_delays`)."""
    return _text(TEST_ALGORITHM_DELAY_ENV)


def dynamic_process_sets() -> bool:
    """``HOROVOD_DYNAMIC_PROCESS_SETS``."""
    return flag(DYNAMIC_PROCESS_SETS_ENV)


def set_dynamic_process_sets() -> None:
    """``hvd.init(process_sets="dynamic")``: the core reads the variable at init."""
    os.environ[DYNAMIC_PROCESS_SETS_ENV] = "1"


def elastic() -> bool:
    """``HOROVOD_ELASTIC=1``: the job runs under an elastic driver."""
    return _text("HOROVOD_ELASTIC") == "1"


# The elastic driver's contract with its workers, beside Horovod's variables
# (bagua_hvd.runner.elastic.driver sets them; bagua_hvd.common.elastic reads them here).
ELASTIC_GENERATION_ENV = "BAGUA_HVD_ELASTIC_GENERATION"


def elastic_generation() -> int:
    """The elastic driver's generation of the job this process is in (0 outside elastic jobs):
    the same on every rank of the job, a worker that just joined included."""
    text = _text(ELASTIC_GENERATION_ENV)
    return int(text) if text.isdigit() else 0


ELASTIC_UPDATE_ENV = "BAGUA_HVD_ELASTIC_UPDATE"
ELASTIC_WAIT_ENV = "BAGUA_HVD_ELASTIC_WAIT_SECONDS"


class ElasticWorker(NamedTuple):
    """Where this worker stands in an elastic job (see :func:`elastic_worker`)."""

    hostname: str
    local_rank: int
    generation: int  # the driver's rendezvous generation the current ranks belong to
    first_update: int  # the first host-update notification this process has not seen
    wait_s: float  # the longest wait for the driver's answer at a reset
    store_addr: str
    store_port: int
    secret: str


def elastic_worker() -> ElasticWorker:
    """The elastic contract as the launcher (or the last reset) left it in the environment;
    ValueError naming the variable when it is incomplete."""

    def integer(name: str, default: Optional[int] = None) -> int:
        value = _text(name)
        if not value and default is not None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"HOROVOD_ELASTIC=1, but {name}={value!r} is not an integer: start elastic "
                "jobs with bagua-run --min-np/--host-discovery-script"
            ) from None

    return ElasticWorker(
        hostname=_text("HOROVOD_HOSTNAME") or "localhost",
        local_rank=integer("HOROVOD_LOCAL_RANK", 0),
        generation=integer(ELASTIC_GENERATION_ENV),
        first_update=integer(ELASTIC_UPDATE_ENV, 1),
        wait_s=seconds(ELASTIC_WAIT_ENV, 660.0),
        store_addr=_text("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
        store_port=integer("HOROVOD_GLOO_RENDEZVOUS_PORT"),
        secret=shared_secret(),
    )


def library_override() -> Optional[Path]:
    """``BAGUA_HVD_LIBRARY``: a core library to load instead of the package's."""
    value = _text("BAGUA_HVD_LIBRARY")
    return Path(value) if value else None


def cuda_device_pointers() -> bool:
    """``BAGUA_HVD_CUDA_DEVICE_POINTERS`` (default 1): hand CUDA tensors' device pointers to a
    core built with CUDA; 0 copies them to host memory in the frontend instead."""
    return _text("BAGUA_HVD_CUDA_DEVICE_POINTERS") != "0"


def nccl_library() -> str:
    """``BAGUA_HVD_NCCL_LIBRARY``: the libnccl.so to load (only it); empty: search (the one the
    process has loaded, the nvidia-nccl wheel, the loader's path)."""
    return _text("BAGUA_HVD_NCCL_LIBRARY")


def tf_kernels_enabled() -> bool:
    """``BAGUA_HVD_TF_KERNELS`` (default 1; 0 switches the TensorFlow kernel library off: the
    collectives' numpy_function path, and ImportError for BAGUA's algorithms)."""
    return _text("BAGUA_HVD_TF_KERNELS") != "0"


def cache_dir() -> Path:
    """``$BAGUA_HVD_CACHE_DIR``, else ``$XDG_CACHE_HOME/bagua_hvd``, else
    ``~/.cache/bagua_hvd``."""
    root = _text("BAGUA_HVD_CACHE_DIR")
    if root:
        return Path(root)
    xdg = _text("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "bagua_hvd"


def compiler() -> str:
    """``$CXX`` (default ``g++``), the compiler of the TensorFlow kernels."""
    return _text("CXX") or "g++"


class ForeignLaunch(NamedTuple):
    """A job started by another launcher (mpirun, srun): who, and this process's place."""

    launcher: str
    rank: int
    size: int


# (launcher, rank variable, size variable), in the order looked at. Slurm's step variables
# (set by srun, not by sbatch's batch script) are last: mpirun inside an allocation wins.
_FOREIGN_LAUNCHERS = (
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpirun (MPICH / Intel MPI)", "PMI_RANK", "PMI_SIZE"),
    ("srun (Slurm)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    # LSF's jsrun (IBM's job step manager); its MPI also sets Open MPI's variables.
    ("jsrun (LSF)", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE"),
)


def launcher_size() -> Optional[int]:
    """The job's size as a launcher gave it (HOROVOD_SIZE), None without one (or unreadable)."""
    size = _text("HOROVOD_SIZE")
    return int(size) if size.isdigit() else None


def launcher_rank() -> Optional[int]:
    """This process's rank as its launcher gave it: HOROVOD_RANK (bagua-run), else mpirun's or
    srun's rank variable; None outside a launched job (or unreadable)."""
    rank = _text("HOROVOD_RANK")
    if rank.isdigit():
        return int(rank)
    try:
        foreign = foreign_launch()
    except ValueError:
        return None
    return foreign.rank if foreign is not None else None


def launched_by_bagua_run() -> bool:
    """The launcher's contract (bagua_hvd.runner.bagua_run.job_env) is in the environment."""
    return bool(_text("HOROVOD_GLOO_RENDEZVOUS_ADDR") or _text("HOROVOD_RANK"))


def foreign_launch() -> Optional[ForeignLaunch]:
    """The first of mpirun's and srun's rank variables found, None when there are none."""
    for launcher, rank_var, size_var in _FOREIGN_LAUNCHERS:
        rank, size = _text(rank_var), _text(size_var)
        if rank and size:
            try:
                return ForeignLaunch(launcher, int(rank), int(size))
            except ValueError:
                raise ValueError(
                    f"{launcher}: {rank_var}={rank!r} and {size_var}={size!r} must be integers"
                ) from None
    return None


# Horovod's run-time variables that bagua_hvd accepts but does not act on, and why; init() names
# those that are set in one warning per process (docs/environment.md). ``asks``: whether the value
# asks for something (a boolean switched off asks for Horovod's default, which holds here).
_ASKS_ANY: Callable[[str], bool] = bool


def _ASKS_TRUE(value: str) -> bool:  # noqa: N802 - a constant of the table below
    return value.lower() not in ("0", "false", "no", "off")


NO_EFFECT_VARIABLES: Tuple[Tuple[str, Callable[[str], bool], str], ...] = (
    ("HOROVOD_HIERARCHICAL_ALLGATHER", _ASKS_TRUE, "bagua_hvd's allgather has one algorithm"),
    ("HOROVOD_TORUS_ALLREDUCE", _ASKS_TRUE,
     "there is no torus allreduce here: HOROVOD_HIERARCHICAL_ALLREDUCE serves hosts of "
     "several GPUs"),
    ("HOROVOD_NUM_NCCL_STREAMS", _ASKS_ANY,
     "the CUDA engine runs NCCL on one stream of its own per device"),
    ("HOROVOD_THREAD_AFFINITY", _ASKS_ANY, "the core does not pin its background thread"),
    # Without HOROVOD_CPU_OPERATIONS=mpi it is acted on: bootstrap.prepare initializes MPI
    # with MPI_THREAD_SINGLE.
    ("HOROVOD_MPI_THREADS_DISABLE", lambda v: _ASKS_TRUE(v) and cpu_operations() == "mpi",
     "with HOROVOD_CPU_OPERATIONS=mpi the core's background thread calls MPI, which needs "
     "MPI_THREAD_SERIALIZED or more"),
    ("HOROVOD_DISABLE_GROUP_FUSION", _ASKS_TRUE,
     "the core fuses a group's tensors with other ready tensors of the same kind, always"),
    ("HOROVOD_BATCH_D2D_MEMCOPIES", _ASKS_ANY,
     "the CUDA engine copies each tensor into the fusion buffer with its own copy"),
    ("HOROVOD_ENABLE_ASYNC_COMPLETION", _ASKS_TRUE,
     "CUDA operations always complete asynchronously here (an event the caller's stream waits "
     "on)"),
    ("HOROVOD_ADASUM_MPI_CHUNK_SIZE", _ASKS_ANY,
     "Adasum runs over the core's transports, not in MPI chunks"),
    ("HOROVOD_CCL_CACHE", _ASKS_TRUE, "bagua_hvd has no oneCCL"),
    ("HOROVOD_ENABLE_XLA_OPS", _ASKS_TRUE, "bagua_hvd has no XLA ops"),
    ("HOROVOD_SECRET_KEY", _ASKS_ANY,
     "the job's secret is bagua-run's own (BAGUA_HVD_SECRET), made fresh for every job"),
)  # fmt: skip
# Set by bagua-run for the variables of the flags it already warned about (flags.py).
WARNED_ENV = "BAGUA_HVD_WARNED_VARIABLES"


def no_effect_variables() -> List[Tuple[str, str]]:
    """(variable, why) for each of :data:`NO_EFFECT_VARIABLES` set to a value that asks for
    something, except those bagua-run already warned about."""
    warned = set(_text(WARNED_ENV).split(","))
    out = []
    for name, asks, why in NO_EFFECT_VARIABLES:
        value = _text(name)
        if value and name not in warned and asks(value):
            out.append((name, why))
    return out


def no_effect_warning() -> Optional[str]:
    """One line naming every variable of :func:`no_effect_variables` and why it has no effect,
    grouped by reason; None when there is none."""
    reasons: dict = {}
    for name, why in no_effect_variables():
        reasons.setdefault(why, []).append(name)
    if not reasons:
        return None
    parts = [f"{', '.join(names)} ({why})" for why, names in reasons.items()]
    return "bagua_hvd: these variables have no effect here: " + "; ".join(parts)


def jsm_placement() -> Optional[Tuple[int, int]]:
    """(local rank, local size) of this task as LSF's jsrun placed it (JSM_NAMESPACE_LOCAL_RANK,
    JSM_NAMESPACE_LOCAL_SIZE: its rank among the tasks of its node, and their number); None
    outside jsrun. ValueError naming a variable that is not an integer."""
    names = ("JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE")
    values = [_text(n) for n in names]
    if not all(values):
        return None
    try:
        return int(values[0]), int(values[1])
    except ValueError:
        raise ValueError(
            f"jsrun (LSF): {names[0]}={values[0]!r} and {names[1]}={values[1]!r} must be integers"
        ) from None


def network_interface() -> str:
    """``HOROVOD_GLOO_IFACE`` ("" when unset)."""
    return _text("HOROVOD_GLOO_IFACE")


def cpu_operations() -> str:
    """``HOROVOD_CPU_OPERATIONS`` (or ``BAGUA_HVD_CPU_OPERATIONS``) as set, lower case; "gloo"
    (the core's own transports) when unset. The core validates it (native/src/core/config.cc)."""
    return (_text("HOROVOD_CPU_OPERATIONS") or _text("BAGUA_HVD_CPU_OPERATIONS") or "gloo").lower()


def shared_secret() -> str:
    """``BAGUA_HVD_SECRET`` as set ("" when unset)."""
    return _text("BAGUA_HVD_SECRET")


def set_job(variables: dict) -> None:
    """The launcher's contract, set by the bootstrap under mpirun/srun for the core to read."""
    os.environ.update({k: str(v) for k, v in variables.items()})


def slurm_step() -> dict:
    """srun's variables of this task ("" where unset): job and step ids, the step's node list
    and tasks per node, this task's node index, local id and node name."""
    names = {
        "job_id": "SLURM_JOB_ID",
        "step_id": "SLURM_STEP_ID",
        "nodelist": "SLURM_STEP_NODELIST",
        "tasks_per_node": "SLURM_STEP_TASKS_PER_NODE",
        "node_id": "SLURM_NODEID",
        "local_id": "SLURM_LOCALID",
        "nodename": "SLURMD_NODENAME",
    }
    out = {key: _text(var) for key, var in names.items()}
    out["nodelist"] = out["nodelist"] or _text("SLURM_JOB_NODELIST")
    out["tasks_per_node"] = out["tasks_per_node"] or _text("SLURM_TASKS_PER_NODE")
    return out


def rendezvous_endpoint() -> Optional[Tuple[str, int]]:
    """``HOROVOD_GLOO_RENDEZVOUS_ADDR`` and ``HOROVOD_GLOO_RENDEZVOUS_PORT`` (set by the launcher,
    or by the bootstrap under mpirun/srun); None outside a launched job or when either is unset
    or the port is not a number."""
    addr, port = _text("HOROVOD_GLOO_RENDEZVOUS_ADDR"), _text("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port.isdigit():
        return None
    return addr, int(port)


# bagua_hvd.spark.run (Horovod's variable for its start timeout, and the host override).
SPARK_START_TIMEOUT_ENV = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_SPARK_START_TIMEOUT_S = 600.0  # Horovod's default
SPARK_HOST_ENV = "BAGUA_HVD_SPARK_HOST"


def spark_start_timeout() -> float:
    """``HOROVOD_SPARK_START_TIMEOUT`` (default 600): seconds for the Spark tasks of
    ``bagua_hvd.spark.run`` to start and register; ValueError when it is not a positive
    number."""
    value = seconds(SPARK_START_TIMEOUT_ENV, DEFAULT_SPARK_START_TIMEOUT_S)
    if not value > 0:
        raise ValueError(f"{SPARK_START_TIMEOUT_ENV} must be a positive number of seconds")
    return value


def spark_host() -> str:
    """``BAGUA_HVD_SPARK_HOST`` ("" when unset): the host name by which a Spark executor's
    ranks are grouped (local rank, local size) instead of the machine's hostname; set it apart
    for containers that share a hostname but not memory."""
    return _text(SPARK_HOST_ENV)
