#include "losses/batch_layout.h"

#include <vector>

#include "gtest/gtest.h"

namespace dflash {
namespace {

std::vector<float> Masks(const std::vector<RowMeta>& rows) {
  std::vector<float> out;
  for (const RowMeta& m : rows) out.push_back(m.mask);
  return out;
}

TEST(LabelRowsTest, DFlashBlocksPredictAnchorPlusK) {
  // One sequence of S = 6; anchor 1, K = 4: k predicts token 1 + k.
  const std::vector<int64_t> ids = {10, 11, 12, 13, 14, 15};
  const std::vector<uint8_t> loss_mask = {1, 1, 1, 0, 1, 1};
  auto rows = LabelRows({1, 6, ids, loss_mask}, std::vector<int64_t>{1},
                        std::vector<uint8_t>{1}, 1, 4, 16, Labeling::kDFlash);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(Masks(*rows), (std::vector<float>{0, 1, 0, 1}));
  EXPECT_EQ((*rows)[1].target, 12);
  EXPECT_EQ((*rows)[3].target, 14);
  for (int k = 0; k < 4; ++k) EXPECT_EQ((*rows)[k].position, k);
}

TEST(LabelRowsTest, DSparkBlocksPredictAnchorPlusOnePlusKContiguously) {
  const std::vector<int64_t> ids = {10, 11, 12, 13, 14, 15};
  const std::vector<uint8_t> loss_mask = {1, 1, 1, 0, 1, 1};
  auto rows = LabelRows({1, 6, ids, loss_mask}, std::vector<int64_t>{0},
                        std::vector<uint8_t>{1}, 1, 4, 16, Labeling::kDSpark);
  ASSERT_TRUE(rows.ok()) << rows.status();
  // Tokens 1, 2 supervised, 3 not: the mask stops there although 4 is.
  EXPECT_EQ(Masks(*rows), (std::vector<float>{1, 1, 0, 0}));
  EXPECT_EQ((*rows)[0].target, 11);
  EXPECT_EQ((*rows)[1].target, 12);
}

TEST(LabelRowsTest, BadInputsAreErrors) {
  const std::vector<int64_t> ids = {0, 1, 2, 99};
  const std::vector<uint8_t> mask = {1, 1, 1, 1};
  const TokenBatch tokens{1, 4, ids, mask};
  EXPECT_EQ(LabelRows(tokens, std::vector<int64_t>{0}, std::vector<uint8_t>{1},
                      1, 4, 8, Labeling::kDFlash)
                .status()
                .message(),
            "batch layout: input_ids (0, 3) = 99 is outside [0, 8)");
  EXPECT_EQ(LabelRows(tokens, std::vector<int64_t>{4}, std::vector<uint8_t>{1},
                      1, 2, 100, Labeling::kDFlash)
                .status()
                .message(),
            "batch layout: anchor (0, 0) = 4 is outside [0, 4)");
  // A padding anchor's position is not read.
  EXPECT_TRUE(LabelRows(tokens, std::vector<int64_t>{-7},
                        std::vector<uint8_t>{0}, 1, 2, 100, Labeling::kDFlash)
                  .ok());
  EXPECT_EQ(LabelRows(tokens, std::vector<int64_t>{0, 1},
                      std::vector<uint8_t>{1}, 1, 2, 100, Labeling::kDFlash)
                .status()
                .message(),
            "batch layout: anchors and keep must hold batch x num_anchors = 1 "
            "values, got 2 and 1");
  EXPECT_EQ(LabelRows({1, 5, ids, mask}, std::vector<int64_t>{0},
                      std::vector<uint8_t>{1}, 1, 2, 100, Labeling::kDFlash)
                .status()
                .message(),
            "batch layout: input_ids and loss_mask must hold batch x seq_len "
            "= 5 values, got 4 and 4");
}

TEST(SampleAnchorsTest, DrawsSortedValidPositionsAndPads) {
  // Valid anchors need loss_mask[p] and loss_mask[p + 1]: p in {1, 2, 5}.
  const std::vector<int64_t> ids(8, 0);
  const std::vector<uint8_t> mask = {0, 1, 1, 1, 0, 1, 1, 0};
  const TokenBatch tokens{1, 8, ids, mask};
  // The width is the batch's largest candidate count, at most num_anchors.
  auto all = SampleAnchors(tokens, 5, 1);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->num_anchors, 3);
  EXPECT_EQ(all->positions, (std::vector<int64_t>{1, 2, 5}));
  EXPECT_EQ(all->keep, (std::vector<uint8_t>{1, 1, 1}));
  // max_valid_anchors (one value on every rank) sets it instead.
  auto padded = SampleAnchors(tokens, 5, 1, 4);
  ASSERT_TRUE(padded.ok());
  EXPECT_EQ(padded->positions, (std::vector<int64_t>{1, 2, 5, 0}));
  EXPECT_EQ(padded->keep, (std::vector<uint8_t>{1, 1, 1, 0}));
  EXPECT_EQ(SampleAnchors(tokens, 5, 1, 2)->num_anchors, 2);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto two = SampleAnchors(tokens, 2, seed);
    ASSERT_TRUE(two.ok());
    EXPECT_LT(two->positions[0], two->positions[1]);
    for (int64_t p : two->positions) EXPECT_TRUE(p == 1 || p == 2 || p == 5);
    EXPECT_EQ(SampleAnchors(tokens, 2, seed)->positions, two->positions);
  }
}

// As SpecForge: a sequence without two consecutive supervised tokens is all
// padding; a batch where no sequence has them is an error.
TEST(SampleAnchorsTest, NoTwoConsecutiveSupervisedTokensInTheBatchIsAnError) {
  const std::vector<int64_t> ids(8, 0);
  const std::vector<uint8_t> mask = {1, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0,
                                     1, 0, 1, 0};
  auto one = SampleAnchors({2, 8, std::vector<int64_t>(16, 0), mask}, 4, 0);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->positions, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(one->keep, (std::vector<uint8_t>{1, 0}));
  const std::vector<uint8_t> none = {1, 0, 1, 0, 1, 0, 1, 0,
                                     1, 0, 1, 0, 1, 0, 1, 0};
  EXPECT_EQ(SampleAnchors({2, 8, std::vector<int64_t>(16, 0), none}, 4, 0)
                .status()
                .message(),
            "batch layout: DFlash-family training requires two consecutive "
            "supervised tokens, got none in any of the 2 sequence(s)");
  EXPECT_EQ(SampleAnchors({2, 8, std::vector<int64_t>(16, 0), mask}, 4, 0, -1)
                .status()
                .message(),
            "batch layout: max_valid_anchors must be >= 0, got -1");
  EXPECT_EQ(SampleAnchors({1, 8, ids, std::vector<uint8_t>(8, 1)}, 0, 0)
                .status()
                .message(),
            "batch layout: num_anchors must be > 0, got 0");
}

}  // namespace
}  // namespace dflash
