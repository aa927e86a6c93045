// Fuzzes the chunk planner and the chunked reduction's argument handling.
// Plans: any policy and shape plan or fail with a message; a plan covers
// [0, rows) with contiguous, non-empty, block-aligned chunks that respect
// the policy, and its byte counts are exact. Reductions: any inputs, ranks,
// dim, chunk size and gradient layout run or fail with a message; a run's
// sum over chunks equals the sum of the whole input, and backward leaves
// the gradient of that sum (all ones).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "chunking/chunk_plan.h"
#include "chunking/chunked_reduce.h"
#include "fuzz/fuzz_input.h"

namespace dflash {
namespace {

void FuzzPlan(FuzzInput& in) {
  ChunkingOptions options;
  const bool wild = in.Bool();  // Any 64-bit values, or plausible ones.
  auto value = [&](int64_t hi) {
    return wild ? in.Raw<int64_t>() : in.Int(-2, hi);
  };
  switch (in.Int(0, 3)) {
    case 0:
      options = {ChunkingOptions::Size::kRowsPerChunk, value(5000)};
      break;
    case 1:
      options = {ChunkingOptions::Size::kBlocksPerChunk, value(500)};
      break;
    case 2:
      options = {ChunkingOptions::Size::kLogitsBudgetBytes,
                 value(int64_t{1} << 30)};
      break;
    default:
      break;
  }
  options.align_to_blocks = in.Bool();
  const ProblemShape shape{value(1 << 20), value(64), value(300000),
                           in.Int(-1, 8), in.Int(-1, 3)};
  absl::StatusOr<ChunkPlan> plan = PlanChunks(options, shape);
  if (!plan.ok()) {
    FUZZ_CHECK(!plan.status().message().empty(), "an empty error");
    return;
  }
  const int64_t row_bytes =
      shape.vocab * shape.bytes_per_logit * shape.logits_buffers;
  FUZZ_CHECK(!plan->chunks.empty(), "no chunks");
  int64_t at = 0, largest = 0;
  for (size_t c = 0; c < plan->chunks.size(); ++c) {
    const ChunkRange& chunk = plan->chunks[c];
    FUZZ_CHECK(chunk.begin == at && chunk.end > chunk.begin,
               "chunk %zu is [%ld, %ld), expected to start at %ld", c,
               static_cast<long>(chunk.begin), static_cast<long>(chunk.end),
               static_cast<long>(at));
    FUZZ_CHECK(chunk.rows() <= plan->rows_per_chunk, "chunk %zu too long", c);
    FUZZ_CHECK(chunk.logits_bytes == chunk.rows() * row_bytes,
               "chunk %zu bytes", c);
    if (options.align_to_blocks) {
      FUZZ_CHECK(chunk.begin % shape.block_size == 0, "unaligned chunk %zu", c);
    }
    if (options.size == ChunkingOptions::Size::kLogitsBudgetBytes) {
      FUZZ_CHECK(chunk.logits_bytes <= options.value,
                 "chunk %zu over the budget", c);
    }
    largest = std::max(largest, chunk.logits_bytes);
    at = chunk.end;
  }
  FUZZ_CHECK(at == shape.rows, "the plan ends at %ld of %ld rows",
             static_cast<long>(at), static_cast<long>(shape.rows));
  FUZZ_CHECK(plan->max_chunk_bytes == largest, "max_chunk_bytes");
}

// Sums every element of the first present input; backward adds the
// upstream gradient to every element of the gradient tensors.
class SumFirst : public ChunkFunction {
 public:
  absl::StatusOr<Terms> Forward(Slices slices) override {
    for (const std::optional<TensorView>& s : slices) {
      if (s.has_value()) return Terms{{Sum(*s)}};
    }
    return Terms{{0.0}};
  }
  absl::Status Backward(Slices slices, const Terms& grad_terms,
                        Slices grad_slices) override {
    for (size_t i = 0; i < grad_slices.size(); ++i) {
      if (!grad_slices[i].has_value() || !slices[i].has_value()) continue;
      const bool first = FirstPresent(slices) == static_cast<int>(i);
      ForEach(*grad_slices[i], [&](double& g) {
        if (first) g += grad_terms[0][0];
      });
    }
    return absl::OkStatus();
  }

