"""Jobs on several hosts, started over OpenSSH as horovodrun does (``bagua-run -H h1:4,h2:4``).

The launcher serves the rendezvous, checks that every remote host answers ssh, then runs one
agent per host (bagua_hvd.runner.agent): over ``ssh HOST`` for other machines, directly for
this one. Each agent starts its host's ranks; their prefixed output comes back through the
agent's stdout/stderr and is forwarded as it arrives.

Differences from horovodrun, on purpose:

- One ssh per host, not per rank, and the environment (the job's secret among it) travels on
  the agent's stdin, never on a command line (``ps`` on either host shows no secret).
- Host keys: ``StrictHostKeyChecking=accept-new`` (a new host is trusted on first use, a changed
  key is refused), where horovodrun turns checking off. ``BatchMode=yes``: ssh never prompts.
- Every wait is bounded: the reachability check by ``--start-timeout``; a dead connection by ssh's
  keep-alives; stopping by the grace times below.

Stopping: a rank failing anywhere, or SIGINT/SIGTERM/SIGHUP to the launcher, closes every
agent's stdin; an agent then stops its ranks (SIGTERM, SIGKILL after job.KILL_AFTER_S). An agent
still there after AGENT_GRACE_S has its ssh ended (its connection closes, so the remote agent
sees end of file too), and is killed after job.KILL_AFTER_S more.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import queue
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from bagua_hvd.common import network
from bagua_hvd.runner.agent import REPORT
from bagua_hvd.runner.hosts import Slot, is_local_host
from bagua_hvd.runner.job import (
    DRAIN_TIMEOUT_S,
    FAILURE_GRACE_S,
    KILL_AFTER_S,
    OUTPUT,
    JobResult,
    LaunchError,
    SignalTrap,
    output_rank_dir,
    shell_exit_code,
)

# An agent stops its ranks within KILL_AFTER_S (SIGTERM, then SIGKILL) and drains their output
# within DRAIN_TIMEOUT_S; one more second for ssh to carry its last lines.
AGENT_GRACE_S = KILL_AFTER_S + DRAIN_TIMEOUT_S + 1.0
SSH_ARGS_ENV = "BAGUA_HVD_SSH_ARGS"  # extra ssh options, e.g. "-F ~/.ssh/cluster_config"
# Not forwarded to other hosts (horovodrun's list, plus what names this shell or this host).
_NOT_FORWARDED = re.compile(
    r"^(BASH_FUNC_.*|OLDPWD|PWD|SHLVL|_|HOSTNAME|SSH_.*|DISPLAY|XAUTHORITY|TMUX.*|"
    r".*CUDA_VISIBLE_DEVICES)$"
)
_LINE = re.compile(rb"^\[(\d+)\]<(stdout|stderr)>:")
_POLL_S = 0.1


def ssh_command(
    host: str, port: Optional[int], identity: Optional[str], connect_timeout: float
) -> List[str]:
    """The ssh client's argv up to and including the host."""
    cmd = [
        "ssh",
        "-o", "BatchMode=yes",
        "-o", "PasswordAuthentication=no",
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
        "-o", "ServerAliveInterval=10",
        "-o", "ServerAliveCountMax=3",
    ]  # fmt: skip
    if port is not None:
        cmd += ["-p", str(port)]
    if identity is not None:
        cmd += ["-i", identity]
    cmd += shlex.split(os.environ.get(SSH_ARGS_ENV, ""))
    return cmd + [host]


AGENT = ("-m", "bagua_hvd.runner.agent")


def agent_command(env: Mapping[str, str], args: Sequence[str] = AGENT) -> str:
    """The shell command that runs this interpreter with ``args`` on a remote host (by default
    the agent): the same path (hosts of one job share their software layout, as horovodrun
    assumes) with this PYTHONPATH."""
    words = [sys.executable, *args]
    prefix = ""
    if env.get("PYTHONPATH"):
        prefix = "PYTHONPATH=" + shlex.quote(env["PYTHONPATH"]) + " "
    return prefix + "exec " + shlex.join(words)


