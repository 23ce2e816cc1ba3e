"""bagua-run's command line: every horovodrun (Horovod 0.28.1) flag, in horovodrun's groups,
then bagua_hvd's own; horovodrun's ``--config-file`` YAML; the variables the flags give the
ranks (``tuning_env``, what horovodrun sets) and the one warning naming the flags bagua_hvd
accepts but cannot honour (``no_effect_warning``). Checks that need the hosts or the
environment are in ``bagua_hvd.runner.bagua_run.parse_args``.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional, Tuple

from bagua_hvd.version import __version__

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
TRANSPORTS = ("auto", "shm", "tcp")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535, got {value}")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(LOG_LEVELS)})"
        )
    return level


# bagua_hvd.torch.algorithms.from_name's names (QAdam needs its own optimizer: code only). Kept
# here so that the launcher does not import torch.
ALGORITHM_NAMES = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "async",
    "auto",
)


class _Given(argparse.Action):
    """Stores a flag's value (``const`` for a flag without one) and records its destination in
    ``namespace.given``: horovodrun's rule that a flag on the command line wins over
    ``--config-file``, wherever the two appear."""

    def __init__(self, option_strings, dest, nargs=None, const=None, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.given = namespace.given | {self.dest}


def _switch(group, on: str, off: str, dest: str, help_on: str, help_off: Optional[str]) -> None:
    """A pair of mutually exclusive flags setting ``dest`` to True / False (None: neither)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(on, dest=dest, action=_Given, nargs=0, const=True, help=help_on)
    pair.add_argument(
        off,
        dest=dest,
        action=_Given,
        nargs=0,
        const=False,
        help=help_off if help_off is not None else argparse.SUPPRESS,
    )


class _Nics(argparse.Action):
    """--network-interfaces / --network-interface: one ordered list, comma-separated values split."""

    def __call__(self, parser, namespace, values, option_string=None):
        nics = list(namespace.nics or [])
        for nic in values.split(","):
            nic = nic.strip()
            if nic and nic not in nics:
                nics.append(nic)
        namespace.nics = nics


