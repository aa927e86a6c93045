// The CPU loss suite's families and options, re-run on the CUDA loss and
// compared with the CPU loss in float64 (itself checked against naive
// references and finite differences in chunk_loss_test). Skipped, with the
// reason, where no GPU is usable.
#include "losses/cuda_chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "base/tracking_allocator.h"
#include "bench/cuda_fill.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "losses/chunk_loss.h"
#include "losses/cuda_chunk_loss_from_host.h"

namespace dflash {
namespace {

constexpr int64_t kK = 5, kBlocks = 7, kRows = kK * kBlocks;

std::unique_ptr<CudaStream> StreamOrSkip(std::string& why) {
  absl::StatusOr<std::unique_ptr<CudaStream>> stream = CudaStream::Create();
  if (!stream.ok()) {
    why = std::string(stream.status().message());
    return nullptr;
  }
  return *std::move(stream);
}

#define SKIP_WITHOUT_GPU(stream)                          \
  std::string why;                                        \
  std::unique_ptr<CudaStream> stream = StreamOrSkip(why); \
  DFLASH_SKIP_WITHOUT_GPU(stream == nullptr ? absl::UnavailableError(why) \
                                            : absl::OkStatus())

v1::LossConfig Loss(const std::string& text) {
  v1::LossConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &config))
      << text;
  return config;
}

// Rows of kBlocks blocks of kK positions: some masked, one ignore_index
// target, one block with fractional masks.
struct Problem {
  int64_t vocab;
  std::vector<RowMeta> rows;
  std::vector<double> logits, teacher;
  std::vector<float> confidence;
};

Problem MakeProblem(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 2);
  std::uniform_int_distribution<int32_t> token(0,
                                               static_cast<int32_t>(vocab) - 1);
  Problem p;
  p.vocab = vocab;
  for (int64_t r = 0; r < kRows; ++r) {
    RowMeta meta;
    meta.block = r / kK;
    meta.position = static_cast<int32_t>(r % kK);
    meta.target = token(rng);
    meta.mask = meta.position == 0 || r % 11 == 3 ? 0.0f : 1.0f;
    if (meta.block == 2 && meta.mask > 0) meta.mask = 0.5f;
    if (r == 8) meta.target = -100;  // ignore_index
    // Read only by SEQUENCE_BALANCED D-PACE.
    meta.sequence_share = 1.0 / static_cast<double>(1 + meta.block % 3);
    p.rows.push_back(meta);
  }
  for (int64_t i = 0; i < kRows * vocab; ++i) {
    p.logits.push_back(normal(rng));
    p.teacher.push_back(p.logits.back() + 0.5 * normal(rng));
  }
  // A planted winner in some rows: argmax away from 0, ties nowhere.
  for (int64_t r = 0; r < kRows; r += 3) p.logits[r * vocab + (r % vocab)] += 6;
  for (int64_t r = 0; r < kRows; ++r) {
    p.confidence.push_back(static_cast<float>(normal(rng)));
  }
  return p;
}

struct Outcome {
  absl::StatusOr<ChunkTerms> terms;
  std::vector<double> grad;
  std::vector<double> confidence_grad, neg_log_q;
  std::vector<int32_t> argmax, top_k;
  std::vector<double> target_probability;
};

constexpr int32_t kTopK = 4;

// Runs `T` on the CPU (ChunkLoss) or the GPU (CudaChunkLossFromHost).
template <typename T>
Outcome RunLoss(const v1::LossConfig& config, const ChunkLossOptions& options,
                const Problem& p, CudaStream* gpu, int32_t top_k = kTopK) {
  std::vector<T> logits = FromDoubles<T>(p.logits);
  const std::vector<T> teacher = FromDoubles<T>(p.teacher);
  const bool confidence =
      config.has_dspark() && config.dspark().confidence_weight() > 0;
  const std::vector<ConfidenceOf<T>> confidence_logits(p.confidence.begin(),
                                                       p.confidence.end());
  Outcome out;
  out.confidence_grad.assign(confidence ? kRows : 0, 7);
  out.neg_log_q.assign(kRows, 7);
  out.argmax.assign(kRows, 7);
  out.top_k.assign(kRows * top_k, 7);
  out.target_probability.assign(kRows, 7);
  const bool needs_teacher = config.has_dspark() || config.has_distillation();
  const ChunkLossInputs<T> inputs{
      absl::MakeSpan(logits),
      needs_teacher ? absl::MakeConstSpan(teacher) : absl::Span<const T>(),
      confidence ? absl::MakeConstSpan(confidence_logits)
                 : absl::Span<const ConfidenceOf<T>>(),
      p.rows, p.vocab};
  const ChunkLossOutputs outputs{absl::MakeSpan(out.confidence_grad),
                                 absl::MakeSpan(out.neg_log_q),
                                 absl::MakeSpan(out.argmax),
                                 absl::MakeSpan(out.top_k),
                                 top_k,
                                 absl::MakeSpan(out.target_probability)};
  if constexpr (std::is_same_v<T, double>) {
    out.terms =
        ChunkLoss<T>(config, options, inputs, outputs);  // No FP64 on CUDA.
  } else {
    out.terms = gpu != nullptr ? CudaChunkLossFromHost<T>(config, options,
                                                          inputs, outputs, *gpu)
                               : ChunkLoss<T>(config, options, inputs, outputs);
  }
  out.grad = AsDoubles(logits);
  return out;
}

