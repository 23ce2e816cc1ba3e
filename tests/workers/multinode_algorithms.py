"""Worker for tests/test_multinode.py: BAGUA's hierarchical algorithms on 2 nodes x 2 ranks.

Every rank trains through DistributedOptimizer(algorithm=...(hierarchical=True)) and compares its
weights with a reference that simulates the 4 ranks in this process (tests/reference_algorithms.py
primitives, written from docs/algorithms.md): within each host the exact float32 average (two
ranks: (a + b) * 0.5), the algorithm among the two hosts' leaders, the result on every rank of
the host. Prints "rank R OK" when every case matched.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import reference_algorithms as ra  # noqa: E402

import bagua_hvd.torch as hvd  # noqa: E402
from bagua_hvd.torch import algorithms as A  # noqa: E402

STEPS = 4
IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8
BUCKET_BYTES = 1048  # BAGUA_HVD_BUCKET_MB=0.001, set by the test


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss_of(model, b):
    x, y = b
    return ((model(x) - y) ** 2).mean()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def host_average(arrays, hosts):
    """Per host, the float32 average of its ranks' arrays (two ranks: (a + b) * 0.5, exact as
    the core's sum-then-scale)."""
    out = {}
    for h, ranks in hosts.items():
        acc = np.asarray(arrays[ranks[0]], dtype=np.float32).copy()
        for r in ranks[1:]:
            acc = acc + np.asarray(arrays[r], dtype=np.float32)
        out[h] = acc * np.float32(1.0 / len(ranks))
    return out


def reference(kind: str, hosts, n: int, **kw):
    """Final parameters of every rank under the hierarchical algorithm ``kind``."""
    models = [make_model() for _ in range(n)]
    opts = [sgd(m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    layout = ra.bucket_layout_for(params[0], BUCKET_BYTES)
    order = sorted(hosts)  # leaders in host order = by lowest rank
    residuals = [[ra.ByteGradResidual() for _ in order] for _ in layout]
    rings = None
    for t in range(STEPS):
        for r in range(n):
            opts[r].zero_grad(set_to_none=True)
            loss_of(models[r], batch(r, t)).backward()
        if kind == "bytegrad":
            for b, idx in enumerate(layout):
                bufs = [ra.to_numpy(ra.flatten([params[r][i].grad for i in idx])) for r in range(n)]
                avg = host_average(bufs, hosts)
                res = residuals[b] if kw.get("error_feedback") else None
                outs = ra.bytegrad([avg[h] for h in order], "float32", True, res)
                for h, out in zip(order, outs):
                    for r in hosts[h]:
                        ra.unflatten_into(
                            ra.from_numpy(out, torch.float32), [params[r][i].grad for i in idx]
                        )
        elif kind == "decentralized":
            xs = [ra.to_numpy(ra.flatten(params[r])) for r in range(n)]
            avg = host_average(xs, hosts)
            mixed = ra.decentralized_average(
                [torch.from_numpy(avg[h]) for h in order], kw["peer_selection_mode"], t
            )
            for h, x in zip(order, mixed):
                for r in hosts[h]:
                    ra.unflatten_into(x, params[r])
        if kind == "low_precision_decentralized" and t == 0:
            rings = [
                ra.LowPrecisionRing.initial(
                    [ra.to_numpy(ra.flatten([params[hosts[h][0]][i] for i in idx])) for h in order],
                    "float32",
                )
                for idx in layout
            ]
        for o in opts:
            o.step()
        if kind == "low_precision_decentralized":
            for idx, ring in zip(layout, rings):
                bufs = [ra.to_numpy(ra.flatten([params[r][i] for i in idx])) for r in range(n)]
                avg = host_average(bufs, hosts)
                outs = ring.communicate([avg[h] for h in order])
                for h, out in zip(order, outs):
                    for r in hosts[h]:
                        ra.unflatten_into(
                            ra.from_numpy(out, torch.float32), [params[r][i] for i in idx]
                        )
    return params


def main() -> int:
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    nodes = hvd.allgather_object(hvd.cross_rank(), name="nodes")
    hosts = {}
    for r, node in enumerate(nodes):
        hosts.setdefault(node, []).append(r)
    assert len(hosts) == 2 and all(len(v) == 2 for v in hosts.values()), hosts
    cases = [
        ("bytegrad", lambda: A.ByteGrad(hierarchical=True), {}),
        (
            "bytegrad",
            lambda: A.ByteGrad(hierarchical=True, error_feedback=True),
            {"error_feedback": True},
        ),
        (
            "decentralized",
            lambda: A.Decentralized(hierarchical=True, peer_selection_mode="all"),
            {"peer_selection_mode": "all"},
        ),
        (
            "decentralized",
            lambda: A.Decentralized(hierarchical=True, peer_selection_mode="ring"),
            {"peer_selection_mode": "ring"},
        ),
        ("low_precision_decentralized", lambda: A.LowPrecisionDecentralized(hierarchical=True), {}),
    ]
    for kind, make_alg, kw in cases:
        model = make_model()
        opt = hvd.DistributedOptimizer(
            sgd(model.parameters()), named_parameters=model.named_parameters(), algorithm=make_alg()
        )
        for t in range(STEPS):
            opt.zero_grad()
            loss_of(model, batch(rank, t)).backward()
            opt.step()
        want = reference(kind, hosts, n, **kw)[rank]
        for i, (a, b) in enumerate(zip(model.parameters(), want)):
            err = (a.detach() - b.detach()).abs().max().item()
            scale = b.detach().abs().max().item()
            assert err <= 1e-5 * scale, f"{kind} {kw}: parameter {i} differs by {err:.3g}"
        print(f"rank {rank} {kind} {kw} matches the hierarchical reference", flush=True)
    hvd.barrier()
    print(f"rank {rank} OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
