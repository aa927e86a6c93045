// The fused head in every execution mode on a synthetic DFlash batch (frozen
// FP32 head, dflash loss with gamma 7), in a training loop's steady state
// (second step on a caching allocator), next to the floor for the same work:
// the two GEMMs of the projected rows (logits = X W^T, grad = D W) timed with
// plain cblas_sgemm in the same process. Reports time, effective GFLOP/s
// (the 2 floor GEMMs' flops / time), peak bytes from the tracking allocator,
// GEMM passes, and gemm_ratio = time / floor time.
#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/checksum.h"
#include "bench/gemm_floor.h"
#include "bench/head_cases.h"
#include "benchmark/benchmark.h"

namespace dflash {
namespace {

// Chunks of 8 blocks (128 rows, a tight logits budget: 16 MiB at V =
// 32768, 78 MiB at V = 151936) and of 32 blocks (512 rows), with the weight
// laid out once for oneDNN and with OpenBLAS per chunk.
constexpr HeadShape kShapes[] = {
    {112, 1024, 32768, 8, true},   {112, 1024, 32768, 32, true},
    {60, 1024, 151936, 8, true},   {60, 1024, 151936, 32, true},
    {112, 1024, 32768, 8, false},  {60, 1024, 151936, 8, false},
};

// The floor for one shape, measured once per process: the faster of one
// GEMM pair over all rows and the pair chunk by chunk.
double FloorSeconds(const HeadShape& shape, int64_t rows) {
  static std::map<std::pair<int64_t, int64_t>, double> cache;
  const auto key = std::make_pair(shape.vocab, rows);
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache
             .emplace(key, GemmFloorSeconds(
                               rows, shape.hidden, shape.vocab,
                               rows * shape.blocks_per_chunk / shape.anchors))
             .first;
  }
  return it->second;
}

void BM_Head(benchmark::State& state, HeadShape shape,
             v1::HeadConfig::ExecutionMode mode) {
  auto config = HeadBenchConfig(shape, mode);
  if (!config.ok()) {
    state.SkipWithError(std::string(config.status().message()).c_str());
    return;
  }
  auto batch = HeadBenchBatch(*config, shape);
  if (!batch.ok()) {
    state.SkipWithError(std::string(batch.status().message()).c_str());
    return;
  }
  // A training loop's steady state: the allocator keeps its blocks, a
  // first, untimed step has faulted their pages in, and the frozen weight
  // was laid out before the loop.
  TrackingAllocator allocator(std::numeric_limits<int64_t>::max(),
                              /*cache_blocks=*/true);
  auto prepared = PrepareHeadCase(*config, *batch);
  if (!prepared.ok()) {
    state.SkipWithError(std::string(prepared.status().message()).c_str());
    return;
  }
  if (auto warm = RunHeadCase(*config, *batch, allocator, prepared->get());
      !warm.ok()) {
    state.SkipWithError(std::string(warm.status().message()).c_str());
    return;
  }
  HeadStats stats;
  for (auto _ : state) {
    auto result = RunHeadCase(*config, *batch, allocator, prepared->get());
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      return;
    }
    stats = result->stats;
    state.SetIterationTime(stats.forward_seconds + stats.backward_seconds);
  }
  const double seconds = stats.forward_seconds + stats.backward_seconds;
  const double floor = FloorSeconds(shape, stats.projected_rows);
  const double floor_flops =
      2 * 2.0 * stats.projected_rows * shape.hidden * shape.vocab;
  state.counters["rows"] = static_cast<double>(stats.projected_rows);
  state.counters["GFLOPs"] = floor_flops / seconds / 1e9;
  state.counters["peak_MiB"] = stats.peak_bytes / 1048576.0;
  state.counters["gemm_passes"] = stats.gemm_passes;
  state.counters["floor_s"] = floor;
  state.counters["gemm_ratio"] = seconds / floor;
  state.counters["gemm_s"] = stats.gemm_seconds;
  state.counters["loss_s"] = stats.loss_seconds;
  state.counters["prepare_s"] =
      *prepared != nullptr ? (*prepared)->prepare_seconds() : 0.0;
}

// What each run given a PreparedProjection pays to find a weight written in
// place: ContentChecksum over W [V, 1024] float32 (Revalidate's pass), next
// to a floor measured in the same process: a plain sum of the same words
// on the same threads (a read at memory speed).
void BM_WeightChecksum(benchmark::State& state) {
  const int64_t vocab = state.range(0), hidden = 1024;
  const int threads = static_cast<int>(state.range(1));
  // The weight's bits as words, so the floor reads them as integers (a
  // vectorised sum; a float sum would be serial).
  std::vector<uint32_t> weight(vocab * hidden);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = 0x3a000000u + i % 977;
  const size_t bytes = weight.size() * sizeof(uint32_t);
  auto seconds_of = [](auto&& work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  auto read = [&] {
    uint32_t sum = 0;
#pragma omp parallel for simd num_threads(threads) reduction(+ : sum)
    for (int64_t i = 0; i < static_cast<int64_t>(weight.size()); ++i) {
      sum += weight[i];
    }
    benchmark::DoNotOptimize(sum);
  };
  read();
  double floor = std::numeric_limits<double>::max();
  for (int repeat = 0; repeat < 5; ++repeat) {
    floor = std::min(floor, seconds_of(read));
  }
  double total = 0;
  for (auto _ : state) {
    const double seconds = seconds_of([&] {
      benchmark::DoNotOptimize(
          ContentChecksum(weight.data(), bytes, threads));
    });
    state.SetIterationTime(seconds);
    total += seconds;
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
  state.counters["floor_ms"] = floor * 1e3;
  state.counters["floor_ratio"] = total / state.iterations() / floor;
}
BENCHMARK(BM_WeightChecksum)
    ->ArgsProduct({{32768, 151936}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

int Register() {
  for (const HeadShape& shape : kShapes) {
    for (v1::HeadConfig::ExecutionMode mode : BenchModes()) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Head/", v1::HeadConfig::ExecutionMode_Name(mode),
                       "/V", shape.vocab, "/chunk_rows",
                       16 * shape.blocks_per_chunk,
                       shape.pack_weight ? "/onednn" : "/openblas")
              .c_str(),
          BM_Head, shape, mode)
          ->UseManualTime()
          ->Iterations(1)
          ->Unit(benchmark::kSecond);
    }
  }
  return 0;
}
const int registered = Register();

}  // namespace
}  // namespace dflash