double RelativeNormError(const std::vector<double>& a,
                         const std::vector<double>& b) {
  return RelativeL2Error<double>(a, b);
}

struct Case {
  const char* name;
  const char* loss;
  double scale = 1, softcap = 0;
};

const Case kCases[] = {
    {"dflash", "dflash { gamma: 7 }"},
    {"dflash_smoothing_zloss",
     "dflash { gamma: 4 } cross_entropy { label_smoothing: 0.1 "
     "z_loss_scale: 0.01 }"},
    {"dflash_softcap", "dflash { gamma: 7 }", 0.8, 5},
    {"dpace", "dpace { alpha: 0.3 }"},
    {"dpace_cumulative",
     "dpace { alpha: 0.2 variant: CUMULATIVE_CONFIDENCE_ONLY }"},
    {"dpace_continuation",
     "dpace { alpha: 0.4 variant: CONTINUATION_VALUE_ONLY }"},
    {"tv", "tv { gamma: 7 }"},
    {"lk_lambda", "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }"},
    {"dpace_lk_tv", "dpace { alpha: 0.3 lk { type: TV } }"},
    {"dflash_lk_lambda_batch",
     "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } }"},
    {"dspark", "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }"},
    {"forward_kl", "distillation { divergence: FORWARD_KL temperature: 2 }"},
    {"reverse_kl", "distillation { divergence: REVERSE_KL temperature: 0.7 }"},
    {"jsd", "distillation { divergence: JSD beta: 0.3 }"},
    // Row 8's ignored target counted, as SpecForge does; D-PACE's weights
    // times the rows' sequence shares.
    {"dflash_count",
     "dflash { gamma: 7 } cross_entropy { ignored_target_weight: COUNT }"},
    {"dpace_count",
     "dpace { alpha: 0.3 } cross_entropy { ignored_target_weight: COUNT }"},
    {"dpace_balanced_count",
     "dpace { alpha: 0.4 variant: CONTINUATION_VALUE_ONLY denominator: "
     "SEQUENCE_BALANCED } cross_entropy { ignored_target_weight: COUNT }"},
    {"dflash_lk_lambda_batch_count",
     "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } } "
     "cross_entropy { ignored_target_weight: COUNT }"},
    {"dspark_count",
     "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 } "
     "cross_entropy { ignored_target_weight: COUNT }"},
};

class CudaChunkLossTest : public ::testing::TestWithParam<Case> {};

// FP32 on the GPU within 1e-5 of the CPU in float64: terms, gradient,
// neg_log_q and the confidence gradient; argmax and top-k exact.
TEST_P(CudaChunkLossTest, Float32MatchesTheCpuInFloat64) {
  SKIP_WITHOUT_GPU(gpu);
  const Case& c = GetParam();
  const v1::LossConfig config = Loss(c.loss);
  const ChunkLossOptions options{kK, c.scale, c.softcap};
  for (int64_t vocab : {int64_t{13}, int64_t{1000}, int64_t{4099}}) {
    SCOPED_TRACE(vocab);
    const Problem p = MakeProblem(vocab, 11);
    const Outcome want = RunLoss<double>(config, options, p, nullptr);
    const Outcome got = RunLoss<float>(config, options, p, gpu.get());
    ASSERT_TRUE(want.terms.ok()) << want.terms.status();
    ASSERT_TRUE(got.terms.ok()) << got.terms.status();
    EXPECT_NEAR(got.terms->loss_num, want.terms->loss_num,
                1e-5 * std::abs(want.terms->loss_num));
    EXPECT_NEAR(got.terms->loss_den, want.terms->loss_den,
                1e-6 * want.terms->loss_den);
    EXPECT_EQ(got.terms->correct, want.terms->correct);
    EXPECT_EQ(got.terms->accuracy_den, want.terms->accuracy_den);
    EXPECT_NEAR(got.terms->target_probability,
                want.terms->target_probability,
                1e-5 * (1 + want.terms->target_probability));
    EXPECT_NEAR(got.terms->ce_num, want.terms->ce_num,
                1e-5 * (1 + std::abs(want.terms->ce_num)));
    EXPECT_NEAR(got.terms->tv_num, want.terms->tv_num,
                1e-5 * (1 + std::abs(want.terms->tv_num)));
    EXPECT_EQ(got.terms->correct_per_position,
              want.terms->correct_per_position);
    EXPECT_EQ(got.terms->mask_per_position, want.terms->mask_per_position);
    EXPECT_LT(RelativeNormError(got.grad, want.grad), 1e-5);
    for (int64_t r = 0; r < kRows; ++r) {
      EXPECT_NEAR(got.target_probability[r], want.target_probability[r], 1e-6)
          << "row " << r;
      EXPECT_NEAR(got.neg_log_q[r], want.neg_log_q[r],
                  1e-5 * (1 + std::abs(want.neg_log_q[r])))
          << "row " << r;
      EXPECT_EQ(got.argmax[r], want.argmax[r]) << "row " << r;
    }
    EXPECT_EQ(got.top_k, want.top_k);
    for (size_t r = 0; r < want.confidence_grad.size(); ++r) {
      EXPECT_NEAR(got.confidence_grad[r], want.confidence_grad[r], 1e-5);
    }
  }
}

