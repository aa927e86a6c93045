#ifndef DFLASH_PYTHON_NATIVE_CONFIG_OVERRIDES_H_
#define DFLASH_PYTHON_NATIVE_CONFIG_OVERRIDES_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/objective.pb.h"

namespace dflash::python {

// The keyword overrides dflash.torch takes on top of a config; unset ones
// keep the config's value. Names follow the dflash_head command's flags.
struct ConfigOverrides {
  // dflash, dpace, dpace-cumulative-confidence-only,
  // dpace-continuation-value-only, tv, lk-lambda, dspark, dpard, domino, kl,
  // reverse-kl, jsd: a fresh family (its own fields at their defaults), keeping the
  // cross-entropy options.
  std::optional<std::string> loss_type;
  // SpecForge's lk_loss_type (alpha, tv, lambda), kl_scale and kl_decay.
  std::optional<std::string> lk_loss_type;
  std::optional<double> kl_scale, kl_decay;
  std::optional<double> gamma;          // The family's decay; D-PACE has none.
  std::optional<std::string> mode;      // materialize, save, checkpoint,
                                        // selective, fused.
  std::optional<int64_t> chunk_blocks;  // chunking.blocks_per_chunk.
  std::optional<int64_t> segment_chunks;  // checkpoint.segment_chunks.
  std::optional<int64_t> threads;         // head.threads.
  std::optional<int64_t> ignore_index;
  std::optional<double> label_smoothing;
  std::optional<double> z_loss_scale;
};

// Applies `overrides` in the order above. A name outside its list, gamma
// for D-PACE, or a value outside its range (chunk_blocks, segment_chunks,
// gamma, threads, label_smoothing, z_loss_scale) is an error naming the
// keyword; the rest is checked when the config is validated.
absl::Status ApplyOverrides(const ConfigOverrides& overrides,
                            v1::ObjectiveConfig& config);

// configs/dflash_default.textproto, compiled in.
absl::StatusOr<v1::ObjectiveConfig> DefaultConfig();

// A text-format file, parsed as ParseObjectiveConfig does (no defaults, no
// validation: the tensors fill the shapes at each call); NotFound when it
// cannot be read.
absl::StatusOr<v1::ObjectiveConfig> ConfigFromFile(const std::string& path);

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_CONFIG_OVERRIDES_H_
