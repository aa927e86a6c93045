#include "base/checked_math.h"

#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace dflash {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(CheckedMathTest, FitsOrNullopt) {
  EXPECT_EQ(CheckedMul(1 << 20, 1 << 20), int64_t{1} << 40);
  EXPECT_EQ(CheckedMul(int64_t{1} << 32, int64_t{1} << 31), std::nullopt);
  EXPECT_EQ(CheckedAdd(kMax - 1, 1), kMax);
  EXPECT_EQ(CheckedAdd(kMax, 1), std::nullopt);
  EXPECT_EQ(CheckedSum({1, 2, kMax - 3}), kMax);
  EXPECT_EQ(CheckedSum({1, 2, kMax - 2}), std::nullopt);
}

// (2^32, 2^32, 4, 16): each extent is modest, the product is 2^70.
TEST(CheckedMathTest, ProductOfModestExtentsCanOverflow) {
  const int64_t shape[] = {int64_t{1} << 32, int64_t{1} << 32, 4, 16};
  EXPECT_EQ(CheckedProduct(shape), std::nullopt);
  EXPECT_EQ(CheckedProduct({int64_t{1} << 32, 4, 16}), int64_t{1} << 38);
  EXPECT_EQ(CheckedProduct({}), 1);
  EXPECT_EQ(CheckedProduct({3, 0, kMax}), 0);
}

}  // namespace
}  // namespace dflash
