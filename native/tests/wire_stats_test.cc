// Bytes on the wire per op type (base/wire_stats.h): the scopes, and Comm::run's counting over
// 2 hosts x 2 in-process ranks (shared memory within a host, TCP between).
#include "base/wire_stats.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "in_process_ranks.h"

namespace bagua_hvd {
namespace {

using testing_ranks::Kind;
using testing_ranks::run_ranks;

TEST(WireStats, ScopesCountPerOpTypeAndNest) {
  reset_wire_stats();
  count_bytes_sent(true, 5);  // no scope open: "other"
  {
    WireOpScope outer(BHVD_OP_ALLGATHER);
    count_bytes_sent(false, 10);
    {
      WireOpScope inner(BHVD_OP_COMPRESSED_ALLREDUCE);
      count_bytes_sent(true, 7);
      count_bytes_sent(true, 0);
    }
    const WireCounts in = take_last_scope_bytes();
    EXPECT_EQ(in.calls, 1);
    EXPECT_EQ(in.within_host, 0);
    EXPECT_EQ(in.between_hosts, 7);
    count_bytes_sent(false, 1);  // the outer scope again
  }
  const WireCounts out = take_last_scope_bytes();
  EXPECT_EQ(out.within_host, 11);
  EXPECT_EQ(out.between_hosts, 0);
  EXPECT_EQ(take_last_scope_bytes().calls, 0);  // read once
  { WireOpScope bogus(1000); }                  // not an op type: "other"

  const WireCounts ag = wire_counts(BHVD_OP_ALLGATHER);
  EXPECT_EQ(ag.calls, 1);
  EXPECT_EQ(ag.within_host, 11);
  EXPECT_EQ(ag.between_hosts, 0);
  const WireCounts ca = wire_counts(BHVD_OP_COMPRESSED_ALLREDUCE);
  EXPECT_EQ(ca.calls, 1);
  EXPECT_EQ(ca.between_hosts, 7);
  const WireCounts other = wire_counts(kWireOther);
  EXPECT_EQ(other.calls, 1);
  EXPECT_EQ(other.between_hosts, 5);
  EXPECT_EQ(wire_bytes_sent(false), 23);
  EXPECT_EQ(wire_bytes_sent(true), 12);

  EXPECT_STREQ(wire_slot_name(BHVD_OP_ALLREDUCE), "allreduce");
  EXPECT_STREQ(wire_slot_name(BHVD_OP_ADASUM), "adasum");
  EXPECT_STREQ(wire_slot_name(BHVD_OP_COMPRESSED_ALLREDUCE), "compressed_allreduce");
  EXPECT_STREQ(wire_slot_name(BHVD_OP_LP_DECENTRALIZED_EXCHANGE), "lp_decentralized_exchange");
  EXPECT_STREQ(wire_slot_name(kWireOther), "other");

  reset_wire_stats();
  for (int s = 0; s < kWireSlots; ++s) {
    const WireCounts c = wire_counts(s);
    EXPECT_EQ(c.calls + c.within_host + c.between_hosts, 0) << wire_slot_name(s);
  }
}

TEST(WireStats, CommRunCountsSendsByHost) {
  // Every rank sends 1000 bytes to each other rank (and to itself, which is not counted) under
  // ALLTOALL: of the 3 peers, 1 is on its host and 2 on the other.
  reset_wire_stats();
  constexpr size_t kBytes = 1000;
  run_ranks(
      4, Kind::SHM,
      [&](Comm& comm) {
        WireOpScope scope(BHVD_OP_ALLTOALL);
        const int n = comm.size();
        std::vector<unsigned char> out(kBytes * n, static_cast<unsigned char>(comm.rank()));
        std::vector<unsigned char> in(kBytes * n);
        std::vector<Comm::Xfer> x;
        for (int p = 0; p < n; ++p) {
          x.push_back({Comm::Xfer::SEND, p, out.data() + p * kBytes, kBytes});
          x.push_back({Comm::Xfer::RECV, p, in.data() + p * kBytes, kBytes});
        }
        comm.run(x, "wire stats test");
        for (int p = 0; p < n; ++p) EXPECT_EQ(in[p * kBytes], p);
      },
      0, 2);
  const WireCounts c = wire_counts(BHVD_OP_ALLTOALL);
  EXPECT_EQ(c.calls, 4);
  EXPECT_EQ(c.within_host, static_cast<int64_t>(4 * 1 * kBytes));
  EXPECT_EQ(c.between_hosts, static_cast<int64_t>(4 * 2 * kBytes));
  EXPECT_EQ(wire_bytes_sent(false), static_cast<int64_t>(4 * 3 * kBytes));
}

}  // namespace
}  // namespace bagua_hvd
