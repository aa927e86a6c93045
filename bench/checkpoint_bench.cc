// Per-offer and per-fetch overhead of a checkpoint context. For scale: one
// chunk GEMM of 2048 rows x H 1024 x V 32768 is 137 GFLOP, about 1 s on this
// machine's CPU; the context's calls must be negligible next to it.
#include <cstdint>
#include <vector>

#include "benchmark/benchmark.h"
#include "checkpoint/checkpoint_context.h"
#include "checkpoint/checkpoint_policy.h"
#include "proto/config.h"

namespace dflash {
namespace {

CheckpointOptions Selective() {
  CheckpointOptions options;
  options.rules = PresetCheckpointRules(
      v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
  options.segment_chunks = 1;
  options.memory_budget_bytes = int64_t{1} << 40;
  return options;
}

// Offer + fetch + release of one small dropped intermediate: the decision
// and bookkeeping, not the copy.
void BM_OfferFetchRecompute(benchmark::State& state) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(Selective(), allocator);
  std::vector<float> value(16, 1.0f);
  const IntermediateInfo info{"loss_stats", IntermediateKind::kLossStatistics, false, true, 0};
  auto recompute = [](const TensorView&) { return absl::OkStatus(); };
  int64_t chunk = 0;
  for (auto _ : state) {
    auto kept = (*context)->Offer(chunk, info,
                                  TensorView::Of(value.data(), {16}), recompute);
    auto fetched = (*context)->Fetch(chunk, "loss_stats");
    benchmark::DoNotOptimize(fetched);
    (*context)->Release(chunk);
    ++chunk;
  }
  state.counters["seconds_per_call"] = benchmark::Counter(
      2.0 * state.iterations(),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_OfferFetchRecompute);

// Keeping a frozen projection's logits: offer copies the chunk into the
// store; reported as bytes per second next to the copy size.
void BM_OfferKeptLogits(benchmark::State& state) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(Selective(), allocator);
  const int64_t n = state.range(0);
  std::vector<float> logits(n, 1.0f);
  const IntermediateInfo info{"teacher_logits", IntermediateKind::kProjection, true, false, 0};
  int64_t chunk = 0;
  for (auto _ : state) {
    auto kept = (*context)->Offer(chunk, info, TensorView::Of(logits.data(), {n}),
                                  nullptr);
    benchmark::DoNotOptimize(kept);
    (*context)->Release(chunk++);
  }
  state.SetBytesProcessed(state.iterations() * n * 4);
  state.counters["peak_bytes"] = static_cast<double>(allocator.peak_bytes());
}
BENCHMARK(BM_OfferKeptLogits)->Arg(64 * 32768);

}  // namespace
}  // namespace dflash
