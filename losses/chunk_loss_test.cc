#include "losses/chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "losses/batch_layout.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"

namespace dflash {
namespace {

// SpecForge's loss fixture: B = 2, N = 2, K = 5, V = 13, S = 9.
constexpr int64_t kB = 2, kN = 2, kK = 5, kV = 13, kS = 9;
constexpr int64_t kRows = kB * kN * kK;

std::vector<RowMeta> FixtureRows(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> token(0, kV - 1);
  std::vector<int64_t> ids(kB * kS);
  for (int64_t& id : ids) id = token(rng);
  std::vector<uint8_t> loss_mask(kB * kS, 1);
  loss_mask[0 * kS + 7] = 0;
  loss_mask[1 * kS + 6] = 0;
  const std::vector<int64_t> anchors = {0, 3, 1, 4};
  const std::vector<uint8_t> keep = {1, 1, 1, 0};
  auto rows = LabelRows({kB, kS, ids, loss_mask}, anchors, keep, kN, kK, kV,
                        Labeling::kDFlash);
  EXPECT_TRUE(rows.ok()) << rows.status();
  return *rows;
}

// Everything a chunk loss reads, in float64, before the logit transform.
struct Problem {
  std::vector<double> logits, teacher, confidence;
  std::vector<RowMeta> rows;
  ChunkLossOptions options;
};

Problem MakeProblem(uint32_t seed, const ChunkLossOptions& options) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(-3, 3);
  std::normal_distribution<double> noise(0, 0.7);
  Problem p;
  p.rows = FixtureRows(seed);
  p.options = options;
  p.logits.resize(kRows * kV);
  for (double& x : p.logits) x = uniform(rng);
  for (double x : p.logits) p.teacher.push_back(x + noise(rng));
  // In double, as a float64 chunk takes them (ConfidenceOf<double>); the
  // float and bfloat16 cases round them first.
  for (int64_t r = 0; r < kRows; ++r) p.confidence.push_back(uniform(rng));
  return p;
}

// The quantities taken without gradient (docs/semantics.md section 4);
// finite differences hold them fixed.
struct Detached {
  std::vector<double> weights, ce_share, accept;
  double kl_weight = 1;  // The batch-level LK lambda's.
};

struct Reference {
  double num = 0, den = 0, correct = 0, acc_den = 0, target_probability = 0;
  double ce_num = 0, tv_num = 0;
  std::vector<double> correct_per_position = std::vector<double>(kK, 0.0);
  std::vector<double> neg_log_q = std::vector<double>(kRows, 0.0);
  std::vector<int> argmax = std::vector<int>(kRows, -1);
  Detached detached;
};

double Transform(double z, const ChunkLossOptions& o) {
  return o.logit_softcap > 0
             ? o.logit_softcap * std::tanh(o.logit_scale * z / o.logit_softcap)
             : o.logit_scale * z;
}

double LogSumExp(const std::vector<double>& x) {
  const double max = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (double v : x) sum += std::exp(v - max);
  return max + std::log(sum);
}

std::vector<double> Softmax(const std::vector<double>& x, double temperature) {
  std::vector<double> scaled;
  for (double v : x) scaled.push_back(v / temperature);
  const double lse = LogSumExp(scaled);
  for (double& v : scaled) v = std::exp(v - lse);
  return scaled;
}

double Kl(const std::vector<double>& a, const std::vector<double>& b) {
  double kl = 0;
  for (size_t v = 0; v < a.size(); ++v) kl += a[v] * std::log(a[v] / b[v]);
  return kl;
}

// Independent float64 reference, written from docs/semantics.md sections 3
// to 6 in the plainest form.
Reference Naive(const v1::LossConfig& c, const Problem& p,
                const Detached* fixed = nullptr) {
  Reference ref;
  const v1::CrossEntropyOptions& ce = c.cross_entropy();
  std::vector<std::vector<double>> z(kRows), t(kRows);
  std::vector<double> mask(kRows), q(kRows), lse(kRows);
  std::vector<bool> has_target(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      z[r].push_back(Transform(p.logits[r * kV + v], p.options));
      t[r].push_back(Transform(p.teacher[r * kV + v], p.options));
    }
    const RowMeta& m = p.rows[r];
    // SpecForge's COUNT: F.cross_entropy's 0 for the row (q = 1), its
    // weight kept.
    const bool ignored = m.target == ce.ignore_index();
    has_target[r] = !ignored;
    mask[r] = ignored && ce.ignored_target_weight() !=
                             v1::CrossEntropyOptions::COUNT
                  ? 0
                  : m.mask;
    lse[r] = LogSumExp(z[r]);
    q[r] = ignored ? 1.0 : std::exp(z[r][m.target] - lse[r]);
    if (mask[r] > 0) {
      ref.neg_log_q[r] = ignored ? 0.0 : lse[r] - z[r][m.target];
      ref.argmax[r] = static_cast<int>(
          std::max_element(z[r].begin(), z[r].end()) - z[r].begin());
    }
  }
  Detached& d = ref.detached;
  d.weights.assign(kRows, 0);
  d.ce_share.assign(kRows, 1);
  d.accept.assign(kRows, 0);
  for (int64_t b = 0; b < kRows / kK; ++b) {
    double prefix[kK], suffix[kK], hit_mass = 0, mass = 0;
    for (int64_t k = 0; k < kK; ++k) {
      const int64_t r = b * kK + k;
      const double alpha = c.dpace().alpha();
      const double smooth = mask[r] > 0 ? (1 - alpha) * q[r] + alpha : 1;
      prefix[k] = smooth * (k > 0 ? prefix[k - 1] : 1.0);
      hit_mass += q[r] * mask[r];
      mass += mask[r];
    }
    for (int64_t k = kK - 1; k >= 0; --k) {
      suffix[k] = prefix[k] * mask[b * kK + k] + (k + 1 < kK ? suffix[k + 1] : 0);
    }
    for (int64_t k = 0; k < kK; ++k) {
      const int64_t r = b * kK + k;
      double gamma = 0;
      if (c.has_dflash()) gamma = c.dflash().gamma();
      if (c.has_tv()) gamma = c.tv().gamma();
      if (c.has_lk_lambda()) gamma = c.lk_lambda().gamma();
      if (c.has_distillation()) gamma = c.distillation().gamma();
      double w = mask[r] * (gamma > 0 ? std::exp(-std::max<double>(k - 1, 0) / gamma) : 1);
      if (c.has_dspark()) {
        const double g = c.dspark().gamma();
        w = mask[r] * (g > 0 ? std::exp(-k / g) : 1);
      }
      if (c.has_dpace()) {
        // SEQUENCE_BALANCED: 1 / the weighted blocks of the row's sequence.
        double share = 1;
        if (c.dpace().denominator() == v1::DPaceLoss::SEQUENCE_BALANCED) {
          const int64_t sequence = b / kN;
          int64_t blocks = 0;
          for (int64_t n = 0; n < kN; ++n) {
            double block_mass = 0;
            for (int64_t j = 0; j < kK; ++j) {
              block_mass += mask[(sequence * kN + n) * kK + j];
            }
            blocks += block_mass > 0;
          }
          share = 1.0 / std::max<int64_t>(blocks, 1);
        }
        switch (c.dpace().variant()) {
          case v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY:
            w = prefix[k];
            break;
          case v1::DPaceLoss::CONTINUATION_VALUE_ONLY:
            w = suffix[k] / prefix[k];
            break;
          default:
            w = suffix[k];
        }
        w *= mask[r] * share;
      }
      d.weights[r] = w;
      if (c.has_lk_lambda()) {
        d.ce_share[r] = c.lk_lambda().kl_scale() *
                        std::exp(-c.lk_lambda().kl_decay() * hit_mass / mass);
      }
    }
  }
  if (fixed != nullptr) d = *fixed;
  for (int64_t r = 0; r < kRows; ++r) {
    const RowMeta& m = p.rows[r];
    if (mask[r] == 0) continue;
    const bool hit = mask[r] > 0.5 && ref.argmax[r] == m.target;
    ref.correct += hit;
    ref.correct_per_position[m.position] += hit;
    ref.acc_den += mask[r];
    ref.target_probability += mask[r] * q[r];
    const double w = d.weights[r];
    ref.den += w;
    const double eps = ce.label_smoothing();
    const double mean = std::accumulate(z[r].begin(), z[r].end(), 0.0) / kV;
    // A counted row without a target has no CE and no z-loss.
    const double ce_term =
        has_target[r] ? (1 - eps) * (lse[r] - z[r][m.target]) +
                            eps * (lse[r] - mean)
                      : 0.0;
    const double z_term =
        has_target[r] ? ce.z_loss_scale() * lse[r] * lse[r] : 0.0;
    // SpecForge's ce_loss_num and tv_loss_num, for every softmax family.
    const v1::LkComposition::Type lk_type =
        c.has_dflash()  ? c.dflash().lk().type()
        : c.has_dpace() ? c.dpace().lk().type()
                        : v1::LkComposition::ALPHA;
    if (!c.has_distillation()) ref.ce_num += w * ce_term;
    if (c.has_tv() || c.has_lk_lambda() ||
        lk_type != v1::LkComposition::ALPHA) {
      ref.tv_num += w * (1 - q[r]);
    }
    if (c.has_dflash() || c.has_dpace()) {
      const v1::LkComposition& lk =
          c.has_dflash() ? c.dflash().lk() : c.dpace().lk();
      // LAMBDA's numerator is composed below, from the batch's sums.
      if (lk.type() == v1::LkComposition::TV) {
        ref.num += w * ((1 - q[r]) + z_term);
      } else if (lk.type() == v1::LkComposition::ALPHA) {
        ref.num += w * (ce_term + z_term);
      }
    } else if (c.has_tv()) {
      ref.num += w * ((1 - q[r]) + z_term);
    } else if (c.has_lk_lambda()) {
      const double kl_w = d.ce_share[r];
      ref.num += w * (kl_w * ce_term + (1 - kl_w) * (1 - q[r]) + z_term);
    } else if (c.has_dspark()) {
      const std::vector<double> ps = Softmax(z[r], 1), pt = Softmax(t[r], 1);
      double l1 = 0;
      for (int64_t v = 0; v < kV; ++v) l1 += std::abs(ps[v] - pt[v]);
      if (fixed == nullptr) d.accept[r] = std::clamp(1 - 0.5 * l1, 0.0, 1.0);
      const double x = p.confidence[r], a = d.accept[r];
      // BCE-with-logits, written as -(a log sigmoid(x) + (1-a) log(1-sigmoid(x))).
      const double sig = 1 / (1 + std::exp(-x));
      const double bce = -(a * std::log(sig) + (1 - a) * std::log(1 - sig));
      ref.num += w * (c.dspark().ce_weight() * ce_term + z_term +
                      c.dspark().l1_weight() * l1 +
                      c.dspark().confidence_weight() * bce);
    } else if (c.has_distillation()) {
      const v1::DistillationLoss& dist = c.distillation();
      const std::vector<double> s = Softmax(z[r], dist.temperature());
      const std::vector<double> tp = Softmax(t[r], dist.temperature());
      double divergence;
      switch (dist.divergence()) {
        case v1::DistillationLoss::REVERSE_KL:
          divergence = Kl(s, tp);
          break;
        case v1::DistillationLoss::JSD: {
          const double beta = dist.beta();
          std::vector<double> mix(kV);
          for (int64_t v = 0; v < kV; ++v) mix[v] = beta * tp[v] + (1 - beta) * s[v];
          divergence = beta * Kl(tp, mix) + (1 - beta) * Kl(s, mix);
          break;
        }
        default:
          divergence = Kl(tp, s);
      }
      ref.num += w * divergence;
    }
  }
  const v1::LkComposition& lk =
      c.has_dflash() ? c.dflash().lk() : c.dpace().lk();
  if ((c.has_dflash() || c.has_dpace()) &&
      lk.type() == v1::LkComposition::LAMBDA) {
    if (fixed == nullptr) {
      d.kl_weight =
          lk.kl_scale() * std::exp(-lk.kl_decay() * ref.target_probability /
                                   std::max(ref.acc_den, 1.0));
    }
    ref.num = d.kl_weight * ref.ce_num + (1 - d.kl_weight) * ref.tv_num;
  }
  return ref;
}

