#include "heads/gradient_filter.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "heads/synthetic_batch.h"
#include "proto/config.h"

namespace dflash {
namespace {

TEST(GradientFilterTest, KeepsTilesWithAnEntryAtTheCut) {
  // 2 rows, vocabulary 10 in tiles of 3: [0,3) [3,6) [6,9) [9,10).
  const std::vector<double> grad = {
      1.0, 0.0, 0.0, 0.05, 0.0,  0.0, 0.0, 0.0, 0.0, 0.0,   // Row max 1.
      0.0, 0.0, 0.0, 0.0,  0.0, -0.2, 0.0, 0.0, 0.0, 0.02,  // Row max 0.2.
  };
  int64_t skipped = -1;
  std::vector<VocabRange> kept =
      KeptVocabRanges(grad.data(), 2, 10, 0.1, 3, skipped);
  // Tile 1 holds row 1's maximum; tile 0 row 0's; 0.05 < 0.1 * 1 and
  // 0.02 < 0.1 * 0.2 do not count.
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].begin, 0);
  EXPECT_EQ(kept[0].end, 6);
  EXPECT_EQ(skipped, 2);
  kept = KeptVocabRanges(grad.data(), 2, 10, 0.0, 3, skipped);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].end, 10);
  EXPECT_EQ(skipped, 0);
  const std::vector<float> none(20, 0.0f);
  EXPECT_TRUE(KeptVocabRanges(none.data(), 2, 10, 0.5, 3, skipped).empty());
  EXPECT_EQ(skipped, 4);
}

struct FilteredRun {
  HeadResult result;
  std::vector<float> grad;
};

FilteredRun RunOnce(const v1::ObjectiveConfig& config,
                const HeadBatch<float>& batch) {
  FilteredRun run;
  run.grad.assign(batch.hidden.size(), 0);
  TrackingAllocator allocator;
  absl::StatusOr<HeadResult> result = RunHead<float>(
      config, batch.Inputs(config), {absl::MakeSpan(run.grad)}, allocator);
  EXPECT_TRUE(result.ok()) << result.status();
  if (result.ok()) run.result = *std::move(result);
  return run;
}

// The filtered gradient against the exact one, in every mode: each skipped
// entry is below threshold x its row's largest, and the largest is at most
// the row's share w / loss_den (softmax gradients lie in [-1, 1] times the
// logit scale), so a row's error is at most threshold * scale / loss_den *
// sum_v max_h |W[v, h]|. On a peaked batch (heads/synthetic_batch.h) most
// tiles go.
TEST(GradientFilterTest, ErrorStaysWithinItsBoundInEveryMode) {
  constexpr int64_t kV = 8192, kH = 32;
  constexpr double kScale = 2, kThreshold = 1e-2;
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      absl::StrCat("layout { block_size: 8 num_anchors: 8 } head { "
                   "vocab_size: ",
                   kV, " hidden_size: ", kH, " logit_scale: ", kScale,
                   " bias: true } chunking { blocks_per_chunk: 3 } loss { "
                   "dflash { "
                   "gamma: 7 } }"),
      "test");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<HeadBatch<float>> batch =
      MakeSyntheticBatch<float>(*config, {2, 256, 8, /*peaked=*/true}, 4);
  ASSERT_TRUE(batch.ok()) << batch.status();
  double weight_sum = 0;
  for (int64_t v = 0; v < kV; ++v) {
    double largest = 0;
    for (int64_t h = 0; h < kH; ++h) {
      largest = std::max<double>(largest, std::abs(batch->weight[v * kH + h]));
    }
    weight_sum += largest;
  }
  for (const char* mode : {"fused", "checkpoint", "save"}) {
    SCOPED_TRACE(mode);
    v1::ObjectiveConfig exact = *config;
    ASSERT_TRUE(SetModeByName("mode", mode, exact).ok());
    v1::ObjectiveConfig filtered = exact;
    filtered.mutable_head()->set_gradient_filter(kThreshold);
    const FilteredRun want = RunOnce(exact, *batch);
    const FilteredRun got = RunOnce(filtered, *batch);
    EXPECT_EQ(got.result.loss, want.result.loss);
    const HeadStats& s = got.result.stats;
    EXPECT_EQ(s.filter_tiles, s.chunks * kV / kGradientFilterTile);
    EXPECT_GT(s.filter_skipped_tiles, s.filter_tiles / 2);
    EXPECT_LT(s.gemm_passes, want.result.stats.gemm_passes);
    const double bound =
        kThreshold * kScale / want.result.terms.loss_den * weight_sum;
    double worst = 0;
    bool differs = false;
    for (size_t i = 0; i < want.grad.size(); ++i) {
      worst = std::max<double>(worst, std::abs(got.grad[i] - want.grad[i]));
      differs = differs || got.grad[i] != want.grad[i];
    }
    EXPECT_LE(worst, bound);
    EXPECT_TRUE(differs);  // Something was skipped that mattered a little.
  }
  // A threshold of 0 is the exact path.
  v1::ObjectiveConfig zero = *config;
  zero.mutable_head()->set_gradient_filter(0);
  const FilteredRun a = RunOnce(zero, *batch), b = RunOnce(*config, *batch);
  EXPECT_EQ(a.grad, b.grad);
  EXPECT_EQ(a.result.stats.filter_tiles, 0);
}

}  // namespace
}  // namespace dflash
