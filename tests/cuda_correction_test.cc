// The low-rank correction, DSpark's SpecForge terms, D-PARD and Domino on
// the CUDA head, against the CPU head in float64 (which
// //tests:head_correction_test and //tests:specforge_correction_parity_test
// prove against materialised logits and SpecForge's own code): FP32 within
// 1e-5, BF16 within bfloat16's rounding, the BF16 correction weight's
// gradient summed in FP32 over many chunks. Skipped, with the reason, where
// no GPU is usable.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "base/status_macros.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cpu_head.h"
#include "heads/cuda_head.h"
#include "losses/loss_family.h"
#include "tests/cuda_test_util.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using head_test::kH;
using head_test::kV;
using head_test::MakeBatch;

constexpr int64_t kRank = 3;

// Everything a run reads and writes, in float64 on the host.
struct Case {
  Batch batch;
  std::vector<double> z, m;
};

struct Result {
  absl::StatusOr<HeadResult> head;
  std::vector<double> grad_hidden, grad_z, grad_m, grad_confidence;
  std::vector<int32_t> argmax, base_argmax, teacher_argmax;  // Row outputs.
};

Case MakeCase(uint32_t seed) {
  Case c{MakeBatch(seed), {}, {}};
  std::mt19937 rng(seed + 1);
  std::uniform_real_distribution<double> uniform(-1, 1);
  for (int64_t i = 0; i < c.batch.num_rows() * kRank; ++i) {
    c.z.push_back(uniform(rng));
  }
  for (int64_t i = 0; i < kV * kRank; ++i) c.m.push_back(uniform(rng));
  return c;
}

bool Confidence(const v1::ObjectiveConfig& config) {
  return LossTraitsOf(config.loss()).needs_confidence;
}

Result OnCpu(const v1::ObjectiveConfig& config, const Case& c) {
  const Batch& b = c.batch;
  const bool teacher = ProjectsTeacher(config);
  Result r;
  r.grad_hidden.assign(b.hidden.size(), 0);
  r.grad_z.assign(c.z.size(), 0);
  r.grad_m.assign(c.m.size(), 0);
  std::vector<double> grad_confidence(Confidence(config) ? b.num_rows() : 0);
  const HeadInputs<double> inputs{
      b.hidden,
      teacher ? absl::MakeConstSpan(b.teacher) : absl::Span<const double>(),
      Confidence(config) ? absl::MakeConstSpan(b.confidence)
                         : absl::Span<const double>(),
      b.rows,
      b.weight,
      b.bias,
      c.z,
      c.m};
  const HeadGradients<double> gradients{absl::MakeSpan(r.grad_hidden),
                                        {},
                                        {},
                                        absl::MakeSpan(grad_confidence),
                                        absl::MakeSpan(r.grad_z),
                                        absl::MakeSpan(r.grad_m)};
  r.argmax.assign(b.num_rows(), 7);
  r.base_argmax.assign(b.num_rows(), 7);
  r.teacher_argmax.assign(b.num_rows(), 7);
  HeadRowOutputs row_outputs;
  row_outputs.argmax = absl::MakeSpan(r.argmax);
  row_outputs.base_argmax = absl::MakeSpan(r.base_argmax);
  row_outputs.teacher_argmax = absl::MakeSpan(r.teacher_argmax);
  TrackingAllocator allocator;
  r.head = RunHead<double>(config, inputs, gradients, allocator, row_outputs);
  r.grad_confidence.assign(grad_confidence.begin(), grad_confidence.end());
  return r;
}

// [rows] ids, 7 each: the head must overwrite every one.
TrackedBuffer<int32_t> UploadIds(int64_t rows, CudaStream& stream) {
  return Upload<int32_t>(std::vector<int32_t>(rows, 7), stream);
}

