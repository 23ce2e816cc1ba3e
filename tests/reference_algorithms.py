"""Single-process references for BAGUA's algorithms (docs/algorithms.md), in plain torch/numpy.

All n ranks are simulated in ONE process: n replicas of a model, n optimizers, per-rank
batches. Nothing here imports bagua_hvd; every formula is written from docs/algorithms.md.

Driver
------
``run_reference(algorithm, n, make_model, batches, loss_fn, opt_factory, steps,
bucket_layout=None, bucket_bytes=None, **alg_kwargs) -> ReferenceResult``

* ``algorithm``: ``gradient_allreduce``, ``bytegrad``, ``decentralized``,
  ``low_precision_decentralized`` or ``qadam``.
* ``make_model(rank) -> nn.Module``: rank ``rank``'s initial model (return the same weights for
  every rank to model a broadcast; different ones to model "never broadcast"). The model is
  moved to the CPU. Parameters = ``[p for p in model.parameters() if p.requires_grad]``, in
  registration order; "parameter index" below means the position in that list.
* ``batches``: ``batches[rank][step]`` (a list of lists), or a callable ``(rank, step) -> batch``.
  A batch is anything ``loss_fn`` accepts.
* ``loss_fn(model, batch) -> scalar Tensor`` (``mse_loss`` is provided for ``(x, y)`` batches).
* ``opt_factory(params) -> torch.optim.Optimizer``: the wrapped optimizer (one per rank), e.g.
  ``lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)``. For ``qadam`` pass ``None``: the
  reference builds its own QAdamOptimizer from ``lr``, ``warmup_steps``, ``betas``, ``eps``,
  ``weight_decay`` (keyword arguments, bagua_hvd's defaults).
* ``bucket_layout``: buckets as lists of parameter indices (each bucket one dtype). Default:
  ``bucket_layout_for(params, bucket_bytes)``, which is the first-guess layout of
  ``bagua_hvd/torch/buckets.py`` (reverse registration order, per dtype, cut at
  ``bucket_bytes``; ``bucket_bytes=None`` reads ``BAGUA_HVD_BUCKET_MB`` like ``_bucket_bytes``).
  The optimizer re-lays the buckets out after step 1 in rank 0's observed gradient-ready order;
  for a ``Sequential``-like MLP that order is reverse registration order, so both agree.
  Only ByteGrad/QAdam (chunking, padding) and low-precision decentralized (one chunk per bucket)
  depend on the layout; the other algorithms are element-wise.
* ``alg_kwargs``: the algorithm's arguments (``average``, ``error_feedback``,
  ``peer_selection_mode``, ``communication_interval``, ``hierarchical`` (accepted; one host means
  the flat algorithm), QAdam's optimizer arguments).

Every step: each rank runs ``zero_grad(set_to_none=True)``, ``loss_fn(model, batch).backward()``
on its own batch, then the algorithm (see the classes below) and the update.
``ReferenceResult.params[r]`` is rank r's final parameter list (detached clones);
``.state`` holds the algorithm's state (replicas, residuals, QAdam moments), ``.losses[t][r]``
the losses. ``ReferenceCluster`` is the same thing one ``step(batches)`` at a time.

For a multi-process test, rank r builds ``make_model(r)``, its optimizer and its batches
``batches(r, t)``, runs the real ``DistributedOptimizer`` and compares its parameters with
``run_reference(...).params[r]``, computed locally for all ranks.

Arithmetic
----------
* MinMaxUInt8 (``compress``/``decompress``): numpy float32 everywhere, ``np.rint``, no float64
  intermediates, no FMA; values of dtype T (float32, float16, bfloat16) are held in float32
  arrays and rounded to T with ``round_to`` (float16 via ``np.float16``, bfloat16 by
  round-to-nearest-even on the uint32 bits, NaN -> 0x7FC0 as torch does). Interpretations where
  the spec is silent: the float -> uint8 conversion saturates (values below 0 -> 0, NaN -> 0;
  the formula yields -1 e.g. for the chunk [-1, 1], where rint(-127.5) = -128 and ub = 128); a
  chunk with a NaN/Inf is written with NaN as min and max and zero payload, and any chunk
  whose header min or max is not finite decodes to NaN.
* Full-precision averages (GradientAllReduce, QAdam warm-up, Decentralized ``all``): float64
  sum in rank order, divided by n in float64, rounded once to T. The real core sums in ring
  order, so compare these within ~1e-5 relative, not bitwise.
* Decentralized ``shift_one``/``ring``: float32 (float64 for float64 weights), rounded once to T:
  (x + x_peer) / 2 and ((x_left + x) + x_right) / 3, at n = 2 (x + 2 x_peer) / 3.
* ByteGrad step 4 and low-precision decentralized follow the spec's operation order in float32
  (bit-exact targets). "Decompress" includes its rounding to T, so step 4 sums T values.
* QAdam warm-up repeats ``torch.optim.Adam``'s single-tensor (CPU) update op by op, so it is
  bitwise equal to it. Compression stage (the spec gives math, not an order), torch ops in the
  parameter's dtype: ``g = g.add(x, alpha=wd)`` (if wd), ``m.mul_(b1).add_(g, alpha=1 - b1)``,
  ByteGrad of the m buckets (n > 1), ``m.masked_fill_(v == 0, 0)``,
  ``denom = torch.maximum(v.sqrt() / (1 - b2**s) ** 0.5, m.abs() / (1 - b1**s)).add_(eps)``,
  ``x.addcdiv_(m, denom, value=-lr / (1 - b1**s))`` (torch.optim.Adam's expressions; the floor
  by ``|m|`` is bagua_hvd's, docs/algorithms.md).
* At n = 1 nothing communicates or compresses (QAdam still freezes v after warm-up).
* Gradients: a parameter without a gradient gets zeros before a gradient algorithm runs (the
  DistributedOptimizer fills zeros, since other ranks may have one).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

ALGORITHMS = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "qadam",
)
PEER_MODES = ("all", "shift_one", "ring")
COMPRESSIBLE = ("float32", "float16", "bfloat16")

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
OptFactory = Callable[[List[nn.Parameter]], torch.optim.Optimizer]
Batches = Union[Sequence[Sequence[Batch]], Callable[[int, int], Batch]]

_F32 = np.float32
_EPS = np.float32(1e-7)  # the float32 nearest to 1e-7
_F255 = np.float32(255.0)
_HEADER_BYTES = 32  # align32(2 * sizeof(T)) for float32, float16 and bfloat16
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


# ---- dtypes ------------------------------------------------------------------------------------
def dtype_name(dtype: Union[str, torch.dtype, np.dtype]) -> str:
    """``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"float64"`` for a torch/numpy dtype."""
    if isinstance(dtype, torch.dtype):
        for name, t in _TORCH_DTYPES.items():
            if t == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}")
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in _TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return name


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded (nearest, ties to even) to ``dtype``, returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        with np.errstate(over="ignore"):  # overflow to inf is the rounding's result
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
        rounded = np.where(np.isnan(x), np.uint32(0x7FC00000), rounded).astype(np.uint32)
        return rounded.view(np.float32)
    raise ValueError(f"round_to: dtype must be one of {COMPRESSIBLE}, got {dtype!r}")


def _t_bytes(values: np.ndarray, dtype: str) -> bytes:
    """float32 values (exact in T) as little-endian T bytes."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return values.astype("<f4").tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    return (values.view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes()


