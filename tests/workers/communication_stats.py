"""Worker for tests/test_communication_stats.py, run as 2 simulated hosts x 2 ranks (shared memory
within a host, TCP between): hvd.communication_stats() around known collectives. Each rank prints
one ``STATS {json}`` line per case with what the case added to its counters, which the test sums
over the ranks and compares with the collectives' formulas.

Two jobs in one run of this script: the first without HOROVOD_HIERARCHICAL_ALLREDUCE (a plain
allreduce, ByteGrad hierarchical and flat), then shutdown(), HOROVOD_HIERARCHICAL_ALLREDUCE=1 and
init() again (the counters restart from zero, then the same plain allreduce). Under
HOROVOD_TIMELINE, rank 0's timeline shows the second job.
"""

from __future__ import annotations

import json
import os

import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common import ops
from bagua_hvd.common import primitives as P
from bagua_hvd.common._native import lib

PLAIN = 1 << 20  # float32 elements of the plain allreduce (4 MiB)
BYTEGRAD = int(os.environ["STATS_BYTEGRAD_COUNT"])  # float32 elements of the ByteGrad bucket
KEYS = {"within_host_bytes_sent", "between_hosts_bytes_sent", "calls"}


def delta(before: dict, after: dict) -> dict:
    out = {}
    for op, counts in after.items():
        old = before.get(op, dict.fromkeys(KEYS, 0))
        d = {k: counts[k] - old[k] for k in KEYS}
        if any(d.values()):
            out[op] = d
    return out


def report(case: str, fn) -> None:
    before = hvd.communication_stats()
    sent_before = lib().bhvd_stat(b"bytes_sent"), lib().bhvd_stat(b"bytes_sent_remote")
    fn()
    after = hvd.communication_stats()
    sent = lib().bhvd_stat(b"bytes_sent") - sent_before[0]
    remote = lib().bhvd_stat(b"bytes_sent_remote") - sent_before[1]
    for counts in after.values():
        assert set(counts) == KEYS, counts
    d = delta(before, after)
    # bhvd_stat's totals are the sums of the table.
    assert sent == sum(
        c["within_host_bytes_sent"] + c["between_hosts_bytes_sent"] for c in d.values()
    )
    assert remote == sum(c["between_hosts_bytes_sent"] for c in d.values())
    line = {"case": case, "rank": hvd.rank(), "host": hvd.cross_rank(), "delta": d}
    print("STATS " + json.dumps(line), flush=True)


def plain_allreduce(name: str) -> None:
    t = torch.full((PLAIN,), float(hvd.rank() + 1))
    out = hvd.allreduce(t, op=hvd.Sum, name=name)
    assert torch.all(out == float(sum(range(1, hvd.size() + 1)))), out[:4]


def bytegrad(name: str, hierarchical: bool) -> None:
    t = torch.linspace(-1.0, 1.0, BYTEGRAD) * (hvd.rank() + 1)
    buf = P.Buffer(t.data_ptr(), ops.FLOAT32, t.numel())
    P.allreduce(
        buf, name, 0, reduce_op=ops.Average, compressed=True, hierarchical=hierarchical
    ).wait()
    # The mean of (r + 1) * x over 4 ranks is 2.5 x; two 8-bit quantizations of [-2.5, 2.5]
    # (hierarchical: one of [-1.5, 1.5] and one of [-3.5, 3.5] on the hosts) lose < 0.1.
    expected = torch.linspace(-1.0, 1.0, BYTEGRAD) * 2.5
    assert float((t - expected).abs().max()) < 0.1, float((t - expected).abs().max())


os.environ.pop("HOROVOD_HIERARCHICAL_ALLREDUCE", None)
os.environ.pop("HOROVOD_TIMELINE", None)
timeline = os.environ.pop("STATS_TIMELINE", "")
hvd.init()
assert hvd.size() == 4, hvd.size()
RANK = hvd.rank()
report("init", lambda: None)  # an empty delta...
assert hvd.communication_stats() == {}, hvd.communication_stats()  # ...of nothing: init sends none
report("allreduce flat", lambda: plain_allreduce("s.flat"))
report("bytegrad hierarchical", lambda: bytegrad("s.bg.hier", True))
report("bytegrad flat", lambda: bytegrad("s.bg.flat", False))
hvd.shutdown()

os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
if timeline:
    os.environ["HOROVOD_TIMELINE"] = timeline  # rank 0 writes it
hvd.init()
assert hvd.communication_stats() == {}, hvd.communication_stats()  # counting restarts at init
report("allreduce hierarchical", lambda: plain_allreduce("s.hier"))
hvd.barrier()
hvd.shutdown()  # the timeline file is complete
print(f"rank {RANK} OK", flush=True)
