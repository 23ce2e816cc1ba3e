"""The runner names Horovod's programmatic launchers import: ``_HorovodArgs`` (horovodrun's
settings as attributes), ``_run`` (runs them), ``gloo_run`` and ``mpi_run`` (run a command with
a ``Settings``). They are reached as Horovod spells them: ``bagua_hvd.runner._HorovodArgs``,
``bagua_hvd.runner.launch._run`` / ``gloo_run`` / ``mpi_run``, ``bagua_hvd.runner.gloo_run.gloo_run``
and ``bagua_hvd.runner.mpi_run.mpi_run``. Each builds bagua-run's command line and runs it
(``bagua_hvd.runner.launch.main``), or ``bagua_hvd.run`` for a function, so the flags mean what
they mean for bagua-run.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
from typing import Any, Dict, List, Optional, Sequence, Union

# (attribute, bagua-run flag) of the flags that take a value.
_VALUES = (
    ("num_proc", "--num-proc"), ("ssh_port", "--ssh-port"),
    ("ssh_identity_file", "--ssh-identity-file"), ("start_timeout", "--start-timeout"),
    ("output_filename", "--output-filename"), ("config_file", "--config-file"),
    ("fusion_threshold_mb", "--fusion-threshold-mb"), ("cycle_time_ms", "--cycle-time-ms"),
    ("cache_capacity", "--cache-capacity"), ("autotune_log_file", "--autotune-log-file"),
    ("autotune_warmup_samples", "--autotune-warmup-samples"),
    ("autotune_steps_per_sample", "--autotune-steps-per-sample"),
    ("autotune_bayes_opt_max_samples", "--autotune-bayes-opt-max-samples"),
    ("autotune_gaussian_process_noise", "--autotune-gaussian-process-noise"),
    ("min_num_proc", "--min-np"), ("max_num_proc", "--max-np"), ("slots", "--slots-per-host"),
    ("elastic_timeout", "--elastic-timeout"), ("reset_limit", "--reset-limit"),
    ("timeline_filename", "--timeline-filename"),
    ("stall_check_warning_time_seconds", "--stall-check-warning-time-seconds"),
    ("stall_check_shutdown_time_seconds", "--stall-check-shutdown-time-seconds"),
    ("mpi_args", "--mpi-args"), ("binding_args", "--binding-args"),
    ("num_nccl_streams", "--num-nccl-streams"), ("thread_affinity", "--thread-affinity"),
    ("gloo_timeout_seconds", "--gloo-timeout-seconds"), ("log_level", "--log-level"),
    ("hosts", "--hosts"), ("hostfile", "--hostfile"),
    ("host_discovery_script", "--host-discovery-script"), ("nic", "--network-interface"),
)  # fmt: skip
# (attribute, flag when True) of the flags without a value.
_TRUE = (
    ("check_build", "--check-build"), ("disable_cache", "--disable-cache"),
    ("verbose", "--verbose"), ("tcp_flag", "--tcp"),
    ("prefix_output_with_timestamp", "--prefix-output-with-timestamp"),
    ("timeline_mark_cycles", "--timeline-mark-cycles"), ("no_stall_check", "--no-stall-check"),
    ("use_gloo", "--gloo"), ("use_mpi", "--mpi"), ("use_jsrun", "--jsrun"),
)  # fmt: skip
# (attribute, flag when True, flag when False)
_SWITCHES = (
    ("hierarchical_allreduce", "--hierarchical-allreduce", "--no-hierarchical-allreduce"),
    ("hierarchical_allgather", "--hierarchical-allgather", "--no-hierarchical-allgather"),
    ("torus_allreduce", "--torus-allreduce", "--no-torus-allreduce"),
    ("autotune", "--autotune", "--no-autotune"),
    ("mpi_threads_disable", "--mpi-threads-disable", "--no-mpi-threads-disable"),
    ("log_with_timestamp", "--log-with-timestamp", "--log-without-timestamp"),
)


class _HorovodArgs:
    """horovodrun's settings as attributes, every one None (unset) but ``num_proc`` (1), as
    Horovod's ``horovod.runner._HorovodArgs``; set them and pass the object to
    :func:`_run`. ``command`` (a list) is run on every rank, or ``run_func`` (a function of no
    arguments) whose results :func:`_run` returns by rank."""

    def __init__(self) -> None:
        self.num_proc: Optional[int] = 1
        self.check_build = None
        self.ssh_port = None
        self.ssh_identity_file = None
        self.disable_cache = None
        self.start_timeout = None
        self.nic = None
        self.output_filename = None
        self.verbose = None
        self.command: Optional[List[str]] = None
        self.run_func = None
        self.config_file = None
        self.nics: Optional[List[str]] = None
        self.executable = None
        self.fusion_threshold_mb = None
        self.cycle_time_ms = None
        self.cache_capacity = None
        self.hierarchical_allreduce = None
        self.hierarchical_allgather = None
        self.torus_allreduce = None
        self.autotune = None
        self.autotune_log_file = None
        self.autotune_warmup_samples = None
        self.autotune_steps_per_sample = None
        self.autotune_bayes_opt_max_samples = None
        self.autotune_gaussian_process_noise = None
        self.min_num_proc = None
        self.max_num_proc = None
        self.slots = None
        self.elastic_timeout = None
        self.reset_limit = None
        self.cooldown_range = None
        self.timeline_filename = None
        self.timeline_mark_cycles = None
        self.no_stall_check = None
        self.stall_check_warning_time_seconds = None
        self.stall_check_shutdown_time_seconds = None
        self.mpi_threads_disable = None
        self.mpi_args = None
        self.tcp_flag = None
        self.binding_args = None
        self.num_nccl_streams = None
        self.thread_affinity = None
        self.gloo_timeout_seconds = None
        self.log_level = None
        self.log_with_timestamp = None
        self.prefix_output_with_timestamp = None
        self.hosts = None
        self.hostfile = None
        self.host_discovery_script = None
        self.use_gloo = None
        self.use_mpi = None
        self.use_jsrun = None


def _value(args: Any, name: str) -> Any:
    value = getattr(args, name, None)
    # Horovod's own _HorovodArgs leaves (None,) in cycle_time_ms and cache_capacity.
    return None if value == (None,) else value


def _argv(args: Any) -> List[str]:
    """bagua-run's flags for the settings of ``args`` (a _HorovodArgs or alike)."""
    argv: List[str] = []
    for name, flag in _VALUES:
        value = _value(args, name)
        if value is not None:
            argv.append(f"{flag}={value}")
    for name, flag in _TRUE:
        if _value(args, name):
            argv.append(flag)
    for name, on, off in _SWITCHES:
        value = _value(args, name)
        if value is not None:
            argv.append(on if value else off)
    nics = _value(args, "nics")
    if nics:
        argv.append("--network-interfaces=" + ",".join(nics))
    cooldown = _value(args, "cooldown_range")
    if cooldown is not None:
        argv += ["--blacklist-cooldown-range", *(str(int(v)) for v in cooldown)]
    return argv


