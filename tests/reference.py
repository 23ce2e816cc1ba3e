"""Numpy references for every collective, computed from every rank's deterministic inputs.

Each rank regenerates all ranks' inputs from seeds (``make_input``), computes the expected
result here with numpy only, and compares its own output. Nothing here imports bagua_hvd or a
framework, so the references are independent of the code under test.

Semantics follow Horovod: Average is Sum followed by ``postscale /= size``; integer scaling is
computed in double and truncated toward zero; the order is prescale -> reduce -> postscale; bool
reductions are logical (Sum/Max: or, Min/Product: and).
"""

from __future__ import annotations

import zlib
from typing import List, Sequence, Tuple

import numpy as np

AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5

FLOAT_TYPES = ("float16", "bfloat16", "float32", "float64")
INT_TYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype used to hold values of ``name`` (bfloat16 is held as float32)."""
    return np.dtype("float32") if name == "bfloat16" else np.dtype(name)


def seed_for(*parts: object) -> int:
    """A stable 32-bit seed from any printable parts (test name, rank, ...)."""
    return zlib.crc32(repr(parts).encode())


def make_input(
    seed: int, rank: int, shape: Sequence[int], dtype: str, low: int = -4, high: int = 4
) -> np.ndarray:
    """Rank ``rank``'s input: integers in [low, high] (exact in every dtype), as ``dtype``.

    Unsigned types use [0, high]; bool uses {False, True}. Small integers keep sums and
    products exact in float16/bfloat16, so any reduction order gives the same answer.
    """
    rng = np.random.default_rng([seed & 0xFFFFFFFF, rank])
    if dtype == "bool":
        return rng.integers(0, 2, size=tuple(shape)).astype(bool)
    lo = 0 if dtype.startswith("uint") else low
    values = rng.integers(lo, high + 1, size=tuple(shape))
    return values.astype(numpy_dtype(dtype))


def _scale(a: np.ndarray, factor: float, dtype: str) -> np.ndarray:
    if factor == 1.0:
        return a
    if dtype in INT_TYPES:
        return np.trunc(a.astype(np.float64) * factor).astype(a.dtype)
    return a.astype(np.float64) * factor


def allreduce(
    arrays: Sequence[np.ndarray],
    op: int,
    dtype: str,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> np.ndarray:
    """Expected allreduce of the per-rank ``arrays``; float results are float64."""
    size = len(arrays)
    if dtype == "bool":
        stack = np.stack(arrays)
        if op in (SUM, MAX):
            return stack.any(axis=0)
        if op in (MIN, PRODUCT):
            return stack.all(axis=0)
        raise ValueError(f"op {op} is not defined for bool")
    floating = dtype in FLOAT_TYPES
    scaled = [_scale(a, prescale, dtype) for a in arrays]
    work = np.stack([s.astype(np.float64) if floating else s.astype(np.int64) for s in scaled])
    if op in (SUM, AVERAGE):
        out = work.sum(axis=0)
    elif op == MIN:
        out = work.min(axis=0)
    elif op == MAX:
        out = work.max(axis=0)
    elif op == PRODUCT:
        out = np.prod(work, axis=0)
    else:
        raise ValueError(f"no reference for op {op}")
    if not floating:
        out = out.astype(numpy_dtype(dtype))  # wraps like the C types would
    if op == AVERAGE:
        postscale = postscale / size
    return _scale(out, postscale, dtype)


def allgather(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenation along dim 0 in rank order."""
    return np.concatenate(list(arrays), axis=0)


def broadcast(arrays: Sequence[np.ndarray], root_index: int) -> np.ndarray:
    """The root's array (``root_index`` is the root's position in ``arrays``)."""
    return arrays[root_index]


