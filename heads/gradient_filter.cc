#include "heads/gradient_filter.h"

#include <algorithm>
#include <cmath>

namespace dflash {

template <typename T>
std::vector<VocabRange> KeptVocabRanges(const T* grad, int64_t rows,
                                        int64_t vocab, double threshold,
                                        int64_t tile, int64_t& skipped_tiles) {
  const int64_t tiles = (vocab + tile - 1) / tile;
  std::vector<bool> kept(tiles, false);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = grad + r * vocab;
    T largest = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      largest = std::max<T>(largest, std::abs(row[v]));
    }
    // A row without gradient (no weight) keeps nothing.
    if (!(largest > 0)) continue;
    const T cut = static_cast<T>(threshold * largest);
    for (int64_t t = 0; t < tiles; ++t) {
      if (kept[t]) continue;
      const int64_t end = std::min(vocab, (t + 1) * tile);
      T tile_largest = 0;
      for (int64_t v = t * tile; v < end; ++v) {
        tile_largest = std::max<T>(tile_largest, std::abs(row[v]));
      }
      kept[t] = tile_largest >= cut;
    }
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
                                                        int64_t, int64_t&);
template std::vector<VocabRange> KeptVocabRanges<double>(const double*,
                                                         int64_t, int64_t,
                                                         double, int64_t,
                                                         int64_t&);

}  // namespace dflash
