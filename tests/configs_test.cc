// Every config shipped in configs/ loads, validates, plans, and runs its own
// policy (chunking, checkpoint, mode, loss) on the suite's small batch in
// float64, matching the naive reference within the measured peak bound.
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "heads/head_plan.h"
#include "proto/config.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using namespace head_test;  // NOLINT: the suite's shared vocabulary.

std::vector<std::string> ShippedConfigs() {
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator("configs")) {
    if (entry.path().extension() == ".textproto") {
      paths.push_back(entry.path().string());
    }
  }
  return paths;
}

TEST(ConfigsTest, EveryShippedConfigRunsAndMatchesTheReference) {
  const std::vector<std::string> paths = ShippedConfigs();
  ASSERT_GE(paths.size(), 4u);
  const Batch b = MakeBatch(11);
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    absl::StatusOr<v1::ObjectiveConfig> loaded =
        LoadObjectiveConfigFromFile(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    // The shipped policy on the batch's shapes, in float64.
    v1::ObjectiveConfig config = *loaded;
    config.mutable_layout()->set_block_size(kK);
    config.mutable_layout()->set_num_anchors(b.anchors);
    v1::HeadConfig& head = *config.mutable_head();
    head.set_vocab_size(kV);
    head.set_hidden_size(kH);
    head.set_dtype(v1::HeadConfig::FLOAT64);
    head.set_threads(1);
    head.set_bias(false);
    ASSERT_TRUE(ValidateObjectiveConfig(config).ok())
        << ValidateObjectiveConfig(config);

    absl::StatusOr<int64_t> bound = PredictPeakBytes(config, b.rows, 8);
    ASSERT_TRUE(bound.ok()) << bound.status();
    const bool teacher = LossNeedsTeacher(config.loss());
    const bool confidence = config.loss().has_dspark() &&
                            config.loss().dspark().confidence_weight() > 0;
    std::vector<double> grad_hidden(b.num_rows() * kH, 7), none;
    std::vector<double> grad_confidence(confidence ? b.num_rows() : 0, 7);
    const HeadInputs<double> inputs{
        b.hidden,
        teacher ? absl::MakeConstSpan(b.teacher) : absl::Span<const double>(),
        confidence ? absl::MakeConstSpan(b.confidence)
                   : absl::Span<const double>(),
        b.rows,
        b.weight,
        {}};
    TrackingAllocator allocator;
    absl::StatusOr<HeadResult> run = RunHead<double>(
        config, inputs,
        {absl::MakeSpan(grad_hidden), absl::MakeSpan(none),
         absl::MakeSpan(none), absl::MakeSpan(grad_confidence)},
        allocator);
    ASSERT_TRUE(run.ok()) << run.status();

    const Reference ref = Naive(config, b);
    ASSERT_GT(ref.terms.loss_den, 0);
    EXPECT_NEAR(run->loss, ref.loss, 1e-10 * std::abs(ref.loss));
    EXPECT_LT(RelativeError(grad_hidden, ref.grad_hidden), 1e-10);
    EXPECT_EQ(run->terms.correct, ref.terms.correct);
    EXPECT_LE(run->stats.peak_bytes, *bound);
    EXPECT_EQ(run->mode, loaded->head().mode());
  }
}

}  // namespace
}  // namespace dflash