// BF16 logits on the GPU against the CPU's BF16 path on the same values:
// per-token CE within 1e-5 (SpecForge's tolerance), argmax and top-k exact;
// the gradient, rounded to bfloat16 once, within 5e-3 in relative norm of
// the float64 gradient of the same bfloat16 logits. V 4099 takes the scalar
// path, V 1024 and 4096 the 16-byte vector path; the softcap off and on.
TEST_P(CudaChunkLossTest, BFloat16MatchesTheCpu) {
  SKIP_WITHOUT_GPU(gpu);
  const Case& c = GetParam();
  const v1::LossConfig config = Loss(c.loss);
  for (double softcap : {c.softcap, c.softcap > 0 ? 0.0 : 5.0}) {
    for (int64_t vocab : {int64_t{4099}, int64_t{1024}, int64_t{4096}}) {
      SCOPED_TRACE(absl::StrCat("V ", vocab, " softcap ", softcap));
      const ChunkLossOptions options{kK, c.scale, softcap};
      Problem p = MakeProblem(vocab, 12);
      // The float64 reference sees exactly the bfloat16 values.
      for (std::vector<double>* values : {&p.logits, &p.teacher}) {
        for (double& x : *values) {
          x = ToFloat(ToBFloat16(static_cast<float>(x)));
        }
      }
      const Outcome cpu = RunLoss<BFloat16>(config, options, p, nullptr);
      const Outcome exact = RunLoss<double>(config, options, p, nullptr);
      const Outcome got = RunLoss<BFloat16>(config, options, p, gpu.get());
      ASSERT_TRUE(cpu.terms.ok() && exact.terms.ok());
      ASSERT_TRUE(got.terms.ok()) << got.terms.status();
      EXPECT_NEAR(got.terms->loss_num, exact.terms->loss_num,
                  1e-5 * std::abs(exact.terms->loss_num));
      for (int64_t r = 0; r < kRows; ++r) {
        EXPECT_NEAR(got.neg_log_q[r], cpu.neg_log_q[r],
                    1e-5 * (1 + std::abs(cpu.neg_log_q[r])))
            << "row " << r;
        EXPECT_EQ(got.argmax[r], cpu.argmax[r]) << "row " << r;
      }
      EXPECT_EQ(got.top_k, cpu.top_k);
      EXPECT_LT(RelativeNormError(got.grad, exact.grad), 5e-3);
    }
  }
}

// The same inputs twice give bit-identical terms and gradients: the
// reductions run in a fixed order.
TEST_P(CudaChunkLossTest, RunsAreBitIdentical) {
  SKIP_WITHOUT_GPU(gpu);
  const Case& c = GetParam();
  const v1::LossConfig config = Loss(c.loss);
  const ChunkLossOptions options{kK, c.scale, c.softcap};
  const Problem p = MakeProblem(4096, 31);
  const Outcome first = RunLoss<float>(config, options, p, gpu.get());
  const Outcome second = RunLoss<float>(config, options, p, gpu.get());
  ASSERT_TRUE(first.terms.ok() && second.terms.ok());
  EXPECT_EQ(first.terms->loss_num, second.terms->loss_num);
  EXPECT_TRUE(first.grad == second.grad);
  EXPECT_EQ(first.top_k, second.top_k);
}

