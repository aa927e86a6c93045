#ifndef DFLASH_LOSSES_LOSS_MATH_H_
#define DFLASH_LOSSES_LOSS_MATH_H_

// The per-row scalar formulas of the DFlash-family losses, as host/device
// inline functions that the CPU loss (chunk_loss.cc) and the CUDA kernels
// (cuda_row_kernels.cu) both call, so each is written once
// (docs/semantics.md sections 3 to 5). Templated on the type they compute
// in where the backends differ (float rows on the GPU, double on the CPU).

#include <cmath>
#include <cstdint>

#include "base/host_device.h"
#include "losses/loss_params.h"

namespace dflash {

// log(exp(a) + exp(b)) without overflow.
template <typename R>
DFLASH_HOST_DEVICE inline R LogAddExp(R a, R b) {
  const R max = a > b ? a : b;
  const R gap = a > b ? a - b : b - a;
  return max + log1p(exp(-gap));
}

// D-PACE: a row's factor in its block's cumulative product, from its target
// probability q under the smoothing alpha; unsupervised rows pass 1.
DFLASH_HOST_DEVICE inline double DPaceSmooth(double mask, double q,
                                             double alpha) {
  return mask > 0 ? (1 - alpha) * q + alpha : 1.0;
}

// lk_lambda: the weight of the KL (CE) part of a block, from the block's
// mask-weighted acceptance (mean target probability).
DFLASH_HOST_DEVICE inline double LkLambdaKlWeight(double kl_scale,
                                                  double kl_decay,
                                                  double acceptance) {
  return kl_scale * exp(-kl_decay * acceptance);
}

// The share of a row's weight its cross-entropy takes: DSpark's ce_weight,
// lk_lambda's per-block `block_share`, else 1.
DFLASH_HOST_DEVICE inline double CrossEntropyShare(const LossParams& p,
                                                   double block_share) {
  if (p.family == LossFamily::kDSpark) return p.ce_weight;
  return p.lk == LkMode::kLambdaBlock ? block_share : 1.0;
}

// D-PARD's credit of a block: D-PACE's weights (DPaceBlockWeights) with the
// smoothing dpard_alpha, over each row's acceptance for q.
DFLASH_HOST_DEVICE inline LossParams DPardCreditParams(const LossParams& p) {
  LossParams credit = p;
  credit.alpha = p.dpard_alpha;
  credit.dpace_variant = DPaceVariant::kDPace;
  return credit;
}

// D-PARD at one logit, given l = (log q + log p) / 2 - log sum sqrt(q p)
// (the log of sqrt(q p) normalised) and q: d(-2 log sum sqrt(q p))/dz' =
// q - exp(l).
template <typename R>
DFLASH_HOST_DEVICE inline R RenyiGradient(R q, R normalised_log_root) {
  return q - exp(normalised_log_root);
}

// DSpark: the acceptance a row's L1 distance to the teacher implies.
DFLASH_HOST_DEVICE inline double DSparkAcceptance(double l1) {
  const double a = 1 - 0.5 * l1;
  return a < 0 ? 0.0 : (a > 1 ? 1.0 : a);
}

// DSpark's confidence head: binary cross-entropy of the logit c against the
// target `accept`, and its derivative in c (sigmoid(c) - accept).
DFLASH_HOST_DEVICE inline double ConfidenceBce(double c, double accept) {
  return (c > 0 ? c : 0.0) - c * accept + log1p(exp(-fabs(c)));
}
DFLASH_HOST_DEVICE inline double ConfidenceBceGradient(double c,
                                                       double accept) {
  return 1 / (1 + exp(-c)) - accept;
}

// z' = cap * tanh(scale * z / cap), or scale * z without a softcap (cap 0),
// and the chain rule d/dz from d/dz' given z'. In double on both backends
// (the caller rounds z' to its working type); the ratios are taken once,
// so no element pays a division, unless a subnormal cap overflows them.
class LogitTransform {
 public:
  DFLASH_HOST_DEVICE LogitTransform(double scale, double cap)
      : scale_(scale),
        cap_(cap),
        scale_over_cap_(cap > 0 ? scale / cap : 0),
        inv_cap_(cap > 0 ? 1 / cap : 0),
        ratios_finite_(scale_over_cap_ - scale_over_cap_ == 0 &&
                       inv_cap_ - inv_cap_ == 0) {}
  DFLASH_HOST_DEVICE double operator()(double z) const {
    if (cap_ == 0) return scale_ * z;
    return cap_ *
           tanh(ratios_finite_ ? z * scale_over_cap_ : scale_ * z / cap_);
  }
  DFLASH_HOST_DEVICE double Chain(double grad, double transformed) const {
    if (cap_ == 0) return grad * scale_;
    const double t =
        ratios_finite_ ? transformed * inv_cap_ : transformed / cap_;
    return grad * scale_ * (1 - t * t);
  }
  DFLASH_HOST_DEVICE bool identity() const { return scale_ == 1 && cap_ == 0; }
  DFLASH_HOST_DEVICE double scale() const { return scale_; }
  DFLASH_HOST_DEVICE double softcap() const { return cap_; }

