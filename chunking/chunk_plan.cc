#include "chunking/chunk_plan.h"

#include <algorithm>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

absl::Status CheckShape(const ProblemShape& shape, bool aligned) {
  if (shape.rows <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk plan: rows must be > 0, got ", shape.rows));
  }
  if (shape.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: block_size must be > 0, got ", shape.block_size));
  }
  if (shape.vocab <= 0 || shape.bytes_per_logit <= 0 ||
      shape.logits_buffers <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: vocab, bytes_per_logit and logits_buffers must be > 0, "
        "got ", shape.vocab, ", ", shape.bytes_per_logit, ", ",
        shape.logits_buffers));
  }
  if (aligned && shape.rows % shape.block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: rows (", shape.rows,
        ") must be a multiple of block_size (", shape.block_size,
        ") when align_to_blocks is true"));
  }
  return absl::OkStatus();
}

// a * b for a message, for factors > 0 whose product may not fit 64 bits.
std::string ProductString(int64_t a, int64_t b) {
  if (a > INT64_MAX / b) return absl::StrCat("more than ", INT64_MAX);
  return absl::StrCat(a * b);
}

}  // namespace

absl::StatusOr<ChunkPlan> PlanChunks(const v1::ChunkingPolicy& policy,
                                     const ProblemShape& shape) {
  const bool aligned = policy.align_to_blocks();
  DFLASH_RETURN_IF_ERROR(CheckShape(shape, aligned));
  // Overflow check for one row's bytes: vocab < 2^31 and the factors are
  // small, but a caller may pass anything.
  const int64_t row_bytes_limit = INT64_MAX / shape.bytes_per_logit /
                                  shape.logits_buffers;
  if (shape.vocab > row_bytes_limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: one row of ", shape.vocab, " logits overflows 64 bits"));
  }
  const int64_t row_bytes =
      shape.vocab * shape.bytes_per_logit * shape.logits_buffers;
  const int64_t unit = aligned ? shape.block_size : 1;

  int64_t rows_per_chunk = 0;
  switch (policy.size_case()) {
    case v1::ChunkingPolicy::kRowsPerChunk:
      rows_per_chunk = policy.rows_per_chunk();
      if (rows_per_chunk <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.rows_per_chunk: must be > 0, got ", rows_per_chunk));
      }
      if (rows_per_chunk % unit != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.rows_per_chunk: must be a multiple of block_size (",
            unit, ") when align_to_blocks is true, got ", rows_per_chunk));
      }
      break;
    case v1::ChunkingPolicy::kBlocksPerChunk:
      if (policy.blocks_per_chunk() <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("chunking.blocks_per_chunk: must be > 0, got ",
                         policy.blocks_per_chunk()));
      }
      rows_per_chunk =
          policy.blocks_per_chunk() > shape.rows / shape.block_size
              ? shape.rows
              : policy.blocks_per_chunk() * shape.block_size;
      break;
    case v1::ChunkingPolicy::kLogitsBudgetBytes: {
      const int64_t budget = policy.logits_budget_bytes();
      const int64_t units = budget / row_bytes / unit;
      if (budget <= 0 || units == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.logits_budget_bytes: must hold one ",
            unit == 1 ? "row" : "block", " (", ProductString(unit, row_bytes),
            " bytes), got ", budget));
      }
      rows_per_chunk = units > shape.rows / unit ? shape.rows : units * unit;
      break;
    }
    case v1::ChunkingPolicy::SIZE_NOT_SET:
      return absl::InvalidArgumentError(
          "chunking: one of rows_per_chunk, blocks_per_chunk, "
          "logits_budget_bytes must be set");
  }
  rows_per_chunk = std::min(rows_per_chunk, shape.rows);
  if (rows_per_chunk > INT64_MAX / row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: a chunk of ", rows_per_chunk, " rows x ", row_bytes,
        " bytes overflows 64 bits"));
  }

  // The plan lists its chunks; a count past any sensible one (each chunk is
  // at least one GEMM call) is a mistake to report, not memory to take.
  const int64_t chunks = shape.rows / rows_per_chunk +
                         (shape.rows % rows_per_chunk != 0 ? 1 : 0);
  if (chunks > kMaxChunks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: ", shape.rows, " rows in chunks of ", rows_per_chunk,
        " make ", chunks, " chunks, more than the ", kMaxChunks,
        " allowed; use larger chunks"));
  }
  ChunkPlan plan;
  plan.rows_per_chunk = rows_per_chunk;
  plan.chunks.reserve(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * rows_per_chunk;
    const int64_t end = std::min(shape.rows - begin, rows_per_chunk) + begin;
    plan.chunks.push_back({begin, end, (end - begin) * row_bytes});
  }
  plan.max_chunk_bytes = plan.chunks.front().logits_bytes;
  return plan;
}

}  // namespace dflash
