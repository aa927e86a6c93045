#include "chunking/chunked_reduce.h"

#include <cstdint>
#include <optional>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::testing::ElementsAre;

// Element (i, j) of a 2-D float64 view, honouring strides.
double& At(const TensorView& t, int64_t i, int64_t j) {
  return t.data_as<double>()[i * t.strides()[0] + j * t.strides()[1]];
}

// Terms {sum(v * w), sum(v^2 * w)} of 2-D slices (values, weights, absent);
// records the width of every call.
class WeightedSums : public ChunkFunction {
 public:
  absl::StatusOr<Terms> Forward(Slices s) override {
    EXPECT_EQ(s.size(), 3u);
    EXPECT_FALSE(s[2].has_value()) << "absent input must stay absent";
    const TensorView& v = *s[0];
    const TensorView& w = *s[1];
    widths.push_back(v.dim(1));
    pointers.push_back(v.data());
    double linear = 0, quadratic = 0;
    for (int64_t i = 0; i < v.dim(0); ++i) {
      for (int64_t j = 0; j < v.dim(1); ++j) {
        linear += At(v, i, j) * At(w, i, j);
        quadratic += At(v, i, j) * At(v, i, j) * At(w, i, j);
      }
    }
    return Terms{{linear}, {quadratic}};
  }
  absl::Status Backward(Slices s, const Terms& g, Slices grads) override {
    ++backward_calls;
    const TensorView& v = *s[0];
    const TensorView& w = *s[1];
    if (!grads[0]) return absl::OkStatus();
    for (int64_t i = 0; i < v.dim(0); ++i) {
      for (int64_t j = 0; j < v.dim(1); ++j) {
        At(*grads[0], i, j) +=
            g[0][0] * At(w, i, j) + g[1][0] * 2 * At(v, i, j) * At(w, i, j);
      }
    }
    return absl::OkStatus();
  }
  std::vector<int64_t> widths;
  std::vector<void*> pointers;
  int backward_calls = 0;
};

struct Fixture {
  Fixture() : values(12), weights(12), grad(12, 0.0) {
    for (int i = 0; i < 12; ++i) {
      values[i] = i;                        // arange(12).reshape(2, 6)
      weights[i] = 0.5 + i * (1.0 / 11.0);  // linspace(0.5, 1.5, 12)
    }
  }
  std::vector<std::optional<TensorView>> Inputs() {
    return {TensorView::Of(values.data(), {2, 6}),
            TensorView::Of(weights.data(), {2, 6}), std::nullopt};
  }
  std::vector<std::optional<TensorView>> Grads() {
    return {TensorView::Of(grad.data(), {2, 6}), std::nullopt, std::nullopt};
  }
  std::vector<double> values, weights, grad;
};

TEST(ChunkedReduceTest, ChunkedSumsEqualUnchunkedWithGradient) {
  Fixture f;
  double linear = 0, quadratic = 0;
  for (int i = 0; i < 12; ++i) {
    linear += f.values[i] * f.weights[i];
    quadratic += f.values[i] * f.values[i] * f.weights[i];
  }
  WeightedSums function;
  auto reduction = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 2, .dim = 1, .checkpoint = true},
      f.Grads());
  ASSERT_TRUE(reduction.ok()) << reduction.status();
  EXPECT_EQ(reduction->num_chunks(), 3);
  EXPECT_TRUE(reduction->checkpointed());
  EXPECT_DOUBLE_EQ(reduction->terms()[0][0], linear);
  EXPECT_DOUBLE_EQ(reduction->terms()[1][0], quadratic);
  ASSERT_TRUE(reduction->Backward({{0.0}, {1.0}}).ok());
  for (int i = 0; i < 12; ++i) {
    EXPECT_DOUBLE_EQ(f.grad[i], 2 * f.values[i] * f.weights[i]) << i;
  }
  // Checkpointed: every chunk ran forward again in backward.
  EXPECT_EQ(reduction->recomputations(), 3);
  EXPECT_THAT(function.widths, ElementsAre(2, 2, 2, 2, 2, 2));
}

TEST(ChunkedReduceTest, SlicesAreViewsNotCopies) {
  Fixture f;
  WeightedSums function;
  auto reduction = ChunkedReduction::Run(function, f.Inputs(),
                                         {.chunk_size = 2, .dim = 1});
  ASSERT_TRUE(reduction.ok()) << reduction.status();
  EXPECT_THAT(function.pointers,
              ElementsAre(f.values.data(), f.values.data() + 2,
                          f.values.data() + 4));
}

