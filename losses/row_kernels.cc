#include "losses/row_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace dflash {

template <typename T>
absl::StatusOr<RowStats> ComputeRowStats(absl::Span<const T> logits,
                                         int32_t target, int64_t row) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  if (vocab == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("row ", row, ": empty vocabulary"));
  }
  if (target < 0 || target >= vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row ", row, ": target id ", target, " is outside [0, ", vocab, ")"));
  }
  // Online logsumexp: rescale the running sum when the maximum moves.
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0;
  int32_t argmax = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const double x = logits[v];
    if (!std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", row, ": logit ", v, " is not finite (", x, ")"));
    }
    if (x > max) {
      sum = sum * std::exp(max - x) + 1.0;
      max = x;
      argmax = static_cast<int32_t>(v);
    } else {
      sum += std::exp(x - max);
    }
  }
  return RowStats{max + std::log(sum), static_cast<double>(logits[target]),
                  argmax};
}

template <typename T>
absl::Status TopK(absl::Span<const T> logits, int32_t k,
                  absl::Span<int32_t> indices) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  if (k < 1 || k > 64 || k > vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top-k: k must lie in [1, min(64, V = ", vocab, ")], got ", k));
  }
  if (static_cast<int64_t>(indices.size()) < k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top-k: indices holds ", indices.size(), " entries, need ", k));
  }
  // Insertion into a sorted list of k: strict ">" keeps the earlier index
  // ahead on ties.
  int32_t count = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const T x = logits[v];
    if (count == k && !(x > logits[indices[k - 1]])) continue;
    int32_t at = count < k ? count++ : k - 1;
    while (at > 0 && x > logits[indices[at - 1]]) {
      indices[at] = indices[at - 1];
      --at;
    }
    indices[at] = static_cast<int32_t>(v);
  }
  return absl::OkStatus();
}

template <typename T>
void WriteCrossEntropyGradient(absl::Span<T> logits, int32_t target,
                               double logsumexp, double scale) {
  for (T& x : logits) x = static_cast<T>(scale * std::exp(x - logsumexp));
  logits[target] = static_cast<T>(logits[target] - scale);
}

template absl::StatusOr<RowStats> ComputeRowStats<float>(
    absl::Span<const float>, int32_t, int64_t);
template absl::StatusOr<RowStats> ComputeRowStats<double>(
    absl::Span<const double>, int32_t, int64_t);
template absl::Status TopK<float>(absl::Span<const float>, int32_t,
                                  absl::Span<int32_t>);
template absl::Status TopK<double>(absl::Span<const double>, int32_t,
                                   absl::Span<int32_t>);
template void WriteCrossEntropyGradient<float>(absl::Span<float>, int32_t,
                                               double, double);
template void WriteCrossEntropyGradient<double>(absl::Span<double>, int32_t,
                                                double, double);

}  // namespace dflash
