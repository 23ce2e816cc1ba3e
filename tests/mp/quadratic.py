"""The quadratic model of the TensorFlow algorithm tests (tests/mp/test_tf_algorithms.py), in
torch for tests/reference_algorithms.py: every variable W gets the loss
sum(0.5 a * W**2 + c * W) with per-rank, per-step data (a, c)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np
import torch
from torch import nn


class TorchQuadratic(nn.Module):
    """The variables, as parameters initialised with ``values``."""

    def __init__(self, values: Sequence[np.ndarray]) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.from_numpy(x)) for x in values])


def torch_loss(model: TorchQuadratic, batch: Tuple[List[np.ndarray], List[np.ndarray]]) -> Any:
    a, c = batch
    total = 0
    for w, ai, ci in zip(model.ws, a, c):
        total = total + (0.5 * torch.from_numpy(ai) * w.square() + torch.from_numpy(ci) * w).sum()
    return total
