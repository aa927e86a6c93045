#ifndef DFLASH_CHECKPOINT_CHECKPOINT_CONTEXT_H_
#define DFLASH_CHECKPOINT_CHECKPOINT_CONTEXT_H_

// CheckpointContext decides, per intermediate a chunk offers in forward,
// whether to keep it or recompute it in backward, by the rules and memory
// budget of a v1::CheckpointPolicy, and hands it back in backward (Fetch).
// Use it to trade recomputation for memory in a chunked forward/backward;
// CheckpointStats reports what was kept and what was recomputed.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/tensor.h"
#include "base/tracking_allocator.h"
#include "proto/policy.pb.h"

namespace dflash {

// What a stage says about an intermediate it produced.
struct IntermediateInfo {
  std::string tag;
  v1::IntermediateKind kind = v1::OTHER;
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
// recomputed tensors are held until Release() of their chunk. Kept tensors
// live in a store owned through the TrackingAllocator, on its device. Not
// thread-safe.
class CheckpointContext {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointContext>> Create(
      const v1::CheckpointPolicy& policy, TrackingAllocator& allocator);

  // The action the rules give `info`.
  v1::CheckpointAction Decide(const IntermediateInfo& info) const;

  // Forward: offers a contiguous tensor of chunk `chunk`, in the allocator's
  // memory (host, or a CUDA device's); copies it into the store when kept. Returns whether it was kept. `recompute` may be
  // empty only for an intermediate that will be kept.
  absl::StatusOr<bool> Offer(int64_t chunk, const IntermediateInfo& info,
                             const TensorView& value, RecomputeFn recompute);

  // Backward: the tensor, kept or recomputed; valid until Release(chunk).
  absl::StatusOr<TensorView> Fetch(int64_t chunk, absl::string_view tag);

  // Frees everything held for `chunk`.
  void Release(int64_t chunk);

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
  CheckpointContext(const v1::CheckpointPolicy& policy,
                    std::vector<v1::CheckpointRule> rules,
                    TrackingAllocator& allocator)
      : policy_(policy), rules_(std::move(rules)), allocator_(allocator) {}
  absl::Status RecomputeSegment(int64_t segment);
  absl::StatusOr<TrackedBuffer<char>> Hold(int64_t bytes);
  void Drop(TrackedBuffer<char>& buffer);

  const v1::CheckpointPolicy policy_;
  const std::vector<v1::CheckpointRule> rules_;
  TrackingAllocator& allocator_;
  std::map<int64_t, std::map<std::string, Entry, std::less<>>> chunks_;
  CheckpointStats stats_;
  int64_t offers_ = 0;
};

}  // namespace dflash

#endif  // DFLASH_CHECKPOINT_CHECKPOINT_CONTEXT_H_
