#ifndef DFLASH_LOSSES_TERM_SLOTS_H_
#define DFLASH_LOSSES_TERM_SLOTS_H_

// TermSlot: the names of a row's additive terms (losses/chunk_terms.inc),
// through which the family row passes (family_passes.h) report what they
// add. The CUDA kernels keep one kTermSlots row per chunk row and reduce
// them into ChunkTerms' totals; the CPU loss adds each into ChunkTerms at
// once. A slot's value counts in its summed term and in every per-position
// term that names it, at the row's block position.

#include <cstdint>

#include "base/host_device.h"

namespace dflash {

enum TermSlot : int {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) slot,
#define DFLASH_POSITION_SLOT(slot) slot,
#include "losses/chunk_terms.inc"
  kTermSlots,
};
// LossKernel zeroes the slots from kL1Num on for each row, after TopKKernel
// wrote these.
static_assert(kTopKRecall < kL1Num && kTopKMass < kL1Num &&
              kTeacherTopKMass < kL1Num);
constexpr int kPositionTerms = 0
#define DFLASH_POSITION_TERM(field, slot, dict, key) +1
#include "losses/chunk_terms.inc"
    ;
// The slot the t-th per-position term sums.
DFLASH_HOST_DEVICE constexpr int PositionSlot(int t) {
  constexpr int kSlots[kPositionTerms] = {
#define DFLASH_POSITION_TERM(field, slot, dict, key) slot,
#include "losses/chunk_terms.inc"
  };
  return kSlots[t];
}
// The device totals of a chunk: the slots, then each per-position term [K].
inline int64_t TotalsSize(int32_t block_size) {
  return kTermSlots + kPositionTerms * int64_t{block_size};
}

}  // namespace dflash

#endif  // DFLASH_LOSSES_TERM_SLOTS_H_
