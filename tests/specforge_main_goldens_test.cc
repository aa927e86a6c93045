// SpecForge main's objective against the head: each case in
// tests/goldens/specforge_main holds a batch of draft states, targets (some
// -100 with weight) and weight masks, a frozen lm_head, and what SpecForge
// main's own OnlineDFlashModel objective computed from them in float64
// (tools/specforge_main_goldens.py; the matched version is in the
// directory's README.md): the sequence-balanced D-PACE denominator and
// SpecForge's counting of ignored targets. The head, configured by the
// case's config.textproto, must give the same terms, loss and d(loss)/
// d(hidden) in every execution mode and at every chunk size.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/error_norms.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "proto/config.h"
#include "tests/specforge_golden.h"

namespace dflash {
namespace {

using Golden = SpecForgeMainGolden;
constexpr char kGoldens[] = "tests/goldens/specforge_main";
// SpecForge's diagnostics take softmax in float32 (`.float()`), so its
// metric loss weights carry float32 rounding.
constexpr double kFloat32Metric = 2e-6;

TEST(SpecForgeMainGoldensTest, GoldensAreThere) {
  const std::vector<Golden> goldens = LoadSpecForgeMainGoldens(kGoldens);
  EXPECT_GE(goldens.size(), 8u);
  for (const Golden& g : goldens) {
    SCOPED_TRACE(g.name);
    EXPECT_EQ(g.terms.size(), static_cast<size_t>(Golden::kTermCount));
    EXPECT_EQ(g.grad_hidden.size(), g.hidden.size());
    EXPECT_EQ(g.hidden.size(),
              g.rows.size() * g.config.head().hidden_size());
    if (!g.loss_weight.empty()) {
      EXPECT_EQ(g.loss_weight.size(),
                static_cast<size_t>(g.config.layout().block_size()));
    }
  }
}

// Every execution mode, at chunks of one block up to the whole batch, on
// one and two threads: SpecForge's terms within float64 round-off, and its
// per-position loss weights (the sequence shares in them) within float32's.
TEST(SpecForgeMainGoldensTest, HeadMatchesSpecForgeMainInFloat64) {
  for (const Golden& g : LoadSpecForgeMainGoldens(kGoldens)) {
    ASSERT_EQ(g.terms.size(), static_cast<size_t>(Golden::kTermCount))
        << g.name;
    const int64_t blocks =
        static_cast<int64_t>(g.rows.size()) / g.config.layout().block_size();
    for (const char* mode :
         {"fused", "checkpoint", "selective", "save", "materialize"}) {
      for (int64_t per_chunk : {int64_t{1}, int64_t{2}, blocks}) {
        for (int threads : {1, 2}) {
          SCOPED_TRACE(absl::StrCat(g.name, " ", mode, " blocks_per_chunk ",
                                    per_chunk, " threads ", threads));
          v1::ObjectiveConfig config = g.config;
          ASSERT_TRUE(SetModeByName("mode", mode, config).ok());
          config.mutable_chunking()->set_blocks_per_chunk(per_chunk);
          config.mutable_head()->set_threads(threads);
          std::vector<double> grad(g.hidden.size(), 7.0);
          const HeadInputs<double> inputs{g.hidden, {}, {}, g.rows, g.weight,
                                          {}};
          const HeadGradients<double> gradients{absl::MakeSpan(grad), {}, {},
                                                {}};
          TrackingAllocator allocator;
          absl::StatusOr<HeadResult> result =
              RunHead<double>(config, inputs, gradients, allocator);
          ASSERT_TRUE(result.ok()) << result.status();
          const ChunkTerms& t = result->terms;
          ExpectNear(result->loss, g.terms[Golden::kLoss], 1e-12, "loss");
          ExpectNear(t.loss_num, g.terms[Golden::kLossNum], 1e-12,
                     "loss_num");
          ExpectNear(t.loss_den, g.terms[Golden::kLossDen], 1e-12,
                     "loss_den");
          ExpectNear(t.ce_num, g.terms[Golden::kCeLossNum], 1e-12, "ce_num");
          ExpectNear(t.tv_num, g.terms[Golden::kTvLossNum], 1e-12, "tv_num");
          ExpectNear(t.target_probability,
                     g.terms[Golden::kTargetProbabilityNum], 1e-12,
                     "target_probability");
          EXPECT_EQ(t.correct, g.terms[Golden::kCorrectNum]);
          EXPECT_EQ(t.accuracy_den, g.terms[Golden::kAccuracyDen]);
          EXPECT_LT(RelativeL2Error<double>(grad, g.grad_hidden), 1e-12);
          // SpecForge's metric takes its probabilities in float32.
          for (size_t k = 0; k < g.loss_weight.size(); ++k) {
            ExpectNear(t.loss_weight_per_position[k], g.loss_weight[k],
                       kFloat32Metric, absl::StrCat("loss_weight[", k, "]"));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace dflash
