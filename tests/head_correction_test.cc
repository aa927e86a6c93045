// The head's low-rank logit correction (head.correction_rank): logits =
// hidden @ W^T + bias + z @ M^T, with gradients for z and M, against a
// float64 reference that materialises the logits with naive loops and runs
// one unchunked loss call (//losses checks that against its own naive
// reference and finite differences); every family that adds the
// correction, and Domino's, which reads it apart; every mode and chunk
// size; the cost table's extra r/H passes; peak memory within
// PredictPeakBytes; rejected inputs.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/error_norms.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cpu_head.h"
#include "heads/head_plan.h"
#include "losses/batch_layout.h"
#include "losses/chunk_loss.h"
#include "losses/loss_family.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using head_test::kH;
using head_test::kK;
using head_test::kV;
using head_test::MakeBatch;

constexpr int64_t kRank = 3;

struct Correction {
  std::vector<double> z, m;
};

Correction MakeCorrection(uint32_t seed, int64_t rows) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(-1, 1);
  Correction c;
  for (int64_t i = 0; i < rows * kRank; ++i) c.z.push_back(uniform(rng));
  for (int64_t i = 0; i < kV * kRank; ++i) c.m.push_back(uniform(rng));
  return c;
}

struct Gradients {
  double loss = 0;
  std::vector<double> hidden, z, m;
};

// The reference: logits with naive loops (the correction added, or apart
// for a loss that splits it), one ChunkLoss<double> over every row, then
// the gradients with naive loops divided as FinishTerms says.
Gradients Naive(const v1::ObjectiveConfig& config, const Batch& b,
                const Correction& c) {
  const int64_t n = b.num_rows();
  const bool split = SplitsCorrection(config);
  std::vector<double> logits(n * kV), correction(split ? n * kV : 0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      double base = b.bias[v], extra = 0;
      for (int64_t h = 0; h < kH; ++h) {
        base += b.hidden[r * kH + h] * b.weight[v * kH + h];
      }
      for (int64_t j = 0; j < kRank; ++j) {
        extra += c.z[r * kRank + j] * c.m[v * kRank + j];
      }
      logits[r * kV + v] = split ? base : base + extra;
      if (split) correction[r * kV + v] = extra;
    }
  }
  const LossParams params = LossParamsOf(config.loss());
  ChunkLossInputs<double> inputs{absl::MakeSpan(logits), {}, {}, b.rows, kV};
  inputs.correction_logits = absl::MakeSpan(correction);
  absl::StatusOr<ChunkTerms> terms =
      ChunkLoss<double>(config.loss(), ChunkLossOptionsOf(config), inputs);
  EXPECT_TRUE(terms.ok()) << terms.status();
  Gradients g;
  if (!terms.ok()) return g;
  const FinishedLoss finished = FinishTerms(params, *terms, b.batch);
  g.loss = finished.loss;
  const double s = finished.gradient_scale;
  const std::vector<double>& gc = split ? correction : logits;
  g.hidden.assign(n * kH, 0);
  g.z.assign(n * kRank, 0);
  g.m.assign(kV * kRank, 0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      for (int64_t h = 0; h < kH; ++h) {
        g.hidden[r * kH + h] += s * logits[r * kV + v] * b.weight[v * kH + h];
      }
      for (int64_t j = 0; j < kRank; ++j) {
        g.z[r * kRank + j] += s * gc[r * kV + v] * c.m[v * kRank + j];
        g.m[v * kRank + j] += s * gc[r * kV + v] * c.z[r * kRank + j];
      }
    }
  }
  return g;
}

template <typename T>
struct HeadRunResult {
  absl::StatusOr<HeadResult> result;
  Gradients gradients;
};

