#ifndef DFLASH_LOSSES_LOSS_FAMILY_H_
#define DFLASH_LOSSES_LOSS_FAMILY_H_

// The one place that reads a v1::LossConfig: its validation, its
// resolution into LossParams (what the CPU loss and the CUDA kernels read),
// and LossTraitsOf, what a family needs from the batch and the head (a
// teacher projection, whole blocks per chunk, a cross-entropy term, the
// confidence head, which labels). The losses, heads, command and config
// checks ask here instead of testing the config's family themselves.

#include "absl/status/statusor.h"
#include "base/problem_list.h"
#include "losses/batch_layout.h"
#include "losses/loss_params.h"
#include "proto/loss.pb.h"

namespace dflash {

struct LossTraits {
  const char* name = "none";  // The family's field name ("dflash", ...).
  // Reads a frozen teacher projection: a second logits buffer per chunk.
  bool needs_teacher = false;
  // Block-level weights: a block's rows in one chunk, in position order.
  bool couples_blocks = false;
  // Has a cross-entropy term that label smoothing and z-loss act on.
  bool has_cross_entropy = true;
  // Takes the draft's confidence logits (dspark with confidence_weight > 0).
  bool needs_confidence = false;
  // Reads the head's correction logits apart from the base logits (domino),
  // rather than their sum.
  bool splits_correction = false;
  // How the batch layout labels its rows for this family.
  Labeling labeling = Labeling::kDFlash;
  // The first block position the accepted lengths count: 1 under DFlash's
  // labels (position 0 is the anchor), 0 where slot 0 is supervised.
  int64_t first_accepted_position = 1;
  // Computes each row's teacher acceptance itself (DSpark with a teacher),
  // whose chain over the block is its tau.
  bool accepts_teacher = false;
};

LossTraits LossTraitsOf(const LossParams& loss);
LossTraits LossTraitsOf(const v1::LossConfig& loss);

// The config's values as LossParams, unchecked: for configs already
// validated (the objective's, once parsed).
LossParams LossParamsOf(const v1::LossConfig& loss);

// ValidateLossConfig, then LossParamsOf.
absl::StatusOr<LossParams> ResolveLoss(const v1::LossConfig& loss);

// Every problem of a loss config (paths under "loss."), into `problems`: the
// family's fields and the cross-entropy options it accepts.
void AddLossConfigProblems(const v1::LossConfig& loss, ProblemList& problems);

// The problems as one InvalidArgument error, a line each; OK when none.
absl::Status ValidateLossConfig(const v1::LossConfig& loss);

}  // namespace dflash

#endif  // DFLASH_LOSSES_LOSS_FAMILY_H_
