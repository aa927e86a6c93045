#include "heads/row_compaction.h"

#include "losses/loss_math.h"

namespace dflash {

std::vector<int64_t> WeightedRows(absl::Span<const RowMeta> rows,
                                  const LossParams& loss) {
  std::vector<int64_t> indices;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (EffectiveMask(loss, rows[r].target, rows[r].mask) > 0) {
      indices.push_back(static_cast<int64_t>(r));
    }
  }
  return indices;
}

}  // namespace dflash
