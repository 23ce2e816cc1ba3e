"""Every horovodrun (Horovod 0.28.1) flag on bagua-run's command line: the variables the ranks
get, the one warning for flags bagua_hvd cannot honour, horovodrun's --config-file YAML and its
override rule, the --help groups, and one real job. Parsing only, except the last test."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from bagua_hvd.runner import launch

REPO = Path(__file__).resolve().parent.parent

# horovodrun's groups and their flags (help shown), in its order, from horovod/runner/launch.py.
HOROVODRUN_GROUPS = {
    None: ["-h", "--help", "-v", "--version", "-np", "--num-proc", "-cb", "--check-build",
           "--disable-cache", "--start-timeout", "--network-interfaces", "--network-interface",
           "--output-filename", "--verbose", "--config-file"],
    "SSH arguments": ["-p", "--ssh-port", "-i", "--ssh-identity-file"],
    "tuneable parameter arguments": [
        "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity",
        "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--hierarchical-allgather",
        "--no-hierarchical-allgather", "--torus-allreduce", "--no-torus-allreduce"],
    "autotune arguments": [
        "--autotune", "--autotune-log-file", "--autotune-warmup-samples",
        "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
        "--autotune-gaussian-process-noise"],
    "elastic arguments": [
        "--min-np", "--min-num-proc", "--max-np", "--max-num-proc", "--slots-per-host",
        "--elastic-timeout", "--reset-limit", "--blacklist-cooldown-range"],
    "timeline arguments": ["--timeline-filename", "--timeline-mark-cycles"],
    "stall check arguments": [
        "--no-stall-check", "--stall-check-warning-time-seconds",
        "--stall-check-shutdown-time-seconds"],
    "library arguments": [
        "--mpi-threads-disable", "--mpi-args", "--tcp", "--binding-args", "--num-nccl-streams",
        "--thread-affinity", "--gloo-timeout-seconds"],
    "logging arguments": [
        "--log-level", "--log-without-timestamp", "-prefix-timestamp",
        "--prefix-output-with-timestamp"],
    "host arguments": ["-H", "--hosts", "-hostfile", "--hostfile", "--host-discovery-script"],
    "controller arguments": ["--gloo", "--mpi", "--jsrun"],
}  # fmt: skip
# horovodrun's flags without help (the negations and deprecated spellings).
HOROVODRUN_HIDDEN = ["--no-autotune", "--no-timeline-mark-cycles", "--stall-check",
                     "--no-mpi-threads-disable", "--log-with-timestamp", "--log-hide-timestamp",
                     "--no-log-hide-timestamp"]  # fmt: skip
HOROVODRUN_FLAGS = [f for flags in HOROVODRUN_GROUPS.values() for f in flags] + HOROVODRUN_HIDDEN
MB = 1024 * 1024
AUTOTUNE = "they only configure the autotuner: add --autotune"
ELASTIC = "they only configure elastic jobs"

# (horovodrun command line without "horovodrun" and the command, the variables the ranks get
# from the flags, {flag named in the warning: words of its reason}; {} = no warning)
CASES = [
    ("-np 4 --fusion-threshold-mb 32 --cycle-time-ms 3.5 --cache-capacity 0",
     {"HOROVOD_FUSION_THRESHOLD": str(32 * MB), "HOROVOD_CYCLE_TIME": "3.5",
      "HOROVOD_CACHE_CAPACITY": "0"}, {}),
    ("--num-proc 2 --hierarchical-allreduce", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, {}),
    ("-np 2 --no-hierarchical-allreduce", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, {}),
    ("-np 2 --hierarchical-allgather", {"HOROVOD_HIERARCHICAL_ALLGATHER": "1"},
     {"--hierarchical-allgather": "allgather has one algorithm"}),
    ("-np 2 --no-hierarchical-allgather", {"HOROVOD_HIERARCHICAL_ALLGATHER": "0"}, {}),
    ("-np 2 --torus-allreduce", {"HOROVOD_TORUS_ALLREDUCE": "1"},
     {"--torus-allreduce": "no torus allreduce"}),
    ("-np 2 --no-torus-allreduce", {"HOROVOD_TORUS_ALLREDUCE": "0"}, {}),
    ("-np 2 --autotune --autotune-log-file tune.csv --autotune-warmup-samples 5 "
     "--autotune-steps-per-sample 20 --autotune-bayes-opt-max-samples 40 "
     "--autotune-gaussian-process-noise 0.5",
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "tune.csv",
      "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "20",
      "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "40",
      "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}, {}),
    ("-np 2 --no-autotune", {}, {}),
    # horovodrun passes the autotune-* values only with --autotune
    ("-np 2 --autotune-warmup-samples 5 --autotune-log-file t.csv", {},
     {"--autotune-warmup-samples": AUTOTUNE, "--autotune-log-file": AUTOTUNE}),
    ("-np 2 --max-np 4 --slots-per-host 2 --elastic-timeout 60 --reset-limit 3 "
     "--blacklist-cooldown-range 10 100", {},
     {f: ELASTIC for f in ("--max-np", "--slots-per-host", "--elastic-timeout",
                           "--reset-limit", "--blacklist-cooldown-range")}),
    ("-np 2 --max-num-proc 4", {}, {"--max-np": ELASTIC}),
    ("-np 2 --timeline-filename /tmp/tl.json --timeline-mark-cycles",
     {"HOROVOD_TIMELINE": "/tmp/tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1"}, {}),
    ("-np 2 --timeline-filename tl.json --no-timeline-mark-cycles",
     {"HOROVOD_TIMELINE": "tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "0"}, {}),
    ("-np 2 --no-stall-check", {"HOROVOD_STALL_CHECK_DISABLE": "1"}, {}),
    ("-np 2 --stall-check --stall-check-warning-time-seconds 10 "
     "--stall-check-shutdown-time-seconds 20",
     {"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
      "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"}, {}),
    ("-np 2 --mpi-threads-disable", {"HOROVOD_MPI_THREADS_DISABLE": "1"},
     {"--mpi-threads-disable": "only with --mpi"}),
    # under mpirun it is acted on (MPI_THREAD_SINGLE: tests/test_environment.py)
    ("-np 2 --mpi --mpi-threads-disable", {"HOROVOD_MPI_THREADS_DISABLE": "1"}, {}),
    ("-np 2 --no-mpi-threads-disable", {"HOROVOD_MPI_THREADS_DISABLE": "0"}, {}),
    ("-np 2 --tcp --gloo-timeout-seconds 0",
     {"NCCL_IB_DISABLE": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "0"}, {}),
    ("-np 2 --num-nccl-streams 2 --thread-affinity 3",
     {"HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "3"},
     {"--num-nccl-streams": "one stream of its own", "--thread-affinity": "does not pin"}),
    ("-np 2 --mpi-args=--map-by=ppr:2:node --binding-args=--bind-to=core", {},
     {"--mpi-args": "without --mpi", "--binding-args": "without --mpi"}),
    ("-np 2 --mpi --mpi-args=--oversubscribe --binding-args=--bind-to=core", {}, {}),
    ("-np 2 --log-level TRACE --log-without-timestamp",
     {"HOROVOD_LOG_LEVEL": "TRACE", "HOROVOD_LOG_HIDE_TIME": "1"}, {}),
    ("-np 2 --log-with-timestamp", {"HOROVOD_LOG_HIDE_TIME": "0"}, {}),
    ("-np 2 --log-hide-timestamp", {"HOROVOD_LOG_HIDE_TIME": "1"}, {}),
    ("-np 2 --no-log-hide-timestamp", {"HOROVOD_LOG_HIDE_TIME": "0"}, {}),
    ("-np 2 -prefix-timestamp", {}, {}),
    ("-np 2 --prefix-output-with-timestamp", {}, {}),
    ("-np 2 --disable-cache --start-timeout 60 --verbose --output-filename out "
     "--network-interface eth0 --network-interface eth1",
     {"HOROVOD_GLOO_IFACE": "eth0", "NCCL_SOCKET_IFNAME": "eth0,eth1"}, {}),
    ("-np 2 --network-interfaces eth1,eth0 --network-interface eth2",
     {"HOROVOD_GLOO_IFACE": "eth1", "NCCL_SOCKET_IFNAME": "eth1,eth0,eth2"}, {}),
    ("-np 2 -p 2222 -i /tmp/key -H localhost:2 --gloo", {}, {}),
    ("-np 2 --ssh-port 22 --ssh-identity-file k --hosts localhost:2 --mpi", {}, {}),
    ("-np 2 -hostfile {hostfile}", {}, {}),
    ("-np 2 --hostfile {hostfile}", {}, {}),
]  # fmt: skip

# (command line, words of the error; exit status 2)
ERRORS = [
    # Horovod's check: -H defaults to localhost:<np>, and an elastic job needs two hosts.
    ("-np 2 --min-np 1", "Cannot run in fault tolerance mode with fewer than 2 hosts."),
    ("-np 2 --min-num-proc 1 -H h1:2", "Cannot run in fault tolerance mode with fewer than 2"),
    ("-np 2 --min-np 3 -H a:2,b:2", "--min-np 3 is more than -np 2"),
    ("-np 4 --max-np 2 --host-discovery-script ./hosts.sh", "--max-np 2 is less than -np 4"),
    ("-np 2 --host-discovery-script ./hosts.sh --blacklist-cooldown-range 5 2",
     "--blacklist-cooldown-range"),
    ("-np 2 --host-discovery-script ./hosts.sh --mpi", "--mpi cannot be combined with an elastic"),
    ("-np 2 --host-discovery-script ./hosts.sh --reset-limit -1", "--reset-limit must be >= 0"),
    ("-np 2 --jsrun", "--jsrun needs the LSF allocation's compute hosts"),
    ("-np 2 --jsrun --min-np 1 -H a:1,b:1", "--jsrun cannot be combined with an elastic"),
    ("-np 2 --autotune-gaussian-process-noise 1.5", "must be in [0, 1]"),
    ("-np 2 --fusion-threshold-mb -1", "must be >= 0"),
    ("-np 2 --fusion-threshold-mb 1.5", "invalid _non_negative_int value"),
    ("-np 2 --log-level LOUD", "invalid choice"),
    ("-np 2 --hierarchical-allreduce --no-hierarchical-allreduce", "not allowed with"),
    ("-np 2 --log-without-timestamp -prefix-timestamp", "not allowed with"),
    ("-np 2 --gloo --mpi", "not allowed with"),
    ("-np 2 -H localhost:2 --host-discovery-script x", "not allowed with"),
    ("-np 2 --blacklist-cooldown-range 10", "--blacklist-cooldown-range: invalid int value"),
]


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "HOROVOD_START_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def parse(line: str, tmp_path: Optional[Path] = None) -> argparse.Namespace:
    if "{hostfile}" in line:
        assert tmp_path is not None
        hostfile = tmp_path / "hosts"
        hostfile.write_text("localhost slots=2\n")
        line = line.format(hostfile=hostfile)
    return launch.parse_args(line.split() + ["python", "train.py", "--lr", "1"])


def warned(args: argparse.Namespace) -> Dict[str, str]:
    """The warning's flags -> their reasons ({} without a warning)."""
    line = launch.no_effect_warning(args)
    if line is None:
        return {}
    prefix = "bagua-run: warning: no effect in bagua_hvd: "
    assert line.startswith(prefix) and "\n" not in line, line
    named = {}
    for part in line[len(prefix) :].split("; "):
        flags, _, why = part.partition(" (")
        for flag in flags.split(", "):
            named[flag] = why
    return named