template <typename T>
HeadRunResult<T> RunHeadWith(const v1::ObjectiveConfig& config, const Batch& b,
                   const Correction& c, TrackingAllocator& allocator,
                   const HeadRowOutputs& row_outputs = {}) {
  auto as = [](const std::vector<double>& v) {
    return std::vector<T>(v.begin(), v.end());
  };
  const std::vector<T> hidden = as(b.hidden), weight = as(b.weight),
                       bias = as(b.bias), teacher = as(b.teacher),
                       z = as(c.z), m = as(c.m);
  const std::vector<ConfidenceOf<T>> confidence(b.confidence.begin(),
                                                b.confidence.end());
  const LossTraits traits = LossTraitsOf(config.loss());
  std::vector<T> grad_hidden(hidden.size(), T(5)), grad_z(z.size(), T(5)),
      grad_m(m.size(), T(5));
  std::vector<ConfidenceOf<T>> grad_confidence(
      traits.needs_confidence ? b.num_rows() : 0);
  const HeadInputs<T> inputs{
      hidden,
      traits.needs_teacher ? absl::MakeConstSpan(teacher)
                           : absl::Span<const T>(),
      traits.needs_confidence ? absl::MakeConstSpan(confidence)
                              : absl::Span<const ConfidenceOf<T>>(),
      b.rows,
      weight,
      bias,
      z,
      m};
  const HeadGradients<T> gradients{absl::MakeSpan(grad_hidden),
                                   {},
                                   {},
                                   absl::MakeSpan(grad_confidence),
                                   absl::MakeSpan(grad_z),
                                   absl::MakeSpan(grad_m)};
  HeadRunResult<T> run;
  run.result = RunHead<T>(config, inputs, gradients, allocator, row_outputs);
  run.gradients.hidden.assign(grad_hidden.begin(), grad_hidden.end());
  run.gradients.z.assign(grad_z.begin(), grad_z.end());
  run.gradients.m.assign(grad_m.begin(), grad_m.end());
  if (run.result.ok()) run.gradients.loss = run.result->loss;
  return run;
}

v1::ObjectiveConfig WithCorrection(ConfigBuilder builder) {
  builder.ExtraHead(absl::StrCat("correction_rank: ", kRank));
  v1::ObjectiveConfig config = builder.Build();
  config.mutable_layout()->set_num_anchors(3);
  return config;
}

// The teacher-free families and one with a teacher; Domino splits.
const char* const kCorrectedLosses[] = {
    "dflash { gamma: 7 }",
    "dpace { alpha: 0.3 }",
    "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }",
    "dspark { gamma: 7 l1_weight: 0 confidence_weight: 0 }",
    "domino { lambda_base: 0.3 gamma: 3 }",
    "domino { shift_label: true pure_draft_prefix_len: 1 }",
};

TEST(HeadCorrectionTest, EveryModeMatchesMaterialisedLogits) {
  const Batch b = MakeBatch(11);
  const Correction c = MakeCorrection(12, b.num_rows());
  for (const char* loss : kCorrectedLosses) {
    const Gradients want = Naive(WithCorrection(ConfigBuilder(loss)), b, c);
    for (const char* mode : head_test::kModes) {
      for (int64_t blocks : {1, 2, 6}) {
        SCOPED_TRACE(absl::StrCat(loss, " ", mode, " blocks ", blocks));
        const v1::ObjectiveConfig config = WithCorrection(
            ConfigBuilder(loss).Mode(mode).BlocksPerChunk(blocks).Threads(2));
        TrackingAllocator allocator;
        const HeadRunResult<double> run = RunHeadWith<double>(config, b, c, allocator);
        ASSERT_TRUE(run.result.ok()) << run.result.status();
        EXPECT_NEAR(run.gradients.loss, want.loss,
                    1e-12 * std::abs(want.loss));
        EXPECT_LE(RelativeMaxError<double>(run.gradients.hidden, want.hidden),
                  1e-12);
        EXPECT_LE(RelativeMaxError<double>(run.gradients.z, want.z), 1e-12);
        EXPECT_LE(RelativeMaxError<double>(run.gradients.m, want.m), 1e-12);
        // Float32 against the same float64 reference.
        v1::ObjectiveConfig single = config;
        single.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
        const HeadRunResult<float> f = RunHeadWith<float>(single, b, c, allocator);
        ASSERT_TRUE(f.result.ok()) << f.result.status();
        EXPECT_LE(RelativeMaxError<double>(f.gradients.z, want.z), 1e-5);
        EXPECT_LE(RelativeMaxError<double>(f.gradients.m, want.m), 1e-5);
      }
    }
  }
}

