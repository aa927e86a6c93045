#ifndef DFLASH_BENCH_HEAD_CASES_H_
#define DFLASH_BENCH_HEAD_CASES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/tracking_allocator.h"
#include "heads/cpu_head.h"
#include "heads/prepared_projection.h"
#include "heads/synthetic_batch.h"
#include "proto/objective.pb.h"

namespace dflash {

// A benchmarked head: a synthetic batch of one sequence with `anchors`
// blocks of 16 (FP32, frozen head, dflash loss with gamma 7).
struct HeadShape {
  int64_t anchors = 128;
  int64_t hidden = 1024;
  int64_t vocab = 32768;
  int64_t blocks_per_chunk = 64;
  // head.pack_weight: the frozen weight laid out once for oneDNN, prepared
  // before the timed steps as a training loop would (PreparedProjection);
  // false: OpenBLAS per chunk.
  bool pack_weight = true;
  // head.threads (0: all cores) and head.gradient_filter (0: exact).
  int threads = 0;
  double gradient_filter = 0;
  // The peaked synthetic batch (heads/synthetic_batch.h) with its
  // rare-token bias, at logit scale 2: the target and the frequent ids take
  // the softmax mass, as a trained draft model's do.
  bool peaked = false;
};

// The execution modes, in the order of the cost table in docs/semantics.md
// section 8.
const std::vector<v1::HeadConfig::ExecutionMode>& BenchModes();

// The objective of `shape` in `mode` (SELECTIVE with the frozen-projection
// preset), validated.
absl::StatusOr<v1::ObjectiveConfig> HeadBenchConfig(
    const HeadShape& shape, v1::HeadConfig::ExecutionMode mode);

// The synthetic batch of `shape` (seed 1).
absl::StatusOr<HeadBatch<float>> HeadBenchBatch(
    const v1::ObjectiveConfig& config, const HeadShape& shape);

// One forward and backward of `config` over `batch`. Pass the same caching
// allocator to successive runs to measure a training loop's steady state
// (no fresh pages after the first step); peak bytes are each run's own.
// The weight laid out once for the case's steps, or null where the config
// does not pack it.
absl::StatusOr<std::unique_ptr<PreparedProjection>> PrepareHeadCase(
    const v1::ObjectiveConfig& config, const HeadBatch<float>& batch);

absl::StatusOr<HeadResult> RunHeadCase(
    const v1::ObjectiveConfig& config, const HeadBatch<float>& batch,
    TrackingAllocator& allocator,
    const PreparedProjection* prepared = nullptr,
    std::vector<float>* grad_hidden = nullptr);

}  // namespace dflash

#endif  // DFLASH_BENCH_HEAD_CASES_H_
