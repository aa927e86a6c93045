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

// The k largest logits' indices, largest first; equal logits go to the lower
// index. 1 <= k <= min(64, V).
template <typename T>
absl::Status TopK(absl::Span<const T> logits, int32_t k,
                  absl::Span<int32_t> indices);

// Overwrites `logits` with scale * (softmax(logits) - onehot(target)), the
// gradient of scale * neg_log_q, given the row's stats.
template <typename T>
void WriteCrossEntropyGradient(absl::Span<T> logits, int32_t target,
                               const RowStats& stats, double scale);

}  // namespace dflash

#endif  // DFLASH_LOSSES_ROW_KERNELS_H_
