#ifndef DFLASH_BASE_BFLOAT16_H_
#define DFLASH_BASE_BFLOAT16_H_

// BFloat16, the bfloat16 storage type, with ToFloat and ToBFloat16 (round to
// nearest even) and FromFloat, host and device functions that the CPU code
// and the CUDA kernels share; and FromDouble / AsDouble for code and tests
// templated on the storage type (float, double or BFloat16).

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "base/host_device.h"

namespace dflash {

// bfloat16 storage: the top 16 bits of an IEEE float. Arithmetic happens in
// float; values are rounded to nearest-even once, when stored.
struct BFloat16 {
  uint16_t bits = 0;
};

// A float's bits and back, without aliasing.
DFLASH_HOST_DEVICE inline float FloatFromBits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

DFLASH_HOST_DEVICE inline uint32_t BitsOfFloat(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

DFLASH_HOST_DEVICE inline float ToFloat(BFloat16 x) {
  return FloatFromBits(static_cast<uint32_t>(x.bits) << 16);
}

DFLASH_HOST_DEVICE inline BFloat16 ToBFloat16(float f) {
  const uint32_t bits = BitsOfFloat(f);
  // Branch-free so that conversion loops vectorise; NaN stays a quiet NaN
  // rather than rounding up into infinity.
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return BFloat16{static_cast<uint16_t>(nan ? quiet_nan : rounded)};
}

// A float or BFloat16 read as float, and a float stored as T (float or
// BFloat16, rounded once): for kernels templated on the storage type.
DFLASH_HOST_DEVICE inline float ToFloat(float x) { return x; }
template <typename T>
DFLASH_HOST_DEVICE inline T FromFloat(float f) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return ToBFloat16(f);
  } else {
    return f;
  }
}

// `x` stored as T (float, double or BFloat16, rounded once), and a stored
// value read back, for code templated on the storage type.
template <typename T>
T FromDouble(double x) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return ToBFloat16(static_cast<float>(x));
  } else {
    return static_cast<T>(x);
  }
}
template <typename T>
double AsDouble(T x) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return ToFloat(x);
  } else {
    return static_cast<double>(x);
  }
}

// FromDouble and AsDouble of every value.
template <typename T>
std::vector<T> FromDoubles(const std::vector<double>& values) {
  std::vector<T> out;
  out.reserve(values.size());
  for (double x : values) out.push_back(FromDouble<T>(x));
  return out;
}
template <typename T>
std::vector<double> AsDoubles(const std::vector<T>& values) {
  std::vector<double> out;
  out.reserve(values.size());
  for (const T& x : values) out.push_back(AsDouble(x));
  return out;
}

}  // namespace dflash

#endif  // DFLASH_BASE_BFLOAT16_H_