INSTANTIATE_TEST_SUITE_P(Families, CudaChunkLossTest,
                         ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// k = 64 on heavily tied logits (eight distinct values): the GPU's top-k
// is the CPU's, ties to the lower index.
TEST(CudaChunkLossTopKTest, SixtyFourOnTiedDataMatchesTheCpu) {
  SKIP_WITHOUT_GPU(gpu);
  const v1::LossConfig config = Loss("dflash { gamma: 7 }");
  const ChunkLossOptions options{kK, 1, 0};
  Problem p = MakeProblem(1000, 41);
  for (double& x : p.logits) x = std::round(x);  // About eight values.
  const Outcome cpu = RunLoss<float>(config, options, p, nullptr, 64);
  const Outcome got = RunLoss<float>(config, options, p, gpu.get(), 64);
  ASSERT_TRUE(cpu.terms.ok() && got.terms.ok());
  EXPECT_EQ(got.top_k, cpu.top_k);
  EXPECT_EQ(got.argmax, cpu.argmax);
}

// Logits offset by 1e4: one float for logsumexp would round its log-sum to
// ulp(1e4) ~ 1e-3; kept as max plus log-sum, -log q and the gradient stay
// within float32's error of the log-sum, as the CPU's float path does.
TEST(CudaChunkLossPrecisionTest, LargeLogitOffsetsKeepTheLogSum) {
  SKIP_WITHOUT_GPU(gpu);
  const v1::LossConfig config = Loss("dflash { gamma: 7 }");
  const ChunkLossOptions options{kK, 1, 0};
  Problem p = MakeProblem(4099, 43);
  // Offset, then rounded to float so that both runs see the same values.
  for (double& x : p.logits) x = static_cast<float>(x + 1e4);
  const Outcome exact = RunLoss<double>(config, options, p, nullptr);
  const Outcome got = RunLoss<float>(config, options, p, gpu.get());
  ASSERT_TRUE(exact.terms.ok());
  ASSERT_TRUE(got.terms.ok()) << got.terms.status();
  for (int64_t r = 0; r < kRows; ++r) {
    EXPECT_NEAR(got.neg_log_q[r], exact.neg_log_q[r], 2e-5) << "row " << r;
  }
  EXPECT_NEAR(got.terms->loss_num, exact.terms->loss_num,
              1e-5 * std::abs(exact.terms->loss_num));
  EXPECT_LT(RelativeNormError(got.grad, exact.grad), 1e-5);
}

TEST(CudaChunkLossErrorsTest, BadInputsAreClearErrors) {
  SKIP_WITHOUT_GPU(gpu);
  const v1::LossConfig config = Loss("dflash { gamma: 7 }");
  const ChunkLossOptions options{kK, 1, 0};
  Problem p = MakeProblem(13, 3);
  p.rows[4].target = 13;
  p.rows[4].mask = 1;
  EXPECT_EQ(
      RunLoss<float>(config, options, p, gpu.get()).terms.status().message(),
      "row 4: target id 13 is outside [0, 13)");
  p = MakeProblem(13, 3);
  p.rows[2].position = kK;
  EXPECT_EQ(
      RunLoss<float>(config, options, p, gpu.get()).terms.status().message(),
      "row 2: block position 5 is outside [0, 5)");
  // A gradient that overflows float32 is an error, as on the CPU.
  p = MakeProblem(13, 3);
  p.rows[6].mask = 1e30f;
  p.rows[6].target = 1;
  EXPECT_EQ(RunLoss<float>(Loss("dpace { alpha: 0.3 }"), options, p, gpu.get())
                .terms.status()
                .message(),
            "row 6: d(loss)/d(logits) overflows float32; masks and loss "
            "weights this large need rescaling");
  // The device's error codes hold vocabularies below 2^30 (the check comes
  // before any value is read).
  p = MakeProblem(13, 3);
  std::vector<float> one(1);
  const RowMeta row = p.rows[1];
  EXPECT_EQ(CudaChunkLossFromHost<float>(
                config, options,
                {absl::MakeSpan(one.data(), int64_t{1} << 30),
                 {},
                 {},
                 absl::MakeConstSpan(&row, 1),
                 int64_t{1} << 30},
                {}, *gpu)
                .status()
                .message(),
            "cuda chunk loss: vocab and rows must lie below 2^30 (the "
            "device's error codes), got vocab 1073741824 and 1 rows");
  // The same messages as the CPU's where both see the problem first.
  p = MakeProblem(13, 3);
  p.rows[2].position = kK;
  EXPECT_EQ(
      RunLoss<float>(config, options, p, nullptr).terms.status().message(),
      "row 2: block position 5 is outside [0, 5)");
}

// Non-finite logits, teacher logits and confidence logits: the GPU names
// the row, the first bad logit and its value in the CPU's words.
TEST(CudaChunkLossErrorsTest, NonFiniteInputsGiveTheCpuMessages) {
  SKIP_WITHOUT_GPU(gpu);
  const ChunkLossOptions options{kK, 1, 0};
  struct Bad {
    const char* loss;
    const char* want;
    void (*plant)(Problem&);
  };
  const Bad cases[] = {
      {"dflash { gamma: 7 }", "row 6: logit 5 is not finite (nan)",
       [](Problem& p) { p.logits[6 * 13 + 5] = NAN; }},
      {"dflash { gamma: 7 }", "row 6: logit 2 is not finite (-inf)",
       [](Problem& p) {
         p.logits[6 * 13 + 9] = NAN;
         p.logits[6 * 13 + 2] = -INFINITY;
       }},
      {"dspark { gamma: 7 l1_weight: 0.5 }",
       "row 6: teacher logits: logit 3 is not finite (inf)",
       [](Problem& p) { p.teacher[6 * 13 + 3] = INFINITY; }},
      {"dspark { gamma: 7 confidence_weight: 0.3 }",
       "row 6: confidence logit is not finite (nan)",
       [](Problem& p) { p.confidence[6] = NAN; }},
      {"distillation { divergence: FORWARD_KL }",
       "row 6: teacher logits: logit 0 is not finite (nan)",
       [](Problem& p) { p.teacher[6 * 13] = NAN; }},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.want);
    Problem p = MakeProblem(13, 3);
    // Every row of block 1 weighted, so each backend reads row 6.
    for (int64_t r = kK; r < 2 * kK; ++r) p.rows[r].mask = 1;
    bad.plant(p);
    const v1::LossConfig config = Loss(bad.loss);
    const Outcome cpu = RunLoss<float>(config, options, p, nullptr);
    const Outcome got = RunLoss<float>(config, options, p, gpu.get());
    EXPECT_EQ(cpu.terms.status().message(), bad.want);
    EXPECT_EQ(got.terms.status().message(), bad.want);
  }
}

