// BAGUA's primitives of a stream engine: the phased forms over its backend
// (engines/stream_engine.h).
#include "engines/stream_engine.h"

namespace bagua_hvd {

void StreamEngine::allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype,
                                          bool average, void* ef_worker, void* ef_server) {
  allreduce_minmax_uint8_phased(*backend(comm), buf, count, dtype, average, ef_worker, ef_server);
}

void StreamEngine::decentralized_average(Comm& comm, const void* in, void* out, size_t count,
                                         DataType dtype, PeerMode mode, int64_t step) {
  decentralized_average_phased(*backend(comm), in, out, count, dtype, mode, step);
}

void StreamEngine::lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right,
                                    size_t count, DataType dtype) {
  lp_decentralized_phased(*backend(comm), x, self, left, right, count, dtype);
}

void StreamEngine::lp_decentralized_init(Comm& comm, const void* x, void* self, void* left,
                                         void* right, size_t count, DataType dtype) {
  lp_decentralized_init_phased(*backend(comm), x, self, left, right, count, dtype);
}

void StreamEngine::lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                                             size_t count, DataType dtype) {
  lp_decentralized_exchange_phased(*backend(comm), c, left, right, count, dtype);
}

}  // namespace bagua_hvd
