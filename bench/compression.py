"""MinMaxUInt8 CPU kernels: compress/decompress throughput beside numpy and memcpy, one thread.

    python bench/compression.py                      # float32 1..64 MiB, fp16/bf16 at 16 MiB
    python bench/compression.py --sizes 4,16 --chunks 8

GB/s = bytes of the uncompressed tensor (input of compress, output of decompress) per second,
GB = 1e9 B. Each cell is the best of several timed calls after a warm-up call (the minimum is
the least disturbed by the other processes of a shared machine). Beside the library:

- numpy: a vectorized numpy float32 implementation of the same formula (docs/algorithms.md),
  whose bytes must equal the library's (checked; the run fails otherwise);
- memcpy: np.copyto of the float tensor into another, the memory-bandwidth bound of one pass.

The library runs single-threaded (no threads are involved); numpy's loops are single-threaded too.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np

from bagua_hvd.common._native import ffi, lib

MIB = 1 << 20
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
GOAL_F32_COMPRESS_GBPS = 2.0


def dtype_code(dtype: str) -> int:
    return {"float32": 7, "float16": 6, "bfloat16": 10}[dtype]


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def narrow(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    u = x.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # finite data


# ---- numpy implementation (finite data, as benchmarked) ------------------------------------------
def np_compress(a: np.ndarray, dtype: str, n_chunks: int, out: np.ndarray) -> None:
    c = a.size // n_chunks
    step = 32 + (c + 31) // 32 * 32
    t = ITEMSIZE[dtype]
    for k in range(n_chunks):
        v = widen(a[k * c : (k + 1) * c], dtype)
        mn, mx = np.float32(v.min()), np.float32(v.max())
        mn, mx = (np.float32(0.0) if mn == 0 else mn), (np.float32(0.0) if mx == 0 else mx)
        scale = np.float32(255.0) / ((mx - mn) + np.float32(1e-7))
        ub = np.rint(mx * scale)
        lb = ub - np.float32(255.0)
        q = np.rint(v * scale)
        np.minimum(q, ub, out=q)
        q -= lb
        np.clip(q, 0, 255, out=q)
        chunk = out[k * step : (k + 1) * step]
        chunk[:32] = 0
        chunk[:t] = narrow(np.array([mn]), dtype).view(np.uint8)
        chunk[t : 2 * t] = narrow(np.array([mx]), dtype).view(np.uint8)
        chunk[32 : 32 + c] = q
        chunk[32 + c :] = 0


def np_decompress(blob: np.ndarray, dtype: str, n: int, n_chunks: int, out: np.ndarray) -> None:
    c = n // n_chunks
    step = 32 + (c + 31) // 32 * 32
    t = ITEMSIZE[dtype]
    store = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]
    for k in range(n_chunks):
        chunk = blob[k * step : (k + 1) * step]
        mn, mx = widen(chunk[: 2 * t].view(store), dtype)
        scale = np.float32(255.0) / ((mx - mn) + np.float32(1e-7))
        lb = np.rint(mx * scale) - np.float32(255.0)
        x = chunk[32 : 32 + c].astype(np.float32)
        x += lb
        x /= scale
        out[k * c : (k + 1) * c] = narrow(x, dtype)


# ---- timing -------------------------------------------------------------------------------------
def best_seconds(fn: Callable[[], None], min_total: float, min_reps: int = 3) -> float:
    fn()  # warm-up: page faults, caches
    best, total, reps = float("inf"), 0.0, 0
    while reps < min_reps or total < min_total:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, total, reps = min(best, dt), total + dt, reps + 1
    return best


def measure(dtype: str, size_bytes: int, n_chunks: int, min_total: float) -> dict[str, float]:
    n = size_bytes // ITEMSIZE[dtype]
    n -= n % n_chunks
    rng = np.random.default_rng(0)
    a = narrow(rng.normal(size=n).astype(np.float32), dtype)
    size = int(lib().bhvd_minmax_uint8_size(dtype_code(dtype), n, n_chunks))
    blob, ref_blob = np.empty(size, np.uint8), np.empty(size, np.uint8)
    dec, ref_dec, copy = np.empty_like(a), np.empty_like(a), np.empty_like(a)
    pa, pblob, pdec = ffi.from_buffer(a), ffi.from_buffer(blob), ffi.from_buffer(dec)
    code = dtype_code(dtype)

    def lib_compress() -> None:
        if lib().bhvd_minmax_uint8_compress(pa, code, n, n_chunks, pblob) != 0:
            raise RuntimeError(ffi.string(lib().bhvd_last_error()).decode())

    def lib_decompress() -> None:
        if lib().bhvd_minmax_uint8_decompress(pblob, code, n, n_chunks, pdec) != 0:
            raise RuntimeError(ffi.string(lib().bhvd_last_error()).decode())

    row = {
        "compress": best_seconds(lib_compress, min_total),
        "np_compress": best_seconds(lambda: np_compress(a, dtype, n_chunks, ref_blob), min_total),
        "decompress": best_seconds(lib_decompress, min_total),
        "np_decompress": best_seconds(
            lambda: np_decompress(blob, dtype, n, n_chunks, ref_dec), min_total
        ),
        "memcpy": best_seconds(lambda: np.copyto(copy, a), min_total),
    }
    if not np.array_equal(blob, ref_blob):
        raise AssertionError(f"{dtype} {size_bytes} B: library bytes differ from numpy's")
    if not np.array_equal(dec.view(np.uint8), ref_dec.view(np.uint8)):
        raise AssertionError(f"{dtype} {size_bytes} B: decompressed values differ from numpy's")
    return {k: a.nbytes / v / 1e9 for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="float32 sizes in MiB")
    parser.add_argument("--half-size", type=int, default=16, help="fp16/bf16 size in MiB")
    parser.add_argument("--chunks", type=int, default=1, help="n_chunks")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per cell, at least")
    args = parser.parse_args(argv)
    cases = [("float32", int(s) * MIB) for s in args.sizes.split(",")]
    cases += [("float16", args.half_size * MIB), ("bfloat16", args.half_size * MIB)]

    head = (
        f"{'dtype':<9} {'MiB':>4} | {'compress':>8} {'numpy':>7} {'ratio':>6} | "
        f"{'decomp':>7} {'numpy':>7} {'ratio':>6} | {'memcpy':>7}   (GB/s, n_chunks={args.chunks})"
    )
    print(head)
    print("-" * len(head))
    slow = []
    for dtype, size in cases:
        r = measure(dtype, size, args.chunks, args.min_time)
        print(
            f"{dtype:<9} {size // MIB:>4} | {r['compress']:>8.2f} {r['np_compress']:>7.2f} "
            f"{r['compress'] / r['np_compress']:>5.1f}x | {r['decompress']:>7.2f} "
            f"{r['np_decompress']:>7.2f} {r['decompress'] / r['np_decompress']:>5.1f}x | "
            f"{r['memcpy']:>7.2f}",
            flush=True,
        )
        if dtype == "float32" and r["compress"] < GOAL_F32_COMPRESS_GBPS:
            slow.append(size // MIB)
    if slow:
        print(f"float32 compress below {GOAL_F32_COMPRESS_GBPS} GB/s at {slow} MiB")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
