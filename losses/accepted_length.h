#ifndef DFLASH_LOSSES_ACCEPTED_LENGTH_H_
#define DFLASH_LOSSES_ACCEPTED_LENGTH_H_

// SpecForge's accepted-length diagnostics of a DFlash batch: how many tokens
// each anchor block would accept, from its rows' target probabilities (the
// expected length) or from whether each target is among the draft's top-k
// candidates (the oracle length). They chain the positions of a block, so
// they are taken over whole blocks once every chunk is done.

#include <cstdint>

#include "absl/types/span.h"
#include "losses/row_meta.h"

namespace dflash {

// Sums over blocks; over block_den, the mean accepted lengths.
struct AcceptedLengthTerms {
  // Blocks with a supervised slot k >= 1 (m > 0.5).
  double block_den = 0;
  // Sum over those blocks of 1 + sum_{k>=1} prod_{j=1..k} q_j [m_j > 0.5].
  double expected_num = 0;
  // The same with [target among the top-k] for q; 0 without `rank`.
  double oracle_num = 0;
  // The same with the teacher acceptance for q; 0 without it (DSpark's
  // tau_probabilistic over block_den).
  double teacher_expected_num = 0;
  // Domino's greedy accepted length (`compute_accept_len`), for the final
  // and the base logits: blocks with a slot of mask > 0, and the sum over
  // them of 1 + the slots with mask > 0 before the first such slot whose
  // argmax misses its target (slots without mask are skipped).
  double greedy_den = 0;
  double greedy_num = 0;
  double base_greedy_num = 0;
};

// Rows are grouped by RowMeta::block, in any order; positions before
// `first_position` never count (1 for DFlash's labels, whose position 0 is
// the anchor; 0 for DSpark's). q[r] is row r's target probability, rank[r]
// its target's place among the top-k or -1, teacher[r] its teacher
// acceptance (rank and teacher may be empty). A chain stops at the first
// unsupervised slot.
AcceptedLengthTerms AcceptedLengths(absl::Span<const RowMeta> rows,
                                    absl::Span<const double> q,
                                    absl::Span<const int32_t> rank,
                                    absl::Span<const double> teacher,
                                    int64_t block_size,
                                    int64_t first_position = 1);

// Sets terms' greedy_* from each row's argmax of the final and the base
// logits (-1 for rows the head skipped, which carry no mask).
void AddGreedyAcceptedLengths(absl::Span<const RowMeta> rows,
                              absl::Span<const int32_t> argmax,
                              absl::Span<const int32_t> base_argmax,
                              int64_t block_size, AcceptedLengthTerms& terms);

}  // namespace dflash

#endif  // DFLASH_LOSSES_ACCEPTED_LENGTH_H_