def forwarded_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """What of the launcher's environment the ranks of other hosts get."""
    return {k: v for k, v in environ.items() if not _NOT_FORWARDED.match(k)}


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (LaunchError when it has none)."""
    addr = network.interface_address(name)
    if addr is None:
        raise LaunchError(f"--network-interfaces: interface {name!r} has no IPv4 address here")
    return addr


def address_toward(host: str, port: int) -> str:
    """The local address that traffic to ``host`` leaves from (what its ranks reach us at)."""
    try:
        return network.address_toward(host, port)
    except socket.gaierror as e:
        raise LaunchError(f"cannot resolve host {host!r}: {e}") from None
    except OSError as e:
        raise LaunchError(f"no route to host {host!r}: {e}") from None


def check_hosts(
    hosts: Sequence[str],
    port: Optional[int],
    identity: Optional[str],
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
) -> None:
    """Checks, in parallel and within ``timeout`` seconds, that every host answers ssh and can
    run this interpreter with bagua_hvd (with the PYTHONPATH of ``env``, default this process's,
    as the agents will); LaunchError naming every host that cannot."""
    probe = agent_command(os.environ if env is None else env, ("-c", "import bagua_hvd"))

    def one(host: str) -> Optional[str]:
        cmd = ssh_command(host, port, identity, timeout) + [probe]
        try:
            proc = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout + 5,
            )
        except FileNotFoundError:
            return "no ssh client here (install OpenSSH's client)"
        except subprocess.TimeoutExpired:
            return f"no answer over ssh within {timeout:g} s"
        if proc.returncode == 0:
            return None
        text = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        detail = text[-1] if text else f"exit code {proc.returncode}"
        if proc.returncode == 255:
            return f"ssh failed: {detail}"
        return f"ssh works, but {sys.executable} cannot import bagua_hvd there: {detail}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        errors = [(h, e) for h, e in zip(hosts, pool.map(one, hosts)) if e is not None]
    if errors:
        raise LaunchError(
            "cannot start ranks on "
            + "; ".join(f"host {h}: {e}" for h, e in errors)
            + " (check -H/--hostfile, -p/--ssh-port, -i/--ssh-identity-file, --start-timeout)"
        )


@dataclasses.dataclass
class Agent:
    host: str
    slots: List[Slot]
    proc: subprocess.Popen
    threads: List[threading.Thread]
    error: Optional[Tuple[str, int]] = None  # the agent could not start its ranks
    tail: List[str] = dataclasses.field(default_factory=list)  # its last lines of stderr

    def close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


class OutputCopies:
    """--output-filename on the launcher's machine: each rank's raw lines in
    ``DIR/rank.<padded>/stdout|stderr``, as horovodrun writes them."""

    def __init__(self, output_dir: Optional[str], size: int) -> None:
        self.dir, self.size = output_dir, size
        self.files: Dict[Tuple[int, str], IO[bytes]] = {}
        self.lock = threading.Lock()
        self.failed = False
        if output_dir is not None:
            # Refused before any rank starts, as one-host runs do (LaunchError naming it).
            output_rank_dir(output_dir, 0, size)

    def write(self, line: bytes) -> None:
        if self.dir is None:
            return
        m = _LINE.match(line)
        if m is None:
            return
        key = (int(m.group(1)), m.group(2).decode())
        with self.lock:
            try:
                f = self.files.get(key)
                if f is None:
                    d = output_rank_dir(self.dir, key[0], self.size)
                    f = self.files[key] = open(d / key[1], "ab")
                f.write(line[m.end() :])
                f.flush()
            except (OSError, LaunchError) as e:
                # A copy that fails later (disk full) must not cost the console its output.
                if not self.failed:
                    self.failed = True
                    OUTPUT.write(
                        "stderr", f"bagua-run: --output-filename copy failed: {e}\n".encode()
                    )

    def close(self) -> None:
        with self.lock:
            for f in self.files.values():
                f.close()


def _pump(agent: Agent, pipe: IO[bytes], kind: str, copies: OutputCopies, events: queue.Queue):
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if kind == "stdout" and line.startswith(REPORT):
                try:
                    events.put(("report", agent, json.loads(line[len(REPORT) :])))
                except ValueError:
                    pass
                continue
            if kind == "stderr" and not _LINE.match(line):
                agent.tail = (agent.tail + [line.decode("utf-8", "replace").rstrip()])[-5:]
            copies.write(line)
            OUTPUT.write(kind, line)
    except (OSError, ValueError):
        pass
    finally:
        pipe.close()


def start_agent(
    host: str,
    slots: List[Slot],
    spec: dict,
    argv: List[str],
    copies: OutputCopies,
    events: queue.Queue,
) -> Agent:
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only
        )
    except OSError as e:
        raise LaunchError(f"cannot start {argv[0]!r} for host {host}: {e.strerror or e}") from e
    agent = Agent(host=host, slots=slots, proc=proc, threads=[])
    for kind, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        t = threading.Thread(
            target=_pump,
            args=(agent, pipe, kind, copies, events),
            name=f"bagua-run-{host}-{kind}",
            daemon=True,
        )
        t.start()
        agent.threads.append(t)

    def wait() -> None:
        events.put(("gone", agent, proc.wait()))

    threading.Thread(target=wait, name=f"bagua-run-{host}-wait", daemon=True).start()
    try:
        proc.stdin.write(json.dumps(dict(spec, host=host)).encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        pass  # the agent is gone already: its exit is reported like any other
    return agent


def run_hosts(
    command: Sequence[str],
    placement: List[Tuple[str, List[Slot]]],
    env: Mapping[str, str],
    *,
    ssh_port: Optional[int] = None,
    ssh_identity: Optional[str] = None,
    start_timeout: float = 30,
    output_dir: Optional[str] = None,
    verbose: bool = False,
    cwd: Optional[str] = None,
) -> JobResult:
    """Runs ``command`` on every slot of ``placement`` (host, its slots) with the launcher's
    environment + ``env`` + the slot's variables; returns once every agent is gone."""
    spec = {
        "command": list(command),
        "env": dict(forwarded_env(os.environ), **env),
        "cwd": cwd or os.getcwd(),
        "verbose": verbose,
    }
    size = sum(len(slots) for _, slots in placement)
    copies = OutputCopies(output_dir, size)
    events: queue.Queue = queue.Queue()
    agents: List[Agent] = []
    try:
        with SignalTrap() as trap:
            try:
                for host, slots in placement:
                    if is_local_host(host):
                        argv = [sys.executable, *AGENT]
                    else:
                        argv = ssh_command(host, ssh_port, ssh_identity, start_timeout)
                        argv.append(agent_command(spec["env"]))
                    if verbose:
                        print(
                            f"bagua-run: host {host}: ranks {slots[0].rank}..{slots[-1].rank}: "
                            + shlex.join(argv),
                            file=sys.stderr,
                            flush=True,
                        )
                    job = dict(spec, slots=[dataclasses.asdict(s) for s in slots])
                    agents.append(start_agent(host, slots, job, argv, copies, events))
                return _supervise(agents, events, trap, verbose)
            except BaseException:
                end_agents(agents, time.monotonic())
                raise
    finally:
        copies.close()


