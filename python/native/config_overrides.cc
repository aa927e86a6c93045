#include "python/native/config_overrides.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "base/status_macros.h"
#include "base/threads.h"
#include "configs/default_config.h"
#include "proto/config.h"

namespace dflash::python {
absl::Status ApplyOverrides(const ConfigOverrides& overrides,
                            v1::ObjectiveConfig& config) {
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
