#include "transport/auth.h"

#include <cstring>

#include "transport/hmac.h"

namespace bagua_hvd {
namespace {

constexpr char kMagic[4] = {'B', 'H', 'V', 'D'};
// Version 2: the server proves the secret only after the client did (version 1 proved first).
constexpr uint8_t kVersion = 2;
constexpr uint8_t kHello = 1, kChallenge = 2, kProof = 3, kResult = 4;
constexpr size_t kNonceLen = 32, kMacLen = 32, kHeaderLen = 6;
constexpr uint8_t kStatusOk = 0, kStatusRefused = 1;
constexpr char kServerLabel[] = "bagua_hvd auth v2 server";
constexpr char kClientLabel[] = "bagua_hvd auth v2 client";
constexpr char kWrongProof[] = "wrong proof of the job secret";

std::string header(uint8_t type) {
  std::string s(kMagic, 4);
  s.push_back(static_cast<char>(kVersion));
  s.push_back(static_cast<char>(type));
  return s;
}

// Checks magic, version and type; returns a reason or "".
std::string check_header(const std::string& msg, uint8_t type, size_t min_len) {
  if (msg.size() < kHeaderLen || std::memcmp(msg.data(), kMagic, 4) != 0) {
    return "not a bagua_hvd handshake message";
  }
  if (static_cast<uint8_t>(msg[4]) != kVersion) {
    return "unsupported handshake version " + std::to_string(static_cast<uint8_t>(msg[4]));
  }
  if (static_cast<uint8_t>(msg[5]) != type) return "unexpected handshake message type";
  if (msg.size() < min_len) return "truncated handshake message";
  return "";
}

// MAC over the label, the client's whole hello (purpose, info, client nonce) and the server nonce.
std::array<uint8_t, 32> proof(const std::string& secret, const char* label,
                              const std::string& hello, const std::string& server_nonce) {
  std::string msg(label);
  msg += hello;
  msg += server_nonce;
  return hmac_sha256(secret.data(), secret.size(), msg.data(), msg.size());
}

void require_secret(const std::string& secret) {
  if (secret.empty()) {
    throw AuthError("the job secret is empty (BAGUA_HVD_SECRET must hold the launcher's hex "
                    "secret)");
  }
}

}  // namespace

std::string peer_purpose(const std::string& job_id, int epoch) {
  return "peer/" + job_id.substr(0, 200) + "/" + std::to_string(epoch);
}

void auth_client(int fd, const std::string& secret, const std::string& purpose,
                 const std::string& info, Deadline deadline, const std::string& what) {
  require_secret(secret);
  if (purpose.size() > kMaxPurposeLen || info.size() > kMaxInfoLen) {
    throw TransportError("handshake purpose or info too long");
  }
  std::string hello = header(kHello);
  hello.push_back(static_cast<char>(purpose.size()));
  hello += purpose;
  put_u16(&hello, static_cast<uint16_t>(info.size()));
  hello += info;
  hello += random_bytes(kNonceLen);
  send_frame(fd, hello, deadline, what);

  std::string ch = recv_frame(fd, kMaxHandshakeFrame, deadline, what);
  if (auto bad = check_header(ch, kChallenge, kHeaderLen + 1); !bad.empty()) {
    throw AuthError(what + " did not answer the authentication handshake properly: " + bad);
  }
  if (static_cast<uint8_t>(ch[6]) != kStatusOk) {
    throw AuthError(what + " refused the connection: " + ch.substr(kHeaderLen + 1, 512));
  }
  if (ch.size() != kHeaderLen + 1 + kNonceLen) {
    throw AuthError(what + " sent a malformed authentication challenge");
  }
  std::string server_nonce = ch.substr(kHeaderLen + 1, kNonceLen);
  auto mine = proof(secret, kClientLabel, hello, server_nonce);
  std::string pr = header(kProof);
  pr.append(reinterpret_cast<const char*>(mine.data()), kMacLen);
  send_frame(fd, pr, deadline, what);

  std::string res = recv_frame(fd, kMaxHandshakeFrame, deadline, what);
  if (auto bad = check_header(res, kResult, kHeaderLen + 1); !bad.empty()) {
    throw AuthError(what + " sent a malformed authentication result: " + bad);
  }
  if (static_cast<uint8_t>(res[6]) != kStatusOk) {
    throw AuthError(what + " rejected this process: " +
                    (res.size() > kHeaderLen + 1 ? res.substr(kHeaderLen + 1, 512)
                                                 : std::string("bad proof of the job secret")));
  }
  // The server proves the secret only now, after we did: a stranger posing as a client never
  // gets a MAC from the server to guess the secret from offline.
  auto expected = proof(secret, kServerLabel, hello, server_nonce);
  if (res.size() != kHeaderLen + 1 + kMacLen ||
      !equal_constant_time(expected.data(), kMacLen, res.data() + kHeaderLen + 1, kMacLen)) {
    throw AuthError(what + " could not prove it knows the job secret (a different job, or a "
                    "stale BAGUA_HVD_SECRET?)");
  }
}

std::string auth_server(int fd, const std::string& secret, const std::string& purpose,
                        Deadline deadline,
                        const std::function<std::string(const std::string&)>& validate,
                        const std::string& what) {
  require_secret(secret);
  std::string hello = recv_frame(fd, kMaxHandshakeFrame, deadline, what);
  // Refusals before the client proved the secret say only what is wrong with its message's
  // format: nothing about this job (its id, the purpose served) or this process.
  auto refuse = [&](const std::string& reason) {
    std::string msg = header(kChallenge);
    msg.push_back(static_cast<char>(kStatusRefused));
    msg += reason;
    try {
      send_frame(fd, msg, deadline, what);
    } catch (const TransportError&) {  // the client may already be gone; the reason is logged
    }
    throw AuthError(reason);
  };
  if (auto bad = check_header(hello, kHello, kHeaderLen + 1); !bad.empty()) refuse(bad);
  size_t plen = static_cast<uint8_t>(hello[kHeaderLen]);
  size_t pos = kHeaderLen + 1;
  if (hello.size() < pos + plen + 2) refuse("truncated hello");
  std::string got_purpose = hello.substr(pos, plen);
  pos += plen;
  size_t ilen = get_u16(hello.data() + pos);
  pos += 2;
  if (hello.size() != pos + ilen + kNonceLen) refuse("malformed hello");
  std::string info = hello.substr(pos, ilen);

  std::string server_nonce = random_bytes(kNonceLen);
  std::string ch = header(kChallenge);
  ch.push_back(static_cast<char>(kStatusOk));
  ch += server_nonce;
  send_frame(fd, ch, deadline, what);

  std::string pr = recv_frame(fd, kMaxHandshakeFrame, deadline, what);
  std::string reason = check_header(pr, kProof, kHeaderLen + kMacLen);
  if (reason.empty() && pr.size() != kHeaderLen + kMacLen) reason = "malformed proof";
  if (reason.empty()) {
    auto expected = proof(secret, kClientLabel, hello, server_nonce);
    if (!equal_constant_time(expected.data(), kMacLen, pr.data() + kHeaderLen, kMacLen)) {
      reason = kWrongProof;
    }
  }
  const bool proved = reason.empty();
  // The client knows the secret from here on: it may learn why it is refused.
  if (proved && got_purpose != purpose) {
    reason = "wrong endpoint: this listener serves '" + purpose + "' connections, not '" +
             got_purpose.substr(0, 64) + "'";
  }
  if (reason.empty() && validate) reason = validate(info);
  std::string res = header(kResult);
  res.push_back(static_cast<char>(reason.empty() ? kStatusOk : kStatusRefused));
  if (!reason.empty()) {
    if (proved) res += reason;  // strangers learn nothing
    try {
      send_frame(fd, res, deadline, what);
    } catch (const TransportError&) {
    }
    throw AuthError(reason);
  }
  auto mine = proof(secret, kServerLabel, hello, server_nonce);
  res.append(reinterpret_cast<const char*>(mine.data()), kMacLen);
  send_frame(fd, res, deadline, what);
  return info;
}

}  // namespace bagua_hvd
