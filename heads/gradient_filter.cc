#include "heads/gradient_filter.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <omp.h>

#include "base/cpu_dispatch.h"

namespace dflash {
namespace {

// max |x[i]| for i < count (0 when empty; NaNs do not count).
template <typename T>
T MaxAbs(const T* x, int64_t count) {
  T max = 0;
  for (int64_t i = 0; i < count; ++i) {
    const T a = std::abs(x[i]);
    max = a > max ? a : max;
  }
  return max;
}

// The float one on vector types: compilers do not vectorise a float max
// reduction by themselves, and the filter reads the whole chunk with it.
template <>
DFLASH_CPU_DISPATCH float MaxAbs<float>(const float* x, int64_t count) {
  using Floats = float __attribute__((vector_size(32)));
  constexpr int kWidth = sizeof(Floats) / sizeof(float);
  Floats max_v = {};
  int64_t i = 0;
  for (; i + kWidth <= count; i += kWidth) {
    Floats a;
    std::memcpy(&a, x + i, sizeof(a));
    a = a < 0 ? -a : a;
    max_v = a > max_v ? a : max_v;
  }
  float max = 0;
  for (int l = 0; l < kWidth; ++l) max = max_v[l] > max ? max_v[l] : max;
  for (; i < count; ++i) {
    const float a = std::abs(x[i]);
    max = a > max ? a : max;
  }
  return max;
}

}  // namespace

template <typename T>
std::vector<VocabRange> KeptVocabRanges(const T* grad, int64_t rows,
                                        int64_t vocab, double threshold,
                                        int64_t tile, int64_t& skipped_tiles,
                                        int threads) {
  const int64_t tiles = (vocab + tile - 1) / tile;
  std::vector<unsigned char> kept(tiles, 0);
  // Rows in parallel on OpenMP's threads (the head's), each reading its row
  // once: the tiles' maxima, then the row's cut against them.
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
  {
    std::vector<unsigned char> mine(tiles, 0);
    std::vector<T> tile_max(tiles);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = grad + r * vocab;
      T largest = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t begin = t * tile;
        tile_max[t] =
            MaxAbs(row + begin, std::min(vocab, begin + tile) - begin);
        largest = tile_max[t] > largest ? tile_max[t] : largest;
      }
      // A row without gradient (no weight) keeps nothing.
      if (!(largest > 0)) continue;
      const T cut = static_cast<T>(threshold * largest);
      for (int64_t t = 0; t < tiles; ++t) mine[t] |= tile_max[t] >= cut;
    }
#pragma omp critical
    for (int64_t t = 0; t < tiles; ++t) kept[t] |= mine[t];
  }
  std::vector<VocabRange> ranges;
  skipped_tiles = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    if (!kept[t]) {
      ++skipped_tiles;
      continue;
    }
    const int64_t begin = t * tile, end = std::min(vocab, (t + 1) * tile);
    if (!ranges.empty() && ranges.back().end == begin) {
      ranges.back().end = end;
    } else {
      ranges.push_back({begin, end});
    }
  }
  return ranges;
}

template std::vector<VocabRange> KeptVocabRanges<float>(const float*, int64_t,
                                                        int64_t, double,
                                                        int64_t, int64_t&,
                                                        int);
template std::vector<VocabRange> KeptVocabRanges<double>(const double*,
                                                         int64_t, int64_t,
                                                         double, int64_t,
                                                         int64_t&, int);

}  // namespace dflash
