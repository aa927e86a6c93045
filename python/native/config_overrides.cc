#include "python/native/config_overrides.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "proto/config.h"

namespace dflash::python {
namespace {

constexpr char kDefaultConfig[] =
#include "python/native/default_config.inc"
    ;

absl::Status SetLossType(const std::string& name, v1::LossConfig& loss) {
  v1::LossConfig fresh;
  if (name == "dflash") {
    fresh.mutable_dflash();
  } else if (name == "dpace") {
    fresh.mutable_dpace()->set_variant(v1::DPaceLoss::DPACE);
  } else if (name == "dpace-cumulative-confidence-only") {
    fresh.mutable_dpace()->set_variant(
        v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY);
  } else if (name == "dpace-continuation-value-only") {
    fresh.mutable_dpace()->set_variant(v1::DPaceLoss::CONTINUATION_VALUE_ONLY);
  } else if (name == "tv") {
    fresh.mutable_tv();
  } else if (name == "lk-lambda") {
    fresh.mutable_lk_lambda();
  } else if (name == "dspark") {
    fresh.mutable_dspark();
  } else if (name == "kl") {
    fresh.mutable_distillation()->set_divergence(
        v1::DistillationLoss::FORWARD_KL);
  } else if (name == "reverse-kl") {
    fresh.mutable_distillation()->set_divergence(
        v1::DistillationLoss::REVERSE_KL);
  } else if (name == "jsd") {
    fresh.mutable_distillation()->set_divergence(v1::DistillationLoss::JSD);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_type: must be one of dflash, dpace, "
        "dpace-cumulative-confidence-only, dpace-continuation-value-only, tv, "
        "lk-lambda, dspark, kl, reverse-kl, jsd, got '",
        name, "'"));
  }
  *fresh.mutable_cross_entropy() = loss.cross_entropy();
  loss = std::move(fresh);
  return absl::OkStatus();
}

absl::Status SetGamma(double gamma, v1::LossConfig& loss) {
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      loss.mutable_dflash()->set_gamma(gamma);
      return absl::OkStatus();
    case v1::LossConfig::kTv:
      loss.mutable_tv()->set_gamma(gamma);
      return absl::OkStatus();
    case v1::LossConfig::kLkLambda:
      loss.mutable_lk_lambda()->set_gamma(gamma);
      return absl::OkStatus();
    case v1::LossConfig::kDspark:
      loss.mutable_dspark()->set_gamma(gamma);
      return absl::OkStatus();
    case v1::LossConfig::kDistillation:
      loss.mutable_distillation()->set_gamma(gamma);
      return absl::OkStatus();
    case v1::LossConfig::kDpace:
      return absl::InvalidArgumentError(
          absl::StrCat("gamma: the dpace family has no decay, got ", gamma));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "gamma: the config names no loss family to decay (set loss_type), "
          "got ",
          gamma));
  }
}

// Selective mode without a policy of its own gets the frozen-projection
// preset, as the dflash_head command's --mode=selective does.
absl::Status SetMode(const std::string& name, v1::ObjectiveConfig& config) {
  v1::HeadConfig::ExecutionMode mode;
  if (name == "materialize") {
    mode = v1::HeadConfig::MATERIALIZE;
  } else if (name == "save") {
    mode = v1::HeadConfig::SAVE_CHUNKS;
  } else if (name == "checkpoint") {
    mode = v1::HeadConfig::CHECKPOINT;
  } else if (name == "selective") {
    mode = v1::HeadConfig::SELECTIVE;
  } else if (name == "fused") {
    mode = v1::HeadConfig::FUSED;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "mode: must be one of materialize, save, checkpoint, selective, "
        "fused, got '",
        name, "'"));
  }
  config.mutable_head()->set_mode(mode);
  v1::CheckpointPolicy& policy = *config.mutable_checkpoint();
  if (mode == v1::HeadConfig::SELECTIVE && !policy.has_preset() &&
      policy.rules_size() == 0) {
    policy.set_preset(v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyOverrides(const ConfigOverrides& overrides,
                            v1::ObjectiveConfig& config) {
  v1::LossConfig& loss = *config.mutable_loss();
  if (overrides.loss_type.has_value()) {
    DFLASH_RETURN_IF_ERROR(SetLossType(*overrides.loss_type, loss));
  }
  if (overrides.gamma.has_value()) {
    DFLASH_RETURN_IF_ERROR(SetGamma(*overrides.gamma, loss));
  }
  if (overrides.mode.has_value()) {
    DFLASH_RETURN_IF_ERROR(SetMode(*overrides.mode, config));
  }
  if (overrides.chunk_blocks.has_value()) {
    config.mutable_chunking()->set_blocks_per_chunk(*overrides.chunk_blocks);
  }
  if (overrides.segment_chunks.has_value()) {
    config.mutable_checkpoint()->set_segment_chunks(*overrides.segment_chunks);
  }
  if (overrides.threads.has_value()) {
    config.mutable_head()->set_threads(*overrides.threads);
  }
  v1::CrossEntropyOptions& ce = *loss.mutable_cross_entropy();
  if (overrides.ignore_index.has_value()) {
    ce.set_ignore_index(*overrides.ignore_index);
  }
  if (overrides.label_smoothing.has_value()) {
    ce.set_label_smoothing(*overrides.label_smoothing);
  }
  if (overrides.z_loss_scale.has_value()) {
    ce.set_z_loss_scale(*overrides.z_loss_scale);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ObjectiveConfig> DefaultConfig() {
  return ParseObjectiveConfig(kDefaultConfig,
                              "configs/dflash_default.textproto");
}

absl::StatusOr<v1::ObjectiveConfig> ConfigFromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("config: cannot read the file '", path, "'"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return ParseObjectiveConfig(text.str(), path);
}

}  // namespace dflash::python