// Domino's correction applies from suffix_start: rows before it get no
// correction gradient, whatever z holds there.
TEST(HeadCorrectionTest, DominoIgnoresZBeforeTheSuffix) {
  const Batch b = MakeBatch(13);
  Correction c = MakeCorrection(14, b.num_rows());
  const v1::ObjectiveConfig config =
      WithCorrection(ConfigBuilder("domino { pure_draft_prefix_len: 1 }"));
  TrackingAllocator allocator;
  const HeadRunResult<double> first = RunHeadWith<double>(config, b, c, allocator);
  for (int64_t r = 0; r < b.num_rows(); ++r) {
    if (b.rows[r].position < 2) c.z[r * kRank] += 10;  // suffix_start = 2.
  }
  const HeadRunResult<double> second = RunHeadWith<double>(config, b, c, allocator);
  ASSERT_TRUE(first.result.ok() && second.result.ok());
  EXPECT_EQ(first.gradients.loss, second.gradients.loss);
  EXPECT_EQ(first.gradients.m, second.gradients.m);
  for (int64_t r = 0; r < b.num_rows(); ++r) {
    if (b.rows[r].position >= 2) continue;
    for (int64_t j = 0; j < kRank; ++j) {
      EXPECT_EQ(first.gradients.z[r * kRank + j], 0) << "row " << r;
    }
  }
}

// Domino's per-row argmaxes through the head: of the final logits (the
// correction added from suffix_start) and of the base logits (without it),
// against naive float64 logits; -1 where a row has no mask. Ties are
// absent from these random logits.
TEST(HeadCorrectionTest, DominoRowArgmaxesMatchMaterialisedLogits) {
  const Batch b = MakeBatch(31);
  const Correction c = MakeCorrection(32, b.num_rows());
  const int64_t n = b.num_rows();
  for (const char* loss :
       {"domino { lambda_base: 0.3 }",
        "domino { shift_label: true pure_draft_prefix_len: 1 }"}) {
    const v1::ObjectiveConfig base_config = WithCorrection(ConfigBuilder(loss));
    const int64_t suffix_start =
        LossParamsOf(base_config.loss()).suffix_start;
    std::vector<int32_t> want_final(n, -1), want_base(n, -1);
    for (int64_t r = 0; r < n; ++r) {
      if (b.rows[r].mask <= 0) continue;
      double best_final = -INFINITY, best_base = -INFINITY;
      for (int64_t v = 0; v < kV; ++v) {
        double base = b.bias[v], extra = 0;
        for (int64_t h = 0; h < kH; ++h) {
          base += b.hidden[r * kH + h] * b.weight[v * kH + h];
        }
        for (int64_t j = 0; j < kRank; ++j) {
          extra += c.z[r * kRank + j] * c.m[v * kRank + j];
        }
        const double final_logit =
            b.rows[r].position >= suffix_start ? base + extra : base;
        if (base > best_base) best_base = base, want_base[r] = v;
        if (final_logit > best_final) best_final = final_logit, want_final[r] = v;
      }
    }
    for (const char* mode : head_test::kModes) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      const v1::ObjectiveConfig config = WithCorrection(
          ConfigBuilder(loss).Mode(mode).BlocksPerChunk(2).Threads(2));
      std::vector<int32_t> argmax(n, 7), base_argmax(n, 7);
      HeadRowOutputs row_outputs;
      row_outputs.argmax = absl::MakeSpan(argmax);
      row_outputs.base_argmax = absl::MakeSpan(base_argmax);
      TrackingAllocator allocator;
      const HeadRunResult<double> run =
          RunHeadWith<double>(config, b, c, allocator, row_outputs);
      ASSERT_TRUE(run.result.ok()) << run.result.status();
      EXPECT_EQ(argmax, want_final);
      EXPECT_EQ(base_argmax, want_base);
    }
  }
  // Other families have no base logits: -1 on every row.
  std::vector<int32_t> base_argmax(n, 7);
  HeadRowOutputs row_outputs;
  row_outputs.base_argmax = absl::MakeSpan(base_argmax);
  TrackingAllocator allocator;
  const HeadRunResult<double> run = RunHeadWith<double>(
      WithCorrection(ConfigBuilder("dflash {}")), b, c, allocator,
      row_outputs);
  ASSERT_TRUE(run.result.ok()) << run.result.status();
  EXPECT_EQ(base_argmax, std::vector<int32_t>(n, -1));
  // A buffer of the wrong size is an error naming it.
  std::vector<int32_t> short_buffer(n - 1);
  row_outputs.base_argmax = absl::MakeSpan(short_buffer);
  EXPECT_EQ(RunHeadWith<double>(WithCorrection(ConfigBuilder("domino {}")), b,
                                c, allocator, row_outputs)
                .result.status()
                .message(),
            absl::StrCat("row_outputs.base_argmax: must hold ", n,
                         " values (one per row), got ", n - 1));
}

