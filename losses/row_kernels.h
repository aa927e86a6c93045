#ifndef DFLASH_LOSSES_ROW_KERNELS_H_
#define DFLASH_LOSSES_ROW_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dflash {

// What one pass over a row of logits yields.
struct RowStats {
  double max_logit = 0;
  double logsumexp = 0;
  double target_logit = 0;
  int32_t argmax = 0;  // First index of the maximum.
};

// One fused pass over `logits` (float or double; accumulation in double):
// online max-subtracted logsumexp, target logit, first-index argmax. A
// non-finite logit or a target outside [0, V) is an error naming `row`.
template <typename T>
absl::StatusOr<RowStats> ComputeRowStats(absl::Span<const T> logits,
                                         int32_t target, int64_t row);

// ComputeRowStats for a float row that also leaves exp(logit - max) in
// place, so that WriteSoftmaxGradientFromExp needs no second exponential.
absl::StatusOr<RowStats> ComputeRowStatsKeepExp(absl::Span<float> logits,
                                                int32_t target, int64_t row);

// The k largest logits' indices, largest first; equal logits go to the lower
// index. 1 <= k <= min(64, V).
template <typename T>
absl::Status TopK(absl::Span<const T> logits, int32_t k,
                  absl::Span<int32_t> indices);

// The gradient of a row loss that depends on the logits z only through
// softmax p, the target and the mean logit: softmax * p - target * onehot -
// uniform / V. Cross-entropy with label smoothing eps and weight c is
// {c, c * (1 - eps), c * eps}; tv's (1 - q) * c is {c * q, c * q, 0}; the
// z-loss c * lse^2 is {2 * c * lse, 0, 0}; sums of these add.
struct SoftmaxGradient {
  double softmax = 0;
  double target = 0;
  double uniform = 0;
};

// Overwrites `logits` with their SoftmaxGradient, given the row's stats.
template <typename T>
void WriteSoftmaxGradient(absl::Span<T> logits, int32_t target,
                          const RowStats& stats, const SoftmaxGradient& grad);

// WriteSoftmaxGradient over the exponentials ComputeRowStatsKeepExp left.
void WriteSoftmaxGradientFromExp(absl::Span<float> exps, int32_t target,
                                 const RowStats& stats,
                                 const SoftmaxGradient& grad);

}  // namespace dflash

#endif  // DFLASH_LOSSES_ROW_KERNELS_H_
