#ifndef DFLASH_PROTO_CONFIG_H_
#define DFLASH_PROTO_CONFIG_H_

// Loading and checking objective configs: ParseObjectiveConfig reads text
// format, ResolveDefaults writes out every default, ValidateObjectiveConfig
// checks the result; LoadObjectiveConfigFromString and
// LoadObjectiveConfigFromFile do all three. Also what other targets derive
// from a config (PresetRules, BytesPerLogit, LossNeedsTeacher) and
// ToTextFormat for printing one.

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/objective.pb.h"

namespace dflash {

// Parses an ObjectiveConfig from protobuf text format. Syntax errors name
// `source`, line and column. Does not fill defaults or validate.
absl::StatusOr<v1::ObjectiveConfig> ParseObjectiveConfig(
    absl::string_view text, absl::string_view source = "<string>");

// Returns `config` with every defaulted field written out explicitly, so that
// printing it shows the policy that will run (each component's .proto file
// gives its defaults). A chunking policy with no size gets
// blocks_per_chunk = 128.
v1::ObjectiveConfig ResolveDefaults(v1::ObjectiveConfig config);

// Checks every field and the cross-field constraints of a resolved config.
// The error lists each problem on its own line as
// "full.field.path: what is wrong, got VALUE".
absl::Status ValidateObjectiveConfig(const v1::ObjectiveConfig& config);

// The checkpoint part of ValidateObjectiveConfig, for users of the
// checkpoint policy alone (paths start with "checkpoint.").
absl::Status ValidateCheckpointPolicy(const v1::CheckpointPolicy& policy);


// What a config must satisfy whatever shapes a consumer later gives it
// (dflash_head replaces layout and sizes from its flags or files): its
// layout fields as written (a value replaced later must not hide an
// invalid one), and a head.backend this build can run (CUDA needs a build
// with the CUDA toolkit). check_config and dflash_head both refuse what
// this refuses, with its "field: what, got VALUE" lines.
absl::Status ValidateConfigAsWritten(const v1::ObjectiveConfig& config);

// Parse, resolve defaults, validate.
absl::StatusOr<v1::ObjectiveConfig> LoadObjectiveConfigFromString(
    absl::string_view text, absl::string_view source = "<string>");
absl::StatusOr<v1::ObjectiveConfig> LoadObjectiveConfigFromFile(
    const std::string& path);

// The text-format config at `path` as written (ParseObjectiveConfig: no
// defaults, no validation). Only a regular file of at most 16 MiB is read;
// a read error's message starts with `error_prefix`, the caller's name for
// the file ("--config: ").
absl::StatusOr<v1::ObjectiveConfig> ParseObjectiveConfigFile(
    const std::string& path, absl::string_view error_prefix);

// The ordered rules a checkpoint preset stands for.
std::vector<v1::CheckpointRule> PresetRules(
    v1::CheckpointPolicy::Preset preset);

// Config edits by name, as the dflash_head command and the Python binding
// take them. Errors start with `option`, the caller's spelling of the
// setting ("--loss", "loss_type").
//
// The loss family: dflash, dpace, dpace-cumulative-confidence-only,
// dpace-continuation-value-only, tv, lk-lambda, dspark, dpard (dspark's
// D-PARD objective), domino, kl, reverse-kl, jsd (the family's other fields
// reset; cross_entropy kept).
absl::Status SetLossByName(absl::string_view option, absl::string_view name,
                           v1::LossConfig& loss);
// SpecForge's lk_loss_type on the dflash or dpace family: alpha
// (cross-entropy), tv or lambda; the composition's kl_scale and kl_decay,
// when given, too (lambda only).
absl::Status SetLkByName(absl::string_view option, absl::string_view name,
                         std::optional<double> kl_scale,
                         std::optional<double> kl_decay, v1::LossConfig& loss);
// The decay gamma of the config's loss family (D-PACE has none).
absl::Status SetLossGamma(absl::string_view option, double gamma,
                          v1::LossConfig& loss);
// The execution mode: materialize, save, checkpoint, selective, fused.
// Selective without a checkpoint policy of its own gets the
// SELECTIVE_FROZEN_PROJECTION preset.
absl::Status SetModeByName(absl::string_view option, absl::string_view name,
                           v1::ObjectiveConfig& config);

// Bytes one logit occupies in the head's logits buffer.
int64_t BytesPerLogit(v1::HeadConfig::DType dtype);

// Whether the loss family reads a frozen teacher projection (a second logits
// buffer per chunk): LossTraitsOf(loss).needs_teacher (losses/loss_family.h),
// kept for callers of this library.
bool LossNeedsTeacher(const v1::LossConfig& loss);

// Text format of any policy message, fields in declaration order.
std::string ToTextFormat(const google::protobuf::Message& message);

}  // namespace dflash

#endif  // DFLASH_PROTO_CONFIG_H_
