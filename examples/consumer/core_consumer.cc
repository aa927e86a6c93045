// Uses dflash's core libraries alone, through plain C++ options: the chunk
// planner, the checkpoint context and the batch layout. No protobuf, no
// heads, no CUDA in its closure.
#include <iostream>

#include "base/tracking_allocator.h"
#include "checkpoint/checkpoint_context.h"
#include "chunking/chunk_plan.h"
#include "losses/batch_layout.h"

int main() {
  absl::StatusOr<dflash::ChunkPlan> plan =
      dflash::PlanChunks(dflash::ChunkingOptions::LogitsBudgetBytes(64 << 20),
                         {.rows = 4096 * 16,
                          .block_size = 16,
                          .vocab = 151936,
                          .bytes_per_logit = 2});
  if (!plan.ok()) {
    std::cerr << plan.status() << "\n";
    return 1;
  }
  std::cout << plan->chunks.size() << " chunks of up to "
            << plan->rows_per_chunk << " rows\n";

  dflash::CheckpointOptions options;
  options.segment_chunks = 2;
  options.rules.push_back({.kind = dflash::IntermediateKind::kProjection,
                           .action = dflash::CheckpointAction::kMustSave});
  dflash::TrackingAllocator allocator;
  auto context = dflash::CheckpointContext::Create(options, allocator);
  if (!context.ok()) {
    std::cerr << context.status() << "\n";
    return 1;
  }
  const dflash::IntermediateInfo logits{
      "logits", dflash::IntermediateKind::kProjection, true, false, 0};
  std::cout << "logits: "
            << dflash::CheckpointActionName((*context)->Decide(logits))
            << "\n";

  const std::vector<int64_t> ids = {5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<uint8_t> mask(8, 1);
  auto rows = dflash::LabelRows({1, 8, ids, mask}, {2}, {1}, 1, 4, 100,
                                dflash::Labeling::kDFlash);
  if (!rows.ok()) {
    std::cerr << rows.status() << "\n";
    return 1;
  }
  std::cout << rows->size() << " rows, first target " << (*rows)[1].target
            << "\n";
  return 0;
}
