#ifndef DFLASH_CHECKPOINT_CHECKPOINT_CONTEXT_H_
#define DFLASH_CHECKPOINT_CHECKPOINT_CONTEXT_H_

// CheckpointContext decides, per intermediate a chunk offers in forward,
// whether to keep it or recompute it in backward, by the rules and memory
// budget of CheckpointOptions, and hands it back in backward (Fetch).
// Plain C++, no protobuf: //checkpoint:checkpoint_policy reads the options
// from a v1::CheckpointPolicy.
// Use it to trade recomputation for memory in a chunked forward/backward;
// CheckpointStats reports what was kept and what was recomputed.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/tensor.h"
#include "base/tracking_allocator.h"

namespace dflash {

// What kind of value an intermediate is (v1::IntermediateKind's values).
enum class IntermediateKind {
  kUnspecified = 0,
  kProjection = 1,      // Output of a vocabulary projection (logits).
  kLossStatistics = 2,  // Per-row statistics of a loss.
  kLogitsGradient = 3,  // d(loss)/d(logits) of a chunk.
  kOther = 4,
};

// What a context does with an intermediate (v1::CheckpointAction's values).
// PREFER_* yields to the memory budget; MUST_* does not.
enum class CheckpointAction {
  kUnspecified = 0,
  kMustSave = 1,
  kPreferSave = 2,
  kPreferRecompute = 3,
  kMustRecompute = 4,
};

// The config's name of an action ("MUST_SAVE", ...), for messages.
absl::string_view CheckpointActionName(CheckpointAction action);

// One rule: every set matcher must match; unset matchers match anything.
struct CheckpointRule {
  std::optional<IntermediateKind> kind;
  std::optional<std::string> name;  // Exact tag, or a prefix ending in '*'.
  std::optional<bool> weight_frozen;
  std::optional<bool> input_requires_grad;
  CheckpointAction action = CheckpointAction::kUnspecified;
};

// What a context keeps: ordered rules (the first match decides), the
// action for intermediates no rule matches, and a budget for PREFER_SAVE.
struct CheckpointOptions {
  // A segment of this many consecutive chunks is recomputed together in
  // backward; 0 means never recompute.
  int64_t segment_chunks = 1;
  std::optional<int64_t> memory_budget_bytes;  // Unset: no limit.
  std::vector<CheckpointRule> rules;
  CheckpointAction default_action = CheckpointAction::kPreferRecompute;
};

// Every problem of `options`, one "path: what is wrong, got VALUE" each,
// with paths under "checkpoint." and the rules named `rules_path`[i] (how
// the caller's config spells them).
std::vector<std::string> CheckpointOptionsProblems(
    const CheckpointOptions& options,
    absl::string_view rules_path = "checkpoint.rules");

// The problems as one InvalidArgument error, a line each; OK when none.
absl::Status ValidateCheckpointOptions(const CheckpointOptions& options);

// What a stage says about an intermediate it produced.
struct IntermediateInfo {
  std::string tag;
  IntermediateKind kind = IntermediateKind::kOther;
  bool weight_frozen = false;
  bool input_requires_grad = true;
  int64_t recompute_flops = 0;
};

// Writes the intermediate again into `out` (contiguous, the offered shape).
using RecomputeFn = std::function<absl::Status(const TensorView& out)>;

struct TagStats {
  int64_t offered = 0;
  int64_t kept = 0;
  int64_t recomputed = 0;
  int64_t recomputed_flops = 0;
};

struct CheckpointStats {
  int64_t current_kept_bytes = 0;  // Kept and recomputed tensors held now.
  int64_t peak_kept_bytes = 0;
  int64_t segment_recomputes = 0;  // Segments run again in backward.
  int64_t must_save_over_budget = 0;  // MUST_SAVE kept beyond the budget.
  int64_t budget_refusals = 0;        // PREFER_SAVE dropped for the budget.
  std::map<std::string, TagStats> per_tag;
};

// Decides, per intermediate, keep or recompute, by the policy's ordered rules
// (first match wins; the default action otherwise):
// - MUST_SAVE keeps, even beyond the budget (counted in the stats);
// - PREFER_SAVE keeps while the tensors held plus this one fit
//   memory_budget_bytes, in offer order (deterministic), else recomputes;
// - PREFER_RECOMPUTE and MUST_RECOMPUTE drop; with segment_chunks = 0
//   (never recompute) PREFER_RECOMPUTE keeps.
// Backward fetches a dropped tensor by recomputing its whole segment (the
// segment_chunks consecutive chunks containing it) once, in offer order, so
// that a recompute function may Fetch what was offered before it; the
// recomputed tensors are held until Release() (or ReleaseRecomputed()) of
// their chunk. Kept tensors
// live in a store owned through the TrackingAllocator, on its device. Not
// thread-safe.
class CheckpointContext {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointContext>> Create(
      CheckpointOptions options, TrackingAllocator& allocator);

  // The action the rules give `info`.
  CheckpointAction Decide(const IntermediateInfo& info) const;

  // Forward: offers a contiguous tensor of chunk `chunk`, in the allocator's
  // memory (host, or a CUDA device's); copies it into the store when kept. Returns whether it was kept. `recompute` may be
  // empty only for an intermediate that will be kept.
  absl::StatusOr<bool> Offer(int64_t chunk, const IntermediateInfo& info,
                             const TensorView& value, RecomputeFn recompute);

  // Backward: the tensor, kept or recomputed; valid until Release(chunk).
  absl::StatusOr<TensorView> Fetch(int64_t chunk, absl::string_view tag);

  // Frees everything held for `chunk`.
  void Release(int64_t chunk);

  // Frees what backward recomputed for `chunk` and keeps what forward kept,
  // so that a second backward pass finds the chunk as the first did (a
  // later Fetch recomputes again).
  void ReleaseRecomputed(int64_t chunk);

  // Forgets `tag` of `chunk` (frees it if held): for an intermediate that
  // nothing will Fetch, e.g. teacher logits once the logits gradient they
  // would recompute is kept. No-op when nothing was offered as `tag`.
  void Discard(int64_t chunk, absl::string_view tag);

  const CheckpointStats& stats() const { return stats_; }

 private:
  struct Entry {
    IntermediateInfo info;
    DType dtype;
    Shape shape;
    RecomputeFn recompute;
    TrackedBuffer<char> held;  // Kept copy or recomputed tensor; may be empty.
    bool kept = false;
    int64_t sequence = 0;  // Offer order: recomputation follows it.
  };
  CheckpointContext(CheckpointOptions options, TrackingAllocator& allocator)
      : options_(std::move(options)), allocator_(allocator) {}
  absl::Status RecomputeSegment(int64_t segment);
  absl::StatusOr<TrackedBuffer<char>> Hold(int64_t bytes);
  void Drop(TrackedBuffer<char>& buffer);

  const CheckpointOptions options_;
  TrackingAllocator& allocator_;
  std::map<int64_t, std::map<std::string, Entry, std::less<>>> chunks_;
  CheckpointStats stats_;
  int64_t offers_ = 0;
};

}  // namespace dflash

#endif  // DFLASH_CHECKPOINT_CHECKPOINT_CONTEXT_H_
