// Asynchronous model averaging's per-implementation state machine (core/async_impl.cc) over a fake
// runtime of one rank: the averagers' names (restarts, the elastic generation), the start at the
// first step, the staged weights copied in, merged rounds reported, abort and resume, and a job's
// end. The averager's rounds themselves are core/async_average.cc's.
#include "core/async_impl.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bagua_hvd {
namespace {

// One rank: every allreduce returns its input; the names it ran are logged.
struct FakeRuntime {
  std::mutex mu;
  std::vector<std::string> names;

  AsyncImpl::Ops ops() {
    AsyncImpl::Ops o;
    o.start = [this](const std::string& name, const AsyncImpl::Step& s,
                     std::shared_ptr<AsyncAverager>* out) {
      std::vector<AsyncAverager::Weights> ws;
      for (int32_t i = 0; i < s.num_tensors; ++i)
        ws.push_back(
            {s.weights[i].data, static_cast<DataType>(s.weights[i].dtype),
             std::vector<int64_t>(s.weights[i].shape, s.weights[i].shape + s.weights[i].ndim)});
      auto run = [this](const bhvd_request& r) {
        const auto& t = r.inputs[0];
        std::memcpy(r.outputs[0].data, t.data, t.shape[0] * dtype_size(DataType(t.dtype)));
        std::lock_guard<std::mutex> lock(mu);
        names.push_back(r.name);
        return Status::OK();
      };
      *out = std::make_shared<AsyncAverager>(run, name, std::move(ws), s.set_id, 1, s.interval_ms);
      return Status::OK();
    };
    o.device_copy = [](int, void*, const void*, size_t, void*) {
      ADD_FAILURE() << "host buffers only";
    };
    return o;
  }
  bool ran(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& n : names)
      if (n == name) return true;
    return false;
  }
};

struct Weights {
  explicit Weights(std::vector<float> v) : x(std::move(v)), n(int64_t(x.size())) {
    desc = {x.data(), BHVD_FLOAT32, 1, &n};
  }
  std::vector<float> x;
  int64_t n;
  bhvd_tensor desc;
};

AsyncImpl::Step step_of(Weights& w, Weights* staged = nullptr) {
  AsyncImpl::Step s;
  s.prefix = "async.fc.weight";
  s.interval_ms = 1;
  s.weights = &w.desc;
  s.staged = staged ? &staged->desc : nullptr;
  s.num_tensors = 1;
  return s;
}