def _parse(argv: List[str]) -> Any:
    """bagua-run's parse of ``argv``; ValueError with its message instead of exiting."""
    from bagua_hvd.runner.bagua_run import parse_args

    text = io.StringIO()
    try:
        with contextlib.redirect_stderr(text):
            return parse_args(argv)
    except SystemExit:
        message = text.getvalue().strip().splitlines()
        raise ValueError(message[-1] if message else f"bad arguments: {argv}") from None


def _run(args: Any) -> Optional[List[Any]]:
    """Runs ``args`` (a :class:`_HorovodArgs`) as horovodrun would, as Horovod's
    ``horovod.runner.launch._run``.

    With ``args.run_func``: runs it on every rank (``bagua_hvd.run``, the other settings
    applied as bagua-run's flags) and returns the results by rank. Otherwise runs
    ``args.command`` on every rank and returns None; ``check_build`` prints what
    ``bagua-run --check-build`` prints.

    Raises:
        ValueError: settings bagua-run refuses (its message).
        RuntimeError: a rank failed (bagua-run's exit status in the message).
    """
    argv = _argv(args)
    func = _value(args, "run_func")
    if func is not None:
        from bagua_hvd.runner.api import run
        from bagua_hvd.runner.flags import rank_env

        parsed = _parse(argv + ["--", "python"])
        if parsed.jsrun:
            raise ValueError("run_func with use_jsrun: bagua_hvd.run has no jsrun mode")
        cooldown = _value(args, "cooldown_range")
        return run(
            func,
            num_proc=parsed.num_proc, min_num_proc=parsed.min_num_proc,
            max_num_proc=parsed.max_num_proc, slots=parsed.slots,
            reset_limit=parsed.reset_limit,
            cooldown_range=None if cooldown is None else tuple(cooldown),
            hosts=parsed.hosts, hostfile=parsed.hostfile,
            host_discovery_script=parsed.host_discovery_script,
            start_timeout=_value(args, "start_timeout"), ssh_port=parsed.ssh_port,
            ssh_identity_file=parsed.ssh_identity_file, output_filename=parsed.output_filename,
            verbose=parsed.verbose, use_gloo=parsed.gloo or None, use_mpi=parsed.mpi or None,
            mpi_args=parsed.mpi_args, executable=_value(args, "executable"),
            _env=rank_env(parsed),
        )  # fmt: skip
    command = _value(args, "command")
    if not _value(args, "check_build"):
        if not command:
            raise ValueError("_HorovodArgs.command (the command each rank runs) is not set")
        argv += ["--", *_command(command)]
    return _launch(argv)


