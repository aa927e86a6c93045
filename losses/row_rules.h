#ifndef DFLASH_LOSSES_ROW_RULES_H_
#define DFLASH_LOSSES_ROW_RULES_H_

// The rules that make a batch's rows (RowMeta) from its target ids and
// weight masks, written once for the host (RowsOf, python/native/
// objective.cc; SetSequenceShares, chunk_loss.h) and the device
// (BuildCudaRows's kernels, heads/cuda_head_kernels.cu), so that device
// metadata gives the rows and the errors host metadata does.

#include <cmath>
#include <cstdint>

#include "base/host_device.h"
#include "losses/loss_math.h"
#include "losses/loss_params.h"
#include "losses/row_meta.h"

namespace dflash {

// A weight mask a row may carry: finite and >= 0 (NaN is not).
DFLASH_HOST_DEVICE inline bool ValidMask(double mask) {
  return mask >= 0 && mask < INFINITY;
}

// What decides an element's row besides its own mask and target.
struct RowRules {
  int64_t vocab = 0;
  int64_t ignore_index = 0;
  bool count_ignored = false;  // loss.cross_entropy's ignored_target_weight COUNT.
  bool float64_terms = false;  // The terms' dtype: float64, else float32.
};

// The row of an element with a ValidMask `mask`, at `position` (k) of
// anchor block `block` (b N + n), into `row`. An ignored target carries
// nothing, as a zero mask does, unless the loss counts it (then it keeps
// its weight, and its target, which the loss reads as ignored; the config
// holds such an ignore_index to int32); where the row carries weight it
// gets its target and its mask in the terms' dtype (a float32 run rounds a
// float64 mask such as 1/3 here, and only here). False where a target with
// weight lies outside [0, vocab) and is not ignored (`row` then carries
// nothing).
DFLASH_HOST_DEVICE inline bool RowOfElement(double mask, int64_t target,
                                            int64_t position, int64_t block,
                                            const RowRules& rules,
                                            RowMeta& row) {
  row.position = static_cast<int32_t>(position);
  row.block = block;
  const bool ignored = target == rules.ignore_index;
  if (!(mask > 0) || (ignored && !rules.count_ignored)) return true;
  if (!ignored && (target < 0 || target >= rules.vocab)) return false;
  row.target = static_cast<int32_t>(target);
  row.mask = rules.float64_terms
                 ? mask
                 : static_cast<double>(static_cast<float>(mask));
  return true;
}

// D-PACE's SEQUENCE_BALANCED share of the rows [begin, end) of one sequence
// (SetSequenceShares): 1 / A, A its anchor blocks of `block_size` rows with
// an effective mask > 0, at least 1 (SpecForge's clamp_min(1): a sequence
// without weight has share 1, which no row of it uses).
DFLASH_HOST_DEVICE inline double SequenceShareOf(const LossParams& params,
                                                 const RowMeta* rows,
                                                 int64_t begin, int64_t end,
                                                 int64_t block_size) {
  int64_t weighted_blocks = 0;
  for (int64_t b = begin; b < end; b += block_size) {
    const int64_t block_end = end < b + block_size ? end : b + block_size;
    for (int64_t r = b; r < block_end; ++r) {
      if (EffectiveMask(params, rows[r].target, rows[r].mask) > 0) {
        ++weighted_blocks;
        break;
      }
    }
  }
  return 1.0 / static_cast<double>(weighted_blocks > 1 ? weighted_blocks : 1);
}

}  // namespace dflash

#endif  // DFLASH_LOSSES_ROW_RULES_H_