// Runs ChunkLoss<double> on a copy; `grad` receives d(loss_num)/d(logits).
absl::StatusOr<ChunkTerms> RunDouble(const v1::LossConfig& c, const Problem& p,
                                     std::vector<double>& grad,
                                     std::vector<double>& confidence_grad,
                                     const ChunkLossOutputs& extra = {}) {
  grad = p.logits;
  confidence_grad.assign(kRows, 0);
  ChunkLossOutputs outputs = extra;
  outputs.confidence_grad = absl::MakeSpan(confidence_grad);
  return ChunkLoss<double>(c, p.options,
                           {absl::MakeSpan(grad), p.teacher, p.confidence,
                            p.rows, kV},
                           outputs);
}

struct Case {
  std::string name;
  std::string loss;  // LossConfig in text format.
  ChunkLossOptions options = {kK, 1, 0};
};

v1::LossConfig Parse(const std::string& text) {
  v1::LossConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &config))
      << text;
  return config;
}

std::vector<Case> AllCases() {
  return {
      {"DFlashNoGamma", "dflash {}"},
      {"DFlashGamma7", "dflash { gamma: 7 }"},
      {"DFlashGamma2p5", "dflash { gamma: 2.5 }"},
      {"DFlashLabelSmoothing",
       "dflash { gamma: 7 } cross_entropy { label_smoothing: 0.1 }"},
      {"DFlashZLoss",
       "dflash { gamma: 7 } cross_entropy { z_loss_scale: 0.01 }"},
      {"DFlashIgnoreIndex",
       "dflash { gamma: 7 } cross_entropy { ignore_index: 3 }"},
      {"DFlashSoftcapAndScale", "dflash { gamma: 7 }", {kK, 0.7, 5}},
      {"DFlashScale", "dflash {}", {kK, 2, 0}},
      {"Tv", "tv { gamma: 7 }"},
      {"DFlashLkTvZLoss",
       "dflash { gamma: 7 lk { type: TV } } cross_entropy { z_loss_scale: "
       "0.01 }"},
      {"DPaceLkTv", "dpace { alpha: 0.3 lk { type: TV } }"},
      {"DPaceLkAlpha", "dpace { alpha: 0.3 lk { type: ALPHA } }"},
      {"TvNoGammaScaledZLoss",
       "tv {} cross_entropy { z_loss_scale: 0.02 }",
       {kK, 1.5, 0}},
      {"DPace", "dpace { alpha: 0.3 }"},
      {"DPaceCumulativeConfidenceOnly",
       "dpace { alpha: 0.3 variant: CUMULATIVE_CONFIDENCE_ONLY }"},
      {"DPaceContinuationValueOnly",
       "dpace { alpha: 0.3 variant: CONTINUATION_VALUE_ONLY }"},
      {"DPaceAlphaZeroSmoothedSoftcap",
       "dpace { alpha: 0 } cross_entropy { label_smoothing: 0.2 }",
       {kK, 1, 4}},
      {"LkLambda", "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }"},
      {"LkLambdaZLossSmoothing",
       "lk_lambda { kl_scale: 1 kl_decay: 0.5 } cross_entropy { z_loss_scale: "
       "0.01 label_smoothing: 0.05 }"},
      {"DSpark", "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }"},
      {"DSparkNoGammaSoftcapSmoothing",
       "dspark { l1_weight: 1 confidence_weight: 1 } cross_entropy { "
       "label_smoothing: 0.1 }",
       {kK, 1, 6}},
      {"DSparkNoConfidence", "dspark { confidence_weight: 0 }"},
      {"ForwardKlTemperature2",
       "distillation { divergence: FORWARD_KL temperature: 2 }"},
      {"ReverseKl",
       "distillation { divergence: REVERSE_KL temperature: 1.5 "
       "gamma: 7 }"},
      {"Jsd", "distillation { divergence: JSD beta: 0.3 }"},
      {"JsdSoftcapIgnoreIndex",
       "distillation { divergence: JSD beta: 0.5 temperature: 0.8 } "
       "cross_entropy { ignore_index: 5 }",
       {kK, 1, 3}},
      // SpecForge's convention for ignored targets with weight.
      {"DFlashCountIgnored",
       "dflash { gamma: 7 } cross_entropy { ignored_target_weight: COUNT }"},
      {"DFlashCountIgnoredSmoothingZLossSoftcap",
       "dflash {} cross_entropy { ignored_target_weight: COUNT "
       "label_smoothing: 0.1 z_loss_scale: 0.01 }",
       {kK, 1, 4}},
      {"DFlashLkTvCountIgnored",
       "dflash { lk { type: TV } } cross_entropy { ignored_target_weight: "
       "COUNT }"},
      {"TvCountIgnored",
       "tv { gamma: 7 } cross_entropy { ignored_target_weight: COUNT }"},
      {"DPaceCountIgnored",
       "dpace { alpha: 0.3 } cross_entropy { ignored_target_weight: COUNT }"},
      {"DPaceCumulativeCountIgnored",
       "dpace { alpha: 0.3 variant: CUMULATIVE_CONFIDENCE_ONLY } "
       "cross_entropy { ignored_target_weight: COUNT }"},
      {"DPaceContinuationCountIgnored",
       "dpace { alpha: 0.3 variant: CONTINUATION_VALUE_ONLY } "
       "cross_entropy { ignored_target_weight: COUNT }"},
      {"DPaceLkTvCountIgnored",
       "dpace { alpha: 0.6 lk { type: TV } } cross_entropy { "
       "ignored_target_weight: COUNT }"},
      {"DSparkCountIgnored",
       "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 } "
       "cross_entropy { ignored_target_weight: COUNT }"},
  };
}

