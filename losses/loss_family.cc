#include "losses/loss_family.h"

namespace dflash {

LossTraits LossTraitsOf(const v1::LossConfig& loss) {
  LossTraits traits;
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      traits.name = "dflash";
      break;
    case v1::LossConfig::kDpace:
      traits.name = "dpace";
      traits.couples_blocks = true;
      break;
    case v1::LossConfig::kTv:
      traits.name = "tv";
      traits.has_cross_entropy = false;
      break;
    case v1::LossConfig::kLkLambda:
      traits.name = "lk_lambda";
      traits.couples_blocks = true;
      break;
    case v1::LossConfig::kDspark:
      traits.name = "dspark";
      traits.needs_teacher = true;
      traits.needs_confidence = loss.dspark().confidence_weight() > 0;
      traits.labeling = Labeling::kDSpark;
      break;
    case v1::LossConfig::kDistillation:
      traits.name = "distillation";
      traits.needs_teacher = true;
      traits.has_cross_entropy = false;
      break;
    case v1::LossConfig::FAMILY_NOT_SET:
      break;
  }
  return traits;
}

}  // namespace dflash
