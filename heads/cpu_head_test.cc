// RunHead inside a host process: a run stops when its caller's interrupt is
// set, and runs on the threads head.threads names, bounded by the CPUs.
#include "heads/cpu_head.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/threads.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/synthetic_batch.h"
#include "proto/config.h"

namespace dflash {
namespace {

v1::ObjectiveConfig Config(const std::string& mode, int threads) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      absl::StrCat("layout { block_size: 4 num_anchors: 8 } head { "
                   "vocab_size: 97 hidden_size: 16 mode: ",
                   mode, " threads: ", threads,
                   " } chunking { blocks_per_chunk: 2 } loss { dflash { "
                   "gamma: 7 } }"),
      "test");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

struct HeadRunOutput {
  absl::StatusOr<HeadResult> result;
  std::vector<float> grad;
};

HeadRunOutput RunWith(const v1::ObjectiveConfig& config, const HeadBatch<float>& batch,
            const HeadOptions& options) {
  HeadRunOutput run;
  run.grad.assign(batch.hidden.size(), 0);
  TrackingAllocator allocator;
  run.result = RunHead<float>(config, batch.Inputs(config),
                              {absl::MakeSpan(run.grad)}, allocator, {},
                              options);
  return run;
}

// Set before the run, or by the progress callback after its first chunk
// step: Cancelled, in every mode; the next run is whole and equal to one
// never interrupted.
TEST(CpuHeadTest, AnInterruptStopsTheRun) {
  for (const char* mode : {"FUSED", "CHECKPOINT", "SAVE_CHUNKS"}) {
    SCOPED_TRACE(mode);
    const v1::ObjectiveConfig config = Config(mode, 1);
    absl::StatusOr<HeadBatch<float>> batch =
        MakeSyntheticBatch<float>(config, {2, 64, 8}, 5);
    ASSERT_TRUE(batch.ok()) << batch.status();
    const HeadRunOutput whole = RunWith(config, *batch, {});
    ASSERT_TRUE(whole.result.ok()) << whole.result.status();
    ASSERT_GT(whole.result->stats.chunks, 2);

    std::atomic<bool> interrupt{true};
    HeadOptions options;
    options.interrupt = &interrupt;
    EXPECT_EQ(RunWith(config, *batch, options).result.status(),
              absl::CancelledError("the head run was interrupted"));

    interrupt = false;
    int64_t steps_seen = 0;
    options.progress = [&](int64_t done, int64_t) {
      steps_seen = done;
      interrupt = true;
    };
    EXPECT_EQ(RunWith(config, *batch, options).result.status().code(),
              absl::StatusCode::kCancelled);
    EXPECT_EQ(steps_seen, 1);

    interrupt = false;
    options.progress = nullptr;
    const HeadRunOutput again = RunWith(config, *batch, options);
    ASSERT_TRUE(again.result.ok()) << again.result.status();
    EXPECT_EQ(again.result->loss, whole.result->loss);
    EXPECT_EQ(again.grad, whole.grad);
  }
}

// More threads than CPUs run on the CPUs; beyond kMaxThreads the config is
// refused; the result does not depend on the count.
TEST(CpuHeadTest, ThreadsAreBoundedByTheCpus) {
  const v1::ObjectiveConfig one = Config("FUSED", 1);
  absl::StatusOr<HeadBatch<float>> batch =
      MakeSyntheticBatch<float>(one, {2, 64, 8}, 6);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const HeadRunOutput single = RunWith(one, *batch, {});
  ASSERT_TRUE(single.result.ok()) << single.result.status();
  EXPECT_EQ(single.result->stats.threads, 1);
  for (int threads : {0, 64, kMaxThreads}) {
    const HeadRunOutput many = RunWith(Config("FUSED", threads), *batch, {});
    ASSERT_TRUE(many.result.ok()) << many.result.status();
    EXPECT_EQ(many.result->stats.threads, UsableCpus());
    EXPECT_NEAR(many.result->loss, single.result->loss,
                1e-12 * single.result->loss);
  }
  EXPECT_EQ(LoadObjectiveConfigFromString(
                "head { vocab_size: 97 hidden_size: 16 threads: 100000 } "
                "loss { dflash {} }",
                "test")
                .status()
                .message(),
            "test: invalid config:\nhead.threads: must lie in [0, 1024], got "
            "100000");
}

// HeadOptions::forward_only: the terms, accuracy and row outputs of a
// training run, in every mode and for a loss with a confidence term, with
// one projection's GEMMs instead of two or more and no gradient buffer.
TEST(CpuHeadTest, AForwardOnlyRunGivesTheTrainingRunsValues) {
  for (const char* loss :
       {"dflash { gamma: 7 }",
        "dspark { confidence_weight: 1 }"}) {
    for (const char* mode : {"FUSED", "CHECKPOINT", "SAVE_CHUNKS",
                             "MATERIALIZE", "SELECTIVE"}) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      absl::StatusOr<v1::ObjectiveConfig> config =
          LoadObjectiveConfigFromString(
              absl::StrCat("layout { block_size: 4 num_anchors: 8 } head { "
                           "vocab_size: 97 hidden_size: 16 mode: ",
                           mode,
                           " } chunking { blocks_per_chunk: 2 } loss { ",
                           loss, " }",
                           std::string(mode) == "SELECTIVE"
                               ? " checkpoint { preset: "
                                 "SELECTIVE_FROZEN_PROJECTION }"
                               : ""),
              "test");
      ASSERT_TRUE(config.ok()) << config.status();
      absl::StatusOr<HeadBatch<float>> batch =
          MakeSyntheticBatch<float>(*config, {2, 64, 8}, 7);
      ASSERT_TRUE(batch.ok()) << batch.status();
      const HeadInputs<float> inputs = batch->Inputs(*config);
      const size_t rows = inputs.rows.size();
      const bool confidence = !inputs.confidence_logits.empty();
      struct Run {
        absl::StatusOr<HeadResult> result;
        std::vector<double> neg_log_q, loss_weight;
        std::vector<int32_t> argmax;
      };
      auto run = [&](bool forward_only) {
        Run out;
        out.neg_log_q.assign(rows, -1);
        out.loss_weight.assign(rows, -1);
        out.argmax.assign(rows, -2);
        std::vector<float> grad(forward_only ? 0 : inputs.hidden.size());
        std::vector<float> grad_confidence(
            forward_only || !confidence ? 0 : rows);
        HeadRowOutputs row_outputs;
        row_outputs.neg_log_q = absl::MakeSpan(out.neg_log_q);
        row_outputs.argmax = absl::MakeSpan(out.argmax);
        row_outputs.loss_weight = absl::MakeSpan(out.loss_weight);
        HeadOptions options;
        options.forward_only = forward_only;
        TrackingAllocator allocator;
        HeadGradients<float> gradients;
        gradients.hidden = absl::MakeSpan(grad);
        gradients.confidence = absl::MakeSpan(grad_confidence);
        out.result = RunHead<float>(*config, inputs, gradients, allocator,
                                    row_outputs, options);
        return out;
      };
      const Run train = run(false), eval = run(true);
      ASSERT_TRUE(train.result.ok()) << train.result.status();
      ASSERT_TRUE(eval.result.ok()) << eval.result.status();
      EXPECT_EQ(eval.result->loss, train.result->loss);
      EXPECT_EQ(eval.result->terms.loss_num, train.result->terms.loss_num);
      EXPECT_EQ(eval.result->terms.loss_den, train.result->terms.loss_den);
      EXPECT_EQ(eval.result->terms.correct, train.result->terms.correct);
      EXPECT_EQ(eval.result->accuracy_per_position,
                train.result->accuracy_per_position);
      EXPECT_EQ(eval.neg_log_q, train.neg_log_q);
      EXPECT_EQ(eval.argmax, train.argmax);
      EXPECT_EQ(eval.loss_weight, train.loss_weight);
      // One projection of the projected rows (and the teacher's, for
      // dspark); training adds at least the input gradient's.
      EXPECT_NEAR(eval.result->stats.gemm_passes + 1,
                  train.result->stats.gemm_passes,
                  train.result->stats.gemm_passes - 2 + 1e-9)
          << "train " << train.result->stats.gemm_passes << ", eval "
          << eval.result->stats.gemm_passes;
      EXPECT_LT(eval.result->stats.gemm_passes,
                train.result->stats.gemm_passes);
      EXPECT_EQ(eval.result->stats.segment_recomputes, 0);
      EXPECT_LE(eval.result->stats.peak_bytes, train.result->stats.peak_bytes);
    }
  }
}