def _unit_float(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def make_parser() -> argparse.ArgumentParser:
    """The argument parser: horovodrun's flags in horovodrun's groups, then bagua_hvd's own
    (unknown flags are errors; the command starts at the first word that is not a flag)."""
    parser = argparse.ArgumentParser(
        prog="bagua-run",
        allow_abbrev=False,
        description="Launch a bagua_hvd (Horovod-compatible) job: runs COMMAND once per rank. "
        "Takes every horovodrun flag; those bagua_hvd cannot honour are named in one warning.",
    )
    parser.set_defaults(given=frozenset())
    parser.add_argument(
        "-v",
        "--version",
        action="version",
        version=__version__,
        help="print the bagua_hvd version and exit",
    )
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=_positive_int,
        help="total number of ranks (processes) of the job",
    )
    parser.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="show the frameworks, controllers, transports and GPU support "
        "this installation has, and exit",
    )
    parser.add_argument(
        "--disable-cache",
        action="store_true",
        help="bagua-run checks the hosts on every start and caches nothing, as this asks",
    )
    parser.add_argument(
        "--start-timeout",
        type=_positive_int,
        default=None,
        help="seconds to wait for the job to start (the hosts' checks, the rendezvous server "
        "of node 0); default 30 or HOROVOD_START_TIMEOUT",
    )
    parser.add_argument(
        "--network-interfaces",
        dest="nics",
        action=_Nics,
        metavar="NICS",
        help="comma-separated interfaces for TCP traffic, repeatable; the first one is used "
        "(HOROVOD_GLOO_IFACE; all of them in NCCL_SOCKET_IFNAME)",
    )
    parser.add_argument(
        "--network-interface",
        dest="nics",
        action=_Nics,
        metavar="NIC",
        help="one interface for TCP traffic, repeatable (as --network-interfaces)",
    )
    parser.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each rank's output to DIR/rank.<rank>/stdout|stderr",
    )
    parser.add_argument("--verbose", action="store_true", help="log what the launcher does")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the command each rank runs, e.g. python train.py"
    )
    parser.add_argument(
        "--config-file",
        metavar="FILE",
        help="horovodrun's YAML file of settings (sections params, autotune, timeline, "
        "stall_check, library_options, logging; key controller); a flag given on the command "
        "line wins over the file",
    )

    ssh = parser.add_argument_group("SSH arguments")
    ssh.add_argument(
        "-p", "--ssh-port", type=_port, help="ssh port of the other hosts (default: ssh's)"
    )
    ssh.add_argument(
        "-i",
        "--ssh-identity-file",
        metavar="FILE",
        help="ssh private key for the other hosts (default: ssh's)",
    )

    params = parser.add_argument_group("tuneable parameter arguments")
    params.add_argument(
        "--fusion-threshold-mb",
        action=_Given,
        type=_non_negative_int,
        metavar="MB",
        help="tensor fusion buffer in MB, 0 disables fusion "
        "(HOROVOD_FUSION_THRESHOLD; default 128)",
    )
    params.add_argument(
        "--cycle-time-ms",
        action=_Given,
        type=_non_negative_float,
        metavar="MS",
        help="fusion cycle time in ms (HOROVOD_CYCLE_TIME; default 1)",
    )
    params.add_argument(
        "--cache-capacity",
        action=_Given,
        type=_non_negative_int,
        metavar="N",
        help="response cache entries, 0 disables it (HOROVOD_CACHE_CAPACITY; default 1024)",
    )
    _switch(
        params,
        "--hierarchical-allreduce",
        "--no-hierarchical-allreduce",
        "hierarchical_allreduce",
        "allreduce within each host, among one rank per host, then within the host "
        "again, on CPU and CUDA tensors (HOROVOD_HIERARCHICAL_ALLREDUCE=1; no effect on one host)",
        "a flat allreduce over all ranks (HOROVOD_HIERARCHICAL_ALLREDUCE=0, the default)",
    )
    _switch(
        params,
        "--hierarchical-allgather",
        "--no-hierarchical-allgather",
        "hierarchical_allgather",
        "no effect here: bagua_hvd's allgather has one algorithm "
        "(HOROVOD_HIERARCHICAL_ALLGATHER is still set)",
        "the default: a flat allgather (HOROVOD_HIERARCHICAL_ALLGATHER=0)",
    )
    _switch(
        params,
        "--torus-allreduce",
        "--no-torus-allreduce",
        "torus_allreduce",
        "no effect here: there is no torus allreduce; --hierarchical-allreduce serves hosts of "
        "several GPUs (HOROVOD_TORUS_ALLREDUCE is still set)",
        "the default: no torus allreduce (HOROVOD_TORUS_ALLREDUCE=0)",
    )

    autotune = parser.add_argument_group("autotune arguments")
    _switch(
        autotune,
        "--autotune",
        "--no-autotune",
        "autotune",
        "tune the fusion threshold, cycle time, response cache, hierarchical allreduce and "
        "bucket size online: Horovod's autotuner (HOROVOD_AUTOTUNE=1; docs/autotune.md)",
        None,
    )
    autotune.add_argument(
        "--autotune-log-file",
        action=_Given,
        metavar="FILE",
        help="rank 0 writes each tuned setting and its score to this CSV file "
        "(HOROVOD_AUTOTUNE_LOG; with --autotune)",
    )
    for name, minimum, text in (
        ("warmup-samples", _non_negative_int,
         "scores dropped before tuning starts (default 3; HOROVOD_AUTOTUNE_WARMUP_SAMPLES)"),
        ("steps-per-sample", _positive_int,
         "steps per sample; the score is the median of five samples (default 10; "
         "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE)"),
        ("bayes-opt-max-samples", _positive_int,
         "scores of the Bayesian optimisation per setting of the other tunables (default 20; "
         "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES)"),
    ):  # fmt: skip
        autotune.add_argument(
            f"--autotune-{name}",
            action=_Given,
            type=minimum,
            metavar="N",
            help=text + "; with --autotune",
        )
    autotune.add_argument(
        "--autotune-gaussian-process-noise",
        action=_Given,
        type=_unit_float,
        metavar="X",
        help="the Gaussian process's noise, in [0, 1] (default 0.8; "
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE); with --autotune",
    )

    elastic = parser.add_argument_group("elastic arguments")
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_num_proc",
        type=int,
        metavar="N",
        help="minimum number of processes of an elastic job (default: -np); makes the job elastic",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_num_proc",
        type=int,
        metavar="N",
        help="maximum number of processes of an elastic job (default: every available slot)",
    )
    elastic.add_argument(
        "--slots-per-host",
        dest="slots",
        type=int,
        metavar="N",
        help="slots of a host the discovery script names without ':N'",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=int,
        metavar="S",
        help="seconds an elastic job waits for --min-np slots (default: "
        "HOROVOD_ELASTIC_TIMEOUT, else 600)",
    )
    elastic.add_argument(
        "--reset-limit",
        type=int,
        metavar="N",
        help="the most times an elastic job may re-form (default: no limit)",
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        dest="cooldown_range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="a failed host may come back after a cooldown of MIN..MAX seconds, growing "
        "with each failure (default: blacklisted for good)",
    )

    timeline = parser.add_argument_group("timeline arguments")
    timeline.add_argument(
        "--timeline-filename",
        action=_Given,
        metavar="FILE",
        help="rank 0 writes Horovod's timeline (Chrome trace JSON) to FILE (HOROVOD_TIMELINE)",
    )
    _switch(
        timeline,
        "--timeline-mark-cycles",
        "--no-timeline-mark-cycles",
        "timeline_mark_cycles",
        "cycle markers in the timeline (HOROVOD_TIMELINE_MARK_CYCLES; with "
        "--timeline-filename only)",
        None,
    )

    stall = parser.add_argument_group("stall check arguments")
    _switch(
        stall,
        "--no-stall-check",
        "--stall-check",
        "no_stall_check",
        "no warning about ranks that have not submitted a tensor the others wait on "
        "(HOROVOD_STALL_CHECK_DISABLE=1)",
        None,
    )
    stall.add_argument(
        "--stall-check-warning-time-seconds",
        action=_Given,
        type=_non_negative_int,
        metavar="S",
        help="seconds before a stall is reported on stderr "
        "(HOROVOD_STALL_CHECK_TIME_SECONDS; default 60)",
    )
    stall.add_argument(
        "--stall-check-shutdown-time-seconds",
        action=_Given,
        type=_non_negative_int,
        metavar="S",
        help="seconds of stall after which the job fails, when more than the warning time "
        "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; default 0: never)",
    )

    library = parser.add_argument_group("library arguments")
    _switch(
        library,
        "--mpi-threads-disable",
        "--no-mpi-threads-disable",
        "mpi_threads_disable",
        "with --mpi: MPI is initialized with MPI_THREAD_SINGLE, unless "
        "HOROVOD_CPU_OPERATIONS=mpi (the core's background thread then calls MPI); no effect "
        "without --mpi (HOROVOD_MPI_THREADS_DISABLE)",
        None,
    )
    library.add_argument(
        "--mpi-args",
        metavar="ARGS",
        help="extra arguments for mpirun (with --mpi), as one string, e.g. "
        '--mpi-args="--map-by ppr:4:node"',
    )
    library.add_argument(
        "--tcp",
        dest="tcp_flag",
        action="store_true",
        help="no InfiniBand: NCCL (CUDA tensors) gets NCCL_IB_DISABLE=1, as with horovodrun; "
        "the core's own transports never use it (TCP between hosts, shared memory within one "
        "unless --transport tcp)",
    )
    library.add_argument(
        "--binding-args",
        metavar="ARGS",
        help="process binding arguments for Open MPI's mpirun (with --mpi), as one string",
    )
    library.add_argument(
        "--num-nccl-streams",
        action=_Given,
        type=_non_negative_int,
        metavar="N",
        help="no effect here: the CUDA engine runs NCCL on one stream of its own per device "
        "(HOROVOD_NUM_NCCL_STREAMS is still set)",
    )
    library.add_argument(
        "--thread-affinity",
        action=_Given,
        type=_non_negative_int,
        metavar="CPU",
        help="no effect here: the core does not pin its background thread "
        "(HOROVOD_THREAD_AFFINITY is still set)",
    )
    library.add_argument(
        "--gloo-timeout-seconds",
        action=_Given,
        type=_non_negative_int,
        metavar="S",
        help="timeout of rendezvous, connection set-up and waits without progress "
        "(HOROVOD_GLOO_TIMEOUT_SECONDS; default 30)",
    )

    logging = parser.add_argument_group("logging arguments")
    logging.add_argument(
        "--log-level",
        action=_Given,
        type=_log_level,
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="core log level (HOROVOD_LOG_LEVEL; default WARNING)",
    )
    stamps = logging.add_mutually_exclusive_group()
    stamps.add_argument(
        "--log-with-timestamp",
        dest="log_with_timestamp",
        action=_Given,
        nargs=0,
        const=True,
        help=argparse.SUPPRESS,
    )
    stamps.add_argument(
        "--log-without-timestamp",
        dest="log_with_timestamp",
        action=_Given,
        nargs=0,
        const=False,
        help="core log lines without their time (HOROVOD_LOG_HIDE_TIME=1)",
    )
    stamps.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_output_with_timestamp",
        action="store_true",
        help="start each line of the ranks' output with the time",
    )
    for flag, with_time in (("--log-hide-timestamp", False), ("--no-log-hide-timestamp", True)):
        stamps.add_argument(  # horovodrun's deprecated spellings
            flag,
            dest="log_with_timestamp",
            action=_Given,
            nargs=0,
            const=with_time,
            help=argparse.SUPPRESS,
        )

    hosts_group = parser.add_argument_group("host arguments")
    hosts = hosts_group.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        help="host list HOST1:SLOTS,HOST2:SLOTS (default localhost:NP); other hosts are "
        "started over ssh, ranks fill the hosts in the order given",
    )
    hosts.add_argument(
        "-hostfile",
        "--hostfile",
        metavar="FILE",
        help="file with one 'HOST slots=N' per line, instead of -H",
    )
    hosts.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="prints the available hosts, one 'HOST[:SLOTS]' per line; polled every second; "
        "makes the job elastic",
    )

    controller_group = parser.add_argument_group("controller arguments")
    controller = controller_group.add_mutually_exclusive_group()
    controller.add_argument(
        "--gloo", action="store_true", help="bagua-run starts the ranks itself (the default)"
    )
    controller.add_argument(
        "--mpi",
        action="store_true",
        help="start the ranks with the system's mpirun (Open MPI or MPICH); each rank joins "
        "the job through MPI (needs mpi4py)",
    )
    controller.add_argument(
        "--jsrun",
        action="store_true",
        help="start the ranks with LSF's jsrun (inside an LSF job; -H/--hostfile name the "
        "compute hosts and their GPUs), as horovodrun; each rank joins the job through MPI",
    )

    bagua = parser.add_argument_group("bagua_hvd arguments (not in horovodrun)")
    bagua.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="auto: shared memory within a host, TCP between hosts; tcp: TCP "
        "everywhere (BAGUA_HVD_TRANSPORT)",
    )
    bagua.add_argument(
        "--algorithm",
        choices=ALGORITHM_NAMES,
        help="one of BAGUA's algorithms, with default arguments, for every "
        "DistributedOptimizer built without algorithm= (BAGUA_HVD_ALGORITHM; "
        "docs/algorithms.md); auto: times a few steps of gradient_allreduce and bytegrad "
        "and keeps the faster, rank 0 printing the measurements",
    )

    bagua.add_argument(
        "--as-horovod",
        action="store_true",
        help="'import horovod' (horovod.torch, horovod.tensorflow.keras, ...) is bagua_hvd in "
        "every rank: unmodified Horovod scripts run (BAGUA_HVD_AS_HOROVOD=1)",
    )

    nodes = parser.add_argument_group("several nodes (one bagua-run per node)")
    nodes.add_argument(
        "--num-nodes",
        type=_positive_int,
        default=1,
        help="number of nodes, each running -np/num-nodes ranks (default 1)",
    )
    nodes.add_argument(
        "--node-rank",
        type=_non_negative_int,
        default=0,
        help="index of this node, 0..num-nodes-1 (node 0 serves the rendezvous)",
    )
    nodes.add_argument(
        "--rendezvous-addr",
        metavar="ADDR:PORT",
        help="address of node 0's rendezvous server (required with --num-nodes "
        "> 1; node 0 listens on PORT)",
    )
    return parser