// Rows given an ignored target (-100, the default ignore_index) though
// their mask is positive, in two blocks: one mid-block, one at a block's
// last supervised position.
void IgnoreTwoWeightedTargets(Problem& p) {
  int64_t set = 0;
  for (int64_t r : {2, 8}) {
    ASSERT_GT(p.rows[r].mask, 0) << "row " << r;
    p.rows[r].target = -100;
    ++set;
  }
  ASSERT_EQ(set, 2);
}

class LossCaseTest : public ::testing::TestWithParam<Case> {
 protected:
  v1::LossConfig config() const { return Parse(GetParam().loss); }
  // With the default ignore_index, two weighted rows' targets are ignored.
  Problem problem(uint32_t seed) const {
    Problem p = MakeProblem(seed, GetParam().options);
    if (config().cross_entropy().ignore_index() == -100) {
      IgnoreTwoWeightedTargets(p);
    }
    return p;
  }
};

TEST_P(LossCaseTest, MatchesNaiveFloat64ReferenceOnSpecForgeFixture) {
  const Problem p = problem(11);
  const Reference ref = Naive(config(), p);
  std::vector<double> grad;
  std::vector<double> confidence_grad, neg_log_q(kRows);
  std::vector<int32_t> argmax(kRows);
  ChunkLossOutputs outputs;
  outputs.neg_log_q = absl::MakeSpan(neg_log_q);
  outputs.argmax = absl::MakeSpan(argmax);
  auto terms = RunDouble(config(), p, grad, confidence_grad, outputs);
  ASSERT_TRUE(terms.ok()) << terms.status();
  ASSERT_GT(ref.den, 0);
  EXPECT_NEAR(terms->loss_num, ref.num, 1e-10);
  EXPECT_NEAR(terms->loss_den, ref.den, 1e-10);
  EXPECT_EQ(terms->correct, ref.correct);
  EXPECT_EQ(terms->accuracy_den, ref.acc_den);
  EXPECT_NEAR(terms->target_probability, ref.target_probability, 1e-12);
  EXPECT_NEAR(terms->ce_num, ref.ce_num, 1e-10);
  EXPECT_NEAR(terms->tv_num, ref.tv_num, 1e-10);
  EXPECT_EQ(terms->correct_per_position, ref.correct_per_position);
  for (int64_t r = 0; r < kRows; ++r) {
    EXPECT_NEAR(neg_log_q[r], ref.neg_log_q[r], 1e-12) << "row " << r;
    EXPECT_EQ(argmax[r], ref.argmax[r]) << "row " << r;
  }
}

// Masks that float32 does not hold (4/3 + r/97): a float64 chunk keeps
// them (RowMeta::mask is a double), so every family's terms match the naive
// float64 reference to 1e-12 relative; with the masks rounded to float32
// the weights would differ by about 1e-8.
TEST_P(LossCaseTest, Float64MasksAreKeptExactly) {
  Problem p = problem(11);
  for (int64_t r = 0; r < kRows; ++r) {
    if (p.rows[r].mask > 0) p.rows[r].mask *= 4.0 / 3 + r / 97.0;
  }
  const Reference ref = Naive(config(), p);
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  auto terms = RunDouble(config(), p, grad, confidence_grad);
  ASSERT_TRUE(terms.ok()) << terms.status();
  ASSERT_GT(ref.den, 0);
  auto near = [](double actual, double wanted) {
    return std::abs(actual - wanted) <= 1e-12 * std::max(1.0, std::abs(wanted));
  };
  EXPECT_PRED2(near, terms->loss_num, ref.num);
  EXPECT_PRED2(near, terms->loss_den, ref.den);
  EXPECT_PRED2(near, terms->accuracy_den, ref.acc_den);
  EXPECT_PRED2(near, terms->correct, ref.correct);
  EXPECT_PRED2(near, terms->target_probability, ref.target_probability);
  EXPECT_PRED2(near, terms->ce_num, ref.ce_num);
  EXPECT_PRED2(near, terms->tv_num, ref.tv_num);
  // The masks rounded to float32 give another accuracy_den: the test tells
  // them apart.
  for (RowMeta& m : p.rows) m.mask = static_cast<float>(m.mask);
  EXPECT_GT(std::abs(Naive(config(), p).acc_den - ref.acc_den), 1e-10);
}

TEST_P(LossCaseTest, GradientMatchesFiniteDifferences) {
  const Problem p = problem(5);
  const v1::LossConfig c = config();
  const Detached detached = Naive(c, p).detached;
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  ASSERT_TRUE(RunDouble(c, p, grad, confidence_grad).ok());
  const double h = 1e-6;
  for (int64_t i = 0; i < kRows * kV; ++i) {
    Problem plus = p, minus = p;
    plus.logits[i] += h;
    minus.logits[i] -= h;
    const double numeric =
        (Naive(c, plus, &detached).num - Naive(c, minus, &detached).num) /
        (2 * h);
    ASSERT_NEAR(grad[i], numeric, 1e-8) << "logit " << i;
  }
  for (int64_t r = 0; r < kRows; ++r) {
    Problem plus = p, minus = p;
    plus.confidence[r] += h;
    minus.confidence[r] -= h;
    const double numeric =
        (Naive(c, plus, &detached).num - Naive(c, minus, &detached).num) /
        (2 * h);
    EXPECT_NEAR(confidence_grad[r], numeric, 1e-8) << "confidence " << r;
  }
  // Rows without weight get an exactly zero gradient.
  for (int64_t r = 0; r < kRows; ++r) {
    if (p.rows[r].mask > 0) continue;
    for (int64_t v = 0; v < kV; ++v) ASSERT_EQ(grad[r * kV + v], 0.0);
  }
}

TEST_P(LossCaseTest, Float32WithinOneInTenToTheFiveOfFloat64) {
  Problem p = problem(9);
  std::vector<float> logits(p.logits.begin(), p.logits.end());
  std::vector<float> teacher(p.teacher.begin(), p.teacher.end());
  std::vector<float> confidence(p.confidence.begin(), p.confidence.end());
  p.logits.assign(logits.begin(), logits.end());
  p.teacher.assign(teacher.begin(), teacher.end());
  p.confidence.assign(confidence.begin(), confidence.end());
  std::vector<double> grad64;
  std::vector<double> confidence_grad64, confidence_grad32(kRows);
  auto t64 = RunDouble(config(), p, grad64, confidence_grad64);
  ChunkLossOutputs outputs;
  outputs.confidence_grad = absl::MakeSpan(confidence_grad32);
  auto t32 = ChunkLoss<float>(
      config(), p.options,
      {absl::MakeSpan(logits), teacher, confidence, p.rows, kV}, outputs);
  ASSERT_TRUE(t64.ok() && t32.ok()) << t32.status();
  EXPECT_NEAR(t32->loss_num, t64->loss_num, 1e-5 * std::abs(t64->loss_num));
  EXPECT_NEAR(t32->loss_den, t64->loss_den, 1e-6 * t64->loss_den);
  EXPECT_EQ(t32->correct, t64->correct);
  for (size_t i = 0; i < grad64.size(); ++i) {
    ASSERT_NEAR(logits[i], grad64[i], 1e-5 * (std::abs(grad64[i]) + 1e-2))
        << i;
  }
  for (int64_t r = 0; r < kRows; ++r) {
    EXPECT_NEAR(confidence_grad32[r], confidence_grad64[r], 1e-6);
  }
}

