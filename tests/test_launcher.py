"""bagua-run end to end: real processes, real sockets, no core library needed."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "bagua_hvd.runner.launch"]
PREFIX = re.compile(rb"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
CONTRACT = [
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_CONTROLLER",
    "HOROVOD_CPU_OPERATIONS", "BAGUA_HVD_SECRET", "BAGUA_HVD_JOB_ID", "PYTHONUNBUFFERED",
]
TUNING = ["HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY",
          "HOROVOD_LOG_LEVEL", "HOROVOD_GLOO_TIMEOUT_SECONDS", "BAGUA_HVD_TRANSPORT",
          "HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME", "BAGUA_HVD_ALGORITHM"]
# horovodrun does not set torch.distributed's variables (hosts.Slot.env says why): nor do we.
NOT_SET = ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
# A rank's rendezvous through the launcher's store, with the address and secret it was given:
# publish its hostname, read everybody's (STORE=h0,h1,...); rank 0 leaves last so that the store
# (served by rank 0's launcher) outlives every reader.
STORE_EXCHANGE = """
import os
from bagua_hvd.rendezvous.store import StoreClient
e = os.environ
rank, size, job = int(e["HOROVOD_RANK"]), int(e["HOROVOD_SIZE"]), e["BAGUA_HVD_JOB_ID"]
with StoreClient(e["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(e["HOROVOD_GLOO_RENDEZVOUS_PORT"]),
                 bytes.fromhex(e["BAGUA_HVD_SECRET"]), timeout=20) as store:
    store.set(f"{job}/host/{rank}", e["HOROVOD_HOSTNAME"])
    hosts = [store.get(f"{job}/host/{r}").decode() for r in range(size)]
    print("STORE=" + ",".join(hosts), flush=True)
    store.set(f"{job}/done/{rank}", b"1")
    if rank == 0:
        for r in range(size):
            store.get(f"{job}/done/{r}")
"""
# Prints KEY=VALUE for each variable, then runs STORE_EXCHANGE.
PRINT_ENV = [
    "bash", "-c",
    'for k in ' + " ".join(CONTRACT + TUNING + NOT_SET) + '; do echo "$k=${!k}"; done; exec "$0" -c "$1"',
    sys.executable, STORE_EXCHANGE,
]


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.pop("BAGUA_HVD_SECRET", None)
    env.update(extra)
    return env


def bagua_run(args: List[str], timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + args, capture_output=True, timeout=timeout, env=_env(**env),
                          cwd=str(REPO))


def by_rank(output: bytes, stream: str = "stdout") -> Dict[int, List[str]]:
    """Prefixed launcher output -> rank -> lines; every line must carry a prefix."""
    lines: Dict[int, List[str]] = {}
    for raw in output.splitlines():
        match = PREFIX.match(raw)
        assert match, f"unprefixed line {raw!r}"
        assert match.group(2).decode() == stream, raw
        lines.setdefault(int(match.group(1)), []).append(match.group(3).decode())
    return lines


def parse_env(lines: List[str]) -> Dict[str, str]:
    return dict(line.split("=", 1) for line in lines)


def alive(pid: int) -> bool:
    """True when pid exists and is not a zombie (zombies may linger if init does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rpartition(b")")[2].split()[0] not in (b"Z", b"X")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("np", [1, 2, 3])
def test_env_per_rank(np: int) -> None:
    tuning = ["--fusion-threshold-mb", "4", "--cycle-time-ms", "2.5", "--cache-capacity", "7",
              "--log-level", "debug", "--gloo-timeout-seconds", "9", "--transport", "tcp",
              "--network-interfaces", "lo,eth0", "--algorithm", "bytegrad"] if np == 2 else []
    proc = bagua_run(["-np", str(np), "-H", f"localhost:{np}", *tuning, *PRINT_ENV])
    assert proc.returncode == 0, proc.stderr.decode()
    ranks = by_rank(proc.stdout)
    assert sorted(ranks) == list(range(np))
    envs = {rank: parse_env(lines) for rank, lines in ranks.items()}
    for rank, env in envs.items():
        expected = {
            "HOROVOD_RANK": rank, "HOROVOD_SIZE": np, "HOROVOD_LOCAL_RANK": rank,
            "HOROVOD_LOCAL_SIZE": np, "HOROVOD_CROSS_RANK": 0, "HOROVOD_CROSS_SIZE": 1,
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": 1,
            "HOROVOD_HOSTNAME": socket.gethostname(),
            "STORE": ",".join([socket.gethostname()] * np),
        }
        for key, value in expected.items():
            assert env[key] == str(value), (rank, key, env)
        assert all(env[key] == "" for key in NOT_SET), env
        assert re.fullmatch(r"[0-9a-f]{64}", env["BAGUA_HVD_SECRET"]), env
        assert 0 < int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]) < 65536
        assert env["BAGUA_HVD_JOB_ID"]
        for key in ("BAGUA_HVD_SECRET", "BAGUA_HVD_JOB_ID", "HOROVOD_GLOO_RENDEZVOUS_PORT"):
            assert env[key] == envs[0][key], key  # one job: one secret, id and store
        if np == 2:
            assert env["HOROVOD_FUSION_THRESHOLD"] == str(4 * 1024 * 1024)
            assert env["HOROVOD_CYCLE_TIME"] == "2.5"
            assert env["HOROVOD_CACHE_CAPACITY"] == "7"
            assert env["HOROVOD_LOG_LEVEL"] == "DEBUG"
            assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "9"
            assert env["BAGUA_HVD_TRANSPORT"] == "tcp"
            assert env["HOROVOD_GLOO_IFACE"] == "lo"
            assert env["NCCL_SOCKET_IFNAME"] == "lo,eth0"
            assert env["BAGUA_HVD_ALGORITHM"] == "bytegrad"
        else:
            assert all(env[key] == "" for key in TUNING), env  # nothing set unless asked


