#include "base/bfloat16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace dflash {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

TEST(BFloat16Test, ExactValuesRoundTrip) {
  for (float x : {0.0f, -0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f, 3.0e38f}) {
    const float bf = ToFloat(ToBFloat16(x));
    EXPECT_LE(std::abs(bf - x), std::abs(x) * (1.0f / 256)) << x;
    EXPECT_EQ(ToFloat(ToBFloat16(bf)), bf) << x;
  }
  EXPECT_EQ(ToFloat(ToBFloat16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(ToFloat(ToBFloat16(std::nanf("")))));
}

TEST(BFloat16Test, RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even 1.
  EXPECT_EQ(ToFloat(ToBFloat16(FromBits(0x3f808000u))), 1.0f);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
  EXPECT_EQ(ToFloat(ToBFloat16(FromBits(0x3f818000u))), 1.0f + 1.0f / 64);
  // Just above the halfway point rounds up.
  EXPECT_EQ(ToFloat(ToBFloat16(FromBits(0x3f808001u))), 1.0f + 1.0f / 128);
  // A NaN whose payload sits in the low bits stays NaN instead of becoming
  // infinity.
  EXPECT_TRUE(std::isnan(ToFloat(ToBFloat16(FromBits(0x7f800001u)))));
}

}  // namespace
}  // namespace dflash
