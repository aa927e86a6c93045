// The fused head in every execution mode on a synthetic DFlash batch (frozen
// FP32 head, dflash loss with gamma 7), next to the floor for the same work:
// the two GEMMs of the projected rows (logits = X W^T, grad = D W) timed with
// plain cblas_sgemm in the same process. Reports time, effective GFLOP/s
// (the 2 floor GEMMs' flops / time), peak bytes from the tracking allocator,
// GEMM passes, and gemm_ratio = time / floor time.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "bench/gemm_floor.h"
#include "benchmark/benchmark.h"
#include "heads/fused_head.h"
#include "heads/synthetic_batch.h"
#include "proto/config.h"

namespace dflash {
namespace {

struct Shape {
  int64_t anchors, hidden, vocab, blocks_per_chunk;
};
constexpr Shape kShapes[] = {
    // Chunks of about 800 and 400 weighted rows: below a few hundred rows
    // per chunk OpenBLAS's GEMMs lose 20-40% of their rate here.
    {128, 1024, 32768, 64},  // N = 2048 rows.
    {64, 1024, 151936, 32},  // N = 1024 rows, large vocabulary.
};
constexpr int64_t kBlock = 16;
const char* const kModes[] = {"MATERIALIZE", "SAVE_CHUNKS", "CHECKPOINT",
                              "SELECTIVE", "FUSED"};

v1::ObjectiveConfig Config(const Shape& shape, const std::string& mode) {
  std::string checkpoint;
  if (mode == "SELECTIVE") {
    checkpoint = "checkpoint { preset: SELECTIVE_FROZEN_PROJECTION }";
  }
  auto config = LoadObjectiveConfigFromString(absl::StrCat(
      "layout { block_size: ", kBlock, " num_anchors: ", shape.anchors,
      " } chunking { blocks_per_chunk: ", shape.blocks_per_chunk, " } ",
      checkpoint, " head { vocab_size: ", shape.vocab,
      " hidden_size: ", shape.hidden, " mode: ", mode,
      " } loss { dflash { gamma: 7 } }"));
  if (!config.ok()) std::abort();
  return *config;
}

// The floor for one shape, measured once per process.
double FloorSeconds(const Shape& shape, int64_t rows) {
  static std::map<std::pair<int64_t, int64_t>, double> cache;
  const auto key = std::make_pair(shape.vocab, rows);
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(key, GemmFloorSeconds(rows, shape.hidden, shape.vocab))
             .first;
  }
  return it->second;
}

void BM_Head(benchmark::State& state, Shape shape, std::string mode) {
  const v1::ObjectiveConfig config = Config(shape, mode);
  auto batch = MakeSyntheticBatch<float>(config, {1, 8192, shape.anchors}, 1);
  if (!batch.ok()) {
    state.SkipWithError(std::string(batch.status().message()).c_str());
    return;
  }
  const int64_t rows = static_cast<int64_t>(batch->rows.size());
  std::vector<float> grad_hidden(rows * shape.hidden);
  const HeadInputs<float> inputs = batch->Inputs(config);
  HeadGradients<float> gradients{absl::MakeSpan(grad_hidden), {}, {}, {}};
  HeadStats stats;
  for (auto _ : state) {
    TrackingAllocator allocator;
    auto result = RunHead<float>(config, inputs, gradients, allocator);
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
}

int Register() {
  for (const Shape& shape : kShapes) {
    for (const char* mode : kModes) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Head/", mode, "/V", shape.vocab).c_str(), BM_Head,
          shape, std::string(mode))
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
