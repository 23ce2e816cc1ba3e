"""MinMaxUInt8 CPU kernels (bhvd_minmax_uint8_*) against an independent numpy float32 reference.

The reference is written from docs/algorithms.md ("MinMaxUInt8") and docs/compression.md (the
conventions the spec leaves open: saturating uint8 conversion, +0 for a zero min/max, NaN header
for non-finite chunks, canonical NaN on decode, zero padding). Every comparison is bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_algorithms as ra

from bagua_hvd.common._native import ffi, lib

F32, F16, BF16 = "float32", "float16", "bfloat16"
DTYPES = [F32, F16, BF16]
ITEMSIZE = {F32: 4, F16: 2, BF16: 2}
CANONICAL_NAN_BITS = {F32: 0x7FC00000, F16: 0x7E00, BF16: 0x7FC0}


def dtype_code(dtype: str) -> int:
    return {F32: lib().BHVD_FLOAT32, F16: lib().BHVD_FLOAT16, BF16: lib().BHVD_BFLOAT16}[dtype]


# ---- the reference ------------------------------------------------------------------------------
def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN kept quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = ((u >> 16) | 0x40) & 0xFFFF
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, nan, rounded).astype(np.uint16)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the stored array of dtype (bfloat16 as uint16 bits), RNE."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == F32:
        return x.copy()
    if dtype == F16:
        return x.astype(np.float16)
    return bf16_round(x)


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values -> float32, exactly."""
    if dtype == BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def storage_bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def align32(n: int) -> int:
    return (n + 31) // 32 * 32


# The chunk parameters (the overflow rule included) and the largest finite values: the one
# numpy model of docs/algorithms.md's arithmetic, shared with the algorithms' reference.
ref_params = ra._params
TOP = ra._TOP


def ref_compress(a: np.ndarray, dtype: str, n_chunks: int) -> bytes:
    c = a.size // n_chunks
    out = bytearray()
    with np.errstate(all="ignore"):
        for k in range(n_chunks):
            v = widen(a[k * c : (k + 1) * c], dtype)
            header = bytearray(32)
            payload = np.zeros(align32(c), dtype=np.uint8)
            if c == 0:
                mn = mx = np.float32(0.0)
            elif not np.isfinite(v).all():
                mn = mx = np.uint32(0x7FC00000).view(np.float32)
            else:
                mn, mx = np.float32(v.min()), np.float32(v.max())
                # A zero min/max is stored as +0.
                mn = np.float32(0.0) if mn == 0 else mn
                mx = np.float32(0.0) if mx == 0 else mx
                scale, ub, lb = ref_params(mn, mx)
                q = np.minimum(np.rint(v * scale), ub) - lb
                q = np.where(q > 0, q, np.float32(0.0))  # saturate; NaN -> 0
                payload[:c] = np.minimum(q, np.float32(255.0)).astype(np.uint8)
            t = ITEMSIZE[dtype]
            header[0:t] = to_storage(np.array([mn]), dtype).tobytes()
            header[t : 2 * t] = to_storage(np.array([mx]), dtype).tobytes()
            out += header + payload.tobytes()
    return bytes(out)


def ref_decode_f32(blob: bytes, dtype: str, n: int, n_chunks: int) -> np.ndarray:
    """Decoded values in float32 (before rounding to dtype), NaN canonical."""
    c = n // n_chunks
    t = ITEMSIZE[dtype]
    store = np.float32 if dtype == F32 else (np.float16 if dtype == F16 else np.uint16)
    out = np.empty(n, dtype=np.float32)
    raw = np.frombuffer(blob, dtype=np.uint8)
    with np.errstate(all="ignore"):
        for k in range(n_chunks):
            base = k * (32 + align32(c))
            mn, mx = widen(raw[base : base + 2 * t].copy().view(store), dtype)
            scale, _, lb = ref_params(mn, mx)
            q = raw[base + 32 : base + 32 + c].astype(np.float32)
            out[k * c : (k + 1) * c] = np.clip((q + lb) / scale, -TOP[dtype], TOP[dtype])
    out[np.isnan(out)] = np.uint32(0x7FC00000).view(np.float32)
    return out