def test_each_job_gets_a_fresh_secret() -> None:
    secrets_seen = set()
    for _ in range(2):
        proc = bagua_run(["-np", "1", "bash", "-c", "echo $BAGUA_HVD_SECRET $BAGUA_HVD_JOB_ID"])
        assert proc.returncode == 0, proc.stderr.decode()
        secrets_seen.add(by_rank(proc.stdout)[0][0])
    assert len(secrets_seen) == 2


def test_output_prefixes_whole_lines() -> None:
    # Three ranks write long lines to both streams at once; no line may be torn or mixed.
    script = ("import os, sys\n"
              "r = os.environ['HOROVOD_RANK']\n"
              "for i in range(300):\n"
              "    print(f'r{r}-{i}-' + r * 3000)\n"
              "    print(f'e{r}-{i}', file=sys.stderr)\n"
              "sys.stdout.write('partial' + r)\n")
    proc = bagua_run(["-np", "3", sys.executable, "-c", script])
    assert proc.returncode == 0, proc.stderr.decode()
    out = by_rank(proc.stdout)
    err = by_rank(proc.stderr, "stderr")
    for rank in range(3):
        r = str(rank)
        assert out[rank] == [f"r{r}-{i}-" + r * 3000 for i in range(300)] + ["partial" + r]
        assert err[rank] == [f"e{r}-{i}" for i in range(300)]


