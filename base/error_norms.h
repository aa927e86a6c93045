#ifndef DFLASH_BASE_ERROR_NORMS_H_
#define DFLASH_BASE_ERROR_NORMS_H_

// How far a computed vector (a gradient, a row of logits) is from its
// float64 reference, normwise, for the tests' tolerances: one definition
// for every suite.

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "absl/types/span.h"

namespace dflash {

// max |a - b| / max |b| (max |a - b| when b is all zero).
template <typename T>
double RelativeMaxError(absl::Span<const T> a, absl::Span<const double> b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size() && i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  if (a.size() != b.size()) return INFINITY;
  return scale > 0 ? diff / scale : diff;
}

// |a - b|_2 / |b|_2 (|a - b|_2 when b is all zero).
template <typename T>
double RelativeL2Error(absl::Span<const T> a, absl::Span<const double> b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    diff += d * d;
    norm += b[i] * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace dflash

#endif  // DFLASH_BASE_ERROR_NORMS_H_
