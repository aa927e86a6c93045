#include "losses/chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <string>
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

// Independent reference, written from SEMANTICS.md section 3. `fixed`
// holds the weights constant (they are taken without gradient) for finite
// differences.
struct Reference {
  double num = 0, den = 0, correct = 0, acc_den = 0;
  std::vector<double> weights;
};
Reference Naive(const Batch& batch, const v1::LossConfig& config,
                const std::vector<double>* fixed = nullptr) {
  std::vector<double> neg_log_q(kRows), q(kRows);
  std::vector<int> argmax(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    const double* x = &batch.logits[r * kV];
    double sum = 0;
    argmax[r] = 0;
    for (int v = 0; v < kV; ++v) {
      sum += std::exp(x[v]);
      if (x[v] > x[argmax[r]]) argmax[r] = v;
    }
    neg_log_q[r] = std::log(sum) - x[batch.rows[r].target];
    q[r] = std::exp(-neg_log_q[r]);
  }
  Reference ref;
  ref.weights.resize(kRows);
  for (int64_t b = 0; b < kBlocks; ++b) {
    double prefix[kK], suffix[kK];
    for (int64_t k = 0; k < kK; ++k) {
      const RowMeta& m = batch.rows[b * kK + k];
      const double alpha = config.dpace().alpha();
      const double smooth = m.mask > 0 ? (1 - alpha) * q[b * kK + k] + alpha : 1;
      prefix[k] = smooth * (k > 0 ? prefix[k - 1] : 1.0);
    }
    for (int64_t k = kK - 1; k >= 0; --k) {
      suffix[k] = prefix[k] * batch.rows[b * kK + k].mask +
                  (k + 1 < kK ? suffix[k + 1] : 0.0);
    }
    for (int64_t k = 0; k < kK; ++k) {
      const int64_t r = b * kK + k;
      const RowMeta& m = batch.rows[r];
      double w;
      if (config.has_dpace()) {
        switch (config.dpace().variant()) {
          case v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY:
            w = prefix[k];
            break;
          case v1::DPaceLoss::CONTINUATION_VALUE_ONLY:
            w = suffix[k] / prefix[k];
            break;
          default:
            w = suffix[k];
        }
        w *= m.mask;
      } else {
        const double gamma =
            config.has_dflash() ? config.dflash().gamma() : config.tv().gamma();
        w = m.mask *
            (gamma > 0 ? std::exp(-std::max(m.position - 1, 0) / gamma) : 1.0);
      }
      if (fixed != nullptr) w = (*fixed)[r];
      ref.weights[r] = w;
      ref.num += (config.has_tv() ? 1 - q[r] : neg_log_q[r]) * w;
      ref.den += w;
      ref.correct += (argmax[r] == m.target && m.mask > 0.5);
      ref.acc_den += m.mask;
    }
  }
  return ref;
}

v1::LossConfig Loss(const std::string& family, double gamma = 7,
                    v1::DPaceLoss::Variant variant = v1::DPaceLoss::DPACE) {
  v1::LossConfig config;
  if (family == "dflash") config.mutable_dflash()->set_gamma(gamma);
  if (family == "tv") config.mutable_tv()->set_gamma(gamma);
  if (family == "dpace") {
    config.mutable_dpace()->set_alpha(0.3);
    config.mutable_dpace()->set_variant(variant);
  }
  return config;
}

std::vector<v1::LossConfig> AllLosses() {
  return {Loss("dflash", 0),
          Loss("dflash", 7),
          Loss("dflash", 2.5),
          Loss("tv", 7),
          Loss("tv", 0),
          Loss("dpace", 0, v1::DPaceLoss::DPACE),
          Loss("dpace", 0, v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY),
          Loss("dpace", 0, v1::DPaceLoss::CONTINUATION_VALUE_ONLY)};
}

class LossFamilyTest : public ::testing::TestWithParam<v1::LossConfig> {};

TEST_P(LossFamilyTest, MatchesNaiveFloat64Reference) {
  Batch batch = MakeBatch(11);
  const Reference ref = Naive(batch, GetParam());
  auto terms = SoftmaxFamilyChunkLoss<double>(
      GetParam(), kK, absl::MakeSpan(batch.logits), kV, batch.rows);
  ASSERT_TRUE(terms.ok()) << terms.status();
  EXPECT_NEAR(terms->loss_num, ref.num, 1e-10);
  EXPECT_NEAR(terms->loss_den, ref.den, 1e-10);
  EXPECT_EQ(terms->correct, ref.correct);
  EXPECT_EQ(terms->accuracy_den, ref.acc_den);
}

TEST_P(LossFamilyTest, GradientMatchesFiniteDifferences) {
  Batch batch = MakeBatch(5);
  const std::vector<double> weights = Naive(batch, GetParam()).weights;
  std::vector<double> grad = batch.logits;
  ASSERT_TRUE(SoftmaxFamilyChunkLoss<double>(GetParam(), kK,
                                             absl::MakeSpan(grad), kV,
                                             batch.rows)
                  .ok());
  const double h = 1e-6;
  for (int64_t i = 0; i < kRows * kV; i += 5) {
    Batch plus = batch, minus = batch;
    plus.logits[i] += h;
    minus.logits[i] -= h;
    const double numeric = (Naive(plus, GetParam(), &weights).num -
                            Naive(minus, GetParam(), &weights).num) /
                           (2 * h);
    EXPECT_NEAR(grad[i], numeric, 1e-8) << "logit " << i;
  }
  // Rows without weight get an exactly zero gradient.
  for (int64_t v = 0; v < kV; ++v) EXPECT_EQ(grad[7 * kV + v], 0.0);
}

