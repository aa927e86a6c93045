// Chunk planning and chunked-reduction overhead (per chunk, with a trivial
// chunk function, so what is measured is the reduction's own work).
#include <cstdint>
#include <vector>

#include "benchmark/benchmark.h"
#include "chunking/chunk_plan.h"
#include "chunking/chunked_reduce.h"

namespace dflash {
namespace {

void BM_PlanChunks(benchmark::State& state) {
  const ChunkingOptions options =
      ChunkingOptions::BlocksPerChunk(state.range(0));
  const ProblemShape shape{.rows = 8 * 512 * 16, .block_size = 16,
                           .vocab = 151936, .bytes_per_logit = 4};
  int64_t chunks = 0;
  for (auto _ : state) {
    auto plan = PlanChunks(options, shape);
    benchmark::DoNotOptimize(plan);
    chunks = static_cast<int64_t>(plan->chunks.size());
  }
  state.counters["chunks"] = static_cast<double>(chunks);
  state.counters["seconds_per_chunk"] = benchmark::Counter(
      static_cast<double>(chunks) * state.iterations(),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_PlanChunks)->Arg(1)->Arg(128);

class FirstElement : public ChunkFunction {
 public:
  absl::StatusOr<Terms> Forward(Slices s) override {
    return Terms{{s[0]->data_as<float>()[0]}, {1.0}};
  }
  absl::Status Backward(Slices, const Terms&, Slices) override {
    return absl::OkStatus();
  }
};

void BM_ChunkedReduce(benchmark::State& state) {
  const int64_t rows = 65536;
  std::vector<float> hidden(rows * 4);
  FirstElement function;
  const ChunkedReduceOptions options{
      .chunk_size = state.range(0), .dim = 0, .checkpoint = false};
  for (auto _ : state) {
    auto reduction = ChunkedReduction::Run(
        function, {TensorView::Of(hidden.data(), {rows, 4})}, options);
    benchmark::DoNotOptimize(reduction);
  }
  const double chunks = static_cast<double>(rows / state.range(0));
  state.counters["seconds_per_chunk"] = benchmark::Counter(
      chunks * state.iterations(),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_ChunkedReduce)->Arg(16)->Arg(2048);

}  // namespace
}  // namespace dflash