@pytest.mark.parametrize("line,env,warning", CASES, ids=[c[0] for c in CASES])
def test_horovodrun_command_lines(line: str, env: dict, warning: dict, tmp_path: Path) -> None:
    args = parse(line, tmp_path)
    assert args.command == ["python", "train.py", "--lr", "1"]
    assert launch.tuning_env(args) == env
    named = warned(args)
    assert sorted(named) == sorted(warning), named
    for flag, words in warning.items():
        assert words in named[flag], (flag, named[flag])
    prefix = {"-prefix-timestamp", "--prefix-output-with-timestamp"} & set(line.split())
    assert args.prefix_output_with_timestamp == bool(prefix)


def test_the_table_covers_every_horovodrun_flag() -> None:
    parser = launch.make_parser()
    missing = [f for f in HOROVODRUN_FLAGS if f not in parser._option_string_actions]
    assert not missing, f"horovodrun flags bagua-run does not take: {missing}"
    used = {word.partition("=")[0] for line, _, _ in CASES for word in line.split()}
    used |= {word for line, _ in ERRORS for word in line.split()}
    untested = set(HOROVODRUN_FLAGS) - used - {"-h", "--help", "-v", "--version", "-cb",
                                               "--check-build", "--config-file"}  # fmt: skip
    assert not untested, untested  # (-h, -v, -cb and --config-file have tests of their own)


