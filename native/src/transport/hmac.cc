#include "transport/hmac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <stdexcept>

namespace bagua_hvd {

std::array<uint8_t, 32> hmac_sha256(const void* key, size_t key_len, const void* msg, size_t len) {
  if (key_len > static_cast<size_t>(INT_MAX)) throw std::invalid_argument("HMAC key too long");
  std::array<uint8_t, 32> out{};
  unsigned int out_len = 0;
  // OpenSSL rejects a null key pointer even for an empty key.
  static const uint8_t kEmpty = 0;
  const void* k = key_len ? key : &kEmpty;
  const unsigned char* m = len ? static_cast<const unsigned char*>(msg) : &kEmpty;
  if (HMAC(EVP_sha256(), k, static_cast<int>(key_len), m, len, out.data(), &out_len) == nullptr ||
      out_len != out.size()) {
    throw std::runtime_error("HMAC-SHA256 failed in OpenSSL");
  }
  return out;
}

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  if (n > static_cast<size_t>(INT_MAX) ||
      (n && RAND_bytes(reinterpret_cast<unsigned char*>(&out[0]), static_cast<int>(n)) != 1)) {
    throw std::runtime_error("OpenSSL RAND_bytes failed: no secure random bytes available");
  }
  return out;
}

bool equal_constant_time(const void* a, size_t a_len, const void* b, size_t b_len) {
  return a_len == b_len && CRYPTO_memcmp(a, b, a_len) == 0;
}

}  // namespace bagua_hvd