TEST_P(LossCaseTest, BFloat16WithinSpecForgeTolerances) {
  Problem p = problem(13);
  std::vector<BFloat16> logits, teacher;
  for (double& x : p.logits) {
    logits.push_back(ToBFloat16(static_cast<float>(x)));
    x = ToFloat(logits.back());
  }
  for (double& x : p.teacher) {
    teacher.push_back(ToBFloat16(static_cast<float>(x)));
    x = ToFloat(teacher.back());
  }
  std::vector<float> confidence(p.confidence.begin(), p.confidence.end());
  p.confidence.assign(confidence.begin(), confidence.end());
  std::vector<double> grad64;
  std::vector<double> confidence_grad64, confidence_grad(kRows);
  auto t64 = RunDouble(config(), p, grad64, confidence_grad64);
  ChunkLossOutputs outputs;
  outputs.confidence_grad = absl::MakeSpan(confidence_grad);
  auto bf = ChunkLoss<BFloat16>(
      config(), p.options,
      {absl::MakeSpan(logits), teacher, confidence, p.rows, kV}, outputs);
  ASSERT_TRUE(t64.ok() && bf.ok()) << bf.status();
  // FP32 accumulation over bfloat16 inputs: the loss is as exact as in float.
  EXPECT_NEAR(bf->loss_num, t64->loss_num, 1e-5 * std::abs(t64->loss_num));
  // The gradient is rounded to bfloat16 once: relative norm error < 5e-3.
  double diff = 0, norm = 0;
  for (size_t i = 0; i < grad64.size(); ++i) {
    diff += std::pow(ToFloat(logits[i]) - grad64[i], 2);
    norm += grad64[i] * grad64[i];
  }
  EXPECT_LT(std::sqrt(diff / norm), 5e-3);
}

// The scale a head may fold into its input-gradient GEMM before any logit
// is the one FinishTerms gives after the last chunk; where the logits
// decide it (D-PACE, the batch-level LK lambda) there is none.
TEST_P(LossCaseTest, RowsGradientScaleIsTheFinishedOne) {
  const Problem p = problem(23);
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  auto terms = RunDouble(config(), p, grad, confidence_grad);
  ASSERT_TRUE(terms.ok()) << terms.status();
  const LossParams params = *ResolveLoss(config());
  const int64_t sequences = 2;
  const double finished = FinishTerms(params, *terms, sequences).gradient_scale;
  const std::optional<double> known =
      RowsGradientScale(params, p.rows, sequences);
  if (params.family == LossFamily::kDPace ||
      params.lk == LkMode::kLambdaBatch) {
    EXPECT_FALSE(known.has_value());
  } else {
    ASSERT_TRUE(known.has_value());
    EXPECT_NEAR(*known, finished, 1e-14 * finished);
  }
}

TEST(ChunkLossTest, RowsGradientScaleOfDPardCountsSequences) {
  const Problem p = MakeProblem(24, {kK, 1, 0});
  const v1::LossConfig config =
      Parse("dspark { objective: DPARD ce_weight: 0 l1_weight: 0 }");
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  auto terms = RunDouble(config, p, grad, confidence_grad);
  ASSERT_TRUE(terms.ok()) << terms.status();
  const LossParams params = *ResolveLoss(config);
  EXPECT_EQ(RowsGradientScale(params, p.rows, 3),
            FinishTerms(params, *terms, 3).gradient_scale);
}

// Rows padded to a longer stride (the CUDA head's 16-byte rows) give the
// same terms and gradient; the padding, NaN here, is never read as a logit
// and is left as it was.
TEST_P(LossCaseTest, PaddedRowsGiveTheSameResult) {
  const Problem p = problem(25);
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  auto want = RunDouble(config(), p, grad, confidence_grad);
  ASSERT_TRUE(want.ok()) << want.status();
  constexpr int64_t kStride = kV + 3;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> logits(kRows * kStride, nan), teacher = logits;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      logits[r * kStride + v] = p.logits[r * kV + v];
      teacher[r * kStride + v] = p.teacher[r * kV + v];
    }
  }
  std::vector<double> padded_confidence_grad(kRows, 0);
  ChunkLossOutputs outputs;
  outputs.confidence_grad = absl::MakeSpan(padded_confidence_grad);
  ChunkLossInputs<double> inputs{absl::MakeSpan(logits), teacher, p.confidence,
                                 p.rows, kV};
  inputs.row_stride = kStride;
  auto got = ChunkLoss<double>(config(), p.options, inputs, outputs);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->loss_num, want->loss_num);
  EXPECT_EQ(got->loss_den, want->loss_den);
  EXPECT_EQ(got->correct, want->correct);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kStride; ++v) {
      const double x = logits[r * kStride + v];
      if (v < kV) {
        EXPECT_EQ(x, grad[r * kV + v]) << "row " << r << " logit " << v;
      } else {
        EXPECT_TRUE(std::isnan(x)) << "row " << r << " padding " << v;
      }
    }
  }
  EXPECT_EQ(padded_confidence_grad, confidence_grad);
}

TEST_P(LossCaseTest, WholeBlockChunksSumToTheUnchunkedTerms) {
  const Problem p = problem(21);
  std::vector<double> whole_grad;
  std::vector<double> whole_confidence_grad;
  auto all = RunDouble(config(), p, whole_grad, whole_confidence_grad);
  ASSERT_TRUE(all.ok());
  std::vector<double> grad = p.logits;
  std::vector<double> confidence_grad(kRows);
  ChunkTerms sum;
  for (int64_t block = 0; block < kRows / kK; ++block) {
    const int64_t row = block * kK;
    ChunkLossOutputs outputs;
    outputs.confidence_grad = absl::MakeSpan(confidence_grad).subspan(row, kK);
    auto part = ChunkLoss<double>(
        config(), p.options,
        {absl::MakeSpan(grad).subspan(row * kV, kK * kV),
         absl::MakeConstSpan(p.teacher).subspan(row * kV, kK * kV),
         absl::MakeConstSpan(p.confidence).subspan(row, kK),
         absl::MakeConstSpan(p.rows).subspan(row, kK), kV},
        outputs);
    ASSERT_TRUE(part.ok());
    sum.Add(*part);
  }
  EXPECT_NEAR(sum.loss_num, all->loss_num, 1e-12 * all->loss_num);
  EXPECT_NEAR(sum.loss_den, all->loss_den, 1e-12 * all->loss_den);
  EXPECT_EQ(sum.correct, all->correct);
  EXPECT_EQ(sum.correct_per_position, all->correct_per_position);
  EXPECT_EQ(sum.mask_per_position, all->mask_per_position);
  EXPECT_EQ(grad, whole_grad);
  EXPECT_EQ(confidence_grad, whole_confidence_grad);
}

