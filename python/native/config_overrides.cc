#include "python/native/config_overrides.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "base/status_macros.h"
#include "base/threads.h"
#include "configs/default_config.h"
#include "proto/config.h"

namespace dflash::python {
namespace {

// A keyword's range, checked where the caller's name for it is known (the
// config's later validation would name only its field).
absl::Status CheckOverride(absl::string_view keyword, absl::string_view field,
                           double value, bool valid, absl::string_view range) {
  if (valid) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      keyword, ": must be ", range, " (", field, "), got ", value));
}

}  // namespace

absl::Status ApplyOverrides(const ConfigOverrides& overrides,
                            v1::ObjectiveConfig& config) {
  const ConfigOverrides& o = overrides;
  if (o.chunk_blocks) {
    DFLASH_RETURN_IF_ERROR(CheckOverride("chunk_blocks",
                                         "chunking.blocks_per_chunk",
                                         *o.chunk_blocks, *o.chunk_blocks > 0,
                                         "> 0"));
  }
  if (o.segment_chunks) {
    DFLASH_RETURN_IF_ERROR(CheckOverride(
        "segment_chunks", "checkpoint.segment_chunks", *o.segment_chunks,
        *o.segment_chunks >= 0, ">= 0 (0: never recompute)"));
  }
  if (o.gamma) {
    DFLASH_RETURN_IF_ERROR(CheckOverride(
        "gamma", "the loss family's gamma", *o.gamma,
        *o.gamma >= 0 && std::isfinite(*o.gamma), "finite and >= 0"));
  }
  if (o.label_smoothing) {
    DFLASH_RETURN_IF_ERROR(CheckOverride(
        "label_smoothing", "loss.cross_entropy.label_smoothing",
        *o.label_smoothing, *o.label_smoothing >= 0 && *o.label_smoothing < 1,
        "in [0, 1)"));
  }
  if (o.z_loss_scale) {
    DFLASH_RETURN_IF_ERROR(CheckOverride(
        "z_loss_scale", "loss.cross_entropy.z_loss_scale", *o.z_loss_scale,
        *o.z_loss_scale >= 0 && std::isfinite(*o.z_loss_scale),
        "finite and >= 0"));
  }
  v1::LossConfig& loss = *config.mutable_loss();
  if (overrides.loss_type.has_value()) {
    DFLASH_RETURN_IF_ERROR(
        SetLossByName("loss_type", *overrides.loss_type, loss));
  }
  if (overrides.gamma.has_value()) {
    DFLASH_RETURN_IF_ERROR(SetLossGamma("gamma", *overrides.gamma, loss));
  }
  if (overrides.lk_loss_type.has_value()) {
    DFLASH_RETURN_IF_ERROR(SetLkByName("lk_loss_type", *overrides.lk_loss_type,
                                       overrides.kl_scale, overrides.kl_decay,
                                       loss));
  } else if (overrides.kl_scale.has_value() || overrides.kl_decay.has_value()) {
    return absl::InvalidArgumentError(
        "kl_scale, kl_decay: set with lk_loss_type='lambda', got no "
        "lk_loss_type");
  }
  if (overrides.mode.has_value()) {
    DFLASH_RETURN_IF_ERROR(SetModeByName("mode", *overrides.mode, config));
  }
  if (overrides.chunk_blocks.has_value()) {
    config.mutable_chunking()->set_blocks_per_chunk(*overrides.chunk_blocks);
  }
  if (overrides.segment_chunks.has_value()) {
    config.mutable_checkpoint()->set_segment_chunks(*overrides.segment_chunks);
  }
  if (overrides.threads.has_value()) {
    if (*overrides.threads < 0 || *overrides.threads > kMaxThreads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "threads: must lie in [0, ", kMaxThreads,
          "] (0: every usable CPU), got ", *overrides.threads));
    }
    config.mutable_head()->set_threads(
        static_cast<int32_t>(*overrides.threads));
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
  return ParseObjectiveConfig(DefaultObjectiveConfigText(),
                              kDefaultConfigSource);
}

absl::StatusOr<v1::ObjectiveConfig> ConfigFromFile(const std::string& path) {
  // A regular file only (a FIFO would block); the OS's reason otherwise.
  constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
  absl::StatusOr<std::string> text = ReadFileToString(path, kMaxConfigBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("config: ", text.status().message()));
  }
  return ParseObjectiveConfig(*text, path);
}

}  // namespace dflash::python