def _t_from_bytes(raw: np.ndarray, dtype: str) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if dtype == "float32":
        return raw.view("<f4").astype(np.float32)
    if dtype == "float16":
        return raw.view("<f2").astype(np.float32)
    return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A flat float32 copy of a float32/float16/bfloat16 tensor (exact)."""
    return t.detach().to("cpu", torch.float32).reshape(-1).numpy().copy()


def from_numpy(a: np.ndarray, dtype: Union[str, torch.dtype]) -> torch.Tensor:
    """float32 values (already rounded to ``dtype``) as a flat tensor of ``dtype``."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).copy())
    return t.to(_TORCH_DTYPES[dtype_name(dtype)])


# ---- MinMaxUInt8 -------------------------------------------------------------------------------
def _align32(nbytes: int) -> int:
    return (nbytes + 31) // 32 * 32


def chunk_wire_bytes(chunk_len: int) -> int:
    """Bytes of one compressed chunk: align32(2 * sizeof(T)) + align32(c) (32 + align32(c))."""
    return _HEADER_BYTES + _align32(chunk_len)


def wire_bytes(numel: int, n_chunks: int) -> int:
    """Bytes of a compressed buffer of ``numel`` elements in ``n_chunks`` chunks."""
    _check_chunks(numel, n_chunks)
    return n_chunks * chunk_wire_bytes(numel // n_chunks)


def _check_chunks(numel: int, n_chunks: int) -> None:
    if n_chunks <= 0 or numel % n_chunks:
        raise ValueError(f"{numel} elements cannot be split into {n_chunks} equal chunks")


# The largest finite value of each type, as float32 (decompress clamps to it).
_TOP = {
    "float32": np.finfo(np.float32).max,
    "float16": np.float32(np.finfo(np.float16).max),
    "bfloat16": np.float32(3.3895313892515355e38),  # (2 - 2**-7) * 2**127
}


def _params(mn: np.float32, mx: np.float32) -> Tuple[np.float32, np.float32, np.float32]:
    """(scale, ub, lb) of a finite chunk, in float32. Where the formula overflows (mx - mn or
    mx * scale is infinite), the scale is computed on mn and mx times s = 2**(1 - k),
    k = floor(log2(max(|mn|, |mx|))), and multiplied by s again (docs/algorithms.md)."""
    with np.errstate(over="ignore"):
        scale = _F255 / ((mx - mn) + _EPS)
        ub = np.rint(mx * scale)
        overflow = not (np.isfinite(mx - mn) and np.isfinite(ub))
        if overflow and np.isfinite(mn) and np.isfinite(mx):
            k = math.frexp(max(abs(float(mn)), abs(float(mx))))[1] - 1  # m = f * 2**(k + 1)
            s = _F32(2.0 ** (1 - k))
            scale = (_F255 / ((mx * s - mn * s) + _EPS)) * s
            ub = np.rint(mx * scale)
    assert scale.dtype == np.float32 and ub.dtype == np.float32
    return scale, ub, ub - _F255


def _to_uint8(level: np.ndarray) -> np.ndarray:
    # Saturating conversion (the spec's cast; see the module docstring): NaN -> 0.
    level = np.where(np.isnan(level), _F32(0), level)
    return np.clip(level, _F32(0), _F255).astype(np.uint8)


def compress(x: np.ndarray, n_chunks: int, dtype: str = "float32") -> np.ndarray:
    """MinMaxUInt8 of ``x`` (float32 array of values exact in ``dtype``, or a float16 array)
    in ``n_chunks`` chunks: the wire bytes (uint8 array, layout of docs/algorithms.md)."""
    if dtype not in COMPRESSIBLE:
        raise ValueError(f"MinMaxUInt8 supports {COMPRESSIBLE}, got {dtype!r}")
    x = np.asarray(x).reshape(-1)
    if x.dtype not in (np.float32, np.float16):
        raise TypeError(f"compress expects float32 (or float16) values, got {x.dtype}")
    x = x.astype(np.float32)
    exact = round_to(x, dtype)
    same = (exact == x) | (np.isnan(exact) & np.isnan(x))
    if not same.all():
        raise ValueError(f"compress: input values are not exact in {dtype}; round them first")
    _check_chunks(x.size, n_chunks)
    c = x.size // n_chunks
    stride = chunk_wire_bytes(c)
    out = np.zeros(n_chunks * stride, dtype=np.uint8)
    for k in range(n_chunks):
        chunk = x[k * c : (k + 1) * c]
        base = k * stride
        if not np.isfinite(chunk).all():
            header = _t_bytes(np.array([np.nan, np.nan], np.float32), dtype)
            out[base : base + len(header)] = np.frombuffer(header, np.uint8)
            continue
        mn, mx = chunk.min(), chunk.max()
        scale, ub, lb = _params(mn, mx)
        with np.errstate(over="ignore", invalid="ignore"):  # saturated by _to_uint8
            level = np.minimum(np.rint(chunk * scale), ub) - lb
        assert level.dtype == np.float32 and scale.dtype == np.float32
        header = _t_bytes(np.array([mn, mx], np.float32), dtype)
        out[base : base + len(header)] = np.frombuffer(header, np.uint8)
        out[base + _HEADER_BYTES : base + _HEADER_BYTES + c] = _to_uint8(level)
    return out


def decompress(wire: np.ndarray, numel: int, n_chunks: int, dtype: str = "float32") -> np.ndarray:
    """The ``numel`` values encoded in ``wire`` (as float32 arrays of ``dtype`` values)."""
    if dtype not in COMPRESSIBLE:
        raise ValueError(f"MinMaxUInt8 supports {COMPRESSIBLE}, got {dtype!r}")
    wire = np.asarray(wire, dtype=np.uint8).reshape(-1)
    _check_chunks(numel, n_chunks)
    c = numel // n_chunks
    stride = chunk_wire_bytes(c)
    if wire.size != n_chunks * stride:
        raise ValueError(f"wire has {wire.size} bytes, expected {n_chunks * stride}")
    size = _ITEMSIZE[dtype]
    out = np.empty(numel, dtype=np.float32)
    for k in range(n_chunks):
        base = k * stride
        mn, mx = _t_from_bytes(wire[base : base + 2 * size], dtype)
        if not (np.isfinite(mn) and np.isfinite(mx)):
            out[k * c : (k + 1) * c] = np.nan
            continue
        scale, _, lb = _params(mn, mx)
        q = wire[base + _HEADER_BYTES : base + _HEADER_BYTES + c].astype(np.float32)
        with np.errstate(over="ignore"):
            values = np.clip((q + lb) / scale, -_TOP[dtype], _TOP[dtype])
        assert values.dtype == np.float32
        out[k * c : (k + 1) * c] = values
    return round_to(out, dtype)


def quantize(x: np.ndarray, n_chunks: int, dtype: str = "float32") -> np.ndarray:
    """Decompress(Compress(x)): what the receivers of ``x`` see."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    return decompress(compress(x, n_chunks, dtype), x.size, n_chunks, dtype)


# ---- buckets -------------------------------------------------------------------------------------
def bucket_bytes_from_env(environ: Optional[Dict[str, str]] = None) -> int:
    """``BAGUA_HVD_BUCKET_MB`` (default 10) in bytes: int(MiB * 2**20), as optimizer.py does."""
    env = os.environ if environ is None else environ
    value = env.get("BAGUA_HVD_BUCKET_MB", "")
    mb = float(value) if value else 10.0
    if mb < 0:
        raise ValueError(f"BAGUA_HVD_BUCKET_MB must be >= 0, got {value!r}")
    return int(mb * (1 << 20))


def bucket_layout_for(
    params: Sequence[Any],
    bucket_bytes: Optional[int] = None,
    order: Optional[Sequence[int]] = None,
) -> List[List[int]]:
    """Buckets (lists of parameter indices) for ``params`` (tensors, or ``(numel, dtype)``).

    Parameters are taken in ``order`` (default: reverse registration order) and appended to the
    open bucket of their dtype; a bucket is closed when the next parameter would take it past
    ``bucket_bytes`` (a bigger parameter gets a bucket of its own); ``bucket_bytes == 0`` makes
    one bucket per parameter. Buckets are listed in the order they were opened.
    """
    cap = bucket_bytes_from_env() if bucket_bytes is None else int(bucket_bytes)
    infos = []
    for p in params:
        if isinstance(p, torch.Tensor):
            infos.append((p.numel(), dtype_name(p.dtype)))
        else:
            numel, dt = p
            infos.append((int(numel), dtype_name(dt)))
    if order is None:
        order = list(reversed(range(len(infos))))
    if sorted(order) != list(range(len(infos))):
        raise ValueError("order must be a permutation of the parameter indices")
    if cap == 0:
        return [[i] for i in order]
    # Written from the rule, not from the optimizer's code: each dtype's parameters, in order,
    # are cut into consecutive runs, a run growing while its bytes stay within the cap (a run
    # holds at least one parameter); the runs of all dtypes are then listed by the position of
    # their first parameter in ``order``.
    position = {i: k for k, i in enumerate(order)}
    runs: List[List[int]] = []
    for dt in {d for _, d in infos}:
        members = [i for i in order if infos[i][1] == dt]
        nbytes = [infos[i][0] * _ITEMSIZE[dt] for i in members]
        start = 0
        while start < len(members):
            end = start + 1
            while end < len(members) and sum(nbytes[start : end + 1]) <= cap:
                end += 1
            runs.append(members[start:end])
            start = end
    return sorted(runs, key=lambda run: position[run[0]])


def _check_layout(layout: Sequence[Sequence[int]], params: Sequence[torch.Tensor]) -> None:
    flat = sorted(i for b in layout for i in b)
    if flat != list(range(len(params))):
        raise ValueError("bucket_layout must list every parameter index exactly once")
    for b in layout:
        if not b:
            raise ValueError("bucket_layout has an empty bucket")
        if len({params[i].dtype for i in b}) != 1:
            raise ValueError(f"bucket {list(b)} mixes dtypes")


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The concatenation of the flattened tensors (a bucket's buffer)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies consecutive slices of ``flat`` into ``tensors``."""
    off = 0
    with torch.no_grad():
        for t in tensors:
            k = t.numel()
            t.copy_(flat[off : off + k].view_as(t))
            off += k


# ---- ByteGrad --------------------------------------------------------------------------------
@dataclass
class ByteGradResidual:
    """One rank's error-feedback residuals of one bucket (float32 arrays of T values)."""

    worker: Optional[np.ndarray] = None  # e_w, N' elements
    server: Optional[np.ndarray] = None  # e_s, chunk length c


def bytegrad(
    buffers: Sequence[np.ndarray],
    dtype: str = "float32",
    average: bool = True,
    residuals: Optional[Sequence[ByteGradResidual]] = None,
) -> List[np.ndarray]:
    """ByteGrad of one bucket: ``buffers[r]`` is rank r's flat buffer (float32 array of T
    values); returns every rank's result (identical bits). ``residuals`` (one per rank, updated
    in place) turns error feedback on."""
    n = len(buffers)
    bufs = [np.asarray(b, dtype=np.float32).reshape(-1) for b in buffers]
    numel = bufs[0].size
    if any(b.size != numel for b in bufs):
        raise ValueError("every rank's bucket must have the same number of elements")
    if n == 1:
        return [bufs[0].copy()]
    if residuals is not None and len(residuals) != n:
        raise ValueError("one residual per rank")
    c = -(-numel // n)
    padded = n * c
    g = []
    for b in bufs:
        p = np.zeros(padded, dtype=np.float32)
        p[:numel] = b
        g.append(p)
    q = []
    for r in range(n):
        if residuals is not None:  # 1.
            res = residuals[r]
            if res.worker is None:
                res.worker = np.zeros(padded, dtype=np.float32)
            g[r] = round_to(g[r] + res.worker, dtype)
        q.append(compress(g[r], n, dtype))  # 2.
        if residuals is not None:
            residuals[r].worker = round_to(g[r] - decompress(q[r], padded, n, dtype), dtype)
    stride = chunk_wire_bytes(c)
    gathered = []
    for r in range(n):
        # 3. alltoall: chunk r of every rank's q; 4. sum in rank order, float32.
        parts = [decompress(q[j][r * stride : (r + 1) * stride], c, 1, dtype) for j in range(n)]
        a = parts[0].copy()
        for part in parts[1:]:
            a = a + part
        if average:
            a = a / _F32(n)
        assert a.dtype == np.float32
        a = round_to(a, dtype)
        if residuals is not None:  # 5.
            res = residuals[r]
            if res.server is None:
                res.server = np.zeros(c, dtype=np.float32)
            a = round_to(a + res.server, dtype)
        qr = compress(a, 1, dtype)  # 6.
        mine = decompress(qr, c, 1, dtype)
        if residuals is not None:
            residuals[r].server = round_to(a - mine, dtype)
        gathered.append(mine)  # 7. allgather, every rank decodes every chunk
    result = np.concatenate(gathered)[:numel]
    return [result.copy() for _ in range(n)]


# ---- decentralized ---------------------------------------------------------------------------
def shift_one_peer(rank: int, round_k: int, n: int) -> Optional[int]:
    """``rank``'s peer in round ``round_k`` of ``shift_one`` over n ranks; None: no peer this
    round (odd n, paired with the virtual rank n)."""
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} not in [0, {n})")
    m = n + (n % 2)
    h = m // 2
    if rank < h:
        peer = ((round_k + rank) % h) + h
    else:
        peer = (rank - h - round_k) % h  # Python's % is the non-negative modulo
    return None if peer == n else peer


def ring_neighbours(rank: int, n: int) -> tuple:
    """(left, right) = ((r - 1) mod n, (r + 1) mod n)."""
    return (rank - 1) % n, (rank + 1) % n


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def full_average(tensors: Sequence[torch.Tensor], average: bool = True) -> torch.Tensor:
    """Sum over ranks (float64, rank order), divided by n if ``average``, rounded to T."""
    acc = tensors[0].detach().to(torch.float64).clone()
    for t in tensors[1:]:
        acc += t.detach().to(torch.float64)
    if average:
        acc /= len(tensors)
    return acc.to(tensors[0].dtype)


def decentralized_average(
    xs: Sequence[torch.Tensor], mode: str, round_k: int
) -> List[torch.Tensor]:
    """Every rank's peer average of the weights ``xs`` (one tensor per rank) in round k."""
    n = len(xs)
    if mode not in PEER_MODES:
        raise ValueError(f"peer_selection_mode must be one of {PEER_MODES}, got {mode!r}")
    if n == 1:
        return [xs[0].detach().clone()]
    if mode == "all":
        avg = full_average(xs)
        return [avg.clone() for _ in range(n)]
    dtype = xs[0].dtype
    w = [x.detach().to(_work_dtype(dtype)) for x in xs]
    out = []
    for r in range(n):
        if mode == "shift_one":
            peer = shift_one_peer(r, round_k, n)
            out.append(xs[r].detach().clone() if peer is None else ((w[r] + w[peer]) / 2).to(dtype))
        else:
            left, right = ring_neighbours(r, n)
            if n == 2:
                v = (w[r] + 2 * w[left]) / 3
            else:
                v = ((w[left] + w[r]) + w[right]) / 3
            out.append(v.to(dtype))
    return out


@dataclass
class LowPrecisionRing:
    """Low-precision decentralized state of one bucket on every rank: ``s[r]`` (x̂_r),
    ``left[r]`` (x̂_{r-1} as r holds it), ``right[r]`` (x̂_{r+1}); float32 arrays of T values."""

    dtype: str
    s: List[np.ndarray] = field(default_factory=list)
    left: List[np.ndarray] = field(default_factory=list)
    right: List[np.ndarray] = field(default_factory=list)

    @classmethod
    def initial(cls, xs: Sequence[np.ndarray], dtype: str) -> LowPrecisionRing:
        """First step, before its update: s = x, L/R = the neighbours' x (full precision)."""
        n = len(xs)
        xs = [np.asarray(x, dtype=np.float32).reshape(-1) for x in xs]
        state = cls(dtype)
        for r in range(n):
            left, right = ring_neighbours(r, n)
            state.s.append(xs[r].copy())
            state.left.append(xs[left].copy())
            state.right.append(xs[right].copy())
        return state

    def communicate(self, xs: Sequence[np.ndarray]) -> List[np.ndarray]:
        """One round after the local update; ``xs[r]`` = rank r's updated weights. Returns the
        new weights (= the new s)."""
        n = len(xs)
        dt = self.dtype
        third = _F32(1) / _F32(3)
        five_thirds = _F32(5) / _F32(3)
        decoded = []
        for r in range(n):
            x = np.asarray(xs[r], dtype=np.float32).reshape(-1)
            d = ((x + self.left[r] * third) + self.right[r] * third) - self.s[r] * five_thirds
            assert d.dtype == np.float32
            d = round_to(d, dt)
            decoded.append(decompress(compress(d, 1, dt), d.size, 1, dt))
        out = []
        for r in range(n):
            left, right = ring_neighbours(r, n)  # at n = 2 both are the peer: one exchange
            self.left[r] = round_to(self.left[r] + decoded[left], dt)
            self.right[r] = round_to(self.right[r] + decoded[right], dt)
            x = round_to(self.s[r] + decoded[r], dt)
            self.s[r] = x
            out.append(x.copy())
        return out


# ---- QAdam ---------------------------------------------------------------------------------------
class QAdamReference:
    """One rank's QAdamOptimizer state (m, v, step count) and its two update rules."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if warmup_steps <= 0:
            raise ValueError(f"QAdam needs warmup_steps > 0, got {warmup_steps}")
        self.params = list(params)
        self.lr, self.warmup_steps, self.betas = lr, warmup_steps, tuple(betas)
        self.eps, self.weight_decay = eps, weight_decay
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        self.step_count = 0

    def in_warmup(self, s: int) -> bool:
        return s <= self.warmup_steps

    @torch.no_grad()
    def adam_step(self, grads: Sequence[torch.Tensor]) -> None:
        """Warm-up: torch.optim.Adam's single-tensor update, op by op."""
        self.step_count += 1
        s = float(self.step_count)
        beta1, beta2 = self.betas
        for p, g, m, v in zip(self.params, grads, self.exp_avg, self.exp_avg_sq):
            if self.weight_decay != 0:
                g = g.add(p, alpha=self.weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction1 = 1 - beta1**s
            bias_correction2 = 1 - beta2**s
            step_size = self.lr / bias_correction1
            denom = (v.sqrt() / bias_correction2**0.5).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)

    @torch.no_grad()
    def momentum(self, grads: Sequence[torch.Tensor]) -> None:
        """Compression stage, before communication: m <- b1 m + (1 - b1)(g + wd x)."""
        self.step_count += 1
        beta1 = self.betas[0]
        for p, g, m in zip(self.params, grads, self.exp_avg):
            if self.weight_decay != 0:
                g = g.add(p, alpha=self.weight_decay)
            m.mul_(beta1).add_(g, alpha=1 - beta1)

    @torch.no_grad()
    def frozen_v_update(self) -> None:
        """Compression stage, after communication, with v frozen:
        x <- x - lr/bc1 * m / (max(sqrt(v/bc2), |m|/bc1) + eps)."""
        s = float(self.step_count)
        beta1, beta2 = self.betas
        bc1 = 1 - beta1**s
        bc2 = 1 - beta2**s
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            # torch.optim.Adam's expressions (docs/algorithms.md), with v frozen and the
            # denominator floored by |m| / bc1 (no coordinate moves by more than lr);
            # coordinates with v == 0 (no gradient in warm-up) do not move.
            m.masked_fill_(v == 0, 0.0)
            denom = torch.maximum(v.sqrt() / bc2**0.5, m.abs() / bc1).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)


