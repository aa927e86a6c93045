// The CPU head's parity suite re-run on the CUDA backend: every loss family
// and mode, chunk and segment sizes, frozen and trainable, against the same
// float64 reference (FP32 within 1e-5); BF16 within SpecForge's tolerances;
// device peak bytes within chunk-sized bounds. Skipped, with the reason,
// where no GPU is usable.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/gpu_test.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cpu_head.h"
#include "heads/cuda_head.h"
#include "heads/top_k_gradient.h"
#include "proto/config.h"
#include "tests/cuda_test_util.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using namespace head_test;  // NOLINT: the suite's shared vocabulary.

#define OPEN_GPU_OR_SKIP(gpu)          \
  absl::StatusOr<Gpu> gpu = OpenGpu(); \
  DFLASH_SKIP_WITHOUT_GPU(gpu.status())

// One RunCudaHead of `config` over `b`, results back on the host.
struct GpuRun {
  absl::StatusOr<HeadResult> result;
  RunOutputs outputs;
  int64_t leaked_bytes = 0;
  bool idle_on_return = false;  // Nothing left queued when it returned.
};

template <typename T>
GpuRun RunOnGpu(const v1::ObjectiveConfig& config, const Batch& b, Gpu& gpu) {
  CudaStream& stream = *gpu.stream;
  const int64_t base = stream.allocator().current_bytes();
  GpuRun run;
  {
    const bool trainable = config.head().trainable();
    const bool bias = config.head().bias();
    const bool teacher = ProjectsTeacher(config);
    const bool conf = config.loss().has_dspark() &&
                      config.loss().dspark().confidence_weight() > 0;
    const int64_t n = b.num_rows();
    TrackedBuffer<T> hidden = Upload<T>(b.hidden, stream);
    TrackedBuffer<T> teacher_hidden =
        Upload<T>(teacher ? b.teacher : std::vector<double>(), stream);
    TrackedBuffer<T> weight = Upload<T>(b.weight, stream);
    TrackedBuffer<T> bias_values =
        Upload<T>(bias ? b.bias : std::vector<double>(), stream);
    TrackedBuffer<float> confidence =
        Upload<float>(conf ? b.confidence : std::vector<double>(), stream);
    TrackedBuffer<T> grad_hidden =
        Upload<T>(std::vector<double>(n * kH, 7), stream);
    TrackedBuffer<T> grad_weight =
        Upload<T>(std::vector<double>(trainable ? kV * kH : 0, 7), stream);
    TrackedBuffer<T> grad_bias =
        Upload<T>(std::vector<double>(trainable && bias ? kV : 0, 7), stream);
    TrackedBuffer<float> grad_confidence =
        Upload<float>(std::vector<double>(conf ? n : 0, 7), stream);
    TrackedBuffer<double> neg_log_q =
        Upload<double>(std::vector<double>(n, 7), stream);
    TrackedBuffer<int32_t> argmax =
        Upload<int32_t>(std::vector<int32_t>(n, 7), stream);
    TrackedBuffer<int32_t> top_k =
        Upload<int32_t>(std::vector<int32_t>(n * kTopK, 7), stream);
    const HeadInputs<T> inputs{Span(hidden),     Span(teacher_hidden),
                               Span(confidence), b.rows,
                               Span(weight),     Span(bias_values)};
    const HeadGradients<T> gradients{Span(grad_hidden), Span(grad_weight),
                                     Span(grad_bias), Span(grad_confidence)};
    const HeadRowOutputs outputs{Span(neg_log_q), Span(argmax), Span(top_k),
                                 kTopK};
    run.result = RunCudaHead<T>(config, inputs, gradients, *gpu.blas, outputs);
    run.idle_on_return = stream.Idle();
    RunOutputs& o = run.outputs;
    o.grad_hidden = Download(grad_hidden, stream);
    o.grad_weight = Download(grad_weight, stream);
    o.grad_bias = Download(grad_bias, stream);
    o.grad_confidence = Download(grad_confidence, stream);
    o.neg_log_q = CopyBack(neg_log_q, stream);
    o.argmax = CopyBack(argmax, stream);
    o.top_k = CopyBack(top_k, stream);
  }
  EXPECT_TRUE(stream.Synchronize().ok());
  run.leaked_bytes = stream.allocator().current_bytes() - base;
  return run;
}

