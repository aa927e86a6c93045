// Hardening of the CPU head: measured peak bytes never exceed what the plan
// and the checkpoint policy predict, in every mode; numerics at the edges
// (|logits| = 1e4, V = 262144, a row count that is no multiple of the
// chunk, every row masked, a single row, K = 1) stay finite and equal the
// float64 reference; shapes whose N x V passes 2^31 are planned and
// refused cleanly, without allocating them.
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "heads/head_plan.h"
#include "proto/config.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using namespace head_test;  // NOLINT: the suite's shared vocabulary.

struct HeadRunResult {
  absl::StatusOr<HeadResult> result;
  std::vector<double> grad_hidden, grad_weight;
};

// RunHead<double> of `config` over rows, states and weight given directly.
HeadRunResult RunDouble(const v1::ObjectiveConfig& config,
                        absl::Span<const RowMeta> rows,
                        const std::vector<double>& hidden,
                        const std::vector<double>& teacher,
                        const std::vector<double>& weight,
                        TrackingAllocator& allocator) {
  HeadRunResult run;
  run.grad_hidden.assign(hidden.size(), 0);
  if (config.head().trainable()) run.grad_weight.assign(weight.size(), 0);
  const HeadInputs<double> inputs{hidden,
                                  LossNeedsTeacher(config.loss())
                                      ? absl::MakeConstSpan(teacher)
                                      : absl::Span<const double>(),
                                  {},
                                  rows,
                                  weight,
                                  {}};
  run.result = RunHead<double>(config, inputs,
                               {absl::MakeSpan(run.grad_hidden),
                                absl::MakeSpan(run.grad_weight),
                                {},
                                {}},
                               allocator);
  return run;
}

// Every mode and policy shape: the measured peak is within the prediction,
// and at least one chunk's logits (the prediction is not vacuous).
TEST(HeadMemoryPredictionTest, PeakNeverExceedsThePrediction) {
  const Batch b = MakeBatch(31, 4, 3);  // 12 blocks.
  struct Policy {
    const char* mode;
    int64_t chunk, segment;
    int64_t budget;  // Bytes kept at most; < 0: the Config default (1 GiB).
  };
  const Policy policies[] = {
      {"MATERIALIZE", 1, 1, -1}, {"SAVE_CHUNKS", 1, 1, -1},
      {"SAVE_CHUNKS", 5, 1, -1}, {"CHECKPOINT", 1, 1, -1},
      {"CHECKPOINT", 2, 3, -1},  {"CHECKPOINT", 5, 1000, -1},
      {"SELECTIVE", 2, 2, -1},   {"SELECTIVE", 2, 2, 2000},
      {"SELECTIVE", 1, 1, 1},    {"FUSED", 1, 1, -1},
      {"FUSED", 12, 1, -1},
  };
  for (const char* loss : {"dflash { gamma: 7 }", "distillation { }"}) {
    for (bool trainable : {false, true}) {
      for (const Policy& policy : policies) {
        SCOPED_TRACE(absl::StrCat(loss, " ", policy.mode, " chunk ",
                                  policy.chunk, " segment ", policy.segment,
                                  " budget ", policy.budget, " trainable ",
                                  trainable));
        v1::ObjectiveConfig config = ConfigBuilder(loss)
                                         .Mode(policy.mode)
                                         .BlocksPerChunk(policy.chunk)
                                         .Segment(policy.segment)
                                         .Trainable(trainable)
                                         .Bias(false)
                                         .Build();
        if (policy.budget >= 0) {
          config.mutable_checkpoint()->set_memory_budget_bytes(policy.budget);
        }
        ASSERT_TRUE(ValidateObjectiveConfig(config).ok())
            << ValidateObjectiveConfig(config);
        absl::StatusOr<int64_t> predicted =
            PredictPeakBytes(config, b.rows, sizeof(double));
        ASSERT_TRUE(predicted.ok()) << predicted.status();
        TrackingAllocator allocator;
        const HeadRunResult run =
            RunDouble(config, b.rows, b.hidden, b.teacher, b.weight, allocator);
        ASSERT_TRUE(run.result.ok()) << run.result.status();
        const int64_t peak = run.result->stats.peak_bytes;
        EXPECT_LE(peak, *predicted);
        absl::StatusOr<HeadPlan> plan =
            PlanHead(config, b.rows, sizeof(double));
        ASSERT_TRUE(plan.ok());
        EXPECT_GE(peak, plan->max_chunk_rows * kV * int64_t{sizeof(double)});
      }
    }
  }
}

