#include "losses/row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/cpu_dispatch.h"
#include "base/status_macros.h"
#include "losses/row_error.h"

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

// First index of `max` in x: a vectorisable any-equal test per 64 values,
// then a scalar scan inside the first block that has it.
DFLASH_CPU_DISPATCH
int32_t FirstIndexOf(const float* x, int64_t vocab, float max) {
  constexpr int64_t kBlock = 64;
  int64_t start = 0;
  for (; start + kBlock <= vocab; start += kBlock) {
    int hit = 0;
    for (int64_t v = start; v < start + kBlock; ++v) hit |= x[v] == max;
    if (hit) break;
  }
  while (x[start] != max) ++start;
  return static_cast<int32_t>(start);
}

// Float rows: max and a finiteness check in one vectorised pass, sum of
// exponentials in another (kLanes float partial sums, added in double).
// With kKeepExp, the second pass also stores exp(x - max) over x.
template <bool kKeepExp>
DFLASH_CPU_DISPATCH absl::StatusOr<RowStats> FloatRowStats(
    std::conditional_t<kKeepExp, float*, const float*> x, int64_t vocab,
    int32_t target, int64_t row) {
  // Max and finiteness flags on GCC/Clang vector types: neither compiler
  // vectorises a float max reduction by itself without -ffast-math.
  using Floats = float __attribute__((vector_size(32)));
  using Ints = int32_t __attribute__((vector_size(32)));
  constexpr int kWidth = sizeof(Floats) / sizeof(float);
  const float lowest = -std::numeric_limits<float>::infinity();
  Floats max0 = lowest - Floats{}, max1 = max0;
  Ints bad0 = {}, bad1 = {};
  int64_t v = 0;
  for (; v + 2 * kWidth <= vocab; v += 2 * kWidth) {
    Floats a, b;
    std::memcpy(&a, x + v, sizeof(a));
    std::memcpy(&b, x + v + kWidth, sizeof(b));
    max0 = a > max0 ? a : max0;
    max1 = b > max1 ? b : max1;
    bad0 |= (a - a) != 0;  // NaN for inf and NaN.
    bad1 |= (b - b) != 0;
  }
  float max = lowest;
  int32_t bad = 0;
  for (; v < vocab; ++v) {
    max = std::max(max, x[v]);
    bad |= !(x[v] - x[v] == 0.0f);
  }
  for (int l = 0; l < kWidth; ++l) {
    max = std::max({max, max0[l], max1[l]});
    bad |= bad0[l] | bad1[l];
  }
  if (bad) {
    for (int64_t v = 0; v < vocab; ++v) {
      if (!std::isfinite(x[v])) {
        return RowError(row,
                        absl::StrCat("logit ", v, " is not finite (", x[v], ")"));
      }
    }
  }
  const int32_t argmax = FirstIndexOf(x, vocab, max);
  const double target_logit = x[target];
  float lanes[kLanes] = {};
  double sum = 0;
  v = 0;
  if constexpr (kKeepExp) {
    for (; v + kLanes <= vocab; v += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        x[v + l] = ExpNonPositive(x[v + l] - max);
        lanes[l] += x[v + l];
      }
    }
    for (; v < vocab; ++v) {
      x[v] = ExpNonPositive(x[v] - max);
      sum += x[v];
    }
  } else {
    for (; v + kLanes <= vocab; v += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        lanes[l] += ExpNonPositive(x[v + l] - max);
      }
    }
    for (; v < vocab; ++v) sum += ExpNonPositive(x[v] - max);
  }
  for (float lane : lanes) sum += lane;
  return RowStats{max, max + std::log(sum), target_logit, argmax};
}

absl::Status CheckRow(int64_t vocab, int32_t target, int64_t row) {
  if (vocab == 0) {
    return RowError(row, "empty vocabulary");
  }
  if (target < 0 || target >= vocab) {
    return RowError(row, absl::StrCat("target id ", target, " is outside [0, ",
                                      vocab, ")"));
  }
  return absl::OkStatus();
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
      return RowError(row,
                      absl::StrCat("logit ", v, " is not finite (", x, ")"));
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
  DFLASH_RETURN_IF_ERROR(CheckRow(vocab, target, row));
  if constexpr (std::is_same_v<T, float>) {
    return FloatRowStats<false>(logits.data(), vocab, target, row);
  } else {
    return DoubleRowStats(logits, target, row);
  }
}

absl::StatusOr<RowStats> ComputeRowStatsKeepExp(absl::Span<float> logits,
                                                int32_t target, int64_t row) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  DFLASH_RETURN_IF_ERROR(CheckRow(vocab, target, row));
  return FloatRowStats<true>(logits.data(), vocab, target, row);
}

