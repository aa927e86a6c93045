#include "losses/row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace dflash {
namespace {

// exp(x) for x <= 0 in float, written so the compiler vectorises it (no
// libm call, no branches): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
// and a degree-7 Taylor polynomial for exp(r); about 2 ulp. Inputs are
// clamped at -87 (exp = 1.6e-38, below any softmax term that matters).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  // Round to nearest by adding and removing 1.5 * 2^23 (vectorises, unlike
  // nearbyint).
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr int kLanes = 16;

// Float rows: max and a finiteness check in one vectorised pass, sum of
// exponentials in another (kLanes float partial sums, added in double).
absl::StatusOr<RowStats> FloatRowStats(absl::Span<const float> logits,
                                       int32_t target, int64_t row) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const float* x = logits.data();
  float max = -std::numeric_limits<float>::infinity();
  int bad = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    max = std::max(max, x[v]);
    bad |= !(x[v] - x[v] == 0.0f);  // NaN for inf and NaN.
  }
  if (bad) {
    for (int64_t v = 0; v < vocab; ++v) {
      if (!std::isfinite(x[v])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row ", row, ": logit ", v, " is not finite (", x[v], ")"));
      }
    }
  }
  int32_t argmax = 0;
  while (x[argmax] != max) ++argmax;
  float lanes[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += ExpNonPositive(x[v + l] - max);
  }
  double sum = 0;
  for (; v < vocab; ++v) sum += ExpNonPositive(x[v] - max);
  for (float lane : lanes) sum += lane;
  return RowStats{max, max + std::log(sum), static_cast<double>(x[target]),
                  argmax};
}

// Double rows: online logsumexp, rescaling the running sum when the maximum
// moves; the float64 reference path.
absl::StatusOr<RowStats> DoubleRowStats(absl::Span<const double> logits,
                                        int32_t target, int64_t row) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
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
  return RowStats{max, max + std::log(sum), static_cast<double>(logits[target]),
                  argmax};
}

}  // namespace

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
  if constexpr (std::is_same_v<T, float>) {
    return FloatRowStats(logits, target, row);
  } else {
    return DoubleRowStats(logits, target, row);
  }
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
                               const RowStats& stats, double scale) {
  if constexpr (std::is_same_v<T, float>) {
    // x - max is exact in float; lse - max is small, so nothing large is
    // rounded away even when |logits| ~ 1e4.
    const float max = static_cast<float>(stats.max_logit);
    const float shift = static_cast<float>(stats.logsumexp - stats.max_logit);
    const float s = static_cast<float>(scale);
    for (float& x : logits) x = s * ExpNonPositive((x - max) - shift);
  } else {
    for (T& x : logits) {
      x = static_cast<T>(scale * std::exp(x - stats.logsumexp));
    }
  }
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
                                               const RowStats&, double);
template void WriteCrossEntropyGradient<double>(absl::Span<double>, int32_t,
                                                const RowStats&, double);

}  // namespace dflash
