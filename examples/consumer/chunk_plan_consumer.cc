// Uses dflash's chunk planner alone: plain C++ options, no protobuf, no
// heads, no CUDA in its closure.
#include <iostream>

#include "chunking/chunk_plan.h"

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
  return 0;
}
