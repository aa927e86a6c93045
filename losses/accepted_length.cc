#include "losses/accepted_length.h"

#include <vector>

#include "absl/container/flat_hash_map.h"

namespace dflash {

namespace {

// 1 + sum_{k>=1} prod_{j=1..k} a[j] over a block's slots.
double ChainLength(const double* a, int64_t block_size) {
  double alive = 1, length = 1;
  for (int64_t k = 1; k < block_size; ++k) {
    alive *= a[k];
    length += alive;
  }
  return length;
}

}  // namespace

AcceptedLengthTerms AcceptedLengths(absl::Span<const RowMeta> rows,
                                    absl::Span<const double> q,
                                    absl::Span<const int32_t> rank,
                                    absl::Span<const double> teacher,
                                    int64_t block_size) {
  // Per block, slots 1..K-1: each acceptance times supervised.
  absl::flat_hash_map<int64_t, int64_t> index;
  std::vector<double> expected, oracle, teacher_expected;
  std::vector<bool> valid;
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowMeta& meta = rows[r];
    if (meta.position < 1 || meta.position >= block_size) continue;
    const auto [at, added] =
        index.try_emplace(meta.block, static_cast<int64_t>(valid.size()));
    if (added) {
      for (std::vector<double>* v : {&expected, &oracle, &teacher_expected}) {
        v->resize(v->size() + block_size, 0.0);
      }
      valid.push_back(false);
    }
    const int64_t slot = at->second * block_size + meta.position;
    const bool supervised = meta.mask > 0.5f;
    valid[at->second] = valid[at->second] || supervised;
    expected[slot] = supervised ? q[r] : 0.0;
    oracle[slot] = supervised && !rank.empty() && rank[r] >= 0 ? 1.0 : 0.0;
    teacher_expected[slot] = supervised && !teacher.empty() ? teacher[r] : 0.0;
  }
  AcceptedLengthTerms terms;
  for (size_t b = 0; b < valid.size(); ++b) {
    if (!valid[b]) continue;
    const int64_t at = static_cast<int64_t>(b) * block_size;
    terms.block_den += 1;
    terms.expected_num += ChainLength(expected.data() + at, block_size);
    if (!rank.empty()) {
      terms.oracle_num += ChainLength(oracle.data() + at, block_size);
    }
    if (!teacher.empty()) {
      terms.teacher_expected_num +=
          ChainLength(teacher_expected.data() + at, block_size);
    }
  }
  return terms;
}

}  // namespace dflash
