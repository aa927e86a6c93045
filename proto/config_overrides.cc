#include "proto/config_overrides.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "base/threads.h"
#include "proto/config.h"

namespace dflash {
namespace {

// An override's name as the caller spells it: the binding's keyword (two
// follow SpecForge: loss_type, lk_loss_type), or the command's flag.
std::string NameOf(OverrideNames names, absl::string_view keyword) {
  if (names == OverrideNames::kKeywords) {
    if (keyword == "loss") return "loss_type";
    if (keyword == "lk") return "lk_loss_type";
    return std::string(keyword);
  }
  return absl::StrCat("--", keyword);
}

// A value's range, checked where the caller's name for it is known (the
// config's later validation would name only its field).
absl::Status CheckRange(const std::string& name, absl::string_view field,
                        double value, bool valid, absl::string_view range) {
  if (valid) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": must be ", range, " (", field, "), got ", value));
}

}  // namespace

absl::Status ApplyOverrides(const ConfigOverrides& overrides,
                            OverrideNames names, v1::ObjectiveConfig& config) {
  const ConfigOverrides& o = overrides;
  auto name = [names](absl::string_view keyword) {
    return NameOf(names, keyword);
  };
  if (o.chunk_blocks) {
    DFLASH_RETURN_IF_ERROR(CheckRange(name("chunk_blocks"),
                                      "chunking.blocks_per_chunk",
                                      *o.chunk_blocks, *o.chunk_blocks > 0,
                                      "> 0"));
  }
  if (o.segment_chunks) {
    DFLASH_RETURN_IF_ERROR(CheckRange(
        name("segment_chunks"), "checkpoint.segment_chunks", *o.segment_chunks,
        *o.segment_chunks >= 0, ">= 0 (0: never recompute)"));
  }
  if (o.gamma) {
    DFLASH_RETURN_IF_ERROR(CheckRange(
        name("gamma"), "the loss family's gamma", *o.gamma,
        *o.gamma >= 0 && std::isfinite(*o.gamma), "finite and >= 0"));
  }
  if (o.label_smoothing) {
    DFLASH_RETURN_IF_ERROR(CheckRange(
        name("label_smoothing"), "loss.cross_entropy.label_smoothing",
        *o.label_smoothing, *o.label_smoothing >= 0 && *o.label_smoothing < 1,
        "in [0, 1)"));
  }
  if (o.z_loss_scale) {
    DFLASH_RETURN_IF_ERROR(CheckRange(
        name("z_loss_scale"), "loss.cross_entropy.z_loss_scale",
        *o.z_loss_scale, *o.z_loss_scale >= 0 && std::isfinite(*o.z_loss_scale),
        "finite and >= 0"));
  }
  if (o.threads && (*o.threads < 0 || *o.threads > kMaxThreads)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name("threads"), ": must lie in [0, ", kMaxThreads,
                     "] (0: every usable CPU), got ", *o.threads));
  }
  v1::LossConfig& loss = *config.mutable_loss();
  if (o.loss) DFLASH_RETURN_IF_ERROR(SetLossByName(name("loss"), *o.loss, loss));
  if (o.gamma) DFLASH_RETURN_IF_ERROR(SetLossGamma(name("gamma"), *o.gamma, loss));
  if (o.lk) {
    DFLASH_RETURN_IF_ERROR(
        SetLkByName(name("lk"), *o.lk, o.kl_scale, o.kl_decay, loss));
  } else if (o.kl_scale || o.kl_decay) {
    const std::string lambda = names == OverrideNames::kKeywords
                                   ? absl::StrCat(name("lk"), "='lambda'")
                                   : absl::StrCat(name("lk"), "=lambda");
    return absl::InvalidArgumentError(
        absl::StrCat(name("kl_scale"), ", ", name("kl_decay"), ": set with ",
                     lambda, ", got no ", name("lk")));
  }
  if (o.mode) DFLASH_RETURN_IF_ERROR(SetModeByName(name("mode"), *o.mode, config));
  if (o.chunk_blocks) {
    config.mutable_chunking()->set_blocks_per_chunk(*o.chunk_blocks);
  }
  if (o.segment_chunks) {
    config.mutable_checkpoint()->set_segment_chunks(*o.segment_chunks);
  }
  if (o.threads) {
    config.mutable_head()->set_threads(static_cast<int32_t>(*o.threads));
  }
  v1::CrossEntropyOptions& ce = *loss.mutable_cross_entropy();
  if (o.ignore_index) ce.set_ignore_index(*o.ignore_index);
  if (o.label_smoothing) ce.set_label_smoothing(*o.label_smoothing);
  if (o.z_loss_scale) ce.set_z_loss_scale(*o.z_loss_scale);
  return absl::OkStatus();
}

}  // namespace dflash
