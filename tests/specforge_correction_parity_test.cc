// SpecForge parity for the objectives that train a logit correction on the
// frozen head: each case in tests/goldens/specforge_dspark (OnlineDSparkModel
// with a Markov head of each kind, a confidence head, D-PARD) and
// tests/goldens/specforge_domino (OnlineDominoModel) holds a token batch,
// anchors, the draft's output states, the frozen lm_head, the correction's
// inputs z and weight M (captured at SpecForge's markov_w2 / embed_proj[2]),
// and what SpecForge computed from them in float64
// (tools/specforge_dspark_goldens.py). The head, configured by the case's
// config.textproto, labels the same batch and must give the same loss,
// terms, and gradients for hidden (through the lm_head), z, M and the
// confidence logits, in every execution mode and at every chunk size.
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

constexpr char kDSparkGoldens[] = "tests/goldens/specforge_dspark";
constexpr char kDominoGoldens[] = "tests/goldens/specforge_domino";

// DSpark's terms.npy: SpecForge's 12 scalar chunk terms, then local_loss_den,
// loss and accuracy.
enum DSparkTerm {
  kCeNum,
  kL1Num,
  kConfidenceNum,
  kConfidenceErrorNum,
  kCorrectNum,
  kEvalDen,
  kTeacherAgreementNum,
  kTeacherTop1Num,
  kDraftTop1Num,
  kTauNum,
  kTauDen,
  kDPardLossNum,
  kLocalLossDen,
  kDSparkLoss,
  kDSparkAccuracy,
  kDSparkTerms,
};
// DSpark's position.npy rows.
enum DSparkPosition {
  kCePosition,
  kCorrectPosition,
  kPositionDen,
  kDPardCreditPosition,
  kDSparkPositionRows,
};
// Domino's terms.npy: its 9 chunk terms, then loss and accuracy.
enum DominoTerm {
  kFinalNum,
  kBaseNum,
  kLossDen,
  kDominoCorrectNum,
  kBaseCorrectNum,
  kAccuracyDen,
  kAcceptNum,
  kBaseAcceptNum,
  kAcceptDen,
  kDominoLoss,
  kDominoAccuracy,
  kDominoTerms,
};

struct Golden : SpecForgeBatch {
  bool domino = false;
  std::vector<double> teacher_hidden;
  std::vector<double> z, correction_weight, grad_z, grad_correction_weight;
  std::vector<double> confidence, grad_confidence;
  std::vector<double> terms, position;
};

Golden Load(const std::filesystem::path& dir, bool domino) {
  const std::string d = dir.string();
  Golden g;
  static_cast<SpecForgeBatch&>(g) = LoadSpecForgeBatch(d);
  g.domino = domino;
  g.teacher_hidden = ReadOptionalGoldenValues(d, "teacher_hidden");
  g.z = ReadOptionalGoldenValues(d, "correction_inputs");
  g.correction_weight = ReadOptionalGoldenValues(d, "correction_weight");
  g.grad_z = ReadOptionalGoldenValues(d, "grad_correction_inputs");
  g.grad_correction_weight =
      ReadOptionalGoldenValues(d, "grad_correction_weight");
  g.confidence = ReadOptionalGoldenValues(d, "confidence_logits");
  g.grad_confidence = ReadOptionalGoldenValues(d, "grad_confidence_logits");
  g.terms = ReadGoldenValues(d, "terms");
  if (!domino) g.position = ReadGoldenValues(d, "position");
  return g;
}

std::vector<Golden> LoadAll() {
  std::vector<Golden> goldens;
  for (const auto& [root, domino] :
       {std::pair<const char*, bool>{kDSparkGoldens, false},
        {kDominoGoldens, true}}) {
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      if (entry.is_directory()) goldens.push_back(Load(entry.path(), domino));
    }
  }
  return goldens;
}

struct CaseRun {
  HeadResult result;
  std::vector<double> grad_hidden, grad_z, grad_correction_weight;
  std::vector<double> grad_confidence;
};

template <typename T>
std::vector<T> As(const std::vector<double>& values) {
  return std::vector<T>(values.begin(), values.end());
}