// The teacher's per-row argmax through the head, against naive float64
// teacher logits: every family that reads a teacher and a loss with the
// teacher diagnostics, every mode; -1 where a row has no mask and, without
// teacher_hidden, on every row.
TEST(HeadCorrectionTest, TeacherArgmaxMatchesMaterialisedTeacherLogits) {
  const Batch b = MakeBatch(33);
  const int64_t n = b.num_rows();
  std::vector<int32_t> want(n, -1);
  for (int64_t r = 0; r < n; ++r) {
    if (!(b.rows[r].mask > 0)) continue;
    double best = -INFINITY;
    for (int64_t v = 0; v < kV; ++v) {
      double logit = b.bias[v];
      for (int64_t h = 0; h < kH; ++h) {
        logit += b.teacher[r * kH + h] * b.weight[v * kH + h];
      }
      if (logit > best) best = logit, want[r] = static_cast<int32_t>(v);
    }
  }
  struct Case {
    const char* loss;
    const char* head;
  };
  for (const Case& c :
       {Case{"dspark { gamma: 7 }", ""},
        Case{"distillation { divergence: FORWARD_KL temperature: 2 }", ""},
        Case{"dflash { gamma: 7 }", "teacher_diagnostics: true"},
        Case{"dflash { gamma: 7 }", ""}}) {
    for (const char* mode : head_test::kModes) {
      SCOPED_TRACE(absl::StrCat(c.loss, " ", c.head, " ", mode));
      ConfigBuilder builder =
          ConfigBuilder(c.loss).Mode(mode).BlocksPerChunk(2).Threads(2);
      if (*c.head != 0) builder.ExtraHead(c.head);
      const v1::ObjectiveConfig config = builder.Build();
      const bool teacher = ProjectsTeacher(config);
      const bool needs_confidence =
          LossTraitsOf(config.loss()).needs_confidence;
      const HeadInputs<double> inputs{
          b.hidden,
          teacher ? absl::MakeConstSpan(b.teacher) : absl::Span<const double>(),
          needs_confidence ? absl::MakeConstSpan(b.confidence)
                           : absl::Span<const double>(),
          b.rows,
          b.weight,
          b.bias};
      std::vector<double> grad_hidden(b.hidden.size());
      std::vector<double> grad_confidence(needs_confidence ? n : 0);
      HeadGradients<double> gradients;
      gradients.hidden = absl::MakeSpan(grad_hidden);
      gradients.confidence = absl::MakeSpan(grad_confidence);
      std::vector<int32_t> teacher_argmax(n, 7);
      HeadRowOutputs row_outputs;
      row_outputs.teacher_argmax = absl::MakeSpan(teacher_argmax);
      TrackingAllocator allocator;
      const absl::StatusOr<HeadResult> result = RunHead<double>(
          config, inputs, gradients, allocator, row_outputs);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(teacher_argmax,
                teacher ? want : std::vector<int32_t>(n, -1));
    }
  }
}

