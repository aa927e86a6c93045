#include "heads/row_compaction.h"

namespace dflash {

std::vector<int64_t> WeightedRows(absl::Span<const RowMeta> rows,
                                  int64_t ignore_index, bool count_ignored) {
  std::vector<int64_t> indices;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].mask > 0 &&
        (count_ignored || rows[r].target != ignore_index)) {
      indices.push_back(static_cast<int64_t>(r));
    }
  }
  return indices;
}

}  // namespace dflash
