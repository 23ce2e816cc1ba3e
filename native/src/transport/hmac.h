// HMAC-SHA256 and secure random bytes (OpenSSL), used by the authentication handshake.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace bagua_hvd {

std::array<uint8_t, 32> hmac_sha256(const void* key, size_t key_len, const void* msg, size_t len);

// n bytes from OpenSSL's CSPRNG; throws std::runtime_error if it fails.
std::string random_bytes(size_t n);

// Constant-time comparison of two equally long byte strings (false if the lengths differ).
bool equal_constant_time(const void* a, size_t a_len, const void* b, size_t b_len);

}  // namespace bagua_hvd
