#ifndef DFLASH_LOSSES_BATCH_LAYOUT_H_
#define DFLASH_LOSSES_BATCH_LAYOUT_H_

// Turns a token batch (TokenBatch: input ids and loss mask) into the rows
// the loss reads: SampleAnchors draws anchor positions per sequence, and
// LabelRows gives each row of an anchor block its target, position, block
// id and weight mask (RowMeta), under DFlash or DSpark Labeling.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "losses/row_meta.h"

namespace dflash {

// Token-level inputs of a DFlash batch, row-major [batch, seq_len].
struct TokenBatch {
  int64_t batch = 0;
  int64_t seq_len = 0;
  absl::Span<const int64_t> input_ids;
  absl::Span<const uint8_t> loss_mask;  // Nonzero: the token is supervised.
};

// Anchor positions [batch, num_anchors], sorted per sequence, with a keep
// mask that is 0 for padding anchors.
struct Anchors {
  int64_t num_anchors = 0;
  std::vector<int64_t> positions;
  std::vector<uint8_t> keep;
};

// How block position k maps to a label and a weight mask.
enum class Labeling {
  // docs/semantics.md section 2.3: k predicts anchor + k,
  // m = keep * (anchor + k < S) * (k > 0) * loss_mask[anchor + k].
  kDFlash,
  // docs/semantics.md section 2.4 (DSpark): k predicts anchor + 1 + k, the
  // mask is contiguous (it stops at the first unsupervised or out-of-range
  // token).
  kDSpark,
  // Domino with shift_label: k predicts anchor + 1 + k, m = keep *
  // (anchor + 1 + k < S) * loss_mask[anchor + 1 + k], not contiguous.
  kShifted,
};

// Anchors as SpecForge's `_sample_anchor_positions` draws them. Candidates
// are the positions p in [0, S-2] with loss_mask[p] and loss_mask[p+1] set.
// Every sequence gets the same width N = min(num_anchors,
// max_valid_anchors), max_valid_anchors defaulting to the batch's largest
// candidate count (pass one value on every rank for equal shapes). A
// sequence draws min(N, its count) of its candidates without replacement
// (seeded), sorted; the rest are padding (position 0, keep 0), so a
// sequence without candidates is all padding. N = 0 is an error.
absl::StatusOr<Anchors> SampleAnchors(
    const TokenBatch& tokens, int64_t num_anchors, uint64_t seed,
    std::optional<int64_t> max_valid_anchors = std::nullopt);

// The rows [batch, num_anchors, block_size] in that order: target ids,
// block positions, block ids (b * N + n) and weight masks. Rows without
// weight get target 0. Kept
// anchors outside [0, S), supervised targets outside [0, vocab) and
// mis-sized inputs are errors naming the (b, n) or (b, s) concerned.
absl::StatusOr<std::vector<RowMeta>> LabelRows(const TokenBatch& tokens,
                                               absl::Span<const int64_t> anchors,
                                               absl::Span<const uint8_t> keep,
                                               int64_t num_anchors,
                                               int64_t block_size,
                                               int64_t vocab,
                                               Labeling labeling);

}  // namespace dflash

#endif  // DFLASH_LOSSES_BATCH_LAYOUT_H_
