// MinMaxUInt8 compression on the CPU (docs/algorithms.md "MinMaxUInt8", docs/compression.md).
//
// n elements of dtype (FLOAT32, FLOAT16, BFLOAT16) are split into n_chunks chunks of
// c = n / n_chunks elements, each quantized to uint8 with its own min and max. Compressed layout,
// per chunk, chunks back to back: min at byte 0 and max at byte sizeof(T) (as T), zeros up to
// byte 32, then the c uint8 values, then zeros up to align32(c). Single-threaded; vectorized with
// AVX2 + F16C when the CPU has them (bit-identical to the scalar path).
//
// Every function throws std::invalid_argument for a dtype other than those three, n_chunks < 1
// or n not a multiple of n_chunks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/common.h"

namespace bagua_hvd {

// Bytes of the compressed form: n_chunks * (align32(2 * sizeof(T)) + align32(n / n_chunks)).
size_t minmax_uint8_bytes(DataType dtype, size_t n, size_t n_chunks);

// in: n elements of dtype; out: minmax_uint8_bytes(dtype, n, n_chunks) bytes, all written.
void minmax_uint8_compress(const void* in, DataType dtype, size_t n, size_t n_chunks,
                           uint8_t* out);

// out: n elements of dtype (each decoded value rounded to nearest-even in dtype).
void minmax_uint8_decompress(const uint8_t* in, DataType dtype, size_t n, size_t n_chunks,
                             void* out);

// acc[i] += float(T(x'_i)): the decoded values, rounded to dtype, accumulated in float32.
void minmax_uint8_decompress_add_f32(const uint8_t* in, DataType dtype, size_t n,
                                     size_t n_chunks, float* acc);

// One chunk (n_chunks = 1) in pieces, for pipelined collectives: the header first, then the
// values of any ranges [i0, i0 + m), in any order and split; together they write exactly the
// bytes of minmax_uint8_compress(in, dtype, c, 1, chunk), and the ranged decoders compute exactly
// what the whole-chunk ones compute for those elements (the math is element-wise).
//  - compress_header: scans the c elements of in (the whole chunk), writes the header and the
//    payload's zero padding (a chunk with NaN or Inf: the whole zero payload).
//  - compress_range: in points at element i0; writes payload bytes [i0, i0 + m) of chunk, whose
//    header must already be written.
//  - decompress_range / decompress_add_range: elements [i0, i0 + m) of the compressed chunk (its
//    header and those payload bytes must be present), to out[0, m) / added to acc[0, m).
void minmax_uint8_compress_header(const void* in, DataType dtype, size_t c, uint8_t* chunk);
// The same header from a chunk scanned in pieces (any split, any order: a min and a max do not
// depend on them, and zeros are stored as +0): scan each piece into one MinMaxUint8Scan, then
// write the header of the c elements scanned.
struct MinMaxUint8Scan {
  float mn = 0.0f, mx = 0.0f;
  bool finite = true;
  bool any = false;  // a piece was scanned
};
void minmax_uint8_scan_range(const void* in, DataType dtype, size_t m, MinMaxUint8Scan* scan);
void minmax_uint8_write_header(const MinMaxUint8Scan& scan, DataType dtype, size_t c,
                               uint8_t* chunk);
void minmax_uint8_compress_range(const void* in, DataType dtype, size_t i0, size_t m,
                                 uint8_t* chunk);
void minmax_uint8_decompress_range(const uint8_t* chunk, DataType dtype, size_t i0, size_t m,
                                   void* out);
void minmax_uint8_decompress_add_range(const uint8_t* chunk, DataType dtype, size_t i0, size_t m,
                                       float* acc);

// Throws std::invalid_argument naming the problem; used by the CPU and CUDA entry points.
void minmax_uint8_check_args(DataType dtype, size_t n, size_t n_chunks);

}  // namespace bagua_hvd
