// SplitHeadRun (StartHead): the forward and backward passes apart give
// RunHead's loss, row outputs and gradients, hold between the passes only
// what the mode keeps, repeat, scale by the upstream given at Backward, and
// refuse what does not split.
//
// The reference is RunHead itself in the same mode: it runs the same
// products, losses and scalings in the same order (the CPU backend folds
// no scale into its products), so the split must be bitwise equal to it.
// RunHead is tested against float64 naive references and finite
// differences by //tests:head_parity_test and //tests:head_correction_test.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cpu_head.h"
#include "heads/head_backend.h"
#include "heads/head_types.h"
#include "heads/synthetic_batch.h"
#include "losses/vocab_shard.h"
#include "proto/config.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 61, kHidden = 12, kRank = 3;

struct Family {
  const char* name;
  const char* loss;
  bool correction = false;  // head.correction_rank kRank.
  bool frozen_only = false;  // The batch-level LK lambda: frozen heads only.
};

const Family kFamilies[] = {
    {"DFlash", "dflash { gamma: 7 }"},
    {"DPaceBalanced", "dpace { denominator: SEQUENCE_BALANCED }"},
    {"DSparkConfidence",
     "dspark { gamma: 7 ce_weight: 0.3 l1_weight: 0.2 confidence_weight: 0.7 "
     "}"},
    {"LkLambda", "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }", false,
     true},
    {"Distillation", "distillation {}"},
    {"DominoCorrection", "domino { lambda_base: 0.3 gamma: 3 }", true},
};

const char* const kModes[] = {"MATERIALIZE", "SAVE_CHUNKS", "CHECKPOINT",
                              "SELECTIVE"};

v1::ObjectiveConfig Config(const std::string& loss, const std::string& mode,
                           bool float64, bool trainable, bool correction) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      absl::StrCat("layout { block_size: 4 num_anchors: 4 } head { "
                   "vocab_size: ",
                   kVocab, " hidden_size: ", kHidden, " mode: ", mode,
                   " dtype: ", float64 ? "FLOAT64" : "FLOAT32",
                   " threads: 1 bias: true trainable: ",
                   trainable ? "true" : "false",
                   correction ? absl::StrCat(" correction_rank: ", kRank) : "",
                   " } chunking { blocks_per_chunk: 2 } loss { ", loss, " }",
                   mode == "SELECTIVE"
                       ? " checkpoint { preset: SELECTIVE_FROZEN_PROJECTION }"
                       : ""),
      "test");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// Gradient buffers of a run over `batch`, sized as RunHead wants them.
template <typename T>
struct Gradients {
  Gradients(const v1::ObjectiveConfig& config, const HeadBatch<T>& batch) {
    const v1::HeadConfig& head = config.head();
    const int64_t rows = static_cast<int64_t>(batch.rows.size());
    hidden.assign(rows * head.hidden_size(), T(-7));
    if (head.trainable()) {
      weight.assign(head.vocab_size() * head.hidden_size(), T(-7));
      bias.assign(head.vocab_size(), T(-7));
    }
    confidence.assign(rows, -7);
    correction_inputs.assign(rows * head.correction_rank(), T(-7));
    correction_weight.assign(head.vocab_size() * head.correction_rank(),
                             T(-7));
  }
  HeadGradients<T> View() {
    return {absl::MakeSpan(hidden),           absl::MakeSpan(weight),
            absl::MakeSpan(bias),             absl::MakeSpan(confidence),
            absl::MakeSpan(correction_inputs), absl::MakeSpan(correction_weight)};
  }
  bool operator==(const Gradients& o) const {
    return hidden == o.hidden && weight == o.weight && bias == o.bias &&
           confidence == o.confidence &&
           correction_inputs == o.correction_inputs &&
           correction_weight == o.correction_weight;
  }
  // Every value times `factor` (exact for a power of two).
  Gradients Times(double factor) const {
    Gradients out = *this;
    for (std::vector<T>* v : {&out.hidden, &out.weight, &out.bias,
                              &out.correction_inputs, &out.correction_weight}) {
      for (T& x : *v) x = static_cast<T>(x * factor);
    }
    for (ConfidenceOf<T>& x : out.confidence) {
      x = static_cast<ConfidenceOf<T>>(x * factor);
    }
    return out;
  }
  std::vector<T> hidden, weight, bias;
  std::vector<ConfidenceOf<T>> confidence;
  std::vector<T> correction_inputs, correction_weight;
};

