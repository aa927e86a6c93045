#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "heads/cpu_projection.h"
#include "heads/row_compaction.h"

namespace dflash {
namespace {

constexpr int64_t kV = 7, kH = 5, kM = 3;

std::vector<double> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(-1, 1);
  std::vector<double> out(n);
  for (double& x : out) x = uniform(rng);
  return out;
}

TEST(ProjectionTest, ThreeProductsMatchNaiveLoops) {
  const std::vector<double> w = Random(kV * kH, 1), b = Random(kV, 2);
  const std::vector<double> x = Random(kM * kH, 3), d = Random(kM * kV, 4);
  auto projection = CreateCpuProjection<double>(w, b, kV, kH);
  ASSERT_TRUE(projection.ok()) << projection.status();
  std::vector<double> logits(kM * kV), grad_x(kM * kH);
  std::vector<double> grad_w(kV * kH, 1.0), grad_b(kV, 1.0);  // Accumulated.
  (*projection)->Forward(x.data(), kM, logits.data());
  (*projection)->InputGradient(d.data(), kM, grad_x.data());
  (*projection)->AccumulateWeightGradient(d.data(), x.data(), kM, grad_w.data(),
                                          grad_b.data());
  for (int64_t r = 0; r < kM; ++r) {
    for (int64_t v = 0; v < kV; ++v) {
      double expected = b[v];
      for (int64_t h = 0; h < kH; ++h) expected += x[r * kH + h] * w[v * kH + h];
      EXPECT_NEAR(logits[r * kV + v], expected, 1e-14);
    }
    for (int64_t h = 0; h < kH; ++h) {
      double expected = 0;
      for (int64_t v = 0; v < kV; ++v) expected += d[r * kV + v] * w[v * kH + h];
      EXPECT_NEAR(grad_x[r * kH + h], expected, 1e-14);
    }
  }
  for (int64_t v = 0; v < kV; ++v) {
    double bias = 1.0;
    for (int64_t r = 0; r < kM; ++r) bias += d[r * kV + v];
    EXPECT_NEAR(grad_b[v], bias, 1e-14);
    for (int64_t h = 0; h < kH; ++h) {
      double expected = 1.0;
      for (int64_t r = 0; r < kM; ++r) expected += d[r * kV + v] * x[r * kH + h];
      EXPECT_NEAR(grad_w[v * kH + h], expected, 1e-14);
    }
  }
  EXPECT_EQ((*projection)->gemms().calls, 3);
  EXPECT_EQ((*projection)->gemms().flops, 3 * 2.0 * kM * kV * kH);
}

TEST(ProjectionTest, FloatMatchesDouble) {
  const std::vector<double> w = Random(kV * kH, 5), x = Random(kM * kH, 6);
  const std::vector<float> w32(w.begin(), w.end()), x32(x.begin(), x.end());
  auto p64 = CreateCpuProjection<double>(w, {}, kV, kH);
  auto p32 = CreateCpuProjection<float>(w32, {}, kV, kH);
  ASSERT_TRUE(p64.ok() && p32.ok());
  std::vector<double> l64(kM * kV);
  std::vector<float> l32(kM * kV);
  (*p64)->Forward(x.data(), kM, l64.data());
  (*p32)->Forward(x32.data(), kM, l32.data());
  for (int64_t i = 0; i < kM * kV; ++i) EXPECT_NEAR(l32[i], l64[i], 1e-6);
}

TEST(ProjectionTest, BadShapesAreErrors) {
  const std::vector<double> w(kV * kH), b(kV - 1);
  EXPECT_EQ(CreateCpuProjection<double>(w, {}, kV, kH + 1).status().message(),
            "projection: weight must hold vocab x hidden = 7 x 6 values, got "
            "35");
  EXPECT_EQ(CreateCpuProjection<double>(w, b, kV, kH).status().message(),
            "projection: bias must hold vocab = 7 values or none, got 6");
  EXPECT_EQ(CreateCpuProjection<double>(w, {}, 0, kH).status().message(),
            "projection: vocab and hidden must lie in [1, 2^31), got 0 and 5");
}

TEST(FlattenTest, WeightedRowsGatherAndScatter) {
  const std::vector<RowMeta> rows = {
      {1, 0, 0.0f}, {2, 1, 1.0f}, {-100, 2, 1.0f}, {3, 3, 0.5f}};
  LossParams loss;
  loss.ignore_index = -100;
  const std::vector<int64_t> weighted = WeightedRows(rows, loss);
  EXPECT_EQ(weighted, (std::vector<int64_t>{1, 3}));
  // Under ignored_target_weight COUNT a -100 target with weight is kept.
  loss.count_ignored = true;
  EXPECT_EQ(WeightedRows(rows, loss), (std::vector<int64_t>{1, 2, 3}));
  const std::vector<int> src = {0, 1, 10, 11, 20, 21, 30, 31};
  std::vector<int> packed(4), back(8, -1);
  GatherRows(src.data(), 2, weighted, packed.data());
  EXPECT_EQ(packed, (std::vector<int>{10, 11, 30, 31}));
  ScatterRows(packed.data(), 2, weighted, back.data());
  EXPECT_EQ(back, (std::vector<int>{-1, -1, 10, 11, -1, -1, 30, 31}));
}

}  // namespace
}  // namespace dflash