@pytest.mark.parametrize("line,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_refused_command_lines(line: str, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(line)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_groups_the_flags_as_horovodrun() -> None:
    parser = launch.make_parser()
    groups = {g.title: [s for a in g._group_actions if a.help != argparse.SUPPRESS
                        for s in a.option_strings] for g in parser._action_groups}  # fmt: skip
    titles = [g.title for g in parser._action_groups if groups[g.title]]
    horovod_titles = [t for t in HOROVODRUN_GROUPS if t is not None]
    # horovodrun's groups, in its order, after the general options; bagua_hvd's own after them
    assert titles[1 : 1 + len(horovod_titles)] == horovod_titles, titles
    for title in horovod_titles:
        assert groups[title] == HOROVODRUN_GROUPS[title], title
    assert groups[titles[0]] == HOROVODRUN_GROUPS[None], groups[titles[0]]
    text = parser.format_help()
    positions = [text.index(f"\n{title}:\n") for title in horovod_titles]
    assert positions == sorted(positions)
    for hidden in HOROVODRUN_HIDDEN:
        assert not re.search(rf"{hidden}(?![\w-])", text), hidden


CONFIG = """\
controller: mpi
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false
  torus_allreduce: false
autotune:
  enabled: true
  log_file: tune.csv
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.3
timeline:
  filename: tl.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 30
  shutdown_time_seconds: 90
library_options:
  mpi_threads_disable: false
  num_nccl_streams: 2
  thread_affinity: 1
  gloo_timeout_seconds: 45
logging:
  level: debug
  with_timestamp: false
"""
CONFIG_ENV = {
    "HOROVOD_FUSION_THRESHOLD": str(32 * MB), "HOROVOD_CYCLE_TIME": "10",
    "HOROVOD_CACHE_CAPACITY": "2048", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_TORUS_ALLREDUCE": "0",
    "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "tune.csv",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "20",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "50",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.3",
    "HOROVOD_TIMELINE": "tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
    "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90", "HOROVOD_MPI_THREADS_DISABLE": "0",
    "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "1",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "HOROVOD_LOG_LEVEL": "DEBUG",
    "HOROVOD_LOG_HIDE_TIME": "1",
}  # fmt: skip


def test_config_file_sections(tmp_path: Path) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text(CONFIG)
    args = parse(f"-np 2 --config-file {path}")
    assert launch.tuning_env(args) == CONFIG_ENV
    assert args.mpi and not args.gloo  # controller: mpi
    assert sorted(warned(args)) == ["--num-nccl-streams", "--thread-affinity"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_command_line_wins_over_the_config_file(tmp_path: Path, where: str) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text(CONFIG)
    flags = ("--gloo --fusion-threshold-mb 8 --no-hierarchical-allreduce --stall-check "
             "--no-autotune --log-level ERROR --log-with-timestamp --gloo-timeout-seconds 5 "
             "--timeline-filename mine.json")  # fmt: skip
    config = f"--config-file {path}"
    args = parse(f"-np 2 {config} {flags}" if where == "after" else f"-np 2 {flags} {config}")
    expected = dict(CONFIG_ENV)
    for key in [k for k in expected if k.startswith("HOROVOD_AUTOTUNE")]:
        del expected[key]  # --no-autotune: horovodrun passes no autotune variable
    expected.update({
        "HOROVOD_FUSION_THRESHOLD": str(8 * MB), "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
        "HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_LOG_LEVEL": "ERROR",
        "HOROVOD_LOG_HIDE_TIME": "0", "HOROVOD_GLOO_TIMEOUT_SECONDS": "5",
        "HOROVOD_TIMELINE": "mine.json",
    })  # fmt: skip
    assert launch.tuning_env(args) == expected
    assert args.gloo and not args.mpi  # --gloo wins over controller: mpi


@pytest.mark.parametrize("text,message", [
    (None, "cannot read it: No such file or directory"),
    ("params: [fusion_threshold_mb: 1\n", "not valid YAML"),
    ("- params\n", "expected a mapping of sections"),
    ("params: 3\n", "section params must be a mapping"),
    ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms must be a number >= 0, got 'fast'"),
    ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb must be an integer"),
    ("autotune:\n  gaussian_process_noise: 2\n", "must be a number in [0, 1]"),
    ("logging:\n  level: loud\n", "logging.level must be one of TRACE"),
    ("stall_check:\n  enabled: maybe\n", "stall_check.enabled must be true or false"),
    ("controller: jsrun\n", "controller must be gloo or mpi"),
])  # fmt: skip
def test_bad_config_file(tmp_path: Path, text: Optional[str], message: str,
                         capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse(f"-np 2 --config-file {path}")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--config-file {path}: " in err and message in err, err


# A rank prints the variables horovodrun's flags set.
PRINT = ("import os; print(' '.join(f'{k}={os.environ.get(k, \"-\")}' for k in ["
         "'HOROVOD_RANK', 'HOROVOD_FUSION_THRESHOLD', 'HOROVOD_CYCLE_TIME', "
         "'HOROVOD_CACHE_CAPACITY', 'HOROVOD_STALL_CHECK_TIME_SECONDS', 'HOROVOD_LOG_HIDE_TIME', "
         "'NCCL_IB_DISABLE', 'HOROVOD_AUTOTUNE', 'HOROVOD_THREAD_AFFINITY']))")  # fmt: skip
STAMP = r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun) \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"


def test_a_real_job(tmp_path: Path) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text("params:\n  cache_capacity: 7\n  cycle_time_ms: 9\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("HOROVOD_START_TIMEOUT", None)
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2",
           "--fusion-threshold-mb", "4", "--cycle-time-ms", "2", "--config-file", str(path),
           "--stall-check-warning-time-seconds", "5", "--log-without-timestamp", "--tcp",
           "--autotune", "--thread-affinity", "1", sys.executable, "-c", PRINT]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("bagua-run: warning: no effect in bagua_hvd: --thread-affinity (")
    assert "--autotune" not in warnings[0]
    lines = sorted(proc.stdout.splitlines())
    assert lines == [
        f"[{r}]<stdout>:HOROVOD_RANK={r} HOROVOD_FUSION_THRESHOLD={4 * MB} HOROVOD_CYCLE_TIME=2 "
        "HOROVOD_CACHE_CAPACITY=7 HOROVOD_STALL_CHECK_TIME_SECONDS=5 HOROVOD_LOG_HIDE_TIME=1 "
        "NCCL_IB_DISABLE=1 HOROVOD_AUTOTUNE=1 HOROVOD_THREAD_AFFINITY=1"
        for r in range(2)
    ], proc.stdout
    # -prefix-timestamp: every line of the ranks starts with the time, as with horovodrun
    proc = subprocess.run(cmd[:3] + ["-np", "2", "-prefix-timestamp", sys.executable, "-c",
                                     "print('x')"],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(STAMP + r"\[[01]\]<stdout>:x", x) for x in lines)