// FUSED keeps its two projection passes; the correction adds three of
// rank r (forward, d/dz, d/dM): 3 r / H more passes.
TEST(HeadCorrectionTest, FusedCostsTwoPassesPlusTheCorrections) {
  const Batch b = MakeBatch(15);
  const Correction c = MakeCorrection(16, b.num_rows());
  for (const char* loss : {"dflash {}", "domino {}"}) {
    SCOPED_TRACE(loss);
    TrackingAllocator allocator;
    const HeadRunResult<double> run = RunHeadWith<double>(
        WithCorrection(ConfigBuilder(loss)), b, c, allocator);
    ASSERT_TRUE(run.result.ok()) << run.result.status();
    EXPECT_NEAR(run.result->stats.gemm_passes,
                2 + 3.0 * kRank / static_cast<double>(kH), 1e-12);
  }
}

TEST(HeadCorrectionTest, PeakBytesStayWithinThePrediction) {
  const Batch b = MakeBatch(17, 4, 3);
  const Correction c = MakeCorrection(18, b.num_rows());
  for (const char* loss : {"dflash {}", "domino { lambda_base: 0.5 }"}) {
    for (const char* mode : head_test::kModes) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      const v1::ObjectiveConfig config =
          WithCorrection(ConfigBuilder(loss).Mode(mode));
      TrackingAllocator allocator;
      const HeadRunResult<double> run = RunHeadWith<double>(config, b, c, allocator);
      ASSERT_TRUE(run.result.ok()) << run.result.status();
      absl::StatusOr<int64_t> predicted =
          PredictPeakBytes(config, b.rows, sizeof(double));
      ASSERT_TRUE(predicted.ok()) << predicted.status();
      EXPECT_LE(run.result->stats.peak_bytes, *predicted);
    }
  }
}

TEST(HeadCorrectionTest, BadInputsAreClearErrors) {
  const Batch b = MakeBatch(19);
  const v1::ObjectiveConfig config = WithCorrection(ConfigBuilder());
  TrackingAllocator allocator;
  Correction short_z = MakeCorrection(20, b.num_rows());
  short_z.z.pop_back();
  EXPECT_EQ(RunHeadWith<double>(config, b, short_z, allocator)
                .result.status()
                .message(),
            absl::StrCat("inputs.correction_inputs: must hold ",
                         b.num_rows() * kRank,
                         " values (rows x head.correction_rank), got ",
                         b.num_rows() * kRank - 1));
  Correction short_m = MakeCorrection(21, b.num_rows());
  short_m.m.resize(kV);
  EXPECT_EQ(RunHeadWith<double>(config, b, short_m, allocator)
                .result.status()
                .message(),
            absl::StrCat("inputs.correction_weight: must hold ", kV * kRank,
                         " values (head.vocab_size x head.correction_rank), "
                         "got ",
                         kV));
  // A correction the config does not name.
  v1::ObjectiveConfig none = config;
  none.mutable_head()->set_correction_rank(0);
  EXPECT_EQ(RunHeadWith<double>(none, b, MakeCorrection(22, b.num_rows()),
                                allocator)
                .result.status()
                .message(),
            absl::StrCat("inputs.correction_inputs: must hold 0 values (rows "
                         "x head.correction_rank), got ",
                         b.num_rows() * kRank));
  // D-PARD counts sequences of num_anchors blocks.
  v1::ObjectiveConfig dpard = ConfigBuilder(
      "dspark { objective: DPARD ce_weight: 0 l1_weight: 0 "
      "confidence_weight: 0 }").Build();
  dpard.mutable_layout()->set_num_anchors(4);
  EXPECT_EQ(RunHeadWith<double>(dpard, b, {}, allocator)
                .result.status()
                .message(),
            absl::StrCat("inputs.rows: loss.dspark objective DPARD counts "
                         "sequences of layout.num_anchors x "
                         "layout.block_size = 16 rows, got ",
                         b.num_rows(), " rows"));
  // A non-finite z is named by its row.
  Correction bad = MakeCorrection(23, b.num_rows());
  int64_t weighted = 0;
  while (b.rows[weighted].mask == 0) ++weighted;
  bad.z[weighted * kRank] = std::nan("");
  const absl::Status status =
      RunHeadWith<double>(config, b, bad, allocator).result.status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("is not finite"), absl::string_view::npos)
      << status;
}

}  // namespace
}  // namespace dflash