// A float64 head keeps masks float32 does not hold (1/3, decay weights)
// exactly: its terms and d(loss)/d(hidden) within 1e-12 of a naive
// float64 computation here.
TEST(CpuHeadTest, Float64MasksAreExact) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      "layout { block_size: 4 num_anchors: 8 } head { vocab_size: 97 "
      "hidden_size: 16 dtype: FLOAT64 } chunking { blocks_per_chunk: 2 } "
      "loss { dflash { "
      "gamma: 7 } }",
      "test");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<HeadBatch<double>> batch =
      MakeSyntheticBatch<double>(*config, {2, 64, 8}, 3);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const int64_t h = 16, v = 97;
  for (size_t r = 0; r < batch->rows.size(); ++r) {
    RowMeta& m = batch->rows[r];
    if (m.mask > 0) m.mask = (r % 3 + 1) / 3.0 * std::exp(-m.position / 5.0);
  }
  std::vector<double> grad(batch->hidden.size());
  TrackingAllocator allocator;
  absl::StatusOr<HeadResult> result =
      RunHead<double>(*config, batch->Inputs(*config),
                      {absl::MakeSpan(grad)}, allocator, {}, {});
  ASSERT_TRUE(result.ok()) << result.status();
  double num = 0, den = 0;
  std::vector<double> want_grad(grad.size(), 0.0);
  for (size_t r = 0; r < batch->rows.size(); ++r) {
    const RowMeta& m = batch->rows[r];
    if (m.mask == 0) continue;
    std::vector<double> z(v);
    double max = -INFINITY;
    for (int64_t j = 0; j < v; ++j) {
      z[j] = 0;
      for (int64_t i = 0; i < h; ++i) {
        z[j] += batch->hidden[r * h + i] * batch->weight[j * h + i];
      }
      max = std::max(max, z[j]);
    }
    double sum = 0;
    for (double x : z) sum += std::exp(x - max);
    const double lse = max + std::log(sum);
    const double w =
        m.mask * std::exp(-std::max(m.position - 1, 0) / 7.0);
    num += w * (lse - z[m.target]);
    den += w;
    for (int64_t j = 0; j < v; ++j) {
      const double dz = w * (std::exp(z[j] - lse) - (j == m.target));
      for (int64_t i = 0; i < h; ++i) {
        want_grad[r * h + i] += dz * batch->weight[j * h + i];
      }
    }
  }
  ASSERT_GT(den, 0);
  EXPECT_NEAR(result->terms.loss_num, num, 1e-12 * num);
  EXPECT_NEAR(result->terms.loss_den, den, 1e-12 * den);
  // The gradient is of loss = loss_num / loss_den.
  double scale = 0;
  for (double g : want_grad) scale = std::max(scale, std::abs(g / den));
  for (size_t i = 0; i < grad.size(); ++i) {
    ASSERT_NEAR(grad[i], want_grad[i] / den, 1e-12 * scale) << i;
  }
}

}  // namespace
}  // namespace dflash
