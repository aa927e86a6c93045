#include "proto/config.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/file.h"
#include "base/problem_list.h"
#include "base/status_macros.h"
#include "checkpoint/checkpoint_context.h"
#include "checkpoint/checkpoint_policy.h"
#include "chunking/chunk_plan.h"
#include "chunking/chunking_policy.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "heads/config/head_config.h"
#include "heads/config/head_facts.h"
#include "losses/loss_family.h"

namespace dflash {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  explicit CollectErrors(absl::string_view source) : source_(source) {}
  void AddError(int line, int column, const std::string& message) override {
    errors_.push_back(
        absl::StrCat(source_, ":", line + 1, ":", column + 1, ": ", message));
  }
  void AddWarning(int line, int column, const std::string& message) override {
    AddError(line, column, message);
  }
  std::string Joined() const { return absl::StrJoin(errors_, "\n"); }

 private:
  std::string source_;
  std::vector<std::string> errors_;
};

// Writes explicit defaults into every singular field that has one, creating
// the non-oneof sub-messages so that the whole policy is visible.
void FillDefaults(Message& message) {
  const Reflection* reflection = message.GetReflection();
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) continue;
    const bool in_oneof = field->containing_oneof() != nullptr;
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (!in_oneof || reflection->HasField(message, field)) {
        FillDefaults(*reflection->MutableMessage(&message, field));
      }
      continue;
    }
    if (in_oneof || !field->has_default_value() ||
        reflection->HasField(message, field)) {
      continue;
    }
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(&message, field, field->default_value_int32());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(&message, field, field->default_value_int64());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        reflection->SetDouble(&message, field, field->default_value_double());
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(&message, field, field->default_value_bool());
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        reflection->SetEnum(&message, field, field->default_value_enum());
        break;
      default:
        break;
    }
  }
}

// Config problems are collected in base/problem_list.h's ProblemList.
using Problems = ProblemList;

void ValidateLayout(const v1::BatchLayout& layout, Problems& problems) {
  problems.Above("layout.block_size", layout.block_size(), 0);
  problems.Above("layout.num_anchors", layout.num_anchors(), 0);
}

void ValidateChunking(const v1::ObjectiveConfig& config, Problems& problems) {
  const v1::ChunkingPolicy& chunking = config.chunking();
  // The chunk plan's own check (chunking/chunk_plan.h), for one block of
  // the config's vocabulary; it names its field.
  const absl::Status plan = ValidateChunkingOptions(
      ChunkingOptionsFromPolicy(chunking),
      {.rows = 0,
       .block_size = config.layout().block_size(),
       .vocab = config.head().vocab_size(),
       .bytes_per_logit = BytesPerLogit(config.head().dtype()),
       .logits_buffers = LogitsBuffers(config)});
  if (!plan.ok()) problems.AddLine(std::string(plan.message()));
  const v1::LossConfig& loss = config.loss();
  const LossTraits traits = LossTraitsOf(loss);
  if (traits.couples_blocks && !chunking.align_to_blocks()) {
    problems.Add("chunking.align_to_blocks",
                 absl::StrCat("must be true for loss.", traits.name,
                              " (block-level weights need whole blocks in a "
                              "chunk), got false"));
  }
}

void ValidateCheckpoint(const v1::CheckpointPolicy& checkpoint,
                        Problems& problems) {
  if (checkpoint.has_preset() && checkpoint.rules_size() > 0) {
    problems.Add("checkpoint.rules",
                 absl::StrCat("must be empty when checkpoint.preset is set, got ",
                              checkpoint.rules_size(), " rule(s) with preset ",
                              v1::CheckpointPolicy::Preset_Name(
                                  checkpoint.preset())));
  }
  if (checkpoint.has_preset() &&
      checkpoint.preset() == v1::CheckpointPolicy::PRESET_UNSPECIFIED) {
    problems.Add("checkpoint.preset", "must be a named preset, got "
                                      "PRESET_UNSPECIFIED");
  }
  // The checkpoint context's own checks (checkpoint/checkpoint_context.h),
  // on the rules the policy stands for.
  const std::string rules_path =
      checkpoint.has_preset()
          ? absl::StrCat("checkpoint.preset ",
                         v1::CheckpointPolicy::Preset_Name(checkpoint.preset()),
                         " rule")
          : "checkpoint.rules";
  for (std::string& line : CheckpointOptionsProblems(
           CheckpointOptionsFromPolicy(checkpoint), rules_path)) {
    problems.AddLine(std::move(line));
  }
}

