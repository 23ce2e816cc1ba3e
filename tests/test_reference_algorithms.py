"""Checks of tests/reference_algorithms.py against facts derived independently of it:
hand-computed MinMaxUInt8 codes, error bounds, torch's own dtype rounding, matching and
mixing-matrix properties, torch.optim.Adam, training on concatenated batches."""

from __future__ import annotations

import math
from typing import Callable, List, Tuple

import numpy as np
import pytest
import reference_algorithms as ra
import torch
from torch import nn

DTYPES = ("float32", "float16", "bfloat16")
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
REL_ULP = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}  # half an ulp


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in ``dtype`` (rounded by torch, not the reference)."""
    return torch.from_numpy(np.asarray(x, np.float32)).to(TORCH[dtype]).float().numpy()


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool((a.view(np.uint32) == b.view(np.uint32)).all())


# ---- dtype rounding ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_to_matches_torch(dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(4000).astype(np.float32)
            * np.float32(10.0) ** rng.integers(-9, 9, 4000),
            np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65536, 1e-8, -3e-39], np.float32),
            # exact ties in bfloat16: the 16 low bits are 0x8000, upper bits even and odd
            (np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000], np.uint32)).view(
                np.float32
            ),
            # exact ties in float16: 1 + 2^-11 and 1 + 3 * 2^-11
            np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11], np.float32),
        ]
    )
    got = ra.round_to(x, dtype)
    want = torch.from_numpy(x).to(TORCH[dtype]).float().numpy()
    assert bits_equal(got, want)
    nan = ra.round_to(np.array([np.nan, -np.nan], np.float32), dtype)
    assert np.isnan(nan).all()


# ---- MinMaxUInt8 -------------------------------------------------------------------------------
def test_compress_hand_example() -> None:
    # mn = 0, mx = 3: 3 + 1e-7 rounds to 3 in float32, scale = 85, ub = 255, lb = 0.
    wire = ra.compress(np.array([0, 1, 2, 3], np.float32), 1)
    assert wire.dtype == np.uint8 and wire.size == 32 + 32
    assert np.frombuffer(wire[:8].tobytes(), "<f4").tolist() == [0.0, 3.0]
    assert wire[32:36].tolist() == [0, 85, 170, 255]
    assert ra.decompress(wire, 4, 1).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_compress_products_are_float32() -> None:
    # scale = 85: the float32 products 0.1f*85, 0.7f*85, 1.7f*85, 2.3f*85 round to the exact
    # ties 8.5, 59.5, 144.5, 195.5, which rint sends to the even 8, 60, 144, 196; the exact
    # (float64) products lie just beside the ties and would give 9, 59, 145, 195.
    x = np.array([0, 3, 0.1, 0.7, 1.7, 2.3], np.float32)
    assert (x[2:].astype(np.float64) * 85 != [8.5, 59.5, 144.5, 195.5]).all()
    wire = ra.compress(x, 1)
    assert wire[32:38].tolist() == [0, 255, 8, 60, 144, 196]


def test_compress_min_of_symmetric_chunk_saturates() -> None:
    # [-1, 1]: 2 + 1e-7 rounds to 2, scale = 127.5, ub = rint(127.5) = 128, lb = -127;
    # rint(-127.5) = -128 gives -1, which must not wrap to 255.
    wire = ra.compress(np.array([-1, 1], np.float32), 1)
    assert wire[32:34].tolist() == [0, 255]
    dec = ra.decompress(wire, 2, 1)
    assert dec.tolist() == [
        np.float32(-127) / np.float32(127.5),
        np.float32(128) / np.float32(127.5),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_wire_layout(dtype: str) -> None:
    rng = np.random.default_rng(1)
    c, chunks = 40, 3
    x = as_dtype(rng.standard_normal(c * chunks), dtype)
    wire = ra.compress(x, chunks, dtype)
    stride = 32 + 64  # align32(2 sizeof(T)) + align32(40)
    assert wire.size == chunks * stride == ra.wire_bytes(c * chunks, chunks)
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    for k in range(chunks):
        header = wire[k * stride : k * stride + 2 * size].tobytes()
        if dtype == "float32":
            mn, mx = np.frombuffer(header, "<f4")
        elif dtype == "float16":
            mn, mx = np.frombuffer(header, "<f2").astype(np.float32)
        else:
            mn, mx = (np.frombuffer(header, "<u2").astype(np.uint32) << 16).view(np.float32)
        chunk = x[k * c : (k + 1) * c]
        assert (mn, mx) == (chunk.min(), chunk.max())
        payload = wire[k * stride + 32 : k * stride + 32 + c]
        # the smallest element has the lowest code, the largest 255
        assert payload[chunk.argmax()] == 255 and payload[chunk.argmin()] == payload.min()


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_on_the_grid_are_lossless(dtype: str) -> None:
    # Range 255 * 2^j with 2^j >= 2^-6: 1e-7 is below half an ulp of the range, so
    # scale = 2^-j exactly and every value mn + k 2^j is coded and decoded exactly.
    rng = np.random.default_rng(2)
    for j in range(-6, 5):
        step = 2.0**j
        chunks = []
        for _ in range(3):
            lo = int(rng.integers(-128, 1))  # keeps |values| < 256 steps: exact in bfloat16
            k = rng.integers(0, 256, 50)
            k[:2] = [0, 255]
            rng.shuffle(k)
            chunks.append(((lo + k) * step).astype(np.float32))
        x = np.concatenate(chunks)
        assert bits_equal(as_dtype(x, dtype), x)
        wire = ra.compress(x, 3, dtype)
        assert bits_equal(ra.decompress(wire, x.size, 3, dtype), x)
        stride = 32 + 64
        for i, ch in enumerate(chunks):
            codes = wire[i * stride + 32 : i * stride + 32 + 50].astype(np.int64)
            assert codes.tolist() == np.rint((ch - ch.min()) / step).astype(np.int64).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_error_bound(dtype: str) -> None:
    # |x' - x| <= 0.5 / scale (rint), plus float32 rounding of x * scale and of the result,
    # plus half an ulp of T for the final rounding.
    rng = np.random.default_rng(3)
    for scale_exp, offset in [(-3, 0.0), (0, 0.5), (2, -3.0), (0, 0.0)]:
        raw = rng.standard_normal(4 * 257) * 10.0**scale_exp + offset
        if offset == 0.0 and scale_exp == 0:
            raw[:2] = [-1.0, 1.0]  # the saturating edge case
        x = as_dtype(raw, dtype)
        dec = ra.quantize(x, 4, dtype)
        for k in range(4):
            ch = x[k * 257 : (k + 1) * 257].astype(np.float64)
            d = dec[k * 257 : (k + 1) * 257].astype(np.float64)
            step = (ch.max() - ch.min() + 1e-7) / 255.0
            bound = 0.5 * step * (1 + 1e-4) + 1e-6 * np.abs(ch).max() + REL_ULP[dtype] * np.abs(d)
            assert (np.abs(d - ch) <= bound).all(), (dtype, scale_exp, k)


def _torch_minmax(chunk: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """An independent float32 implementation (torch ops) of one chunk: codes and values."""
    x = torch.from_numpy(chunk.astype(np.float32))
    mn, mx = x.min(), x.max()
    scale = torch.tensor(255.0) / ((mx - mn) + torch.tensor(1e-7, dtype=torch.float32))
    ub = torch.round(mx * scale)
    lb = ub - 255
    q = (torch.minimum(torch.round(x * scale), ub) - lb).clamp(0, 255).to(torch.uint8)
    return q.numpy(), ((q.float() + lb) / scale).numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_matches_torch_float32_implementation(dtype: str) -> None:
    rng = np.random.default_rng(4)
    c, chunks = 300, 5
    x = as_dtype(rng.standard_normal(c * chunks) * rng.uniform(1e-3, 1e3), dtype)
    x[7] = 0.0
    wire = ra.compress(x, chunks, dtype)
    dec = ra.decompress(wire, x.size, chunks, dtype)
    stride = 32 + 320
    for k in range(chunks):
        codes, values = _torch_minmax(x[k * c : (k + 1) * c])
        assert wire[k * stride + 32 : k * stride + 32 + c].tolist() == codes.tolist()
        assert bits_equal(dec[k * c : (k + 1) * c], as_dtype(values, dtype))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_chunk_decodes_to_nan(bad: float) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(3 * 16).astype(np.float32)
    x[16 + 3] = bad
    dec = ra.quantize(x, 3, "float32")
    assert np.isnan(dec[16:32]).all()
    assert bits_equal(dec[:16], ra.quantize(x[:16], 1))
    assert bits_equal(dec[32:], ra.quantize(x[32:], 1))


def test_compress_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="equal chunks"):
        ra.compress(np.zeros(10, np.float32), 3)
    with pytest.raises(ValueError, match="not exact in bfloat16"):
        ra.compress(np.array([1 + 2.0**-12], np.float32), 1, "bfloat16")


# ---- buckets -------------------------------------------------------------------------------------
def test_bucket_layout() -> None:
    f32, f16 = torch.float32, torch.float16
    params = [(10, f32), (5, f32), (300, f32), (7, f32), (8, f32)]
    # reverse order: 4 (32 B), 3 (28 B, 60), 2 (1200 B: own bucket), 1 (20 B), 0 (40 B, 60)
    assert ra.bucket_layout_for(params, 100) == [[4, 3], [2], [1, 0]]
    assert ra.bucket_layout_for(params, 0) == [[4], [3], [2], [1], [0]]
    assert ra.bucket_layout_for(params, 1 << 20) == [[4, 3, 2, 1, 0]]
    mixed = [(10, f32), (10, f16), (10, f32), (10, f16), (30, f16)]
    # f16: 4 (60 B), 3 (80 B), 1 (100 B: exactly the cap); f32: 2 (40 B), 0 (80 B)
    assert ra.bucket_layout_for(mixed, 100) == [[4, 3, 1], [2, 0]]
    # cap 64: f16 4 (60 B), 3 (80 > 64: new), 1 (40 B); f32 2 (40 B), 0 (80 > 64: new)
    assert ra.bucket_layout_for(mixed, 64) == [[4], [3, 1], [2], [0]]
    assert ra.bucket_layout_for(params, 100, order=[0, 1, 2, 3, 4]) == [[0, 1], [2], [3, 4]]
    assert ra.bucket_bytes_from_env({"BAGUA_HVD_BUCKET_MB": "0.001"}) == 1048
    assert ra.bucket_bytes_from_env({}) == 10 * 2**20
    with pytest.raises(ValueError):
        ra.bucket_bytes_from_env({"BAGUA_HVD_BUCKET_MB": "-1"})


# ---- peer selection ----------------------------------------------------------------------------
def bagua_shift_one(rank: int, step: int, n: int) -> int:
    """BAGUA's formula for even n (shared/reference/bagua.md, section 1.4)."""
    if rank < n // 2:
        return ((step + rank) % ((n + 1) // 2)) + n // 2
    return (rank - n // 2 - step) % (n // 2)


@pytest.mark.parametrize("n", range(2, 10))
def test_shift_one_is_a_matching(n: int) -> None:
    m = n + n % 2
    h = m // 2
    met = {r: set() for r in range(h)}
    for k in range(3 * h):
        peers = [ra.shift_one_peer(r, k, n) for r in range(n)]
        assert sum(p is None for p in peers) == n % 2
        for r, p in enumerate(peers):
            if p is None:
                continue
            assert p != r and peers[p] == r  # symmetric, degree 1
            assert (r < h) != (p < h)  # across the halves
            if n % 2 == 0:
                assert p == bagua_shift_one(r, k, n)
        if k < h:
            for r in range(h):
                met[r].add(n if peers[r] is None else peers[r])
    for r in range(h):
        assert met[r] == set(range(h, m))  # every upper-half rank (and the virtual one) once


def ring_matrix(n: int) -> np.ndarray:
    w = np.zeros((n, n))
    for r in range(n):
        for j in (r - 1, r, r + 1):
            w[r, j % n] += 1 / 3
    return w


@pytest.mark.parametrize("n", [2, 3, 5])
def test_ring_is_the_mixing_matrix(n: int) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, 33)).astype(np.float32)
    got = ra.decentralized_average([torch.from_numpy(row) for row in x], "ring", 0)
    want = ring_matrix(n) @ x.astype(np.float64)
    np.testing.assert_allclose(torch.stack(got).numpy(), want, rtol=1e-6, atol=1e-6)
    if n == 3:
        np.testing.assert_allclose(want, np.broadcast_to(x.mean(0), x.shape), rtol=1e-6, atol=1e-6)


# ---- models and training -----------------------------------------------------------------------
def make_mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.to(dtype)


def batch_fn(seed: int, dtype: torch.dtype = torch.float32) -> Callable[[int, int], tuple]:
    def batch(rank: int, step: int) -> tuple:
        g = torch.Generator().manual_seed(seed * 100003 + rank * 1009 + step)
        return torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)

    return batch


