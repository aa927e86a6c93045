// Throughput of the fused loss pass (stats, terms, gradient in place) over a
// 64-row logits chunk, next to a plain read (a float sum) of the same buffer
// measured in the same run: read_ratio = kernel time / read time, the aim is
// about 3.
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "losses/chunk_loss.h"

namespace dflash {
namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kBlock = 16;

double SecondsToRead(const std::vector<float>& buffer) {
  constexpr int kReps = 5;
  float sum = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int rep = 0; rep < kReps; ++rep) {
    for (float x : buffer) sum += x;
    benchmark::DoNotOptimize(sum);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
             .count() /
         kReps;
}

void BM_DFlashChunkLoss(benchmark::State& state) {
  const int64_t vocab = state.range(0);
  std::vector<float> logits(kRows * vocab);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-4, 4);
  for (float& x : logits) x = uniform(rng);
  std::vector<RowMeta> rows(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    rows[r] = {static_cast<int32_t>(r * 997 % vocab),
               static_cast<int32_t>(r % kBlock), r % kBlock == 0 ? 0.0f : 1.0f};
  }
  v1::LossConfig config;
  config.mutable_dflash()->set_gamma(7);
  const double read_seconds = SecondsToRead(logits);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    auto terms = SoftmaxFamilyChunkLoss<float>(config, kBlock,
                                               absl::MakeSpan(logits), vocab,
                                               rows);
    benchmark::DoNotOptimize(terms);
  }
  const double kernel_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count() /
      static_cast<double>(state.iterations());
  const double bytes = static_cast<double>(logits.size() * sizeof(float));
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["read_bytes_per_second"] = bytes / read_seconds;
  state.counters["read_ratio"] = kernel_seconds / read_seconds;
}
BENCHMARK(BM_DFlashChunkLoss)->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dflash