// One chunk through CudaChunkLoss itself: the logits `offset` elements past
// an aligned allocation, rows `stride` apart (0: V; the padding NaN); per-row
// outputs of the chunk's row i at out_rows[i] of out_size rows (none: at i);
// run once per entry of `records` (false: a recomputation, whose terms are
// not kept). The gradient comes back unpadded.
template <typename T>
Outcome RunOnDevice(const v1::LossConfig& config,
                    const ChunkLossOptions& options, const Problem& p,
                    CudaStream& gpu, int64_t offset,
                    const std::vector<int64_t>& out_rows = {},
                    int64_t out_size = kRows,
                    const std::vector<bool>& records = {true},
                    int64_t stride = 0) {
  const int64_t v = p.vocab, row_stride = stride > 0 ? stride : v;
  const int64_t count = kRows * row_stride;
  std::vector<double> padded(count, std::nan(""));
  for (int64_t r = 0; r < kRows; ++r) {
    std::copy_n(p.logits.begin() + r * v, v, padded.begin() + r * row_stride);
  }
  const std::vector<T> host = FromDoubles<T>(padded);
  Outcome out;
  auto fail = [&](const absl::Status& status) {
    out.terms = status;
    return out;
  };
  auto logits = TrackedBuffer<T>::Create(gpu.allocator(), count + offset);
  auto neg_log_q = TrackedBuffer<double>::Create(gpu.allocator(), out_size);
  auto argmax = TrackedBuffer<int32_t>::Create(gpu.allocator(), out_size);
  auto top_k =
      TrackedBuffer<int32_t>::Create(gpu.allocator(), out_size * kTopK);
  auto rows = TrackedBuffer<int64_t>::Create(
      gpu.allocator(), static_cast<int64_t>(out_rows.size()));
  for (const absl::Status& status :
       {logits.status(), neg_log_q.status(), argmax.status(), top_k.status(),
        rows.status()}) {
    if (!status.ok()) return fail(status);
  }
  out.neg_log_q.assign(out_size, 7);
  out.argmax.assign(out_size, 7);
  out.top_k.assign(out_size * kTopK, 7);
  for (const absl::Status& status :
       {gpu.CopyToDevice(rows->data(), out_rows.data(), rows->bytes()),
        gpu.CopyToDevice(neg_log_q->data(), out.neg_log_q.data(),
                         neg_log_q->bytes()),
        gpu.CopyToDevice(argmax->data(), out.argmax.data(), argmax->bytes()),
        gpu.CopyToDevice(top_k->data(), out.top_k.data(), top_k->bytes())}) {
    if (!status.ok()) return fail(status);
  }
  absl::StatusOr<LossParams> params = ResolveChunkLoss(config);
  if (!params.ok()) return fail(params.status());
  auto loss = CudaChunkLoss<T>::Create(*params, options, gpu);
  if (!loss.ok()) return fail(loss.status());
  T* z = logits->data() + offset;
  for (bool record : records) {
    // Each run overwrites the logits with their gradient.
    if (absl::Status ok = gpu.CopyToDevice(z, host.data(), count * sizeof(T));
        !ok.ok()) {
      return fail(ok);
    }
    const ChunkLossInputs<T> inputs{
        absl::MakeSpan(z, count), {}, {}, p.rows, p.vocab, {}, stride};
    const ChunkLossOutputs outputs{
        {},
        absl::MakeSpan(neg_log_q->data(), out_size),
        absl::MakeSpan(argmax->data(), out_size),
        absl::MakeSpan(top_k->data(), out_size * kTopK),
        kTopK};
    if (absl::Status ok = (*loss)->Run(
            inputs, outputs, out_rows.empty() ? nullptr : rows->data(), record);
        !ok.ok()) {
      return fail(ok);
    }
  }
  out.terms = (*loss)->Terms();
  std::vector<T> grad(count);
  for (const absl::Status& status :
       {gpu.CopyToHost(grad.data(), z, count * sizeof(T)),
        gpu.CopyToHost(out.neg_log_q.data(), neg_log_q->data(),
                       neg_log_q->bytes()),
        gpu.CopyToHost(out.argmax.data(), argmax->data(), argmax->bytes()),
        gpu.CopyToHost(out.top_k.data(), top_k->data(), top_k->bytes())}) {
    if (!status.ok()) return fail(status);
  }
  const std::vector<double> padded_grad = AsDoubles(grad);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t i = 0; i < row_stride; ++i) {
      const double x = padded_grad[r * row_stride + i];
      if (i < v) {
        out.grad.push_back(x);
      } else if (!std::isnan(x)) {
        out.terms = absl::InternalError(
            absl::StrCat("row ", r, ": padding ", i, " changed to ", x));
      }
    }
  }
  return out;
}