TEST_P(LossCaseTest, AllMaskedGivesFiniteZero) {
  Problem p = problem(2);
  for (RowMeta& m : p.rows) m.mask = 0;
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  auto terms = RunDouble(config(), p, grad, confidence_grad);
  ASSERT_TRUE(terms.ok());
  EXPECT_EQ(terms->loss_num, 0.0);
  EXPECT_EQ(terms->loss_den, 0.0);
  for (double g : grad) ASSERT_EQ(g, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Losses, LossCaseTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

TEST(ChunkLossFixtureTest, SpecForgeLayoutGivesTheHandComputedMask) {
  std::vector<float> mask;
  for (const RowMeta& m : FixtureRows(1)) mask.push_back(m.mask);
  const std::vector<float> expected = {
      0, 1, 1, 1, 1,  // b 0, anchor 0: tokens 1..4.
      0, 1, 1, 1, 0,  // b 0, anchor 3: token 7 is unsupervised.
      0, 1, 1, 1, 1,  // b 1, anchor 1: tokens 2..5.
      0, 0, 0, 0, 0,  // b 1, anchor 4: not kept.
  };
  EXPECT_EQ(mask, expected);
}

TEST(ChunkLossFixtureTest, PartialTailBlockHasOneFiniteTarget) {
  // S = 4, anchor 2: only k = 1 (token 3) lies inside the sequence.
  const std::vector<int64_t> ids = {4, 7, 1, 9};
  const std::vector<uint8_t> loss_mask = {1, 1, 1, 1};
  auto rows = LabelRows({1, 4, ids, loss_mask}, std::vector<int64_t>{2},
                        std::vector<uint8_t>{1}, 1, kK, kV, Labeling::kDFlash);
  ASSERT_TRUE(rows.ok()) << rows.status();
  std::vector<double> logits(kK * kV);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(i * 0.37);
  const double neg_log_q = [&] {
    std::vector<double> row(logits.begin() + kV, logits.begin() + 2 * kV);
    return LogSumExp(row) - row[9];
  }();
  auto terms = ChunkLoss<double>(Parse("dflash { gamma: 7 }"), {kK},
                                 {absl::MakeSpan(logits), {}, {}, *rows, kV});
  ASSERT_TRUE(terms.ok()) << terms.status();
  EXPECT_EQ(terms->loss_den, 1.0);
  EXPECT_TRUE(std::isfinite(terms->loss_num));
  EXPECT_NEAR(terms->loss_num, neg_log_q, 1e-12);
}

TEST(ChunkLossTest, GammaSevenDecayIsExact) {
  const LossParams seven = LossParamsOf(Parse("dflash { gamma: 7 }"));
  EXPECT_EQ(RowLossWeight(seven, 0, 1.0), 1.0);
  EXPECT_EQ(RowLossWeight(seven, 1, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(RowLossWeight(seven, 2, 1.0), std::exp(-1.0 / 7));
  EXPECT_DOUBLE_EQ(RowLossWeight(seven, 4, 0.5), 0.5 * std::exp(-3.0 / 7));
  // gamma absent or 0: no decay.
  EXPECT_EQ(RowLossWeight(LossParamsOf(Parse("dflash {}")), 4, 1.0), 1.0);
  EXPECT_EQ(RowLossWeight(LossParamsOf(Parse("dflash { gamma: 0 }")), 4, 1.0),
            1.0);
  // DSpark decays from k = 0: exp(-k / gamma).
  const LossParams dspark = LossParamsOf(Parse("dspark { gamma: 7 }"));
  EXPECT_DOUBLE_EQ(RowLossWeight(dspark, 1, 1.0), std::exp(-1.0 / 7));
  EXPECT_DOUBLE_EQ(RowLossWeight(dspark, 4, 0.5), 0.5 * std::exp(-4.0 / 7));
}

TEST(ChunkLossTest, TopKMatchesASortOfTheLossLogits) {
  Problem p = MakeProblem(3, {kK, 1, 4});
  for (int64_t i = 0; i < kRows * kV; i += 3) p.logits[i] = 0.5;  // Ties.
  const int32_t k = 4;
  std::vector<int32_t> top(kRows * k);
  ChunkLossOutputs outputs;
  outputs.top_k = absl::MakeSpan(top);
  outputs.k = k;
  std::vector<double> grad = p.logits;
  ASSERT_TRUE(ChunkLoss<double>(Parse("dflash {}"), p.options,
                                {absl::MakeSpan(grad), {}, {}, p.rows, kV},
                                outputs)
                  .ok());
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<int32_t> expected(k, -1);
    if (p.rows[r].mask > 0) {
      std::vector<int32_t> order(kV);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return Transform(p.logits[r * kV + a], p.options) >
               Transform(p.logits[r * kV + b], p.options);
      });
      expected.assign(order.begin(), order.begin() + k);
    }
    EXPECT_EQ(std::vector<int32_t>(top.begin() + r * k, top.begin() + (r + 1) * k),
              expected)
        << "row " << r;
  }
}

TEST(ChunkLossTest, ExtremeLogitsAndLargeVocabularyStayExact) {
  constexpr int64_t kBig = 262144;
  const std::vector<RowMeta> rows = {{17, 1, 1.0f}, {kBig - 1, 2, 1.0f}};
  std::vector<float> logits(2 * kBig), teacher(2 * kBig);
  for (int64_t i = 0; i < 2 * kBig; ++i) {
    logits[i] = (i % 7 == 0) ? 1e4f : -1e4f + static_cast<float>(i % 1000);
    teacher[i] = (i % 5 == 0) ? 1e4f : -1e4f;
  }
  for (const char* loss : {"dflash { gamma: 7 }", "tv {}",
                           "distillation { divergence: REVERSE_KL }"}) {
    std::vector<float> grad32 = logits;
    std::vector<double> grad64(logits.begin(), logits.end());
    const std::vector<double> teacher64(teacher.begin(), teacher.end());
    auto t32 = ChunkLoss<float>(Parse(loss), {kK},
                                {absl::MakeSpan(grad32), teacher, {}, rows, kBig});
    auto t64 = ChunkLoss<double>(
        Parse(loss), {kK}, {absl::MakeSpan(grad64), teacher64, {}, rows, kBig});
    ASSERT_TRUE(t32.ok() && t64.ok()) << loss;
    EXPECT_TRUE(std::isfinite(t32->loss_num)) << loss;
    EXPECT_NEAR(t32->loss_num, t64->loss_num,
                1e-5 * std::abs(t64->loss_num) + 1e-6)
        << loss;
    for (int64_t i = 0; i < 2 * kBig; ++i) {
      ASSERT_TRUE(std::isfinite(grad32[i])) << loss << " " << i;
      ASSERT_NEAR(grad32[i], grad64[i], 1e-5 * std::abs(grad64[i]) + 1e-7)
          << loss << " " << i;
    }
  }
}

absl::Status RunLoss(const std::string& loss, Problem p,
                     ChunkLossOutputs outputs = {}) {
  const std::vector<double>& confidence = p.confidence;
  std::vector<double> confidence_grad(kRows);
  if (outputs.confidence_grad.empty() && loss.find("dspark") == 0) {
    outputs.confidence_grad = absl::MakeSpan(confidence_grad);
  }
  return ChunkLoss<double>(
             Parse(loss), p.options,
             {absl::MakeSpan(p.logits), p.teacher, confidence, p.rows, kV},
             outputs)
      .status();
}

TEST(ChunkLossTest, BadInputsAreClearErrors) {
  const Problem good = MakeProblem(1, {kK});
  Problem p = good;
  p.rows[3].position = 5;
  EXPECT_EQ(RunLoss("dflash {}", p).message(),
            "row 3: block position 5 is outside [0, 5)");
  p = good;
  p.rows[2].mask = -1;
  EXPECT_EQ(RunLoss("dflash {}", p).message(),
            "row 2: mask must be finite and >= 0, got -1");
  p = good;
  p.rows[1].target = kV;
  EXPECT_EQ(RunLoss("dflash {}", p).message(),
            "row 1: target id 13 is outside [0, 13)");
  p = good;
  p.logits[2 * kV + 4] = std::nan("");
  EXPECT_EQ(RunLoss("dflash {}", p).message(), "row 2: logit 4 is not finite (nan)");
  p = good;
  p.teacher[6 * kV + 1] = INFINITY;
  EXPECT_EQ(RunLoss("distillation {}", p).message(),
            "row 6: teacher logits: logit 1 is not finite (inf)");
  p = good;
  p.confidence[1] = NAN;
  EXPECT_EQ(RunLoss("dspark {}", p).message(),
            "row 1: confidence logit is not finite (nan)");
  p = good;
  p.logits.pop_back();
  EXPECT_EQ(RunLoss("dflash {}", p).message(),
            "chunk loss: logits hold 259 values, expected 20 rows x 13 vocab");
  p = good;
  p.teacher.clear();
  EXPECT_EQ(RunLoss("distillation {}", p).message(),
            "chunk loss: teacher_logits must hold 260 values (rows x vocab), "
            "got 0");
  p = good;
  p.confidence.resize(3);
  EXPECT_EQ(RunLoss("dspark {}", p).message(),
            "chunk loss: confidence_logits must hold 20 values (one per row "
            "for loss.dspark.confidence_weight), got 3");
  EXPECT_EQ(RunLoss("", good).message(),
            "chunk loss: loss: one loss family must be set (dflash, dpace, tv, "
            "lk_lambda, dspark, domino, distillation), got none");
  EXPECT_EQ(RunLoss("dpace { alpha: 1.5 }", good).message(),
            "chunk loss: loss.dpace.alpha: must lie in [0, 1], got 1.5");
  EXPECT_EQ(RunLoss("tv {} cross_entropy { label_smoothing: 0.1 }", good).message(),
            "chunk loss: loss.cross_entropy.label_smoothing: applies to "
            "cross-entropy terms, which loss.tv does not have, got 0.1");
  p = good;
  p.options.logit_scale = 0;
  EXPECT_EQ(RunLoss("dflash {}", p).message(),
            "chunk loss: logit_scale must be finite and > 0 and logit_softcap "
            "finite and >= 0, got 0 and 0");
  std::vector<int32_t> top(kRows * 65);
  ChunkLossOutputs outputs;
  outputs.top_k = absl::MakeSpan(top);
  outputs.k = 65;
  EXPECT_EQ(RunLoss("dflash {}", good, outputs).message(),
            "chunk loss: outputs.k must lie in [1, min(64, V = 13)], got 65");
  std::vector<int32_t> argmax(3);
  outputs = {};
  outputs.argmax = absl::MakeSpan(argmax);
  EXPECT_EQ(RunLoss("dflash {}", good, outputs).message(),
            "chunk loss: outputs.argmax must hold 20 values (one per row), "
            "got 3");
}

TEST(ChunkLossTest, BadRowStridesAreClearErrors) {
  Problem p = MakeProblem(1, {kK});
  const std::vector<double>& confidence = p.confidence;
  ChunkLossInputs<double> inputs{absl::MakeSpan(p.logits), p.teacher,
                                 confidence, p.rows, kV};
  inputs.row_stride = kV - 1;
  EXPECT_EQ(ChunkLoss<double>(Parse("dflash {}"), p.options, inputs, {})
                .status()
                .message(),
            "chunk loss: row_stride must be 0 (vocab) or >= vocab (13), got "
            "12");
  inputs.row_stride = kV + 1;
  EXPECT_EQ(ChunkLoss<double>(Parse("dflash {}"), p.options, inputs, {})
                .status()
                .message(),
            "chunk loss: logits hold 260 values, expected 20 rows x 14 "
            "row_stride");
  std::vector<double> padded(kRows * (kV + 1));
  inputs.logits = absl::MakeSpan(padded);
  EXPECT_EQ(ChunkLoss<double>(Parse("distillation {}"), p.options, inputs, {})
                .status()
                .message(),
            "chunk loss: teacher_logits must hold 280 values (rows x "
            "row_stride 14), got 260");
}

// The diagnostics (metric_top_k): per position, the target among the k
// largest z' (recall) and their softmax mass, the target probability and
// loss weight, and per row the target's rank and q; against a stable sort of
// z' in float64. A caller's top-k, shorter or longer than the metric's,
// comes from the same list. Float rows keep exp(z' - max) in place (no
// softcap), so the float path is checked too.
TEST(ChunkLossTest, DiagnosticsMatchASortOfTheLossLogits) {
  for (const char* loss : {"dflash { gamma: 7 }", "dpace { alpha: 0.3 }"}) {
    for (int32_t caller_k : {0, 2, 6}) {
      for (bool in_float : {false, true}) {
        SCOPED_TRACE(
            absl::StrCat(loss, " caller k ", caller_k, " float ", in_float));
        Problem p = MakeProblem(4, {kK});
        p.options.metric_top_k = 4;
        for (int64_t i = 0; i < kRows * kV; i += 5) p.logits[i] = 0.25;
        std::vector<int32_t> top(kRows * caller_k), rank(kRows);
        std::vector<double> q(kRows);
        ChunkLossOutputs outputs;
        outputs.top_k = absl::MakeSpan(top);
        outputs.k = caller_k;
        outputs.target_probability = absl::MakeSpan(q);
        outputs.target_rank = absl::MakeSpan(rank);
        absl::StatusOr<ChunkTerms> terms;
        if (in_float) {
          std::vector<float> logits(p.logits.begin(), p.logits.end());
          terms = ChunkLoss<float>(Parse(loss), p.options,
                                   {absl::MakeSpan(logits), {}, {}, p.rows, kV},
                                   outputs);
        } else {
          std::vector<double> logits = p.logits;
          terms = ChunkLoss<double>(
              Parse(loss), p.options,
              {absl::MakeSpan(logits), {}, {}, p.rows, kV}, outputs);
        }
        ASSERT_TRUE(terms.ok()) << terms.status();
        const Reference ref = Naive(Parse(loss), p);
        std::vector<double> recall(kK), mass(kK), probability(kK), weight(kK);
        for (int64_t r = 0; r < kRows; ++r) {
          const RowMeta& m = p.rows[r];
          std::vector<int32_t> order(kV);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(),
                           [&](int32_t a, int32_t b) {
                             return p.logits[r * kV + a] > p.logits[r * kV + b];
                           });
          if (caller_k > 0) {
            const std::vector<int32_t> want =
                m.mask > 0 ? std::vector<int32_t>(order.begin(),
                                                  order.begin() + caller_k)
                           : std::vector<int32_t>(caller_k, -1);
            EXPECT_EQ(std::vector<int32_t>(top.begin() + r * caller_k,
                                           top.begin() + (r + 1) * caller_k),
                      want)
                << "row " << r;
          }
          if (m.mask == 0) {
            EXPECT_EQ(rank[r], -1);
            EXPECT_EQ(q[r], 0);
            continue;
          }
          const double q_r = std::exp(-ref.neg_log_q[r]);
          int32_t want_rank = -1;
          double top_mass = 0;
          for (int32_t j = 0; j < 4; ++j) {
            if (order[j] == m.target) want_rank = j;
            top_mass +=
                std::exp(p.logits[r * kV + order[j]] -
                         p.logits[r * kV + m.target] - ref.neg_log_q[r]);
          }
          EXPECT_EQ(rank[r], want_rank) << "row " << r;
          EXPECT_NEAR(q[r], q_r, 1e-6) << "row " << r;
          recall[m.position] += want_rank >= 0 ? m.mask : 0.0;
          mass[m.position] += m.mask * top_mass;
          probability[m.position] += m.mask * q_r;
          weight[m.position] += ref.detached.weights[r];
        }
        for (int64_t k = 0; k < kK; ++k) {
          EXPECT_EQ(terms->top_k_recall_per_position[k], recall[k]);
          EXPECT_NEAR(terms->top_k_mass_per_position[k], mass[k], 1e-6);
          EXPECT_NEAR(terms->target_probability_per_position[k], probability[k],
                      1e-6);
          EXPECT_NEAR(terms->loss_weight_per_position[k], weight[k], 1e-6);
        }
      }
    }
  }
  // A rank needs the diagnostics' k.
  std::vector<int32_t> rank(kRows);
  ChunkLossOutputs outputs;
  outputs.target_rank = absl::MakeSpan(rank);
  EXPECT_EQ(RunLoss("dflash {}", MakeProblem(1, {kK}), outputs).message(),
            "chunk loss: outputs.target_rank needs options.metric_top_k > 0, "
            "got 0");
  Problem p = MakeProblem(1, {kK});
  p.options.metric_top_k = 65;
  EXPECT_EQ(RunLoss("dflash {}", p).message(),
            "chunk loss: metric_top_k must lie in [0, 64], got 65");
}

