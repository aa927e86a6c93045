#ifndef DFLASH_LOSSES_LOSS_FAMILY_H_
#define DFLASH_LOSSES_LOSS_FAMILY_H_

// LossTraitsOf: what a loss family needs from the batch and the head (a
// teacher projection, whole blocks per chunk, a cross-entropy term, the
// confidence head, which labels), read once from a v1::LossConfig. The one
// place these facts live: the losses, heads, command and config checks ask
// here instead of testing the config's family themselves.

#include "losses/batch_layout.h"
#include "proto/policy.pb.h"

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
  // How the batch layout labels its rows for this family.
  Labeling labeling = Labeling::kDFlash;
};

LossTraits LossTraitsOf(const v1::LossConfig& loss);

}  // namespace dflash

#endif  // DFLASH_LOSSES_LOSS_FAMILY_H_