def test_failing_rank_stops_the_others() -> None:
    # Rank 1 exits 3; rank 0 sleeps; rank 2 ignores SIGTERM (and has a child) so it needs SIGKILL.
    script = ('echo pid=$$; '
              'if [ $HOROVOD_RANK = 1 ]; then sleep 0.5; exit 3; fi; '
              'if [ $HOROVOD_RANK = 2 ]; then trap "" TERM; fi; '
              'sleep 60 & echo child=$!; wait; sleep 60')
    start = time.monotonic()
    proc = bagua_run(["-np", "3", "bash", "-c", script])
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr.decode()
    assert elapsed < 10, elapsed
    err = proc.stderr.decode()
    assert ("Horovod detected that one or more processes exited with non-zero status, thus "
            "causing the job to be terminated. The first process to do so was:\n"
            "Process name: 1\nExit code: 3\n") in err
    assert ("Other processes that exited with non-zero status: 0 (exit code 143, stopped by the "
            "launcher), 2 (exit code 137, stopped by the launcher)") in err
    pids = [int(line.split("=")[1]) for lines in by_rank(proc.stdout).values() for line in lines]
    assert len(pids) == 5  # three ranks and the children of ranks 0 and 2
    assert not [pid for pid in pids if alive(pid)]


def test_sigkilled_rank() -> None:
    proc = bagua_run(["-np", "2", "bash", "-c",
                      'if [ $HOROVOD_RANK = 0 ]; then sleep 0.3; kill -KILL $$; fi; sleep 60'])
    assert proc.returncode == 128 + signal.SIGKILL
    err = proc.stderr.decode()
    assert "Process name: 0\nExit code: 137\n" in err
    assert "SIGKILL" in err