TEST_P(LossFamilyTest, Float32WithinOneInTenToTheFiveOfFloat64) {
  Batch batch = MakeBatch(9);
  std::vector<float> logits32(batch.logits.begin(), batch.logits.end());
  std::vector<double> rounded(logits32.begin(), logits32.end());
  auto t64 = SoftmaxFamilyChunkLoss<double>(GetParam(), kK,
                                            absl::MakeSpan(rounded), kV,
                                            batch.rows);
  auto t32 = SoftmaxFamilyChunkLoss<float>(GetParam(), kK,
                                           absl::MakeSpan(logits32), kV,
                                           batch.rows);
  ASSERT_TRUE(t64.ok() && t32.ok());
  EXPECT_NEAR(t32->loss_num, t64->loss_num, 1e-5 * std::abs(t64->loss_num));
  for (size_t i = 0; i < rounded.size(); ++i) {
    EXPECT_NEAR(logits32[i], rounded[i], 1e-5 * (std::abs(rounded[i]) + 1e-2));
  }
}

TEST_P(LossFamilyTest, WholeBlockChunksSumToTheUnchunkedTerms) {
  Batch batch = MakeBatch(21);
  Batch whole = batch;
  auto all = SoftmaxFamilyChunkLoss<double>(
      GetParam(), kK, absl::MakeSpan(whole.logits), kV, whole.rows);
  ASSERT_TRUE(all.ok());
  ChunkTerms sum;
  sum.correct_per_position.assign(kK, 0);
  for (int64_t block = 0; block < kBlocks; ++block) {
    auto part = SoftmaxFamilyChunkLoss<double>(
        GetParam(), kK,
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
  EXPECT_NEAR(sum.loss_den, all->loss_den, 1e-12 * all->loss_den);
  EXPECT_EQ(sum.correct, all->correct);
  EXPECT_EQ(sum.correct_per_position, all->correct_per_position);
  EXPECT_EQ(batch.logits, whole.logits);  // Same gradients.
}

TEST_P(LossFamilyTest, AllMaskedGivesFiniteZero) {
  Batch batch = MakeBatch(2);
  for (RowMeta& m : batch.rows) m.mask = 0;
  auto terms = SoftmaxFamilyChunkLoss<double>(
      GetParam(), kK, absl::MakeSpan(batch.logits), kV, batch.rows);
  ASSERT_TRUE(terms.ok());
  EXPECT_EQ(terms->loss_num, 0.0);
  EXPECT_EQ(terms->loss_den, 0.0);
  for (double g : batch.logits) ASSERT_EQ(g, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Families, LossFamilyTest,
                         ::testing::ValuesIn(AllLosses()));

TEST(DFlashLossTest, GammaSevenDecayIsExact) {
  EXPECT_EQ(DFlashWeight(true, 7, 0, 1.0f), 1.0);
  EXPECT_EQ(DFlashWeight(true, 7, 1, 1.0f), 1.0);
  EXPECT_DOUBLE_EQ(DFlashWeight(true, 7, 2, 1.0f), std::exp(-1.0 / 7));
  EXPECT_DOUBLE_EQ(DFlashWeight(true, 7, 4, 0.5f), 0.5 * std::exp(-3.0 / 7));
  EXPECT_EQ(DFlashWeight(false, 7, 4, 1.0f), 1.0);  // gamma absent
  EXPECT_EQ(DFlashWeight(true, 0, 4, 1.0f), 1.0);
}

TEST(DFlashLossTest, BadInputsAreErrors) {
  Batch batch = MakeBatch(1);
  auto rows = batch.rows;
  rows[3].position = 5;
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(Loss("dflash"), kK,
                                            absl::MakeSpan(batch.logits), kV,
                                            rows)
                .status()
                .message(),
            "row 3: block position 5 is outside [0, 5)");
  rows = batch.rows;
  rows[2].mask = -1;
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(Loss("dflash"), kK,
                                            absl::MakeSpan(batch.logits), kV,
                                            rows)
                .status()
                .message(),
            "row 2: mask must be finite and >= 0, got -1");
  rows = batch.rows;
  rows[1].target = kV;
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(Loss("dflash"), kK,
                                            absl::MakeSpan(batch.logits), kV,
                                            rows)
                .status()
                .message(),
            "row 1: target id 13 is outside [0, 13)");
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(
                Loss("dflash"), kK, absl::MakeSpan(batch.logits).subspan(1), kV,
                batch.rows)
                .status()
                .message(),
            "chunk loss: logits hold 259 values, expected 20 rows x 13 vocab");
}

TEST(DPaceLossTest, NeedsWholeBlocksInOrderAndAKnownFamily) {
  Batch batch = MakeBatch(1);
  const v1::LossConfig dpace = Loss("dpace");
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(
                dpace, kK, absl::MakeSpan(batch.logits).subspan(0, 3 * kV), kV,
                absl::MakeConstSpan(batch.rows).subspan(0, 3))
                .status()
                .message(),
            "chunk loss: loss.dpace needs whole blocks, got 3 rows for "
            "block_size 5");
  auto rows = batch.rows;
  std::swap(rows[1].position, rows[2].position);
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(dpace, kK,
                                           absl::MakeSpan(batch.logits), kV,
                                           rows)
                .status()
                .message(),
            "row 1: block position 2 is outside [0, 5) or not 1 (loss.dpace "
            "needs blocks in order)");
  v1::LossConfig dspark;
  dspark.mutable_dspark();
  EXPECT_EQ(SoftmaxFamilyChunkLoss<double>(dspark, kK,
                                           absl::MakeSpan(batch.logits), kV,
                                           batch.rows)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dflash