# ---- the simulated cluster ---------------------------------------------------------------------
def mse_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean squared error of ``model(x)`` against ``y`` for a batch ``(x, y)``."""
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _params_of(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class ReferenceResult:
    params: List[List[torch.Tensor]]  # [rank][parameter index], detached clones
    losses: List[List[float]]  # [step][rank]
    bucket_layout: List[List[int]]
    state: Dict[str, Any]
    cluster: ReferenceCluster


class ReferenceCluster:
    """n simulated ranks running ``algorithm``; see the module docstring."""

    def __init__(
        self,
        algorithm: str,
        n: int,
        make_model: Callable[[int], nn.Module],
        loss_fn: LossFn,
        opt_factory: Optional[OptFactory],
        bucket_layout: Optional[Sequence[Sequence[int]]] = None,
        bucket_bytes: Optional[int] = None,
        layout_after_first_step: Optional[Sequence[Sequence[int]]] = None,
        **alg_kwargs: Any,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.algorithm, self.n, self.loss_fn, self.t = algorithm, n, loss_fn, 0
        self.models = [make_model(r).to("cpu") for r in range(n)]
        self.params = [_params_of(m) for m in self.models]
        shapes = [[(p.shape, p.dtype) for p in ps] for ps in self.params]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("make_model must build the same architecture for every rank")
        if bucket_layout is None:
            bucket_layout = bucket_layout_for(self.params[0], bucket_bytes)
        self.layout = [list(b) for b in bucket_layout]
        _check_layout(self.layout, self.params[0])
        # The DistributedOptimizer re-lays its gradient buckets out after step 1 (observed ready
        # order); gradient algorithms switch to this layout then, with fresh residuals.
        self.later_layout = None
        if layout_after_first_step is not None:
            self.later_layout = [list(b) for b in layout_after_first_step]
            _check_layout(self.later_layout, self.params[0])
        self.kw = dict(alg_kwargs)
        self.kw.pop("hierarchical", None)  # one host: the flat algorithm
        allowed = {
            "gradient_allreduce": {"average"},
            "bytegrad": {"average", "error_feedback"},
            "decentralized": {"peer_selection_mode", "communication_interval"},
            "low_precision_decentralized": {"communication_interval"},
            "qadam": {"lr", "warmup_steps", "betas", "eps", "weight_decay", "error_feedback"},
        }[algorithm]
        unknown = set(self.kw) - allowed
        if unknown:
            raise TypeError(f"{algorithm} got unexpected arguments {sorted(unknown)}")
        self.interval = int(self.kw.get("communication_interval", 1))
        if self.interval < 1:
            raise ValueError("communication_interval must be >= 1")
        self.mode = self.kw.get("peer_selection_mode", "all")
        if self.mode not in PEER_MODES:
            raise ValueError(f"peer_selection_mode must be one of {PEER_MODES}, got {self.mode!r}")
        if algorithm in ("bytegrad", "low_precision_decentralized", "qadam") and n > 1:
            for p in self.params[0]:
                if dtype_name(p.dtype) not in COMPRESSIBLE:
                    raise ValueError(f"{algorithm} compresses {COMPRESSIBLE} only, not {p.dtype}")
        ef = bool(self.kw.get("error_feedback", False))
        self.residuals: Optional[List[List[ByteGradResidual]]] = None
        if ef:  # [bucket][rank]
            self.residuals = [[ByteGradResidual() for _ in range(n)] for _ in self.layout]
        self.rings: Optional[List[LowPrecisionRing]] = None
        if algorithm == "qadam":
            if opt_factory is not None:
                raise ValueError("qadam builds its own QAdamOptimizer: pass opt_factory=None")
            qkw = {k: v for k, v in self.kw.items() if k != "error_feedback"}
            self.optimizers: List[Any] = [QAdamReference(ps, **qkw) for ps in self.params]
        else:
            if opt_factory is None:
                raise ValueError(f"{algorithm} needs opt_factory")
            self.optimizers = [opt_factory(ps) for ps in self.params]

    # -- one step ------------------------------------------------------------------------------
    def step(self, batches: Sequence[Batch]) -> List[float]:
        """One training step of every rank on its batch; returns the losses."""
        if len(batches) != self.n:
            raise ValueError(f"one batch per rank: got {len(batches)} for {self.n} ranks")
        losses = []
        for model, batch in zip(self.models, batches):
            model.zero_grad(set_to_none=True)
            loss = self.loss_fn(model, batch)
            loss.backward()
            losses.append(float(loss.detach()))
        t, n, alg = self.t, self.n, self.algorithm
        if alg == "gradient_allreduce":
            self._fill_grads()
            if n > 1:
                self._allreduce_grads(average=bool(self.kw.get("average", True)))
            self._local_updates()
        elif alg == "bytegrad":
            self._fill_grads()
            if n > 1:
                grads = [[p.grad for p in ps] for ps in self.params]
                self._bytegrad(grads, average=bool(self.kw.get("average", True)))
            self._local_updates()
        elif alg == "decentralized":
            if n > 1 and t % self.interval == 0:
                self._mix_weights(t // self.interval)
            self._local_updates()
        elif alg == "low_precision_decentralized":
            if n > 1 and t == 0:
                self._init_rings()
            self._local_updates()
            if n > 1 and t % self.interval == 0:
                self._lp_round()
        else:
            self._qadam_step()
        self.t += 1
        if self.t == 1 and self.later_layout is not None and alg in ("bytegrad", "qadam"):
            self.layout = self.later_layout
            if self.residuals is not None:
                self.residuals = [[ByteGradResidual() for _ in range(n)] for _ in self.layout]
        return losses

    def _fill_grads(self) -> None:
        for ps in self.params:
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _local_updates(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def _allreduce_grads(self, average: bool) -> None:
        for i in range(len(self.params[0])):
            avg = full_average([ps[i].grad for ps in self.params], average)
            for ps in self.params:
                ps[i].grad = avg.clone()

    def _bytegrad(self, tensors: List[List[torch.Tensor]], average: bool) -> None:
        """ByteGrad, bucket by bucket, of ``tensors[rank][param]``; results written in place."""
        for b, idx in enumerate(self.layout):
            dt = dtype_name(tensors[0][idx[0]].dtype)
            bufs = [to_numpy(flatten([ts[i] for i in idx])) for ts in tensors]
            res = None if self.residuals is None else self.residuals[b]
            outs = bytegrad(bufs, dt, average=average, residuals=res)
            for ts, out in zip(tensors, outs):
                unflatten_into(from_numpy(out, dt), [ts[i] for i in idx])

    def _mix_weights(self, round_k: int) -> None:
        for i in range(len(self.params[0])):
            mixed = decentralized_average([ps[i] for ps in self.params], self.mode, round_k)
            with torch.no_grad():
                for ps, x in zip(self.params, mixed):
                    ps[i].copy_(x)

    def _bucket_weights(self, idx: Sequence[int]) -> List[np.ndarray]:
        return [to_numpy(flatten([ps[i] for i in idx])) for ps in self.params]

    def _init_rings(self) -> None:
        self.rings = []
        for idx in self.layout:
            dt = dtype_name(self.params[0][idx[0]].dtype)
            self.rings.append(LowPrecisionRing.initial(self._bucket_weights(idx), dt))

    def _lp_round(self) -> None:
        assert self.rings is not None
        for idx, ring in zip(self.layout, self.rings):
            new = ring.communicate(self._bucket_weights(idx))
            for ps, x in zip(self.params, new):
                unflatten_into(from_numpy(x, ring.dtype), [ps[i] for i in idx])

    def _qadam_step(self) -> None:
        self._fill_grads()
        s = self.t + 1
        opts: List[QAdamReference] = self.optimizers
        grads = [[p.grad for p in ps] for ps in self.params]
        if opts[0].in_warmup(s):
            if self.n > 1:
                self._allreduce_grads(average=True)
                grads = [[p.grad for p in ps] for ps in self.params]
            for opt, gs in zip(opts, grads):
                opt.adam_step(gs)
            return
        for opt, gs in zip(opts, grads):
            opt.momentum(gs)
        if self.n > 1:
            self._bytegrad([opt.exp_avg for opt in opts], average=True)
        for opt in opts:
            opt.frozen_v_update()

    # -- results -------------------------------------------------------------------------------
    def parameters(self) -> List[List[torch.Tensor]]:
        """Every rank's parameters (detached clones), ``[rank][parameter index]``."""
        return [[p.detach().clone() for p in ps] for ps in self.params]

    def state(self) -> Dict[str, Any]:
        """The algorithm's state, as torch tensors of the buckets' dtype:

        * ``bytegrad``/``qadam`` with error feedback: ``worker_residuals`` and
          ``server_residuals``, ``[rank][bucket]`` (N' and c elements; None before the first
          compressed step);
        * ``low_precision_decentralized``: ``replica``, ``left``, ``right``, ``[rank][bucket]``
          (flat, bucket order; absent before the first step or at n = 1);
        * ``qadam``: ``exp_avg``, ``exp_avg_sq``, ``[rank][parameter index]``, and ``step``.
        """
        out: Dict[str, Any] = {}
        if self.residuals is not None:

            def conv(a: Optional[np.ndarray], b: int) -> Optional[torch.Tensor]:
                dt = self.params[0][self.layout[b][0]].dtype
                return None if a is None else from_numpy(a, dt)

            out["worker_residuals"] = [
                [conv(self.residuals[b][r].worker, b) for b in range(len(self.layout))]
                for r in range(self.n)
            ]
            out["server_residuals"] = [
                [conv(self.residuals[b][r].server, b) for b in range(len(self.layout))]
                for r in range(self.n)
            ]
        if self.rings is not None:
            for key, attr in (("replica", "s"), ("left", "left"), ("right", "right")):
                out[key] = [
                    [from_numpy(getattr(ring, attr)[r], ring.dtype) for ring in self.rings]
                    for r in range(self.n)
                ]
        if self.algorithm == "qadam":
            out["exp_avg"] = [[m.clone() for m in o.exp_avg] for o in self.optimizers]
            out["exp_avg_sq"] = [[v.clone() for v in o.exp_avg_sq] for o in self.optimizers]
            out["step"] = self.optimizers[0].step_count
        return out


def run_reference(
    algorithm: str,
    n: int,
    make_model: Callable[[int], nn.Module],
    batches: Batches,
    loss_fn: LossFn,
    opt_factory: Optional[OptFactory],
    steps: int,
    bucket_layout: Optional[Sequence[Sequence[int]]] = None,
    bucket_bytes: Optional[int] = None,
    layout_after_first_step: Optional[Sequence[Sequence[int]]] = None,
    **alg_kwargs: Any,
) -> ReferenceResult:
    """Runs ``steps`` steps of ``algorithm`` on n simulated ranks; see the module docstring."""
    cluster = ReferenceCluster(
        algorithm, n, make_model, loss_fn, opt_factory, bucket_layout, bucket_bytes,
        layout_after_first_step, **alg_kwargs
    )
    losses = []
    for t in range(steps):
        if callable(batches):
            step_batches = [batches(r, t) for r in range(n)]
        else:
            step_batches = [batches[r][t] for r in range(n)]
        losses.append(cluster.step(step_batches))
    return ReferenceResult(cluster.parameters(), losses, cluster.layout, cluster.state(), cluster)
