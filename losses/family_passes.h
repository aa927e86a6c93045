#ifndef DFLASH_LOSSES_FAMILY_PASSES_H_
#define DFLASH_LOSSES_FAMILY_PASSES_H_

// Each loss family's row pass, written once over a small row interface that
// the CPU loss (chunk_loss.cc, a loop over V in double) and the CUDA loss
// kernel (cuda_row_kernels.cu, one thread block per row, block reductions
// in float) both implement, so the CPU suites run the very family code the
// GPU runs (docs/adding-a-loss-family.md). What a row pass may do, `Row`'s
// members:
//
//   Real                    the type of per-logit arithmetic.
//   loss(), vocab(), target(), mask(), weight()
//                           the row's LossParams, V, and RowMeta's fields;
//                           weight() is the row's loss weight w.
//   neg_log_q(), lse(), MeanLogit()
//                           of the row's logits z' (the stats pass's).
//   share(), accept()       the block pass's results: lk_lambda's CE share
//                           or D-PARD's credit (else 1), D-PARD's acceptance.
//   has_teacher(), confidence()
//   LogSoftmax(z'), Softmax(z'), TemperedLogSoftmax(z')
//   TeacherLogSoftmax(t'), TeacherSoftmax(t'), TeacherTemperedLogSoftmax(t')
//                           at one logit; Tempered: at 1 / inv_temperature.
//   DraftTop1(), TeacherTop1(), TeacherAgrees()
//                           max softmax of each, and argmax equality.
//   ForEach(f)              f(i, z'_i, t'_i) over this worker's logits (t'
//                           is z' without a teacher); with Reduce(partial),
//                           the sum of every worker's partial, a row sum.
//   LogSumExp(f)            logsumexp over the row of f(z'_i, t'_i).
//   WriteGradient(g, bound) the row's d(loss_num)/dz' = g(i, z'_i, t'_i),
//                           chained through the logit transform and stored;
//                           bound >= max |g| (HUGE_VAL: none), which lets
//                           the CPU skip its overflow scan.
//   WriteSoftmaxGradient(softmax, on_target, uniform, bound)
//                           the same for softmax * p - on_target * onehot -
//                           uniform / V, which each backend runs its own
//                           fastest way.
//   Add(slot, value)        the row's term (term_slots.h).
//   SetTeacherAcceptance(a), SetConfidenceGradient(g)   per-row outputs.
//   ConfidenceNotFinite(c)  the row's error.
//
// Domino's rows read two logit tensors; its Row has DominoStats(stats)
// (false on the row's error), SetDominoOutputs(stats, q) and
// WriteDominoGradient(g_final, g_base) instead of the single-row members.

#include <cmath>
#include <cstdint>

#include "base/host_device.h"
#include "losses/loss_math.h"
#include "losses/loss_params.h"
#include "losses/term_slots.h"

// The row passes are host/device templates, inlined into the CUDA kernel
// and the CPU loss, so that a Row's members stay in registers across the
// per-logit loops (an out-of-line pass would reload them after every call
// to exp).
#if defined(__CUDACC__)
#define DFLASH_ROW_PASS __host__ __device__ __forceinline__
#else
#define DFLASH_ROW_PASS inline __attribute__((always_inline))
#endif

