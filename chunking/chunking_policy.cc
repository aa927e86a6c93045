#include "chunking/chunking_policy.h"

namespace dflash {

ChunkingOptions ChunkingOptionsFromPolicy(const v1::ChunkingPolicy& policy) {
  ChunkingOptions options;
  options.align_to_blocks = policy.align_to_blocks();
  switch (policy.size_case()) {
    case v1::ChunkingPolicy::kRowsPerChunk:
      options.size = ChunkingOptions::Size::kRowsPerChunk;
      options.value = policy.rows_per_chunk();
      break;
    case v1::ChunkingPolicy::kBlocksPerChunk:
      options.size = ChunkingOptions::Size::kBlocksPerChunk;
      options.value = policy.blocks_per_chunk();
      break;
    case v1::ChunkingPolicy::kLogitsBudgetBytes:
      options.size = ChunkingOptions::Size::kLogitsBudgetBytes;
      options.value = policy.logits_budget_bytes();
      break;
    case v1::ChunkingPolicy::SIZE_NOT_SET:
      break;
  }
  return options;
}

}  // namespace dflash
