#include "checkpoint/checkpoint_context.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

bool Matches(const CheckpointRule& rule, const IntermediateInfo& info) {
  if (rule.kind.has_value() && *rule.kind != info.kind) return false;
  if (rule.name.has_value()) {
    const std::string& name = *rule.name;
    const bool prefix = !name.empty() && name.back() == '*';
    if (prefix ? !absl::StartsWith(info.tag, name.substr(0, name.size() - 1))
               : info.tag != name) {
      return false;
    }
  }
  if (rule.weight_frozen.has_value() &&
      *rule.weight_frozen != info.weight_frozen) {
    return false;
  }
  if (rule.input_requires_grad.has_value() &&
      *rule.input_requires_grad != info.input_requires_grad) {
    return false;
  }
  return true;
}

}  // namespace

absl::string_view CheckpointActionName(CheckpointAction action) {
  switch (action) {
    case CheckpointAction::kMustSave:
      return "MUST_SAVE";
    case CheckpointAction::kPreferSave:
      return "PREFER_SAVE";
    case CheckpointAction::kPreferRecompute:
      return "PREFER_RECOMPUTE";
    case CheckpointAction::kMustRecompute:
      return "MUST_RECOMPUTE";
    case CheckpointAction::kUnspecified:
      break;
  }
  return "ACTION_UNSPECIFIED";
}

std::vector<std::string> CheckpointOptionsProblems(
    const CheckpointOptions& options, absl::string_view rules_path) {
  std::vector<std::string> problems;
  auto add = [&](absl::string_view path, absl::string_view what) {
    problems.push_back(absl::StrCat(path, ": ", what));
  };
  if (options.segment_chunks < 0) {
    add("checkpoint.segment_chunks",
        absl::StrCat("must be >= 0, got ", options.segment_chunks));
  }
  if (options.memory_budget_bytes.has_value() &&
      *options.memory_budget_bytes < 0) {
    add("checkpoint.memory_budget_bytes",
        absl::StrCat("must be >= 0, got ", *options.memory_budget_bytes));
  }
  if (options.default_action == CheckpointAction::kUnspecified) {
    add("checkpoint.default_action", "must be set, got ACTION_UNSPECIFIED");
  }
  // Where PREFER_SAVE comes from, for the zero-budget check.
  std::vector<std::string> prefer_save;
  for (size_t i = 0; i < options.rules.size(); ++i) {
    const CheckpointRule& rule = options.rules[i];
    const std::string path = absl::StrCat(rules_path, "[", i, "]");
    if (rule.action == CheckpointAction::kUnspecified) {
      add(path + ".action", "must be set, got ACTION_UNSPECIFIED");
    }
    if (rule.kind == IntermediateKind::kUnspecified) {
      add(path + ".kind",
          "must name a kind (leave it unset to match any), got "
          "KIND_UNSPECIFIED");
    }
    if (rule.name.has_value() && (rule.name->empty() || *rule.name == "*")) {
      add(path + ".name",
          absl::StrCat("must name a tag or a prefix* (leave it unset to "
                       "match any), got \"",
                       *rule.name, "\""));
    }
    if (rule.action == CheckpointAction::kPreferSave) {
      prefer_save.push_back(path);
    }
  }
  if (options.default_action == CheckpointAction::kPreferSave) {
    prefer_save.push_back("checkpoint.default_action");
  }
  if (options.segment_chunks == 0) {
    for (size_t i = 0; i < options.rules.size(); ++i) {
      if (options.rules[i].action == CheckpointAction::kMustRecompute) {
        add("checkpoint.segment_chunks",
            absl::StrCat("0 (never recompute) contradicts MUST_RECOMPUTE in ",
                         rules_path, "[", i, "], got 0"));
      }
    }
    if (options.default_action == CheckpointAction::kMustRecompute) {
      add("checkpoint.segment_chunks",
          "0 (never recompute) contradicts MUST_RECOMPUTE in "
          "checkpoint.default_action, got 0");
    }
  }
  if (options.memory_budget_bytes == 0 && !prefer_save.empty()) {
    add("checkpoint.memory_budget_bytes",
        absl::StrCat("is 0, so PREFER_SAVE in ",
                     absl::StrJoin(prefer_save, ", "),
                     " could never save; raise the budget or use "
                     "MUST_SAVE/PREFER_RECOMPUTE, got 0"));
  }
  return problems;
}

absl::Status ValidateCheckpointOptions(const CheckpointOptions& options) {
  const std::vector<std::string> problems = CheckpointOptionsProblems(options);
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(problems, "\n"));
}

absl::StatusOr<std::unique_ptr<CheckpointContext>> CheckpointContext::Create(
    CheckpointOptions options, TrackingAllocator& allocator) {
  DFLASH_RETURN_IF_ERROR(ValidateCheckpointOptions(options));
  return std::unique_ptr<CheckpointContext>(
      new CheckpointContext(std::move(options), allocator));
}

CheckpointAction CheckpointContext::Decide(
    const IntermediateInfo& info) const {
  for (const CheckpointRule& rule : options_.rules) {
    if (Matches(rule, info)) return rule.action;
  }
  return options_.default_action;
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
  const CheckpointAction action = Decide(info);
  const int64_t bytes = value.bytes();
  const bool never_recompute = options_.segment_chunks == 0;
  const bool fits = !options_.memory_budget_bytes.has_value() ||
                    stats_.current_kept_bytes + bytes <=
                        *options_.memory_budget_bytes;
  bool keep = never_recompute;
  switch (action) {
    case CheckpointAction::kMustSave:
      keep = true;
      if (!fits) ++stats_.must_save_over_budget;
      break;
    case CheckpointAction::kPreferSave:
      if (fits) keep = true;
      if (!fits && !never_recompute) ++stats_.budget_refusals;
      break;
    default:
      break;
  }
  if (!keep && !recompute) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint: ", info.tag, " of chunk ", chunk, " is dropped (",
        CheckpointActionName(action),
        ") but no recompute function was given"));
  }
  Entry entry{info, value.dtype(), value.shape(), std::move(recompute), {},
              keep, offers_++};
  if (keep) {
    DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<char> held, Hold(bytes));
    if (bytes > 0) {
      DFLASH_RETURN_IF_ERROR(allocator_.Copy(held.data(), value.data(), bytes));
    }
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
  const int64_t k = options_.segment_chunks;
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
    DFLASH_RETURN_IF_ERROR(RecomputeSegment(chunk / options_.segment_chunks));
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

void CheckpointContext::ReleaseRecomputed(int64_t chunk) {
  auto it = chunks_.find(chunk);
  if (it == chunks_.end()) return;
  for (auto& [name, entry] : it->second) {
    if (!entry.kept) Drop(entry.held);
  }
}

void CheckpointContext::Discard(int64_t chunk, absl::string_view tag) {
  auto chunk_it = chunks_.find(chunk);
  if (chunk_it == chunks_.end()) return;
  auto it = chunk_it->second.find(tag);
  if (it == chunk_it->second.end()) return;
  Drop(it->second.held);
  chunk_it->second.erase(it);
  if (chunk_it->second.empty()) chunks_.erase(chunk_it);
}

}  // namespace dflash
