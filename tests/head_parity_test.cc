#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cpu_head.h"
#include "losses/batch_layout.h"
#include "losses/chunk_loss.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using namespace head_test;  // NOLINT: the suite's shared vocabulary.

template <typename T>
struct HeadRunOutput {
  absl::StatusOr<HeadResult> result;
  std::vector<T> grad_hidden, grad_weight, grad_bias;
  std::vector<ConfidenceOf<T>> grad_confidence;
  std::vector<double> neg_log_q;
  std::vector<int32_t> argmax;
};

v1::ObjectiveConfig AsFloat32(v1::ObjectiveConfig config) {
  config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
  return config;
}

template <typename T>
HeadRunOutput<T> RunOn(const v1::ObjectiveConfig& config, const Batch& b,
             TrackingAllocator& allocator, double upstream = 1.0) {
  const bool trainable = config.head().trainable();
  const bool bias = config.head().bias();
  const std::vector<T> hidden(b.hidden.begin(), b.hidden.end());
  const std::vector<T> teacher(b.teacher.begin(), b.teacher.end());
  const std::vector<T> weight(b.weight.begin(), b.weight.end());
  const std::vector<T> bias_values(b.bias.begin(), b.bias.end());
  const std::vector<ConfidenceOf<T>> confidence(b.confidence.begin(),
                                                b.confidence.end());
  const int64_t n = b.num_rows();
  HeadRunOutput<T> run;
  run.grad_hidden.assign(n * kH, T(7));  // Must be overwritten.
  if (trainable) run.grad_weight.assign(kV * kH, T(7));
  if (trainable && bias) run.grad_bias.assign(kV, T(7));
  const bool teacher_loss = ProjectsTeacher(config);
  const bool conf = config.loss().has_dspark() &&
                    config.loss().dspark().confidence_weight() > 0;
  if (conf) run.grad_confidence.assign(n, 7);
  run.neg_log_q.assign(n, 7);
  run.argmax.assign(n, 7);
  HeadInputs<T> inputs{hidden,
                       teacher_loss ? absl::MakeConstSpan(teacher)
                                    : absl::Span<const T>(),
                       conf ? absl::MakeConstSpan(confidence)
                            : absl::Span<const ConfidenceOf<T>>(),
                       b.rows,
                       weight,
                       bias ? absl::MakeConstSpan(bias_values)
                            : absl::Span<const T>()};
  HeadGradients<T> gradients{absl::MakeSpan(run.grad_hidden),
                             absl::MakeSpan(run.grad_weight),
                             absl::MakeSpan(run.grad_bias),
                             absl::MakeSpan(run.grad_confidence)};
  HeadRowOutputs outputs{absl::MakeSpan(run.neg_log_q),
                         absl::MakeSpan(run.argmax), {}, 0};
  HeadOptions options;
  options.upstream_gradient = upstream;
  int64_t steps = 0;
  options.progress = [&](int64_t done, int64_t total) {
    EXPECT_EQ(done, ++steps);
    EXPECT_LE(done, total);
  };
  run.result = RunHead<T>(config, inputs, gradients, allocator, outputs,
                          options);
  if (run.result.ok()) {
    const int64_t chunks = run.result->stats.chunks;
    EXPECT_EQ(steps, config.head().mode() == v1::HeadConfig::FUSED
                         ? chunks
                         : 2 * chunks);
  }
  return run;
}

class HeadParityTest
    : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

