#ifndef DFLASH_HEADS_HEAD_PLAN_H_
#define DFLASH_HEADS_HEAD_PLAN_H_

// PlanHead: how a head run splits a batch (HeadPlan: the chunk plan, the
// rows it projects, the checkpoint policy), and PredictPeakBytes, an upper
// bound on the bytes a run will hold, computed before it runs. Use them to
// inspect a run's chunking or to check that it fits a memory limit.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "checkpoint/checkpoint_context.h"
#include "chunking/chunk_plan.h"
#include "losses/chunk_loss.h"
#include "proto/objective.pb.h"

namespace dflash {

// How a head run splits a batch: the chunk plan (one chunk of all rows in
// MATERIALIZE), the rows it projects (WeightedRows: weighted, target not
// ignore_index unless such rows count, ascending) and each chunk's share of them, and the checkpoint policy its
// context runs (SAVE_ALL for MATERIALIZE and SAVE_CHUNKS; none in FUSED).
struct HeadPlan {
  ChunkPlan chunks;
  std::vector<int64_t> active;
  std::vector<int64_t> chunk_begin;  // Chunk c: active[begin[c], begin[c+1]).
  int64_t max_chunk_rows = 0;        // The most projected rows in a chunk.
  v1::CheckpointPolicy policy;

  int64_t rows(int64_t chunk) const {
    return chunk_begin[chunk + 1] - chunk_begin[chunk];
  }
};

// What a head run tells its checkpoint context about a chunk of `rows`
// projected rows: its logits gradient (what backward needs; frozen when the
// head is) and its teacher logits (a frozen projection of an input without
// gradient). Recompute flops are one projection of the rows.
inline constexpr char kLogitsGradientTag[] = "logits_gradient";
inline constexpr char kTeacherLogitsTag[] = "teacher_logits";
IntermediateInfo LogitsGradientInfo(const v1::HeadConfig& head, int64_t rows);
IntermediateInfo TeacherLogitsInfo(const v1::HeadConfig& head, int64_t rows);

// `config` validated; `element_bytes` of the head's tensors (4 for FLOAT32).
// With head.row_selection ALL_ROWS the plan is PlanAllRows's.
absl::StatusOr<HeadPlan> PlanHead(const v1::ObjectiveConfig& config,
                                  absl::Span<const RowMeta> rows,
                                  int64_t element_bytes);

// The plan of head.row_selection ALL_ROWS from the row count alone: every
// row projected (active = 0..rows-1, each chunk's rows its range), so
// nothing of the rows' metadata is read. Chunks must be whole blocks (the
// loss's blocks are then rows [j K, (j + 1) K) of a chunk): InvalidArgument
// naming head.row_selection otherwise.
absl::StatusOr<HeadPlan> PlanAllRows(const v1::ObjectiveConfig& config,
                                     int64_t rows, int64_t element_bytes);

// An upper bound on the bytes a head run of `config` over `rows` holds at
// once, from its plan and checkpoint policy alone, before it runs: the
// chunk workspaces (logits, teacher logits, gathered rows and their
// gradient), what the policy keeps (MUST_SAVE always, PREFER_SAVE up to the
// budget, everything with segment_chunks 0), and what backward recomputes
// at once (a segment of chunks' dropped intermediates). RunHead's measured
// peak stays within it; RunCudaHead's also holds the CUDA loss's per-row
// scratch (about 260 bytes a row) and the projected-row index.
absl::StatusOr<int64_t> PredictPeakBytes(const v1::ObjectiveConfig& config,
                                         absl::Span<const RowMeta> rows,
                                         int64_t element_bytes);

}  // namespace dflash

#endif  // DFLASH_HEADS_HEAD_PLAN_H_