struct RowOutputs {
  // `k` top-k ids a row (domino reports none).
  RowOutputs(int64_t rows, int32_t k)
      : neg_log_q(rows, -1), argmax(rows, -2), top_k(rows * k, -2),
        top_k_values(rows * k, -2), loss_weight(rows, -1), k(k) {}
  HeadRowOutputs View() {
    HeadRowOutputs o;
    o.neg_log_q = absl::MakeSpan(neg_log_q);
    o.argmax = absl::MakeSpan(argmax);
    o.top_k = absl::MakeSpan(top_k);
    o.k = k;
    o.top_k_values = absl::MakeSpan(top_k_values);
    o.loss_weight = absl::MakeSpan(loss_weight);
    return o;
  }
  std::vector<double> neg_log_q;
  std::vector<int32_t> argmax, top_k;
  std::vector<float> top_k_values;
  std::vector<double> loss_weight;
  int32_t k;
};

template <typename T>
void ExpectSplitEqualsRunHead(const Family& family, const char* mode,
                              bool trainable) {
  const v1::ObjectiveConfig config =
      Config(family.loss, mode, std::is_same_v<T, double>, trainable,
             family.correction);
  absl::StatusOr<HeadBatch<T>> batch =
      MakeSyntheticBatch<T>(config, {2, 64, 4}, 11);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const HeadInputs<T> inputs = batch->Inputs(config);
  const int64_t rows = static_cast<int64_t>(batch->rows.size());

  // RunHead, upstream 1 and 3.
  TrackingAllocator allocator;
  Gradients<T> whole(config, *batch), whole3(config, *batch);
  const int32_t k = config.loss().has_domino() ? 0 : 2;
  RowOutputs whole_rows(rows, k);
  absl::StatusOr<HeadResult> reference = RunHead<T>(
      config, inputs, whole.View(), allocator, whole_rows.View(), {});
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(reference->stats.saved_bytes, 0);  // Nothing outlives RunHead.
  HeadOptions three;
  three.upstream_gradient = 3;
  ASSERT_TRUE(
      RunHead<T>(config, inputs, whole3.View(), allocator, {}, three).ok());

  const int64_t base = allocator.current_bytes();
  RowOutputs split_rows(rows, k);
  absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> split =
      StartHead<T>(config, inputs, allocator, split_rows.View(), {});
  ASSERT_TRUE(split.ok()) << split.status();
  SplitHeadRun<T>& run = **split;

  // The forward pass: RunHead's loss, terms and row outputs.
  const HeadResult& forward = run.forward();
  EXPECT_EQ(forward.loss, reference->loss);
  EXPECT_EQ(forward.loss_denominator, reference->loss_denominator);
  EXPECT_EQ(forward.accuracy, reference->accuracy);
  EXPECT_EQ(forward.terms.loss_num, reference->terms.loss_num);
  EXPECT_EQ(forward.lk_kl_weight, reference->lk_kl_weight);
  EXPECT_EQ(forward.accuracy_per_position, reference->accuracy_per_position);
  EXPECT_EQ(split_rows.neg_log_q, whole_rows.neg_log_q);
  EXPECT_EQ(split_rows.argmax, whole_rows.argmax);
  EXPECT_EQ(split_rows.top_k, whole_rows.top_k);
  EXPECT_EQ(split_rows.top_k_values, whole_rows.top_k_values);
  EXPECT_EQ(split_rows.loss_weight, whole_rows.loss_weight);

  // Between the passes: what the mode keeps in the allocator, no
  // gradient-sized buffer; and the backend's per-row state in host vectors
  // of doubles (q; DSpark's confidence gradient; the teacher acceptance
  // where recorded) and int32s (the target's rank under a top-k metric;
  // Domino's two argmaxes), and a frozen FLOAT32 head's own laid-out weight.
  const int64_t held = allocator.current_bytes() - base;
  const int64_t active = forward.stats.projected_rows;
  ASSERT_GT(active, 0);
  int64_t row_bytes = 8;
  if (std::string(family.name) == "DSparkConfidence") row_bytes += 8;
  if (RecordsTeacherAcceptance(config)) row_bytes += 8;
  if (ChunkLossOptionsOf(config).metric_top_k > 0) row_bytes += 4;
  if (config.loss().has_domino()) row_bytes += 2 * 4;
  int64_t weight_bytes = 0;
  if (forward.stats.gemm_library.find("laid out for this run") !=
      std::string::npos) {
    absl::StatusOr<int64_t> laid_out = PredictProjectionBytes(config);
    ASSERT_TRUE(laid_out.ok()) << laid_out.status();
    ASSERT_GT(*laid_out, 0);
    weight_bytes = *laid_out;
  }
  EXPECT_EQ(run.saved_bytes(), held + rows * row_bytes + weight_bytes);
  EXPECT_EQ(forward.stats.saved_bytes, run.saved_bytes());
  const int64_t logits_bytes = (family.correction ? 2 : 1) * active * kVocab *
                               static_cast<int64_t>(sizeof(T));
  const std::string m = mode;
  if (m == "MATERIALIZE" || m == "SAVE_CHUNKS") {
    // Every logits gradient; the teacher logits are dropped after forward.
    EXPECT_EQ(held, logits_bytes);
  } else if (m == "CHECKPOINT") {
    EXPECT_EQ(held, 0);
  } else {
    // SELECTIVE: the teacher logits where a teacher is projected.
    EXPECT_LE(held, active * kVocab * static_cast<int64_t>(sizeof(T)));
  }

  // Backward, upstream 1: RunHead's gradients, bitwise.
  Gradients<T> first(config, *batch);
  allocator.ResetPeak();
  absl::StatusOr<HeadStats> stats = run.Backward(1.0, first.View(), nullptr);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->saved_bytes, 0);  // A backward pass's stats.
  // Its peak above the level before Forward, the forward's bytes included.
  EXPECT_EQ(stats->peak_bytes, allocator.peak_bytes() - base);
  EXPECT_TRUE(first == whole);
  EXPECT_EQ(first.hidden, whole.hidden);
  EXPECT_EQ(first.weight, whole.weight);
  EXPECT_EQ(first.correction_weight, whole.correction_weight);
  EXPECT_EQ(first.confidence, whole.confidence);
  EXPECT_GT(stats->gemm_calls, 0);
  // Backward frees what it recomputed.
  EXPECT_EQ(allocator.current_bytes() - base, held);

  // Again: the same gradients.
  Gradients<T> second(config, *batch);
  ASSERT_TRUE(run.Backward(1.0, second.View(), nullptr).ok());
  EXPECT_TRUE(second == first);
  EXPECT_EQ(allocator.current_bytes() - base, held);
  EXPECT_EQ(run.saved_bytes(), forward.stats.saved_bytes);

  // Upstream 2 scales exactly; upstream 3 is RunHead's with upstream 3.
  Gradients<T> twice(config, *batch);
  ASSERT_TRUE(run.Backward(2.0, twice.View(), nullptr).ok());
  EXPECT_TRUE(twice == first.Times(2.0));
  Gradients<T> thrice(config, *batch);
  ASSERT_TRUE(run.Backward(3.0, thrice.View(), nullptr).ok());
  EXPECT_TRUE(thrice == whole3);

  split->reset();
  EXPECT_EQ(allocator.current_bytes(), base);
}

