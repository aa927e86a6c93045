#ifndef DFLASH_CHUNKING_CHUNK_PLAN_H_
#define DFLASH_CHUNKING_CHUNK_PLAN_H_

// PlanChunks cuts the rows of a head run into chunks (a ChunkPlan of
// ChunkRanges) under a v1::ChunkingPolicy: fixed rows, fixed blocks, or a
// byte budget for the logits. Reach for it to decide how many rows each
// chunk projects at once; ProblemShape describes the rows and logits.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/policy.pb.h"

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

// The most chunks a plan may have (PlanChunks reports more as an error).
inline constexpr int64_t kMaxChunks = int64_t{1} << 20;

// Cuts `shape.rows` into chunks per the policy (fixed rows, fixed blocks, or
// the largest block-aligned chunk whose logits fit the byte budget); the last
// chunk is the remainder. Sizes are 64-bit throughout.
absl::StatusOr<ChunkPlan> PlanChunks(const v1::ChunkingPolicy& policy,
                                     const ProblemShape& shape);

}  // namespace dflash

#endif  // DFLASH_CHUNKING_CHUNK_PLAN_H_