// The same run by another path: terms within the reductions' order, the
// gradient within `grad_tolerance` in relative norm, argmax and top-k
// exact.
void ExpectSameResult(const Outcome& got, const Outcome& want,
                      double grad_tolerance) {
  ASSERT_TRUE(want.terms.ok()) << want.terms.status();
  ASSERT_TRUE(got.terms.ok()) << got.terms.status();
  EXPECT_NEAR(got.terms->loss_num, want.terms->loss_num,
              1e-6 * std::abs(want.terms->loss_num));
  EXPECT_LT(RelativeNormError(got.grad, want.grad), grad_tolerance);
  EXPECT_EQ(got.argmax, want.argmax);
  EXPECT_EQ(got.top_k, want.top_k);
}

// Rows of a vocabulary not divisible by 8 (50257, GPT-2's), padded to 16
// bytes as the CUDA head pads them, take the vector path: the result of
// the unpadded (scalar) path, the padding (NaN) neither read nor changed.
TEST(CudaChunkLossLayoutTest, PaddedRowsGiveTheSameResult) {
  SKIP_WITHOUT_GPU(gpu);
  const Problem p = MakeProblem(50257, 55);
  for (double softcap : {0.0, 5.0}) {
    const ChunkLossOptions options{kK, 1, softcap};
    for (const char* loss : {"dflash { gamma: 7 }", "dpace { alpha: 0.3 }"}) {
      SCOPED_TRACE(absl::StrCat(loss, " softcap ", softcap));
      const v1::LossConfig config = Loss(loss);
      const Outcome plain = RunOnDevice<BFloat16>(config, options, p, *gpu, 0);
      const Outcome padded = RunOnDevice<BFloat16>(config, options, p, *gpu, 0,
                                                   {}, kRows, {true}, 50264);
      ExpectSameResult(padded, plain, 4e-3);
    }
  }
}

// Logits one element past a 16-byte boundary take the scalar path: the
// same argmax and top-k, and terms and gradient within the reductions'
// different order (BF16: within one bfloat16 rounding).
TEST(CudaChunkLossLayoutTest, MisalignedLogitsGiveTheSameResult) {
  SKIP_WITHOUT_GPU(gpu);
  const ChunkLossOptions options{kK, 1, 5};
  const Problem p = MakeProblem(1024, 51);
  for (const char* loss : {"dflash { gamma: 7 }", "dpace { alpha: 0.3 }"}) {
    SCOPED_TRACE(loss);
    const v1::LossConfig config = Loss(loss);
    ExpectSameResult(RunOnDevice<float>(config, options, p, *gpu, 1),
                     RunOnDevice<float>(config, options, p, *gpu, 0), 1e-6);
    ExpectSameResult(RunOnDevice<BFloat16>(config, options, p, *gpu, 1),
                     RunOnDevice<BFloat16>(config, options, p, *gpu, 0), 4e-3);
  }
}