// The teacher diagnostics: teacher logits for a loss that reads none give
// per position the mask-weighted teacher acceptance clamp(1 - |p - t|_1 / 2,
// 0, 1), top-1 agreement and the teacher's mass on the draft's top-k, and
// per row the acceptance; the loss itself does not change. Against a
// float64 reference.
TEST(ChunkLossTest, TeacherDiagnosticsMatchANaiveReference) {
  Problem p = MakeProblem(6, {kK});
  p.options.metric_top_k = 3;
  const v1::LossConfig c = Parse("dflash { gamma: 7 }");
  std::vector<double> plain = p.logits, with = p.logits, acceptance(kRows);
  std::vector<int32_t> rank(kRows);
  const absl::StatusOr<ChunkTerms> without = ChunkLoss<double>(
      c, p.options, {absl::MakeSpan(plain), {}, {}, p.rows, kV});
  ChunkLossOutputs outputs;
  outputs.teacher_acceptance = absl::MakeSpan(acceptance);
  const absl::StatusOr<ChunkTerms> terms = ChunkLoss<double>(
      c, p.options, {absl::MakeSpan(with), p.teacher, {}, p.rows, kV}, outputs);
  ASSERT_TRUE(without.ok() && terms.ok()) << terms.status();
  EXPECT_EQ(terms->loss_num, without->loss_num);
  EXPECT_EQ(with, plain);
  std::vector<double> accept(kK), agree(kK), mass(kK);
  for (int64_t r = 0; r < kRows; ++r) {
    const RowMeta& m = p.rows[r];
    if (m.mask == 0) {
      EXPECT_EQ(acceptance[r], 0);
      continue;
    }
    const std::vector<double> z(p.logits.begin() + r * kV,
                                p.logits.begin() + (r + 1) * kV);
    const std::vector<double> t(p.teacher.begin() + r * kV,
                                p.teacher.begin() + (r + 1) * kV);
    const std::vector<double> ps = Softmax(z, 1), pt = Softmax(t, 1);
    double l1 = 0;
    for (int64_t v = 0; v < kV; ++v) l1 += std::abs(ps[v] - pt[v]);
    const double a = std::clamp(1 - 0.5 * l1, 0.0, 1.0);
    EXPECT_NEAR(acceptance[r], a, 1e-12) << "row " << r;
    std::vector<int32_t> order(kV);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t x, int32_t y) { return z[x] > z[y]; });
    const int32_t teacher_top =
        static_cast<int32_t>(std::max_element(t.begin(), t.end()) - t.begin());
    accept[m.position] += m.mask * a;
    agree[m.position] += order[0] == teacher_top ? m.mask : 0.0;
    for (int j = 0; j < 3; ++j) mass[m.position] += m.mask * pt[order[j]];
  }
  double agreements = 0;
  for (int64_t k = 0; k < kK; ++k) {
    EXPECT_NEAR(terms->teacher_acceptance_per_position[k], accept[k], 1e-12);
    EXPECT_EQ(terms->teacher_agreement_per_position[k], agree[k]);
    EXPECT_NEAR(terms->teacher_top_k_mass_per_position[k], mass[k], 1e-12);
    agreements += agree[k];
  }
  EXPECT_GT(agreements, 0);  // The fixture's teacher is the draft plus noise.
  // A row's acceptance needs teacher logits.
  std::vector<double> alone(kRows);
  ChunkLossOutputs lone;
  lone.teacher_acceptance = absl::MakeSpan(alone);
  std::vector<double> logits = p.logits;
  EXPECT_EQ(
      ChunkLoss<double>(c, p.options,
                        {absl::MakeSpan(logits), {}, {}, p.rows, kV}, lone)
          .status()
          .message(),
      "chunk loss: outputs.teacher_acceptance needs teacher logits and a "
      "loss other than distillation, got none");
}

