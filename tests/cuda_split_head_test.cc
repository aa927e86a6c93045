// StartCudaHead: the CUDA head's forward and backward passes apart give
// RunCudaHead's loss and gradients, hold no gradient-sized buffer between
// the passes in CHECKPOINT mode (the FP32 sums of BF16 weight gradients
// included), repeat, and scale by the upstream given at Backward.
// RunCudaHead is checked against the float64 CPU head by
// //tests:cuda_head_parity_test and //tests:cuda_correction_test.
//
// saved_bytes is the sum of the buffers the CUDA backend keeps between the
// passes, from their sizes (HeldBytes), and what the stream's allocator
// shows live after the forward pass (the backend keeps nothing on the
// device outside it).
//
// Not bitwise: RunCudaHead folds the scale the rows decide into its
// input-gradient GEMMs at Start, the split run upstream x the finished
// scale at Backward; the two agree to 1e-9 relative, but their FP32 alphas
// may differ by an ulp. So FP32 within 1e-6 (normwise), BF16 within 1e-2
// (an ulp of bfloat16 on some entries). Skipped, with the reason, where no
// GPU is usable.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cuda_head.h"
#include "heads/head_types.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/row_meta.h"
#include "losses/term_slots.h"
#include "losses/vocab_shard.h"
#include "tests/cuda_test_util.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using head_test::MakeBatch;

constexpr int64_t kRank = 3;

// A run's gradients on the device, filled with 7 (the head overwrites).
template <typename T>
struct DeviceGradients {
  DeviceGradients(const Batch& b, int64_t rank, CudaStream& stream)
      : hidden(Upload<T>(std::vector<double>(b.hidden.size(), 7), stream)),
        weight(Upload<T>(std::vector<double>(b.weight.size(), 7), stream)),
        bias(Upload<T>(std::vector<double>(b.bias.size(), 7), stream)),
        z(Upload<T>(std::vector<double>(b.num_rows() * rank, 7), stream)),
        m(Upload<T>(std::vector<double>(head_test::kV * rank, 7), stream)) {}
  HeadGradients<T> View() {
    return {Span(hidden), Span(weight), Span(bias), {}, Span(z), Span(m)};
  }
  std::vector<std::vector<double>> Host(CudaStream& stream) const {
    return {Download(hidden, stream), Download(weight, stream),
            Download(bias, stream), Download(z, stream), Download(m, stream)};
  }
  TrackedBuffer<T> hidden, weight, bias, z, m;
};

double Relative(const std::vector<double>& a, const std::vector<double>& b) {
  return RelativeMaxError<double>(a, b);
}

// The device bytes a split run of `mode` keeps between its passes, from the
// buffers' sizes (host rows, COMPACT): the loss's term totals (doubles, the
// slots then [K] per position term) and its error word; the active-row
// list (int64); per row, q (double), the target's rank under a top-k
// metric (int32), the teacher acceptance where recorded (double) and
// Domino's two argmaxes (int32); SAVE_CHUNKS adds every active row's
// logits gradient, rows padded to 16 bytes, twice with a split correction.
template <typename T>
int64_t HeldBytes(const v1::ObjectiveConfig& config, const Batch& b,
                  const std::string& mode) {
  const LossParams loss = LossParamsOf(config.loss());
  int64_t active = 0;
  for (const RowMeta& row : b.rows) {
    active += EffectiveMask(loss, row.target, row.mask) > 0;
  }
  int64_t row_bytes = 8;
  if (ChunkLossOptionsOf(config).metric_top_k > 0) row_bytes += 4;
  if (RecordsTeacherAcceptance(config)) row_bytes += 8;
  if (config.loss().has_domino()) row_bytes += 2 * 4;
  int64_t held = TotalsSize(config.layout().block_size()) * 8 + 8 +
                 active * 8 + b.num_rows() * row_bytes;
  if (mode == "SAVE_CHUNKS") {
    const int64_t element = sizeof(T);
    const int64_t row = (head_test::kV * element + 15) / 16 * 16;
    held += (config.head().correction_rank() > 0 ? 2 : 1) * active * row;
  }
  return held;
}