def end_agents(agents: Sequence[Agent], since: float) -> None:
    """Closes the agents' stdin; ends the ssh of those still there after AGENT_GRACE_S."""
    for a in agents:
        a.close_stdin()
    for a in agents:
        left = since + AGENT_GRACE_S - time.monotonic()
        try:
            a.proc.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            a.proc.terminate()
            try:
                a.proc.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                a.proc.kill()
                a.proc.wait()
    for a in agents:
        for t in a.threads:
            t.join(timeout=DRAIN_TIMEOUT_S)


def _supervise(
    agents: List[Agent], events: queue.Queue, trap: SignalTrap, verbose: bool
) -> JobResult:
    running = set(range(len(agents)))
    index = {id(a): i for i, a in enumerate(agents)}
    codes: Dict[int, int] = {}
    failed_rank: Optional[int] = None
    failure_note: Optional[str] = None
    got_signal: Optional[int] = None
    stop_at: Optional[float] = None  # when the agents' stdin is to be closed
    stopped_at: Optional[float] = None
    stopped: set = set()
    terminated = killed = False
    seen_signals = 0
    joined: set = set()

    def fail(rank: int, code: int, note: Optional[str] = None) -> None:
        nonlocal failed_rank, failure_note, stop_at
        if failed_rank is None and got_signal is None and stopped_at is None:
            failed_rank, failure_note = rank, note
            stop_at = time.monotonic() + FAILURE_GRACE_S

    while running:
        now = time.monotonic()
        if len(trap.received) > seen_signals:
            if seen_signals == 0 and failed_rank is None:
                got_signal = trap.received[0]
            if stopped_at is not None:  # a second signal: no more patience
                stopped_at = min(stopped_at, now - AGENT_GRACE_S)
            stop_at = now if stop_at is None else min(stop_at, now)
            seen_signals = len(trap.received)
        if stop_at is not None and stopped_at is None and now >= stop_at:
            stopped_at = now
            for i in sorted(running):
                stopped.update(s.rank for s in agents[i].slots if s.rank not in codes)
                agents[i].close_stdin()
        if stopped_at is not None and not terminated and now >= stopped_at + AGENT_GRACE_S:
            terminated = True
            for i in sorted(running):
                if verbose:
                    print(f"bagua-run: host {agents[i].host}: ending its ssh", file=sys.stderr)
                agents[i].proc.terminate()
        if terminated and not killed and now >= stopped_at + AGENT_GRACE_S + KILL_AFTER_S:
            killed = True
            for i in sorted(running):
                agents[i].proc.kill()
        try:
            what, agent, value = events.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if what == "report":
            if "exit" in value:
                rank, code = value["exit"]
                codes[rank] = code
                if code != 0:
                    fail(rank, code)
            elif "error" in value:
                agent.error = (value["error"], int(value.get("exit_code", 1)))
            continue
        i = index[id(agent)]
        if i not in joined:
            # Its process is gone: let its output drain (queueing its last reports), then
            # take the exit again behind them.
            for t in agent.threads:
                t.join(timeout=DRAIN_TIMEOUT_S)
            joined.add(i)
            events.put((what, agent, value))
            continue
        running.discard(i)
        code = shell_exit_code(value)
        if verbose:
            print(f"bagua-run: host {agent.host}: agent exited with code {code}", file=sys.stderr)
        missing = [s.rank for s in agent.slots if s.rank not in codes]
        if agent.error is not None:
            message, code = agent.error
            note = f"cannot start the ranks of host {message}"
        else:
            detail = "; ".join(agent.tail[-2:]) or f"exit code {code}"
            note = f"host {agent.host} was lost ({detail})"
        if missing and code != 0:
            for r in missing:
                codes[r] = code
            fail(missing[0], code, note)
    return JobResult.ended(codes, failed_rank, got_signal, stopped, failure_note)
