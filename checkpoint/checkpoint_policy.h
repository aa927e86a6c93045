#ifndef DFLASH_CHECKPOINT_CHECKPOINT_POLICY_H_
#define DFLASH_CHECKPOINT_CHECKPOINT_POLICY_H_

// The protobuf side of checkpointing: CheckpointOptions read from a
// v1::CheckpointPolicy (its preset resolved to rules), rules both ways, and
// what each preset stands for. //checkpoint:checkpoint_context itself needs
// no protobuf.

#include <vector>

#include "checkpoint/checkpoint_context.h"
#include "proto/checkpoint.pb.h"

namespace dflash {

CheckpointRule CheckpointRuleFromProto(const v1::CheckpointRule& rule);
v1::CheckpointRule CheckpointRuleToProto(const CheckpointRule& rule);

// The ordered rules a preset stands for (none for PRESET_UNSPECIFIED).
std::vector<CheckpointRule> PresetCheckpointRules(
    v1::CheckpointPolicy::Preset preset);

// The policy's options; with a preset, its rules (the policy's own rules,
// which a valid policy leaves empty then, are ignored).
CheckpointOptions CheckpointOptionsFromPolicy(
    const v1::CheckpointPolicy& policy);

}  // namespace dflash

#endif  // DFLASH_CHECKPOINT_CHECKPOINT_POLICY_H_
