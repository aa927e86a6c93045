#include "checkpoint/checkpoint_context.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "proto/config.h"

namespace dflash {
namespace {

bool Matches(const v1::CheckpointRule& rule, const IntermediateInfo& info) {
  if (rule.has_kind() && rule.kind() != info.kind) return false;
  if (rule.has_name()) {
    const std::string& name = rule.name();
    const bool prefix = !name.empty() && name.back() == '*';
    if (prefix ? !absl::StartsWith(info.tag, name.substr(0, name.size() - 1))
               : info.tag != name) {
      return false;
    }
  }
  if (rule.has_weight_frozen() && rule.weight_frozen() != info.weight_frozen) {
    return false;
  }
  if (rule.has_input_requires_grad() &&
      rule.input_requires_grad() != info.input_requires_grad) {
    return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointContext>> CheckpointContext::Create(
    const v1::CheckpointPolicy& policy, TrackingAllocator& allocator) {
  DFLASH_RETURN_IF_ERROR(ValidateCheckpointPolicy(policy));
  std::vector<v1::CheckpointRule> rules =
      policy.has_preset()
          ? PresetRules(policy.preset())
          : std::vector<v1::CheckpointRule>(policy.rules().begin(),
                                            policy.rules().end());
  return std::unique_ptr<CheckpointContext>(
      new CheckpointContext(policy, std::move(rules), allocator));
}

v1::CheckpointAction CheckpointContext::Decide(
    const IntermediateInfo& info) const {
  for (const v1::CheckpointRule& rule : rules_) {
    if (Matches(rule, info)) return rule.action();
  }
  return policy_.default_action();
}

absl::StatusOr<TrackedBuffer<char>> CheckpointContext::Hold(int64_t bytes) {
  DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<char> buffer,
                          TrackedBuffer<char>::Create(allocator_, bytes));
  stats_.current_kept_bytes += bytes;
  stats_.peak_kept_bytes =
      std::max(stats_.peak_kept_bytes, stats_.current_kept_bytes);
  return buffer;
}

void CheckpointContext::Drop(TrackedBuffer<char>& buffer) {
  stats_.current_kept_bytes -= buffer.bytes();
  buffer.Reset();
}

absl::StatusOr<bool> CheckpointContext::Offer(int64_t chunk,
                                              const IntermediateInfo& info,
                                              const TensorView& value,
                                              RecomputeFn recompute) {
  if (chunk < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: chunk must be >= 0, got ", chunk));
  }
  if (!value.is_contiguous() || value.device() != allocator_.device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint: ", info.tag, " of chunk ", chunk, " must be a contiguous ",
        DeviceName(allocator_.device()), " tensor (the allocator's), got ",
        DeviceName(value.device()), " ", value.DebugString()));
  }
  auto& entries = chunks_[chunk];
  if (entries.count(info.tag) > 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint: ", info.tag, " of chunk ", chunk, " was offered twice"));
  }
  const v1::CheckpointAction action = Decide(info);
  const int64_t bytes = value.bytes();
  const bool never_recompute = policy_.segment_chunks() == 0;
  const bool fits = !policy_.has_memory_budget_bytes() ||
                    stats_.current_kept_bytes + bytes <=
                        policy_.memory_budget_bytes();
  bool keep = never_recompute;
  switch (action) {
    case v1::MUST_SAVE:
      keep = true;
      if (!fits) ++stats_.must_save_over_budget;
      break;
    case v1::PREFER_SAVE:
      if (fits) keep = true;
      if (!fits && !never_recompute) ++stats_.budget_refusals;
      break;
    default:
      break;
  }
  if (!keep && !recompute) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint: ", info.tag, " of chunk ", chunk, " is dropped (",
        v1::CheckpointAction_Name(action),
        ") but no recompute function was given"));
  }
  Entry entry{info, value.dtype(), value.shape(), std::move(recompute), {},
              keep, offers_++};
  if (keep) {
    DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<char> held, Hold(bytes));
    if (bytes > 0) allocator_.Copy(held.data(), value.data(), bytes);
    entry.held = std::move(held);
  }
  TagStats& tag = stats_.per_tag[info.tag];
  ++tag.offered;
  if (keep) ++tag.kept;
  entries.emplace(info.tag, std::move(entry));
  return keep;
}

absl::Status CheckpointContext::RecomputeSegment(int64_t segment) {
  ++stats_.segment_recomputes;
  const int64_t k = policy_.segment_chunks();
  std::vector<std::pair<const std::string*, Entry*>> dropped;
  for (auto it = chunks_.lower_bound(segment * k);
       it != chunks_.end() && it->first < (segment + 1) * k; ++it) {
    for (auto& [name, entry] : it->second) {
      if (!entry.kept && entry.held.data() == nullptr) {
        dropped.emplace_back(&name, &entry);
      }
    }
  }
  std::sort(dropped.begin(), dropped.end(), [](const auto& a, const auto& b) {
    return a.second->sequence < b.second->sequence;
  });
  for (auto& [name, entry] : dropped) {
    const int64_t bytes = TensorView(nullptr, entry->dtype, entry->shape).bytes();
    DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<char> held, Hold(bytes));
    entry->held = std::move(held);
    absl::Status done = entry->recompute(TensorView(
        entry->held.data(), entry->dtype, entry->shape, allocator_.device()));
    if (!done.ok()) {
      Drop(entry->held);
      return done;
    }
    TagStats& tag = stats_.per_tag[*name];
    ++tag.recomputed;
    tag.recomputed_flops += entry->info.recompute_flops;
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorView> CheckpointContext::Fetch(int64_t chunk,
                                                    absl::string_view tag) {
  const auto not_found = [&] {
    return absl::NotFoundError(absl::StrCat(
        "checkpoint: nothing was offered as ", tag, " for chunk ", chunk,
        " (or it was released)"));
  };
  auto chunk_it = chunks_.find(chunk);
  if (chunk_it == chunks_.end()) return not_found();
  auto it = chunk_it->second.find(tag);
  if (it == chunk_it->second.end()) return not_found();
  Entry& entry = it->second;
  if (entry.held.data() == nullptr && !entry.kept) {
    DFLASH_RETURN_IF_ERROR(RecomputeSegment(chunk / policy_.segment_chunks()));
  }
  return TensorView(entry.held.data(), entry.dtype, entry.shape,
                    allocator_.device());
}

void CheckpointContext::Release(int64_t chunk) {
  auto it = chunks_.find(chunk);
  if (it == chunks_.end()) return;
  for (auto& [name, entry] : it->second) Drop(entry.held);
  chunks_.erase(it);
}

}  // namespace dflash
