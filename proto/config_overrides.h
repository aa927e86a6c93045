#ifndef DFLASH_PROTO_CONFIG_OVERRIDES_H_
#define DFLASH_PROTO_CONFIG_OVERRIDES_H_

// Overrides of an objective config by name, shared by the dflash_head
// command (its flags) and the Python binding (its keyword arguments), so
// both accept the same values and refuse the rest with the same message.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "proto/objective.pb.h"

namespace dflash {

// Unset fields keep the config's value.
struct ConfigOverrides {
  // dflash, dpace, dpace-cumulative-confidence-only,
  // dpace-continuation-value-only, tv, lk-lambda, dspark, dpard, domino, kl,
  // reverse-kl, jsd: a fresh family (its own fields at their defaults),
  // keeping the cross-entropy options.
  std::optional<std::string> loss;
  // SpecForge's lk_loss_type (alpha, tv, lambda), kl_scale and kl_decay.
  std::optional<std::string> lk;
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

// How errors name an override: the command's flags (--loss, --lk,
// --chunk_blocks) or the binding's keywords (loss_type, lk_loss_type,
// chunk_blocks).
enum class OverrideNames { kFlags, kKeywords };

// Applies `overrides` in the order above. A name outside its list, gamma
// for D-PACE, kl_scale or kl_decay without lk, or a value outside its range
// (chunk_blocks, segment_chunks, gamma, threads, label_smoothing,
// z_loss_scale) is an InvalidArgument naming the flag or keyword, the value
// and what was expected; the rest is checked when the config is validated.
absl::Status ApplyOverrides(const ConfigOverrides& overrides,
                            OverrideNames names, v1::ObjectiveConfig& config);

}  // namespace dflash

#endif  // DFLASH_PROTO_CONFIG_OVERRIDES_H_