v1::ObjectiveConfig OnCuda(v1::ObjectiveConfig config,
                           v1::HeadConfig::DType dtype) {
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(dtype);
  return config;
}

class CudaHeadParityTest
    : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(CudaHeadParityTest, Float32MatchesTheFloat64Reference) {
  OPEN_GPU_OR_SKIP(gpu);
  const std::string loss = kLosses[std::get<0>(GetParam())];
  const std::string mode = std::get<1>(GetParam());
  const Batch b = MakeBatch(3);
  const int64_t blocks = b.batch * b.anchors;
  const bool segmented = mode == "CHECKPOINT" || mode == "SELECTIVE";
  for (bool trainable : {false, true}) {
    if (trainable && !TrainsWith(loss)) continue;
    const Reference ref = Naive(ConfigBuilder(loss)
                                    .Mode(mode)
                                    .BlocksPerChunk(1)
                                    .Trainable(trainable)
                                    .Build(),
                                b);
    for (int64_t chunk : {int64_t{1}, int64_t{3}, blocks}) {
      for (int64_t segment : {int64_t{1}, int64_t{2}, int64_t{1000}}) {
        if (!segmented && segment != 1) continue;
        SCOPED_TRACE(absl::StrCat(mode, " chunk ", chunk, " segment ", segment,
                                  " trainable ", trainable));
        const v1::ObjectiveConfig config = OnCuda(ConfigBuilder(loss)
                                                      .Mode(mode)
                                                      .BlocksPerChunk(chunk)
                                                      .Segment(segment)
                                                      .Trainable(trainable)
                                                      .Build(),
                                                  v1::HeadConfig::FLOAT32);
        const GpuRun run = RunOnGpu<float>(config, b, *gpu);
        ASSERT_TRUE(run.result.ok()) << run.result.status();
        ExpectMatchesReference(*run.result, run.outputs, ref, b, trainable,
                               1e-5, 1e-5);
        EXPECT_EQ(run.leaked_bytes, 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    LossesAndModes, CudaHeadParityTest,
    ::testing::Combine(::testing::Range(0,
                                        static_cast<int>(std::size(kLosses))),
                       ::testing::ValuesIn(kModes)),
    [](const ::testing::TestParamInfo<std::tuple<int, const char*>>& info) {
      return absl::StrCat("Loss", std::get<0>(info.param), "_",
                          std::get<1>(info.param));
    });

// sqrt(sum (a - b)^2 / sum b^2).
double RelativeNorm(const std::vector<double>& a,
                    const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / norm);
}

// The DFlash2 outputs and the diagnostics on the GPU against the CPU head
// in float32: top-k ids (exact), values and loss weights, the per-position
// diagnostics and accepted lengths; then the values' backward
// (AddCudaTopKValueGradients against AddTopKValueGradients), frozen and
// trainable, with a softcap.
TEST(CudaHeadTopKTest, ValuesDiagnosticsAndTheirBackwardMatchTheCpu) {
  OPEN_GPU_OR_SKIP(gpu);
  const Batch b = MakeBatch(8);
  const int64_t n = b.num_rows();
  for (const char* loss : {"dflash { gamma: 7 }", "dpace { alpha: 0.3 }"}) {
    for (bool trainable : {false, true}) {
      SCOPED_TRACE(absl::StrCat(loss, " trainable ", trainable));
      const v1::ObjectiveConfig cpu_config =
          ConfigBuilder(loss).Mode("CHECKPOINT").Trainable(trainable).Build();
      v1::ObjectiveConfig f32 = cpu_config;
      f32.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
      f32.mutable_head()->set_logit_softcap(6);
      f32.mutable_head()->set_metric_top_k(4);
      // The CPU head in float32.
      const std::vector<float> hidden(b.hidden.begin(), b.hidden.end());
      const std::vector<float> weight(b.weight.begin(), b.weight.end());
      const std::vector<float> bias(b.bias.begin(), b.bias.end());
      std::vector<float> grad_hidden(n * kH),
          grad_weight(trainable ? kV * kH : 0), grad_bias(trainable ? kV : 0),
          values(n * kTopK);
      std::vector<double> weights(n);
      std::vector<int32_t> ids(n * kTopK);
      const HeadInputs<float> inputs{hidden, {}, {}, b.rows, weight, bias};
      const HeadGradients<float> gradients{absl::MakeSpan(grad_hidden),
                                           absl::MakeSpan(grad_weight),
                                           absl::MakeSpan(grad_bias),
                                           {}};
      HeadRowOutputs outputs;
      outputs.top_k = absl::MakeSpan(ids);
      outputs.k = kTopK;
      outputs.top_k_values = absl::MakeSpan(values);
      outputs.loss_weight = absl::MakeSpan(weights);
      TrackingAllocator allocator;
      absl::StatusOr<HeadResult> cpu =
          RunHead<float>(f32, inputs, gradients, allocator, outputs);
      ASSERT_TRUE(cpu.ok()) << cpu.status();

      // The same on the GPU.
      CudaStream& stream = *gpu->stream;
      TrackedBuffer<float> d_hidden = Upload<float>(b.hidden, stream);
      TrackedBuffer<float> d_weight = Upload<float>(b.weight, stream);
      TrackedBuffer<float> d_bias = Upload<float>(b.bias, stream);
      TrackedBuffer<float> d_grad_hidden =
          Upload<float>(std::vector<double>(n * kH, 7), stream);
      TrackedBuffer<float> d_grad_weight = Upload<float>(
          std::vector<double>(trainable ? kV * kH : 0, 7), stream);
      TrackedBuffer<float> d_grad_bias =
          Upload<float>(std::vector<double>(trainable ? kV : 0, 7), stream);
      TrackedBuffer<int32_t> d_ids =
          Upload<int32_t>(std::vector<int32_t>(n * kTopK, 7), stream);
      TrackedBuffer<float> d_values =
          Upload<float>(std::vector<double>(n * kTopK, 7), stream);
      TrackedBuffer<double> d_weights =
          Upload<double>(std::vector<double>(n, 7), stream);
      const HeadInputs<float> d_inputs{Span(d_hidden), {},          {}, b.rows,
                                       Span(d_weight), Span(d_bias)};
      const HeadGradients<float> d_gradients{
          Span(d_grad_hidden), Span(d_grad_weight), Span(d_grad_bias), {}};
      HeadRowOutputs d_outputs;
      d_outputs.top_k = Span(d_ids);
      d_outputs.k = kTopK;
      d_outputs.top_k_values = Span(d_values);
      d_outputs.loss_weight = Span(d_weights);
      absl::StatusOr<HeadResult> gpu_run =
          RunCudaHead<float>(OnCuda(f32, v1::HeadConfig::FLOAT32), d_inputs,
                             d_gradients, *gpu->blas, d_outputs);
      ASSERT_TRUE(gpu_run.ok()) << gpu_run.status();
      EXPECT_EQ(CopyBack(d_ids, stream), ids);
      const std::vector<float> got_values = CopyBack(d_values, stream);
      const std::vector<double> got_weights = CopyBack(d_weights, stream);
      for (int64_t i = 0; i < n * kTopK; ++i) {
        EXPECT_NEAR(got_values[i], values[i], 1e-5 * (1 + std::abs(values[i])));
      }
      for (int64_t r = 0; r < n; ++r) {
        EXPECT_NEAR(got_weights[r], weights[r], 1e-6 * (1 + weights[r]));
      }
      const ChunkTerms& want = cpu->terms;
      const ChunkTerms& got = gpu_run->terms;
      for (const auto& [a, c] :
           {std::pair{&got.target_probability_per_position,
                      &want.target_probability_per_position},
            {&got.loss_weight_per_position, &want.loss_weight_per_position},
            {&got.top_k_recall_per_position, &want.top_k_recall_per_position},
            {&got.top_k_mass_per_position, &want.top_k_mass_per_position}}) {
        ASSERT_EQ(a->size(), c->size());
        for (size_t k = 0; k < a->size(); ++k) {
          EXPECT_NEAR((*a)[k], (*c)[k], 1e-5 * (1 + std::abs((*c)[k])));
        }
      }
      EXPECT_EQ(got.accepted_length.block_den, want.accepted_length.block_den);
      EXPECT_EQ(got.accepted_length.oracle_num,
                want.accepted_length.oracle_num);
      EXPECT_NEAR(got.accepted_length.expected_num,
                  want.accepted_length.expected_num,
                  1e-5 * want.accepted_length.expected_num);

      // The values' backward, from the same ids and values.
      std::vector<double> probe(n * kTopK);
      for (int64_t i = 0; i < n * kTopK; ++i) probe[i] = std::sin(0.7 * i);
      const std::vector<float> grad_values(probe.begin(), probe.end());
      ASSERT_TRUE(AddTopKValueGradients<float>(f32, inputs, ids, values,
                                               grad_values, kTopK, gradients)
                      .ok());
      TrackedBuffer<float> d_grad_values = Upload<float>(probe, stream);
      TrackedBuffer<int32_t> d_cpu_ids = Upload<int32_t>(ids, stream);
      const std::vector<double> values64(values.begin(), values.end());
      TrackedBuffer<float> d_cpu_values = Upload<float>(values64, stream);
      ASSERT_TRUE(
          AddCudaTopKValueGradients<float>(
              OnCuda(f32, v1::HeadConfig::FLOAT32), d_inputs,
              absl::MakeConstSpan(d_cpu_ids.data(), d_cpu_ids.size()),
              absl::MakeConstSpan(d_cpu_values.data(), d_cpu_values.size()),
              absl::MakeConstSpan(d_grad_values.data(), d_grad_values.size()),
              kTopK, d_gradients, stream)
              .ok());
      const std::vector<float> got_hidden = CopyBack(d_grad_hidden, stream);
      EXPECT_LT(RelativeNorm(AsDoubles(got_hidden), AsDoubles(grad_hidden)),
                1e-5);
      if (trainable) {
        EXPECT_LT(RelativeNorm(Download(d_grad_weight, stream),
                               AsDoubles(grad_weight)),
                  1e-5);
        EXPECT_LT(RelativeNorm(Download(d_grad_bias, stream),
                               AsDoubles(grad_bias)),
                  1e-5);
      }
    }
  }
}

// The values' backward on bfloat16 tensors, trainable: the weight and bias
// gradients take compare-and-swap adds rounded to bfloat16; against the
// float32 CPU update from zero, within bfloat16's rounding.
TEST(CudaHeadTopKTest, BFloat16BackwardMatchesTheCpu) {
  OPEN_GPU_OR_SKIP(gpu);
  const Batch b = MakeBatch(9);
  const int64_t n = b.num_rows();
  v1::ObjectiveConfig config =
      ConfigBuilder("dflash { gamma: 7 }").Trainable(true).Build();
  config.mutable_head()->set_logit_softcap(6);
  // Ids with repeats across rows, so that atomic adds meet.
  std::vector<int32_t> ids(n * kTopK);
  std::vector<double> values(n * kTopK), probe(n * kTopK);
  for (int64_t i = 0; i < n * kTopK; ++i) {
    ids[i] = b.rows[i / kTopK].mask > 0 ? static_cast<int32_t>(i % 5) : -1;
    values[i] = 3 * std::sin(0.3 * i);
    probe[i] = std::cos(0.7 * i);
  }
  // The CPU in float on the bfloat16-rounded inputs.
  auto rounded = [](const std::vector<double>& x) {
    std::vector<float> out;
    for (double v : x)
      out.push_back(ToFloat(ToBFloat16(static_cast<float>(v))));
    return out;
  };
  const std::vector<float> hidden = rounded(b.hidden),
                           weight = rounded(b.weight), bias = rounded(b.bias);
  const std::vector<float> f_values(values.begin(), values.end()),
      f_probe(probe.begin(), probe.end());
  std::vector<float> grad_hidden(n * kH), grad_weight(kV * kH), grad_bias(kV);
  v1::ObjectiveConfig f32 = config;
  f32.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
  ASSERT_TRUE(
      AddTopKValueGradients<float>(f32, {hidden, {}, {}, b.rows, weight, bias},
                                   ids, f_values, f_probe, kTopK,
                                   {absl::MakeSpan(grad_hidden),
                                    absl::MakeSpan(grad_weight),
                                    absl::MakeSpan(grad_bias),
                                    {}})
          .ok());
  CudaStream& stream = *gpu->stream;
  TrackedBuffer<BFloat16> d_hidden = Upload<BFloat16>(b.hidden, stream);
  TrackedBuffer<BFloat16> d_weight = Upload<BFloat16>(b.weight, stream);
  TrackedBuffer<BFloat16> d_bias = Upload<BFloat16>(b.bias, stream);
  TrackedBuffer<BFloat16> d_grad_hidden =
      Upload<BFloat16>(std::vector<double>(n * kH, 0), stream);
  TrackedBuffer<BFloat16> d_grad_weight =
      Upload<BFloat16>(std::vector<double>(kV * kH, 0), stream);
  TrackedBuffer<BFloat16> d_grad_bias =
      Upload<BFloat16>(std::vector<double>(kV, 0), stream);
  TrackedBuffer<int32_t> d_ids = Upload<int32_t>(ids, stream);
  TrackedBuffer<float> d_values = Upload<float>(values, stream);
  TrackedBuffer<float> d_probe = Upload<float>(probe, stream);
  ASSERT_TRUE(
      AddCudaTopKValueGradients<BFloat16>(
          OnCuda(config, v1::HeadConfig::BFLOAT16),
          {Span(d_hidden), {}, {}, b.rows, Span(d_weight), Span(d_bias)},
          absl::MakeConstSpan(d_ids.data(), d_ids.size()),
          absl::MakeConstSpan(d_values.data(), d_values.size()),
          absl::MakeConstSpan(d_probe.data(), d_probe.size()), kTopK,
          {Span(d_grad_hidden), Span(d_grad_weight), Span(d_grad_bias), {}},
          stream)
          .ok());
  EXPECT_LT(RelativeNorm(Download(d_grad_hidden, stream),
                         AsDoubles(grad_hidden)),
            1e-2);
  EXPECT_LT(RelativeNorm(Download(d_grad_weight, stream),
                         AsDoubles(grad_weight)),
            2e-2);
  EXPECT_LT(RelativeNorm(Download(d_grad_bias, stream),
                         AsDoubles(grad_bias)),
            2e-2);
}

// A batch on a grid of 1/4 (bias 1/16), so that the GEMM's logits are exact
// in bfloat16 and a float64 reference sees the same logits.
Batch GridBatch(uint32_t seed) {
  Batch b = MakeBatch(seed);
  for (auto* values : {&b.hidden, &b.teacher, &b.weight}) {
    for (double& x : *values) x = std::round(x * 4) / 4;
  }
  for (double& x : b.bias) x = std::round(x * 16) / 16;
  return b;
}

// BF16 with inputs on a grid of 1/4 (bias 1/16), so that the GEMM's logits
// are exact in bf16 and the reference sees the same logits: per-token CE
// within 1e-5, argmax and top-k exact, the hidden gradient within 5e-3 in
// relative norm (SpecForge's fused-head tolerances).
TEST(CudaHeadBFloat16Test, WithinSpecForgeTolerances) {
  OPEN_GPU_OR_SKIP(gpu);
  const Batch b = GridBatch(21);
  for (const char* loss : kLosses) {
    for (const char* mode : {"FUSED", "CHECKPOINT"}) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      const v1::ObjectiveConfig config = ConfigBuilder(loss).Mode(mode).Build();
      const Reference ref = Naive(config, b);
      const GpuRun run =
          RunOnGpu<BFloat16>(OnCuda(config, v1::HeadConfig::BFLOAT16), b, *gpu);
      ASSERT_TRUE(run.result.ok()) << run.result.status();
      for (int64_t r = 0; r < b.num_rows(); ++r) {
        if (b.rows[r].mask <= 0) continue;
        EXPECT_NEAR(run.outputs.neg_log_q[r], ref.neg_log_q[r],
                    1e-5 * (1 + std::abs(ref.neg_log_q[r])));
        EXPECT_EQ(run.outputs.argmax[r], ref.argmax[r]);
        for (int32_t j = 0; j < kTopK; ++j) {
          EXPECT_EQ(run.outputs.top_k[r * kTopK + j], ref.top_k[r * kTopK + j]);
        }
      }
      EXPECT_LT(RelativeNorm(run.outputs.grad_hidden, ref.grad_hidden), 5e-3);
    }
  }
}

// A trainable BF16 head against the float64 reference on the same grid: the
// hidden, weight and bias gradients within 5e-3 in relative norm (the
// weight's summed over chunks in FP32 and rounded once).
TEST(CudaHeadBFloat16Test, TrainableWithinTolerancesOfFloat64) {
  OPEN_GPU_OR_SKIP(gpu);
  const Batch b = GridBatch(22);
  for (const char* loss : kLosses) {
    if (!TrainsWith(loss)) continue;
    for (const char* mode : {"FUSED", "CHECKPOINT", "MATERIALIZE"}) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      const v1::ObjectiveConfig config =
          ConfigBuilder(loss).Mode(mode).BlocksPerChunk(1).Trainable().Build();
      const Reference ref = Naive(config, b);
      const GpuRun run =
          RunOnGpu<BFloat16>(OnCuda(config, v1::HeadConfig::BFLOAT16), b, *gpu);
      ASSERT_TRUE(run.result.ok()) << run.result.status();
      EXPECT_NEAR(run.result->loss, ref.loss, 1e-3 * std::abs(ref.loss));
      EXPECT_LT(RelativeNorm(run.outputs.grad_hidden, ref.grad_hidden), 5e-3);
      EXPECT_LT(RelativeNorm(run.outputs.grad_weight, ref.grad_weight), 5e-3);
      EXPECT_LT(RelativeNorm(run.outputs.grad_bias, ref.grad_bias), 5e-3);
    }
  }
}

// A NaN in one row's hidden state: the GPU head fails with the CPU head's
// message (the batch row, the first bad logit) in every mode, and nothing
// of the run is left queued on the caller's buffers when it returns.
TEST(CudaHeadErrorsTest,
     NaNInAHeadRunGivesTheCpuMessageAndLeavesNothingQueued) {
  OPEN_GPU_OR_SKIP(gpu);
  Batch b = MakeBatch(10);
  int64_t bad = 0;
  while (b.rows[bad].mask <= 0) ++bad;
  b.hidden[bad * kH + 1] = NAN;
  for (const char* mode : kModes) {
    SCOPED_TRACE(mode);
    v1::ObjectiveConfig config = ConfigBuilder().Mode(mode).Build();
    config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
    const std::vector<float> hidden(b.hidden.begin(), b.hidden.end());
    const std::vector<float> weight(b.weight.begin(), b.weight.end());
    const std::vector<float> bias(b.bias.begin(), b.bias.end());
    std::vector<float> grad_hidden(b.num_rows() * kH);
    const HeadInputs<float> inputs{hidden, {}, {}, b.rows, weight, bias};
    const HeadGradients<float> gradients{
        absl::MakeSpan(grad_hidden), {}, {}, {}};
    TrackingAllocator allocator;
    const absl::StatusOr<HeadResult> cpu =
        RunHead<float>(config, inputs, gradients, allocator);
    ASSERT_FALSE(cpu.ok());
    const GpuRun run =
        RunOnGpu<float>(OnCuda(config, v1::HeadConfig::FLOAT32), b, *gpu);
    EXPECT_EQ(run.result.status().message(), cpu.status().message());
    EXPECT_TRUE(run.idle_on_return);
    EXPECT_EQ(run.leaked_bytes, 0);
  }
}

// One MATERIALIZE head of more than 2^31 logits (16400 rows x V 131072 in
// FP32, 8.6 GB): sampled rows, among them the first whose logits lie past
// the 2^31st, against a naive float64 projection, softmax and gradient.
TEST(CudaHeadLargeTest, MaterializeBeyondTwoToThe31Logits) {
  OPEN_GPU_OR_SKIP(gpu);
  constexpr int64_t kBlock = 8, kRows = 16400, kVocab = 131072, kHidden = 16;
  static_assert(kRows * kVocab > (int64_t{1} << 31), "past 2^31 logits");
  // gamma absent: each row weighs its mask, so den = kRows.
  const absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromString(absl::StrCat(
          "layout { block_size: ", kBlock,
          " num_anchors: 1 } chunking { blocks_per_chunk: 1 } head { "
          "vocab_size: ",
          kVocab, " hidden_size: ", kHidden,
          " mode: MATERIALIZE backend: CUDA dtype: FLOAT32 } loss { dflash { "
          "} }"));
  ASSERT_TRUE(config.ok()) << config.status();
  std::mt19937 rng(61);
  std::normal_distribution<double> normal(0, 1);
  std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
  std::vector<double> hidden(kRows * kHidden), weight(kVocab * kHidden);
  for (double& x : hidden) x = static_cast<float>(normal(rng));
  for (double& x : weight) x = static_cast<float>(0.5 * normal(rng));
  std::vector<RowMeta> rows(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    rows[r].block = r / kBlock;
    rows[r].position = static_cast<int32_t>(r % kBlock);
    rows[r].target = token(rng);
    rows[r].mask = 1;
  }
  CudaStream& stream = *gpu->stream;
  TrackedBuffer<float> d_hidden = Upload<float>(hidden, stream);
  TrackedBuffer<float> d_weight = Upload<float>(weight, stream);
  TrackedBuffer<float> grad_hidden =
      Upload<float>(std::vector<double>(kRows * kHidden, 7), stream);
  TrackedBuffer<double> neg_log_q =
      Upload<double>(std::vector<double>(kRows, 7), stream);
  TrackedBuffer<int32_t> argmax =
      Upload<int32_t>(std::vector<int32_t>(kRows, 7), stream);
  const HeadInputs<float> inputs{Span(d_hidden), {}, {}, rows,
                                 Span(d_weight), {}};
  const HeadGradients<float> gradients{Span(grad_hidden), {}, {}, {}};
  const HeadRowOutputs outputs{Span(neg_log_q), Span(argmax), {}, 0};
  const absl::StatusOr<HeadResult> result =
      RunCudaHead<float>(*config, inputs, gradients, *gpu->blas, outputs);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->loss_denominator, kRows);
  const std::vector<float> got_grad = CopyBack(grad_hidden, stream);
  const std::vector<double> got_nlq = CopyBack(neg_log_q, stream);
  const std::vector<int32_t> got_argmax = CopyBack(argmax, stream);
  const int64_t past = (int64_t{1} << 31) / kVocab;
  for (int64_t r :
       {int64_t{0}, int64_t{1}, past - 1, past, past + 7, kRows - 1}) {
    SCOPED_TRACE(absl::StrCat("row ", r));
    std::vector<double> z(kVocab);
    int32_t best = 0;
    for (int64_t v = 0; v < kVocab; ++v) {
      double dot = 0;
      for (int64_t h = 0; h < kHidden; ++h) {
        dot += weight[v * kHidden + h] * hidden[r * kHidden + h];
      }
      z[v] = dot;
      if (dot > z[best]) best = static_cast<int32_t>(v);
    }
    double sum = 0;
    for (double x : z) sum += std::exp(x - z[best]);
    const double lse = z[best] + std::log(sum);
    const int32_t target = rows[r].target;
    EXPECT_NEAR(got_nlq[r], lse - z[target], 1e-4 * (1 + lse - z[target]));
    EXPECT_EQ(got_argmax[r], best);
    std::vector<double> want(kHidden, 0.0), got(kHidden);
    for (int64_t v = 0; v < kVocab; ++v) {
      const double g = std::exp(z[v] - lse) - (v == target ? 1.0 : 0.0);
      for (int64_t h = 0; h < kHidden; ++h) {
        want[h] += g * weight[v * kHidden + h] / kRows;
      }
    }
    for (int64_t h = 0; h < kHidden; ++h) got[h] = got_grad[r * kHidden + h];
    EXPECT_LT(RelativeNorm(got, want), 1e-4);
  }
}

