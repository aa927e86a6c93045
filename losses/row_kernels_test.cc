#include "losses/row_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;

// Reference: logsumexp with long double and an explicit max shift.
double NaiveLogSumExp(const std::vector<double>& x) {
  const double max = *std::max_element(x.begin(), x.end());
  long double sum = 0;
  for (double v : x) sum += std::exp(static_cast<long double>(v - max));
  return max + static_cast<double>(std::log(sum));
}

std::vector<int32_t> SortTopK(const std::vector<double>& x, int k) {
  std::vector<int32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return x[a] > x[b]; });
  order.resize(k);
  return order;
}

TEST(RowKernelsTest, StatsMatchNaiveReference) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> uniform(-5, 5);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> x(1 + trial * 37);
    for (double& v : x) v = uniform(rng);
    const int32_t target = static_cast<int32_t>(x.size() / 2);
    auto stats = ComputeRowStats<double>(x, target, trial);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_NEAR(stats->logsumexp, NaiveLogSumExp(x), 1e-12);
    EXPECT_EQ(stats->target_logit, x[target]);
    EXPECT_EQ(stats->argmax, SortTopK(x, 1)[0]);
  }
}

TEST(RowKernelsTest, FloatStatsMatchFloat64) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> uniform(-30, 30);
  for (int64_t vocab : {1, 15, 16, 17, 1000, 32768}) {
    std::vector<float> x(vocab);
    for (float& v : x) v = uniform(rng);
    const std::vector<double> x64(x.begin(), x.end());
    auto f32 = ComputeRowStats<float>(x, 0, 0);
    ASSERT_TRUE(f32.ok());
    EXPECT_NEAR(f32->logsumexp, NaiveLogSumExp(x64),
                1e-6 * std::abs(NaiveLogSumExp(x64)) + 1e-6);
    EXPECT_EQ(f32->argmax, SortTopK(x64, 1)[0]);
  }
}

TEST(RowKernelsTest, ExtremeLogitsStayFinite) {
  std::vector<float> x(262144, -1e4f);
  x[5] = 1e4f;
  x[77] = 1e4f - 1;
  auto stats = ComputeRowStats<float>(x, 77, 0);
  ASSERT_TRUE(stats.ok()) << stats.status();
  // Float accumulation: 1e-7 relative in the sum, so 1e-6 in the lse.
  EXPECT_NEAR(stats->logsumexp, 1e4 + std::log1p(std::exp(-1.0)), 1e-6);
  EXPECT_EQ(stats->argmax, 5);
  std::vector<float> grad = x;
  WriteSoftmaxGradient<float>(absl::MakeSpan(grad), 77, *stats, {1, 1, 0});
  for (float g : grad) ASSERT_TRUE(std::isfinite(g));
  EXPECT_NEAR(grad[5], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(grad[77], std::exp(-1.0) / (1 + std::exp(-1.0)) - 1, 1e-6);
}

TEST(RowKernelsTest, ArgmaxAndTopKTiesGoToLowestIndex) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> few(0, 4);  // Many ties.
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> x(13 + trial);
    for (double& v : x) v = few(rng);
    auto stats = ComputeRowStats<double>(x, 0, trial);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->argmax, SortTopK(x, 1)[0]);
    for (int k : {1, 5, 13}) {
      std::vector<int32_t> got(k);
      ASSERT_TRUE(TopK<double>(x, k, absl::MakeSpan(got)).ok());
      EXPECT_EQ(got, SortTopK(x, k)) << "trial " << trial << " k " << k;
    }
  }
  // Long rows take the span-skipping path: ties and risers anywhere, also
  // across span boundaries and in the tail.
  std::uniform_real_distribution<double> wide(-3, 3);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> x(1000 + 37 * trial);
    for (double& v : x) v = trial % 2 ? few(rng) : std::round(wide(rng) * 4);
    for (int k : {1, 16, 64}) {
      std::vector<int32_t> got(k);
      ASSERT_TRUE(TopK<double>(x, k, absl::MakeSpan(got)).ok());
      EXPECT_EQ(got, SortTopK(x, k)) << "long trial " << trial << " k " << k;
      const std::vector<float> xf(x.begin(), x.end());
      ASSERT_TRUE(TopK<float>(xf, k, absl::MakeSpan(got)).ok());
      EXPECT_EQ(got, SortTopK(x, k)) << "long float trial " << trial;
    }
  }
  std::vector<float> flat(100, 2.0f);
  std::vector<int32_t> top(64);
  ASSERT_TRUE(TopK<float>(flat, 64, absl::MakeSpan(top)).ok());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(top[i], i);
}