namespace dflash {

// Two row sums reduced together.
template <typename R>
struct RowSums {
  R a = 0, b = 0;
};
template <typename R>
DFLASH_HOST_DEVICE inline RowSums<R> operator+(RowSums<R> x, RowSums<R> y) {
  return {x.a + y.a, x.b + y.b};
}

// |p - t|_1 between the row's draft and teacher softmax.
template <typename Row>
DFLASH_ROW_PASS double TeacherL1(Row& row) {
  using R = typename Row::Real;
  R l1 = 0;
  row.ForEach([&](int64_t, R zp, R tp) {
    const R p = row.Softmax(zp);
    l1 += fabs(p - row.TeacherSoftmax(tp));
  });
  return row.Reduce(l1);
}

// The teacher diagnostics of a row whose loss reads no teacher.
template <typename Row>
DFLASH_ROW_PASS void TeacherDiagnosticsPass(Row& row) {
  const double accept = DSparkAcceptance(TeacherL1(row));
  const double m = row.mask();
  row.Add(kTeacherAcceptance, m * accept);
  row.Add(kTeacherAgreement, row.TeacherAgrees() ? m : 0.0);
  row.SetTeacherAcceptance(accept);
}

// DSpark's teacher terms of a row with acceptance `accept`: top-1
// probabilities, agreement, and the confidence BCE (its gradient output);
// returns what the confidence term adds to loss_num.
template <typename Row>
DFLASH_ROW_PASS double DSparkTeacherTerms(Row& row, double accept) {
  const LossParams& p = row.loss();
  const double m = row.mask(), w = row.weight();
  row.Add(kTeacherTop1, m * row.TeacherTop1());
  row.Add(kDraftTop1, m * row.DraftTop1());
  row.Add(kTeacherAgreement, row.TeacherAgrees() ? m : 0.0);
  row.Add(kTeacherAcceptance, m * accept);
  row.SetTeacherAcceptance(accept);
  if (!(p.confidence_weight > 0)) return 0;
  const double c = row.confidence();
  if (!(c - c == 0)) {  // Not finite.
    row.ConfidenceNotFinite(c);
    return 0;
  }
  const double bce = ConfidenceBce(c, accept);
  const double gradient = ConfidenceBceGradient(c, accept);
  row.Add(kConfidenceNum, w * bce);
  row.Add(kConfidenceErrorNum, w * fabs(gradient));  // |sigmoid(c) - accept|
  row.SetConfidenceGradient(w * p.confidence_weight * gradient);
  return w * p.confidence_weight * bce;
}

// DSpark with a teacher: the softmax-family terms `t` plus the L1 between
// draft and teacher softmax and the teacher terms; `bound` bounds the
// softmax-family gradient.
template <typename Row>
DFLASH_ROW_PASS void DSparkPass(Row& row, const SoftmaxRowTerms& t,
                                double bound) {
  using R = typename Row::Real;
  const LossParams& p = row.loss();
  const double w = row.weight();
  RowSums<R> sums;  // L1, and the signed mass sum_v p_v sign(p_v - t_v).
  row.ForEach([&](int64_t, R zp, R tp) {
    const R pz = row.Softmax(zp);
    const R d = pz - row.TeacherSoftmax(tp);
    sums.a += fabs(d);
    sums.b += pz * SignOf(d);
  });
  sums = row.Reduce(sums);
  const double l1 = sums.a, l1_coefficient = w * p.l1_weight;
  if (p.l1_weight > 0) row.Add(kL1Num, w * l1);
  row.Add(kLossNum, t.loss + l1_coefficient * l1 +
                        DSparkTeacherTerms(row, DSparkAcceptance(l1)));
  const R softmax = static_cast<R>(t.softmax);
  const R on_target = static_cast<R>(t.target);
  const R uniform = static_cast<R>(t.uniform / row.vocab());
  const R coefficient = static_cast<R>(l1_coefficient);
  const R signed_mass = sums.b;
  const int32_t target = row.target();
  // |sign - mass| <= 2.
  row.WriteGradient(
      [&](int64_t i, R zp, R tp) {
        const R pz = row.Softmax(zp);
        const R g = DSparkGradient(softmax, coefficient, signed_mass, uniform,
                                   pz, pz - row.TeacherSoftmax(tp));
        return i == target ? g - on_target : g;
      },
      bound + 2 * fabs(l1_coefficient));
}

// The softmax families (CE, label-smoothed; tv; the LK compositions;
// z-loss), and DSpark, which adds L1 and the confidence BCE where it reads
// a teacher.
template <typename Row>
DFLASH_ROW_PASS void SoftmaxFamilyPass(Row& row) {
  using R = typename Row::Real;
  const LossParams& p = row.loss();
  const double w = row.weight();
  // A row without a target class has no softmax-family terms (HasTarget).
  const SoftmaxRowTerms t =
      HasTarget(row.target())
          ? SoftmaxFamilyRow(p, w, CrossEntropyShare(p, row.share()),
                             row.neg_log_q(), row.lse(),
                             p.label_smoothing > 0 ? row.MeanLogit() : 0.0)
          : SoftmaxRowTerms{};
  row.Add(kCeNum, t.ce);
  row.Add(kTvNum, t.tv);
  if (p.family == LossFamily::kDSpark) {
    row.Add(kCePosition, row.mask() * t.ce / w);
  }
  // |softmax * p - target * onehot - uniform / V| with p <= 1.
  const double bound = fabs(t.softmax) + fabs(t.target) + fabs(t.uniform);
  if (p.family == LossFamily::kDSpark && row.has_teacher()) {
    DSparkPass(row, t, bound);
    return;
  }
  row.Add(kLossNum, t.loss);
  if (!HasTarget(row.target())) {
    row.WriteGradient([](int64_t, R, R) { return R{0}; }, 0.0);
    return;
  }
  row.WriteSoftmaxGradient(t.softmax, t.target, t.uniform, bound);
}

// D-PARD: credit * R, R = -2 log sum sqrt(q t), with the gradient credit *
// (q - sqrt(q t) / sum sqrt(q t)); CE reported, not trained.
template <typename Row>
DFLASH_ROW_PASS void DPardPass(Row& row) {
  using R = typename Row::Real;
  const double credit = row.share(), w = row.weight();
  // log sqrt(q t) at z' and t'.
  auto log_root = [&](R zp, R tp) {
    return static_cast<R>(0.5) *
           (row.LogSoftmax(zp) + row.TeacherLogSoftmax(tp));
  };
  const double log_total = row.LogSumExp(log_root);
  const double renyi = -2 * log_total;
  row.Add(kLossNum,
          credit * renyi + DSparkTeacherTerms(row, row.accept()));
  row.Add(kDPardNum, credit * renyi);
  row.Add(kDPardCredit, credit);
  // SpecForge reports D-PARD's CE too, without gradient.
  row.Add(kCeNum, w * row.neg_log_q());
  row.Add(kCePosition, row.mask() * row.neg_log_q());
  const R c = static_cast<R>(credit), total = static_cast<R>(log_total);
  // |q - normalised sqrt(q t)| <= 1.
  row.WriteGradient(
      [&](int64_t, R zp, R tp) {
        return c * RenyiGradient(row.Softmax(zp), log_root(zp, tp) - total);
      },
      credit);
}

// Distillation: the divergence of the tempered softmaxes, times w, and its
// gradient (d/dz' = w / T * d/du with u = z' / T).
template <typename Row>
DFLASH_ROW_PASS void DistillationPass(Row& row) {
  using R = typename Row::Real;
  const LossParams& p = row.loss();
  const Divergence divergence = p.divergence;
  const R beta = static_cast<R>(p.beta);
  const R log_beta = log(beta), log_rest = log1p(-beta);
  const R g = static_cast<R>(row.weight() * p.inv_temperature);
  auto at = [&](R zp, R tp) {
    return DistillationAt<R>(divergence, beta, log_beta, log_rest,
                             row.TemperedLogSoftmax(zp),
                             row.TeacherTemperedLogSoftmax(tp));
  };
  RowSums<R> sums;  // The divergence, and the JSD's summed student part.
  // Log-probability differences make no cheap bound.
  if (divergence == Divergence::kForwardKl) {
    // Its gradient reads no row sum: one pass.
    row.WriteGradient(
        [&](int64_t, R zp, R tp) {
          const DistillationPoint<R> point = at(zp, tp);
          sums.a += point.divergence;
          return g * point.forward_gradient;
        },
        HUGE_VAL);
    sums = row.Reduce(sums);
  } else {
    row.ForEach([&](int64_t, R zp, R tp) {
      const DistillationPoint<R> point = at(zp, tp);
      sums.a += point.divergence;
      sums.b += point.student_part;
    });
    sums = row.Reduce(sums);
    row.WriteGradient(
        [&](int64_t, R zp, R tp) {
          return DistillationGradientAt<R>(
              divergence, beta, log_beta, log_rest, row.TemperedLogSoftmax(zp),
              row.TeacherTemperedLogSoftmax(tp), sums.a, sums.b, g);
        },
        HUGE_VAL);
  }
  row.Add(kLossNum, row.weight() * sums.a);
}

// The loss pass of a row with weight, by family (Domino apart).
template <typename Row>
DFLASH_ROW_PASS void FamilyPass(Row& row) {
  const LossParams& p = row.loss();
  if (p.family == LossFamily::kDistillation) {
    DistillationPass(row);
  } else if (p.dpard) {
    DPardPass(row);
  } else {
    SoftmaxFamilyPass(row);
  }
}

// The block pass of the block-coupled families over one block of n rows:
// each row's loss weight (D-PACE's block weights times the row's
// DPaceRowScale, else row_weight(i)) and share (lk_lambda's CE share,
// D-PARD's credit over the rows' acceptance, else 1). q(i), accept(i),
// mask(i), row_weight(i) and scale(i) read row i.
template <typename Q, typename Accept, typename Mask, typename RowWeight,
          typename Scale>
DFLASH_HOST_DEVICE inline void CoupledBlockWeights(
    const LossParams& p, int64_t n, Q q, Accept accept, Mask mask,
    RowWeight row_weight, Scale scale, double* weight, double* share) {
  if (p.family == LossFamily::kDPace) {
    DPaceBlockWeights(p, n, q, mask, weight);
    for (int64_t i = 0; i < n; ++i) {
      weight[i] *= scale(i);
      share[i] = 1;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) weight[i] = row_weight(i);
  if (p.dpard) {
    DPaceBlockWeights(DPardCreditParams(p), n, accept, mask, share);
    return;
  }
  const double block_share = p.lk == LkMode::kLambdaBlock
                                 ? LkLambdaBlockShare(p, n, q, mask)
                                 : 1.0;
  for (int64_t i = 0; i < n; ++i) share[i] = block_share;
}

// Domino's per-row statistics of its final logits (base + correction from
// suffix_start) and its base logits, both transformed.
struct DominoRowStats {
  double neg_log_q = 0, base_neg_log_q = 0;
  int32_t argmax = 0, base_argmax = 0;
};

// Domino: CE of the final and the base logits mixed by lambda_base; the
// gradients d/d(base) = g_final + g_base and d/d(correction) = g_final (0
// before the suffix), g_final = (1 - lambda) w (softmax - onehot) of the
// final logits, g_base = lambda w (...) of the base logits.
template <typename Row>
DFLASH_ROW_PASS void DominoPass(Row& row) {
  DominoRowStats s;
  if (!row.DominoStats(s)) return;
  const LossParams& p = row.loss();
  const double m = row.mask(), w = row.weight(), lambda = p.lambda_base;
  const double q = exp(-s.neg_log_q);
  row.Add(kLossNum,
          (1 - lambda) * w * s.neg_log_q + lambda * w * s.base_neg_log_q);
  row.Add(kLossDen, w);
  row.Add(kCorrect, m > 0.5 && s.argmax == row.target() ? 1.0 : 0.0);
  row.Add(kBaseCorrect, m > 0.5 && s.base_argmax == row.target() ? 1.0 : 0.0);
  row.Add(kAccuracyDen, m);
  row.Add(kTargetProbability, m * q);
  row.Add(kCeNum, w * s.neg_log_q);
  row.Add(kBaseCeNum, w * s.base_neg_log_q);
  row.SetDominoOutputs(s, q);
  row.WriteDominoGradient((1 - lambda) * w, lambda * w);
}

}  // namespace dflash

#endif  // DFLASH_LOSSES_FAMILY_PASSES_H_
