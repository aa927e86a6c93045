#ifndef DFLASH_BASE_CHECKED_MATH_H_
#define DFLASH_BASE_CHECKED_MATH_H_

// Sizes computed from untrusted extents (file headers, flags): each product
// or sum is nullopt when it does not fit int64, so callers refuse the input
// before allocating instead of wrapping around.

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "absl/types/span.h"

namespace dflash {

inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The product of `factors`; nullopt on overflow.
inline std::optional<int64_t> CheckedProduct(
    absl::Span<const int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

inline std::optional<int64_t> CheckedProduct(
    std::initializer_list<int64_t> factors) {
  return CheckedProduct(
      absl::Span<const int64_t>(factors.begin(), factors.size()));
}

// The sum of `terms`; nullopt on overflow.
inline std::optional<int64_t> CheckedSum(std::initializer_list<int64_t> terms) {
  int64_t out = 0;
  for (int64_t t : terms) {
    if (__builtin_add_overflow(out, t, &out)) return std::nullopt;
  }
  return out;
}

}  // namespace dflash

#endif  // DFLASH_BASE_CHECKED_MATH_H_