def ref_decompress(blob: bytes, dtype: str, n: int, n_chunks: int) -> np.ndarray:
    return to_storage(ref_decode_f32(blob, dtype, n, n_chunks), dtype)


# ---- calling the library ------------------------------------------------------------------------
def lib_size(dtype: str, n: int, n_chunks: int) -> int:
    return int(lib().bhvd_minmax_uint8_size(dtype_code(dtype), n, n_chunks))


def lib_compress(a: np.ndarray, dtype: str, n_chunks: int) -> bytes:
    size = lib_size(dtype, a.size, n_chunks)
    assert size >= 0, ffi.string(lib().bhvd_last_error()).decode()
    out = np.full(size, 0xAB, dtype=np.uint8)  # garbage: every byte must be written
    a = np.ascontiguousarray(a)
    rc = lib().bhvd_minmax_uint8_compress(
        ffi.from_buffer(a), dtype_code(dtype), a.size, n_chunks, ffi.from_buffer(out)
    )
    assert rc == lib().BHVD_OK, ffi.string(lib().bhvd_last_error()).decode()
    return out.tobytes()


def lib_decompress(blob: bytes, dtype: str, n: int, n_chunks: int) -> np.ndarray:
    store = np.float32 if dtype == F32 else (np.float16 if dtype == F16 else np.uint16)
    out = np.full(n, 0x5A, dtype=store) if dtype != F32 else np.full(n, 1234.5, np.float32)
    src = np.frombuffer(blob, dtype=np.uint8)
    rc = lib().bhvd_minmax_uint8_decompress(
        ffi.from_buffer(src), dtype_code(dtype), n, n_chunks, ffi.from_buffer(out)
    )
    assert rc == lib().BHVD_OK, ffi.string(lib().bhvd_last_error()).decode()
    return out


def check_bit_exact(values: np.ndarray, dtype: str, n_chunks: int) -> bytes:
    """Compresses values (float32, rounded to dtype first), compares with the reference bytes,
    decompresses and compares with the reference decode; returns the compressed bytes."""
    a = to_storage(values, dtype)
    got = lib_compress(a, dtype, n_chunks)
    want = ref_compress(a, dtype, n_chunks)
    assert len(got) == len(want) == lib_size(dtype, a.size, n_chunks)
    if got != want:
        g, w = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
        bad = np.flatnonzero(g != w)
        raise AssertionError(
            f"{bad.size} bytes differ, first at {bad[0]}: got {g[bad[:8]]} want {w[bad[:8]]}"
        )
    dec = lib_decompress(got, dtype, a.size, n_chunks)
    np.testing.assert_array_equal(
        storage_bits(dec), storage_bits(ref_decompress(want, dtype, a.size, n_chunks))
    )
    return got


# ---- bit exactness ------------------------------------------------------------------------------
CHUNKS = [1, 2, 3, 4, 7]
CHUNK_LENGTHS = [1, 5, 8, 31, 33, 100, 1000, 4099]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_chunks", CHUNKS)
@pytest.mark.parametrize("c", CHUNK_LENGTHS)
def test_random_bit_exact(dtype: str, n_chunks: int, c: int) -> None:
    rng = np.random.default_rng(1000 * n_chunks + c)
    # Chunks of different scales and offsets, so that each gets its own min/max.
    scales = np.float32(10.0) ** rng.integers(-6, 4, size=n_chunks).astype(np.float32)
    offsets = rng.normal(size=n_chunks).astype(np.float32) * scales
    x = rng.normal(size=(n_chunks, c)).astype(np.float32) * scales[:, None] + offsets[:, None]
    check_bit_exact(x.reshape(-1), dtype, n_chunks)


def test_layout_and_padding() -> None:
    """min at 0, max at sizeof(T), zeros to 32, payload, zeros to align32(c), over garbage."""
    x = np.array([3.0, -1.0, 0.5, 2.0, 1.0] * 2, dtype=np.float32)
    blob = check_bit_exact(x, F32, 2)
    assert len(blob) == 2 * (32 + 32)
    for k in range(2):
        chunk = blob[k * 64 : (k + 1) * 64]
        assert np.frombuffer(chunk[:8], np.float32).tolist() == [-1.0, 3.0]
        assert chunk[8:32] == bytes(24)
        assert chunk[32 + 5 :] == bytes(27)
        # -1 -> 0 and 3 -> 255 by construction of the formula (min and max hit the ends).
        assert chunk[32] == 255 and chunk[33] == 0
    blob16 = check_bit_exact(x, F16, 1)
    assert np.frombuffer(blob16[:4], np.float16).tolist() == [-1.0, 3.0]
    assert blob16[4:32] == bytes(28)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 64])
