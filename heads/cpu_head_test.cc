// RunHead inside a host process: a run stops when its caller's interrupt is
// set, and runs on the threads head.threads names, bounded by the CPUs.
#include "heads/cpu_head.h"

#include <atomic>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/threads.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/synthetic_batch.h"
#include "proto/config.h"

namespace dflash {
namespace {

v1::ObjectiveConfig Config(const std::string& mode, int threads) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      absl::StrCat("layout { block_size: 4 num_anchors: 8 } head { "
                   "vocab_size: 97 hidden_size: 16 mode: ",
                   mode, " threads: ", threads,
                   " } chunking { blocks_per_chunk: 2 } loss { dflash { "
                   "gamma: 7 } }"),
      "test");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

struct HeadRunOutput {
  absl::StatusOr<HeadResult> result;
  std::vector<float> grad;
};

HeadRunOutput RunWith(const v1::ObjectiveConfig& config, const HeadBatch<float>& batch,
            const HeadOptions& options) {
  HeadRunOutput run;
  run.grad.assign(batch.hidden.size(), 0);
  TrackingAllocator allocator;
  run.result = RunHead<float>(config, batch.Inputs(config),
                              {absl::MakeSpan(run.grad)}, allocator, {},
                              options);
  return run;
}

// Set before the run, or by the progress callback after its first chunk
// step: Cancelled, in every mode; the next run is whole and equal to one
// never interrupted.
TEST(CpuHeadTest, AnInterruptStopsTheRun) {
  for (const char* mode : {"FUSED", "CHECKPOINT", "SAVE_CHUNKS"}) {
    SCOPED_TRACE(mode);
    const v1::ObjectiveConfig config = Config(mode, 1);
    absl::StatusOr<HeadBatch<float>> batch =
        MakeSyntheticBatch<float>(config, {2, 64, 8}, 5);
    ASSERT_TRUE(batch.ok()) << batch.status();
    const HeadRunOutput whole = RunWith(config, *batch, {});
    ASSERT_TRUE(whole.result.ok()) << whole.result.status();
    ASSERT_GT(whole.result->stats.chunks, 2);

    std::atomic<bool> interrupt{true};
    HeadOptions options;
    options.interrupt = &interrupt;
    EXPECT_EQ(RunWith(config, *batch, options).result.status(),
              absl::CancelledError("the head run was interrupted"));

    interrupt = false;
    int64_t steps_seen = 0;
    options.progress = [&](int64_t done, int64_t) {
      steps_seen = done;
      interrupt = true;
    };
    EXPECT_EQ(RunWith(config, *batch, options).result.status().code(),
              absl::StatusCode::kCancelled);
    EXPECT_EQ(steps_seen, 1);

    interrupt = false;
    options.progress = nullptr;
    const HeadRunOutput again = RunWith(config, *batch, options);
    ASSERT_TRUE(again.result.ok()) << again.result.status();
    EXPECT_EQ(again.result->loss, whole.result->loss);
    EXPECT_EQ(again.grad, whole.grad);
  }
}

// More threads than CPUs run on the CPUs; beyond kMaxThreads the config is
// refused; the result does not depend on the count.
TEST(CpuHeadTest, ThreadsAreBoundedByTheCpus) {
  const v1::ObjectiveConfig one = Config("FUSED", 1);
  absl::StatusOr<HeadBatch<float>> batch =
      MakeSyntheticBatch<float>(one, {2, 64, 8}, 6);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const HeadRunOutput single = RunWith(one, *batch, {});
  ASSERT_TRUE(single.result.ok()) << single.result.status();
  EXPECT_EQ(single.result->stats.threads, 1);
  for (int threads : {0, 64, kMaxThreads}) {
    const HeadRunOutput many = RunWith(Config("FUSED", threads), *batch, {});
    ASSERT_TRUE(many.result.ok()) << many.result.status();
    EXPECT_EQ(many.result->stats.threads, UsableCpus());
    EXPECT_NEAR(many.result->loss, single.result->loss,
                1e-12 * single.result->loss);
  }
  EXPECT_EQ(LoadObjectiveConfigFromString(
                "head { vocab_size: 97 hidden_size: 16 threads: 100000 } "
                "loss { dflash {} }",
                "test")
                .status()
                .message(),
            "test: invalid config:\nhead.threads: must lie in [0, 1024], got "
            "100000");
}

}  // namespace
}  // namespace dflash
