"""ByteGrad (no hierarchy: every rank compresses) on gradients of 1e30, -1e30 and 3e38 at 2 ranks:
every rank's update is finite and equals tests/reference_algorithms.py's bytegrad exactly
(MinMaxUInt8 "finite in, finite out", docs/algorithms.md). Prints "large values ok" on success."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import reference_algorithms as ra  # noqa: E402

import bagua_hvd.torch as hvd  # noqa: E402
from bagua_hvd.torch.algorithms import ByteGrad  # noqa: E402

C = 8  # elements per chunk: ByteGrad cuts each bucket into n = 2 chunks
# Per case, each rank's gradient (two chunks each). Constant chunks of 1e30 / -1e30 / 3e38
# (max * scale overflowed), a chunk spanning -3e38..3e38 (max - min overflowed), and sums that
# stay finite so that an uncompressed allreduce is finite too.
SPAN = [3e38, -3e38, 0.0, 1.0, -1.0, 1e38, -2e38, 3e38]
CASES = [
    ([[1e30] * C, [-1e30] * C], [[1e30] * C, [-1e30] * C]),
    ([[3e38] * C, SPAN], [[-1e30] * C, [1.0] * C]),
    ([[-3e38] * C, [1e30] * C], [[1.0] * C, SPAN]),
]


def main() -> None:
    hvd.init()
    assert hvd.size() == 2, "run at 2 ranks"
    p = torch.nn.Parameter(torch.zeros(2 * C))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0),
        named_parameters=[("p", p)],
        algorithm=ByteGrad(hierarchical=False),
    )
    for i, case in enumerate(CASES):
        grads = [np.concatenate(chunks).astype(np.float32) for chunks in case]
        want = ra.bytegrad(grads)[hvd.rank()]
        assert np.isfinite(want).all(), f"case {i}: the reference is not finite: {want}"
        with torch.no_grad():
            p.zero_()
        opt.zero_grad()
        (p * torch.from_numpy(grads[hvd.rank()])).sum().backward()  # the gradient is grads[r]
        opt.step()
        got = (-p.detach()).numpy()  # 0 - lr * a, exact (but for the sign of a zero)
        assert np.isfinite(got).all(), f"case {i}: rank {hvd.rank()} got {got}"
        assert np.array_equal(got, want), (
            f"case {i}: rank {hvd.rank()}: got {got}, reference {want}"
        )
    print(f"rank {hvd.rank()}: large values ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