def sgd(ps: List[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def plain_training(model: nn.Module, opt: torch.optim.Optimizer, batches: List[tuple]) -> None:
    for b in batches:
        opt.zero_grad(set_to_none=True)
        ra.mse_loss(model, b).backward()
        opt.step()


@pytest.mark.parametrize(
    "algorithm,kwargs",
    [
        ("gradient_allreduce", {}),
        ("bytegrad", {"error_feedback": True}),
        ("decentralized", {"peer_selection_mode": "shift_one"}),
        ("decentralized", {"peer_selection_mode": "ring"}),
        ("low_precision_decentralized", {}),
    ],
)
def test_one_rank_is_plain_training(algorithm: str, kwargs: dict) -> None:
    batch = batch_fn(1)
    res = ra.run_reference(
        algorithm, 1, lambda r: make_mlp(7), batch, ra.mse_loss, sgd, 6, bucket_bytes=64, **kwargs
    )
    model = make_mlp(7)
    plain_training(model, sgd(list(model.parameters())), [batch(0, t) for t in range(6)])
    for got, want in zip(res.params[0], model.parameters()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_gradient_allreduce_is_training_on_the_concatenated_batch(opt_name: str) -> None:
    def factory(ps: List[nn.Parameter]) -> torch.optim.Optimizer:
        if opt_name == "sgd":
            return torch.optim.SGD(ps, lr=0.1, momentum=0.9)
        return torch.optim.Adam(ps, lr=0.01)

    n, steps, batch = 3, 5, batch_fn(2, torch.float64)
    res = ra.run_reference(
        "gradient_allreduce",
        n,
        lambda r: make_mlp(3, torch.float64),
        batch,
        ra.mse_loss,
        factory,
        steps,
    )
    model = make_mlp(3, torch.float64)
    cat = [
        tuple(torch.cat([batch(r, t)[i] for r in range(n)]) for i in range(2)) for t in range(steps)
    ]
    plain_training(model, factory(list(model.parameters())), cat)
    for r in range(n):
        for got, want in zip(res.params[r], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["all", "shift_one", "ring"])
def test_decentralized_one_step(mode: str) -> None:
    # x_1 = W x_0 - lr g(x_0) with plain SGD; W from the mode (float64 weights and math here).
    n, lr = 3, 0.1
    batch = batch_fn(3, torch.float64)
    res = ra.run_reference(
        "decentralized",
        n,
        lambda r: make_mlp(10 + r, torch.float64),
        batch,
        ra.mse_loss,
        lambda ps: torch.optim.SGD(ps, lr=lr),
        1,
        peer_selection_mode=mode,
    )
    if mode == "all":
        w = np.full((n, n), 1 / n)
    elif mode == "ring":
        w = ring_matrix(n)
    else:  # round 0 at n = 3: 0 <-> 2, rank 1 with the virtual rank 3 keeps its weights
        w = np.array([[0.5, 0, 0.5], [0, 1, 0], [0.5, 0, 0.5]])
    x0 = [
        [p.detach().numpy() for p in make_mlp(10 + r, torch.float64).parameters()] for r in range(n)
    ]
    for r in range(n):
        model = make_mlp(10 + r, torch.float64)
        ra.mse_loss(model, batch(r, 0)).backward()
        for i, p in enumerate(model.parameters()):
            mixed = sum(w[r, j] * x0[j][i] for j in range(n))
            np.testing.assert_allclose(
                res.params[r][i].numpy(), mixed - lr * p.grad.numpy(), rtol=1e-12, atol=1e-14
            )


@pytest.mark.parametrize("mode", ["all", "shift_one", "ring"])
@pytest.mark.parametrize("n", [4, 5])
def test_decentralized_mixing_keeps_the_mean_and_contracts(mode: str, n: int) -> None:
    # lr = 0: only mixing. Doubly stochastic W keeps the mean over ranks; gossip shrinks the spread.
    res = ra.run_reference(
        "decentralized",
        n,
        lambda r: make_mlp(20 + r, torch.float64),
        batch_fn(4, torch.float64),
        ra.mse_loss,
        lambda ps: torch.optim.SGD(ps, lr=0.0),
        12,
        peer_selection_mode=mode,
    )
    x0 = [
        torch.cat([p.detach().reshape(-1) for p in make_mlp(20 + r, torch.float64).parameters()])
        for r in range(n)
    ]
    x = [torch.cat([p.reshape(-1) for p in ps]) for ps in res.params]
    torch.testing.assert_close(
        torch.stack(x).mean(0), torch.stack(x0).mean(0), rtol=1e-12, atol=1e-12
    )
    spread0 = (torch.stack(x0) - torch.stack(x0).mean(0)).abs().max()
    spread = (torch.stack(x) - torch.stack(x).mean(0)).abs().max()
    assert spread < 0.05 * spread0


def test_decentralized_communication_interval() -> None:
    # interval 2, 2 steps: step 0 averages (all), step 1 is local.
    n, lr, batch = 2, 0.1, batch_fn(5, torch.float64)
    res = ra.run_reference(
        "decentralized",
        n,
        lambda r: make_mlp(30 + r, torch.float64),
        batch,
        ra.mse_loss,
        lambda ps: torch.optim.SGD(ps, lr=lr),
        2,
        communication_interval=2,
    )
    models = [make_mlp(30 + r, torch.float64) for r in range(n)]
    grads = []
    for r, m in enumerate(models):
        ra.mse_loss(m, batch(r, 0)).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    avg = [(a.detach() + b.detach()) / 2 for a, b in zip(*[m.parameters() for m in models])]
    for r, m in enumerate(models):
        with torch.no_grad():
            for p, a, g in zip(m.parameters(), avg, grads[r]):
                p.copy_(a - lr * g)
        m.zero_grad()
        ra.mse_loss(m, batch(r, 1)).backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= lr * p.grad
        for got, want in zip(res.params[r], m.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)


# ---- ByteGrad ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("average", [True, False])
def test_bytegrad_exact_on_the_grid(dtype: str, average: bool) -> None:
    # Each chunk of the base has integer values spanning exactly 255 (lossless), every rank
    # adds a constant offset (same range, lossless), offsets sum to a multiple of n: the
    # average has range 255 and integer values, the sum range 255 n = 1020 with multiples of 4.
    n, c = 4, 24
    rng = np.random.default_rng(7)
    base = []
    for _ in range(n):
        k = rng.integers(0, 256, c)
        k[:2] = [0, 255]
        base.append(k - 120)
    base_arr = np.concatenate(base).astype(np.float32)
    offsets = [3.0, -5.0, 10.0, 4.0]  # sum 12
    bufs = [base_arr + np.float32(o) for o in offsets]
    outs = ra.bytegrad([as_dtype(b, dtype) for b in bufs], dtype, average=average)
    want = (base_arr + 3) if average else (4 * base_arr + 12)
    for out in outs:
        assert bits_equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3])
def test_bytegrad_error_bound_and_padding(dtype: str, n: int) -> None:
    rng = np.random.default_rng(8 + n)
    numel = 101  # not a multiple of n: the last chunk is zero-padded
    bufs = [as_dtype(rng.standard_normal(numel) * (1 + r), dtype) for r in range(n)]
    outs = ra.bytegrad(bufs, dtype)
    assert all(o.shape == (numel,) and bits_equal(o, outs[0]) for o in outs)
    c = -(-numel // n)
    padded = [np.concatenate([b, np.zeros(n * c - numel)]).astype(np.float64) for b in bufs]
    mean = np.mean(padded, axis=0)
    for k in range(n):
        sl = slice(k * c, (k + 1) * c)
        step1 = np.mean([(p[sl].max() - p[sl].min()) / 255 for p in padded])
        step2 = (mean[sl].max() - mean[sl].min()) / 255 + step1  # range of the quantized mean
        bound = 0.5 * (step1 + step2) * (1 + 1e-3) + 4 * REL_ULP[dtype] * np.abs(mean[sl]).max()
        got = np.concatenate([outs[0], np.zeros(n * c - numel, np.float32)])[sl]
        err = np.abs(got.astype(np.float64) - mean[sl])[: numel - k * c]  # padding dropped
        assert (err <= bound).all()


def test_bytegrad_error_feedback_keeps_the_accumulated_error_bounded() -> None:
    # With error feedback, sum_t out_t = T mean(g) - mean_j e_w^j - e_s (telescoping): bounded
    # by about one quantization step. Without it the rounding bias adds up over T steps.
    n, numel, steps = 3, 96, 40
    rng = np.random.default_rng(9)
    g = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
    mean = np.mean([x.astype(np.float64) for x in g], axis=0)
    residuals = [ra.ByteGradResidual() for _ in range(n)]
    total_ef = np.zeros(numel)
    total_plain = np.zeros(numel)
    for _ in range(steps):
        total_ef += ra.bytegrad(g, "float32", residuals=residuals)[0]
        total_plain += ra.bytegrad(g, "float32")[0]
    qstep = max((x.max() - x.min()) / 255 for x in g) * 1.2
    assert residuals[0].worker.shape == (96,) and residuals[0].server.shape == (32,)
    err_ef = np.abs(total_ef - steps * mean).max()
    err_plain = np.abs(total_plain - steps * mean).max()
    assert err_ef <= 2 * qstep + 1e-4
    assert err_plain > 5 * qstep


def test_bytegrad_training_keeps_ranks_identical() -> None:
    n, batch = 3, batch_fn(10)
    kw = dict(bucket_bytes=64, error_feedback=True)
    res = ra.run_reference("bytegrad", n, lambda r: make_mlp(11), batch, ra.mse_loss, sgd, 6, **kw)
    exact = ra.run_reference(
        "gradient_allreduce", n, lambda r: make_mlp(11), batch, ra.mse_loss, sgd, 6
    )
    assert len(res.bucket_layout) > 1
    init = list(make_mlp(11).parameters())
    for r in range(1, n):
        assert all(torch.equal(a, b) for a, b in zip(res.params[r], res.params[0]))
    moved = sum((a - b.detach()).abs().sum() for a, b in zip(exact.params[0], init))
    diff = sum((a - b).abs().sum() for a, b in zip(res.params[0], exact.params[0]))
    assert diff < 0.05 * moved
    ws = res.state["worker_residuals"]
    assert len(ws) == n and len(ws[0]) == len(res.bucket_layout)


# ---- low-precision decentralized -------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_replicas_are_consistent(n: int, interval: int, dtype: torch.dtype) -> None:
    res = ra.run_reference(
        "low_precision_decentralized",
        n,
        lambda r: make_mlp(40 + r, dtype),  # never broadcast: different weights per rank
        batch_fn(12, dtype),
        ra.mse_loss,
        sgd,
        5,  # the last step (t = 4) communicates for both intervals
        bucket_bytes=100,
        communication_interval=interval,
    )
    st = res.state
    assert len(res.bucket_layout) > 1
    for r in range(n):
        left, right = (r - 1) % n, (r + 1) % n
        for b, idx in enumerate(res.bucket_layout):
            mine = torch.cat([res.params[r][i].reshape(-1) for i in idx])
            assert torch.equal(st["replica"][r][b], mine)
            assert torch.equal(st["left"][r][b], st["replica"][left][b])
            assert torch.equal(st["right"][r][b], st["replica"][right][b])


def test_low_precision_first_step_is_the_d_update() -> None:
    # Step 0 from different weights: x_new = x0 + Q(d), d = x1 + x0_left/3 + x0_right/3 - 5/3 x0,
    # x1 = x0 - lr g(x0); within the quantization error of d (float64 here, one bucket).
    n, lr, batch = 3, 0.1, batch_fn(13)
    res = ra.run_reference(
        "low_precision_decentralized",
        n,
        lambda r: make_mlp(50 + r),
        batch,
        ra.mse_loss,
        lambda ps: torch.optim.SGD(ps, lr=lr),
        1,
        bucket_bytes=1 << 20,
    )
    (idx,) = res.bucket_layout
    x0, x1 = [], []
    for r in range(n):
        m = make_mlp(50 + r)
        ra.mse_loss(m, batch(r, 0)).backward()
        ps = list(m.parameters())
        x0.append(torch.cat([ps[i].detach().reshape(-1) for i in idx]).double().numpy())
        x1.append(
            torch.cat([(ps[i] - lr * ps[i].grad).detach().reshape(-1) for i in idx])
            .double()
            .numpy()
        )
    for r in range(n):
        left, right = (r - 1) % n, (r + 1) % n
        d = x1[r] + x0[left] / 3 + x0[right] / 3 - 5 / 3 * x0[r]
        got = torch.cat([res.params[r][i].reshape(-1) for i in idx]).double().numpy()
        bound = 0.5 * (d.max() - d.min()) / 255 * (1 + 1e-3) + 1e-5
        assert np.abs(got - (x0[r] + d)).max() <= bound


# ---- QAdam -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_qadam_warmup_is_torch_adam(n: int, weight_decay: float) -> None:
    steps, lr = 50, 0.01
    same = lambda r, t: batch_fn(14)(0, t)  # noqa: E731 - identical batches on every rank
    res = ra.run_reference(
        "qadam",
        n,
        lambda r: make_mlp(60),
        same,
        ra.mse_loss,
        None,
        steps,
        lr=lr,
        warmup_steps=100,
        weight_decay=weight_decay,
    )
    model = make_mlp(60)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    plain_training(model, opt, [same(0, t) for t in range(steps)])
    for r in range(n):
        for got, want in zip(res.params[r], model.parameters()):
            assert torch.equal(got, want)
    for r in range(n):
        for m, p in zip(res.state["exp_avg"][r], model.parameters()):
            assert torch.equal(m, opt.state[p]["exp_avg"])


def test_qadam_compression_stage_freezes_v() -> None:
    # n = 1: Adam for the warm-up W steps, then m <- b1 m + (1 - b1)(g + wd x) and
    # x <- x - lr / (1 - b1^s) m / (max(sqrt(v / (1 - b2^s)), |m| / (1 - b1^s)) + eps) with
    # v from the warm-up (BAGUA's bias correction, with the current s).
    warmup, steps, lr, wd, (b1, b2), eps = 4, 10, 0.01, 0.05, (0.9, 0.999), 1e-8
    batch = batch_fn(15)
    res = ra.run_reference(
        "qadam",
        1,
        lambda r: make_mlp(61),
        batch,
        ra.mse_loss,
        None,
        steps,
        lr=lr,
        warmup_steps=warmup,
        weight_decay=wd,
    )
    model = make_mlp(61)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
    plain_training(model, opt, [batch(0, t) for t in range(warmup)])
    ps = list(model.parameters())
    m = [opt.state[p]["exp_avg"].double() for p in ps]
    v = [opt.state[p]["exp_avg_sq"].double() for p in ps]
    x = [p.detach().double() for p in ps]
    for t in range(warmup, steps):
        s = t + 1
        model.zero_grad()
        ra.mse_loss(model, batch(0, t)).backward()
        for i, p in enumerate(ps):
            g = p.grad.double() + wd * x[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            floor = m[i].abs() / (1 - b1**s)
            denom = torch.maximum(torch.sqrt(v[i] / (1 - b2**s)), floor) + eps
            x[i] = x[i] - lr / (1 - b1**s) * m[i] / denom
        with torch.no_grad():
            for p, xi in zip(ps, x):
                p.copy_(xi)
    for got, want in zip(res.params[0], x):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for got, want in zip(res.state["exp_avg_sq"][0], v):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_qadam_compression_stage_ranks_agree() -> None:
    # Warm-up averages gradients, the compression stage averages m with ByteGrad: every rank
    # holds the same x, m and v even with different batches; close to n = 1 on equal batches.
    kw = dict(lr=0.01, warmup_steps=3, weight_decay=0.01, error_feedback=True)
    res = ra.run_reference(
        "qadam",
        3,
        lambda r: make_mlp(62),
        batch_fn(16),
        ra.mse_loss,
        None,
        8,
        bucket_bytes=64,
        **kw,
    )
    for r in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(res.params[r], res.params[0]))
        assert all(
            torch.equal(a, b) for a, b in zip(res.state["exp_avg"][r], res.state["exp_avg"][0])
        )
    same = lambda r, t: batch_fn(17)(0, t)  # noqa: E731
    two = ra.run_reference("qadam", 2, lambda r: make_mlp(62), same, ra.mse_loss, None, 8, **kw)
    one = ra.run_reference("qadam", 1, lambda r: make_mlp(62), same, ra.mse_loss, None, 8, **kw)
    init = list(make_mlp(62).parameters())
    moved = sum((a - b.detach()).abs().sum() for a, b in zip(one.params[0], init))
    diff = sum((a - b).abs().sum() for a, b in zip(two.params[0], one.params[0]))
    assert 0 < diff < 0.05 * moved


def test_argument_errors() -> None:
    mk = lambda r: make_mlp(0)  # noqa: E731
    with pytest.raises(ValueError, match="warmup_steps"):
        ra.run_reference("qadam", 2, mk, batch_fn(0), ra.mse_loss, None, 1, warmup_steps=0)
    with pytest.raises(ValueError, match="algorithm"):
        ra.run_reference("nope", 2, mk, batch_fn(0), ra.mse_loss, sgd, 1)
    with pytest.raises(ValueError, match="float64"):
        ra.run_reference(
            "bytegrad", 2, lambda r: make_mlp(0, torch.float64), batch_fn(0), ra.mse_loss, sgd, 1
        )
    with pytest.raises(ValueError, match="every parameter"):
        ra.run_reference(
            "bytegrad", 2, mk, batch_fn(0), ra.mse_loss, sgd, 1, bucket_layout=[[0, 1]]
        )


def test_batches_as_lists_or_callable() -> None:
    batch = batch_fn(18)
    lists = [[batch(r, t) for t in range(3)] for r in range(2)]
    args = ("bytegrad", 2, lambda r: make_mlp(1), lists, ra.mse_loss, sgd, 3)
    a = ra.run_reference(*args, bucket_bytes=64)
    b = ra.run_reference(*args[:3], batch, *args[4:], bucket_bytes=64)
    assert a.losses == b.losses and all(math.isfinite(v) for row in a.losses for v in row)
    assert all(torch.equal(x, y) for x, y in zip(a.params[1], b.params[1]))
