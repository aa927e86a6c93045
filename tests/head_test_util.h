#ifndef DFLASH_TESTS_HEAD_TEST_UTIL_H_
#define DFLASH_TESTS_HEAD_TEST_UTIL_H_

// The head parity suite's batch, float64 reference and configs, shared by
// the CPU suite (head_parity_test) and its re-run on CUDA
// (cuda_head_parity_test).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "base/error_norms.h"
#include "heads/cpu_head.h"
#include "losses/chunk_loss.h"
#include "proto/objective.pb.h"

namespace dflash {
namespace head_test {

constexpr int64_t kK = 4, kV = 23, kH = 8, kS = 14;
constexpr int32_t kTopK = 3;

// A DFlash batch in float64: token layout -> rows, random states, weights.
struct Batch {
  int64_t batch = 2, anchors = 3;
  std::vector<RowMeta> rows;
  std::vector<double> hidden, teacher, weight, bias, confidence;
  int64_t num_rows() const { return static_cast<int64_t>(rows.size()); }
};

Batch MakeBatch(uint32_t seed, int64_t batch = 2, int64_t anchors = 3);

// The reference: every row projected with naive float64 loops, one
// unchunked loss call over all rows (//losses verifies it against its own
// naive reference and finite differences), then the gradients by naive
// loops, divided by the denominator.
struct Reference {
  double loss = 0;
  ChunkTerms terms;
  std::vector<double> grad_hidden, grad_weight, grad_bias;
  std::vector<double> grad_confidence, neg_log_q;
  std::vector<int32_t> argmax, top_k;  // top_k: kTopK per row.
};

Reference Naive(const v1::ObjectiveConfig& config, const Batch& b);

// An objective over Batch's shape, built as XNNPACK's testers are: name
// what differs from the defaults, then Build(). float64 on the CPU, FUSED,
// 2 blocks per chunk, segments of 1 chunk, 1 thread, frozen, with a bias.
//   ConfigBuilder("dpace {}").Mode("CHECKPOINT").Segment(2).Build()
class ConfigBuilder {
 public:
  // `loss`: a LossConfig body in text format.
  explicit ConfigBuilder(std::string loss = "dflash {}")
      : loss_(std::move(loss)) {}
  ConfigBuilder& Mode(std::string mode) {  // An ExecutionMode name.
    mode_ = std::move(mode);
    return *this;
  }
  ConfigBuilder& BlocksPerChunk(int64_t blocks) {
    blocks_per_chunk_ = blocks;
    return *this;
  }
  // Chunks per recompute segment (CHECKPOINT and SELECTIVE).
  ConfigBuilder& Segment(int64_t chunks) {
    segment_ = chunks;
    return *this;
  }
  ConfigBuilder& Threads(int threads) {
    threads_ = threads;
    return *this;
  }
  ConfigBuilder& Trainable(bool trainable = true) {
    trainable_ = trainable;
    return *this;
  }
  ConfigBuilder& Bias(bool bias) {
    bias_ = bias;
    return *this;
  }
  // More HeadConfig fields in text format ("logit_softcap: 30").
  ConfigBuilder& ExtraHead(std::string fields) {
    extra_head_ = std::move(fields);
    return *this;
  }
  // Loaded (defaults resolved) and validated; a failure fails the test.
  v1::ObjectiveConfig Build() const;

 private:
  std::string loss_;
  std::string mode_ = "FUSED";
  int64_t blocks_per_chunk_ = 2;
  int64_t segment_ = 1;
  int threads_ = 1;
  bool trainable_ = false;
  bool bias_ = true;
  std::string extra_head_;
};

// max |a - b| / max |b|: the normwise relative error of a gradient.
template <typename T>
double RelativeError(const std::vector<T>& a, const std::vector<double>& b) {
  return RelativeMaxError<T>(a, b);
}

// What a head run left, copied to the host in float64.
struct RunOutputs {
  std::vector<double> grad_hidden, grad_weight, grad_bias;
  std::vector<double> grad_confidence, neg_log_q;
  std::vector<int32_t> argmax, top_k;  // top_k: kTopK per row, or none.
};

// Expects a run to equal the reference: loss and gradients (normwise)
// within `relative`, correct counts exact, per-row neg_log_q and confidence
// gradient within `outputs` * (1 + |reference|), argmax and top-k exact;
// rows without weight report 0 and -1.
void ExpectMatchesReference(const HeadResult& result, const RunOutputs& out,
                            const Reference& ref, const Batch& b,
                            bool trainable, double relative, double outputs);

inline const char* const kLosses[] = {
    "dflash { gamma: 7 }",
    "dpace { alpha: 0.3 }",
    "tv { gamma: 7 }",
    "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }",
    "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } }",
    "dpace { alpha: 0.3 lk { type: TV } }",
    "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
    "distillation { divergence: FORWARD_KL temperature: 2 }",
    "distillation { divergence: JSD beta: 0.3 }",
};
// Whether a head with `loss` may train its projection (the batch-level LK
// lambda may not: proto/config.cc says why).
bool TrainsWith(const std::string& loss);

inline const char* const kModes[] = {"MATERIALIZE", "SAVE_CHUNKS", "CHECKPOINT",
                                     "SELECTIVE", "FUSED"};

}  // namespace head_test
}  // namespace dflash

#endif  // DFLASH_TESTS_HEAD_TEST_UTIL_H_
