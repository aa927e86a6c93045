#include "losses/accepted_length.h"

#include <vector>

#include "gtest/gtest.h"

namespace dflash {
namespace {

RowMeta Row(int64_t block, int32_t position, float mask) {
  RowMeta meta;
  meta.block = block;
  meta.position = position;
  meta.mask = mask;
  return meta;
}

// Three blocks of K = 4, rows shuffled. Block 7: q 0.5, 0.4, 0.2 at k = 1..3,
// targets ranked 0, -1, 2: expected 1 + .5 + .5 * .4 + .5 * .4 * .2 = 1.74,
// oracle 1 + 1 = 2. Block 3: k = 1 unsupervised stops the chain at once
// (expected and oracle 1) though k = 2 is supervised. Block 5: nothing
// supervised, not counted. The anchor slots (k = 0) never count.
TEST(AcceptedLengthTest, ChainsEachBlockToItsFirstMiss) {
  const std::vector<RowMeta> rows = {
      Row(7, 2, 1), Row(3, 2, 1), Row(7, 0, 1), Row(5, 1, 0), Row(7, 1, 1),
      Row(3, 1, 0), Row(7, 3, 1), Row(3, 0, 1), Row(5, 0, 1), Row(3, 3, 0.4f)};
  const std::vector<double> q = {0.4, 0.9, 0.99, 0.7,  0.5,
                                 0.3, 0.2, 0.99, 0.99, 0.6};
  const std::vector<int32_t> rank = {-1, 0, 0, 0, 0, 0, 2, 0, 0, 0};
  // Teacher acceptances: block 7 has 1, 0.5, 0.5 at k = 1..3: 1 + 1 + .5 +
  // .25 = 2.75; block 3 stops at once: 1.
  const std::vector<double> teacher = {0.5, 0.9, 0.9, 0.9, 1.0,
                                       0.9, 0.5, 0.9, 0.9, 0.9};
  const AcceptedLengthTerms terms = AcceptedLengths(rows, q, rank, teacher, 4);
  EXPECT_EQ(terms.block_den, 2);
  EXPECT_DOUBLE_EQ(terms.expected_num, 1.74 + 1);
  EXPECT_DOUBLE_EQ(terms.oracle_num, 2 + 1);
  EXPECT_DOUBLE_EQ(terms.teacher_expected_num, 2.75 + 1);
  // Without ranks or teacher there is no oracle or teacher length.
  const AcceptedLengthTerms bare = AcceptedLengths(rows, q, {}, {}, 4);
  EXPECT_EQ(bare.oracle_num, 0);
  EXPECT_EQ(bare.teacher_expected_num, 0);
}

}  // namespace
}  // namespace dflash
