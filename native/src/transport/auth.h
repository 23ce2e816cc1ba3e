// Mutual authentication handshake run at the start of every connection (store and peer). Each
// side proves it knows the per-job secret by an HMAC-SHA256 over both sides' fresh nonces, bound
// to a purpose string; the secret never crosses the wire. Wire format: docs/protocol.md.
#pragma once

#include <functional>
#include <string>

#include "base/common.h"
#include "transport/socket.h"

namespace bagua_hvd {

// The other end failed to authenticate (wrong secret, wrong purpose, not a bagua_hvd endpoint).
// Not worth retrying, unlike I/O errors.
class AuthError : public TransportError {
 public:
  using TransportError::TransportError;
};

constexpr size_t kMaxHandshakeFrame = 4096;
constexpr size_t kMaxPurposeLen = 255;
constexpr size_t kMaxInfoLen = 1024;

// Purposes (a connection for one is refused by a listener expecting another).
inline std::string store_purpose() { return "store"; }
std::string peer_purpose(const std::string& job_id, int epoch);

// Client side, on a freshly connected socket. `info` (<= kMaxInfoLen bytes, covered by both
// proofs) tells the server who is connecting. Throws AuthError when the server refused us or could
// not prove it knows the secret, TransportError on I/O errors; `what` names the server.
void auth_client(int fd, const std::string& secret, const std::string& purpose,
                 const std::string& info, Deadline deadline, const std::string& what);

// Server side, on a freshly accepted socket. `validate(info)` returns "" to accept the client's
// info or a reason to refuse it (checked only after the client proved the secret). Returns the
// client's info. Throws AuthError / TransportError; `what` names the client.
std::string auth_server(int fd, const std::string& secret, const std::string& purpose,
                        Deadline deadline,
                        const std::function<std::string(const std::string&)>& validate,
                        const std::string& what);

}  // namespace bagua_hvd
