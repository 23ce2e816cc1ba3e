"""QAdamOptimizer's CPU step in pieces beside the same step on whole tensors (the form it takes
off the CPU) and beside torch.optim.Adam's step (foreach and single-tensor) on the same
parameters.

One process, one torch thread, the 25.13M float32 parameters of bench/algorithms.py's MLP
(1024->2048x6->1000); QAdam in its compression stage (v frozen; without communication its step
also turns the gradient into the momentum). Prints the best of --repeat timings of each, run
side by side in this invocation, and checks that both QAdam forms give the same bits.

    python bench/qadam_update.py [--repeat 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from bagua_hvd.torch import algorithms as A

SHAPES = [(2048, 1024), (2048,)] + [(2048, 2048), (2048,)] * 5 + [(1000, 2048), (1000,)]


def _timed(piece: int, repeat: int) -> tuple:
    A._PIECE = piece
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in SHAPES]
    q = A.QAdamOptimizer(params, lr=1e-3, warmup_steps=1)
    for p in params:
        p.grad = torch.randn_like(p)
    q.step()  # warm-up stage: v from one gradient, then frozen
    best = float("inf")
    for i in range(repeat):
        torch.manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn_like(p)
        t = time.perf_counter()
        q.step()
        best = min(best, time.perf_counter() - t)
    return best, [p.detach().clone() for p in params]


def _adam(foreach: bool, repeat: int) -> float:
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in SHAPES]
    opt = torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    best = float("inf")
    for i in range(repeat + 1):
        for p in params:
            p.grad = torch.randn_like(p)
        t = time.perf_counter()
        opt.step()
        if i:  # the first step allocates the state
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    default = A._PIECE
    n = sum(torch.Size(s).numel() for s in SHAPES)
    whole, w = _timed(1 << 62, args.repeat)  # a piece larger than any tensor: whole tensors
    pieces, p = _timed(default, args.repeat)
    same = all(torch.equal(a, b) for a, b in zip(w, p))
    adam_foreach, adam_single = _adam(True, args.repeat), _adam(False, args.repeat)
    print(f"{n / 1e6:.2f}M float32 parameters, best of {args.repeat}")
    print(f"whole tensors      {whole * 1e3:8.1f} ms")
    print(f"pieces of {default:<8d} {pieces * 1e3:8.1f} ms  ({whole / pieces:.2f}x faster)")
    print(f"torch.optim.Adam, foreach {adam_foreach * 1e3:8.1f} ms")
    print(f"torch.optim.Adam, single  {adam_single * 1e3:8.1f} ms")
    print(f"same bits (QAdam, both forms): {same}")
    if not same:
        raise SystemExit("the two forms differ")


if __name__ == "__main__":
    main()