TEST(ChunkedReduceTest, ChunkSizeZeroCallsOnceOnTheFullSlice) {
  Fixture f;
  WeightedSums function;
  auto reduction = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 0, .dim = 1, .checkpoint = true},
      f.Grads());
  ASSERT_TRUE(reduction.ok()) << reduction.status();
  EXPECT_THAT(function.widths, ElementsAre(6));
  EXPECT_FALSE(reduction->checkpointed());
  ASSERT_TRUE(reduction->Backward({{1.0}, {0.0}}).ok());
  EXPECT_EQ(reduction->recomputations(), 0);
  for (int i = 0; i < 12; ++i) EXPECT_DOUBLE_EQ(f.grad[i], f.weights[i]);
}

TEST(ChunkedReduceTest, CheckpointOffWalksRemainderAndNeverRecomputes) {
  Fixture f;
  WeightedSums function;
  auto reduction = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 4, .dim = 1, .checkpoint = false},
      f.Grads());
  ASSERT_TRUE(reduction.ok()) << reduction.status();
  ASSERT_TRUE(reduction->Backward({{0.0}, {1.0}}).ok());
  EXPECT_THAT(function.widths, ElementsAre(4, 2));
  EXPECT_EQ(reduction->recomputations(), 0);
  EXPECT_EQ(function.backward_calls, 2);
}

TEST(ChunkedReduceTest, NoInputNeedingGradientMeansNoCheckpoint) {
  Fixture f;
  WeightedSums function;
  auto reduction = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 2, .dim = 1, .checkpoint = true});
  ASSERT_TRUE(reduction.ok());
  EXPECT_FALSE(reduction->checkpointed());
  auto no_grad_mode = ChunkedReduction::Run(
      function, f.Inputs(),
      {.chunk_size = 2, .dim = 1, .checkpoint = true, .grad_enabled = false},
      f.Grads());
  ASSERT_TRUE(no_grad_mode.ok());
  EXPECT_FALSE(no_grad_mode->checkpointed());
}

// As SpecForge's `checkpoint=True`: a chunked reduction whose inputs need
// gradients is checkpointed unless told otherwise.
TEST(ChunkedReduceTest, CheckpointsByDefault) {
  Fixture f;
  WeightedSums function;
  auto reduction = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 2, .dim = 1}, f.Grads());
  ASSERT_TRUE(reduction.ok());
  EXPECT_TRUE(reduction->checkpointed());
}

TEST(ChunkedReduceTest, NegativeDimAndMixedRanks) {
  // A [2, 6] tensor and a [6] tensor, both sliced along their last dim.
  std::vector<double> matrix(12, 1.0), vector(6);
  for (int i = 0; i < 6; ++i) vector[i] = i;
  class Dot : public ChunkFunction {
   public:
    absl::StatusOr<Terms> Forward(Slices s) override {
      double sum = 0;
      for (int64_t j = 0; j < s[1]->dim(0); ++j) {
        sum += At(*s[0], 1, j) * s[1]->data_as<double>()[j];
      }
      return Terms{{sum, 1.0}};
    }
    absl::Status Backward(Slices, const Terms&, Slices) override {
      return absl::OkStatus();
    }
  } dot;
  auto reduction = ChunkedReduction::Run(
      dot,
      {TensorView::Of(matrix.data(), {2, 6}), TensorView::Of(vector.data(), {6})},
      {.chunk_size = 4, .dim = -1});
  ASSERT_TRUE(reduction.ok()) << reduction.status();
  EXPECT_THAT(reduction->terms()[0], ElementsAre(15.0, 2.0));
}

class CountingTerms : public ChunkFunction {
 public:
  absl::StatusOr<Terms> Forward(Slices) override {
    ++calls;
    if (calls == 2) return Terms(changed_count ? 3 : 2, Term{1.0});
    return Terms{{1.0}, {1.0}};
  }
  absl::Status Backward(Slices, const Terms&, Slices) override {
    return absl::OkStatus();
  }
  bool changed_count = true;
  int calls = 0;
};

