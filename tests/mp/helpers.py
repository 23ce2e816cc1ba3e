"""Conversions between numpy references and torch tensors for the multi-process tests."""

from __future__ import annotations

import numpy as np
import reference as ref
import torch

TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "uint16": torch.uint16,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
REDUCE_DTYPES = [
    "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
]
MOVE_DTYPES = REDUCE_DTYPES + ["bool", "uint16"]


def to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A contiguous CPU tensor of ``dtype`` holding ``a``."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).clone()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of a tensor (bfloat16 as float32)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy().copy()


def check(got: torch.Tensor, expected: np.ndarray, dtype: str, tol: float = 0.0,
          what: str = "") -> None:
    """Asserts dtype, shape and values of ``got`` against the numpy reference."""
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got)}"
    assert got.dtype == TORCH_DTYPES[dtype], f"{what}: dtype {got.dtype} != {dtype}"
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    )
    g = to_numpy(got)
    if dtype in ref.FLOAT_TYPES:
        np.testing.assert_allclose(g.astype(np.float64), expected.astype(np.float64), rtol=0,
                                   atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(g, expected.astype(g.dtype), err_msg=what)


def inputs_for(case: tuple, size: int, shape_of, dtype: str, low: int = -4,
               high: int = 4) -> list:
    """Every rank's input for one test case; ``shape_of(rank)`` gives each rank's shape."""
    seed = ref.seed_for(*case, dtype)
    return [ref.make_input(seed, r, shape_of(r), dtype, low, high) for r in range(size)]