  template <typename F>
  static void ForEach(const TensorView& t, F f) {
    std::vector<int64_t> index(t.rank(), 0);
    const int64_t n = t.numel();
    for (int64_t e = 0; e < n; ++e) {
      int64_t offset = 0;
      for (int64_t d = 0; d < t.rank(); ++d)
        offset += index[d] * t.strides()[d];
      f(t.data_as<double>()[offset]);
      for (int64_t d = t.rank() - 1; d >= 0; --d) {
        if (++index[d] < t.dim(d)) break;
        index[d] = 0;
      }
    }
  }
  static double Sum(const TensorView& t) {
    double sum = 0;
    ForEach(t, [&](double& x) { sum += x; });
    return sum;
  }
  static int FirstPresent(Slices slices) {
    for (size_t i = 0; i < slices.size(); ++i) {
      if (slices[i].has_value()) return static_cast<int>(i);
    }
    return -1;
  }
};

void FuzzReduce(FuzzInput& in) {
  const int count = static_cast<int>(in.Int(0, 3));
  std::vector<std::vector<double>> storage, grad_storage;
  std::vector<std::optional<TensorView>> inputs, grads;
  const bool with_grads = in.Bool();
  for (int i = 0; i < count; ++i) {
    if (!in.Bool()) {
      inputs.push_back(std::nullopt);
      if (with_grads) grads.push_back(std::nullopt);
      continue;
    }
    Shape shape;
    const int rank = static_cast<int>(in.Int(0, 3));
    int64_t numel = 1;
    for (int d = 0; d < rank; ++d) {
      shape.push_back(in.Int(0, 6));
      numel *= shape.back();
    }
    storage.emplace_back(numel);
    for (int64_t e = 0; e < numel; ++e) storage.back()[e] = e % 7 - 3;
    inputs.push_back(TensorView(storage.back().data(), DType::kFloat64, shape));
    if (with_grads) {
      if (in.Bool()) {
        grad_storage.emplace_back(numel, 0.0);
        grads.push_back(
            TensorView(grad_storage.back().data(), DType::kFloat64, shape));
      } else {
        grads.push_back(std::nullopt);
      }
    }
  }
  ChunkedReduceOptions options;
  options.chunk_size = in.Int(-2, 8);
  options.dim = in.Int(-4, 4);
  options.checkpoint = in.Bool();
  options.grad_enabled = in.Bool();
  SumFirst function;
  absl::StatusOr<ChunkedReduction> run =
      ChunkedReduction::Run(function, inputs, options, grads);
  if (!run.ok()) {
    FUZZ_CHECK(!run.status().message().empty(), "an empty error");
    return;
  }
  const int first = SumFirst::FirstPresent(inputs);
  const double whole = first >= 0 ? SumFirst::Sum(*inputs[first]) : 0.0;
  FUZZ_CHECK(run->terms().size() == 1 && run->terms()[0].size() == 1 &&
                 run->terms()[0][0] == whole,
             "the chunks' sum is not the whole input's sum");
  if (absl::Status done = run->Backward({{1.0}}); !done.ok()) {
    FUZZ_CHECK(!done.message().empty(), "an empty backward error");
    return;
  }
  if (with_grads && first >= 0 && grads[first].has_value()) {
    SumFirst::ForEach(*grads[first], [&](double& g) {
      FUZZ_CHECK(g == 1.0, "gradient of the sum is %g, not 1", g);
    });
  }
}

}  // namespace
}  // namespace dflash

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dflash::FuzzInput in(data, size);
  if (in.Bool()) {
    dflash::FuzzPlan(in);
  } else {
    dflash::FuzzReduce(in);
  }
  return 0;
}