void ValidateHead(const v1::ObjectiveConfig& config, Problems& problems) {
  const v1::HeadConfig& head = config.head();
  AddHeadConfigProblems(head, problems);
  const v1::CheckpointPolicy& checkpoint = config.checkpoint();
  if (head.mode() == v1::HeadConfig::SELECTIVE && !checkpoint.has_preset() &&
      checkpoint.rules_size() == 0) {
    problems.Add("head.mode",
                 "SELECTIVE needs checkpoint.preset or checkpoint.rules to say "
                 "what to keep, got neither");
  }
  if (head.teacher_diagnostics() && LossNeedsTeacher(config.loss())) {
    problems.Add("head.teacher_diagnostics",
                 absl::StrCat("applies to losses that read no teacher; loss.",
                              LossTraitsOf(config.loss()).name,
                              " projects the teacher already, got true"));
  }
  // The batch-level LK lambda scales each row's hidden-state gradient once
  // the batch's acceptance is known; a weight gradient sums rows before
  // that, and would need a second V x H accumulator.
  const LossParams params = LossParamsOf(config.loss());
  if (head.correction_rank() > 0 && params.lk == LkMode::kLambdaBatch) {
    problems.Add("head.correction_rank",
                 absl::StrCat("must be 0 with an lk composition of type "
                              "LAMBDA (the correction weight's gradient sums "
                              "rows before the batch's CE weight is known), "
                              "got ",
                              head.correction_rank()));
  }
  if (params.family == LossFamily::kDomino) {
    const int64_t block_size = config.layout().block_size();
    if (params.suffix_start >= block_size) {
      problems.Add("loss.domino.pure_draft_prefix_len",
                   absl::StrCat("leaves no corrected suffix: suffix_start = ",
                                params.suffix_start,
                                " must be < layout.block_size = ", block_size,
                                ", got ",
                                config.loss().domino().pure_draft_prefix_len()));
    }
  }
  if (head.trainable() && params.lk == LkMode::kLambdaBatch) {
    problems.Add("head.trainable",
                 "must be false with an lk composition of type LAMBDA (its CE "
                 "weight comes from the whole batch, after the weight "
                 "gradient's rows are summed; loss.lk_lambda takes it per "
                 "anchor block and trains), got true");
  }
}

}  // namespace

absl::StatusOr<v1::ObjectiveConfig> ParseObjectiveConfig(
    absl::string_view text, absl::string_view source) {
  // Editors on some systems start UTF-8 files with a byte-order mark.
  absl::ConsumePrefix(&text, "\xEF\xBB\xBF");
  v1::ObjectiveConfig config;
  CollectErrors errors(source);
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &config)) {
    return absl::InvalidArgumentError(errors.Joined());
  }
  return config;
}

v1::ObjectiveConfig ResolveDefaults(v1::ObjectiveConfig config) {
  if (config.mutable_chunking()->size_case() ==
      v1::ChunkingPolicy::SIZE_NOT_SET) {
    config.mutable_chunking()->set_blocks_per_chunk(128);
  }
  FillDefaults(config);
  return config;
}

absl::Status ValidateObjectiveConfig(const v1::ObjectiveConfig& config) {
  Problems problems;
  ValidateLayout(config.layout(), problems);
  ValidateChunking(config, problems);
  ValidateCheckpoint(config.checkpoint(), problems);
  ValidateHead(config, problems);
  AddLossConfigProblems(config.loss(), problems);
  return problems.ToStatus();
}

absl::Status ValidateConfigAsWritten(const v1::ObjectiveConfig& config) {
  Problems problems;
  ValidateLayout(config.layout(), problems);
#ifndef DFLASH_WITH_CUDA
  if (config.head().backend() == v1::HeadConfig::CUDA) {
    problems.Add("head.backend",
                 "CUDA needs a build with the CUDA toolkit, and this one has "
                 "none (CPU runs anywhere), got CUDA");
  }
#endif
  return problems.ToStatus();
}

absl::Status ValidateCheckpointPolicy(const v1::CheckpointPolicy& policy) {
  Problems problems;
  ValidateCheckpoint(policy, problems);
  return problems.ToStatus();
}

absl::StatusOr<v1::ObjectiveConfig> LoadObjectiveConfigFromString(
    absl::string_view text, absl::string_view source) {
  DFLASH_ASSIGN_OR_RETURN(v1::ObjectiveConfig parsed,
                          ParseObjectiveConfig(text, source));
  v1::ObjectiveConfig config = ResolveDefaults(std::move(parsed));
  absl::Status valid = ValidateObjectiveConfig(config);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": invalid config:\n", valid.message()));
  }
  return config;
}

namespace {

// A config file's text; a read error's message starts with `error_prefix`.
absl::StatusOr<std::string> ReadConfigText(const std::string& path,
                                           absl::string_view error_prefix) {
  // Configs are a few hundred bytes; a huge file is a mistake, not a policy.
  constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
  absl::StatusOr<std::string> text = ReadFileToString(path, kMaxConfigBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat(error_prefix, text.status().message()));
  }
  return text;
}

}  // namespace