// Steps until a round is merged (rounds every millisecond).
bool step_until_merged(AsyncImpl& impl, const AsyncImpl::Step& s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    bool merged = false;
    EXPECT_TRUE(impl.step(s, &merged).ok());
    if (merged) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(AsyncImpl, NamesFollowTheElasticGenerationAndTheRestarts) {
  unsetenv("BAGUA_HVD_ELASTIC_GENERATION");
  EXPECT_EQ(averager_name("async.fc.bias+1", 2), "async.fc.bias+1.0.2");
  setenv("BAGUA_HVD_ELASTIC_GENERATION", "3", 1);
  EXPECT_EQ(averager_name("async.bagua_tf7", 0), "async.bagua_tf7.3.0");
  setenv("BAGUA_HVD_ELASTIC_GENERATION", " 03 ", 1);  // as Python's int(text.strip())
  EXPECT_EQ(averager_name("async.fc.weight", 1), "async.fc.weight.3.1");
  setenv("BAGUA_HVD_ELASTIC_GENERATION", "x", 1);
  EXPECT_EQ(averager_name("async.fc.weight", 1), "async.fc.weight.0.1");
  unsetenv("BAGUA_HVD_ELASTIC_GENERATION");
}

TEST(AsyncImpl, StartsAtTheFirstStepAndReportsMergedRounds) {
  FakeRuntime rt;
  AsyncImpl impl(rt.ops());
  Weights w({1, 2, 3});
  EXPECT_EQ(impl.state().averager, 0);
  ASSERT_TRUE(step_until_merged(impl, step_of(w)));
  EXPECT_TRUE(rt.ran("async.fc.weight.0.0.go") && rt.ran("async.fc.weight.0.0.w0"));
  const auto st = impl.state();
  EXPECT_NE(st.averager, 0);
  EXPECT_GE(st.rounds, 1);
  EXPECT_EQ(w.x, (std::vector<float>{1, 2, 3}));  // one rank: the average is its own weights
  EXPECT_TRUE(impl.abort().ok());
}

TEST(AsyncImpl, StagedWeightsAreCopiedIntoTheBuffers) {
  FakeRuntime rt;
  AsyncImpl impl(rt.ops());
  Weights w({1, 2, 3}), staged({4, 5, 6});
  bool merged = false;
  ASSERT_TRUE(impl.step(step_of(w), &merged).ok());
  ASSERT_TRUE(impl.step(step_of(w, &staged), &merged).ok());
  EXPECT_EQ(w.x, staged.x);
  Weights small({1});
  EXPECT_FALSE(impl.step(step_of(w, &small), &merged).ok());
  // Other buffers while the averager runs over the first ones: refused.
  Weights other({1, 2, 3});
  EXPECT_EQ(impl.step(step_of(other), &merged).type, StatusType::INVALID_ARGUMENT);
  EXPECT_TRUE(impl.abort().ok());
}

TEST(AsyncImpl, AbortStopsAndResumeStartsTheNextRestart) {
  FakeRuntime rt;
  AsyncImpl impl(rt.ops());
  Weights w({1, 2});
  bool merged = false;
  ASSERT_TRUE(impl.step(step_of(w), &merged).ok());
  const int64_t first = impl.state().averager;
  ASSERT_TRUE(impl.abort().ok());
  EXPECT_EQ(AsyncRegistry::get().find(first), nullptr);  // stopped and released
  auto st = impl.state();
  EXPECT_TRUE(st.aborted);
  EXPECT_EQ(st.averager, 0);
  EXPECT_EQ(st.rounds, 0);
  ASSERT_TRUE(impl.step(step_of(w), &merged).ok());  // nothing while aborted
  EXPECT_EQ(impl.state().averager, 0);
  impl.resume();
  impl.resume();  // not aborted: no further restart
  EXPECT_EQ(impl.state().restarts, 1);
  ASSERT_TRUE(step_until_merged(impl, step_of(w)));
  EXPECT_TRUE(rt.ran("async.fc.weight.0.1.w0"));
  EXPECT_TRUE(impl.abort().ok());
}

TEST(AsyncImpl, AJobsEndForgetsTheAveragerAndTheRestartsButNotTheAbort) {
  FakeRuntime rt;
  AsyncImpl impl(rt.ops()), aborted(rt.ops());
  Weights w({1, 2});
  bool merged = false;
  ASSERT_TRUE(aborted.abort().ok());
  impl.resume();
  ASSERT_TRUE(impl.step(step_of(w), &merged).ok());
  ASSERT_TRUE(impl.abort().ok());
  impl.resume();
  ASSERT_TRUE(impl.step(step_of(w), &merged).ok());
  EXPECT_EQ(impl.state().restarts, 1);
  // The runtime's shutdown: its averagers stop, the implementations forget them.
  AsyncRegistry::get().stop_all(1000);
  impl.end_job();
  aborted.end_job();
  EXPECT_EQ(impl.state().averager, 0);
  EXPECT_EQ(impl.state().restarts, 0);
  EXPECT_TRUE(aborted.state().aborted);
  ASSERT_TRUE(step_until_merged(impl, step_of(w)));  // the new job's first averager
  EXPECT_TRUE(rt.ran("async.fc.weight.0.0.w0"));
  EXPECT_TRUE(impl.abort().ok());
}

}  // namespace
}  // namespace bagua_hvd