// A batch of `blocks` blocks of `k` rows, V = 262144, H = 2; weights of size
// 1e4 / sqrt(2) so that logits reach about 1e4.
struct EdgeBatch {
  int64_t k, blocks;
  std::vector<RowMeta> rows;
  std::vector<double> hidden, teacher, weight;
};

constexpr int64_t kBigVocab = 262144, kSmallHidden = 2;

EdgeBatch MakeEdgeBatch(int64_t k, int64_t blocks, bool mask_all) {
  std::mt19937 rng(static_cast<uint32_t>(k * 1000 + blocks));
  std::uniform_real_distribution<double> uniform(-1, 1);
  std::uniform_int_distribution<int32_t> token(0, kBigVocab - 1);
  EdgeBatch b{k, blocks, {}, {}, {}, {}};
  for (int64_t r = 0; r < k * blocks; ++r) {
    RowMeta meta;
    meta.target = token(rng);
    meta.position = static_cast<int32_t>(r % k);
    meta.block = r / k;
    meta.mask = mask_all ? 0.0f : 1.0f;
    b.rows.push_back(meta);
    for (int64_t h = 0; h < kSmallHidden; ++h) {
      b.hidden.push_back(uniform(rng));
      b.teacher.push_back(b.hidden.back() + 0.1 * uniform(rng));
    }
  }
  for (int64_t i = 0; i < kBigVocab * kSmallHidden; ++i) {
    b.weight.push_back(7071 * uniform(rng));
  }
  return b;
}

v1::ObjectiveConfig EdgeConfig(const std::string& loss, const char* mode,
                               int64_t k, int64_t blocks_per_chunk) {
  auto config = LoadObjectiveConfigFromString(absl::StrCat(
      "layout { block_size: ", k,
      " } chunking { blocks_per_chunk: ", blocks_per_chunk,
      " } head { vocab_size: ", kBigVocab, " hidden_size: ", kSmallHidden,
      " mode: ", mode, " dtype: FLOAT64 threads: 1 } loss { ", loss, " }"));
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// The reference: naive float64 logits, one unchunked loss over all rows
// (verified in //losses), the hidden gradient by naive loops.
struct EdgeReference {
  double loss = 0;
  std::vector<double> grad_hidden;
  // sum_v |d_v W_vh| / den: the size of what each gradient entry sums. Logits
  // of 1e4 carry rounding of about 1e-12 (absolute), so each term carries a
  // relative error of about 1e-12 whichever way the logits were summed; the
  // entry's error scales with this sum, not with the entry.
  std::vector<double> grad_magnitude;
};

EdgeReference Reference(const v1::ObjectiveConfig& config, const EdgeBatch& b) {
  const int64_t n = static_cast<int64_t>(b.rows.size());
  auto project = [&](const std::vector<double>& x) {
    std::vector<double> logits(n * kBigVocab);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t v = 0; v < kBigVocab; ++v) {
        logits[r * kBigVocab + v] =
            x[r * 2] * b.weight[v * 2] + x[r * 2 + 1] * b.weight[v * 2 + 1];
      }
    }
    return logits;
  };
  std::vector<double> d = project(b.hidden);
  const std::vector<double> t = project(b.teacher);
  auto terms = ChunkLoss<double>(config.loss(), {b.k, 1, 0},
                                 {absl::MakeSpan(d), t, {}, b.rows, kBigVocab});
  EXPECT_TRUE(terms.ok()) << terms.status();
  EdgeReference ref;
  const double den = terms->loss_den;
  ref.loss = den > 0 ? terms->loss_num / den : 0;
  ref.grad_hidden.assign(n * 2, 0);
  ref.grad_magnitude.assign(n * 2, 0);
  for (int64_t r = 0; r < n && den > 0; ++r) {
    for (int64_t v = 0; v < kBigVocab; ++v) {
      for (int64_t h = 0; h < 2; ++h) {
        const double term = d[r * kBigVocab + v] / den * b.weight[v * 2 + h];
        ref.grad_hidden[r * 2 + h] += term;
        ref.grad_magnitude[r * 2 + h] += std::abs(term);
      }
    }
  }
  return ref;
}

struct Edge {
  const char* name;
  int64_t k, blocks, blocks_per_chunk;
  bool mask_all;
};