// Device peak bytes: chunk-sized in fused and checkpoint modes (the CPU
// test's bounds plus the loss's per-row scratch and the active-row index),
// growing with N x V when materialized.
TEST(CudaHeadMemoryTest, PeakBytesStayWithinChunkBounds) {
  OPEN_GPU_OR_SKIP(gpu);
  int64_t materialize_small = 0;
  for (int64_t batch : {2, 8}) {
    const Batch b = MakeBatch(6, batch, 3);
    const GpuRun fused = RunOnGpu<float>(
        OnCuda(ConfigBuilder().Build(), v1::HeadConfig::FLOAT32), b, *gpu);
    const GpuRun checkpoint = RunOnGpu<float>(
        OnCuda(ConfigBuilder().Mode("CHECKPOINT").Segment(2).Build(),
               v1::HeadConfig::FLOAT32),
        b, *gpu);
    const GpuRun materialize =
        RunOnGpu<float>(OnCuda(ConfigBuilder().Mode("MATERIALIZE").Build(),
                               v1::HeadConfig::FLOAT32),
                        b, *gpu);
    ASSERT_TRUE(fused.result.ok() && checkpoint.result.ok() &&
                materialize.result.ok());
    const int64_t m = 2 * kK;  // Rows of two blocks at most per chunk.
    const int64_t rows = b.num_rows();
    const int64_t scratch = 256 * m + 8 * rows + 8192;
    EXPECT_LE(fused.result->stats.peak_bytes,
              (m * kV + 2 * m * kH) * 4 + scratch);
    EXPECT_LE(checkpoint.result->stats.peak_bytes,
              (2 * m * kV + 2 * m * kH) * 4 + scratch);
    const int64_t weighted = fused.result->stats.projected_rows;
    EXPECT_GE(materialize.result->stats.peak_bytes, 2 * weighted * kV * 4);
    if (batch == 2) {
      materialize_small = materialize.result->stats.peak_bytes;
    } else {
      EXPECT_GE(materialize.result->stats.peak_bytes, 3 * materialize_small);
    }
  }
}