class SplitHeadRunTest
    : public ::testing::TestWithParam<std::tuple<Family, const char*>> {};

TEST_P(SplitHeadRunTest, EqualsRunHeadInEveryPass) {
  const auto& [family, mode] = GetParam();
  for (bool trainable : {false, true}) {
    if (trainable && family.frozen_only) continue;
    SCOPED_TRACE(trainable ? "trainable" : "frozen");
    {
      SCOPED_TRACE("float64");
      ExpectSplitEqualsRunHead<double>(family, mode, trainable);
    }
    {
      SCOPED_TRACE("float32");
      ExpectSplitEqualsRunHead<float>(family, mode, trainable);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    FamiliesAndModes, SplitHeadRunTest,
    ::testing::Combine(::testing::ValuesIn(kFamilies),
                       ::testing::ValuesIn(kModes)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_",
                          std::get<1>(info.param));
    });

// CHECKPOINT's segments of two chunks and a kept budget for the teacher
// logits: the same as RunHead too.
TEST(SplitHeadRunTest, CheckpointRulesAndSegments) {
  for (const char* checkpoint :
       {"checkpoint { segment_chunks: 2 preset: FULL_RECOMPUTE }",
        "checkpoint { memory_budget_bytes: 4000 rules { kind: PROJECTION "
        "action: PREFER_SAVE } }"}) {
    SCOPED_TRACE(checkpoint);
    absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
        absl::StrCat("layout { block_size: 4 num_anchors: 4 } head { "
                     "vocab_size: 61 hidden_size: 12 mode: CHECKPOINT dtype: "
                     "FLOAT64 trainable: true threads: 1 } chunking { "
                     "blocks_per_chunk: 1 } loss { distillation {} } ",
                     checkpoint),
        "test");
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<HeadBatch<double>> batch =
        MakeSyntheticBatch<double>(*config, {2, 64, 4}, 3);
    ASSERT_TRUE(batch.ok()) << batch.status();
    const HeadInputs<double> inputs = batch->Inputs(*config);
    TrackingAllocator allocator;
    Gradients<double> whole(*config, *batch), split_grad(*config, *batch);
    ASSERT_TRUE(
        RunHead<double>(*config, inputs, whole.View(), allocator).ok());
    auto split = StartHead<double>(*config, inputs, allocator);
    ASSERT_TRUE(split.ok()) << split.status();
    for (int pass = 0; pass < 2; ++pass) {
      absl::StatusOr<HeadStats> stats =
          (*split)->Backward(1.0, split_grad.View(), nullptr);
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_TRUE(split_grad == whole);
    }
  }
}

