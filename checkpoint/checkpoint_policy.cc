#include "checkpoint/checkpoint_policy.h"

namespace dflash {
namespace {

CheckpointRule WithAction(CheckpointAction action) {
  CheckpointRule rule;
  rule.action = action;
  return rule;
}

}  // namespace

// The enums share their values with the protobuf ones.
CheckpointRule CheckpointRuleFromProto(const v1::CheckpointRule& rule) {
  CheckpointRule out;
  if (rule.has_kind()) out.kind = static_cast<IntermediateKind>(rule.kind());
  if (rule.has_name()) out.name = rule.name();
  if (rule.has_weight_frozen()) out.weight_frozen = rule.weight_frozen();
  if (rule.has_input_requires_grad()) {
    out.input_requires_grad = rule.input_requires_grad();
  }
  out.action = static_cast<CheckpointAction>(rule.action());
  return out;
}

v1::CheckpointRule CheckpointRuleToProto(const CheckpointRule& rule) {
  v1::CheckpointRule out;
  if (rule.kind) out.set_kind(static_cast<v1::IntermediateKind>(*rule.kind));
  if (rule.name) out.set_name(*rule.name);
  if (rule.weight_frozen) out.set_weight_frozen(*rule.weight_frozen);
  if (rule.input_requires_grad) {
    out.set_input_requires_grad(*rule.input_requires_grad);
  }
  out.set_action(static_cast<v1::CheckpointAction>(rule.action));
  return out;
}

std::vector<CheckpointRule> PresetCheckpointRules(
    v1::CheckpointPolicy::Preset preset) {
  switch (preset) {
    case v1::CheckpointPolicy::SAVE_ALL:
      return {WithAction(CheckpointAction::kMustSave)};
    case v1::CheckpointPolicy::FULL_RECOMPUTE:
      return {WithAction(CheckpointAction::kMustRecompute)};
    case v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION: {
      // Teacher logits (a frozen projection of an input without gradient)
      // always; other frozen projections within the budget.
      CheckpointRule teacher = WithAction(CheckpointAction::kMustSave);
      teacher.kind = IntermediateKind::kProjection;
      teacher.weight_frozen = true;
      teacher.input_requires_grad = false;
      CheckpointRule frozen = WithAction(CheckpointAction::kPreferSave);
      frozen.kind = IntermediateKind::kProjection;
      frozen.weight_frozen = true;
      return {teacher, frozen, WithAction(CheckpointAction::kMustRecompute)};
    }
    default:
      return {};
  }
}

CheckpointOptions CheckpointOptionsFromPolicy(
    const v1::CheckpointPolicy& policy) {
  CheckpointOptions options;
  options.segment_chunks = policy.segment_chunks();
  if (policy.has_memory_budget_bytes()) {
    options.memory_budget_bytes = policy.memory_budget_bytes();
  }
  if (policy.has_preset()) {
    options.rules = PresetCheckpointRules(policy.preset());
  } else {
    for (const v1::CheckpointRule& rule : policy.rules()) {
      options.rules.push_back(CheckpointRuleFromProto(rule));
    }
  }
  options.default_action =
      static_cast<CheckpointAction>(policy.default_action());
  return options;
}

}  // namespace dflash