def test_launcher_sigterm_stops_ranks() -> None:
    proc = subprocess.Popen(LAUNCH + ["-np", "2", "bash", "-c", "echo pid=$$; sleep 60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        pids = []
        for _ in range(2):
            line = proc.stdout.readline()
            pids.append(int(line.split(b"=")[1]))
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 5
        assert not [pid for pid in pids if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("args,message", [
    (["-np", "2", "--bogus", "true"], "unrecognized arguments: --bogus"),
    (["--num", "2", "true"], "unrecognized arguments: --num"),  # no abbreviations
    (["true"], "-np/--num-proc"),
    (["-np", "2"], "no command given"),
    (["-np", "0", "true"], "must be >= 1"),
    (["-np", "4", "-H", "localhost:2", "true"], "only 2 slots"),
    (["-np", "5", "-H", "gpu-node-7:2,gpu-node-8:2", "true"],
     "Requested more processes (5) than there are available slots (4)"),
    (["-np", "2", "-H", "a:1,a:1", "true"], "host 'a' is listed more than once"),
    (["-np", "2", "-H", "a:2", "--hostfile", "f", "true"], "not allowed with argument"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "true"], "cannot read --hostfile"),
    (["-np", "2", "--log-level", "loud", "true"], "invalid choice"),
    (["-np", "3", "--num-nodes", "2", "--rendezvous-addr", "127.0.0.1:1", "true"],
     "not divisible"),
    (["-np", "2", "--num-nodes", "2", "true"], "--rendezvous-addr"),
])
def test_bad_command_lines(args: List[str], message: str) -> None:
    proc = bagua_run(args)
    assert proc.returncode == 2
    assert message in proc.stderr.decode()


def test_several_nodes_need_a_secret() -> None:
    proc = bagua_run(["-np", "2", "--num-nodes", "2", "--node-rank", "1",
                      "--rendezvous-addr", "127.0.0.1:1", "true"])
    assert proc.returncode == 1
    assert "BAGUA_HVD_SECRET" in proc.stderr.decode()


def test_unreachable_rendezvous_times_out() -> None:
    start = time.monotonic()
    proc = bagua_run(["-np", "2", "--num-nodes", "2", "--node-rank", "1", "--start-timeout", "1",
                      "--rendezvous-addr", f"127.0.0.1:{free_port()}", "true"],
                     BAGUA_HVD_SECRET="ab" * 32)
    assert proc.returncode == 1
    assert "could not reach the rendezvous server" in proc.stderr.decode()
    assert time.monotonic() - start < 10


def test_node_with_another_secret_is_rejected() -> None:
    port = free_port()
    common = ["-np", "2", "--num-nodes", "2", "--rendezvous-addr", f"127.0.0.1:{port}"]
    node0 = subprocess.Popen(LAUNCH + common + ["--node-rank", "0", "sleep", "20"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_env(BAGUA_HVD_SECRET="ab" * 32))
    try:
        proc = bagua_run(common + ["--node-rank", "1", "true"], BAGUA_HVD_SECRET="cd" * 32)
        assert proc.returncode == 1
        assert "rejected this node's BAGUA_HVD_SECRET" in proc.stderr.decode()
    finally:
        node0.send_signal(signal.SIGTERM)
        node0.communicate(timeout=10)
    assert node0.returncode == 128 + signal.SIGTERM


def test_version() -> None:
    import bagua_hvd

    proc = bagua_run(["--version"])
    assert proc.returncode == 0
    assert proc.stdout.decode().strip() == bagua_hvd.__version__ == "0.1.0"


def test_check_build() -> None:
    proc = bagua_run(["--check-build"])
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    for section in ("Available Frameworks:", "Available Controllers:",
                    "Available Transports:", "Available Tensor Operations:"):
        assert section in out
    for name in ("PyTorch", "TensorFlow", "Shared memory", "TCP", "NCCL", "Gloo", "CUDA"):
        assert re.search(rf"^    \[[X ]\] {name}", out, re.M), name


def test_check_build_refuses_a_core_of_another_version(monkeypatch) -> None:
    """The core reports the version it was built as (bhvd_version); a core library left from
    another version of the sources is reported, not used."""
    from importlib.metadata import version

    from bagua_hvd.common import _native
    from bagua_hvd.runner import check_build

    core = _native.ffi.string(_native.lib().bhvd_version()).decode()
    assert core == version("bagua_hvd")
    assert "Core library not loaded" not in check_build.check_build_text()
    monkeypatch.setattr(check_build, "__version__", "9.9.9")
    text = check_build.check_build_text()
    assert f"is version {core}, the Python package 9.9.9: rebuild it" in text
    assert re.search(r"^    \[ \] Gloo", text, re.M)


def test_output_filename(tmp_path: Path) -> None:
    proc = bagua_run(["-np", "11", "--output-filename", str(tmp_path), "bash", "-c",
                      'echo out $HOROVOD_RANK; echo err $HOROVOD_RANK >&2; printf "tail"'])
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank.{r:02d}" for r in range(11)]
    for rank in range(11):
        rank_dir = tmp_path / f"rank.{rank:02d}"
        assert (rank_dir / "stdout").read_text() == f"out {rank}\ntail"  # raw, unprefixed
        assert (rank_dir / "stderr").read_text() == f"err {rank}\n"
    assert by_rank(proc.stdout)[10] == ["out 10", "tail"]  # the terminal still gets it too


def test_two_launchers_as_two_nodes() -> None:
    port = free_port()
    secret = os.urandom(32)
    env = {"BAGUA_HVD_SECRET": secret.hex()}
    common = ["-np", "4", "--num-nodes", "2", "--rendezvous-addr", f"127.0.0.1:{port}"]
    command = PRINT_ENV
    # Node 1 starts first and waits for node 0's rendezvous server.
    node1 = subprocess.Popen(LAUNCH + common + ["--node-rank", "1"] + command,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(**env))
    node0: Optional[subprocess.CompletedProcess] = None
    try:
        time.sleep(0.5)
        node0 = bagua_run(common + ["--node-rank", "0"] + command, **env)
        out1, err1 = node1.communicate(timeout=30)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    assert node0.returncode == 0, node0.stderr.decode()
    assert node1.returncode == 0, err1.decode()
    envs = {}
    for node, out in ((0, node0.stdout), (1, out1)):
        ranks = by_rank(out)
        assert sorted(ranks) == [2 * node, 2 * node + 1]  # node-major placement
        for rank, lines in ranks.items():
            envs[rank] = parse_env(lines)
    hostnames = {rank: env["HOROVOD_HOSTNAME"] for rank, env in envs.items()}
    assert hostnames[0] == hostnames[1] != hostnames[2] == hostnames[3]
    for rank, env in envs.items():
        node = rank // 2
        assert env["HOROVOD_RANK"] == str(rank)
        assert env["HOROVOD_SIZE"] == "4"
        assert env["HOROVOD_LOCAL_RANK"] == str(rank % 2)
        assert env["HOROVOD_LOCAL_SIZE"] == "2"
        assert env["HOROVOD_CROSS_RANK"] == str(node)
        assert env["HOROVOD_CROSS_SIZE"] == "2"
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == str(port)
        assert env["BAGUA_HVD_SECRET"] == secret.hex()
        assert env["BAGUA_HVD_JOB_ID"] == envs[0]["BAGUA_HVD_JOB_ID"]
        # All four ranks met in node 0's store, with their node's own hostname.
        assert env["STORE"] == ",".join(hostnames[r] for r in range(4))


# Each rank prints its pid and a child's; rank 1 (and its child) ignore SIGTERM, so that only
# SIGKILL ends them.
RANK_WITH_CHILD = ('if [ $HOROVOD_RANK = 1 ]; then trap "" TERM; fi; '
                   'sleep 60 & echo child=$!; echo pid=$$; wait')


def _read_pids(proc: subprocess.Popen, count: int, timeout: float = 30) -> List[int]:
    """The pids printed as pid=N / child=N by the launcher's ranks (count of them)."""
    pids: List[int] = []
    buffer = b""
    deadline = time.monotonic() + timeout
    while len(pids) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {pids} after {timeout} s; {buffer!r}"
        if not select.select([proc.stdout], [], [], left)[0]:
            continue
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, f"the launcher closed its output; {pids}, {proc.stderr.read()!r}"
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        pids += [int(line.rpartition(b"=")[2]) for line in lines if b"pid=" in line
                 or b"child=" in line]
    return pids


def _gone_within(pids: List[int], timeout: float) -> List[int]:
    """Waits up to timeout for every pid to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def _kill_all(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


RUN_API = """
import bagua_hvd, os, subprocess
def rank():
    child = subprocess.Popen(["sleep", "60"])
    print(f"child={child.pid}", flush=True)
    print(f"pid={os.getpid()}", flush=True)
    child.wait()
bagua_hvd.run(rank, np=2)
"""


@pytest.mark.parametrize("mode", ["bagua-run", "bagua_hvd.run", "node 1 of 2"])
def test_sigkilled_launcher_takes_its_ranks_down(mode: str) -> None:
    # SIGKILL gives the launcher no chance to stop its ranks: they (and their children) must
    # still be gone within KILL_AFTER_S (3 s) and some slack for a loaded machine.
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(REPO))
    others: List[subprocess.Popen] = []
    other_pids: List[int] = []
    if mode == "bagua-run":
        launcher = subprocess.Popen(LAUNCH + ["-np", "2", "bash", "-c", RANK_WITH_CHILD],
                                    env=_env(), **popen)
    elif mode == "bagua_hvd.run":
        launcher = subprocess.Popen([sys.executable, "-c", RUN_API], env=_env(), **popen)
    else:  # the launcher of node 1 dies; node 0's ranks are another launcher's and live on
        env = _env(BAGUA_HVD_SECRET=os.urandom(32).hex())
        common = LAUNCH + ["-np", "4", "--num-nodes", "2", "--rendezvous-addr",
                           f"127.0.0.1:{free_port()}"]
        others.append(subprocess.Popen(common + ["--node-rank", "0", "bash", "-c",
                                                 RANK_WITH_CHILD], env=env, **popen))
        launcher = subprocess.Popen(common + ["--node-rank", "1", "bash", "-c", RANK_WITH_CHILD],
                                    env=env, **popen)
    pids: List[int] = []
    try:
        pids = _read_pids(launcher, 4)
        if others:
            other_pids = _read_pids(others[0], 4)
        time.sleep(0.5)
        assert not [pid for pid in pids + other_pids if not alive(pid)]  # all were running
        launcher.kill()
        launcher.wait(timeout=10)
        left = _gone_within(pids, 10)
        assert not left, f"processes {left} of {pids} outlived their SIGKILLed launcher"
        # No false kills: another launcher's ranks are untouched.
        assert not [pid for pid in other_pids if not alive(pid)], other_pids
    finally:
        for proc in [launcher] + others:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=20)
            proc.stdout.close()
            proc.stderr.close()
        _kill_all(pids + other_pids)  # whatever a failed run left behind
    assert not _gone_within(other_pids, 10)  # node 0's launcher stopped its own (SIGTERM)


def test_a_host_that_cannot_be_reached_is_named() -> None:
    # A name that does not resolve: ssh fails at once; the launcher names the host, starts
    # nothing and exits 1 (no sshd needed: tests/test_ssh_hosts.py has the real hosts).
    proc = bagua_run(["-np", "3", "-H", "localhost:1,no-such-host.invalid:2",
                      "--start-timeout", "5", "true"])
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "host no-such-host.invalid: ssh failed" in err, err
    assert "localhost" not in err.split("cannot start ranks on", 1)[1], err


def test_hosts_fill_in_order_with_horovods_local_and_cross_ranks(tmp_path) -> None:
    from bagua_hvd.runner.hosts import assign_slots, parse_hostfile

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\na slots=3\n\nb   slots=1  # small one\nc:2\n")
    entries = parse_hostfile(str(hostfile))
    assert entries == [("a", 3), ("b", 1), ("c", 2)]
    placed = assign_slots(entries, 5)  # c gets one of its two slots
    got = [(h, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
           for h, slots in placed for s in slots]
    assert got == [  # written out by hand from Horovod's rules
        ("a", 0, 0, 3, 0, 3), ("a", 1, 1, 3, 0, 1), ("a", 2, 2, 3, 0, 1),
        ("b", 3, 0, 1, 1, 3),
        ("c", 4, 0, 1, 2, 3),
    ]
    assert [h for h, _ in assign_slots(entries, 3)] == ["a"]  # unused hosts are not started
    hostfile.write_text("a slots=2 gpus=4\n")
    with pytest.raises(ValueError, match="line 1: expected 'HOST slots=N'"):
        parse_hostfile(str(hostfile))


def test_slurm_node_lists_and_counts_expand() -> None:
    from bagua_hvd.rendezvous.hostlist import expand_counts, expand_nodelist
    from bagua_hvd.runner.slurm import allocation

    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07",
                                                      "gpu5"]  # fmt: skip
    assert expand_nodelist("r[1-2]-n[8-9]") == ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    env = {"SLURM_JOB_NODELIST": "c[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert allocation(env) == [("c1", 4), ("c2", 4)]
    assert allocation({}) is None
    with pytest.raises(ValueError, match="2 nodes .* 1 per-node counts"):
        allocation({"SLURM_JOB_NODELIST": "c[1-2]", "SLURM_TASKS_PER_NODE": "4"})


def test_inside_a_slurm_allocation_the_hosts_come_from_it() -> None:
    env = dict(os.environ, SLURM_JOB_NODELIST="no-such-node[1-2].invalid",
               SLURM_TASKS_PER_NODE="2(x2)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "5", "true"],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Requested more processes (5) than there are available slots (4)" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "4",
                           "--start-timeout", "5", "true"],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # the allocation's nodes are tried over ssh
    assert "host no-such-node1.invalid: ssh failed" in proc.stderr, proc.stderr
    assert "host no-such-node2.invalid: ssh failed" in proc.stderr, proc.stderr