// SpecForge's lk_loss_type="lambda": the CE weight comes from the whole
// batch, so each chunk leaves loss_num to FinishTerms and writes w (p -
// onehot) and q per row; the batch's gradient is that times
// LkDeferredFactor. Against the naive reference's composed numerator and its
// finite differences (with kl_w and the D-PACE weights held, as SpecForge
// detaches them), over two chunks of whole blocks.
TEST(ChunkLossTest, BatchLkLambdaComposesAfterTheLastChunk) {
  for (const char* text :
       {"dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } }",
        "dpace { alpha: 0.3 lk { type: LAMBDA kl_scale: 1.3 kl_decay: 0.5 } }",
        "dpace { alpha: 0.6 variant: CONTINUATION_VALUE_ONLY lk { type: "
        "LAMBDA } }"}) {
    SCOPED_TRACE(text);
    const v1::LossConfig c = Parse(text);
    const Problem p = MakeProblem(5, {kK});
    const Reference ref = Naive(c, p);
    std::vector<double> grad = p.logits, q(kRows, -1);
    ChunkTerms terms;
    const int64_t half = (kRows / kK / 2) * kK;
    for (const auto& [begin, end] :
         {std::pair<int64_t, int64_t>{0, half}, {half, kRows}}) {
      const int64_t n = end - begin;
      ChunkLossOutputs outputs;
      outputs.target_probability = absl::MakeSpan(q).subspan(begin, n);
      absl::StatusOr<ChunkTerms> chunk = ChunkLoss<double>(
          c, p.options,
          {absl::MakeSpan(grad).subspan(begin * kV, n * kV),
           absl::MakeConstSpan(p.teacher).subspan(begin * kV, n * kV),
           {},
           absl::MakeConstSpan(p.rows).subspan(begin, n),
           kV},
          outputs);
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      EXPECT_EQ(chunk->loss_num, 0);
      terms.Add(*chunk);
    }
    const std::optional<double> kl_weight =
        FinishTerms(*ResolveLoss(c), terms, 1).lk_kl_weight;
    ASSERT_TRUE(kl_weight.has_value());
    EXPECT_NEAR(*kl_weight, ref.detached.kl_weight, 1e-14);
    EXPECT_NEAR(terms.loss_num, ref.num, 1e-10);
    EXPECT_NEAR(terms.ce_num, ref.ce_num, 1e-10);
    EXPECT_NEAR(terms.tv_num, ref.tv_num, 1e-10);
    const double h = 1e-6;
    for (int64_t i = 0; i < kRows * kV; ++i) {
      const int64_t r = i / kV;
      Problem plus = p, minus = p;
      plus.logits[i] += h;
      minus.logits[i] -= h;
      const double numeric = (Naive(c, plus, &ref.detached).num -
                              Naive(c, minus, &ref.detached).num) /
                             (2 * h);
      ASSERT_NEAR(grad[i] * LkDeferredFactor(*kl_weight, q[r]), numeric, 1e-8)
          << "logit " << i;
    }
  }
  // Without the per-row q, the gradient could not be finished.
  const Problem p = MakeProblem(1, {kK});
  EXPECT_EQ(RunLoss("dflash { lk { type: LAMBDA } }", p).message(),
            "chunk loss: outputs.target_probability must hold 20 values (one "
            "per row: the batch-level LK lambda scales each row's gradient by "
            "its q once the batch is done), got none");
}

// The confidence gradient is an optional output like the others: without
// it, the terms and the logits gradient are the same.
TEST(ChunkLossTest, ConfidenceGradientIsOptional) {
  const v1::LossConfig c =
      Parse("dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }");
  const Problem p = MakeProblem(17, {kK, 1, 0});
  std::vector<double> with_grad, without_grad = p.logits;
  std::vector<double> confidence_grad;
  auto with = RunDouble(c, p, with_grad, confidence_grad);
  const std::vector<double>& confidence = p.confidence;
  auto without = ChunkLoss<double>(
      c, p.options,
      {absl::MakeSpan(without_grad), p.teacher, confidence, p.rows, kV});
  ASSERT_TRUE(with.ok() && without.ok()) << without.status();
  EXPECT_EQ(with->loss_num, without->loss_num);
  EXPECT_EQ(with_grad, without_grad);
  double norm = 0;
  for (double g : confidence_grad) norm += std::abs(g);
  EXPECT_GT(norm, 0);
}

// Found by //fuzz:chunk_loss_fuzz: a D-PACE weight of mask^2 from a huge
// (finite) mask overflowed the float32 gradient into inf, silently. Now it
// is an error naming the row; float64 still holds it.
TEST(ChunkLossTest, AGradientThatOverflowsIsAnError) {
  Problem p = MakeProblem(5, {kK, 1, 0});
  int64_t row = -1;
  for (int64_t r = 0; r < kRows; ++r) {
    if (p.rows[r].mask > 0 && row < 0) row = r;
  }
  ASSERT_GE(row, 0);
  p.rows[row].mask = 1e30f;
  std::vector<float> logits(p.logits.begin(), p.logits.end());
  std::vector<float> confidence(p.confidence.begin(), p.confidence.end());
  const v1::LossConfig dpace = Parse("dpace { alpha: 0.3 }");
  absl::Status f32 = ChunkLoss<float>(
      dpace, p.options, {absl::MakeSpan(logits), {}, confidence, p.rows, kV})
                         .status();
  EXPECT_EQ(f32.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f32.message().find(absl::StrCat(
                "row ", row, ": d(loss)/d(logits) overflows float32")),
            std::string::npos)
      << f32;
  std::vector<double> grad;
  std::vector<double> confidence_grad;
  auto f64 = RunDouble(dpace, p, grad, confidence_grad);
  ASSERT_TRUE(f64.ok()) << f64.status();
  for (double g : grad) ASSERT_TRUE(std::isfinite(g));
}

TEST(ChunkLossTest, BlockCoupledLossesNeedEachBlockTogetherInOrder) {
  const Problem good = MakeProblem(1, {kK});
  Problem p = good;
  std::swap(p.rows[1].position, p.rows[2].position);
  EXPECT_EQ(RunLoss("dpace {}", p).message(),
            "row 2: block 0 position 1 does not follow block 0 position 2 "
            "(block-level weights need each block's rows together, in "
            "position order)");
  p = good;
  p.rows[7].block = 0;  // A row of block 1 placed back in block 0.
  EXPECT_EQ(RunLoss("lk_lambda {}", p).message(),
            "row 7: block 0 position 2 does not follow block 1 position 1 "
            "(block-level weights need each block's rows together, in "
            "position order)");
  EXPECT_TRUE(RunLoss("dflash {}", p).ok());  // No block-level weights.
}

// A head checks its rows once per run and marks its chunks rows_checked:
// a chunk then skips the per-row checks, still checks what the chunk
// decides (the rows' order, for block-level weights), and computes the
// same terms and gradients.
TEST(ChunkLossTest, RowsCheckedSkipsOnlyThePerRowChecks) {
  const Problem good = MakeProblem(1, {kK});
  auto run = [](const Problem& p, bool rows_checked,
                std::vector<double>& logits) {
    logits.assign(p.logits.begin(), p.logits.end());
    ChunkLossInputs<double> inputs{absl::MakeSpan(logits), p.teacher, {},
                                   p.rows, kV};
    inputs.rows_checked = rows_checked;
    return ChunkLoss<double>(Parse("dpace { alpha: 0.3 }"), p.options, inputs);
  };
  std::vector<double> plain, checked;
  const absl::StatusOr<ChunkTerms> a = run(good, false, plain);
  const absl::StatusOr<ChunkTerms> b = run(good, true, checked);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->loss_num, b->loss_num);
  EXPECT_EQ(a->loss_den, b->loss_den);
  EXPECT_EQ(plain, checked);
  Problem swapped = good;
  std::swap(swapped.rows[1].position, swapped.rows[2].position);
  EXPECT_EQ(run(swapped, true, checked).status().message(),
            "row 2: block 0 position 1 does not follow block 0 position 2 "
            "(block-level weights need each block's rows together, in "
            "position order)");
}

