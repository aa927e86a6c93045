#include "chunking/chunk_plan.h"

#include <algorithm>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/checked_math.h"
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

// One block's (or row's) logits bytes, as "K rows x V vocab x B bytes x N
// buffer(s) = X bytes", or "more than 2^63 - 1" when they overflow.
std::string UnitBytes(int64_t unit, const ProblemShape& shape) {
  const std::optional<int64_t> bytes = CheckedProduct(
      {unit, shape.vocab, shape.bytes_per_logit, shape.logits_buffers});
  return absl::StrCat(unit, " rows x ", shape.vocab, " vocab x ",
                      shape.bytes_per_logit, " bytes x ", shape.logits_buffers,
                      " buffer(s) = ",
                      bytes ? absl::StrCat(*bytes)
                            : absl::StrCat("more than ", INT64_MAX),
                      " bytes");
}

}  // namespace

absl::Status ValidateChunkingOptions(const ChunkingOptions& options,
                                     const ProblemShape& shape) {
  const int64_t block = shape.block_size;
  switch (options.size) {
    case ChunkingOptions::Size::kRowsPerChunk:
      if (options.value <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.rows_per_chunk: must be > 0, got ", options.value));
      }
      if (options.align_to_blocks && block > 0 && options.value % block != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.rows_per_chunk: must be a multiple of "
            "layout.block_size (",
            block, ") when chunking.align_to_blocks is true, got ",
            options.value));
      }
      return absl::OkStatus();
    case ChunkingOptions::Size::kBlocksPerChunk:
      if (options.value <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.blocks_per_chunk: must be > 0, got ", options.value));
      }
      return absl::OkStatus();
    case ChunkingOptions::Size::kLogitsBudgetBytes: {
      const int64_t unit = options.align_to_blocks ? block : 1;
      if (unit <= 0 || shape.vocab <= 0 || shape.bytes_per_logit <= 0 ||
          shape.logits_buffers <= 0) {
        return absl::OkStatus();  // Reported by whoever set them.
      }
      const std::optional<int64_t> needed = CheckedProduct(
          {unit, shape.vocab, shape.bytes_per_logit, shape.logits_buffers});
      if (options.value <= 0 || !needed || options.value < *needed) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunking.logits_budget_bytes: must hold one ",
            unit == 1 ? "row" : "block", " (", UnitBytes(unit, shape),
            "), got ", options.value));
      }
      return absl::OkStatus();
    }
    case ChunkingOptions::Size::kUnset:
      break;
  }
  return absl::InvalidArgumentError(
      "chunking: one of rows_per_chunk, blocks_per_chunk, "
      "logits_budget_bytes must be set");
}

absl::StatusOr<ChunkPlan> PlanChunks(const ChunkingOptions& options,
                                     const ProblemShape& shape) {
  const bool aligned = options.align_to_blocks;
  DFLASH_RETURN_IF_ERROR(CheckShape(shape, aligned));
  // Overflow check for one row's bytes: vocab < 2^31 and the factors are
  // small, but a caller may pass anything.
  const int64_t row_bytes_limit = INT64_MAX / shape.bytes_per_logit /
                                  shape.logits_buffers;
  if (shape.vocab > row_bytes_limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk plan: one row of ", shape.vocab, " logits overflows 64 bits"));
  }
  DFLASH_RETURN_IF_ERROR(ValidateChunkingOptions(options, shape));
  const int64_t row_bytes =
      shape.vocab * shape.bytes_per_logit * shape.logits_buffers;
  const int64_t unit = aligned ? shape.block_size : 1;

  int64_t rows_per_chunk = 0;
  switch (options.size) {
    case ChunkingOptions::Size::kRowsPerChunk:
      rows_per_chunk = options.value;
      break;
    case ChunkingOptions::Size::kBlocksPerChunk:
      rows_per_chunk = options.value > shape.rows / shape.block_size
                           ? shape.rows
                           : options.value * shape.block_size;
      break;
    case ChunkingOptions::Size::kLogitsBudgetBytes: {
      const int64_t units = options.value / row_bytes / unit;
      rows_per_chunk = units > shape.rows / unit ? shape.rows : units * unit;
      break;
    }
    case ChunkingOptions::Size::kUnset:
      break;  // Refused by ValidateChunkingOptions.
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
