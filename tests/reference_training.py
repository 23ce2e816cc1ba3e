"""Plain-torch, single-process references for DistributedOptimizer tests.

Each rank of a test regenerates every rank's mini-batches from seeds (``batch``) and trains a
fresh copy of the same model here, in one process, on the concatenation of all ranks' batches
(``train``). Averaging per-rank mean-loss gradients over ranks equals the gradient of the mean
loss over the concatenated batch when every rank has the same batch size, so the weights must
match. Nothing here imports bagua_hvd.
"""

from __future__ import annotations

import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

IN_FEATURES = 12
OUT_FEATURES = 3
VOCAB = 20

Batch = Tuple[torch.Tensor, torch.Tensor]


def seed_for(*parts: object) -> int:
    """A stable 31-bit seed from printable parts."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


class Net(nn.Module):
    """A small MLP; optionally with a sparse embedding input and parameters that some ranks
    (or all) leave unused.

    ``use_extra(rank)`` decides per forward pass whether ``extra`` joins the computation;
    ``never`` never takes part.
    """

    def __init__(self, embedding: Optional[str] = None, extras: bool = False) -> None:
        super().__init__()
        width = IN_FEATURES
        self.emb = None
        if embedding is not None:
            self.emb = nn.Embedding(VOCAB, 6, sparse=embedding == "sparse")
            width += 6
        self.fc1 = nn.Linear(width, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, OUT_FEATURES)
        self.extra = nn.Parameter(torch.randn(OUT_FEATURES)) if extras else None
        self.never = nn.Parameter(torch.randn(5)) if extras else None

    def forward(
        self, x: torch.Tensor, tokens: Optional[torch.Tensor] = None, use_extra: bool = False
    ) -> torch.Tensor:
        if self.emb is not None:
            x = torch.cat([x, self.emb(tokens)], dim=1)
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        out = self.fc3(h)
        if use_extra:
            out = out * self.extra
        return out


def make_model(seed: int, dtype: torch.dtype = torch.float64, **kwargs: object) -> Net:
    """The same initial weights for a given seed, in every process."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Net(**kwargs)  # type: ignore[arg-type]
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(dtype)


def batch(
    seed: int,
    step: int,
    rank: int,
    micro: int = 0,
    rows: int = 4,
    dtype: torch.dtype = torch.float64,
) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s mini-batch ``micro`` of step ``step``: inputs, targets and tokens."""
    g = torch.Generator().manual_seed(seed_for(seed, step, rank, micro))
    return {
        "x": torch.randn(rows, IN_FEATURES, generator=g, dtype=torch.float64).to(dtype),
        "y": torch.randn(rows, OUT_FEATURES, generator=g, dtype=torch.float64).to(dtype),
        "tokens": torch.randint(0, VOCAB // 2, (rows,), generator=g),
    }


def loss_of(model: Net, b: Dict[str, torch.Tensor], use_extra: bool = False) -> torch.Tensor:
    """Mean squared error of one batch."""
    out = model(b["x"], b["tokens"] if model.emb is not None else None, use_extra)
    return ((out - b["y"]) ** 2).mean()


def concat(batches: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def train(
    model: Net,
    make_optimizer: Callable[[List[nn.Parameter]], torch.optim.Optimizer],
    seed: int,
    steps: int,
    size: int,
    micro_batches: int = 1,
    rows: int = 4,
    clip: Optional[float] = None,
) -> Net:
    """Trains ``model`` in this process on every rank's batches of every step, concatenated."""
    dtype = next(model.parameters()).dtype
    opt = make_optimizer(list(model.parameters()))
    for step in range(steps):
        everything = [
            batch(seed, step, r, m, rows, dtype) for r in range(size) for m in range(micro_batches)
        ]
        opt.zero_grad()
        loss_of(model, concat(everything)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def extra_grad(
    model: Net, seed: int, size: int, uses_extra: Callable[[int], bool], rows: int = 4
) -> Dict[str, torch.Tensor]:
    """Gradients of one step where only some ranks use ``model.extra``: the average over ranks
    of each rank's gradient (zeros where a rank did not compute one)."""
    dtype = next(model.parameters()).dtype
    total: Dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r in range(size):
        model.zero_grad(set_to_none=True)
        loss_of(model, batch(seed, 0, r, 0, rows, dtype), use_extra=uses_extra(r)).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] += p.grad
    return {n: t / size for n, t in total.items()}
