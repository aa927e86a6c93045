#include "losses/top_k_cursor.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dflash {
namespace {

// The kernel's algorithm with its threads in turn: thread t owns elements
// t, t + threads, ...; each pick is the best head, whose owner pops.
template <int kCapacity>
std::vector<int32_t> CursorTopK(const std::vector<float>& row, int threads,
                                int k) {
  std::vector<TopKCursor<kCapacity>> cursors(threads);
  auto scan_of = [&](int t) {
    return [&row, threads, t](auto offer) {
      for (size_t i = t; i < row.size(); i += threads) {
        offer(Candidate{row[i], static_cast<int32_t>(i)});
      }
    };
  };
  for (int t = 0; t < threads; ++t) cursors[t].Fill(scan_of(t));
  std::vector<int32_t> picked;
  for (int j = 0; j < k; ++j) {
    Candidate best = NoCandidate();
    int owner = -1;
    for (int t = 0; t < threads; ++t) {
      if (cursors[t].HasHead() && Precedes(cursors[t].Head(), best)) {
        best = cursors[t].Head();
        owner = t;
      }
    }
    if (owner < 0) break;
    picked.push_back(best.index);
    cursors[owner].Pop(scan_of(owner));
  }
  return picked;
}

// The reference: a stable sort by value, largest first, NaNs left out.
std::vector<int32_t> SortedTopK(const std::vector<float>& row, int k) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < row.size(); ++i) {
    if (!std::isnan(row[i])) ids.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  ids.resize(std::min<size_t>(ids.size(), k));
  return ids;
}

std::vector<float> Row(int kind, int n, std::mt19937& rng) {
  std::vector<float> row(n);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(0, 2);
  for (float& x : row) {
    switch (kind) {
      case 0:  // Distinct values.
        x = normal(rng);
        break;
      case 1:  // Heavily tied: three values.
        x = static_cast<float>(level(rng));
        break;
      default:  // All equal.
        x = 1.0f;
    }
  }
  return row;
}

template <int kCapacity>
void CheckAgainstSort(int threads) {
  std::mt19937 rng(kCapacity * 1000 + threads);
  for (int kind = 0; kind < 3; ++kind) {
    for (int n : {1, 7, 100, 1031}) {
      const std::vector<float> row = Row(kind, n, rng);
      for (int k : {1, 5, 16, 64, n}) {
        EXPECT_EQ(CursorTopK<kCapacity>(row, threads, k), SortedTopK(row, k))
            << "capacity " << kCapacity << ", threads " << threads << ", kind "
            << kind << ", n " << n << ", k " << k;
      }
    }
  }
}

class TopKCursorTest : public ::testing::TestWithParam<int> {};

TEST_P(TopKCursorTest, MatchesAStableSort) {
  CheckAgainstSort<1>(GetParam());
  CheckAgainstSort<2>(GetParam());
  CheckAgainstSort<16>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Threads, TopKCursorTest,
                         ::testing::Values(1, 3, 32, 512));

TEST(TopKCursorTest, InfinitiesRankAndNaNsDoNot) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> row = {nan, -inf, 2, inf, nan, -FLT_MAX, inf, 2};
  const std::vector<int32_t> expected = {3, 6, 2, 7, 5, 1};
  for (int threads : {1, 2, 3, 8}) {
    EXPECT_EQ(CursorTopK<1>(row, threads, 8), expected) << threads;
    EXPECT_EQ(CursorTopK<4>(row, threads, 8), expected) << threads;
  }
  EXPECT_EQ(SortedTopK(row, 8), expected);
}

}  // namespace
}  // namespace dflash
