#include "base/tensor.h"

#include <vector>

#include "gtest/gtest.h"

namespace dflash {
namespace {

TEST(TensorViewTest, SliceIsAViewOfTheSameMemory) {
  std::vector<float> values(12);
  for (int i = 0; i < 12; ++i) values[i] = static_cast<float>(i);
  TensorView view = TensorView::Of(values.data(), {2, 6});
  EXPECT_TRUE(view.is_contiguous());
  absl::StatusOr<TensorView> slice = view.Slice(1, 2, 3);
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(slice->shape(), (Shape{2, 3}));
  EXPECT_EQ(slice->strides(), (Shape{6, 1}));
  EXPECT_FALSE(slice->is_contiguous());
  EXPECT_EQ(slice->data_as<float>(), values.data() + 2);
  // Row 1, column 0 of the slice is element (1, 2) of the whole.
  EXPECT_EQ(slice->data_as<float>()[slice->strides()[0]], 8.0f);
  EXPECT_EQ(slice->DebugString(), "float32[2, 3]");
}

TEST(TensorViewTest, BadSlicesAreErrors) {
  std::vector<double> values(6);
  TensorView view = TensorView::Of(values.data(), {6});
  EXPECT_EQ(view.Slice(1, 0, 1).status().message(),
            "dim 1 is invalid for a 1D tensor");
  EXPECT_EQ(view.Slice(0, 4, 3).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(view.Slice(0, -1, 1).status().code(),
            absl::StatusCode::kOutOfRange);
}

// Found by //fuzz:chunking_fuzz: an empty tensor (no memory, a zero extent
// elsewhere) sliced past its start offset a null pointer.
TEST(TensorViewTest, SlicingAnEmptyTensorWithoutMemoryStaysNull) {
  const TensorView empty(nullptr, DType::kFloat64, {0, 4});
  absl::StatusOr<TensorView> slice = empty.Slice(1, 2, 2);
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(slice->data(), nullptr);
  EXPECT_EQ(slice->numel(), 0);
}

TEST(TensorViewTest, ElementBytes) {
  EXPECT_EQ(ElementBytes(DType::kBFloat16), 2);
  EXPECT_EQ(ElementBytes(DType::kFloat64), 8);
  EXPECT_EQ(TensorView::Of(static_cast<int32_t*>(nullptr), {3, 5}).bytes(), 60);
}

}  // namespace
}  // namespace dflash