// Every mode x chunk size x segment size x threads, frozen and trainable,
// equals the float64 reference; the FP32 head is within 1e-5 of it.
TEST_P(HeadParityTest, EveryConfigurationMatchesTheReference) {
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
    ASSERT_GT(ref.terms.loss_den, 0);
    for (int64_t chunk : {int64_t{1}, int64_t{3}, blocks}) {
      for (int64_t segment : {int64_t{1}, int64_t{2}, int64_t{1000}}) {
        if (!segmented && segment != 1) continue;
        for (int threads : {1, 2}) {
          SCOPED_TRACE(absl::StrCat(mode, " chunk ", chunk, " segment ",
                                    segment, " threads ", threads,
                                    " trainable ", trainable));
          const v1::ObjectiveConfig config = ConfigBuilder(loss)
                                                 .Mode(mode)
                                                 .BlocksPerChunk(chunk)
                                                 .Segment(segment)
                                                 .Threads(threads)
                                                 .Trainable(trainable)
                                                 .Build();
          TrackingAllocator allocator;
          HeadRunOutput<double> run = RunOn<double>(config, b, allocator);
          ASSERT_TRUE(run.result.ok()) << run.result.status();
          ExpectMatchesReference(
              *run.result,
              {run.grad_hidden, run.grad_weight, run.grad_bias,
               run.grad_confidence, run.neg_log_q, run.argmax, {}},
              ref, b, trainable, 1e-10, 1e-10);
          EXPECT_EQ(allocator.current_bytes(), 0);
        }
      }
    }
    TrackingAllocator allocator;
    HeadRunOutput<float> f32 = RunOn<float>(AsFloat32(ConfigBuilder(loss)
                                                          .Mode(mode)
                                                          .BlocksPerChunk(3)
                                                          .Segment(2)
                                                          .Threads(2)
                                                          .Trainable(trainable)
                                                          .Build()),
                                            b, allocator);
    ASSERT_TRUE(f32.result.ok()) << f32.result.status();
    // The reference saw the double inputs; rounding them to float (6e-8
    // relative) is well inside the 1e-5 budget.
    EXPECT_NEAR(f32.result->loss, ref.loss, 1e-5 * std::abs(ref.loss));
    EXPECT_LT(RelativeError(f32.grad_hidden, ref.grad_hidden), 1e-5);
    if (trainable) {
      EXPECT_LT(RelativeError(f32.grad_weight, ref.grad_weight), 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    LossesAndModes, HeadParityTest,
    ::testing::Combine(::testing::Range(0,
                                        static_cast<int>(std::size(kLosses))),
                       ::testing::ValuesIn(kModes)),
    [](const ::testing::TestParamInfo<std::tuple<int, const char*>>& info) {
      return absl::StrCat("Loss", std::get<0>(info.param), "_",
                          std::get<1>(info.param));
    });

// The cost table of docs/semantics.md section 8, in units of one projection
// of the rows.
TEST(HeadCostTest, GemmCountsMatchTheCostTable) {
  const Batch b = MakeBatch(4);
  struct Row {
    const char* mode;
    double plain, teacher;
  };
  for (const Row& row : {Row{"MATERIALIZE", 2, 3}, Row{"SAVE_CHUNKS", 2, 3},
                         Row{"CHECKPOINT", 3, 5}, Row{"SELECTIVE", 3, 4},
                         Row{"FUSED", 2, 3}}) {
    for (bool trainable : {false, true}) {
      for (bool with_teacher : {false, true}) {
        SCOPED_TRACE(absl::StrCat(row.mode, " trainable ", trainable,
                                  " teacher ", with_teacher));
        const char* loss =
            with_teacher ? "distillation {}" : "dflash { gamma: 7 }";
        TrackingAllocator allocator;
        HeadRunOutput<double> run = RunOn<double>(
            ConfigBuilder(loss).Mode(row.mode).Trainable(trainable).Build(), b,
            allocator);
        ASSERT_TRUE(run.result.ok()) << run.result.status();
        const double expected =
            (with_teacher ? row.teacher : row.plain) + (trainable ? 1 : 0);
        EXPECT_DOUBLE_EQ(run.result->stats.gemm_passes, expected);
      }
    }
  }
}

// Every LK composition keeps the plain cost: the batch-level lambda's CE
// weight scales rows after the last chunk, with no second pass.
TEST(HeadCostTest, EveryCompositionKeepsTheCostTable) {
  const Batch b = MakeBatch(4);
  struct Row {
    const char* mode;
    double passes;
  };
  for (const char* loss :
       {"dflash { lk { type: LAMBDA } }", "dflash { lk { type: TV } }",
        "dpace { lk { type: LAMBDA kl_scale: 2 } }", "lk_lambda {}"}) {
    for (const Row& row : {Row{"MATERIALIZE", 2}, Row{"SAVE_CHUNKS", 2},
                           Row{"CHECKPOINT", 3}, Row{"SELECTIVE", 3},
                           Row{"FUSED", 2}}) {
      SCOPED_TRACE(absl::StrCat(loss, " ", row.mode));
      TrackingAllocator allocator;
      HeadRunOutput<double> run =
          RunOn<double>(ConfigBuilder(loss).Mode(row.mode).Build(), b,
                        allocator);
      ASSERT_TRUE(run.result.ok()) << run.result.status();
      EXPECT_DOUBLE_EQ(run.result->stats.gemm_passes, row.passes);
    }
  }
}

// The teacher diagnostics cost what a teacher loss's projection costs (the
// teacher column), and change no term of the loss.
TEST(HeadCostTest, TeacherDiagnosticsCostTheTeacherColumn) {
  const Batch b = MakeBatch(4);
  struct Row {
    const char* mode;
    double passes;
  };
  for (const Row& row :
       {Row{"MATERIALIZE", 3}, Row{"SAVE_CHUNKS", 3}, Row{"CHECKPOINT", 5},
        Row{"SELECTIVE", 4}, Row{"FUSED", 3}}) {
    SCOPED_TRACE(row.mode);
    TrackingAllocator allocator;
    HeadRunOutput<double> with =
        RunOn<double>(ConfigBuilder("dpace {}")
                          .Mode(row.mode)
                          .ExtraHead("teacher_diagnostics: true")
                          .Build(),
                      b, allocator);
    HeadRunOutput<double> without = RunOn<double>(
        ConfigBuilder("dpace {}").Mode(row.mode).Build(), b, allocator);
    ASSERT_TRUE(with.result.ok()) << with.result.status();
    ASSERT_TRUE(without.result.ok()) << without.result.status();
    EXPECT_DOUBLE_EQ(with.result->stats.gemm_passes, row.passes);
    EXPECT_EQ(with.result->loss, without.result->loss);
    EXPECT_EQ(with.grad_hidden, without.grad_hidden);
  }
}

TEST(HeadCostTest, SegmentsSetHowOftenBackwardRecomputes) {
  const Batch b = MakeBatch(5);  // 6 blocks: 6 chunks of one block.
  for (int64_t segment : {1, 2, 3, 6}) {
    TrackingAllocator allocator;
    HeadRunOutput<double> run = RunOn<double>(ConfigBuilder()
                                                  .Mode("CHECKPOINT")
                                                  .BlocksPerChunk(1)
                                                  .Segment(segment)
                                                  .Build(),
                                              b, allocator);
    ASSERT_TRUE(run.result.ok());
    EXPECT_EQ(run.result->stats.chunks, 6);
    EXPECT_EQ(run.result->stats.segment_recomputes, 6 / segment);
    EXPECT_DOUBLE_EQ(run.result->stats.gemm_passes, 3);
  }
}

// The largest chunk's weighted rows.
int64_t LargestChunkRows(const HeadResult& result, const Batch& b) {
  int64_t most = 0;
  for (const ChunkRange& chunk : result.plan.chunks) {
    int64_t m = 0;
    for (int64_t r = chunk.begin; r < chunk.end; ++r) m += b.rows[r].mask > 0;
    most = std::max(most, m);
  }
  return most;
}

// Peak bytes, measured by the tracking allocator, against bounds derived
// from what each mode holds at once (T = double, 8 bytes):
// - fused: the chunk's logits (+ teacher logits) and two [m, H] buffers;
// - checkpoint, segments of s chunks: s chunks' logits gradients (+ teacher
//   logits) recomputed together, and two [m, H] buffers;
// - materialize: all N x V logits, plus the kept copy.
TEST(HeadMemoryTest, PeakBytesStayWithinChunkBoundsExceptMaterialize) {
  for (bool teacher : {false, true}) {
    const char* loss = teacher ? "distillation {}" : "dflash {}";
    const int64_t t = teacher ? 1 : 0;
    int64_t fused_peak = 0, checkpoint_peak = 0, materialize_peak = 0;
    for (int64_t batch : {2, 8}) {
      SCOPED_TRACE(absl::StrCat("teacher ", teacher, " batch ", batch));
      const Batch b = MakeBatch(6, batch, 3);
      TrackingAllocator fused_alloc, checkpoint_alloc, materialize_alloc;
      HeadRunOutput<double> fused = RunOn<double>(
          ConfigBuilder(loss).Trainable().Build(), b, fused_alloc);
      HeadRunOutput<double> checkpoint = RunOn<double>(
          ConfigBuilder(loss).Mode("CHECKPOINT").Segment(2).Trainable().Build(),
          b, checkpoint_alloc);
      HeadRunOutput<double> materialize = RunOn<double>(
          ConfigBuilder(loss).Mode("MATERIALIZE").Trainable().Build(), b,
          materialize_alloc);
      ASSERT_TRUE(fused.result.ok() && checkpoint.result.ok() &&
                  materialize.result.ok());
      const int64_t m = LargestChunkRows(*fused.result, b);
      const int64_t weighted = fused.result->stats.projected_rows;
      const int64_t bytes = sizeof(double);
      EXPECT_LE(fused.result->stats.peak_bytes,
                (m * kV * (1 + t) + 2 * m * kH) * bytes);
      EXPECT_GE(fused.result->stats.peak_bytes, m * kV * bytes);
      EXPECT_LE(checkpoint.result->stats.peak_bytes,
                (2 * m * kV * (1 + t) + 2 * m * kH) * bytes);
      EXPECT_GE(materialize.result->stats.peak_bytes,
                2 * weighted * kV * bytes);
      if (batch == 2) {
        fused_peak = fused.result->stats.peak_bytes;
        checkpoint_peak = checkpoint.result->stats.peak_bytes;
        materialize_peak = materialize.result->stats.peak_bytes;
      } else {
        // Four times the rows: chunked modes stay within the chunk bound
        // (which does not grow); materialize grows with N x V.
        EXPECT_GE(materialize.result->stats.peak_bytes, 3 * materialize_peak);
        EXPECT_LE(fused.result->stats.peak_bytes,
                  (m * kV * (1 + t) + 2 * m * kH) * bytes);
        EXPECT_GT(fused_peak, 0);
        EXPECT_GT(checkpoint_peak, 0);
      }
    }
  }
}

TEST(HeadMaskTest, SeventyFivePercentMaskedDoesAQuarterOfTheProjection) {
  Batch b = MakeBatch(7, 4, 4);  // 64 rows.
  for (int64_t r = 0; r < b.num_rows(); ++r) {
    b.rows[r].mask = r % 4 == 1 ? 1.0f : 0.0f;
  }
  TrackingAllocator allocator;
  HeadRunOutput<double> run =
      RunOn<double>(ConfigBuilder().Build(), b, allocator);
  ASSERT_TRUE(run.result.ok()) << run.result.status();
  EXPECT_EQ(run.result->stats.projected_rows, b.num_rows() / 4);
  EXPECT_DOUBLE_EQ(run.result->stats.gemm_flops,
                   2 * (2.0 * (b.num_rows() / 4) * kH * kV));
  const Reference ref = Naive(ConfigBuilder().Build(), b);
  EXPECT_NEAR(run.result->loss, ref.loss, 1e-12 * ref.loss);
  for (int64_t r = 0; r < b.num_rows(); ++r) {
    if (b.rows[r].mask > 0) continue;
    for (int64_t h = 0; h < kH; ++h) {
      ASSERT_EQ(run.grad_hidden[r * kH + h], 0.0);
    }
  }
}

TEST(HeadTest, UpstreamGradientScalesTheGradientsOnly) {
  const Batch b = MakeBatch(8);
  TrackingAllocator allocator;
  const v1::ObjectiveConfig config =
      ConfigBuilder("dflash { gamma: 7 }").Trainable().Build();
  HeadRunOutput<double> one = RunOn<double>(config, b, allocator, 1.0);
  HeadRunOutput<double> half = RunOn<double>(config, b, allocator, 0.5);
  ASSERT_TRUE(one.result.ok() && half.result.ok());
  EXPECT_EQ(one.result->loss, half.result->loss);
  for (size_t i = 0; i < one.grad_hidden.size(); ++i) {
    EXPECT_DOUBLE_EQ(half.grad_hidden[i], 0.5 * one.grad_hidden[i]);
  }
}

TEST(HeadTest, NothingWeightedGivesAFiniteZero) {
  Batch b = MakeBatch(9);
  for (RowMeta& m : b.rows) m.mask = 0;
  TrackingAllocator allocator;
  HeadRunOutput<double> run = RunOn<double>(
      ConfigBuilder("dpace {}").Mode("CHECKPOINT").Trainable().Build(), b,
      allocator);
  ASSERT_TRUE(run.result.ok()) << run.result.status();
  EXPECT_EQ(run.result->loss, 0.0);
  EXPECT_EQ(run.result->stats.gemm_calls, 0);
  for (double g : run.grad_hidden) ASSERT_EQ(g, 0.0);
  for (double g : run.grad_weight) ASSERT_EQ(g, 0.0);
}

// A loss error names the row by its place in the batch, (b, n, k), whatever
// chunk, compaction and thread split the row went through.
TEST(HeadTest, LossErrorsNameTheRowsBatchPosition) {
  Batch b = MakeBatch(10);
  const int64_t row = (1 * 3 + 2) * kK + 1;  // b 1, n 2, k 1.
  b.hidden[row * kH + 1] = NAN;
  b.rows[row].mask = 1;
  b.rows[row].target = 0;
  TrackingAllocator allocator;
  for (const char* mode : {"MATERIALIZE", "CHECKPOINT", "FUSED"}) {
    for (int threads : {1, 2}) {
      SCOPED_TRACE(absl::StrCat(mode, " threads ", threads));
      const v1::ObjectiveConfig config =
          ConfigBuilder().Mode(mode).Threads(threads).Build();
      EXPECT_EQ(RunOn<double>(config, b, allocator).result.status().message(),
                "row (b, n, k) = (1, 2, 1): logit 0 is not finite (nan)");
    }
  }
}

// A confidence gradient the loss does not use must still be whole or
// absent: a backend may write every row of it.
TEST(HeadTest, AnUnusedConfidenceGradientIsWholeOrAbsent) {
  const Batch b = MakeBatch(10);
  const v1::ObjectiveConfig config = ConfigBuilder().Bias(false).Build();
  std::vector<double> grad_hidden(b.num_rows() * kH), none;
  std::vector<double> short_confidence(3);
  const HeadInputs<double> inputs{b.hidden, {}, {}, b.rows, b.weight, {}};
  TrackingAllocator allocator;
  EXPECT_EQ(RunHead<double>(config, inputs,
                            {absl::MakeSpan(grad_hidden), absl::MakeSpan(none),
                             absl::MakeSpan(none),
                             absl::MakeSpan(short_confidence)},
                            allocator)
                .status()
                .message(),
            "gradients.confidence: must hold 24 values (none, or one per "
            "row), got 3");
  std::vector<double> whole(b.num_rows(), 5);
  EXPECT_TRUE(RunHead<double>(config, inputs,
                              {absl::MakeSpan(grad_hidden),
                               absl::MakeSpan(none), absl::MakeSpan(none),
                               absl::MakeSpan(whole)},
                              allocator)
                  .ok());
}

TEST(HeadTest, BadInputsAreClearErrors) {
  const Batch good = MakeBatch(10);
  TrackingAllocator allocator;
  const v1::ObjectiveConfig config = ConfigBuilder().Build();
  Batch b = good;
  b.rows[5].target = kV;
  b.rows[5].mask = 1;
  EXPECT_EQ(RunOn<double>(config, b, allocator).result.status().message(),
            "inputs.rows[5].target: must lie in [0, 23), got 23");
  b = good;
  b.rows[2].position = kK;
  EXPECT_EQ(RunOn<double>(config, b, allocator).result.status().message(),
            "inputs.rows[2].position: must lie in [0, 4), got 4");
  b = good;
  b.rows.pop_back();
  EXPECT_EQ(RunOn<double>(config, b, allocator).result.status().message(),
            "inputs.rows: must be a positive number of whole blocks of "
            "layout.block_size = 4, got 23 rows");
  b = good;
  b.weight.pop_back();
  EXPECT_EQ(RunOn<double>(config, b, allocator).result.status().message(),
            "inputs.weight: must hold 184 values (head.vocab_size x "
            "head.hidden_size), got 183");
  b = good;
  b.hidden[3 * kH + 1] = NAN;
  b.rows[3].mask = 1;
  b.rows[3].target = 0;
  EXPECT_NE(RunOn<double>(config, b, allocator)
                .result.status()
                .message()
                .find("is not finite (nan)"),
            std::string::npos);
  v1::ObjectiveConfig cuda = AsFloat32(config);
  cuda.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  EXPECT_EQ(RunOn<float>(cuda, good, allocator).result.status().message(),
            "head.backend: RunHead runs the CPU backend, got CUDA");
  EXPECT_EQ(RunOn<float>(config, good, allocator).result.status().message(),
            "head.dtype: this call takes FLOAT32 tensors (CPU heads run "
            "FLOAT32 or FLOAT64), got FLOAT64");
  TrackingAllocator tiny(1024);
  EXPECT_EQ(RunOn<double>(config, good, tiny).result.status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace dflash
