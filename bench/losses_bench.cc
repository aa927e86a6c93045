// Throughput of the fused loss pass (stats, terms, gradient in place) over a
// 64-row logits chunk, next to a plain read of the same buffer measured in the
// same run: read_ratio = kernel time / read time; the aim for the DFlash CE
// pass is about 3. The read sums 16 independent lanes so that it runs at
// memory (or cache) speed, not at the latency of one dependent add chain,
// compiled as the kernels are (-O3, the CPU's widest vectors).
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "base/bfloat16.h"
#include "base/cpu_dispatch.h"
#include "benchmark/benchmark.h"
#include "google/protobuf/text_format.h"
#include "losses/chunk_loss.h"

namespace dflash {
namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kBlock = 16;

template <typename T>
float Value(T x) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return ToFloat(x);
  } else {
    return x;
  }
}

template <typename T>
DFLASH_CPU_DISPATCH double SecondsToRead(const std::vector<T>& buffer) {
  constexpr int kReps = 5;
  constexpr int kLanes = 16;
  const auto start = std::chrono::steady_clock::now();
  for (int rep = 0; rep < kReps; ++rep) {
    float lanes[kLanes] = {};
    for (size_t i = 0; i + kLanes <= buffer.size(); i += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += Value(buffer[i + l]);
    }
    // Only the total escapes, so the lanes stay in registers.
    float total = 0;
    for (float lane : lanes) total += lane;
    benchmark::DoNotOptimize(total);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
             .count() /
         kReps;
}

template <typename T>
T From(float x) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return ToBFloat16(x);
  } else {
    return x;
  }
}

template <typename T>
void BM_ChunkLoss(benchmark::State& state, const std::string& loss_text) {
  const int64_t vocab = state.range(0);
  std::vector<T> logits(kRows * vocab), teacher(kRows * vocab);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-4, 4);
  for (T& x : logits) x = From<T>(uniform(rng));
  for (T& x : teacher) x = From<T>(uniform(rng));
  std::vector<ConfidenceOf<T>> confidence(kRows, 0.5f);
  std::vector<double> confidence_grad(kRows);
  std::vector<RowMeta> rows(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    rows[r] = {static_cast<int32_t>(r * 997 % vocab),
               static_cast<int32_t>(r % kBlock), r % kBlock == 0 ? 0.0f : 1.0f,
               r / kBlock};
  }
  v1::LossConfig config;
  google::protobuf::TextFormat::ParseFromString(loss_text, &config);
  ChunkLossOutputs outputs;
  outputs.confidence_grad = absl::MakeSpan(confidence_grad);
  const double read_seconds = SecondsToRead(logits);
  const std::vector<T> pristine = logits;
  double kernel_seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    logits = pristine;  // The pass overwrites its input with the gradient.
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    auto terms = ChunkLoss<T>(
        config, {kBlock},
        {absl::MakeSpan(logits), teacher, confidence, rows, vocab}, outputs);
    kernel_seconds += std::chrono::duration<double>(
                          std::chrono::steady_clock::now() - start)
                          .count();
    if (!terms.ok()) {
      state.SkipWithError(std::string(terms.status().message()).c_str());
    }
    benchmark::DoNotOptimize(terms);
  }
  kernel_seconds /= static_cast<double>(state.iterations());
  const double bytes = static_cast<double>(logits.size() * sizeof(T));
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["read_bytes_per_second"] = bytes / read_seconds;
  state.counters["read_ratio"] = kernel_seconds / read_seconds;
}

void BM_ChunkLossFp32(benchmark::State& state, const std::string& loss) {
  BM_ChunkLoss<float>(state, loss);
}
void BM_ChunkLossBf16(benchmark::State& state, const std::string& loss) {
  BM_ChunkLoss<BFloat16>(state, loss);
}

BENCHMARK_CAPTURE(BM_ChunkLossFp32, dflash, "dflash { gamma: 7 }")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ChunkLossBf16, dflash, "dflash { gamma: 7 }")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ChunkLossFp32, dpace, "dpace {}")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ChunkLossFp32, dspark, "dspark { gamma: 7 }")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ChunkLossFp32, forward_kl, "distillation {}")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ChunkLossFp32, reverse_kl,
                  "distillation { divergence: REVERSE_KL }")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ChunkLossFp32, jsd, "distillation { divergence: JSD }")
    ->Arg(32768)->Arg(151936)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dflash