// Compacted rows: the chunk's row i writes its outputs at out_rows[i] of a
// larger array (the rows between keep their values); a recomputation
// (record false) adds no terms, a second recorded run adds them again.
TEST(CudaChunkLossLayoutTest, CompactedRowsWithRecordedAndUnrecordedRuns) {
  SKIP_WITHOUT_GPU(gpu);
  const ChunkLossOptions options{kK, 1, 0};
  const Problem p = MakeProblem(1000, 53);
  std::vector<int64_t> out_rows;
  for (int64_t r = 0; r < kRows; ++r) out_rows.push_back(2 * (kRows - 1 - r));
  for (const char* loss : {"dflash { gamma: 7 }", "dpace { alpha: 0.3 }"}) {
    SCOPED_TRACE(loss);
    const v1::LossConfig config = Loss(loss);
    const Outcome cpu = RunLoss<float>(config, options, p, nullptr);
    const Outcome once = RunOnDevice<float>(config, options, p, *gpu, 0,
                                            out_rows, 2 * kRows, {false, true});
    const Outcome twice = RunOnDevice<float>(config, options, p, *gpu, 0,
                                             out_rows, 2 * kRows, {true, true});
    ASSERT_TRUE(cpu.terms.ok() && once.terms.ok() && twice.terms.ok());
    EXPECT_NEAR(once.terms->loss_num, cpu.terms->loss_num,
                1e-5 * std::abs(cpu.terms->loss_num));
    EXPECT_EQ(once.terms->correct, cpu.terms->correct);
    EXPECT_NEAR(twice.terms->loss_num, 2 * cpu.terms->loss_num,
                2e-5 * std::abs(cpu.terms->loss_num));
    EXPECT_LT(RelativeNormError(once.grad, cpu.grad), 1e-5);
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t o = out_rows[r];
      EXPECT_NEAR(once.neg_log_q[o], cpu.neg_log_q[r],
                  1e-5 * (1 + std::abs(cpu.neg_log_q[r])))
          << "row " << r;
      EXPECT_EQ(once.argmax[o], cpu.argmax[r]) << "row " << r;
      for (int32_t j = 0; j < kTopK; ++j) {
        EXPECT_EQ(once.top_k[o * kTopK + j], cpu.top_k[r * kTopK + j]);
      }
      EXPECT_EQ(once.argmax[o + 1], 7) << "untouched row " << o + 1;
      EXPECT_EQ(once.neg_log_q[o + 1], 7) << "untouched row " << o + 1;
    }
  }
}

// A split run's backward recomputes chunks (record false) and reads no
// terms: the host copies of their metadata are held until the stream has
// run them, then ReleaseHostRows frees them, so repeated backwards hold no
// more than one; Terms() frees them too, and the terms are the recorded
// chunk's alone (the CPU's).
TEST(CudaChunkLossLayoutTest, HostRowsAreFreedAfterTheWait) {
  SKIP_WITHOUT_GPU(gpu);
  const ChunkLossOptions options{kK, 1, 0};
  const Problem p = MakeProblem(300, 57);
  const v1::LossConfig config = Loss("dflash { gamma: 7 }");
  const Outcome cpu = RunLoss<float>(config, options, p, nullptr);
  ASSERT_TRUE(cpu.terms.ok()) << cpu.terms.status();
  absl::StatusOr<LossParams> params = ResolveChunkLoss(config);
  ASSERT_TRUE(params.ok()) << params.status();
  auto loss = CudaChunkLoss<float>::Create(*params, options, *gpu);
  ASSERT_TRUE(loss.ok()) << loss.status();
  const int64_t count = kRows * p.vocab;
  auto logits = TrackedBuffer<float>::Create(gpu->allocator(), count);
  ASSERT_TRUE(logits.ok()) << logits.status();
  const std::vector<float> host = FromDoubles<float>(p.logits);
  auto run = [&](bool record) {
    // Each run overwrites the logits with their gradient.
    ASSERT_TRUE(gpu->CopyToDevice(logits->data(), host.data(),
                                  count * sizeof(float))
                    .ok());
    const ChunkLossInputs<float> inputs{
        absl::MakeSpan(logits->data(), count), {}, {}, p.rows, p.vocab};
    ASSERT_TRUE((*loss)->Run(inputs, ChunkLossOutputs{}, nullptr, record).ok());
  };
  for (int backward = 0; backward < 3; ++backward) {
    for (int64_t chunk = 1; chunk <= 2; ++chunk) {
      run(/*record=*/false);
      EXPECT_EQ((*loss)->host_row_chunks(), chunk);
    }
    ASSERT_TRUE(gpu->Synchronize().ok());
    (*loss)->ReleaseHostRows();
    EXPECT_EQ((*loss)->host_row_chunks(), 0) << "backward " << backward;
  }
  run(/*record=*/true);
  EXPECT_EQ((*loss)->host_row_chunks(), 1);
  const absl::StatusOr<ChunkTerms> terms = (*loss)->Terms();
  EXPECT_EQ((*loss)->host_row_chunks(), 0);
  ASSERT_TRUE(terms.ok()) << terms.status();
  EXPECT_NEAR(terms->loss_num, cpu.terms->loss_num,
              1e-5 * std::abs(cpu.terms->loss_num));
  EXPECT_EQ(terms->correct, cpu.terms->correct);
}