template <typename T>
absl::StatusOr<CaseRun> RunGolden(const Golden& g,
                              const v1::ObjectiveConfig& config) {
  const int64_t vocab = config.head().vocab_size();
  const int64_t hidden = config.head().hidden_size();
  const int64_t rank = config.head().correction_rank();
  absl::StatusOr<std::vector<RowMeta>> rows = LabelSpecForgeBatch(g, config);
  if (!rows.ok()) return rows.status();
  const int64_t n = static_cast<int64_t>(rows->size());
  const std::vector<T> states = As<T>(g.hidden), weight = As<T>(g.weight),
                       teacher = As<T>(g.teacher_hidden), z = As<T>(g.z),
                       m = As<T>(g.correction_weight);
  // ConfidenceOf<T>: the golden's float64 logits as they are for a float64
  // head.
  const std::vector<ConfidenceOf<T>> confidence =
      As<ConfidenceOf<T>>(g.confidence);
  // Filled with a value the head must overwrite.
  std::vector<T> grad(n * hidden, T(7)), grad_z(n * rank, T(7)),
      grad_m(vocab * rank, T(7));
  std::vector<ConfidenceOf<T>> grad_confidence(confidence.size(), 7);
  const HeadInputs<T> inputs{states, teacher,   confidence, *rows,
                             weight, {},        z,          m};
  const HeadGradients<T> gradients{absl::MakeSpan(grad),
                                   {},
                                   {},
                                   absl::MakeSpan(grad_confidence),
                                   absl::MakeSpan(grad_z),
                                   absl::MakeSpan(grad_m)};
  TrackingAllocator allocator;
  absl::StatusOr<HeadResult> result =
      RunHead<T>(config, inputs, gradients, allocator);
  if (!result.ok()) return result.status();
  CaseRun run;
  run.result = *std::move(result);
  run.grad_hidden.assign(grad.begin(), grad.end());
  run.grad_z.assign(grad_z.begin(), grad_z.end());
  run.grad_correction_weight.assign(grad_m.begin(), grad_m.end());
  run.grad_confidence.assign(grad_confidence.begin(), grad_confidence.end());
  return run;
}

// The gradient against the golden's, where the golden has one (a
// correction-free case has no z or M).
void ExpectGradient(const std::vector<double>& got,
                    const std::vector<double>& expected, double tolerance,
                    const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  if (expected.empty()) return;
  EXPECT_LE(RelativeMaxError<double>(got, expected), tolerance) << what;
}

// SpecForge divides its accuracy in float32.
constexpr double kFloat32Ratio = 1e-7;
void CheckDSpark(const Golden& g, const CaseRun& run, double tol) {
  const HeadResult& r = run.result;
  const ChunkTerms& t = r.terms;
  ExpectNear(r.loss, g.terms[kDSparkLoss], tol, "loss");
  ExpectNear(r.accuracy, g.terms[kDSparkAccuracy], kFloat32Ratio, "accuracy");
  ExpectNear(t.loss_den, g.terms[kLocalLossDen], tol, "local_loss_den");
  ExpectNear(t.ce_num, g.terms[kCeNum], tol, "ce_num");
  ExpectNear(t.l1_num, g.terms[kL1Num], tol, "l1_num");
  ExpectNear(t.confidence_num, g.terms[kConfidenceNum], tol,
             "confidence_num");
  ExpectNear(t.confidence_error_num, g.terms[kConfidenceErrorNum], tol,
             "confidence_error_num");
  ExpectNear(t.correct, g.terms[kCorrectNum], 0, "correct_num");
  ExpectNear(t.accuracy_den, g.terms[kEvalDen], 0, "eval_den");
  double agreement = 0;
  for (double a : t.teacher_agreement_per_position) agreement += a;
  ExpectNear(agreement, g.terms[kTeacherAgreementNum], 0,
             "teacher_agreement_num");
  ExpectNear(t.teacher_top1, g.terms[kTeacherTop1Num], tol, "teacher_top1_num");
  ExpectNear(t.draft_top1, g.terms[kDraftTop1Num], tol, "draft_top1_num");
  ExpectNear(t.accepted_length.teacher_expected_num, g.terms[kTauNum], tol,
             "tau_num");
  // Without a teacher SpecForge reports no tau; dflash's block count stays.
  if (g.terms[kTauDen] > 0) {
    ExpectNear(t.accepted_length.block_den, g.terms[kTauDen], 0, "tau_den");
  }
  ExpectNear(t.dpard_num, g.terms[kDPardLossNum], tol, "dpard_loss_num");
  const int64_t k = g.config.layout().block_size();
  for (int64_t p = 0; p < k; ++p) {
    ExpectNear(t.ce_per_position[p], g.position[kCePosition * k + p], tol,
               absl::StrCat("ce_position_num at ", p));
    ExpectNear(t.correct_per_position[p], g.position[kCorrectPosition * k + p],
               0, absl::StrCat("correct_position_num at ", p));
    ExpectNear(t.mask_per_position[p], g.position[kPositionDen * k + p], 0,
               absl::StrCat("position_den at ", p));
    ExpectNear(t.dpard_credit_per_position[p],
               g.position[kDPardCreditPosition * k + p], tol,
               absl::StrCat("dpard_credit_position_num at ", p));
  }
}