# --config-file: section -> {key: (destination, kind)}, as horovodrun reads its YAML.
_CONFIG = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", "int"),
        "cycle_time_ms": ("cycle_time_ms", "float"),
        "cache_capacity": ("cache_capacity", "int"),
        "hierarchical_allreduce": ("hierarchical_allreduce", "bool"),
        "hierarchical_allgather": ("hierarchical_allgather", "bool"),
        "torus_allreduce": ("torus_allreduce", "bool"),
    },
    "autotune": {
        "log_file": ("autotune_log_file", "str"),
        "warmup_samples": ("autotune_warmup_samples", "int"),
        "steps_per_sample": ("autotune_steps_per_sample", "int"),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", "int"),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", "unit"),
    },
    "timeline": {
        "filename": ("timeline_filename", "str"),
        "mark_cycles": ("timeline_mark_cycles", "bool"),
    },
    "stall_check": {
        "warning_time_seconds": ("stall_check_warning_time_seconds", "int"),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", "int"),
    },
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", "bool"),
        "num_nccl_streams": ("num_nccl_streams", "int"),
        "thread_affinity": ("thread_affinity", "int"),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", "int"),
    },
    "logging": {
        "level": ("log_level", "level"),
        "with_timestamp": ("log_with_timestamp", "bool"),
    },
}