template <typename T>
Result OnGpu(v1::ObjectiveConfig config, const Case& c, Gpu& gpu) {
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(std::is_same_v<T, float>
                                       ? v1::HeadConfig::FLOAT32
                                       : v1::HeadConfig::BFLOAT16);
  CudaStream& stream = *gpu.stream;
  const Batch& b = c.batch;
  const bool teacher = ProjectsTeacher(config);
  const bool confidence = Confidence(config);
  Result r;
  {
    TrackedBuffer<T> hidden = Upload<T>(b.hidden, stream);
    TrackedBuffer<T> teacher_hidden =
        Upload<T>(teacher ? b.teacher : std::vector<double>(), stream);
    TrackedBuffer<T> weight = Upload<T>(b.weight, stream);
    TrackedBuffer<T> bias = Upload<T>(b.bias, stream);
    TrackedBuffer<float> logits = Upload<float>(
        confidence ? b.confidence : std::vector<double>(), stream);
    TrackedBuffer<T> z = Upload<T>(c.z, stream), m = Upload<T>(c.m, stream);
    TrackedBuffer<T> grad_hidden =
        Upload<T>(std::vector<double>(b.hidden.size(), 7), stream);
    TrackedBuffer<float> grad_confidence = Upload<float>(
        std::vector<double>(confidence ? b.num_rows() : 0, 7), stream);
    TrackedBuffer<T> grad_z =
        Upload<T>(std::vector<double>(c.z.size(), 7), stream);
    TrackedBuffer<T> grad_m =
        Upload<T>(std::vector<double>(c.m.size(), 7), stream);
    const HeadInputs<T> inputs{Span(hidden), Span(teacher_hidden),
                               Span(logits), b.rows,
                               Span(weight), Span(bias),
                               Span(z),      Span(m)};
    const HeadGradients<T> gradients{Span(grad_hidden), {},
                                     {},                Span(grad_confidence),
                                     Span(grad_z),      Span(grad_m)};
    TrackedBuffer<int32_t> argmax = UploadIds(b.num_rows(), stream);
    TrackedBuffer<int32_t> base_argmax = UploadIds(b.num_rows(), stream);
    TrackedBuffer<int32_t> teacher_argmax = UploadIds(b.num_rows(), stream);
    HeadRowOutputs row_outputs;
    row_outputs.argmax = Span(argmax);
    row_outputs.base_argmax = Span(base_argmax);
    row_outputs.teacher_argmax = Span(teacher_argmax);
    r.head = RunCudaHead<T>(config, inputs, gradients, *gpu.blas, row_outputs);
    r.argmax = CopyBack(argmax, stream);
    r.base_argmax = CopyBack(base_argmax, stream);
    r.teacher_argmax = CopyBack(teacher_argmax, stream);
    r.grad_hidden = Download(grad_hidden, stream);
    r.grad_z = Download(grad_z, stream);
    r.grad_m = Download(grad_m, stream);
    r.grad_confidence = Download(grad_confidence, stream);
  }
  EXPECT_TRUE(stream.Synchronize().ok());
  return r;
}

v1::ObjectiveConfig WithCorrection(ConfigBuilder builder) {
  builder.ExtraHead(absl::StrCat("correction_rank: ", kRank));
  v1::ObjectiveConfig config = builder.Build();
  config.mutable_layout()->set_num_anchors(3);
  return config;
}

const char* const kLosses[] = {
    "dflash { gamma: 7 }",
    "dpace { alpha: 0.3 }",
    "dspark { gamma: 7 }",
    "dspark { ce_weight: 0.3 l1_weight: 0 confidence_weight: 0.7 }",
    "dspark { objective: DPARD ce_weight: 0 l1_weight: 0 dpard_alpha: 0.4 }",
    "domino { lambda_base: 0.3 gamma: 3 }",
    "domino { shift_label: true pure_draft_prefix_len: 1 }",
};