void CheckDomino(const Golden& g, const CaseRun& run, double tol) {
  const HeadResult& r = run.result;
  const ChunkTerms& t = r.terms;
  ExpectNear(r.loss, g.terms[kDominoLoss], tol, "loss");
  ExpectNear(r.accuracy, g.terms[kDominoAccuracy], 1e-12, "accuracy");
  ExpectNear(t.ce_num, g.terms[kFinalNum], tol, "final_num");
  ExpectNear(t.base_ce_num, g.terms[kBaseNum], tol, "base_num");
  ExpectNear(t.loss_den, g.terms[kLossDen], tol, "loss_den");
  ExpectNear(t.correct, g.terms[kDominoCorrectNum], 0, "correct_num");
  ExpectNear(t.base_correct, g.terms[kBaseCorrectNum], 0, "base_correct_num");
  ExpectNear(t.accuracy_den, g.terms[kAccuracyDen], 1e-12, "accuracy_den");
  const AcceptedLengthTerms& a = t.accepted_length;
  ExpectNear(a.greedy_num, g.terms[kAcceptNum], 0, "accept_num");
  ExpectNear(a.base_greedy_num, g.terms[kBaseAcceptNum], 0, "base_accept_num");
  ExpectNear(a.greedy_den, g.terms[kAcceptDen], 0, "accept_den");
}

TEST(SpecForgeCorrectionParityTest, GoldensAreThere) {
  const std::vector<Golden> goldens = LoadAll();
  int dspark = 0, domino = 0;
  for (const Golden& g : goldens) {
    SCOPED_TRACE(g.name);
    (g.domino ? domino : dspark) += 1;
    EXPECT_EQ(g.terms.size(),
              static_cast<size_t>(g.domino ? int{kDominoTerms}
                                           : int{kDSparkTerms}));
    EXPECT_EQ(g.grad_hidden.size(), g.hidden.size());
    const int64_t rank = g.config.head().correction_rank();
    EXPECT_EQ(g.z.size(), g.hidden.size() / g.config.head().hidden_size() *
                              static_cast<size_t>(rank));
    EXPECT_EQ(g.grad_correction_weight.size(),
              static_cast<size_t>(g.config.head().vocab_size() * rank));
    if (!g.domino) {
      EXPECT_EQ(g.position.size(),
                static_cast<size_t>(kDSparkPositionRows *
                                    g.config.layout().block_size()));
    }
  }
  EXPECT_GE(dspark, 6);
  EXPECT_GE(domino, 4);
}

// Every execution mode, at chunks of one block up to the whole batch, with
// 1 and 2 threads.
TEST(SpecForgeCorrectionParityTest, EveryModeAndChunkMatchesSpecForge) {
  for (const Golden& g : LoadAll()) {
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
          absl::StatusOr<CaseRun> run = RunGolden<double>(g, config);
          ASSERT_TRUE(run.ok()) << run.status();
          const double tol = SpecForgeTolerance(config);
          if (g.domino) {
            CheckDomino(g, *run, tol);
          } else {
            CheckDSpark(g, *run, tol);
          }
          ExpectGradient(run->grad_hidden, g.grad_hidden, tol,
                         "d(loss)/d(hidden) through the lm_head");
          ExpectGradient(run->grad_z, g.grad_z, tol, "d(loss)/dz");
          ExpectGradient(run->grad_correction_weight, g.grad_correction_weight,
                         tol, "d(loss)/dM");
          if (!g.grad_confidence.empty()) {
            ExpectGradient(run->grad_confidence, g.grad_confidence, tol,
                           "d(loss)/d(confidence logits)");
          }
        }
      }
    }
  }
}

// The float32 path against the same goldens (inputs rounded to float).
TEST(SpecForgeCorrectionParityTest, Float32MatchesSpecForgeInEveryMode) {
  for (const Golden& g : LoadAll()) {
    for (const char* mode :
         {"fused", "checkpoint", "selective", "save", "materialize"}) {
      SCOPED_TRACE(absl::StrCat(g.name, " ", mode));
      v1::ObjectiveConfig config = g.config;
      ASSERT_TRUE(SetModeByName("mode", mode, config).ok());
      config.mutable_chunking()->set_blocks_per_chunk(2);
      config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
      absl::StatusOr<CaseRun> run = RunGolden<float>(g, config);
      ASSERT_TRUE(run.ok()) << run.status();
      const int loss = g.domino ? int{kDominoLoss} : int{kDSparkLoss};
      ExpectNear(run->result.loss, g.terms[loss], 1e-5, "loss");
      ExpectGradient(run->grad_hidden, g.grad_hidden, 1e-4,
                     "d(loss)/d(hidden)");
      ExpectGradient(run->grad_z, g.grad_z, 1e-4, "d(loss)/dz");
      ExpectGradient(run->grad_correction_weight, g.grad_correction_weight,
                     1e-4, "d(loss)/dM");
    }
  }
}

}  // namespace
}  // namespace dflash
