#include "tests/head_test_util.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losses/batch_layout.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "proto/config.h"

namespace dflash {
namespace head_test {

Batch MakeBatch(uint32_t seed, int64_t batch, int64_t anchors) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(-1, 1);
  std::uniform_int_distribution<int64_t> token(0, kV - 1);
  Batch b;
  b.batch = batch;
  b.anchors = anchors;
  std::vector<int64_t> ids(batch * kS);
  for (int64_t& id : ids) id = token(rng);
  std::vector<uint8_t> loss_mask(batch * kS, 1);
  for (int64_t s = 0; s < batch * kS; s += 5) loss_mask[s] = 0;
  const TokenBatch tokens{batch, kS, ids, loss_mask};
  auto sampled = SampleAnchors(tokens, anchors, seed);
  EXPECT_TRUE(sampled.ok()) << sampled.status();
  auto rows = LabelRows(tokens, sampled->positions, sampled->keep,
                        sampled->num_anchors, kK, kV, Labeling::kDFlash);
  EXPECT_TRUE(rows.ok()) << rows.status();
  b.rows = *rows;
  const int64_t n = b.num_rows();
  for (int64_t i = 0; i < n * kH; ++i) b.hidden.push_back(uniform(rng));
  for (int64_t i = 0; i < n * kH; ++i) b.teacher.push_back(uniform(rng));
  for (int64_t i = 0; i < kV * kH; ++i) b.weight.push_back(2 * uniform(rng));
  for (int64_t i = 0; i < kV; ++i) b.bias.push_back(uniform(rng));
  for (int64_t i = 0; i < n; ++i) {
    b.confidence.push_back(static_cast<float>(uniform(rng)));
  }
  return b;
}

namespace {

std::vector<double> NaiveLogits(const std::vector<double>& x, const Batch& b,
                                bool bias) {
  const int64_t n = b.num_rows();
  std::vector<double> logits(n * kV);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      double sum = bias ? b.bias[v] : 0.0;
      for (int64_t h = 0; h < kH; ++h)
        sum += x[r * kH + h] * b.weight[v * kH + h];
      logits[r * kV + v] = sum;
    }
  }
  return logits;
}

}  // namespace

Reference Naive(const v1::ObjectiveConfig& config, const Batch& b) {
  const bool bias = config.head().bias();
  const int64_t n = b.num_rows();
  std::vector<double> d = NaiveLogits(b.hidden, b, bias);
  const std::vector<double> t = NaiveLogits(b.teacher, b, bias);
  Reference ref;
  ref.grad_confidence.assign(n, 0);
  ref.neg_log_q.assign(n, 0);
  ref.argmax.assign(n, 0);
  ref.top_k.assign(n * kTopK, 0);
  std::vector<double> q(n);
  ChunkLossOutputs outputs{absl::MakeSpan(ref.grad_confidence),
                           absl::MakeSpan(ref.neg_log_q),
                           absl::MakeSpan(ref.argmax),
                           absl::MakeSpan(ref.top_k),
                           kTopK,
                           absl::MakeSpan(q)};
  auto terms = ChunkLoss<double>(config.loss(), ChunkLossOptionsOf(config),
                                 {absl::MakeSpan(d), t, b.confidence, b.rows, kV},
                                 outputs);
  EXPECT_TRUE(terms.ok()) << terms.status();
  ref.terms = *terms;
  // The whole batch in one chunk: the batch-level LK lambda is composed here.
  const std::optional<double> kl_weight =
      FinishTerms(LossParamsOf(config.loss()), ref.terms, 1).lk_kl_weight;
  const double den = ref.terms.loss_den;
  ref.loss = den > 0 ? ref.terms.loss_num / den : 0;
  const double s = den > 0 ? 1 / den : 0;
  ref.grad_hidden.assign(n * kH, 0);
  ref.grad_weight.assign(kV * kH, 0);
  ref.grad_bias.assign(kV, 0);
  for (int64_t r = 0; r < n; ++r) {
    const double row_scale =
        kl_weight ? s * LkDeferredFactor(*kl_weight, q[r]) : s;
    for (int64_t v = 0; v < kV; ++v) {
      const double g = row_scale * d[r * kV + v];
      ref.grad_bias[v] += g;
      for (int64_t h = 0; h < kH; ++h) {
        ref.grad_hidden[r * kH + h] += g * b.weight[v * kH + h];
        ref.grad_weight[v * kH + h] += g * b.hidden[r * kH + h];
      }
    }
    ref.grad_confidence[r] *= s;
  }
  return ref;
}

bool TrainsWith(const std::string& loss) {
  return LossParamsOf(ConfigBuilder(loss).Build().loss()).lk !=
         LkMode::kLambdaBatch;
}

v1::ObjectiveConfig ConfigBuilder::Build() const {
  std::string checkpoint;
  if (mode_ == "SELECTIVE") {
    checkpoint = absl::StrCat(
        "checkpoint { preset: SELECTIVE_FROZEN_PROJECTION segment_chunks: ",
        segment_, " memory_budget_bytes: 1073741824 }");
  } else if (mode_ == "CHECKPOINT") {
    checkpoint = absl::StrCat("checkpoint { segment_chunks: ", segment_, " }");
  }
  const std::string text = absl::StrCat(
      "layout { block_size: ", kK, " num_anchors: 3 } chunking { ",
      "blocks_per_chunk: ", blocks_per_chunk_, " } ", checkpoint,
      " head { vocab_size: ", kV, " hidden_size: ", kH, " mode: ", mode_,
      " threads: ", threads_, " trainable: ", trainable_ ? "true" : "false",
      " bias: ", bias_ ? "true" : "false", " dtype: FLOAT64 ", extra_head_,
      " } loss { ", loss_, " }");
  auto config = LoadObjectiveConfigFromString(text);
  EXPECT_TRUE(config.ok()) << config.status() << "\n" << text;
  return *config;
}

void ExpectMatchesReference(const HeadResult& result, const RunOutputs& out,
                            const Reference& ref, const Batch& b,
                            bool trainable, double relative, double outputs) {
  EXPECT_NEAR(result.loss, ref.loss, relative * std::abs(ref.loss));
  EXPECT_EQ(result.terms.correct, ref.terms.correct);
  EXPECT_EQ(result.terms.correct_per_position, ref.terms.correct_per_position);
  EXPECT_LT(RelativeError(out.grad_hidden, ref.grad_hidden), relative);
  if (trainable) {
    EXPECT_LT(RelativeError(out.grad_weight, ref.grad_weight), relative);
    EXPECT_LT(RelativeError(out.grad_bias, ref.grad_bias), relative);
  }
  for (size_t r = 0; r < out.grad_confidence.size(); ++r) {
    EXPECT_NEAR(out.grad_confidence[r], ref.grad_confidence[r],
                outputs * (1 + std::abs(ref.grad_confidence[r])))
        << "row " << r;
  }
  for (int64_t r = 0; r < b.num_rows(); ++r) {
    const bool weighted = b.rows[r].mask > 0;
    EXPECT_NEAR(out.neg_log_q[r], weighted ? ref.neg_log_q[r] : 0,
                outputs * (1 + std::abs(ref.neg_log_q[r])))
        << "row " << r;
    EXPECT_EQ(out.argmax[r], weighted ? ref.argmax[r] : -1) << "row " << r;
    for (size_t j = 0; j < out.top_k.size() / b.rows.size(); ++j) {
      EXPECT_EQ(out.top_k[r * kTopK + j],
                weighted ? ref.top_k[r * kTopK + j] : -1)
          << "row " << r;
    }
  }
}

}  // namespace head_test
}  // namespace dflash
