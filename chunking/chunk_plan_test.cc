#include "chunking/chunk_plan.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace dflash {
namespace {

ChunkingOptions Blocks(int64_t blocks) {
  return ChunkingOptions::BlocksPerChunk(blocks);
}

TEST(ChunkPlanTest, WholeBlocksWithRemainder) {
  // 10 blocks of 16 rows, 3 blocks per chunk: 48, 48, 48, 16 rows.
  auto plan = PlanChunks(Blocks(3), {.rows = 160, .block_size = 16,
                                     .vocab = 100, .bytes_per_logit = 4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->chunks.size(), 4u);
  EXPECT_EQ(plan->rows_per_chunk, 48);
  EXPECT_EQ(plan->chunks[3].begin, 144);
  EXPECT_EQ(plan->chunks[3].end, 160);
  EXPECT_EQ(plan->chunks[0].logits_bytes, 48 * 100 * 4);
  EXPECT_EQ(plan->chunks[3].logits_bytes, 16 * 100 * 4);
  EXPECT_EQ(plan->max_chunk_bytes, 48 * 100 * 4);
}

TEST(ChunkPlanTest, MoreBlocksThanRowsIsOneChunk) {
  auto plan = PlanChunks(Blocks(128), {.rows = 64, .block_size = 16,
                                       .vocab = 10});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->chunks.size(), 1u);
  EXPECT_EQ(plan->chunks[0].rows(), 64);
}

TEST(ChunkPlanTest, FixedRowsUnaligned) {
  const ChunkingOptions policy =
      ChunkingOptions::RowsPerChunk(7, /*aligned=*/false);
  auto plan = PlanChunks(policy, {.rows = 20, .block_size = 5, .vocab = 3});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->chunks.size(), 3u);
  EXPECT_EQ(plan->chunks[2].rows(), 6);
}

TEST(ChunkPlanTest, BudgetPicksLargestAlignedChunk) {
  // One block = 16 rows x 1000 vocab x 4 bytes x 2 buffers = 128000 bytes.
  const ChunkingOptions policy =
      ChunkingOptions::LogitsBudgetBytes(128000 * 3 + 127999);
  auto plan = PlanChunks(policy, {.rows = 160, .block_size = 16, .vocab = 1000,
                                  .bytes_per_logit = 4, .logits_buffers = 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->rows_per_chunk, 48);
  EXPECT_LE(plan->max_chunk_bytes, policy.value);
  EXPECT_EQ(plan->max_chunk_bytes, 3 * 128000);
}

TEST(ChunkPlanTest, ShapesBeyondTwoToThe31) {
  // 2^22 rows x 262144 vocab: 2^40 logits, planned without allocating.
  auto plan = PlanChunks(Blocks(1024), {.rows = int64_t{1} << 22,
                                        .block_size = 16, .vocab = 262144,
                                        .bytes_per_logit = 4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->chunks.size(), 256u);
  EXPECT_EQ(plan->max_chunk_bytes, int64_t{16384} * 262144 * 4);
  EXPECT_EQ(plan->chunks.back().end, int64_t{1} << 22);
}

TEST(ChunkPlanTest, ImpossiblePlansAreErrors) {
  EXPECT_EQ(PlanChunks(Blocks(2), {.rows = 0, .block_size = 16, .vocab = 10})
                .status()
                .message(),
            "chunk plan: rows must be > 0, got 0");
  EXPECT_EQ(PlanChunks(Blocks(2), {.rows = 20, .block_size = 16, .vocab = 10})
                .status()
                .message(),
            "chunk plan: rows (20) must be a multiple of block_size (16) when "
            "align_to_blocks is true");
  ChunkingOptions budget = ChunkingOptions::LogitsBudgetBytes(1000);
  EXPECT_EQ(PlanChunks(budget, {.rows = 32, .block_size = 16, .vocab = 100})
                .status()
                .message(),
            "chunking.logits_budget_bytes: must hold one block (16 rows x 100 "
            "vocab x 4 bytes x 1 buffer(s) = 6400 bytes), got 1000");
  ChunkingOptions rows = ChunkingOptions::RowsPerChunk(-3);
  EXPECT_EQ(PlanChunks(rows, {.rows = 32, .block_size = 16, .vocab = 100})
                .status()
                .message(),
            "chunking.rows_per_chunk: must be > 0, got -3");
  EXPECT_EQ(PlanChunks(ChunkingOptions(),
                       {.rows = 32, .block_size = 16, .vocab = 100})
                .status()
                .message(),
            "chunking: one of rows_per_chunk, blocks_per_chunk, "
            "logits_budget_bytes must be set");
  EXPECT_EQ(PlanChunks(ChunkingOptions::RowsPerChunk(24),
                       {.rows = 32, .block_size = 16, .vocab = 100})
                .status()
                .message(),
            "chunking.rows_per_chunk: must be a multiple of layout.block_size "
            "(16) when chunking.align_to_blocks is true, got 24");
  EXPECT_EQ(PlanChunks(Blocks(1), {.rows = 16, .block_size = 16,
                                   .vocab = int64_t{1} << 62,
                                   .bytes_per_logit = 4})
                .status()
                .message(),
            "chunk plan: one row of 4611686018427387904 logits overflows 64 "
            "bits");
  // Found by //fuzz:chunking_fuzz: the message for a block whose bytes
  // overflow 64 bits overflowed itself.
  budget.value = 1000;
  EXPECT_EQ(PlanChunks(budget, {.rows = int64_t{1} << 40,
                                .block_size = int64_t{1} << 40,
                                .vocab = int64_t{1} << 30})
                .status()
                .message(),
            "chunking.logits_budget_bytes: must hold one block "
            "(1099511627776 rows x 1073741824 vocab x 4 bytes x 1 buffer(s) = "
            "more than 9223372036854775807 bytes), got 1000");
  // A plan of more chunks than any run makes is an error, not a huge list.
  rows.value = 1;
  EXPECT_EQ(PlanChunks(rows, {.rows = int64_t{1} << 40, .block_size = 1,
                              .vocab = 10})
                .status()
                .message(),
            "chunk plan: 1099511627776 rows in chunks of 1 make 1099511627776 "
            "chunks, more than the 1048576 allowed; use larger chunks");
  EXPECT_TRUE(PlanChunks(rows, {.rows = kMaxChunks, .block_size = 1,
                                .vocab = 10})
                  .ok());
}

}  // namespace
}  // namespace dflash
