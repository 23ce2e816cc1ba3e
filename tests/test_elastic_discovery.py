"""The discovery script cannot stall, outgrow or outlive the elastic launcher
(bagua_hvd.runner.elastic.discovery, driver.py): the driver goes on while a poll runs, a script
that exits is done even if a child it left holds its output, its output is capped, and its
processes end with the launcher (normal end, SIGTERM, SIGKILL). Scripts and jobs run for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_elastic import _check, _explain

from bagua_hvd.runner.elastic import discovery as discovery_mod
from bagua_hvd.runner.elastic.discovery import HostDiscoveryScript

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "tests" / "workers" / "elastic_torch_main.py"
# The launcher under test, with a discovery timeout far beyond the tests' bounds: a driver that
# waited for a hung script would be seen waiting, not rescued by the timeout.
LAUNCHER = (
    "import sys; import bagua_hvd.runner.elastic.discovery as d; d.DISCOVERY_TIMEOUT_S = 600; "
    "from bagua_hvd.runner.launch import main; sys.exit(main())"
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list, seconds: float = 10.0) -> list:
    """The pids still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def _wait_file(path: Path, proc: subprocess.Popen, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)


def _hanging_script(tmp: Path, hosts: list) -> Path:
    """Prints ``hosts`` at its first run; every later run starts a ``sleep`` (its pid appended
    to ``sleeps``) and hangs on it."""
    script = tmp / "discover.sh"
    echo = "; ".join(f"echo {h}" for h in hosts)
    script.write_text(
        "#!/bin/sh\n"
        f'cd "{tmp}"\n'
        f"if [ ! -f first ]; then touch first; {echo}; exit 0; fi\n"
        "sleep 600 &\n"
        "echo $! >> sleeps\n"
        "wait\n"
    )
    script.chmod(0o755)
    return script


def _launch(tmp: Path, args: list) -> subprocess.Popen:
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="20", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *args], cwd=str(tmp), env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


# ---- the script itself ------------------------------------------------------------------------


def test_a_script_that_exits_is_done_though_a_child_holds_its_output(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery_mod, "DISCOVERY_TIMEOUT_S", 20.0)
    pidfile = tmp_path / "child"
    script = HostDiscoveryScript(f"echo a:2; sleep 600 & echo $! > {pidfile}", None)
    start = time.monotonic()
    assert script.find_available_hosts_and_slots() == {"a": 2}
    assert time.monotonic() - start < 10.0
    # The child it left is killed with the script's process group.
    assert _wait_gone([int(pidfile.read_text())]) == []


def test_script_output_is_capped(monkeypatch):
    monkeypatch.setattr(discovery_mod, "DISCOVERY_TIMEOUT_S", 20.0)
    script = HostDiscoveryScript("yes a:1", None)
    with pytest.raises(RuntimeError, match=r"printed more than 1048576 bytes .* was killed"):
        script.find_available_hosts_and_slots()


def test_close_kills_a_running_script(tmp_path):
    pidfile = tmp_path / "child"
    script = HostDiscoveryScript(f"sleep 600 & echo $! > {pidfile}; wait", None)
    errors = []

    def poll() -> None:
        try:
            script.find_available_hosts_and_slots()
        except RuntimeError as e:
            errors.append(str(e))

    poller = threading.Thread(target=poll)
    poller.start()
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    script.close()
    poller.join(10.0)
    assert not poller.is_alive()
    assert errors and "launcher is ending" in errors[0], errors
    assert _wait_gone([int(pidfile.read_text())]) == []
    with pytest.raises(RuntimeError, match="launcher is ending"):
        script.find_available_hosts_and_slots()  # closed: not run again


# ---- the launcher -----------------------------------------------------------------------------


def test_a_hung_script_does_not_delay_a_reset(tmp_path):
    """Start rank 1 (127.0.0.1) fails at the start of epoch 1 while every poll after the first
    hangs: localhost's worker finishes the training at size 1. The driver waited for the hung
    poll before (600 s here): the job ends far within the bound."""
    logfile = tmp_path / "log.jsonl"
    script = _hanging_script(tmp_path, ["localhost:1", "127.0.0.1:1"])
    proc = _launch(tmp_path, ["-np", "2", "--min-np", "1", "--host-discovery-script",
                              str(script), sys.executable, str(MAIN), "--logfile", str(logfile),
                              "--exit-schedule", json.dumps({"(1, 0)": [1]})])  # fmt: skip
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == 0, _explain(result)
    lines = [json.loads(x) for x in logfile.read_text().splitlines() if x.strip()]
    assert len(lines) == 3, _explain(result)
    _check(lines[1], 1, start_rank=0, size=1, hostname="localhost", rendezvous=2)
    assert _wait_gone([int(p) for p in (tmp_path / "sleeps").read_text().split()]) == []


@pytest.mark.parametrize("how", ["end", "sigterm", "sigkill"])
def test_script_processes_end_with_the_launcher(tmp_path, how):
    """A poll hangs (its ``sleep`` recorded) while the job runs; then the job ends by itself,
    or the launcher gets SIGTERM (it must act at once, not after the poll) or SIGKILL: the
    script's processes are gone within seconds."""
    script = _hanging_script(tmp_path, ["localhost:1"])
    sleeps = tmp_path / "sleeps"
    # The worker runs until the hung poll started, or forever.
    wait = f"while not os.path.exists({str(sleeps)!r}): time.sleep(0.05)"
    if how != "end":
        wait += "\ntime.sleep(600)"
    worker = [sys.executable, "-c", f"import os, time\n{wait}"]
    proc = _launch(tmp_path, ["-np", "1", "--host-discovery-script", str(script), *worker])
    try:
        _wait_file(sleeps, proc)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "sigkill":
            proc.kill()
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    if how == "end":
        assert proc.returncode == 0, err
    elif how == "sigterm":
        assert proc.returncode == 128 + signal.SIGTERM, err
    if how != "sigkill":  # the poll killed at the end is no failure to report
        assert "host discovery failed" not in err, err
    assert _wait_gone([int(p) for p in sleeps.read_text().split()]) == []
