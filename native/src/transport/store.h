// TCP client of the launcher's rendezvous store (bagua_hvd/rendezvous/store.py). Wire format:
// docs/protocol.md.
#pragma once

#include <mutex>
#include <string>

#include "transport/socket.h"
#include "transport/transport.h"

namespace bagua_hvd {

constexpr size_t kMaxStoreFrame = (16u << 20) + 64;  // the server's default frame limit
constexpr size_t kMaxStoreKey = 4096;

class TcpStore : public Store {
 public:
  TcpStore(Fd fd, std::string host, int port, double io_timeout_s);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_s) override;
  // The local address of the store connection: the address other hosts can reach us at (works
  // across network namespaces, unlike the hostname).
  const std::string& local_ip() const { return local_ip_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  std::string request(const std::string& req, Deadline deadline);
  std::mutex mu_;  // one request at a time on the connection
  Fd fd_;
  std::string endpoint_, what_, local_ip_, broken_;
  double io_timeout_s_;
};

// The local IP of a TcpStore's connection, or "" for other Store implementations.
std::string store_local_ip(Store& store);

}  // namespace bagua_hvd
