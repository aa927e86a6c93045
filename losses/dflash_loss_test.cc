#include "losses/dflash_loss.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dflash {
namespace {

constexpr int64_t kBlocks = 4;  // B = 2, N = 2.
constexpr int64_t kK = 5;
constexpr int64_t kV = 13;
constexpr int64_t kRows = kBlocks * kK;

struct Batch {
  std::vector<double> logits;
  std::vector<RowMeta> rows;
};

// Random logits and targets; slot 0 of every block and a few other rows
// carry no loss, as the DFlash weight mask would have it.
Batch MakeBatch(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(-3, 3);
  std::uniform_int_distribution<int32_t> token(0, kV - 1);
  Batch batch;
  batch.logits.resize(kRows * kV);
  for (double& x : batch.logits) x = uniform(rng);
  for (int64_t r = 0; r < kRows; ++r) {
    const int32_t k = static_cast<int32_t>(r % kK);
    const bool masked = k == 0 || r == 7 || r >= 3 * kK + 2;
    batch.rows.push_back({token(rng), k, masked ? 0.0f : 1.0f});
  }
  return batch;
}

// Independent reference, written from SEMANTICS.md section 3.
struct Reference {
  double num = 0, den = 0, correct = 0, acc_den = 0;
};
Reference Naive(const Batch& batch, double gamma) {
  Reference ref;
  for (int64_t r = 0; r < kRows; ++r) {
    const RowMeta& m = batch.rows[r];
    const double* x = &batch.logits[r * kV];
    double sum = 0;
    int best = 0;
    for (int v = 0; v < kV; ++v) {
      sum += std::exp(x[v]);
      if (x[v] > x[best]) best = v;
    }
    const double neg_log_q = std::log(sum) - x[m.target];
    const double decay =
        gamma > 0 ? std::exp(-std::max(m.position - 1, 0) / gamma) : 1.0;
    const double w = m.mask * decay;
    ref.num += neg_log_q * w;
    ref.den += w;
    ref.correct += (best == m.target && m.mask > 0.5);
    ref.acc_den += m.mask;
  }
  return ref;
}

v1::DFlashLoss Gamma(double gamma) {
  v1::DFlashLoss config;
  config.set_gamma(gamma);
  return config;
}

TEST(DFlashLossTest, MatchesNaiveFloat64Reference) {
  for (double gamma : {0.0, 7.0, 2.5}) {
    Batch batch = MakeBatch(11);
    const Reference ref = Naive(batch, gamma);
    auto terms = DFlashCrossEntropyChunk<double>(
        Gamma(gamma), kK, absl::MakeSpan(batch.logits), kV, batch.rows);
    ASSERT_TRUE(terms.ok()) << terms.status();
    EXPECT_NEAR(terms->loss_num, ref.num, 1e-10) << gamma;
    EXPECT_NEAR(terms->loss_den, ref.den, 1e-10) << gamma;
    EXPECT_EQ(terms->correct, ref.correct);
    EXPECT_EQ(terms->accuracy_den, ref.acc_den);
  }
}

TEST(DFlashLossTest, GammaSevenDecayIsExact) {
  v1::DFlashLoss config = Gamma(7);
  EXPECT_EQ(DFlashWeight(config, 0, 1.0f), 1.0);
  EXPECT_EQ(DFlashWeight(config, 1, 1.0f), 1.0);
  EXPECT_DOUBLE_EQ(DFlashWeight(config, 2, 1.0f), std::exp(-1.0 / 7));
  EXPECT_DOUBLE_EQ(DFlashWeight(config, 4, 0.5f), 0.5 * std::exp(-3.0 / 7));
  EXPECT_EQ(DFlashWeight(v1::DFlashLoss(), 4, 1.0f), 1.0);  // gamma absent
}

TEST(DFlashLossTest, GradientMatchesFiniteDifferences) {
  const double gamma = 7;
  Batch batch = MakeBatch(5);
  std::vector<double> grad = batch.logits;
  ASSERT_TRUE(DFlashCrossEntropyChunk<double>(Gamma(gamma), kK,
                                              absl::MakeSpan(grad), kV,
                                              batch.rows)
                  .ok());
  const double h = 1e-6;
  for (int64_t i = 0; i < kRows * kV; i += 7) {
    Batch plus = batch, minus = batch;
    plus.logits[i] += h;
    minus.logits[i] -= h;
    const double numeric =
        (Naive(plus, gamma).num - Naive(minus, gamma).num) / (2 * h);
    EXPECT_NEAR(grad[i], numeric, 1e-8) << "logit " << i;
  }
  // Rows without weight get an exactly zero gradient.
  for (int64_t v = 0; v < kV; ++v) EXPECT_EQ(grad[7 * kV + v], 0.0);
}

TEST(DFlashLossTest, Float32WithinOneInTenToTheFiveOfFloat64) {
  Batch batch = MakeBatch(9);
  std::vector<float> logits32(batch.logits.begin(), batch.logits.end());
  std::vector<double> rounded(logits32.begin(), logits32.end());
  auto t64 = DFlashCrossEntropyChunk<double>(Gamma(7), kK,
                                             absl::MakeSpan(rounded), kV,
                                             batch.rows);
  auto t32 = DFlashCrossEntropyChunk<float>(Gamma(7), kK,
                                            absl::MakeSpan(logits32), kV,
                                            batch.rows);
  ASSERT_TRUE(t64.ok() && t32.ok());
  EXPECT_NEAR(t32->loss_num, t64->loss_num, 1e-5 * std::abs(t64->loss_num));
  for (size_t i = 0; i < rounded.size(); ++i) {
    EXPECT_NEAR(logits32[i], rounded[i], 1e-5 * (std::abs(rounded[i]) + 1e-2));
  }
}

TEST(DFlashLossTest, WholeBlockChunksSumToTheUnchunkedTerms) {
  Batch batch = MakeBatch(21);
  Batch whole = batch;
  auto all = DFlashCrossEntropyChunk<double>(Gamma(7), kK,
                                             absl::MakeSpan(whole.logits), kV,
                                             whole.rows);
  ASSERT_TRUE(all.ok());
  ChunkTerms sum;
  sum.correct_per_position.assign(kK, 0);
  for (int64_t block = 0; block < kBlocks; ++block) {
    auto part = DFlashCrossEntropyChunk<double>(
        Gamma(7), kK,
        absl::MakeSpan(batch.logits).subspan(block * kK * kV, kK * kV), kV,
        absl::MakeConstSpan(batch.rows).subspan(block * kK, kK));
    ASSERT_TRUE(part.ok());
    sum.loss_num += part->loss_num;
    sum.loss_den += part->loss_den;
    sum.correct += part->correct;
    for (int64_t k = 0; k < kK; ++k) {
      sum.correct_per_position[k] += part->correct_per_position[k];
    }
  }
  EXPECT_NEAR(sum.loss_num, all->loss_num, 1e-12 * all->loss_num);
  EXPECT_DOUBLE_EQ(sum.loss_den, all->loss_den);
  EXPECT_EQ(sum.correct, all->correct);
  EXPECT_EQ(sum.correct_per_position, all->correct_per_position);
  EXPECT_EQ(batch.logits, whole.logits);  // Same gradients.
}

TEST(DFlashLossTest, BadInputsAreErrors) {
  Batch batch = MakeBatch(1);
  auto rows = batch.rows;
  rows[3].position = 5;
  EXPECT_EQ(DFlashCrossEntropyChunk<double>(Gamma(7), kK,
                                            absl::MakeSpan(batch.logits), kV,
                                            rows)
                .status()
                .message(),
            "row 3: block position 5 is outside [0, 5)");
  rows = batch.rows;
  rows[2].mask = -1;
  EXPECT_EQ(DFlashCrossEntropyChunk<double>(Gamma(7), kK,
                                            absl::MakeSpan(batch.logits), kV,
                                            rows)
                .status()
                .message(),
            "row 2: mask must be finite and >= 0, got -1");
  rows = batch.rows;
  rows[1].target = kV;
  EXPECT_EQ(DFlashCrossEntropyChunk<double>(Gamma(7), kK,
                                            absl::MakeSpan(batch.logits), kV,
                                            rows)
                .status()
                .message(),
            "row 1: target id 13 is outside [0, 13)");
  EXPECT_EQ(DFlashCrossEntropyChunk<double>(
                Gamma(7), kK, absl::MakeSpan(batch.logits).subspan(1), kV,
                batch.rows)
                .status()
                .message(),
            "dflash loss: logits hold 259 values, expected 20 rows x 13 vocab");
}

}  // namespace
}  // namespace dflash
