#ifndef DFLASH_CLI_JOB_MEMORY_H_
#define DFLASH_CLI_JOB_MEMORY_H_

// What a dflash_head job will hold at its peak, predicted before anything
// is allocated, and the refusal (ResourceExhausted, each part named) of a
// job that would not fit the memory it may use.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/objective.pb.h"

namespace dflash {

// How much the job may hold, and where that figure comes from.
struct MemoryBudget {
  int64_t bytes = 0;
  std::string source;  // "--memory_limit", or the system's own measure.
};

// --memory_limit when given, else what the system has available; none
// where the system says nothing.
std::optional<MemoryBudget> JobMemoryBudget(
    std::optional<int64_t> memory_limit);

// The batch's host tensors, and the gradients of `sets` runs held at once,
// overflow-checked: B sequences of S tokens, N anchors, plus `transient`
// bytes the batch holds while it is read.
absl::StatusOr<std::pair<int64_t, int64_t>> HostBytes(
    const v1::ObjectiveConfig& config, int64_t b, int64_t s, int64_t n,
    int64_t transient, int64_t sets);

// What a job holds at its peak, by part.
struct JobBytes {
  int64_t batch = 0, gradients = 0;
  // The head's workspaces (PredictPeakBytes), once the rows are known.
  std::optional<int64_t> head;
  int64_t layout = 0;  // The weight laid out for oneDNN, when it is.
  // What the libraries touch as they run: code pages, BLAS packing buffers,
  // thread stacks and per-thread heaps.
  int64_t runtime = 0;

  std::optional<int64_t> Total() const;  // None on overflow.
};

// The libraries' share of a run on `threads` threads.
int64_t RuntimeBytes(int threads);

// OK when `bytes` fit the budget (or there is none to check); else
// ResourceExhausted naming every part and the budget's source.
absl::Status CheckFits(const std::optional<MemoryBudget>& budget,
                       const JobBytes& bytes);

}  // namespace dflash

#endif  // DFLASH_CLI_JOB_MEMORY_H_
