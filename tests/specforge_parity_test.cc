// SpecForge parity: each case in tests/goldens/specforge_dflash holds a
// token batch, anchors, the draft's output states and a frozen lm_head, and
// what SpecForge's own OnlineDFlashModel computed from them in float64
// (tools/specforge_goldens.py; the matched commit is in
// tests/goldens/README.md). The dflash head, configured by the case's
// config.textproto, labels the same batch and must give the same loss,
// terms, per-position metrics and d(loss)/d(hidden), in every execution
// mode and at every chunk size.
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/error_norms.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "tests/specforge_golden.h"
#include "losses/loss_family.h"
#include "proto/config.h"

namespace dflash {
namespace {

constexpr char kGoldens[] = "tests/goldens/specforge_dflash";

// terms.npy, in tools/specforge_goldens.py's TERMS order.
enum Term {
  kCeLossNum,
  kTvLossNum,
  kLossDen,
  kTargetProbabilityNum,
  kCorrectNum,
  kAccuracyDen,
  kLossNum,
  kLoss,
  kAccuracy,
  kTermCount,
};

// position.npy rows and accepted.npy entries.
enum PositionRow {
  kMaskSum,
  kHits,
  kTargetProbability,
  kLossWeight,
  kTopKRecall,
  kTopKMass,
  kTeacherAcceptance,
  kTeacherAgreement,
  kTeacherTopKMass,
  kPositionRows,
};
enum Accepted {
  kBlockDen,
  kOracleNum,
  kExpectedNum,
  kTeacherExpectedNum,
  kAcceptedCount
};

// SpecForge's diagnostics take softmax in float32 (`.float()`), so its
// probability-based metrics, and D-PACE's metric weights, carry float32
// rounding.
constexpr double kFloat32Metric = 2e-6;

struct Golden : SpecForgeBatch {
  std::vector<double> terms, position, accepted;
  std::vector<double> teacher_hidden;  // For the teacher diagnostics.
  // DFlash2 cases: SpecForge's selector terms. Their loss and gradient
  // include the stand-in selector's CE, which runs in the caller's
  // framework (//python:specforge_goldens_test), not in the head.
  std::vector<double> selector;
};

Golden Load(const std::filesystem::path& dir) {
  const std::string d = dir.string();
  Golden g;
  static_cast<SpecForgeBatch&>(g) = LoadSpecForgeBatch(d);
  g.teacher_hidden = ReadGoldenValues(d, "teacher_hidden");
  g.terms = ReadGoldenValues(d, "terms");
  g.position = ReadGoldenValues(d, "position");
  g.accepted = ReadGoldenValues(d, "accepted");
  g.selector = ReadOptionalGoldenValues(d, "selector");
  return g;
}

std::vector<Golden> LoadAll() {
  std::vector<Golden> goldens;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldens)) {
    if (entry.is_directory()) goldens.push_back(Load(entry.path()));
  }
  return goldens;
}

struct HeadRun {
  HeadResult result;
  std::vector<double> grad_hidden;
};

// The golden through the head in T (double or float), its gradient in
// double.
template <typename T>
absl::StatusOr<HeadRun> RunGolden(const Golden& g,
                                  const v1::ObjectiveConfig& config) {
  const int64_t hidden = config.head().hidden_size();
  absl::StatusOr<std::vector<RowMeta>> rows = LabelSpecForgeBatch(g, config);
  if (!rows.ok()) return rows.status();
  const std::vector<T> states(g.hidden.begin(), g.hidden.end());
  const std::vector<T> weight(g.weight.begin(), g.weight.end());
  const std::vector<T> teacher(g.teacher_hidden.begin(),
                               g.teacher_hidden.end());
  std::vector<T> grad(rows->size() * hidden, T(7));  // Must be overwritten.
  const HeadInputs<T> inputs{states,
                             config.head().teacher_diagnostics()
                                 ? absl::MakeConstSpan(teacher)
                                 : absl::Span<const T>(),
                             {},
                             *rows,
                             weight,
                             {}};
  const HeadGradients<T> gradients{absl::MakeSpan(grad), {}, {}, {}};
  TrackingAllocator allocator;
  absl::StatusOr<HeadResult> result =
      RunHead<T>(config, inputs, gradients, allocator);
  if (!result.ok()) return result.status();
  HeadRun run;
  run.result = *std::move(result);
  run.grad_hidden.assign(grad.begin(), grad.end());
  return run;
}

TEST(SpecForgeParityTest, GoldensAreThere) {
  const std::vector<Golden> goldens = LoadAll();
  EXPECT_GE(goldens.size(), 14u);
  for (const Golden& g : goldens) {
    SCOPED_TRACE(g.name);
    EXPECT_EQ(g.terms.size(), static_cast<size_t>(kTermCount));
    EXPECT_EQ(g.grad_hidden.size(), g.hidden.size());
    EXPECT_EQ(
        g.position.size(),
        static_cast<size_t>(kPositionRows * g.config.layout().block_size()));
    EXPECT_EQ(g.accepted.size(), static_cast<size_t>(kAcceptedCount));
  }
}