// What a head does with masked rows: it never projects them. Dropping the
// rows without weight from a chunk leaves every term and gradient unchanged.
TEST_P(LossCaseTest, RowsWithoutWeightCanBeLeftOut) {
  const Problem p = problem(17);
  std::vector<double> full_grad;
  std::vector<double> full_confidence_grad;
  auto full = RunDouble(config(), p, full_grad, full_confidence_grad);
  ASSERT_TRUE(full.ok());
  Problem kept = p;
  kept.logits.clear();
  kept.teacher.clear();
  kept.confidence.clear();
  kept.rows.clear();
  std::vector<int64_t> source;
  for (int64_t r = 0; r < kRows; ++r) {
    if (p.rows[r].mask == 0) continue;
    source.push_back(r);
    kept.rows.push_back(p.rows[r]);
    kept.confidence.push_back(p.confidence[r]);
    kept.logits.insert(kept.logits.end(), p.logits.begin() + r * kV,
                       p.logits.begin() + (r + 1) * kV);
    kept.teacher.insert(kept.teacher.end(), p.teacher.begin() + r * kV,
                        p.teacher.begin() + (r + 1) * kV);
  }
  std::vector<double> grad = kept.logits;
  const std::vector<double>& confidence = kept.confidence;
  std::vector<double> confidence_grad(kept.rows.size());
  ChunkLossOutputs outputs;
  outputs.confidence_grad = absl::MakeSpan(confidence_grad);
  auto compact = ChunkLoss<double>(
      config(), p.options,
      {absl::MakeSpan(grad), kept.teacher, confidence, kept.rows, kV}, outputs);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_NEAR(compact->loss_num, full->loss_num, 1e-12 * full->loss_num);
  EXPECT_NEAR(compact->loss_den, full->loss_den, 1e-12 * full->loss_den);
  EXPECT_EQ(compact->correct, full->correct);
  EXPECT_EQ(compact->correct_per_position, full->correct_per_position);
  for (size_t i = 0; i < source.size(); ++i) {
    for (int64_t v = 0; v < kV; ++v) {
      ASSERT_EQ(grad[i * kV + v], full_grad[source[i] * kV + v]);
    }
    EXPECT_EQ(confidence_grad[i], full_confidence_grad[source[i]]);
  }
}


TEST(ChunkLossTest, CountedIgnoredTargetsNeedSpecForgesFamiliesAndANegativeIndex) {
  for (const auto& [loss, message] : std::vector<std::pair<std::string, std::string>>{
           {"dflash {} cross_entropy { ignored_target_weight: COUNT "
            "ignore_index: 3 }",
            "loss.cross_entropy.ignore_index: must be negative, and at least "
            "-2^31, with ignored_target_weight COUNT (SpecForge's -100, never "
            "a class), got 3"},
           {"dflash {} cross_entropy { ignored_target_weight: COUNT "
            "ignore_index: -3000000000 }",
            "loss.cross_entropy.ignore_index: must be negative, and at least "
            "-2^31, with ignored_target_weight COUNT (SpecForge's -100, never "
            "a class), got -3000000000"},
           {"lk_lambda {} cross_entropy { ignored_target_weight: COUNT }",
            "loss.cross_entropy.ignored_target_weight: COUNT is SpecForge's "
            "convention, which loss.lk_lambda has no counterpart in (use "
            "DROP, or dflash { lk { type: LAMBDA } } for SpecForge's LK "
            "lambda), got COUNT"},
           {"distillation {} cross_entropy { ignored_target_weight: COUNT }",
            "loss.cross_entropy.ignored_target_weight: COUNT is SpecForge's "
            "convention, which loss.distillation has no counterpart in (use "
            "DROP, or dflash { lk { type: LAMBDA } } for SpecForge's LK "
            "lambda), got COUNT"},
           {"domino {} cross_entropy { ignored_target_weight: COUNT }",
            "loss.cross_entropy.ignored_target_weight: COUNT is undefined for "
            "loss.domino: SpecForge's Domino embeds every target id, which "
            "fails on an ignored one (use DROP), got COUNT"},
           {"dspark { objective: DPARD ce_weight: 0 l1_weight: 0 } "
            "cross_entropy { ignored_target_weight: COUNT }",
            "loss.cross_entropy.ignored_target_weight: COUNT is not matched "
            "for loss.dspark objective DPARD (use DROP), got COUNT"},
           {"dflash {} cross_entropy { ignored_target_weight: "
            "IGNORED_TARGET_WEIGHT_UNSPECIFIED }",
            "loss.cross_entropy.ignored_target_weight: must be set, got "
            "IGNORED_TARGET_WEIGHT_UNSPECIFIED"},
           {"dpace { denominator: DENOMINATOR_UNSPECIFIED }",
            "loss.dpace.denominator: must be set, got "
            "DENOMINATOR_UNSPECIFIED"},
       }) {
    absl::StatusOr<LossParams> params = ResolveLoss(Parse(loss));
    EXPECT_FALSE(params.ok()) << loss;
    EXPECT_EQ(params.status().message(), message) << loss;
  }
}

// Under COUNT a weighted row whose target is another negative id is still
// an error, not a row without a target.
TEST(ChunkLossTest, CountedIgnoredTargetsLeaveOtherBadTargetsErrors) {
  Problem p = MakeProblem(1, {kK});
  p.rows[1].target = -7;
  EXPECT_EQ(RunLoss("dflash {} cross_entropy { ignored_target_weight: COUNT }",
                    p)
                .message(),
            "row 1: target id -7 is outside [0, 13)");
}

// D-PACE's SEQUENCE_BALANCED denominator against the naive reference: each
// weight times 1 / (its sequence's weighted blocks), loss_den the number of
// sequences with weight; the fixture's second sequence has one kept block,
// the first two.
TEST(ChunkLossTest, SequenceBalancedDPaceMatchesTheNaiveReference) {
  for (const std::string loss :
       {"dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }",
        "dpace { alpha: 0.3 variant: CUMULATIVE_CONFIDENCE_ONLY denominator: "
        "SEQUENCE_BALANCED } cross_entropy { ignored_target_weight: COUNT }",
        "dpace { alpha: 0.7 variant: CONTINUATION_VALUE_ONLY lk { type: TV } "
        "denominator: SEQUENCE_BALANCED }"}) {
    const v1::LossConfig config = Parse(loss);
    const LossParams params = *ResolveLoss(config);
    Problem p = MakeProblem(41, {kK});
    IgnoreTwoWeightedTargets(p);
    SetSequenceShares(params, kK, kN * kK, absl::MakeSpan(p.rows));
    EXPECT_EQ(p.rows[0].sequence_share, 0.5) << loss;
    EXPECT_EQ(p.rows[kN * kK].sequence_share, 1.0) << loss;
    const Reference ref = Naive(config, p);
    std::vector<double> grad;
    std::vector<double> confidence_grad;
    auto terms = RunDouble(config, p, grad, confidence_grad);
    ASSERT_TRUE(terms.ok()) << terms.status();
    EXPECT_NEAR(terms->loss_num, ref.num, 1e-12) << loss;
    // The chunk's loss_den is its sum of w (loss_weight_per_position's).
    EXPECT_NEAR(terms->loss_den, ref.den, 1e-12) << loss;
    EXPECT_EQ(WeightedSequences(params, p.rows), 2.0) << loss;
    terms->loss_den = WeightedSequences(params, p.rows);
    const FinishedLoss finished = FinishTerms(params, *terms, kB);
    EXPECT_NEAR(finished.loss, ref.num / 2, 1e-12) << loss;
    EXPECT_EQ(RowsGradientScale(params, p.rows, kB), finished.gradient_scale);
    const Detached detached = Naive(config, p).detached;
    const double h = 1e-6;
    for (int64_t i = 0; i < kRows * kV; ++i) {
      Problem plus = p, minus = p;
      plus.logits[i] += h;
      minus.logits[i] -= h;
      const double numeric = (Naive(config, plus, &detached).num -
                              Naive(config, minus, &detached).num) /
                             (2 * h);
      ASSERT_NEAR(grad[i], numeric, 1e-8) << loss << " logit " << i;
    }
  }
}

// A sequence without weight keeps share 1 (SpecForge's clamp_min(1)) and
// adds nothing to the denominator.
TEST(ChunkLossTest, SequenceSharesOfAnUnweightedSequence) {
  const LossParams params =
      *ResolveLoss(Parse("dpace { denominator: SEQUENCE_BALANCED }"));
  Problem p = MakeProblem(3, {kK});
  for (int64_t r = kN * kK; r < kRows; ++r) p.rows[r].mask = 0;
  SetSequenceShares(params, kK, kN * kK, absl::MakeSpan(p.rows));
  EXPECT_EQ(p.rows[kRows - 1].sequence_share, 1.0);
  EXPECT_EQ(WeightedSequences(params, p.rows), 1.0);
}

}  // namespace
}  // namespace dflash