// A frozen FLOAT32 head's own laid-out weight is held between the passes;
// with head.gradient_filter, its tile copy too once the first Backward has
// made it (PredictProjectionBytes counts both copies and the tiles).
TEST(SplitHeadRunTest, SavedBytesCountTheOwnLaidOutWeightAndItsTiles) {
  v1::ObjectiveConfig config =
      Config("dflash { gamma: 7 }", "CHECKPOINT", false, false, false);
  config.mutable_head()->set_gradient_filter(0.5);
  v1::ObjectiveConfig unfiltered = config;
  unfiltered.mutable_head()->clear_gradient_filter();
  absl::StatusOr<HeadBatch<float>> batch =
      MakeSyntheticBatch<float>(config, {2, 64, 4}, 11);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const int64_t rows = static_cast<int64_t>(batch->rows.size());
  TrackingAllocator allocator;
  auto split = StartHead<float>(config, batch->Inputs(config), allocator);
  ASSERT_TRUE(split.ok()) << split.status();
  if ((*split)->forward().stats.gemm_library.find("laid out for this run") ==
      std::string::npos) {
    GTEST_SKIP() << "no optimised oneDNN kernel here: "
                 << (*split)->forward().stats.gemm_library;
  }
  absl::StatusOr<int64_t> packed = PredictProjectionBytes(unfiltered);
  absl::StatusOr<int64_t> with_tiles = PredictProjectionBytes(config);
  ASSERT_TRUE(packed.ok() && with_tiles.ok());
  ASSERT_GT(*with_tiles, *packed);
  // CHECKPOINT keeps nothing in the allocator; q and the target's rank (a
  // top-k metric) a row outside it.
  int64_t row_bytes = 8;
  if (ChunkLossOptionsOf(config).metric_top_k > 0) row_bytes += 4;
  EXPECT_EQ(allocator.current_bytes(), 0);
  EXPECT_EQ((*split)->saved_bytes(), rows * row_bytes + *packed);
  Gradients<float> gradients(config, *batch);
  ASSERT_TRUE((*split)->Backward(1.0, gradients.View(), nullptr).ok());
  EXPECT_EQ((*split)->saved_bytes(), rows * row_bytes + *with_tiles);
  EXPECT_EQ((*split)->forward().stats.saved_bytes, rows * row_bytes + *packed);
}

class SplitHeadRunRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = Config("dspark { gamma: 7 confidence_weight: 0.5 }",
                     "CHECKPOINT", true, true, false);
    absl::StatusOr<HeadBatch<double>> batch =
        MakeSyntheticBatch<double>(config_, {1, 64, 4}, 5);
    ASSERT_TRUE(batch.ok()) << batch.status();
    batch_ = *std::move(batch);
  }
  absl::StatusOr<std::unique_ptr<SplitHeadRun<double>>> Start(
      const v1::ObjectiveConfig& config, const HeadOptions& options = {}) {
    return StartHead<double>(config, batch_.Inputs(config), allocator_, {},
                             options);
  }
  v1::ObjectiveConfig config_;
  HeadBatch<double> batch_;
  TrackingAllocator allocator_;
};

TEST_F(SplitHeadRunRefusalTest, FusedForwardOnlyAndVocabShardDoNotSplit) {
  v1::ObjectiveConfig fused = config_;
  fused.mutable_head()->set_mode(v1::HeadConfig::FUSED);
  EXPECT_FALSE(SplitsBackward(fused, {}));
  absl::StatusOr<std::unique_ptr<SplitHeadRun<double>>> run = Start(fused);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status().message(), HasSubstr("head.mode: FUSED"));

  HeadOptions forward_only;
  forward_only.forward_only = true;
  EXPECT_FALSE(SplitsBackward(config_, forward_only));
  run = Start(config_, forward_only);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status().message(), HasSubstr("options.forward_only"));

  const VocabShard shard{0, kVocab, nullptr};
  HeadOptions sharded;
  sharded.vocab_shard = &shard;
  EXPECT_FALSE(SplitsBackward(config_, sharded));
  run = Start(config_, sharded);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status().message(), HasSubstr("options.vocab_shard"));

  HeadOptions upstream;
  upstream.upstream_gradient = 2;
  run = Start(config_, upstream);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status().message(), HasSubstr("options.upstream_gradient"));

  EXPECT_TRUE(SplitsBackward(config_, {}));
  EXPECT_TRUE(Start(config_).ok());
}

TEST_F(SplitHeadRunRefusalTest, WrongGradientBuffersAreRefusedAndHarmless) {
  auto run = Start(config_);
  ASSERT_TRUE(run.ok()) << run.status();
  Gradients<double> good(config_, batch_);
  Gradients<double> bad = good;
  bad.hidden.pop_back();
  absl::StatusOr<HeadStats> stats =
      (*run)->Backward(1.0, bad.View(), nullptr);
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stats.status().message(), HasSubstr("gradients.hidden"));
  bad = good;
  bad.weight.clear();
  stats = (*run)->Backward(1.0, bad.View(), nullptr);
  EXPECT_THAT(stats.status().message(), HasSubstr("gradients.weight"));
  bad = good;
  bad.confidence.pop_back();
  stats = (*run)->Backward(1.0, bad.View(), nullptr);
  EXPECT_THAT(stats.status().message(), HasSubstr("gradients.confidence"));
  stats = (*run)->Backward(std::nan(""), good.View(), nullptr);
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stats.status().message(), HasSubstr("upstream"));
  // Nothing was touched: the run still works.
  EXPECT_TRUE((*run)->Backward(1.0, good.View(), nullptr).ok());
}

TEST_F(SplitHeadRunRefusalTest, ACancelledBackwardBreaksTheRun) {
  auto run = Start(config_);
  ASSERT_TRUE(run.ok()) << run.status();
  Gradients<double> gradients(config_, batch_);
  std::atomic<bool> interrupt{true};
  absl::StatusOr<HeadStats> stats =
      (*run)->Backward(1.0, gradients.View(), &interrupt);
  EXPECT_EQ(stats.status(),
            absl::CancelledError("the head run was interrupted"));
  stats = (*run)->Backward(1.0, gradients.View(), nullptr);
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stats.status().message(), HasSubstr("failed or was cancelled"));
}

}  // namespace
}  // namespace dflash