DFLASH_CPU_DISPATCH
void WriteSoftmaxGradientFromExp(absl::Span<float> exps, int32_t target,
                                 const RowStats& stats,
                                 const SoftmaxGradient& grad) {
  // p = exp(x - max) / exp(lse - max).
  const float s = static_cast<float>(
      grad.softmax * std::exp(stats.max_logit - stats.logsumexp));
  const float u =
      static_cast<float>(grad.uniform / static_cast<double>(exps.size()));
  for (float& e : exps) e = s * e - u;
  exps[target] = static_cast<float>(exps[target] - grad.target);
}

namespace {

// max(x[0, count)); a NaN is not propagated (the stats pass reports it).
template <typename T>
DFLASH_CPU_DISPATCH T SpanMax(const T* __restrict x, int64_t count) {
  T max = x[0];
  for (int64_t i = 1; i < count; ++i) max = x[i] > max ? x[i] : max;
  return max;
}

// The float one on vector types, as FloatRowStats's maximum: compilers do
// not vectorise a float max reduction by themselves, and top-k runs this
// over every 64 logits of a row.
template <>
DFLASH_CPU_DISPATCH float SpanMax<float>(const float* __restrict x,
                                         int64_t count) {
  using Floats = float __attribute__((vector_size(32)));
  constexpr int kWidth = sizeof(Floats) / sizeof(float);
  float max = x[0];
  int64_t i = 0;
  if (count >= kWidth) {
    Floats m;
    std::memcpy(&m, x, sizeof(m));
    for (i = kWidth; i + kWidth <= count; i += kWidth) {
      Floats a;
      std::memcpy(&a, x + i, sizeof(a));
      m = a > m ? a : m;
    }
    for (int l = 0; l < kWidth; ++l) max = m[l] > max ? m[l] : max;
  }
  for (; i < count; ++i) max = x[i] > max ? x[i] : max;
  return max;
}

}  // namespace

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
  // ahead on ties. Once the list is full, whole spans of kSpan logits none
  // of which beats its last entry are skipped after a vectorised maximum.
  constexpr int64_t kSpan = 64;
  int32_t count = 0;
  T last = T(0);  // logits[indices[k - 1]] once count == k.
  auto insert = [&](int64_t v) {
    const T x = logits[v];
    if (count == k && !(x > last)) return;
    int32_t at = count < k ? count++ : k - 1;
    while (at > 0 && x > logits[indices[at - 1]]) {
      indices[at] = indices[at - 1];
      --at;
    }
    indices[at] = static_cast<int32_t>(v);
    if (count == k) last = logits[indices[k - 1]];
  };
  int64_t v = 0;
  for (; v < vocab && count < k; ++v) insert(v);
  for (; v + kSpan <= vocab; v += kSpan) {
    if (!(SpanMax(logits.data() + v, kSpan) > last)) continue;
    for (int64_t i = v; i < v + kSpan; ++i) insert(i);
  }
  for (; v < vocab; ++v) insert(v);
  return absl::OkStatus();
}

template <typename T>
DFLASH_CPU_DISPATCH void WriteSoftmaxGradient(absl::Span<T> logits,
                                              int32_t target,
                                              const RowStats& stats,
                                              const SoftmaxGradient& grad) {
  const double uniform = grad.uniform / static_cast<double>(logits.size());
  if constexpr (std::is_same_v<T, float>) {
    // x - max is exact in float; lse - max is small, so nothing large is
    // rounded away even when |logits| ~ 1e4.
    const float max = static_cast<float>(stats.max_logit);
    const float shift = static_cast<float>(stats.logsumexp - stats.max_logit);
    const float s = static_cast<float>(grad.softmax);
    const float u = static_cast<float>(uniform);
    for (float& x : logits) x = s * ExpNonPositive((x - max) - shift) - u;
  } else {
    for (T& x : logits) {
      x = static_cast<T>(grad.softmax * std::exp(x - stats.logsumexp) -
                         uniform);
    }
  }
  logits[target] = static_cast<T>(logits[target] - grad.target);
}

template absl::StatusOr<RowStats> ComputeRowStats<float>(
    absl::Span<const float>, int32_t, int64_t);
template absl::StatusOr<RowStats> ComputeRowStats<double>(
    absl::Span<const double>, int32_t, int64_t);
template absl::Status TopK<float>(absl::Span<const float>, int32_t,
                                  absl::Span<int32_t>);
template absl::Status TopK<double>(absl::Span<const double>, int32_t,
                                   absl::Span<int32_t>);
template void WriteSoftmaxGradient<float>(absl::Span<float>, int32_t,
                                          const RowStats&,
                                          const SoftmaxGradient&);
template void WriteSoftmaxGradient<double>(absl::Span<double>, int32_t,
                                           const RowStats&,
                                           const SoftmaxGradient&);

}  // namespace dflash