TEST(CudaHeadTest, BadConfigsAreClearErrors) {
  OPEN_GPU_OR_SKIP(gpu);
  const Batch b = MakeBatch(10);
  v1::ObjectiveConfig config = ConfigBuilder().Build();
  config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
  EXPECT_EQ(RunOnGpu<float>(config, b, *gpu).result.status().message(),
            "head.backend: RunCudaHead runs the CUDA backend, got CPU");
  config = OnCuda(config, v1::HeadConfig::BFLOAT16);
  EXPECT_EQ(RunOnGpu<float>(config, b, *gpu).result.status().message(),
            "head.dtype: this call takes FLOAT32 tensors (CUDA heads run "
            "FLOAT32 or BFLOAT16), got BFLOAT16");
  Batch bad = b;
  bad.rows[5].target = kV;
  bad.rows[5].mask = 1;
  EXPECT_EQ(
      RunOnGpu<float>(OnCuda(ConfigBuilder().Build(), v1::HeadConfig::FLOAT32),
                      bad, *gpu)
          .result.status()
          .message(),
      "inputs.rows[5].target: must lie in [0, 23), got 23");
}

// Runs everywhere: without a GPU the stream says why.
TEST(CudaHeadTest, NoDeviceIsAnUnavailableStatus) {
  DFLASH_WITHOUT_GPU_OR_SKIP(OpenGpu().ok());
  absl::StatusOr<Gpu> gpu = OpenGpu();
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace dflash
