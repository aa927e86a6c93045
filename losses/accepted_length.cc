#include "losses/accepted_length.h"

#include <vector>

#include "absl/container/flat_hash_map.h"

namespace dflash {

AcceptedLengthTerms AcceptedLengths(absl::Span<const RowMeta> rows,
                                    absl::Span<const double> q,
                                    absl::Span<const int32_t> rank,
                                    int64_t block_size) {
  // Per block, slots 1..K-1: q * supervised and hit * supervised.
  absl::flat_hash_map<int64_t, int64_t> index;
  std::vector<double> expected, oracle;
  std::vector<bool> valid;
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowMeta& meta = rows[r];
    if (meta.position < 1 || meta.position >= block_size) continue;
    const auto [at, added] =
        index.try_emplace(meta.block, static_cast<int64_t>(valid.size()));
    if (added) {
      expected.resize(expected.size() + block_size, 0.0);
      oracle.resize(oracle.size() + block_size, 0.0);
      valid.push_back(false);
    }
    const int64_t slot = at->second * block_size + meta.position;
    const bool supervised = meta.mask > 0.5f;
    valid[at->second] = valid[at->second] || supervised;
    expected[slot] = supervised ? q[r] : 0.0;
    oracle[slot] = supervised && !rank.empty() && rank[r] >= 0 ? 1.0 : 0.0;
  }
  AcceptedLengthTerms terms;
  for (size_t b = 0; b < valid.size(); ++b) {
    if (!valid[b]) continue;
    terms.block_den += 1;
    double alive_expected = 1, alive_oracle = 1;
    double length_expected = 1, length_oracle = 1;
    for (int64_t k = 1; k < block_size; ++k) {
      alive_expected *= expected[b * block_size + k];
      alive_oracle *= oracle[b * block_size + k];
      length_expected += alive_expected;
      length_oracle += alive_oracle;
    }
    terms.expected_num += length_expected;
    if (!rank.empty()) terms.oracle_num += length_oracle;
  }
  return terms;
}

}  // namespace dflash
