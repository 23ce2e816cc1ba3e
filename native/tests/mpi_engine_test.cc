// The MPI data engine's attachment (engines/mpi_library.cc, engines/mpi_engine.cc) in a process
// without MPI: no engine, and the reason hvd.init() gives. The collectives themselves run in jobs
// that mpirun starts (tests/test_mpi_ops.py, Open MPI and MPICH).
#include <gtest/gtest.h>

#include <string>

#include "bagua_hvd/c_api.h"
#include "engines/data_engine.h"
#include "engines/mpi_library.h"

namespace bagua_hvd {
namespace {

TEST(MpiEngine, NoMpiInTheProcessMeansNoEngineAndSaysSo) {
  std::string why;
  EXPECT_EQ(MpiLibrary::attach(&why), nullptr);
  EXPECT_EQ(why, "no MPI library is loaded in this process");
  MpiFacts facts;
  std::string error;
  EXPECT_EQ(make_mpi_engine(0, 2, &facts, &error), nullptr);
  EXPECT_EQ(error, "no MPI library is loaded in this process");
}

TEST(MpiEngine, NotEnabledBeforeInit) {
  EXPECT_EQ(bhvd_mpi_enabled(), 0);
  EXPECT_EQ(bhvd_mpi_threads_supported(), -1);
  EXPECT_EQ(bhvd_stat("mpi_calls"), 0);
}

}  // namespace
}  // namespace bagua_hvd