// |logits| up to about 1e4 at V = 262144, in FUSED and CHECKPOINT: a row
// count no multiple of the chunk, K = 1, a single row, every row masked.
TEST(HeadEdgeTest, ExtremeShapesStayFiniteAndExact) {
  const Edge edges[] = {
      {"7 blocks in chunks of 3", 3, 7, 3, false},
      {"K = 1", 1, 5, 2, false},
      {"a single row", 1, 1, 1, false},
      {"every row masked", 2, 3, 2, true},
  };
  for (const Edge& edge : edges) {
    const EdgeBatch b = MakeEdgeBatch(edge.k, edge.blocks, edge.mask_all);
    for (const char* loss : {"dflash { gamma: 7 }", "distillation { }"}) {
      const EdgeReference ref =
          Reference(EdgeConfig(loss, "FUSED", edge.k, 1), b);
      ASSERT_TRUE(std::isfinite(ref.loss));
      for (const char* mode : {"FUSED", "CHECKPOINT"}) {
        SCOPED_TRACE(absl::StrCat(edge.name, " ", loss, " ", mode));
        TrackingAllocator allocator;
        const HeadRunResult run =
            RunDouble(EdgeConfig(loss, mode, edge.k, edge.blocks_per_chunk),
                      b.rows, b.hidden, b.teacher, b.weight, allocator);
        ASSERT_TRUE(run.result.ok()) << run.result.status();
        EXPECT_TRUE(std::isfinite(run.result->loss));
        EXPECT_NEAR(run.result->loss, ref.loss,
                    1e-9 * (1 + std::abs(ref.loss)));
        for (size_t i = 0; i < ref.grad_hidden.size(); ++i) {
          ASSERT_TRUE(std::isfinite(run.grad_hidden[i]));
          EXPECT_NEAR(run.grad_hidden[i], ref.grad_hidden[i],
                      1e-10 * (1 + ref.grad_magnitude[i]));
        }
        if (edge.mask_all) {
          EXPECT_EQ(run.result->loss, 0.0);
          EXPECT_EQ(run.result->stats.gemm_calls, 0);
        }
      }
    }
  }
}

// N x V = 2^32 logits: planned and predicted in 64 bits, and a run that
// would materialize them under a 1 GiB allocator limit is a clean
// ResourceExhausted naming the bytes, without allocating them.
TEST(HeadSizeTest, ProductsBeyondTwoToThe31AreExactAndRefusedCleanly) {
  constexpr int64_t kRows = int64_t{1} << 17, kVocab = int64_t{1} << 15;
  std::vector<RowMeta> rows(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    rows[r] = {static_cast<int32_t>(r % kVocab), static_cast<int32_t>(r % 2),
               1.0f, r / 2};
  }
  auto config = LoadObjectiveConfigFromString(absl::StrCat(
      "layout { block_size: 2 } chunking { blocks_per_chunk: 1 } head { "
      "vocab_size: ",
      kVocab,
      " hidden_size: 1 mode: MATERIALIZE dtype: FLOAT64 } loss { "
      "dflash { } }"));
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<int64_t> predicted = PredictPeakBytes(*config, rows, 8);
  ASSERT_TRUE(predicted.ok()) << predicted.status();
  const int64_t logits_bytes = kRows * kVocab * 8;  // 2^35.
  EXPECT_GE(*predicted, 2 * logits_bytes);  // The workspace and the kept copy.
  EXPECT_LT(*predicted, 3 * logits_bytes);
  v1::ObjectiveConfig fused = *config;
  fused.mutable_head()->set_mode(v1::HeadConfig::FUSED);
  absl::StatusOr<int64_t> fused_predicted = PredictPeakBytes(fused, rows, 8);
  ASSERT_TRUE(fused_predicted.ok());
  EXPECT_EQ(*fused_predicted, 2 * kVocab * 8 + 2 * 2 * 8);  // One block.

  const std::vector<double> hidden(kRows, 0.5), weight(kVocab, 0.25);
  TrackingAllocator limited(int64_t{1} << 30);
  const HeadRunResult run =
      RunDouble(*config, rows, hidden, {}, weight, limited);
  EXPECT_EQ(run.result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(run.result.status().message().find(
                absl::StrCat("allocating ", logits_bytes, " bytes")),
            std::string::npos)
      << run.result.status();
  EXPECT_EQ(limited.current_bytes(), 0);
}

}  // namespace
}  // namespace dflash
