#include "heads/head_plan.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/tracking_allocator.h"
#include "checkpoint/checkpoint_context.h"
#include "checkpoint/checkpoint_policy.h"
#include "chunking/chunking_policy.h"
#include "heads/config/head_facts.h"
#include "heads/row_compaction.h"
#include "losses/loss_family.h"

namespace dflash {

namespace {

int64_t ProjectionFlops(const v1::HeadConfig& head, int64_t rows) {
  return static_cast<int64_t>(2.0 * rows * head.hidden_size() *
                              head.vocab_size());
}

}  // namespace

IntermediateInfo LogitsGradientInfo(const v1::HeadConfig& head, int64_t rows) {
  return {kLogitsGradientTag, IntermediateKind::kLogitsGradient,
          /*weight_frozen=*/!head.trainable(), /*input_requires_grad=*/true,
          ProjectionFlops(head, rows)};
}

IntermediateInfo TeacherLogitsInfo(const v1::HeadConfig& head, int64_t rows) {
  // No gradient flows through the teacher logits, into the weight or the
  // input, even when the head trains: for them the weight is frozen.
  return {kTeacherLogitsTag, IntermediateKind::kProjection, /*weight_frozen=*/true,
          /*input_requires_grad=*/false, ProjectionFlops(head, rows)};
}

namespace {

// The plan's chunks of `n` rows and checkpoint policy; the active rows are
// the caller's.
absl::StatusOr<HeadPlan> PlanChunksOf(const v1::ObjectiveConfig& config,
                                      int64_t n, int64_t element_bytes) {
  const v1::HeadConfig::ExecutionMode mode = config.head().mode();
  const ChunkingOptions chunking =
      mode == v1::HeadConfig::MATERIALIZE
          ? ChunkingOptions::RowsPerChunk(n, /*aligned=*/false)
          : ChunkingOptionsFromPolicy(config.chunking());
  DFLASH_ASSIGN_OR_RETURN(
      ChunkPlan chunks,
      PlanChunks(chunking,
                 {n, config.layout().block_size(), config.head().vocab_size(),
                  element_bytes, LogitsBuffers(config)}));
  HeadPlan plan;
  plan.chunks = std::move(chunks);
  plan.policy = config.checkpoint();
  if (mode == v1::HeadConfig::MATERIALIZE ||
      mode == v1::HeadConfig::SAVE_CHUNKS) {
    plan.policy = v1::CheckpointPolicy();
    plan.policy.set_preset(v1::CheckpointPolicy::SAVE_ALL);
  }
  return plan;
}

// Each chunk's share of plan.active, and the largest.
void SplitActive(HeadPlan& plan) {
  for (const ChunkRange& chunk : plan.chunks.chunks) {
    plan.chunk_begin.push_back(
        std::lower_bound(plan.active.begin(), plan.active.end(), chunk.begin) -
        plan.active.begin());
  }
  plan.chunk_begin.push_back(static_cast<int64_t>(plan.active.size()));
  for (size_t c = 0; c + 1 < plan.chunk_begin.size(); ++c) {
    plan.max_chunk_rows = std::max(plan.max_chunk_rows, plan.rows(c));
  }
}

}  // namespace

absl::StatusOr<HeadPlan> PlanHead(const v1::ObjectiveConfig& config,
                                  absl::Span<const RowMeta> rows,
                                  int64_t element_bytes) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (config.head().row_selection() == v1::HeadConfig::ALL_ROWS) {
    return PlanAllRows(config, n, element_bytes);
  }
  DFLASH_ASSIGN_OR_RETURN(HeadPlan plan,
                          PlanChunksOf(config, n, element_bytes));
  plan.active = WeightedRows(rows, LossParamsOf(config.loss()));
  SplitActive(plan);
  return plan;
}

absl::StatusOr<HeadPlan> PlanAllRows(const v1::ObjectiveConfig& config,
                                     int64_t rows, int64_t element_bytes) {
  DFLASH_ASSIGN_OR_RETURN(HeadPlan plan,
                          PlanChunksOf(config, rows, element_bytes));
  const int64_t k = config.layout().block_size();
  for (const ChunkRange& chunk : plan.chunks.chunks) {
    if (chunk.begin % k != 0 || chunk.end % k != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head.row_selection: ALL_ROWS needs chunks of whole blocks of ", k,
          " rows (a block-aligned chunking), got a chunk of rows [",
          chunk.begin, ", ", chunk.end, ")"));
    }
  }
  plan.active.resize(rows);
  for (int64_t r = 0; r < rows; ++r) plan.active[r] = r;
  SplitActive(plan);
  return plan;
}

absl::StatusOr<int64_t> PredictPeakBytes(const v1::ObjectiveConfig& config,
                                         absl::Span<const RowMeta> rows,
                                         int64_t element_bytes) {
  DFLASH_ASSIGN_OR_RETURN(HeadPlan plan, PlanHead(config, rows, element_bytes));
  const int64_t v = config.head().vocab_size();
  const int64_t h = config.head().hidden_size();
  const bool teacher = ProjectsTeacher(config);
  // A split correction doubles the logits and their gradient.
  const int64_t split = SplitsCorrection(config) ? 2 : 1;
  const int64_t m = plan.max_chunk_rows;
  const int64_t chunk_logits = m * v * element_bytes;
  const int64_t row_buffers =
      2 * m * (h + config.head().correction_rank()) * element_bytes;
  const int64_t workspace =
      chunk_logits * LogitsBuffers(config) + row_buffers;
  if (config.head().mode() == v1::HeadConfig::FUSED) return workspace;

  // What the policy does with each intermediate the head offers.
  TrackingAllocator unused;
  DFLASH_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointContext> context,
                          CheckpointContext::Create(
                              CheckpointOptionsFromPolicy(plan.policy),
                              unused));
  std::vector<std::pair<IntermediateInfo, int64_t>> offered = {
      {LogitsGradientInfo(config.head(), split * m), split}};
  if (teacher) offered.push_back({TeacherLogitsInfo(config.head(), m), 1});
  const bool never_recompute = plan.policy.segment_chunks() == 0;
  int64_t must = 0, prefer = 0, dropped_per_chunk = 0;
  const int64_t chunks = static_cast<int64_t>(plan.chunks.chunks.size());
  for (const auto& [info, buffers] : offered) {
    const CheckpointAction action = context->Decide(info);
    int64_t all_chunks = 0;
    for (int64_t c = 0; c < chunks; ++c)
      all_chunks += buffers * plan.rows(c) * v * element_bytes;
    if (never_recompute || action == CheckpointAction::kMustSave) {
      must += all_chunks;
    } else if (action == CheckpointAction::kPreferSave) {
      prefer += all_chunks;
      dropped_per_chunk += buffers * chunk_logits;
    } else {
      dropped_per_chunk += buffers * chunk_logits;
    }
  }
  if (plan.policy.has_memory_budget_bytes()) {
    prefer = std::min(prefer, plan.policy.memory_budget_bytes());
  }
  const int64_t kept = must + prefer;
  const int64_t segment =
      never_recompute ? 0 : std::min(plan.policy.segment_chunks(), chunks);
  const int64_t forward = workspace + kept;
  const int64_t backward = kept + segment * dropped_per_chunk + row_buffers;
  return std::max(forward, backward);
}

}  // namespace dflash