def even_splits(dim0: int, size: int) -> List[int]:
    """Alltoall without splits: dim0 must be a multiple of size."""
    assert dim0 % size == 0, "alltoall without splits needs dim0 % size == 0"
    return [dim0 // size] * size


def alltoall(
    arrays: Sequence[np.ndarray], splits: Sequence[Sequence[int]], receiver: int
) -> Tuple[np.ndarray, List[int]]:
    """What ``receiver`` gets: sender s's rows for it, in sender order, and the row counts."""
    parts, received = [], []
    for s, a in enumerate(arrays):
        offset = int(sum(splits[s][:receiver]))
        n = int(splits[s][receiver])
        parts.append(a[offset : offset + n])
        received.append(n)
    return np.concatenate(parts, axis=0), received


def reducescatter_rows(dim0: int, size: int) -> List[int]:
    """Rows per rank: ranks 0 .. dim0 % size - 1 get one extra row."""
    return [dim0 // size + (1 if r < dim0 % size else 0) for r in range(size)]


def reducescatter(
    arrays: Sequence[np.ndarray],
    op: int,
    dtype: str,
    receiver: int,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> np.ndarray:
    """``receiver``'s slice of the allreduced arrays."""
    full = allreduce(arrays, op, dtype, prescale, postscale)
    rows = reducescatter_rows(full.shape[0], len(arrays))
    offset = sum(rows[:receiver])
    return full[offset : offset + rows[receiver]]


def join_allreduce(
    arrays: Sequence[np.ndarray], joined: Sequence[int], op: int, dtype: str
) -> np.ndarray:
    """Allreduce where the ranks in ``joined`` contribute zeros (Average still divides by the
    full size, as Horovod does)."""
    zeros = np.zeros_like(arrays[0])
    contrib = [zeros if r in joined else a for r, a in enumerate(arrays)]
    return allreduce(contrib, op, dtype)


def normal_inputs(case: object, size: int, shape: Sequence[int], dtype: str) -> List[np.ndarray]:
    """Every rank's input for ``case``: standard normal values rounded to ``dtype`` (Adasum's
    coefficients need directions that differ, which small integers rarely give)."""
    return [
        np.random.default_rng(seed_for(case, r)).standard_normal(shape).astype(dtype)
        for r in range(size)
    ]


def adasum(arrays: Sequence[np.ndarray], dtype: str = "float64") -> np.ndarray:
    """Horovod's Adasum of one tensor from every rank (a power-of-2 number of them), from its
    definition (Maleki et al., MLSys 2021): a binary tree, ranks (0, 1), (2, 3), ... then pairs
    of subtrees, each pair combined as (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b with a
    coefficient of 1 where that norm is 0. Each combination is rounded to ``dtype`` (a rank
    stores it so); float64 results."""
    level = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    shape = np.shape(arrays[0])
    assert len(level) & (len(level) - 1) == 0, "Adasum needs a power-of-2 number of ranks"
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, a2, b2 = float(a @ b), float(a @ a), float(b @ b)
            ac = 1.0 - dot / a2 * 0.5 if a2 != 0 else 1.0
            bc = 1.0 - dot / b2 * 0.5 if b2 != 0 else 1.0
            nxt.append((ac * a + bc * b).astype(numpy_dtype(dtype)).astype(np.float64))
        level = nxt
    return level[0].reshape(shape)


def tolerance(dtype: str, op: int, size: int, postscale: float | None = None) -> float:
    """Absolute tolerance for comparing a float result with the float64 reference."""
    if dtype in INT_TYPES or dtype == "bool":
        return 0.0
    if op != AVERAGE and (postscale in (None, 1.0, 0.5, 2.0)):
        return 0.0  # small integers and power-of-two factors are exact
    return {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}[dtype]


# ---- exact (bit for bit) scaled reductions ---------------------------------------------------
def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), held as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return r.view(np.float32)


def scale_exact(a: np.ndarray, factor: float, dtype: str) -> np.ndarray:
    """Horovod's ScaleBuffer: a float tensor is scaled in its own dtype (the factor cast to it,
    one rounding), float16 (and bfloat16, which Horovod does not scale) in float32 and rounded
    back, an integer in float64 and truncated toward zero."""
    if dtype in INT_TYPES:
        return np.trunc(a.astype(np.float64) * factor).astype(a.dtype)
    if dtype == "float64":
        return a.astype(np.float64) * factor
    product = np.float32(factor) * a.astype(np.float32)  # float32 x float32, one rounding
    if dtype == "float16":
        return product.astype(np.float16)
    return round_bf16(product) if dtype == "bfloat16" else product


def _add_exact(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in INT_TYPES:
        return (a.astype(np.int64) + b.astype(np.int64)).astype(numpy_dtype(dtype))  # wraps
    if dtype == "bfloat16":
        return round_bf16(a.astype(np.float32) + b.astype(np.float32))
    return (a + b).astype(numpy_dtype(dtype))  # numpy adds float16 in float32, rounds once


def allreduce_exact(
    arrays: Sequence[np.ndarray], op: int, dtype: str, prescale: float, postscale: float
) -> np.ndarray:
    """Sum or Average with scale factors, computed in ``dtype``'s own arithmetic: prescale,
    sum, then ``postscale`` (divided by the size in float64 for Average, as Horovod does).

    The ranks' sum is taken in rank order: pass inputs whose sum does not depend on the order
    (identical on every rank, or small integers), as Horovod's own tests do."""
    assert op in (SUM, AVERAGE), op
    scaled = [scale_exact(a, prescale, dtype) if prescale != 1.0 else a for a in arrays]
    out = scaled[0]
    for s in scaled[1:]:
        out = _add_exact(out, s, dtype)
    if op == AVERAGE:
        postscale = postscale / len(arrays)
    return scale_exact(out, postscale, dtype) if postscale != 1.0 else out


def reducescatter_exact(
    arrays: Sequence[np.ndarray],
    op: int,
    dtype: str,
    receiver: int,
    prescale: float,
    postscale: float,
) -> np.ndarray:
    """``receiver``'s rows of :func:`allreduce_exact`."""
    full = allreduce_exact(arrays, op, dtype, prescale, postscale)
    rows = reducescatter_rows(full.shape[0], len(arrays))
    offset = sum(rows[:receiver])
    return full[offset : offset + rows[receiver]]
