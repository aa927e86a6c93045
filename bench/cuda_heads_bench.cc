// The CUDA head on a large-vocabulary batch (N = 16384 rows: 8 sequences x
// 128 anchor blocks x 16; H = 4096, V = 151936; BF16, frozen, dflash gamma
// 7, chunks of 128 blocks) in every execution mode, next to the floor for
// the same work: the two cuBLAS GEMMs of the projected rows (logits and
// input gradient), timed with CUDA events in the same process, whole and
// chunk by chunk, the faster counted. Counters: TFLOPs (the floor's flops
// per second of the head), floor_s, gemm_ratio (time / floor), peak_GiB
// (device bytes, tracking allocator). Each mode runs a warm-up step first.
// BM_CudaChunkLoss times the loss kernels alone on one chunk of BF16 logits
// (2048 rows x V) per family and top-k width: GBps counts the bytes a loss
// cannot avoid (the logits read and their gradient written, the teacher
// read), so it reads as a share of the device's bandwidth, and floor_ratio
// is the loss's time over a plain kernel moving those bytes
// (LaunchStreamFloor), timed in the same process.
// Without a GPU every case reports the reason and skips.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "bench/cuda_fill.h"
#include "bench/cuda_gemm_floor.h"
#include "bench/cuda_stream_floor.h"
#include "benchmark/benchmark.h"
#include "google/protobuf/text_format.h"
#include "heads/cuda_head.h"
#include "losses/batch_layout.h"
#include "losses/chunk_loss.h"
#include "losses/cuda_chunk_loss.h"
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

// The loss kernels alone: one chunk of kLossRows rows, refilled before each
// timed run (the loss leaves its gradient in place).
constexpr int64_t kLossRows = 2048;

void BM_CudaChunkLoss(benchmark::State& state, const char* loss_text,
                      int32_t metric_top_k, int32_t caller_k) {
  Setup& s = Shared();
  if (!s.status.ok()) {
    state.SkipWithError(
        absl::StrCat("no GPU here: ", s.status.message()).c_str());
    return;
  }
  v1::LossConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(loss_text, &config)) {
    state.SkipWithError(loss_text);
    return;
  }
  const bool teacher = config.has_distillation() || config.has_dspark();
  const int64_t count = kLossRows * kVocab;
  TrackingAllocator& allocator = s.stream->allocator();
  auto logits = TrackedBuffer<BFloat16>::Create(allocator, count);
  auto teacher_logits =
      TrackedBuffer<BFloat16>::Create(allocator, teacher ? count : 0);
  auto top_k = TrackedBuffer<int32_t>::Create(allocator, kLossRows * caller_k);
  auto params = ResolveChunkLoss(config);
  for (const absl::Status& st : {logits.status(), teacher_logits.status(),
                                 top_k.status(), params.status()}) {
    if (!st.ok()) {
      state.SkipWithError(std::string(st.message()).c_str());
      return;
    }
  }
  const ChunkLossOptions options{kBlock, 1, 0, metric_top_k};
  auto loss = CudaChunkLoss<BFloat16>::Create(*params, options, *s.stream);
  if (!loss.ok()) {
    state.SkipWithError(std::string(loss.status().message()).c_str());
    return;
  }
  LaunchFillNormal(teacher_logits->data(), teacher_logits->size(), 2.0f, 4,
                   s.stream->stream());
  const std::vector<RowMeta> rows(s.rows.begin(), s.rows.begin() + kLossRows);
  const ChunkLossInputs<BFloat16> inputs{
      absl::MakeSpan(logits->data(), count),
      absl::MakeConstSpan(teacher_logits->data(), teacher_logits->size()),
      {},
      rows,
      kVocab};
  ChunkLossOutputs outputs;
  outputs.top_k = absl::MakeSpan(top_k->data(), top_k->size());
  outputs.k = caller_k;
  using Clock = std::chrono::steady_clock;
  // The floor: the fastest of a few plain passes over the same bytes.
  double floor_seconds = 0;
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point start = Clock::now();
    LaunchStreamFloor(logits->data(),
                      teacher ? teacher_logits->data() : nullptr, count,
                      s.stream->stream());
    const absl::Status done = s.stream->Synchronize();
    if (!done.ok()) {
      state.SkipWithError(std::string(done.message()).c_str());
      return;
    }
    const double seconds =
        std::chrono::duration<double>(Clock::now() - start).count();
    floor_seconds = i == 0 ? seconds : std::min(floor_seconds, seconds);
  }
  double loss_seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    LaunchFillNormal(logits->data(), count, 2.0f, 3, s.stream->stream());
    const absl::Status filled = s.stream->Synchronize();
    state.ResumeTiming();
    const Clock::time_point start = Clock::now();
    absl::Status ok = filled.ok() ? (*loss)->Run(inputs, outputs, nullptr,
                                                 /*record=*/true)
                                  : filled;
    if (ok.ok()) ok = (*loss)->Terms().status();
    loss_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (!ok.ok()) {
      state.SkipWithError(std::string(ok.message()).c_str());
      return;
    }
  }
  const double bytes = (teacher ? 3.0 : 2.0) * count * sizeof(BFloat16);
  state.counters["GBps"] = benchmark::Counter(
      bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["floor_GBps"] = bytes / 1e9 / floor_seconds;
  state.counters["floor_ratio"] =
      loss_seconds / static_cast<double>(state.iterations()) / floor_seconds;
}

int Register() {
  struct LossCase {
    const char* name;
    const char* loss;
    int32_t metric_top_k, caller_k;
  };
  for (const LossCase& c : {
           LossCase{"dflash", "dflash { gamma: 7 }", 0, 0},
           LossCase{"dflash_metric_top16", "dflash { gamma: 7 }", 16, 0},
           LossCase{"dflash_top64", "dflash { gamma: 7 }", 16, 64},
           LossCase{"dpace", "dpace { alpha: 0.3 }", 0, 0},
           LossCase{"dspark", "dspark { gamma: 7 confidence_weight: 0 }", 0, 0},
           LossCase{"forward_kl", "distillation { divergence: FORWARD_KL }", 0,
                    0},
       }) {
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_CudaChunkLoss/", c.name, "/N2048_V151936_bf16")
            .c_str(),
        BM_CudaChunkLoss, c.loss, c.metric_top_k, c.caller_k)
        ->UseRealTime()
        ->Iterations(10)
        ->Unit(benchmark::kMillisecond);
  }
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