def _launch(argv: List[str], extra_env: Optional[Dict[str, str]] = None) -> None:
    from bagua_hvd.runner.bagua_run import main

    _parse(argv)  # ValueError with bagua-run's message
    code = main(argv, _extra_env=extra_env)
    if code != 0:
        raise RuntimeError(
            "Horovod detected that one or more processes exited with non-zero status, thus "
            f"causing the job to be terminated (bagua-run exited with status {code}; the "
            "first failing rank is named above)"
        )
    return None


def _command(command: Union[str, Sequence[str]]) -> List[str]:
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def _settings_argv(settings: Any, nics: Any) -> List[str]:
    argv: List[str] = []
    if getattr(settings, "num_proc", None) is not None:
        argv.append(f"--num-proc={settings.num_proc}")
    for name, flag in (("hosts", "--hosts"), ("ssh_port", "--ssh-port"),
                       ("ssh_identity_file", "--ssh-identity-file"),
                       ("output_filename", "--output-filename")):  # fmt: skip
        value = getattr(settings, name, None)
        if value is not None:
            argv.append(f"{flag}={value}")
    timeout = getattr(settings, "start_timeout", None)
    # Horovod passes a Timeout object (its seconds in _timeout), bagua-run whole seconds.
    seconds = getattr(timeout, "_timeout", timeout)
    if seconds is not None:
        argv.append(f"--start-timeout={max(1, int(seconds))}")
    if getattr(settings, "verbose", 0):
        argv.append("--verbose")
    if getattr(settings, "prefix_output_with_timestamp", False):
        argv.append("--prefix-output-with-timestamp")
    if getattr(settings, "tcp_flag", None):
        argv.append("--tcp")
    if nics:
        argv.append("--network-interfaces=" + ",".join(nics))
    return argv


def _env_given(env: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The variables of ``env`` (Horovod passes the ranks' whole environment) that differ from
    this process's and that a launcher passes on."""
    from bagua_hvd.runner.common.util.env import is_exportable

    return {
        k: str(v)
        for k, v in (env or {}).items()
        if is_exportable(k) and os.environ.get(k) != str(v)
    }


def gloo_run(
    settings: Any, nics: Any, env: Optional[Dict[str, str]], server_ip: Any, command: Any
) -> None:
    """Horovod's ``gloo_run(settings, nics, env, server_ip, command)``: runs ``command`` (a
    list, or a shell string) on ``settings.num_proc`` ranks over ``settings.hosts`` with
    bagua_hvd's own launcher (as bagua-run); ``env`` the ranks' environment; ``server_ip``
    accepted (the launcher serves the rendezvous itself). RuntimeError when a rank fails."""
    _launch(_settings_argv(settings, nics) + ["--", *_command(command)], _env_given(env))


def mpi_run(
    settings: Any,
    nics: Any,
    env: Optional[Dict[str, str]],
    command: Any,
    stdout: Any = None,
    stderr: Any = None,
) -> None:
    """Horovod's ``mpi_run(settings, nics, env, command, stdout=None, stderr=None)``: runs
    ``command`` under the system's mpirun (as ``bagua-run --mpi``), with
    ``settings.extra_mpi_args`` and ``settings.binding_args``. ``stdout``/``stderr`` are
    accepted; the ranks' output goes to this process's (tagged by mpirun). RuntimeError when
    mpirun exits non-zero."""
    argv = _settings_argv(settings, nics) + ["--mpi"]
    for name, flag in (("extra_mpi_args", "--mpi-args"), ("binding_args", "--binding-args")):
        value = getattr(settings, name, None)
        if value:
            argv.append(f"{flag}={value}")
    _launch(argv + ["--", *_command(command)], _env_given(env))