void ExpectClose(const Result& got, const Result& want, double tolerance) {
  ASSERT_TRUE(got.head.ok()) << got.head.status();
  ASSERT_TRUE(want.head.ok()) << want.head.status();
  const ChunkTerms& g = got.head->terms;
  const ChunkTerms& w = want.head->terms;
  auto near = [&](double a, double e, const char* what) {
    EXPECT_NEAR(a, e, tolerance * std::max(1.0, std::abs(e))) << what;
  };
  near(got.head->loss, want.head->loss, "loss");
  near(got.head->accuracy, want.head->accuracy, "accuracy");
  near(g.ce_num, w.ce_num, "ce_num");
  near(g.base_ce_num, w.base_ce_num, "base_ce_num");
  near(g.l1_num, w.l1_num, "l1_num");
  near(g.confidence_num, w.confidence_num, "confidence_num");
  near(g.confidence_error_num, w.confidence_error_num, "confidence_error");
  near(g.teacher_top1, w.teacher_top1, "teacher_top1");
  near(g.draft_top1, w.draft_top1, "draft_top1");
  near(g.dpard_num, w.dpard_num, "dpard_num");
  near(g.accepted_length.teacher_expected_num,
       w.accepted_length.teacher_expected_num, "tau");
  near(g.accepted_length.greedy_num, w.accepted_length.greedy_num, "accept");
  near(g.accepted_length.base_greedy_num, w.accepted_length.base_greedy_num,
       "base accept");
  for (size_t k = 0; k < w.ce_per_position.size(); ++k) {
    near(g.ce_per_position[k], w.ce_per_position[k], "ce per position");
    near(g.dpard_credit_per_position[k], w.dpard_credit_per_position[k],
         "credit per position");
  }
  EXPECT_LE(RelativeMaxError<double>(got.grad_hidden, want.grad_hidden),
            tolerance);
  EXPECT_LE(RelativeMaxError<double>(got.grad_z, want.grad_z), tolerance);
  EXPECT_LE(RelativeMaxError<double>(got.grad_m, want.grad_m), tolerance);
  if (!want.grad_confidence.empty()) {
    EXPECT_LE(
        RelativeMaxError<double>(got.grad_confidence, want.grad_confidence),
        tolerance);
  }
}

TEST(CudaCorrectionTest, EveryFamilyAndModeMatchesTheCpuHead) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  const Case c = MakeCase(31);
  for (const char* loss : kLosses) {
    for (const char* mode : head_test::kModes) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      const v1::ObjectiveConfig config =
          WithCorrection(ConfigBuilder(loss).Mode(mode));
      const Result want = OnCpu(config, c);
      const Result fp32 = OnGpu<float>(config, c, *gpu);
      ExpectClose(fp32, want, 1e-5);
      // The argmaxes in FP32 (no near-ties in this batch): domino's base
      // logits' (-1 for the other families) and the teacher's (-1 without
      // one).
      EXPECT_EQ(fp32.argmax, want.argmax);
      EXPECT_EQ(fp32.base_argmax, want.base_argmax);
      EXPECT_EQ(fp32.teacher_argmax, want.teacher_argmax);
      ExpectClose(OnGpu<BFloat16>(config, c, *gpu), want, 3e-2);
    }
  }
}

// Six chunks of one block: the BF16 correction weight's gradient is summed
// in FP32 and rounded once, so its error stays at bfloat16's rounding of
// the result rather than growing with the chunks.
TEST(CudaCorrectionTest, BFloat16CorrectionWeightGradientIsRoundedOnce) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  Case c = MakeCase(32);
  // Inputs on a grid of 1/4 (bias 1/16), so that the logits, multiples of
  // 1/16 well below 16, are exact in bfloat16 and only the gradients'
  // rounding remains.
  for (std::vector<double>* v :
       {&c.batch.hidden, &c.batch.weight, &c.z, &c.m}) {
    for (double& x : *v) x = std::round(x * 4) / 4;
  }
  for (double& x : c.batch.bias) x = std::round(x * 16) / 16;
  const v1::ObjectiveConfig config =
      WithCorrection(ConfigBuilder("dflash {}").BlocksPerChunk(1));
  const Result want = OnCpu(config, c);
  const Result got = OnGpu<BFloat16>(config, c, *gpu);
  ASSERT_TRUE(got.head.ok()) << got.head.status();
  // The logits' gradient, the GEMM's input, is itself bfloat16 (about 2^-9
  // relative an element), so entries that cancel to near zero carry more
  // than a rounding: normwise, once-rounded stays near 2^-9 (2.6e-3 under
  // the CUDA emulation), where a rounding per chunk would add one for each
  // of the six.
  EXPECT_LT(RelativeL2Error<double>(got.grad_m, want.grad_m), 1.0 / 256);
  // The hidden and correction-input gradients, their scale folded into the
  // GEMM so that they too are rounded once: within a bfloat16 rounding of
  // the logits' gradient, normwise.
  EXPECT_LT(RelativeL2Error<double>(got.grad_hidden, want.grad_hidden),
            2.0 / 256);
  EXPECT_LT(RelativeL2Error<double>(got.grad_z, want.grad_z), 2.0 / 256);
}

}  // namespace
}  // namespace dflash
