"""Init/shutdown cycles and memory: nothing may leak (threads, fds, /dev/shm names, RSS).

Run by every rank of a launched job (or alone at size 1).
"""

from __future__ import annotations

import gc
import os
import re
import time
from typing import Callable

import pytest
import torch

import bagua_hvd.torch as hvd

CYCLES = int(os.environ.get("BAGUA_HVD_TEST_INIT_CYCLES", "200"))
RSS_CALLS = int(os.environ.get("BAGUA_HVD_TEST_RSS_CALLS", "10000"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_settled(ok: Callable[[int], bool], within_s: float = 5.0) -> int:
    """The thread count once ``ok(count)`` holds, or after ``within_s``: a joined thread can
    stay listed in /proc/self/task for a moment after pthread_join returns (the kernel wakes
    the joiner during the thread's exit, before it unlinks the task), while a leaked thread
    stays for good."""
    deadline = time.monotonic() + within_s
    while True:
        n = _threads()
        if ok(n) or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _shm_prefix() -> str:
    """The /dev/shm name prefix of this job's segments (the core sanitizes the job id)."""
    job = os.environ.get("BAGUA_HVD_JOB_ID", "")
    return "bhvd_" + (re.sub(r"[^A-Za-z0-9._-]", "_", job[:64]) or "job")


def _shm_names() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(_shm_prefix())}
    except FileNotFoundError:
        return set()


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("VmRSS not found in /proc/self/status")


def _cycle(i: int) -> None:
    hvd.barrier()  # any rank's shutdown stops the job: shut down together
    hvd.shutdown()
    hvd.init()
    got = hvd.allreduce(torch.ones(4), op=hvd.Sum, name=f"cycle.{i}")
    assert torch.equal(got, torch.full((4,), float(hvd.size())))


def test_the_core_thread_is_named():
    """top -H, gdb and py-spy show the core's background thread by name, as gloo's are."""
    names = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.add(f.read().strip())
    assert "bhvd_core" in names, sorted(names)


def test_init_shutdown_cycles_leak_nothing():
    _cycle(-1)  # warm-up: lazy allocations of the first init
    gc.collect()
    threads, fds, shm = _threads(), _fds(), _shm_names()
    for i in range(CYCLES):
        _cycle(i)
    gc.collect()
    left = _threads_settled(lambda n: n == threads)
    assert left == threads, f"threads {threads} -> {left} after {CYCLES} cycles"
    assert _fds() == fds, f"fds {fds} -> {_fds()}: {sorted(os.listdir('/proc/self/fd'))}"
    assert _shm_names() == shm, f"/dev/shm {sorted(shm)} -> {sorted(_shm_names())}"
    # after a final shutdown the core's background thread is gone too
    hvd.barrier()
    hvd.shutdown()
    left = _threads_settled(lambda n: n < threads)
    assert left < threads, f"{left} threads left after shutdown (was {threads})"
    assert _shm_names() == shm
    hvd.init()


def _skip_under_a_sanitizer() -> None:
    if any(rt in os.environ.get("LD_PRELOAD", "") for rt in ("libasan", "libtsan")):
        # .ci/sanitize: the sanitizer's allocator holds freed memory back (ASan's quarantine,
        # 256 MiB): RSS grows without a leak there. Measured in the plain runs of this file.
        pytest.skip("RSS is no leak measure under a sanitizer's allocator")


def test_allreduce_rss_stable():
    _skip_under_a_sanitizer()
    x = torch.ones(1024, dtype=torch.float32)  # 4 KiB
    y = torch.ones(1024, dtype=torch.float32)
    n = float(hvd.size())
    for _ in range(1000):  # warm-up: caches, allocator pools
        hvd.allreduce(x, op=hvd.Sum, name="rss")
        hvd.allreduce_(y, op=hvd.Sum)
    # A leak grows with the calls, in both halves alike; a one-off step (the allocator mapping
    # a new region, the kernel collapsing pages into huge pages: 6 MiB once, seen in CI) does
    # not. The test fails when both halves grow, by 100 bytes a call or more.
    rss = []
    for _half in range(2):
        gc.collect()
        rss.append(_rss_kib())
        for i in range(RSS_CALLS // 2):
            out = hvd.allreduce(x, op=hvd.Sum, name="rss")
            if i % 2:
                hvd.synchronize(hvd.allreduce_async_(y.fill_(1.0), op=hvd.Sum))
    gc.collect()
    rss.append(_rss_kib())
    grew = [b - a for a, b in zip(rss, rss[1:])]
    assert out[0].item() == n
    assert min(grew) < 512, f"RSS grew {grew} KiB over two halves of {RSS_CALLS} allreduces"
    assert rss[-1] - rss[0] < 16 << 10, f"RSS grew {rss[-1] - rss[0]} KiB"
    assert not hvd.mpi_ops._handle_map, "handles left in the map"


def test_allgather_alltoall_rss_stable():
    _skip_under_a_sanitizer()
    x = torch.ones(256, 4)
    splits = [256 // hvd.size()] * hvd.size()
    splits[0] += 256 - sum(splits)
    for _ in range(300):
        hvd.allgather(x, name="rss.ag")
        hvd.alltoall(x, splits=splits, name="rss.a2a")
    gc.collect()
    before = _rss_kib()
    for _ in range(2000):
        hvd.allgather(x, name="rss.ag")
        hvd.alltoall(x, splits=splits, name="rss.a2a")
    gc.collect()
    assert _rss_kib() - before < 1024, f"RSS grew {_rss_kib() - before} KiB"