 private:
  double scale_, cap_, scale_over_cap_, inv_cap_;
  bool ratios_finite_;
};

// Domino adds this to its loss, accuracy and accept-length denominators
// (SpecForge's eps) rather than floor them.
constexpr double kDominoDenominatorOffset = 1e-6;

// What `family` adds to the summed loss_den before dividing: Domino's
// offset; 0 for the rest, whose sum is floored instead (FlooredLossDen).
DFLASH_HOST_DEVICE inline double LossDenOffset(LossFamily family) {
  return family == LossFamily::kDomino ? kDominoDenominatorOffset : 0.0;
}

// The loss's denominator after the reduction over every chunk, floored at
// float32's smallest normal number as SpecForge floors it
// (`clamp_min(finfo.tiny)`): a batch without weight has loss 0 and zero
// gradients, and the loss does not depend on which chunks were empty.
DFLASH_HOST_DEVICE inline double FlooredLossDen(double den) {
  constexpr double kFloat32Tiny = 1.1754943508222875e-38;
  return den > kFloat32Tiny ? den : kFloat32Tiny;
}

// The mask a row counts with: 0 where its target is ignore_index, unless
// the convention counts such rows (LossParams::count_ignored).
DFLASH_HOST_DEVICE inline double EffectiveMask(const LossParams& p,
                                               int32_t target, double mask) {
  return target == p.ignore_index && !p.count_ignored ? 0.0 : mask;
}

// Whether a row with a mask has a target class. Without one (its target
// ignore_index, counted: negative then, by validation) its -log q is 0 and
// q 1, as F.cross_entropy gives it; it adds no loss and no gradient.
DFLASH_HOST_DEVICE inline bool HasTarget(int32_t target) { return target >= 0; }

// A row's -log q from its logits' max, log sum exp(z' - max) and target
// logit (used only with a target class): (max - target_logit) + log_sum in
// double, where the float logits' difference is exact; 0 without a target
// class (HasTarget). The CUDA loss's: the CPU's stats hold logsumexp whole
// and, without a target class, set target_logit to it.
DFLASH_HOST_DEVICE inline double NegLogQ(int32_t target, double max,
                                         double log_sum, double target_logit) {
  if (!HasTarget(target)) return 0.0;
  return (max - target_logit) + log_sum;
}

// The factor of a row's D-PACE weight: its sequence share under the
// SEQUENCE_BALANCED denominator, else 1.
DFLASH_HOST_DEVICE inline double DPaceRowScale(const LossParams& p,
                                               double sequence_share) {
  return p.sequence_balanced ? sequence_share : 1.0;
}

// A row's loss weight before block-level coupling: the family's decay of
// its mask (LossParams::gamma); D-PACE's block weights replace it.
DFLASH_HOST_DEVICE inline double RowLossWeight(const LossParams& p,
                                               int32_t position, double mask) {
  if (p.gamma == 0) return mask;
  const int32_t steps = position > p.decay_from ? position - p.decay_from : 0;
  return mask * exp(-steps / p.gamma);
}

// Whether a family's row weights depend on the other rows of its block.
DFLASH_HOST_DEVICE inline bool CouplesBlocks(const LossParams& p) {
  return p.family == LossFamily::kDPace || p.lk == LkMode::kLambdaBlock ||
         p.dpard;
}

// SpecForge's batch-level LK lambda: the CE weight from the batch's
// target-probability sum over its mask sum, the latter clamped at 1.
DFLASH_HOST_DEVICE inline double BatchLkKlWeight(const LossParams& p,
                                                 double target_probability,
                                                 double accuracy_den) {
  return LkLambdaKlWeight(
      p.kl_scale, p.kl_decay,
      target_probability / (accuracy_den > 1 ? accuracy_den : 1.0));
}

// Under the batch-level LK lambda a row's d(loss_num)/dz' is
// w (p - onehot) (kl_w + (1 - kl_w) q): the loss writes w (p - onehot),
// and the head multiplies the row's gradients by this factor once kl_w is
// known.
DFLASH_HOST_DEVICE inline double LkDeferredFactor(double kl_weight, double q) {
  return kl_weight + (1 - kl_weight) * q;
}

// lk_lambda's share of cross-entropy for a block of n rows: LkLambdaKlWeight
// of the block's mask-weighted mean target probability. q(i) and mask(i)
// read the block's row i.
template <typename Q, typename Mask>
DFLASH_HOST_DEVICE inline double LkLambdaBlockShare(const LossParams& p,
                                                    int64_t n, Q q, Mask mask) {
  double hits = 0, mass = 0;
  for (int64_t i = 0; i < n; ++i) {
    hits += q(i) * mask(i);
    mass += mask(i);
  }
  return LkLambdaKlWeight(p.kl_scale, p.kl_decay, mass > 0 ? hits / mass : 0);
}

// D-PACE's weights of a block of n rows, into weight[0, n), without
// gradient (docs/semantics.md section 5.2): smooth = DPaceSmooth, prefix =
// cumprod(smooth), suffix = reverse-cumsum(prefix * m); the variant picks
// suffix, prefix or suffix / prefix, times m. q(i) and mask(i) read the
// block's row i.
template <typename Q, typename Mask>
DFLASH_HOST_DEVICE inline void DPaceBlockWeights(const LossParams& p, int64_t n,
                                                 Q q, Mask mask,
                                                 double* weight) {
  double running = 1;
  for (int64_t i = 0; i < n; ++i) {
    running *= DPaceSmooth(mask(i), q(i), p.alpha);
    weight[i] = running;  // The prefix, until the pass below.
  }
  constexpr double kTiny = 2.2250738585072014e-308;  // DBL_MIN.
  double tail = 0;
  for (int64_t i = n - 1; i >= 0; --i) {
    const double prefix = weight[i];
    tail += prefix * mask(i);
    double w;
    switch (p.dpace_variant) {
      case DPaceVariant::kCumulative:
        w = prefix;
        break;
      case DPaceVariant::kContinuation:
        w = tail / (prefix > kTiny ? prefix : kTiny);
        break;
      default:
        w = tail;
        break;
    }
    weight[i] = w * mask(i);
  }
}

// The softmax-family terms of one row with weight w (CE, label-smoothed;
// tv's 1 - q; lk_lambda's mix of the two by ce_share; the z-loss), from the
// row's -log q, logsumexp and mean logit z' (read only with label
// smoothing). Its gradient in z' is softmax * p - target * onehot -
// uniform / V. ce and tv are the row's parts of SpecForge's ce_loss_num and
// tv_loss_num (tv only where the composition has one). Under the batch-level
// lambda, loss is 0 (composed from ce and tv after the reduction) and the
// gradient is w (p - onehot), to be scaled by LkDeferredFactor.
struct SoftmaxRowTerms {
  double loss = 0;
  double ce = 0;
  double tv = 0;
  double softmax = 0;
  double target = 0;
  double uniform = 0;
};
DFLASH_HOST_DEVICE inline SoftmaxRowTerms SoftmaxFamilyRow(
    const LossParams& p, double w, double ce_share, double neg_log_q,
    double lse, double mean_logit) {
  const double q = exp(-neg_log_q);
  const double eps = p.label_smoothing;
  const double ce_term =
      eps > 0 ? (1 - eps) * neg_log_q + eps * (lse - mean_logit) : neg_log_q;
  SoftmaxRowTerms t;
  t.ce = w * ce_term;
  t.tv = p.lk == LkMode::kCrossEntropy ? 0 : w * (1 - q);
  if (p.lk == LkMode::kLambdaBatch) {
    t.softmax = w;
    t.target = w;
    return t;
  }
  const bool tv = p.lk == LkMode::kTv;
  const double ce_w = tv ? 0 : w * ce_share;
  const double tv_w = tv                             ? w
                      : p.lk == LkMode::kLambdaBlock ? w * (1 - ce_share)
                                                     : 0;
  const double z_w = w * p.z_loss_scale;
  t.loss = ce_w * ce_term + tv_w * (1 - q) + z_w * lse * lse;
  t.softmax = ce_w + tv_w * q + 2 * z_w * lse;
  t.target = ce_w * (1 - eps) + tv_w * q;
  t.uniform = ce_w * eps;
  return t;
}

// DSpark's L1 at one logit, d = p - t: |d| adds to the row's L1 and
// p * sign(d) to its signed mass.
template <typename R>
DFLASH_HOST_DEVICE inline R SignOf(R d) {
  return static_cast<R>((d > 0) - (d < 0));
}

// DSpark's L1 gradient at one logit: d/dz' of softmax-family terms plus
// l1_coefficient * |p - t|_1, given p = softmax(z'), d = p - t and the row's
// signed mass sum_w p_w sign(d_w); the target's term is left to the caller.
template <typename R>
DFLASH_HOST_DEVICE inline R DSparkGradient(R softmax, R l1_coefficient,
                                           R signed_mass, R uniform_over_v, R p,
                                           R d) {
  return (softmax + l1_coefficient * (SignOf(d) - signed_mass)) * p - uniform_over_v;
}

// Distillation at one logit, with ls and lt the student's and teacher's
// log-probabilities at temperature T: its part of the row's divergence;
// for the JSD, the student part whose row sum its gradient needs; for the
// forward KL, its gradient in u = z' / T (s - t), which needs no row sum,
// so that one pass does. log_beta = log(beta), log_rest = log(1 - beta).
template <typename R>
struct DistillationPoint {
  R divergence = 0;
  R student_part = 0;
  R forward_gradient = 0;
};
template <typename R>
DFLASH_HOST_DEVICE inline DistillationPoint<R> DistillationAt(
    Divergence divergence, R beta, R log_beta, R log_rest, R ls, R lt) {
  DistillationPoint<R> d;
  switch (divergence) {
    case Divergence::kReverseKl:
      d.divergence = exp(ls) * (ls - lt);
      break;
    case Divergence::kJsd: {
      const R lm = LogAddExp(log_rest + ls, log_beta + lt);
      d.student_part = exp(ls) * (ls - lm);
      d.divergence = beta * exp(lt) * (lt - lm) + (1 - beta) * d.student_part;
      break;
    }
    default: {  // Forward KL(t || s).
      const R t = exp(lt);
      d.divergence = t * (lt - ls);
      d.forward_gradient = exp(ls) - t;
      break;
    }
  }
  return d;
}

// d(divergence)/du at one logit (u = z' / T), times g, given the row's
// divergence and, for the JSD, its summed student part: reverse KL s (ls -
// lt - D), JSD (1 - beta) s (log(s / M) - sum), forward KL s - t.
template <typename R>
DFLASH_HOST_DEVICE inline R DistillationGradientAt(Divergence divergence,
                                                   R beta, R log_beta,
                                                   R log_rest, R ls, R lt,
                                                   R row_divergence,
                                                   R row_student_part, R g) {
  switch (divergence) {
    case Divergence::kReverseKl:
      return g * exp(ls) * ((ls - lt) - row_divergence);
    case Divergence::kJsd: {
      const R lm = LogAddExp(log_rest + ls, log_beta + lt);
      return g * (1 - beta) * exp(ls) * ((ls - lm) - row_student_part);
    }
    default:
      return g * (exp(ls) - exp(lt));
  }
}

// The batch's finish (FinishTerms, chunk_loss.h) over the totals it reads,
// written once for the host (FinishTerms) and the CUDA head's device finish
// (head.device_results, a one-thread kernel), so both run the same formula
// (equal within rounding, not bitwise: nvcc contracts a*b + c*d into FMAs):
// composes loss_num where it needs the whole batch (the LK
// lambda's kl_w * ce_num + (1 - kl_w) * tv_num; D-PARD's) and divides as
// the family does. `t.loss_num` is updated in place.
struct FinishTotals {
  double loss_num = 0, loss_den = 0, correct = 0, accuracy_den = 0,
         target_probability = 0, ce_num = 0, tv_num = 0, dpard_num = 0,
         confidence_num = 0;
};
struct FinishedScalars {
  double loss = 0;
  double denominator = 1;
  double accuracy = 0;
  double gradient_scale = 0;
  double confidence_scale = 0;
  // The batch-level LK lambda's kl_w, where has_lk_kl_weight.
  bool has_lk_kl_weight = false;
  double lk_kl_weight = 0;
};
DFLASH_HOST_DEVICE inline FinishedScalars FinishScalars(const LossParams& p,
                                                        FinishTotals& t,
                                                        int64_t sequences) {
  FinishedScalars f;
  if (p.family == LossFamily::kDomino) {
    const double den = t.loss_den + kDominoDenominatorOffset;
    f.denominator = den;
    f.loss = t.loss_num / den;
    f.gradient_scale = f.confidence_scale = 1 / den;
    f.accuracy = t.correct / (t.accuracy_den + kDominoDenominatorOffset);
    return f;
  }
  const double den = FlooredLossDen(t.loss_den);
  f.denominator = den;
  f.accuracy = t.accuracy_den > 0 ? t.correct / t.accuracy_den : 0;
  if (p.family == LossFamily::kDSpark) {
    // std::max(accuracy_den, 1.0), spelled for the device.
    f.accuracy = t.correct / (t.accuracy_den < 1.0 ? 1.0 : t.accuracy_den);
  }
  f.gradient_scale = f.confidence_scale = 1 / den;
  if (p.lk == LkMode::kLambdaBatch) {
    f.has_lk_kl_weight = true;
    f.lk_kl_weight = BatchLkKlWeight(p, t.target_probability, t.accuracy_den);
    t.loss_num = f.lk_kl_weight * t.ce_num + (1 - f.lk_kl_weight) * t.tv_num;
  }
  if (p.dpard) {
    // SpecForge: dpard_loss_num / sequences + alpha_conf * confidence_num /
    // loss_den, the first part per sequence.
    const double per_sequence =
        1.0 / static_cast<double>(sequences > 1 ? sequences : 1);
    f.loss = t.dpard_num * per_sequence +
             p.confidence_weight * t.confidence_num / den;
    f.gradient_scale = per_sequence;
    t.loss_num = f.loss * den;
    return f;
  }
  f.loss = t.loss_num / den;
  return f;
}

// The accepted-length chains (losses/accepted_length.h), for the host's
// AcceptedLengths and the CUDA head's device finish. A slot with a mask
// above 0.5 is supervised; its acceptance is q for the expected length,
// [target among the top-k] (rank >= 0) for the oracle length and the
// teacher acceptance for DSpark's; 0 where unsupervised.
struct SlotAcceptance {
  bool supervised = false;
  double expected = 0, oracle = 0, teacher = 0;
};
DFLASH_HOST_DEVICE inline SlotAcceptance AcceptanceOfSlot(double mask,
                                                          double q,
                                                          int32_t rank,
                                                          double teacher) {
  SlotAcceptance s;
  s.supervised = mask > 0.5f;
  s.expected = s.supervised ? q : 0.0;
  s.oracle = s.supervised && rank >= 0 ? 1.0 : 0.0;
  s.teacher = s.supervised ? teacher : 0.0;
  return s;
}

// 1 + sum_{k>=first} prod_{j=first..k} a(j) over a block's slots k < K.
template <typename A>
DFLASH_HOST_DEVICE inline double ChainLength(A a, int64_t first,
                                             int64_t block_size) {
  double alive = 1, length = 1;
  for (int64_t k = first; k < block_size; ++k) {
    alive *= a(k);
    length += alive;
  }
  return length;
}

}  // namespace dflash

#endif  // DFLASH_LOSSES_LOSS_MATH_H_
