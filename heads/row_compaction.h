#ifndef DFLASH_HEADS_ROW_COMPACTION_H_
#define DFLASH_HEADS_ROW_COMPACTION_H_

// Row compaction: the head projects only the rows that carry weight
// (WeightedRows), gathered into a dense chunk and scattered back
// (GatherRows, ScatterRows).

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "losses/chunk_loss.h"
#include "losses/loss_params.h"

namespace dflash {

// Draft states [B, N, K, H] are already rows [B * N * K, H] in memory; the
// head projects only the rows that carry weight. These are their indices,
// ascending: those whose EffectiveMask (losses/loss_math.h) under `loss` is
// positive (mask > 0 and target != ignore_index, or any target where
// ignored targets count, CrossEntropyOptions COUNT).
std::vector<int64_t> WeightedRows(absl::Span<const RowMeta> rows,
                                  const LossParams& loss);

// dst[i, :] = src[indices[i], :] for rows of `width` values.
template <typename T>
void GatherRows(const T* src, int64_t width, absl::Span<const int64_t> indices,
                T* dst) {
  for (size_t i = 0; i < indices.size(); ++i) {
    const T* from = src + indices[i] * width;
    std::copy(from, from + width, dst + static_cast<int64_t>(i) * width);
  }
}

// dst[indices[i], :] = src[i, :].
template <typename T>
void ScatterRows(const T* src, int64_t width, absl::Span<const int64_t> indices,
                 T* dst) {
  for (size_t i = 0; i < indices.size(); ++i) {
    const T* from = src + static_cast<int64_t>(i) * width;
    std::copy(from, from + width, dst + indices[i] * width);
  }
}

}  // namespace dflash

#endif  // DFLASH_HEADS_ROW_COMPACTION_H_
