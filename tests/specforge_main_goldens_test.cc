// SpecForge main's objective against the head: each case in
// tests/goldens/specforge_main holds a batch of draft states, targets (some
// -100 with weight) and weight masks, a frozen lm_head, and what SpecForge
// main's own OnlineDFlashModel objective computed from them in float64
// (tools/specforge_main_goldens.py; the matched version is in the
// directory's README.md): the sequence-balanced D-PACE denominator and
// SpecForge's counting of ignored targets. The head, configured by the
// case's config.textproto, must give the same terms, loss and d(loss)/
// d(hidden) in every execution mode and at every chunk size.
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/error_norms.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "io/npy.h"
#include "proto/config.h"
#include "tests/specforge_golden.h"

namespace dflash {
namespace {

constexpr char kGoldens[] = "tests/goldens/specforge_main";

// terms.npy, in tools/specforge_main_goldens.py's TERMS order.
enum Term {
  kCeLossNum,
  kTvLossNum,
  kLossDen,
  kTargetProbabilityNum,
  kCorrectNum,
  kAccuracyDen,
  kLossNum,
  kLoss,
  kTermCount,
};

struct Golden {
  std::string name;
  v1::ObjectiveConfig config;
  std::vector<RowMeta> rows;
  std::vector<double> hidden, weight, terms, grad_hidden;
};

Golden Load(const std::filesystem::path& dir) {
  const std::string d = dir.string();
  Golden g;
  g.name = dir.filename().string();
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromFile(d + "/config.textproto");
  EXPECT_TRUE(config.ok()) << config.status();
  if (config.ok()) g.config = *config;
  absl::StatusOr<NpyArray> ids = ReadNpy(d + "/target_ids.npy");
  EXPECT_TRUE(ids.ok()) << ids.status();
  const std::vector<int64_t> targets =
      ids.ok() ? NpyToInt64(*ids) : std::vector<int64_t>();
  const std::vector<double> mask = ReadGoldenValues(d, "weight_mask");
  const int64_t k = g.config.layout().block_size();
  EXPECT_EQ(targets.size(), mask.size());
  for (size_t r = 0; r < targets.size() && r < mask.size(); ++r) {
    RowMeta meta;
    meta.target = static_cast<int32_t>(targets[r]);
    meta.position = static_cast<int32_t>(r % k);
    meta.mask = static_cast<float>(mask[r]);
    meta.block = static_cast<int64_t>(r) / k;
    g.rows.push_back(meta);
  }
  g.hidden = ReadGoldenValues(d, "hidden");
  g.weight = ReadGoldenValues(d, "weight");
  g.terms = ReadGoldenValues(d, "terms");
  g.grad_hidden = ReadGoldenValues(d, "grad_hidden");
  return g;
}

std::vector<Golden> LoadAll() {
  std::vector<Golden> goldens;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldens)) {
    if (entry.is_directory()) goldens.push_back(Load(entry.path()));
  }
  return goldens;
}

TEST(SpecForgeMainGoldensTest, GoldensAreThere) {
  const std::vector<Golden> goldens = LoadAll();
  EXPECT_GE(goldens.size(), 8u);
  for (const Golden& g : goldens) {
    SCOPED_TRACE(g.name);
    EXPECT_EQ(g.terms.size(), static_cast<size_t>(kTermCount));
    EXPECT_EQ(g.grad_hidden.size(), g.hidden.size());
    EXPECT_EQ(g.hidden.size(),
              g.rows.size() * g.config.head().hidden_size());
  }
}

// Every execution mode, at chunks of one block up to the whole batch, on
// one and two threads: SpecForge's terms within float64 round-off.
TEST(SpecForgeMainGoldensTest, HeadMatchesSpecForgeMainInFloat64) {
  for (const Golden& g : LoadAll()) {
    ASSERT_EQ(g.terms.size(), static_cast<size_t>(kTermCount)) << g.name;
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
          const auto near = [](double got, double want) {
            return std::abs(got - want) <=
                   1e-12 * std::max(1.0, std::abs(want));
          };
          EXPECT_PRED2(near, result->loss, g.terms[kLoss]);
          EXPECT_PRED2(near, t.loss_num, g.terms[kLossNum]);
          EXPECT_PRED2(near, t.loss_den, g.terms[kLossDen]);
          EXPECT_PRED2(near, t.ce_num, g.terms[kCeLossNum]);
          EXPECT_PRED2(near, t.tv_num, g.terms[kTvLossNum]);
          EXPECT_PRED2(near, t.target_probability,
                       g.terms[kTargetProbabilityNum]);
          EXPECT_EQ(t.correct, g.terms[kCorrectNum]);
          EXPECT_EQ(t.accuracy_den, g.terms[kAccuracyDen]);
          EXPECT_LT(RelativeL2Error<double>(grad, g.grad_hidden), 1e-12);
        }
      }
    }
  }
}

}  // namespace
}  // namespace dflash