TEST(ChunkedReduceTest, ChangingNumberOfTermsIsAnError) {
  std::vector<double> data(6);
  CountingTerms function;
  auto reduction = ChunkedReduction::Run(
      function, {TensorView::Of(data.data(), {6})}, {.chunk_size = 2});
  EXPECT_EQ(reduction.status().message(),
            "chunk function returned a different number of terms");
}

struct BadCall {
  std::string name;
  std::vector<Shape> shapes;  // Empty shape = absent input.
  int64_t chunk_size;
  int64_t dim;
  std::string message;
};

class RejectedCallTest : public ::testing::TestWithParam<BadCall> {};

TEST_P(RejectedCallTest, HasSpecForgeMessage) {
  std::vector<double> storage(64);
  std::vector<std::optional<TensorView>> inputs;
  for (const Shape& shape : GetParam().shapes) {
    if (shape.empty()) {
      inputs.push_back(std::nullopt);
    } else {
      inputs.push_back(TensorView::Of(storage.data(), shape));
    }
  }
  CountingTerms function;
  auto reduction = ChunkedReduction::Run(
      function, inputs,
      {.chunk_size = GetParam().chunk_size, .dim = GetParam().dim});
  ASSERT_FALSE(reduction.ok());
  EXPECT_EQ(reduction.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reduction.status().message(), GetParam().message);
  EXPECT_EQ(function.calls, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Validation, RejectedCallTest,
    ::testing::Values(
        BadCall{"Misaligned",
                {{2, 3}, {2, 4}},
                2,
                1,
                "chunked reduction inputs must be aligned: expected dimension "
                "length 3, got 4"},
        BadCall{"NegativeChunk",
                {{2, 3}},
                -1,
                1,
                "chunk_size must be >= 0, got -1"},
        // chunk_size is checked first even when there is no tensor.
        BadCall{"NegativeChunkBeforeNoTensor",
                {{}},
                -2,
                0,
                "chunk_size must be >= 0, got -2"},
        BadCall{"NoTensor",
                {{}, {}},
                2,
                0,
                "chunked reduction requires at least one tensor"},
        BadCall{"NoInputsAtAll",
                {},
                2,
                0,
                "chunked reduction requires at least one tensor"},
        BadCall{
            "DimTooLarge", {{2, 3}}, 2, 2, "dim 2 is invalid for a 2D tensor"},
        BadCall{"DimTooNegative",
                {{6}},
                2,
                -2,
                "dim -2 is invalid for a 1D tensor"},
        BadCall{"DimInvalidForSecond",
                {{2, 3}, {3}},
                2,
                1,
                "dim 1 is invalid for a 1D tensor"},
        BadCall{"EmptyDimension",
                {{2, 0}, {2, 0}},
                2,
                1,
                "chunked reduction received an empty dimension"},
        // As SpecForge's newest: the first tensor's length is checked
        // before the other tensors' dims.
        BadCall{"EmptyBeforeLaterDims",
                {{2, 0}, {4}},
                2,
                1,
                "chunked reduction received an empty dimension"},
        BadCall{"DimThenAlignmentPerTensor",
                {{2, 3}, {2, 4}, {5}},
                2,
                1,
                "chunked reduction inputs must be aligned: expected dimension "
                "length 3, got 4"}),
    [](const ::testing::TestParamInfo<BadCall>& info) {
      return info.param.name;
    });

TEST(ChunkedReduceTest, BadGradientsAreErrors) {
  Fixture f;
  WeightedSums function;
  std::vector<double> wrong(10);
  auto reduction = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 2, .dim = 1},
      {TensorView::Of(wrong.data(), {2, 5}), std::nullopt, std::nullopt});
  EXPECT_EQ(reduction.status().message(),
            "grads[0] must match input float64[2, 6], got float64[2, 5]");
  auto absent = ChunkedReduction::Run(
      function, f.Inputs(), {.chunk_size = 2, .dim = 1},
      {std::nullopt, std::nullopt, TensorView::Of(wrong.data(), {2, 5})});
  EXPECT_EQ(absent.status().message(), "grads[2] is given for an absent input");
  auto ok = ChunkedReduction::Run(function, f.Inputs(),
                                  {.chunk_size = 2, .dim = 1}, f.Grads());
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->Backward({{1.0}}).message(),
            "grad_terms must have one gradient per term (2), got 1");
}

}  // namespace
}  // namespace dflash