def test_size(dtype: str, n: int) -> None:
    for n_chunks in CHUNKS:
        if n % n_chunks == 0:
            assert lib_size(dtype, n, n_chunks) == n_chunks * (32 + align32(n // n_chunks))
    assert lib_size(dtype, 7 * 33, 7) == 7 * (32 + 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_chunks(dtype: str) -> None:
    blob = check_bit_exact(np.zeros(0, np.float32), dtype, 3)
    assert blob == bytes(3 * 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_and_signed_zero_chunks(dtype: str) -> None:
    chunks = [
        np.full(37, 3.5),
        np.full(37, -0.0),
        np.zeros(37),
        np.where(np.arange(37) % 2 == 0, -0.0, 0.0),  # mixed zeros: header holds +0
        np.where(np.arange(37) % 3 == 0, -0.0, 1.0),
        np.where(np.arange(37) % 3 == 0, 0.0, -1.0),
        np.full(37, -1e-3),
        np.full(37, 1.0),  # ub - lb = 256 in float32: saturates to 255, decodes to 1.0 exactly
    ]
    x = np.concatenate(chunks).astype(np.float32)
    blob = check_bit_exact(x, dtype, len(chunks))
    t, step = ITEMSIZE[dtype], 32 + 64
    for k in (1, 2, 3):
        assert blob[k * step : k * step + 2 * t] == bytes(2 * t), f"chunk {k} header not +0"
    last = blob[7 * step + 32 : 7 * step + 32 + 37]
    assert last == bytes([255]) * 37
    assert (widen(lib_decompress(blob, dtype, x.size, len(chunks)), dtype)[-37:] == 1.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_dynamic_ranges(dtype: str) -> None:
    rng = np.random.default_rng(7)
    big = 6e4 if dtype == F16 else 3e38  # float32: max - min overflows to +inf
    decades = (-8, 4.5) if dtype == F16 else (-30, 30)
    c = 77
    chunks = [
        np.float32(10.0) ** rng.uniform(*decades, c).astype(np.float32) * rng.choice([-1, 1], c),
        np.concatenate([[-big, big], np.clip(rng.normal(size=c - 2), -4, 4) * big / 4]),
        np.full(c, 1e30),  # constant: max * scale overflows to +inf
        np.full(c, -1e30),
        1000.0 + rng.normal(size=c) * 1e-3,  # large offset, tiny range: |ub| > 2^24
        -1000.0 + rng.normal(size=c) * 1e-4,
        np.concatenate([[1e-30, -1e-30], rng.normal(size=c - 2) * 1e-31]),
    ]
    if dtype == F16:
        chunks[2], chunks[3] = np.full(c, 6e4), np.full(c, -6e4)
        chunks[6] = np.concatenate([[1e-3, -1e-3], rng.normal(size=c - 2) * 1e-4])
    x = np.concatenate(chunks).astype(np.float32)
    assert np.isfinite(widen(to_storage(x, dtype), dtype)).all()
    check_bit_exact(x, dtype, len(chunks))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_saturation_cases_occur(dtype: str) -> None:
    """The large-offset chunks above do reach the saturating (uint8) conversion (else that test
    would not exercise it); checked on the reference's unsaturated values."""
    rng = np.random.default_rng(11)
    hits = 0
    for trial in range(200):
        if trial % 2:  # large offset, small range
            x = 1000.0 + rng.normal(size=64) * 10.0 ** -(trial % 7)
        else:  # constant: range 0, scale = 255 / eps, |max * scale| >> 2^24
            x = np.full(64, rng.uniform(-2.0, 2.0))
        v = widen(to_storage(x, dtype), dtype)
        mn, mx = np.float32(v.min()), np.float32(v.max())
        scale, ub, lb = ref_params(mn, mx)
        q = np.minimum(np.rint(v * scale), ub) - lb
        if (q < 0).any() or (q > 255).any():
            hits += 1
            check_bit_exact(v, dtype, 1)
    assert hits > 0


def tie_values(mn: float, mx: float, count: int, rng: np.random.Generator) -> list[np.float32]:
    """float32 x in (mn, mx) with x * scale exactly k + 1/2 (scale of a chunk with that min/max)."""
    scale, _, _ = ref_params(np.float32(mn), np.float32(mx))
    ties: list[np.float32] = []
    for k in rng.integers(int(np.ceil(mn * scale)), int(np.floor(mx * scale)) - 1, size=count * 8):
        target = np.float32(k + 0.5)
        x = np.float32(target / scale)
        for _ in range(8):  # walk a few ulps around the quotient
            if x * scale == target:
                ties.append(x)
                break
            x = np.nextafter(x, np.float32(np.inf) if x * scale < target else np.float32(-np.inf))
        if len(ties) == count:
            break
    return ties


def test_ties_round_half_even() -> None:
    rng = np.random.default_rng(3)
    mn, mx = np.float32(-2.0), np.float32(6.0)
    ties = tie_values(mn, mx, 40, rng)
    assert len(ties) >= 20
    x = np.array([mn, mx, *ties], dtype=np.float32)
    scale, _, lb = ref_params(mn, mx)
    parities = {int(t * scale - 0.5) % 2 for t in ties}
    assert parities == {0, 1}, "need ties below both even and odd integers"
    blob = check_bit_exact(x, F32, 1)
    q = np.frombuffer(blob[32 : 32 + x.size], np.uint8)
    # Round half to even: the rounded integer rint(x * scale) = q + lb is even at every tie.
    assert all((int(qi) + int(lb)) % 2 == 0 for qi in q[2:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_denormals(dtype: str) -> None:
    rng = np.random.default_rng(5)
    tiny = {F32: 1e-39, F16: 3e-6, BF16: 1e-39}[dtype]  # subnormal in each type
    c = 45
    chunks = [
        rng.uniform(-tiny, tiny, c),
        rng.uniform(0, tiny, c),
        np.concatenate([[tiny, -tiny], rng.normal(size=c - 2)]),
    ]
    x = np.concatenate(chunks).astype(np.float32)
    bits = storage_bits(to_storage(x, dtype)).astype(np.uint32)
    exponent, mantissa = {F32: (0x7F800000, 0x7FFFFF), F16: (0x7C00, 0x3FF), BF16: (0x7F80, 0x7F)}[
        dtype
    ]
    assert ((bits & exponent == 0) & (bits & mantissa != 0)).sum() > c, "too few subnormals"
    check_bit_exact(x, dtype, len(chunks))


# ---- non-finite inputs --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [0, 17, 39])
def test_non_finite_chunk_decodes_to_nan(dtype: str, bad: float, pos: int) -> None:
    rng = np.random.default_rng(pos)
    c, n_chunks = 40, 3
    x = rng.normal(size=n_chunks * c).astype(np.float32)
    x[c + pos] = bad  # chunk 1 only
    blob = check_bit_exact(x, dtype, n_chunks)
    t, step = ITEMSIZE[dtype], 32 + 64
    header = np.frombuffer(blob[step : step + 2 * t], np.uint32 if t == 4 else np.uint16)
    assert header.tolist() == [CANONICAL_NAN_BITS[dtype]] * 2
    assert blob[step + 2 * t : 2 * step] == bytes(step - 2 * t)  # zero payload
    dec = storage_bits(lib_decompress(blob, dtype, n_chunks * c, n_chunks))
    assert (dec[c : 2 * c] == CANONICAL_NAN_BITS[dtype]).all()
    decoded = widen(lib_decompress(blob, dtype, n_chunks * c, n_chunks), dtype)
    assert np.isfinite(decoded[:c]).all() and np.isfinite(decoded[2 * c :]).all()


# ---- decompress alone, on arbitrary compressed bytes --------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_decompress_arbitrary_bytes(dtype: str) -> None:
    rng = np.random.default_rng(9)
    n_chunks, c = 64, 19
    blob = bytearray(rng.integers(0, 256, size=lib_size(dtype, n_chunks * c, n_chunks)).tobytes())
    t = ITEMSIZE[dtype]
    for k in range(n_chunks):  # headers: random finite pairs, some reversed or equal
        base = k * (32 + 32)
        mn, mx = np.sort(rng.normal(size=2) * 10.0 ** rng.integers(-5, 5)).astype(np.float32)
        if k % 5 == 1:
            mn, mx = mx, mn
        if k % 7 == 2:
            mx = mn
        blob[base : base + t] = to_storage(np.array([mn]), dtype).tobytes()
        blob[base + t : base + 2 * t] = to_storage(np.array([mx]), dtype).tobytes()
    got = lib_decompress(bytes(blob), dtype, n_chunks * c, n_chunks)
    want = ref_decompress(bytes(blob), dtype, n_chunks * c, n_chunks)
    np.testing.assert_array_equal(storage_bits(got), storage_bits(want))


# ---- round-trip error ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_chunks", [1, 3, 7])
def test_round_trip_error_bound(dtype: str, n_chunks: int) -> None:
    """|x - x'| <= (max - min + eps) / 255 / 2 (rint) + float32 rounding of the few operations
    (a few ulps of max|x|) + half an ulp of x' in T (the final rounding)."""
    rng = np.random.default_rng(n_chunks)
    c = 999
    x = (rng.normal(size=(n_chunks, c)) * 10.0 ** rng.integers(-3, 3, (n_chunks, 1))).astype(
        np.float32
    )
    a = to_storage(x.reshape(-1), dtype)
    v = widen(a, dtype).reshape(n_chunks, c).astype(np.float64)
    dec = widen(lib_decompress(lib_compress(a, dtype, n_chunks), dtype, a.size, n_chunks), dtype)
    dec = dec.reshape(n_chunks, c).astype(np.float64)
    mn, mx = v.min(axis=1, keepdims=True), v.max(axis=1, keepdims=True)
    mag = np.maximum(np.abs(mn), np.abs(mx))
    t_eps = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}[dtype]
    t_tiny = {F32: 2.0**-150, F16: 2.0**-25, BF16: 2.0**-134}[dtype]  # half a subnormal step
    bound = (mx - mn + 1e-7) / 255 * 0.5 + 8 * 2.0**-24 * mag + t_eps * np.abs(dec) + t_tiny
    err = np.abs(v - dec)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    # The bound is not vacuous: the quantization step dominates it and is actually reached.
    assert (err > 0.25 * (mx - mn) / 255).any()


# ---- errors -------------------------------------------------------------------------------------
def last_error() -> str:
    return ffi.string(lib().bhvd_last_error()).decode()


@pytest.mark.parametrize(
    "dtype, n, n_chunks, message",
    [
        (4, 8, 1, "float32, float16 and bfloat16 only, got dtype 4 (int32)"),
        (8, 8, 1, "got dtype 8 (float64)"),
        (99, 8, 1, "got dtype 99 (unknown)"),
        (7, 10, 3, "n = 10 elements is not a multiple of n_chunks = 3"),
        (7, 8, 0, "needs n_chunks >= 1, got 0"),
        (7, 8, -2, "needs n_chunks >= 1, got -2"),
        (10, -4, 1, "negative n -4"),
    ],
)
def test_errors(dtype: int, n: int, n_chunks: int, message: str) -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    assert lib().bhvd_minmax_uint8_size(dtype, n, n_chunks) == -1
    assert message in last_error()
    p = ffi.from_buffer(buf)
    for fn in (lib().bhvd_minmax_uint8_compress, lib().bhvd_minmax_uint8_decompress):
        lib().bhvd_minmax_uint8_size(7, 8, 1)  # a success does not clear nor set the message
        assert fn(p, dtype, n, n_chunks, p) == lib().BHVD_INVALID_ARGUMENT
        assert message in last_error()
    assert (buf == 0).all(), "nothing written on error"


def test_null_buffer() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    rc = lib().bhvd_minmax_uint8_compress(ffi.NULL, 7, 8, 1, ffi.from_buffer(buf))
    assert rc == lib().BHVD_INVALID_ARGUMENT
    assert "NULL buffer" in last_error()
    rc = lib().bhvd_minmax_uint8_decompress(ffi.from_buffer(buf), 7, 8, 1, ffi.NULL)
    assert rc == lib().BHVD_INVALID_ARGUMENT
