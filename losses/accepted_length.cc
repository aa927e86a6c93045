#include "losses/accepted_length.h"

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "losses/loss_math.h"

namespace dflash {

AcceptedLengthTerms AcceptedLengths(absl::Span<const RowMeta> rows,
                                    absl::Span<const double> q,
                                    absl::Span<const int32_t> rank,
                                    absl::Span<const double> teacher,
                                    int64_t block_size,
                                    int64_t first_position) {
  // Per block, slots first..K-1: each acceptance times supervised.
  absl::flat_hash_map<int64_t, int64_t> index;
  std::vector<double> expected, oracle, teacher_expected;
  std::vector<bool> valid;
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowMeta& meta = rows[r];
    if (meta.position < first_position || meta.position >= block_size) {
      continue;
    }
    const auto [at, added] =
        index.try_emplace(meta.block, static_cast<int64_t>(valid.size()));
    if (added) {
      for (std::vector<double>* v : {&expected, &oracle, &teacher_expected}) {
        v->resize(v->size() + block_size, 0.0);
      }
      valid.push_back(false);
    }
    const int64_t slot = at->second * block_size + meta.position;
    const SlotAcceptance a =
        AcceptanceOfSlot(meta.mask, q[r], rank.empty() ? -1 : rank[r],
                         teacher.empty() ? 0.0 : teacher[r]);
    valid[at->second] = valid[at->second] || a.supervised;
    expected[slot] = a.expected;
    oracle[slot] = a.oracle;
    teacher_expected[slot] = a.teacher;
  }
  AcceptedLengthTerms terms;
  for (size_t b = 0; b < valid.size(); ++b) {
    if (!valid[b]) continue;
    const int64_t at = static_cast<int64_t>(b) * block_size;
    terms.block_den += 1;
    auto slots = [at](const std::vector<double>& a) {
      return [&a, at](int64_t k) { return a[at + k]; };
    };
    terms.expected_num += ChainLength(slots(expected), first_position,
                                      block_size);
    if (!rank.empty()) {
      terms.oracle_num += ChainLength(slots(oracle), first_position,
                                      block_size);
    }
    if (!teacher.empty()) {
      terms.teacher_expected_num +=
          ChainLength(slots(teacher_expected), first_position, block_size);
    }
  }
  return terms;
}

void AddGreedyAcceptedLengths(absl::Span<const RowMeta> rows,
                              absl::Span<const int32_t> argmax,
                              absl::Span<const int32_t> base_argmax,
                              int64_t block_size, AcceptedLengthTerms& terms) {
  // Per block and slot: 1 where valid and hit, 0 where valid and missed, -1
  // where not valid; for the final and the base logits.
  absl::flat_hash_map<int64_t, int64_t> index;
  std::vector<int8_t> final_hits, base_hits;
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowMeta& meta = rows[r];
    if (meta.position < 0 || meta.position >= block_size) continue;
    const auto [at, added] = index.try_emplace(
        meta.block, static_cast<int64_t>(final_hits.size()) / block_size);
    if (added) {
      final_hits.resize(final_hits.size() + block_size, -1);
      base_hits.resize(base_hits.size() + block_size, -1);
    }
    if (!(meta.mask > 0)) continue;
    const int64_t slot = at->second * block_size + meta.position;
    final_hits[slot] = argmax[r] == meta.target;
    base_hits[slot] = base_argmax[r] == meta.target;
  }
  auto length = [block_size](const int8_t* hits, bool& valid) {
    double accepted = 0;
    bool alive = true;
    for (int64_t k = 0; k < block_size; ++k) {
      if (hits[k] < 0) continue;
      valid = true;
      alive = alive && hits[k] == 1;
      accepted += alive;
    }
    return accepted + 1;
  };
  for (size_t at = 0; at < final_hits.size(); at += block_size) {
    bool valid = false;
    const double accepted = length(final_hits.data() + at, valid);
    if (!valid) continue;
    terms.greedy_den += 1;
    terms.greedy_num += accepted;
    terms.base_greedy_num += length(base_hits.data() + at, valid);
  }
}

}  // namespace dflash