// One loss chunk of more than 2^31 logits (16400 rows x V 131072 in FP32,
// filled on the device): sampled rows, among them the first whose logits
// lie past the 2^31st, against the CPU loss on the same rows' logits.
TEST(CudaChunkLossLargeTest, ChunkBeyondTwoToThe31Logits) {
  SKIP_WITHOUT_GPU(gpu);
  constexpr int64_t kLargeRows = 16400, kVocab = 131072;
  static_assert(kLargeRows * kVocab > (int64_t{1} << 31), "past 2^31 logits");
  const int64_t count = kLargeRows * kVocab;
  auto logits = TrackedBuffer<float>::Create(gpu->allocator(), count);
  auto neg_log_q = TrackedBuffer<double>::Create(gpu->allocator(), kLargeRows);
  ASSERT_TRUE(logits.ok() && neg_log_q.ok());
  LaunchFillNormal<float>(logits->data(), count, 2.0f, 71, gpu->stream());
  ASSERT_TRUE(gpu->Synchronize().ok());
  std::vector<RowMeta> rows(kLargeRows);
  for (int64_t r = 0; r < kLargeRows; ++r) {
    rows[r].block = r / kK;
    rows[r].position = static_cast<int32_t>(r % kK);
    rows[r].target = static_cast<int32_t>((r * 7919) % kVocab);
    rows[r].mask = 1;
  }
  const int64_t past = (int64_t{1} << 31) / kVocab;
  const std::vector<int64_t> sampled = {0, past - 1, past, kLargeRows - 1};
  const int64_t n = static_cast<int64_t>(sampled.size());
  // The sampled rows before the loss overwrites them with their gradient.
  std::vector<float> cpu_logits(n * kVocab), got_grad(n * kVocab);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(gpu->CopyToHost(cpu_logits.data() + i * kVocab,
                                logits->data() + sampled[i] * kVocab,
                                kVocab * sizeof(float))
                    .ok());
  }
  const v1::LossConfig config = Loss("dflash { gamma: 7 }");
  const ChunkLossOptions options{kK, 1, 0};
  absl::StatusOr<LossParams> params = ResolveChunkLoss(config);
  ASSERT_TRUE(params.ok()) << params.status();
  auto loss = CudaChunkLoss<float>::Create(*params, options, *gpu);
  ASSERT_TRUE(loss.ok()) << loss.status();
  const ChunkLossInputs<float> inputs{
      absl::MakeSpan(logits->data(), count), {}, {}, rows, kVocab};
  const ChunkLossOutputs outputs{{},
                                 absl::MakeSpan(neg_log_q->data(), kLargeRows)};
  ASSERT_TRUE((*loss)->Run(inputs, outputs, nullptr, true).ok());
  const absl::StatusOr<ChunkTerms> terms = (*loss)->Terms();
  ASSERT_TRUE(terms.ok()) << terms.status();
  std::vector<double> got_nlq(kLargeRows);
  ASSERT_TRUE(
      gpu->CopyToHost(got_nlq.data(), neg_log_q->data(), neg_log_q->bytes())
          .ok());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(gpu->CopyToHost(got_grad.data() + i * kVocab,
                                logits->data() + sampled[i] * kVocab,
                                kVocab * sizeof(float))
                    .ok());
  }
  // The CPU loss on the sampled rows alone: each row's gradient and -log q
  // are its own (no block coupling in dflash).
  std::vector<RowMeta> cpu_rows;
  for (int64_t r : sampled) cpu_rows.push_back(rows[r]);
  std::vector<double> cpu_nlq(n);
  const ChunkLossInputs<float> cpu_inputs{
      absl::MakeSpan(cpu_logits), {}, {}, cpu_rows, kVocab};
  const ChunkLossOutputs cpu_outputs{{}, absl::MakeSpan(cpu_nlq)};
  // ChunkLoss leaves the rows' gradient in cpu_logits.
  ASSERT_TRUE(ChunkLoss<float>(config, options, cpu_inputs, cpu_outputs).ok());
  for (int64_t i = 0; i < n; ++i) {
    SCOPED_TRACE(absl::StrCat("row ", sampled[i]));
    EXPECT_NEAR(got_nlq[sampled[i]], cpu_nlq[i], 1e-5 * (1 + cpu_nlq[i]));
    const std::vector<double> got(got_grad.begin() + i * kVocab,
                                  got_grad.begin() + (i + 1) * kVocab);
    const std::vector<double> want(cpu_logits.begin() + i * kVocab,
                                   cpu_logits.begin() + (i + 1) * kVocab);
    EXPECT_LT(RelativeNormError(got, want), 1e-5);
  }
}

// Without a GPU, the stream says why; this runs everywhere.
TEST(CudaChunkLossErrorsTest, NoDeviceIsAnUnavailableStatus) {
  DFLASH_WITHOUT_GPU_OR_SKIP(CudaStream::Create().ok());
  absl::StatusOr<std::unique_ptr<CudaStream>> stream = CudaStream::Create();
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(stream.status().message().find("CUDA"), std::string::npos)
      << stream.status();
}

}  // namespace
}  // namespace dflash