TEST(RowKernelsTest, GradientIsSoftmaxOneHotAndUniformParts) {
  const std::vector<double> x = {0.5, -1.0, 2.0, 0.0};
  const double lse = NaiveLogSumExp(x);
  std::vector<double> grad = x;
  WriteSoftmaxGradient<double>(absl::MakeSpan(grad), 2,
                               RowStats{2.0, lse, 2.0, 2}, {0.5, 0.25, 0.2});
  for (int v = 0; v < 4; ++v) {
    EXPECT_NEAR(grad[v], 0.5 * std::exp(x[v] - lse) - 0.25 * (v == 2) - 0.05,
                1e-15);
  }
  std::vector<float> grad32(x.begin(), x.end());
  WriteSoftmaxGradient<float>(absl::MakeSpan(grad32), 2,
                              RowStats{2.0, lse, 2.0, 2}, {0.5, 0.25, 0.2});
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(grad32[v], grad[v], 1e-6);
}

TEST(RowKernelsTest, KeepExpPathMatchesTheTwoExponentialPath) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> uniform(-20, 20);
  for (int64_t vocab : {1, 15, 16, 17, 63, 64, 65, 1000, 32768}) {
    std::vector<float> x(vocab);
    for (float& v : x) v = uniform(rng);
    const int32_t target = static_cast<int32_t>(vocab / 3);
    auto plain = ComputeRowStats<float>(x, target, 0);
    std::vector<float> exps = x;
    auto kept = ComputeRowStatsKeepExp(absl::MakeSpan(exps), target, 0);
    ASSERT_TRUE(plain.ok() && kept.ok());
    EXPECT_EQ(kept->logsumexp, plain->logsumexp);
    EXPECT_EQ(kept->target_logit, plain->target_logit);
    EXPECT_EQ(kept->argmax, plain->argmax);
    const SoftmaxGradient grad{0.7, 0.6, 0.1};
    std::vector<float> expected = x;
    WriteSoftmaxGradient<float>(absl::MakeSpan(expected), target, *plain, grad);
    WriteSoftmaxGradientFromExp(absl::MakeSpan(exps), target, *kept, grad);
    for (int64_t v = 0; v < vocab; ++v) {
      ASSERT_NEAR(exps[v], expected[v], 1e-6 * std::abs(expected[v]) + 1e-9)
          << "V " << vocab << " v " << v;
    }
  }
}

TEST(RowKernelsTest, BadInputsAreErrors) {
  std::vector<double> x = {1, 2, std::numeric_limits<double>::quiet_NaN()};
  EXPECT_EQ(ComputeRowStats<double>(x, 0, 42).status().message(),
            "row 42: logit 2 is not finite (nan)");
  x[2] = std::numeric_limits<double>::infinity();
  EXPECT_THAT(std::string(ComputeRowStats<double>(x, 0, 1).status().message()),
              HasSubstr("logit 2 is not finite (inf)"));
  std::vector<float> xf = {1, 2, 3, -std::numeric_limits<float>::infinity()};
  EXPECT_EQ(ComputeRowStats<float>(xf, 0, 9).status().message(),
            "row 9: logit 3 is not finite (-inf)");
  std::vector<double> ok = {1, 2, 3};
  EXPECT_EQ(ComputeRowStats<double>(ok, 3, 7).status().message(),
            "row 7: target id 3 is outside [0, 3)");
  EXPECT_EQ(ComputeRowStats<double>(ok, -1, 7).status().message(),
            "row 7: target id -1 is outside [0, 3)");
  EXPECT_EQ(ComputeRowStats<double>({}, 0, 0).status().message(),
            "row 0: empty vocabulary");
  std::vector<int32_t> out(8);
  EXPECT_EQ(TopK<double>(ok, 4, absl::MakeSpan(out)).message(),
            "top-k: k must lie in [1, min(64, V = 3)], got 4");
  EXPECT_EQ(TopK<double>(ok, 0, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TopK<double>(ok, 2, absl::MakeSpan(out).subspan(0, 1)).message(),
            "top-k: indices holds 1 entries, need 2");
}

}  // namespace
}  // namespace dflash