template <typename T>
void ExpectSplitMatches(const char* loss, const char* mode, bool correction,
                        Gpu& gpu) {
  ConfigBuilder builder(loss);
  builder.Mode(mode).Trainable();
  if (correction) builder.ExtraHead(absl::StrCat("correction_rank: ", kRank));
  v1::ObjectiveConfig config = builder.Build();
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(std::is_same_v<T, float>
                                       ? v1::HeadConfig::FLOAT32
                                       : v1::HeadConfig::BFLOAT16);
  const int64_t rank = correction ? kRank : 0;
  CudaStream& stream = *gpu.stream;
  const Batch b = MakeBatch(7);
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> uniform(-1, 1);
  std::vector<double> z_host(b.num_rows() * rank), m_host(head_test::kV * rank);
  for (double& x : z_host) x = uniform(rng);
  for (double& x : m_host) x = uniform(rng);
  TrackedBuffer<T> hidden = Upload<T>(b.hidden, stream);
  TrackedBuffer<T> weight = Upload<T>(b.weight, stream);
  TrackedBuffer<T> bias = Upload<T>(b.bias, stream);
  TrackedBuffer<T> z = Upload<T>(z_host, stream), m = Upload<T>(m_host, stream);
  const HeadInputs<T> inputs{Span(hidden), {},           {},     b.rows,
                             Span(weight), Span(bias), Span(z), Span(m)};

  DeviceGradients<T> whole(b, rank, stream);
  absl::StatusOr<HeadResult> reference =
      RunCudaHead<T>(config, inputs, whole.View(), *gpu.blas);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(reference->stats.saved_bytes, 0);  // Nothing outlives the run.
  const auto want = whole.Host(stream);

  TrackingAllocator& allocator = stream.allocator();
  const int64_t base = allocator.current_bytes();
  auto split = StartCudaHead<T>(config, inputs, *gpu.blas);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ((*split)->forward().loss, reference->loss);
  // CHECKPOINT: per-row state only, no logits, no gradient.
  const int64_t held = HeldBytes<T>(config, b, mode);
  EXPECT_EQ(allocator.current_bytes() - base, held);
  EXPECT_EQ((*split)->saved_bytes(), held);
  EXPECT_EQ((*split)->forward().stats.saved_bytes, held);
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-2;
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(pass);
    const int64_t before = allocator.current_bytes();
    DeviceGradients<T> got(b, rank, stream);
    const int64_t buffers = allocator.current_bytes() - before;
    absl::StatusOr<HeadStats> stats =
        (*split)->Backward(1.0, got.View(), nullptr);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->saved_bytes, 0);  // A backward pass's stats.
    if (std::is_same_v<T, BFloat16>) {
      // The FP32 weight-gradient sum lives in Backward only.
      EXPECT_GE(stats->peak_bytes,
                static_cast<int64_t>(b.weight.size() * sizeof(float)));
    }
    const auto have = got.Host(stream);
    for (size_t i = 0; i < have.size(); ++i) {
      EXPECT_LE(Relative(have[i], want[i]), tolerance) << "gradient " << i;
    }
    // Backward frees what it allocated (the caller's buffers aside).
    EXPECT_EQ(allocator.current_bytes() - base - buffers, held);
    EXPECT_EQ((*split)->saved_bytes(), held);
  }
  // Upstream 2 doubles every gradient (exact in any precision).
  std::vector<std::vector<double>> one, two;
  {
    DeviceGradients<T> once(b, rank, stream), twice(b, rank, stream);
    ASSERT_TRUE((*split)->Backward(1.0, once.View(), nullptr).ok());
    ASSERT_TRUE((*split)->Backward(2.0, twice.View(), nullptr).ok());
    one = once.Host(stream);
    two = twice.Host(stream);
  }
  for (size_t i = 0; i < one.size(); ++i) {
    std::vector<double> doubled = one[i];
    for (double& x : doubled) x *= 2;
    EXPECT_LE(Relative(two[i], doubled), tolerance) << "gradient " << i;
  }
  split->reset();
  EXPECT_EQ(allocator.current_bytes(), base);
}

TEST(CudaSplitHeadTest, EqualsRunCudaHead) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  for (const char* mode : {"SAVE_CHUNKS", "CHECKPOINT"}) {
    for (const auto& [loss, correction] :
         {std::pair<const char*, bool>{"dflash { gamma: 7 }", false},
          {"dpace { alpha: 0.3 }", false},
          {"domino { lambda_base: 0.3 gamma: 3 }", true}}) {
      SCOPED_TRACE(absl::StrCat(mode, " ", loss));
      {
        SCOPED_TRACE("float32");
        ExpectSplitMatches<float>(loss, mode, correction, *gpu);
      }
      {
        SCOPED_TRACE("bfloat16");
        ExpectSplitMatches<BFloat16>(loss, mode, correction, *gpu);
      }
    }
  }
}

TEST(CudaSplitHeadTest, FusedAndVocabShardAreRefused) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  v1::ObjectiveConfig config = ConfigBuilder("dflash {}").Mode("FUSED").Build();
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
  auto split = StartCudaHead<float>(config, {}, *gpu->blas);
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("head.mode"), std::string::npos)
      << split.status();
  const VocabShard shard{0, head_test::kV, nullptr};
  HeadOptions options;
  options.vocab_shard = &shard;
  config.mutable_head()->set_mode(v1::HeadConfig::CHECKPOINT);
  split = StartCudaHead<float>(config, {}, *gpu->blas, {}, options);
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("vocab_shard"), std::string::npos)
      << split.status();
}

}  // namespace
}  // namespace dflash
