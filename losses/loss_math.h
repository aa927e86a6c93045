#ifndef DFLASH_LOSSES_LOSS_MATH_H_
#define DFLASH_LOSSES_LOSS_MATH_H_

// The per-row scalar formulas of the DFlash-family losses, as host/device
// inline functions that the CPU loss (chunk_loss.cc) and the CUDA kernels
// (cuda_row_kernels.cu) both call, so each is written once
// (docs/semantics.md sections 3 to 5). Templated on the type they compute
// in where the backends differ (float rows on the GPU, double on the CPU).

#include <cmath>

#include "base/host_device.h"

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

// z' = softcap * tanh(scale * z / softcap), or scale * z without a softcap
// (cap 0), and the chain rule d/dz from d/dz' given z'.
template <typename R>
DFLASH_HOST_DEVICE inline R TransformLogit(R z, R scale, R cap) {
  return cap > 0 ? cap * tanh(scale * z / cap) : scale * z;
}
template <typename R>
DFLASH_HOST_DEVICE inline R ChainTransformedLogit(R grad, R transformed,
                                                  R scale, R cap) {
  if (cap > 0) {
    const R t = transformed / cap;
    return grad * scale * (1 - t * t);
  }
  return grad * scale;
}

}  // namespace dflash

#endif  // DFLASH_LOSSES_LOSS_MATH_H_
