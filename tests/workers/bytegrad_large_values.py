"""ByteGrad (no hierarchy: every rank compresses) on gradients of 1e30, -1e30 and 3e38 at 2 ranks,
then low-precision decentralized on weights of 1e30: every rank's update is finite and equals the
numpy reference (tests/reference_algorithms.py) exactly (MinMaxUInt8 "finite in, finite out", docs/algorithms.md). Prints "large values ok" on success."""

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
    low_precision_decentralized()
    print(f"rank {hvd.rank()}: large values ok", flush=True)
    hvd.shutdown()


def low_precision_decentralized() -> None:
    """Weights of 1e30 / 2e30: d = x + L/3 + R/3 - 5/3 s is a constant chunk of ~7e29 whose
    max * scale overflowed, which the compressor turned into Inf, then NaN. Two steps, reference from
    tests/reference_algorithms.py's LowPrecisionRing."""
    from bagua_hvd.torch.algorithms import LowPrecisionDecentralized

    r = hvd.rank()
    weights = [np.full(2 * C, 1e30, np.float32), np.full(2 * C, 2e30, np.float32)]
    grads = [np.full(2 * C, 1e28, np.float32), np.full(2 * C, -1e28, np.float32)]
    p = torch.nn.Parameter(torch.from_numpy(weights[r].copy()))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0),
        named_parameters=[("w", p)],
        algorithm=LowPrecisionDecentralized(hierarchical=False),
    )
    ring = ra.LowPrecisionRing.initial(weights, "float32")
    xs = weights
    for step in range(2):
        xs = ring.communicate([x - g for x, g in zip(xs, grads)])
        opt.zero_grad()
        (p * torch.from_numpy(grads[r])).sum().backward()
        opt.step()
        got = p.detach().numpy()
        assert np.isfinite(xs[r]).all(), f"step {step}: the reference is not finite: {xs[r]}"
        assert np.isfinite(got).all(), f"step {step}: rank {r} got {got}"
        assert np.array_equal(got, xs[r]), f"step {step}: rank {r}: got {got}, want {xs[r]}"


if __name__ == "__main__":
    main()