class ConfigError(ValueError):
    """A --config-file that cannot be read or holds a value of the wrong kind."""


def _config_value(where: str, kind: str, value: object) -> object:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "level" and isinstance(value, str) and value.upper() in LOG_LEVELS:
        return value.upper()
    if kind == "int" and is_number and value == int(value) and value >= 0:
        return int(value)
    if kind == "float" and is_number and value >= 0:
        return float(value)
    if kind == "unit" and is_number and 0 <= value <= 1:
        return float(value)
    wanted = {
        "bool": "true or false",
        "str": "a string",
        "level": "one of " + ", ".join(LOG_LEVELS),
        "int": "an integer >= 0",
        "float": "a number >= 0",
        "unit": "a number in [0, 1]",
    }[kind]
    raise ConfigError(f"{where} must be {wanted}, got {value!r}")


def load_config(path: str) -> dict:
    """horovodrun's YAML settings file as a dict (ConfigError naming the file otherwise)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"--config-file {path}: reading YAML needs PyYAML (pip install pyyaml)"
        ) from None
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config-file {path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config-file {path}: not valid YAML: {e}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(
            f"--config-file {path}: expected a mapping of sections (params, autotune, "
            f"timeline, stall_check, library_options, logging), got {type(config).__name__}"
        )
    return config


def apply_config(args: argparse.Namespace, config: dict, path: str) -> None:
    """Sets what ``config`` (horovodrun's layout) gives, except the flags given on the command
    line (``args.given``), which win as with horovodrun; unknown keys are ignored as there."""
    given = args.given
    controller = config.get("controller")
    if controller and not (args.gloo or args.mpi or args.jsrun):
        name = str(controller).lower()
        if name not in ("gloo", "mpi"):
            raise ConfigError(
                f"--config-file {path}: controller must be gloo or mpi, got {controller!r}"
            )
        setattr(args, name, True)
    for section, keys in _CONFIG.items():
        values = config.get(section)
        if not values:
            continue  # horovodrun skips empty sections
        if not isinstance(values, dict):
            raise ConfigError(f"--config-file {path}: section {section} must be a mapping")
        switch = {"autotune": ("enabled", "autotune", False),
                  "stall_check": ("enabled", "no_stall_check", True)}.get(section)  # fmt: skip
        if switch is not None:
            key, dest, default = switch
            enabled = _config_value(
                f"--config-file {path}: {section}.{key}", "bool", values.get(key, default)
            )
            if dest not in given:
                setattr(args, dest, enabled if dest == "autotune" else not enabled)
        for key, (dest, kind) in keys.items():
            value = values.get(key)
            if value is None or dest in given:
                continue
            setattr(
                args, dest, _config_value(f"--config-file {path}: {section}.{key}", kind, value)
            )


def _bit(value: bool) -> str:
    return "1" if value else "0"


def tuning_env(args: argparse.Namespace) -> Dict[str, str]:
    """The variables the ranks get from the flags and --config-file (only those given): the
    ones horovodrun sets, with its values, and bagua_hvd's own."""
    env: Dict[str, str] = {}

    def put(name: str, value: object, text: Callable[[Any], str] = str) -> None:
        if value is not None:
            env[name] = text(value)

    put("HOROVOD_FUSION_THRESHOLD", args.fusion_threshold_mb, lambda mb: str(mb * 1024 * 1024))
    put("HOROVOD_CYCLE_TIME", args.cycle_time_ms, lambda ms: f"{ms:g}")
    put("HOROVOD_CACHE_CAPACITY", args.cache_capacity)
    put("HOROVOD_HIERARCHICAL_ALLREDUCE", args.hierarchical_allreduce, _bit)
    put("HOROVOD_HIERARCHICAL_ALLGATHER", args.hierarchical_allgather, _bit)
    put("HOROVOD_TORUS_ALLREDUCE", args.torus_allreduce, _bit)
    if args.autotune:  # as horovodrun: the autotune-* values only with autotuning on
        put("HOROVOD_AUTOTUNE", True, _bit)
        put("HOROVOD_AUTOTUNE_LOG", args.autotune_log_file)
        put("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", args.autotune_warmup_samples)
        put("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", args.autotune_steps_per_sample)
        put("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", args.autotune_bayes_opt_max_samples)
        put("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", args.autotune_gaussian_process_noise)
    if args.timeline_filename:
        put("HOROVOD_TIMELINE", args.timeline_filename)
        put("HOROVOD_TIMELINE_MARK_CYCLES", args.timeline_mark_cycles, _bit)
    put("HOROVOD_STALL_CHECK_DISABLE", args.no_stall_check, _bit)
    put("HOROVOD_STALL_CHECK_TIME_SECONDS", args.stall_check_warning_time_seconds)
    put("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", args.stall_check_shutdown_time_seconds)
    put("HOROVOD_MPI_THREADS_DISABLE", args.mpi_threads_disable, _bit)
    put("HOROVOD_NUM_NCCL_STREAMS", args.num_nccl_streams)
    put("NCCL_IB_DISABLE", 1 if args.tcp_flag else None)
    put("HOROVOD_THREAD_AFFINITY", args.thread_affinity)
    put("HOROVOD_GLOO_TIMEOUT_SECONDS", args.gloo_timeout_seconds)
    put("HOROVOD_LOG_LEVEL", args.log_level)
    put("HOROVOD_LOG_HIDE_TIME", args.log_with_timestamp, lambda with_time: _bit(not with_time))
    put("BAGUA_HVD_TRANSPORT", args.transport)
    put("BAGUA_HVD_ALGORITHM", args.algorithm)
    put("BAGUA_HVD_AS_HOROVOD", True if args.as_horovod else None, _bit)
    if args.nics:
        env["HOROVOD_GLOO_IFACE"] = args.nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(args.nics)
    return env


def rank_env(args: argparse.Namespace) -> Dict[str, str]:
    """:func:`tuning_env`, and BAGUA_HVD_WARNED_VARIABLES naming the variables of the flags
    :func:`no_effect_warning` named: the ranks' init() does not warn about them again."""
    env = tuning_env(args)
    warned = warned_variables(args)
    if warned:
        env["BAGUA_HVD_WARNED_VARIABLES"] = ",".join(warned)
    return env


_AUTOTUNE_ONLY = "they only configure the autotuner: add --autotune"
_ELASTIC_ONLY = "they only configure elastic jobs: add --min-np or --host-discovery-script"
# (flag, its destination, whether the value asks for something, why it has no effect here)
_NO_EFFECT: Tuple[Tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("--hierarchical-allgather", "hierarchical_allgather", bool,
     "bagua_hvd's allgather has one algorithm"),
    ("--torus-allreduce", "torus_allreduce", bool,
     "there is no torus allreduce: --hierarchical-allreduce serves hosts of several GPUs"),
    ("--autotune-log-file", "autotune_log_file", lambda v: v is not None, _AUTOTUNE_ONLY),
    ("--autotune-warmup-samples", "autotune_warmup_samples", lambda v: v is not None,
     _AUTOTUNE_ONLY),
    ("--autotune-steps-per-sample", "autotune_steps_per_sample", lambda v: v is not None,
     _AUTOTUNE_ONLY),
    ("--autotune-bayes-opt-max-samples", "autotune_bayes_opt_max_samples",
     lambda v: v is not None, _AUTOTUNE_ONLY),
    ("--autotune-gaussian-process-noise", "autotune_gaussian_process_noise",
     lambda v: v is not None, _AUTOTUNE_ONLY),
    ("--max-np", "max_num_proc", lambda v: v is not None, _ELASTIC_ONLY),
    ("--slots-per-host", "slots", lambda v: v is not None, _ELASTIC_ONLY),
    ("--elastic-timeout", "elastic_timeout", lambda v: v is not None, _ELASTIC_ONLY),
    ("--reset-limit", "reset_limit", lambda v: v is not None, _ELASTIC_ONLY),
    ("--blacklist-cooldown-range", "cooldown_range", lambda v: v is not None, _ELASTIC_ONLY),
    ("--mpi-threads-disable", "mpi_threads_disable", bool,
     "MPI is initialized only with --mpi"),
    ("--num-nccl-streams", "num_nccl_streams", lambda v: v is not None,
     "the CUDA engine runs NCCL on one stream of its own per device"),
    ("--thread-affinity", "thread_affinity", lambda v: v is not None,
     "the core does not pin its background thread"),
)  # fmt: skip


# The variable each no-effect flag sets in the ranks: bagua-run names those it warned about in
# BAGUA_HVD_WARNED_VARIABLES, and the ranks' init() leaves them out of its own warning.
_FLAG_VARIABLES = {
    "hierarchical_allgather": "HOROVOD_HIERARCHICAL_ALLGATHER",
    "torus_allreduce": "HOROVOD_TORUS_ALLREDUCE",
    "autotune": "HOROVOD_AUTOTUNE",
    "autotune_log_file": "HOROVOD_AUTOTUNE_LOG",
    "autotune_warmup_samples": "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "autotune_steps_per_sample": "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "autotune_bayes_opt_max_samples": "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "autotune_gaussian_process_noise": "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "mpi_threads_disable": "HOROVOD_MPI_THREADS_DISABLE",
    "num_nccl_streams": "HOROVOD_NUM_NCCL_STREAMS",
    "thread_affinity": "HOROVOD_THREAD_AFFINITY",
}


def _no_effect_flags(args: argparse.Namespace) -> List[Tuple[str, str, str]]:
    """(flag, destination, why) of each flag given that bagua_hvd cannot honour."""
    out = []
    elastic = args.min_num_proc is not None or args.host_discovery_script is not None
    for flag, dest, asks, why in _NO_EFFECT:
        if why is _ELASTIC_ONLY and elastic:
            continue
        if why is _AUTOTUNE_ONLY and args.autotune:
            continue
        if dest == "mpi_threads_disable" and (args.mpi or args.jsrun):
            continue  # acted on under mpirun (bagua_hvd.common.bootstrap)
        if asks(getattr(args, dest)):
            out.append((flag, dest, why))
    return out


def warned_variables(args: argparse.Namespace) -> List[str]:
    """The variables of the flags :func:`no_effect_warning` names (sorted)."""
    return sorted(
        _FLAG_VARIABLES[dest] for _, dest, _ in _no_effect_flags(args) if dest in _FLAG_VARIABLES
    )


def no_effect_warning(args: argparse.Namespace) -> Optional[str]:
    """The one warning line naming every flag (or --config-file setting) given that bagua_hvd
    accepts but cannot honour, and why; None when there is none."""
    reasons: Dict[str, List[str]] = {}
    for flag, _, why in _no_effect_flags(args):
        reasons.setdefault(why, []).append(flag)
    if not (args.mpi or args.jsrun):
        for flag, dest in (("--mpi-args", "mpi_args"), ("--binding-args", "binding_args")):
            if getattr(args, dest) is not None:
                reasons.setdefault(
                    "mpirun's options: without --mpi bagua-run starts the ranks itself", []
                ).append(flag)
    if not reasons:
        return None
    parts = [f"{', '.join(flags)} ({why})" for why, flags in reasons.items()]
    return "bagua-run: warning: no effect in bagua_hvd: " + "; ".join(parts)