// Every execution mode, at chunks of one block up to the
// whole batch, with 1 and 2 threads.
TEST(SpecForgeParityTest, EveryModeAndChunkMatchesSpecForge) {
  for (const Golden& g : LoadAll()) {
    ASSERT_EQ(g.terms.size(), static_cast<size_t>(kTermCount)) << g.name;
    const int64_t k = g.config.layout().block_size();
    const int64_t blocks = g.batch * g.num_anchors;
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
          // SpecForge projects the teacher untransformed; the head
          // transforms its teacher logits as its own, so the teacher
          // diagnostics match where there is no transform.
          const bool teacher = !config.head().has_logit_softcap();
          config.mutable_head()->set_teacher_diagnostics(teacher);
          absl::StatusOr<HeadRun> run = RunGolden<double>(g, config);
          ASSERT_TRUE(run.ok()) << run.status();
          const HeadResult& r = run->result;
          const double tol = SpecForgeTolerance(config);
          const bool selector = !g.selector.empty();
          if (!selector) {
            ExpectNear(r.loss, g.terms[kLoss], tol, "loss");
            ExpectNear(r.terms.loss_num, g.terms[kLossNum], tol, "loss_num");
          }
          ExpectNear(r.terms.loss_den, g.terms[kLossDen], tol, "loss_den");
          ExpectNear(r.terms.ce_num, g.terms[kCeLossNum], tol, "ce_loss_num");
          ExpectNear(r.terms.tv_num, g.terms[kTvLossNum], tol, "tv_loss_num");
          ExpectNear(r.terms.correct, g.terms[kCorrectNum], 0, "correct");
          ExpectNear(r.terms.accuracy_den, g.terms[kAccuracyDen], 1e-12,
                     "accuracy_den");
          ExpectNear(r.accuracy, g.terms[kAccuracy], 1e-12, "accuracy");
          ExpectNear(r.terms.target_probability, g.terms[kTargetProbabilityNum],
                     1e-12, "target_probability_num");
          const struct {
            PositionRow row;
            const std::vector<double>& got;
            double tolerance;
            const char* name;
            bool teacher_only;
          } checks[] = {
              {kMaskSum, r.terms.mask_per_position, 1e-12, "mask", false},
              {kHits, r.terms.correct_per_position, 0, "hits", false},
              {kTargetProbability, r.terms.target_probability_per_position,
               kFloat32Metric, "target probability", false},
              {kLossWeight, r.terms.loss_weight_per_position,
               std::max(tol, kFloat32Metric), "loss weight", false},
              {kTopKRecall, r.terms.top_k_recall_per_position, 0,
               "top-k recall", false},
              {kTopKMass, r.terms.top_k_mass_per_position, kFloat32Metric,
               "top-k mass", false},
              {kTeacherAcceptance, r.terms.teacher_acceptance_per_position,
               kFloat32Metric, "teacher acceptance", true},
              {kTeacherAgreement, r.terms.teacher_agreement_per_position, 0,
               "teacher agreement", true},
              {kTeacherTopKMass, r.terms.teacher_top_k_mass_per_position,
               kFloat32Metric, "teacher top-k mass", true},
          };
          for (const auto& check : checks) {
            if (check.teacher_only && !teacher) continue;
            for (int64_t p = 1; p < k; ++p) {
              ExpectNear(check.got[p], g.position[check.row * k + p],
                         check.tolerance,
                         absl::StrCat(check.name, " at position ", p));
            }
          }
          if (teacher) {
            ExpectNear(r.terms.accepted_length.teacher_expected_num,
                       g.accepted[kTeacherExpectedNum], kFloat32Metric,
                       "teacher expected accepted length");
          }
          const AcceptedLengthTerms& accepted = r.terms.accepted_length;
          ExpectNear(accepted.block_den, g.accepted[kBlockDen], 0, "block_den");
          ExpectNear(accepted.oracle_num, g.accepted[kOracleNum], 0,
                     "oracle accepted length");
          ExpectNear(accepted.expected_num, g.accepted[kExpectedNum],
                     kFloat32Metric, "expected accepted length");
          if (!selector) {
            EXPECT_LE(RelativeMaxError<double>(run->grad_hidden, g.grad_hidden),
                      tol)
                << "d(loss)/d(hidden)";
          }
        }
      }
    }
  }
}

// The float32 path against the same goldens: SpecForge computed in float64,
// dflash rounds the inputs to float and computes its rows in float.
TEST(SpecForgeParityTest, Float32MatchesSpecForgeInEveryMode) {
  for (const Golden& g : LoadAll()) {
    ASSERT_EQ(g.terms.size(), static_cast<size_t>(kTermCount)) << g.name;
    for (const char* mode :
         {"fused", "checkpoint", "selective", "save", "materialize"}) {
      SCOPED_TRACE(absl::StrCat(g.name, " ", mode));
      v1::ObjectiveConfig config = g.config;
      ASSERT_TRUE(SetModeByName("mode", mode, config).ok());
      config.mutable_chunking()->set_blocks_per_chunk(2);
      config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
      absl::StatusOr<HeadRun> run = RunGolden<float>(g, config);
      ASSERT_TRUE(run.ok()) << run.status();
      const HeadResult& r = run->result;
      if (!g.selector.empty()) continue;  // Its loss includes the selector.
      ExpectNear(r.loss, g.terms[kLoss], 1e-5, "loss");
      ExpectNear(r.terms.loss_num, g.terms[kLossNum], 1e-5, "loss_num");
      ExpectNear(r.terms.loss_den, g.terms[kLossDen], 1e-5, "loss_den");
      ExpectNear(r.terms.target_probability, g.terms[kTargetProbabilityNum],
                 1e-5, "target_probability_num");
      EXPECT_LE(RelativeMaxError<double>(run->grad_hidden, g.grad_hidden), 1e-5)
          << "d(loss)/d(hidden)";
    }
  }
}

}  // namespace
}  // namespace dflash
