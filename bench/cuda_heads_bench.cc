// The CUDA head on a large-vocabulary batch (N = 16384 rows: 8 sequences x
// 128 anchor blocks x 16; H = 4096, V = 151936; BF16, frozen, dflash gamma
// 7, chunks of 128 blocks) in every execution mode, next to the floor for
// the same work: the two cuBLAS GEMMs of the projected rows (logits and
// input gradient), timed with CUDA events in the same process, whole and
// chunk by chunk, the faster counted. Counters: TFLOPs (the floor's flops
// per second of the head), floor_s, gemm_ratio (time / floor), peak_GiB
// (device bytes, tracking allocator). Each mode runs a warm-up step first.
// Without a GPU every case reports the reason and skips.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "bench/cuda_fill.h"
#include "bench/cuda_gemm_floor.h"
#include "benchmark/benchmark.h"
#include "heads/cuda_head.h"
#include "losses/batch_layout.h"
#include "proto/config.h"

namespace dflash {
namespace {

constexpr int64_t kBatch = 8, kSeq = 4096, kAnchors = 128, kBlock = 16;
constexpr int64_t kHidden = 4096, kVocab = 151936, kBlocksPerChunk = 128;

// Everything the cases share: device, rows, device tensors, the floor.
struct Setup {
  absl::Status status;
  std::unique_ptr<CudaStream> stream;
  std::unique_ptr<CublasHandle> blas;
  std::vector<RowMeta> rows;
  TrackedBuffer<BFloat16> hidden, weight, grad;
  int64_t projected = 0;
  double floor_seconds = 0;
};

Setup& Shared() {
  static Setup* setup = [] {
    auto* s = new Setup;
    auto stream = CudaStream::Create();
    if (!stream.ok()) {
      s->status = stream.status();
      return s;
    }
    s->stream = *std::move(stream);
    auto blas = CublasHandle::Create(*s->stream);
    if (!blas.ok()) {
      s->status = blas.status();
      return s;
    }
    s->blas = *std::move(blas);
    std::vector<int64_t> ids(kBatch * kSeq);
    std::vector<uint8_t> mask(kBatch * kSeq);
    uint64_t x = 88172645463325252ull;
    for (int64_t i = 0; i < kBatch * kSeq; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      ids[i] = static_cast<int64_t>(x % kVocab);
      mask[i] = (i % kSeq) % 7 != 6;
    }
    const TokenBatch tokens{kBatch, kSeq, ids, mask};
    auto anchors = SampleAnchors(tokens, kAnchors, 1);
    if (!anchors.ok()) {
      s->status = anchors.status();
      return s;
    }
    auto rows =
        LabelRows(tokens, anchors->positions, anchors->keep,
                  anchors->num_anchors, kBlock, kVocab, Labeling::kDFlash);
    if (!rows.ok()) {
      s->status = rows.status();
      return s;
    }
    s->rows = *std::move(rows);
    for (const RowMeta& r : s->rows) s->projected += r.mask > 0;
    const int64_t n = static_cast<int64_t>(s->rows.size());
    TrackingAllocator& allocator = s->stream->allocator();
    auto hidden = TrackedBuffer<BFloat16>::Create(allocator, n * kHidden);
    auto weight = TrackedBuffer<BFloat16>::Create(allocator, kVocab * kHidden);
    auto grad = TrackedBuffer<BFloat16>::Create(allocator, n * kHidden);
    for (const absl::Status& st :
         {hidden.status(), weight.status(), grad.status()}) {
      if (!st.ok()) {
        s->status = st;
        return s;
      }
    }
    s->hidden = *std::move(hidden);
    s->weight = *std::move(weight);
    s->grad = *std::move(grad);
    LaunchFillNormal(s->hidden.data(), s->hidden.size(), 1.0f, 1,
                     s->stream->stream());
    LaunchFillNormal(s->weight.data(), s->weight.size(),
                     1.0f / 64 /* 1 / sqrt(H) */, 2, s->stream->stream());
    const int64_t chunk_rows =
        s->projected * kBlocksPerChunk / kAnchors / kBatch;
    auto floor = CudaGemmFloorSeconds(*s->blas, s->projected, kHidden,
                                      kVocab, /*bfloat16=*/true, chunk_rows);
    if (!floor.ok()) {
      s->status = floor.status();
      return s;
    }
    s->floor_seconds = *floor;
    s->status = s->stream->Synchronize();
    return s;
  }();
  return *setup;
}

void BM_CudaHead(benchmark::State& state, v1::HeadConfig::ExecutionMode mode) {
  Setup& s = Shared();
  if (!s.status.ok()) {
    state.SkipWithError(
        absl::StrCat("no GPU here: ", s.status.message()).c_str());
    return;
  }
  const std::string checkpoint =
      mode == v1::HeadConfig::SELECTIVE
          ? "checkpoint { preset: SELECTIVE_FROZEN_PROJECTION }"
          : "";
  auto config = LoadObjectiveConfigFromString(absl::StrCat(
      "layout { block_size: ", kBlock, " num_anchors: ", kAnchors,
      " } chunking { blocks_per_chunk: ", kBlocksPerChunk, " } ", checkpoint,
      " head { vocab_size: ", kVocab, " hidden_size: ", kHidden,
      " backend: CUDA dtype: BFLOAT16 mode: ",
      v1::HeadConfig::ExecutionMode_Name(mode),
      " } loss { dflash { gamma: 7 } }"));
  if (!config.ok()) {
    state.SkipWithError(std::string(config.status().message()).c_str());
    return;
  }
  const HeadInputs<BFloat16> inputs{
      absl::MakeConstSpan(s.hidden.data(), s.hidden.size()), {}, {}, s.rows,
      absl::MakeConstSpan(s.weight.data(), s.weight.size()), {}};
  const HeadGradients<BFloat16> gradients{
      absl::MakeSpan(s.grad.data(), s.grad.size()), {}, {}, {}};
  auto warm = RunCudaHead<BFloat16>(*config, inputs, gradients, *s.blas);
  if (!warm.ok()) {
    state.SkipWithError(std::string(warm.status().message()).c_str());
    return;
  }
  HeadStats stats;
  for (auto _ : state) {
    auto result = RunCudaHead<BFloat16>(*config, inputs, gradients, *s.blas);
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      return;
    }
    stats = result->stats;
    state.SetIterationTime(stats.forward_seconds + stats.backward_seconds);
  }
  const double seconds = stats.forward_seconds + stats.backward_seconds;
  const double floor_flops = 2 * 2.0 * s.projected * kHidden * kVocab;
  state.counters["rows"] = static_cast<double>(s.rows.size());
  state.counters["projected"] = static_cast<double>(s.projected);
  state.counters["TFLOPs"] = floor_flops / seconds / 1e12;
  state.counters["floor_s"] = s.floor_seconds;
  state.counters["floor_TFLOPs"] = floor_flops / s.floor_seconds / 1e12;
  state.counters["gemm_ratio"] = seconds / s.floor_seconds;
  state.counters["gemm_passes"] = stats.gemm_passes;
  state.counters["peak_GiB"] = stats.peak_bytes / 1073741824.0;
}

int Register() {
  for (v1::HeadConfig::ExecutionMode mode :
       {v1::HeadConfig::FUSED, v1::HeadConfig::CHECKPOINT,
        v1::HeadConfig::SELECTIVE, v1::HeadConfig::SAVE_CHUNKS,
        v1::HeadConfig::MATERIALIZE}) {
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_CudaHead/", v1::HeadConfig::ExecutionMode_Name(mode),
                     "/N16384_H4096_V151936_bf16")
            .c_str(),
        BM_CudaHead, mode)
        ->UseManualTime()
        ->Iterations(5)
        ->Unit(benchmark::kMillisecond);
  }
  return 0;
}
const int registered = Register();

}  // namespace
}  // namespace dflash
