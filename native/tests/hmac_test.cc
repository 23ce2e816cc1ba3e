// The handshake's primitives (transport/hmac.h) against RFC 4231's HMAC-SHA256 test cases 1, 2
// and 6 (a key longer than SHA-256's block), and the constant-time comparison's contract.
#include "transport/hmac.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace bagua_hvd {
namespace {

std::string hex(const std::array<uint8_t, 32>& mac) {
  std::string out;
  char buf[3];
  for (uint8_t b : mac) {
    std::snprintf(buf, sizeof buf, "%02x", b);
    out += buf;
  }
  return out;
}

std::string mac_of(const std::string& key, const std::string& msg) {
  return hex(hmac_sha256(key.data(), key.size(), msg.data(), msg.size()));
}

TEST(Hmac, Rfc4231Case1) {
  EXPECT_EQ(mac_of(std::string(20, '\x0b'), "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(Hmac, Rfc4231Case2) {
  EXPECT_EQ(mac_of("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Hmac, Rfc4231Case6KeyLongerThanABlock) {
  EXPECT_EQ(mac_of(std::string(131, '\xaa'),
                   "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Hmac, EqualConstantTime) {
  EXPECT_TRUE(equal_constant_time("abcd", 4, "abcd", 4));
  EXPECT_FALSE(equal_constant_time("abcd", 4, "abce", 4));
  EXPECT_FALSE(equal_constant_time("abcd", 4, "abc", 3));
}

TEST(Hmac, RandomBytesHaveTheLengthAskedAndDiffer) {
  const std::string a = random_bytes(32), b = random_bytes(32);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace bagua_hvd
