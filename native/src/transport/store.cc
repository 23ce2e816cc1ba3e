#include "transport/store.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "transport/auth.h"

namespace bagua_hvd {
namespace {

std::string printable(const std::string& key) {
  std::string out;
  for (unsigned char c : key.substr(0, 200)) {
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

void check_key(const std::string& key) {
  if (key.empty() || key.size() > kMaxStoreKey) {
    throw TransportError("invalid rendezvous key of " + std::to_string(key.size()) +
                         " bytes (must be 1.." + std::to_string(kMaxStoreKey) + ")");
  }
}

}  // namespace

TcpStore::TcpStore(Fd fd, std::string host, int port, double io_timeout_s)
    : fd_(std::move(fd)),
      endpoint_(format_endpoint(host, port)),
      what_("the rendezvous store at " + endpoint_),
      local_ip_(bagua_hvd::local_ip(fd_.get())),
      io_timeout_s_(io_timeout_s) {}

std::string TcpStore::request(const std::string& req, Deadline deadline) {
  if (!broken_.empty()) {
    throw TransportError("the connection to " + what_ + " failed earlier: " + broken_);
  }
  try {
    send_frame(fd_.get(), req, deadline, what_);
    std::string resp = recv_frame(fd_.get(), kMaxStoreFrame, deadline, what_);
    if (resp.empty()) throw TransportError("empty response from " + what_);
    if (resp[0] == 'E') throw TransportError(what_ + " refused a request: " + resp.substr(1, 512));
    return resp;
  } catch (const TransportError& e) {
    broken_ = e.what();  // the stream position is unknown now
    fd_.reset();
    throw;
  }
}

void TcpStore::set(const std::string& key, const std::string& value) {
  check_key(key);
  if (value.size() > kMaxStoreFrame - 64 - key.size()) {
    throw TransportError("rendezvous value for key '" + printable(key) + "' is too large (" +
                         std::to_string(value.size()) + " bytes)");
  }
  std::string req = "S";
  put_u32(&req, static_cast<uint32_t>(key.size()));
  req += key;
  req += value;
  std::lock_guard<std::mutex> lock(mu_);
  std::string resp = request(req, deadline_after(io_timeout_s_));
  if (resp != "K") {
    throw TransportError("unexpected reply from " + what_ + " to setting key '" + printable(key) +
                         "'");
  }
}

std::string TcpStore::get(const std::string& key, double timeout_s) {
  check_key(key);
  timeout_s = std::max(0.0, timeout_s);
  // The server waits for the key; milliseconds in a u32 cover 49 days.
  double ms = std::min(timeout_s * 1000.0, 4.0e9);
  std::string req = "G";
  put_u32(&req, static_cast<uint32_t>(ms));
  put_u32(&req, static_cast<uint32_t>(key.size()));
  req += key;
  std::lock_guard<std::mutex> lock(mu_);
  // Give the server time to answer "timed out" itself before we give up on the connection.
  std::string resp = request(req, deadline_after(timeout_s + std::max(5.0, io_timeout_s_)));
  if (resp[0] == 'V') return resp.substr(1);
  if (resp == "T") {
    throw TransportError("timed out after " + format_seconds(timeout_s) +
                         "s waiting for rendezvous key '" + printable(key) + "' in " + what_);
  }
  throw TransportError("unexpected reply from " + what_ + " to reading key '" + printable(key) +
                       "'");
}

std::string store_local_ip(Store& store) {
  auto* tcp = dynamic_cast<TcpStore*>(&store);
  return tcp ? tcp->local_ip() : std::string();
}

std::unique_ptr<Store> connect_tcp_store(const std::string& host, int port,
                                         const std::string& secret, double timeout_s) {
  if (host.empty() || port <= 0 || port > 65535) {
    throw TransportError("invalid rendezvous store address '" + host + ":" +
                         std::to_string(port) +
                         "' (HOROVOD_GLOO_RENDEZVOUS_ADDR / HOROVOD_GLOO_RENDEZVOUS_PORT)");
  }
  if (secret.empty()) {
    throw TransportError("the job secret is empty (BAGUA_HVD_SECRET must hold the launcher's hex "
                         "secret)");
  }
  const std::string what = "the rendezvous store";
  const std::string where = what + " at " + format_endpoint(host, port);
  Deadline deadline = deadline_after(timeout_s);
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  const std::string info = "pid=" + std::to_string(getpid()) + " host=" + hostname;
  std::string last;
  // The launcher may still be starting: retry connection and I/O failures until the deadline,
  // but not an authentication refusal, which will not change.
  do {
    Fd fd = connect_tcp(host, port, deadline, what);
    try {
      auth_client(fd.get(), secret, store_purpose(), info, deadline, where);
      return std::make_unique<TcpStore>(std::move(fd), host, port, std::max(timeout_s, 30.0));
    } catch (const AuthError& e) {
      throw TransportError(std::string("rendezvous authentication failed: ") + e.what());
    } catch (const TransportError& e) {
      last = e.what();
    }
    usleep(50 * 1000);
  } while (seconds_left(deadline) > 0);
  throw TransportError("could not complete the handshake with " + where + " within " +
                       format_seconds(timeout_s) + "s: " + last);
}

}  // namespace bagua_hvd
