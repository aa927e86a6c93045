#ifndef DFLASH_CHUNKING_CHUNK_PLAN_H_
#define DFLASH_CHUNKING_CHUNK_PLAN_H_

// PlanChunks cuts the rows of a head run into chunks (a ChunkPlan of
// ChunkRanges) under ChunkingOptions: fixed rows, fixed blocks, or a byte
// budget for the logits. Reach for it to decide how many rows each chunk
// projects at once; ProblemShape describes the rows and logits. Plain C++,
// no protobuf: //chunking:chunking_policy reads the options from a
// v1::ChunkingPolicy.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dflash {

// What a chunk plan is cut for: `rows` rows in blocks of `block_size`, each
// chunk holding `logits_buffers` buffers of rows x vocab logits.
struct ProblemShape {
  int64_t rows = 0;
  int64_t block_size = 1;
  int64_t vocab = 0;
  int64_t bytes_per_logit = 4;
  int64_t logits_buffers = 1;
};

// Rows [begin, end) and the bytes of the chunk's logits buffer(s).
struct ChunkRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t logits_bytes = 0;
  int64_t rows() const { return end - begin; }
};

struct ChunkPlan {
  std::vector<ChunkRange> chunks;
  int64_t rows_per_chunk = 0;   // Every chunk but possibly the last.
  int64_t max_chunk_bytes = 0;  // Logits bytes of the largest chunk.
};

// How big a chunk is: exactly one of a row count, a block count or a byte
// budget for its logits buffer(s) (the largest block-aligned chunk that
// fits), as v1::ChunkingPolicy's `size` oneof.
struct ChunkingOptions {
  enum class Size { kUnset, kRowsPerChunk, kBlocksPerChunk, kLogitsBudgetBytes };
  Size size = Size::kUnset;
  int64_t value = 0;  // Rows, blocks or bytes, as `size` says.
  // Keep every block's rows in one chunk (block-level weights need it).
  bool align_to_blocks = true;

  static ChunkingOptions RowsPerChunk(int64_t rows, bool aligned = true) {
    return {Size::kRowsPerChunk, rows, aligned};
  }
  static ChunkingOptions BlocksPerChunk(int64_t blocks) {
    return {Size::kBlocksPerChunk, blocks, true};
  }
  static ChunkingOptions LogitsBudgetBytes(int64_t bytes, bool aligned = true) {
    return {Size::kLogitsBudgetBytes, bytes, aligned};
  }
};

// Whether `options` can plan rows of `shape` (shape.rows is not read): the
// first problem, as "chunking.FIELD: what is wrong, got VALUE" (the config
// field's path). A block size or vocabulary <= 0 skips the checks that need
// it (the caller reports those).
absl::Status ValidateChunkingOptions(const ChunkingOptions& options,
                                     const ProblemShape& shape);

// The most chunks a plan may have (PlanChunks reports more as an error).
inline constexpr int64_t kMaxChunks = int64_t{1} << 20;

// Cuts `shape.rows` into chunks per the policy (fixed rows, fixed blocks, or
// the largest block-aligned chunk whose logits fit the byte budget); the last
// chunk is the remainder. Sizes are 64-bit throughout.
absl::StatusOr<ChunkPlan> PlanChunks(const ChunkingOptions& options,
                                     const ProblemShape& shape);

}  // namespace dflash

#endif  // DFLASH_CHUNKING_CHUNK_PLAN_H_