absl::StatusOr<v1::ObjectiveConfig> LoadObjectiveConfigFromFile(
    const std::string& path) {
  DFLASH_ASSIGN_OR_RETURN(std::string text,
                          ReadConfigText(path, "config file "));
  return LoadObjectiveConfigFromString(text, path);
}

absl::StatusOr<v1::ObjectiveConfig> ParseObjectiveConfigFile(
    const std::string& path, absl::string_view error_prefix) {
  DFLASH_ASSIGN_OR_RETURN(std::string text, ReadConfigText(path, error_prefix));
  return ParseObjectiveConfig(text, path);
}

std::vector<v1::CheckpointRule> PresetRules(
    v1::CheckpointPolicy::Preset preset) {
  std::vector<v1::CheckpointRule> rules;
  for (const CheckpointRule& rule : PresetCheckpointRules(preset)) {
    rules.push_back(CheckpointRuleToProto(rule));
  }
  return rules;
}

absl::Status SetLossByName(absl::string_view option, absl::string_view name,
                           v1::LossConfig& loss) {
  const v1::CrossEntropyOptions ce = loss.cross_entropy();
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
  } else if (name == "dpard") {
    v1::DSparkLoss& dpard = *fresh.mutable_dspark();
    dpard.set_objective(v1::DSparkLoss::DPARD);
    dpard.set_ce_weight(0);
    dpard.set_l1_weight(0);
  } else if (name == "domino") {
    fresh.mutable_domino();
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
        option,
        ": must be one of dflash, dpace, "
        "dpace-cumulative-confidence-only, dpace-continuation-value-only, tv, "
        "lk-lambda, dspark, dpard, domino, kl, reverse-kl, jsd, got '",
        name, "'"));
  }
  *fresh.mutable_cross_entropy() = ce;
  loss = fresh;
  return absl::OkStatus();
}

absl::Status SetLkByName(absl::string_view option, absl::string_view name,
                         std::optional<double> kl_scale,
                         std::optional<double> kl_decay, v1::LossConfig& loss) {
  v1::LkComposition* lk =
      loss.has_dflash()  ? loss.mutable_dflash()->mutable_lk()
      : loss.has_dpace() ? loss.mutable_dpace()->mutable_lk()
                         : nullptr;
  if (lk == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        option, ": applies to the dflash and dpace loss families, got ",
        loss.family_case() == v1::LossConfig::FAMILY_NOT_SET
            ? std::string("none")
            : std::string(LossTraitsOf(loss).name)));
  }
  v1::LkComposition::Type type;
  if (name == "alpha") {
    type = v1::LkComposition::ALPHA;
  } else if (name == "tv") {
    type = v1::LkComposition::TV;
  } else if (name == "lambda") {
    type = v1::LkComposition::LAMBDA;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        option, ": must be one of alpha, tv, lambda, got '", name, "'"));
  }
  lk->set_type(type);
  if (kl_scale.has_value()) lk->set_kl_scale(*kl_scale);
  if (kl_decay.has_value()) lk->set_kl_decay(*kl_decay);
  return absl::OkStatus();
}

absl::Status SetLossGamma(absl::string_view option, double gamma,
                          v1::LossConfig& loss) {
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      loss.mutable_dflash()->set_gamma(gamma);
      break;
    case v1::LossConfig::kTv:
      loss.mutable_tv()->set_gamma(gamma);
      break;
    case v1::LossConfig::kLkLambda:
      loss.mutable_lk_lambda()->set_gamma(gamma);
      break;
    case v1::LossConfig::kDspark:
      loss.mutable_dspark()->set_gamma(gamma);
      break;
    case v1::LossConfig::kDomino:
      loss.mutable_domino()->set_gamma(gamma);
      break;
    case v1::LossConfig::kDistillation:
      loss.mutable_distillation()->set_gamma(gamma);
      break;
    case v1::LossConfig::kDpace:
      return absl::InvalidArgumentError(
          absl::StrCat(option, ": D-PACE has no decay, got ", gamma));
    case v1::LossConfig::FAMILY_NOT_SET:
      return absl::InvalidArgumentError(absl::StrCat(
          option, ": the config names no loss family to decay, got ", gamma));
  }
  return absl::OkStatus();
}

absl::Status SetModeByName(absl::string_view option, absl::string_view name,
                           v1::ObjectiveConfig& config) {
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
        option,
        ": must be one of materialize, save, checkpoint, selective, "
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

int64_t BytesPerLogit(v1::HeadConfig::DType dtype) {
  switch (dtype) {
    case v1::HeadConfig::BFLOAT16:
      return 2;
    case v1::HeadConfig::FLOAT64:
      return 8;
    case v1::HeadConfig::FLOAT32:
    default:
      return 4;
  }
}

bool LossNeedsTeacher(const v1::LossConfig& loss) {
  return LossTraitsOf(loss).needs_teacher;
}

std::string ToTextFormat(const google::protobuf::Message& message) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(message, &text);
  return text;
}

}  // namespace dflash
