// The vocab-parallel CUDA head (issue 31) against the single-process
// RunCudaHead on the whole weight: W = 2 and 3 (4 in one case) "processes"
// as threads, each with its own stream and cuBLAS handle (OpenGpu), its
// contiguous range of the weight's rows and the bias (SplitVocab: V = 23
// divisible by none of them), head.vocab_size its width, and a VocabShard
// on a ThreadGroup exchange, whose timeout turns a hang into a failure.
// The single-process CUDA head is checked against the float64 reference by
// //tests:cuda_head_parity_test, and the CPU vocab-parallel head against
// the CPU single-process one by //tests:vocab_parallel_test.
//
// Every family (the softmax ones, DSpark with and without the teacher's
// terms and with a correction, D-PARD, distillation, Domino's split
// correction, the teacher diagnostics) in every mode. Checked: the loss,
// every term and the accuracies; argmax, teacher argmax, Domino's base
// argmax and the rows' top-k ids exactly (k = 6 and the metric's 8, above
// the widths of W = 3's ranges); top-k values, neg_log_q, loss_weight and
// the confidence gradient per row; d/d(hidden) and d/d(correction inputs)
// summed over the processes; d/d(weight), d/d(bias) and d/d(correction
// weight) stacked in rank order. float32 within 1e-6 (relative; gradients
// normwise). bfloat16: the loss, terms and per-row outputs within 1e-5, the
// gradients within 1e-2 normwise, as the dlogits and each process's partial
// hidden gradient are rounded to bfloat16, so that an entry may differ by
// an ulp (2^-8). Every process's loss, terms, accuracies and row outputs
// are bitwise equal to process 0's, and every run, failed or not, leaves
// its stream's allocator where it found it. The batch has a fully masked
// chunk (blocks 2 and 3, chunk 1 of 3) in every case. A NaN on one process
// is an error on every process, and head.device_results is refused on
// every process. Skipped, with the reason, where no GPU is usable.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/gpu_test.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/config/head_facts.h"
#include "heads/cuda_head.h"
#include "heads/head_types.h"
#include "losses/device_results.h"
#include "losses/loss_family.h"
#include "losses/vocab_shard.h"
#include "proto/objective.pb.h"
#include "tests/cuda_test_util.h"
#include "tests/head_test_util.h"
#include "tests/thread_vocab_exchange.h"

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using testing_vocab::Ranges;
using testing_vocab::RunRanks;
using testing_vocab::SplitVocab;
using testing_vocab::ThreadGroup;

constexpr int64_t kV = head_test::kV, kH = head_test::kH, kK = head_test::kK;
// The rows' top-k (row_outputs.k) and the metric's: k above the width of
// W = 3's and 4's ranges (7 and 5 classes).
constexpr int32_t kTopK = 6, kMetricTopK = 8;
// The emulated device runs a process's chunks slowly; a hang still fails.
constexpr std::chrono::milliseconds kTimeout(120000);
constexpr double kUpstream = 0.75;

// head_test's batch (2 sequences x 3 blocks of 4 rows) with blocks 2 and 3
// without a mask: with 2 blocks per chunk, chunk 1 of 3 carries nothing.
Batch MakeShardBatch() {
  Batch b = head_test::MakeBatch(11);
  for (int64_t r = 2 * kK; r < 4 * kK; ++r) b.rows[r].mask = 0;
  return b;
}

// The builder's config on CUDA in `dtype`, with the top-k metric.
v1::ObjectiveConfig OnCuda(const ConfigBuilder& builder,
                           v1::HeadConfig::DType dtype) {
  v1::ObjectiveConfig config = builder.Build();
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(dtype);
  config.mutable_head()->set_metric_top_k(kMetricTopK);
  return config;
}

// A correction's inputs z [rows, r] and weight M [V, r]: fixed values.
std::vector<double> CorrectionValues(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 0.5);
  std::vector<double> values(n);
  for (double& x : values) x = normal(rng);
  return values;
}

// What a process's run is given beyond its range of the batch: a buffer a
// refused feature needs, or a NaN that makes it fail there alone.
struct Extras {
  bool device_results = false;  // HeadOptions::device_results, a buffer.
  int64_t nan_weight = -1;      // An element of this process's weight rows.
  int64_t nan_hidden = -1;      // An element of its copy of the hidden states.
  int64_t nan_teacher = -1;     // Of its copy of the teacher's.
};

// What one process's run left, read back to the host.
struct ProcessRun {
  absl::Status status;
  HeadResult result;
  std::vector<double> grad_hidden, grad_weight, grad_bias, grad_confidence;
  std::vector<double> grad_z, grad_m;  // The correction's inputs, weight.
  std::vector<double> neg_log_q, loss_weight, top_k_values;
  std::vector<int32_t> argmax, teacher_argmax, base_argmax, top_k;
};

// One process's RunCudaHead over classes [offset, offset + width) (the
// single-process run: 0, kV and no shard) on a stream of its own.
template <typename T>
ProcessRun RunAs(const v1::ObjectiveConfig& whole, const Batch& b,
                 int64_t offset, int64_t width, const VocabShard* shard,
                 const Extras& extras) {
  ProcessRun out;
  absl::StatusOr<Gpu> gpu = OpenGpu();
  if (!gpu.ok()) {
    out.status = gpu.status();
    return out;
  }
  CudaStream& stream = *gpu->stream;
  const int64_t base = stream.allocator().current_bytes();
  v1::ObjectiveConfig config = whole;
  config.mutable_head()->set_vocab_size(width);
  const v1::HeadConfig& head = config.head();
  const bool trainable = head.trainable();
  const bool confidence = LossTraitsOf(config.loss()).needs_confidence;
  const bool teacher = ProjectsTeacher(config);
  const int64_t rank = head.correction_rank();
  // Domino takes no top-k.
  const int32_t k = config.loss().has_domino() ? 0 : kTopK;
  const int64_t rows = b.num_rows();
  std::vector<double> weight(b.weight.begin() + offset * kH,
                             b.weight.begin() + (offset + width) * kH);
  std::vector<double> bias(b.bias.begin() + offset,
                           b.bias.begin() + offset + width);
  const std::vector<double> all_m = CorrectionValues(kV * rank, 29);
  const std::vector<double> z = CorrectionValues(b.num_rows() * rank, 23);
  const std::vector<double> m(all_m.begin() + offset * rank,
                              all_m.begin() + (offset + width) * rank);
  std::vector<double> hidden = b.hidden;
  std::vector<double> teacher_hidden =
      teacher ? b.teacher : std::vector<double>();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (extras.nan_weight >= 0) weight[extras.nan_weight] = nan;
  if (extras.nan_hidden >= 0) hidden[extras.nan_hidden] = nan;
  if (extras.nan_teacher >= 0) teacher_hidden[extras.nan_teacher] = nan;
  auto sized = [](bool given, int64_t n) {
    return std::vector<double>(given ? n : 0, 7);  // The head overwrites.
  };
  {
    TrackedBuffer<T> d_hidden = Upload<T>(hidden, stream);
    TrackedBuffer<T> d_teacher = Upload<T>(teacher_hidden, stream);
    TrackedBuffer<float> d_confidence = Upload<float>(
        confidence ? b.confidence : std::vector<double>(), stream);
    TrackedBuffer<T> d_weight = Upload<T>(weight, stream);
    TrackedBuffer<T> d_bias =
        Upload<T>(head.bias() ? bias : std::vector<double>(), stream);
    TrackedBuffer<T> d_z = Upload<T>(z, stream), d_m = Upload<T>(m, stream);
    TrackedBuffer<T> grad_z = Upload<T>(sized(true, rows * rank), stream);
    TrackedBuffer<T> grad_m = Upload<T>(sized(true, width * rank), stream);
    TrackedBuffer<T> grad_hidden = Upload<T>(sized(true, rows * kH), stream);
    TrackedBuffer<T> grad_weight =
        Upload<T>(sized(trainable, width * kH), stream);
    TrackedBuffer<T> grad_bias =
        Upload<T>(sized(trainable && head.bias(), width), stream);
    TrackedBuffer<float> grad_confidence =
        Upload<float>(sized(confidence, rows), stream);
    TrackedBuffer<double> neg_log_q = Upload<double>(sized(true, rows), stream);
    TrackedBuffer<double> loss_weight =
        Upload<double>(sized(true, rows), stream);
    TrackedBuffer<int32_t> argmax =
        Upload<int32_t>(std::vector<int32_t>(rows, 7), stream);
    TrackedBuffer<int32_t> teacher_argmax =
        Upload<int32_t>(std::vector<int32_t>(teacher ? rows : 0, 7), stream);
    TrackedBuffer<int32_t> base_argmax = Upload<int32_t>(
        std::vector<int32_t>(config.loss().has_domino() ? rows : 0, 7), stream);
    TrackedBuffer<int32_t> top_k =
        Upload<int32_t>(std::vector<int32_t>(rows * k, 7), stream);
    TrackedBuffer<float> top_k_values =
        Upload<float>(sized(true, rows * k), stream);
    TrackedBuffer<double> results = Upload<double>(
        sized(extras.device_results, DeviceResultsSize(kK)), stream);
    const HeadInputs<T> inputs{
        Span(d_hidden), Span(d_teacher), Span(d_confidence), b.rows,
        Span(d_weight), Span(d_bias),    Span(d_z),          Span(d_m)};
    const HeadGradients<T> gradients{Span(grad_hidden), Span(grad_weight),
                                     Span(grad_bias),   Span(grad_confidence),
                                     Span(grad_z),      Span(grad_m)};
    HeadRowOutputs row_outputs;
    row_outputs.neg_log_q = Span(neg_log_q);
    row_outputs.argmax = Span(argmax);
    row_outputs.top_k = Span(top_k);
    row_outputs.k = k;
    row_outputs.top_k_values = Span(top_k_values);
    row_outputs.base_argmax = Span(base_argmax);
    row_outputs.loss_weight = Span(loss_weight);
    row_outputs.teacher_argmax = Span(teacher_argmax);
    HeadOptions options;
    options.upstream_gradient = kUpstream;
    options.vocab_shard = shard;
    if (extras.device_results) options.device_results = results.data();
    absl::StatusOr<HeadResult> result = RunCudaHead<T>(
        config, inputs, gradients, *gpu->blas, row_outputs, options);
    out.status = result.status();
    if (result.ok()) out.result = *std::move(result);
    out.grad_hidden = Download(grad_hidden, stream);
    out.grad_weight = Download(grad_weight, stream);
    out.grad_bias = Download(grad_bias, stream);
    out.grad_confidence = Download(grad_confidence, stream);
    out.grad_z = Download(grad_z, stream);
    out.grad_m = Download(grad_m, stream);
    out.top_k_values = Download(top_k_values, stream);
    out.top_k = CopyBack(top_k, stream);
    out.base_argmax = CopyBack(base_argmax, stream);
    out.neg_log_q = CopyBack(neg_log_q, stream);
    out.loss_weight = CopyBack(loss_weight, stream);
    out.argmax = CopyBack(argmax, stream);
    out.teacher_argmax = CopyBack(teacher_argmax, stream);
  }
  EXPECT_TRUE(stream.Synchronize().ok());
  // Nothing of the run left on the device, failed or not.
  EXPECT_EQ(stream.allocator().current_bytes(), base) << out.status;
  return out;
}

ProcessRun RunProcess(const v1::ObjectiveConfig& config, const Batch& b,
                      int64_t offset, int64_t width, const VocabShard* shard,
                      const Extras& extras = Extras()) {
  if (config.head().dtype() == v1::HeadConfig::FLOAT32) {
    return RunAs<float>(config, b, offset, width, shard, extras);
  }
  return RunAs<BFloat16>(config, b, offset, width, shard, extras);
}

// Every process's run of `config` over `size` processes at once, process
// q given extras_of(q).
std::vector<ProcessRun> RunProcesses(
    const v1::ObjectiveConfig& config, const Batch& b, int size,
    const std::function<Extras(int)>& extras_of = [](int) {
      return Extras();
    }) {
  const Ranges ranges = SplitVocab(kV, size);
  ThreadGroup group(size, kTimeout);
  std::vector<ProcessRun> runs(size);
  RunRanks(size, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    runs[q] = RunProcess(config, b, ranges.offsets[q], ranges.widths[q], &shard,
                         extras_of(q));
  });
  return runs;
}

// |a - b| <= tolerance * max(1, |b|).
void ExpectNear(double a, double b, double tolerance, const std::string& what) {
  EXPECT_LE(std::abs(a - b), tolerance * std::max(1.0, std::abs(b)))
      << what << ": " << a << " vs " << b;
}

void ExpectTermsNear(const ChunkTerms& a, const ChunkTerms& b, double tolerance,
                     const std::string& where) {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  ExpectNear(a.field, b.field, tolerance, where + " " #field);
#define DFLASH_POSITION_TERM(field, slot, dict, key)                \
  ASSERT_EQ(a.field.size(), b.field.size()) << where << " " #field; \
  for (size_t i = 0; i < a.field.size(); ++i) {                     \
    ExpectNear(a.field[i], b.field[i], tolerance,                   \
               absl::StrCat(where, " " #field "[", i, "]"));        \
  }
#define DFLASH_BLOCK_TERM(field, dict, key)                               \
  ExpectNear(a.accepted_length.field, b.accepted_length.field, tolerance, \
             where + " accepted_length." #field);
#include "losses/chunk_terms.inc"
}

// Bitwise, as every process must agree.
void ExpectResultsEqual(const HeadResult& a, const HeadResult& b,
                        const std::string& where) {
  EXPECT_EQ(a.loss, b.loss) << where;
  EXPECT_EQ(a.loss_denominator, b.loss_denominator) << where;
  EXPECT_EQ(a.lk_kl_weight, b.lk_kl_weight) << where;
  EXPECT_EQ(a.accuracy, b.accuracy) << where;
  EXPECT_EQ(a.accuracy_per_position, b.accuracy_per_position) << where;
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  EXPECT_EQ(a.terms.field, b.terms.field) << where << " " #field;
#define DFLASH_POSITION_TERM(field, slot, dict, key) \
  EXPECT_EQ(a.terms.field, b.terms.field) << where << " " #field;
#define DFLASH_BLOCK_TERM(field, dict, key)                               \
  EXPECT_EQ(a.terms.accepted_length.field, b.terms.accepted_length.field) \
      << where << " accepted_length." #field;
#include "losses/chunk_terms.inc"
}

// max |a - b| / max |b| over the whole tensor.
double NormwiseError(const std::vector<double>& a,
                     const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double error = 0, norm = 0;
  for (size_t i = 0; i < b.size() && i < a.size(); ++i) {
    error = std::max(error, std::abs(a[i] - b[i]));
    norm = std::max(norm, std::abs(b[i]));
  }
  return norm > 0 ? error / norm : error;
}

// The processes' rows of a [V, columns] gradient, stacked in rank order.
std::vector<double> Stacked(const std::vector<ProcessRun>& runs,
                            std::vector<double> ProcessRun::*field) {
  std::vector<double> all;
  for (const ProcessRun& run : runs) {
    all.insert(all.end(), (run.*field).begin(), (run.*field).end());
  }
  return all;
}

// The processes' partial sums of a gradient, added.
std::vector<double> Summed(const std::vector<ProcessRun>& runs,
                           std::vector<double> ProcessRun::*field) {
  std::vector<double> sum((runs[0].*field).size(), 0.0);
  for (const ProcessRun& run : runs) {
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += (run.*field)[i];
  }
  return sum;
}

// `config` over `b` on each of `sizes` processes against the single
// process; returns the single process's run.
ProcessRun CheckAgainstSingle(const v1::ObjectiveConfig& config, const Batch& b,
                              const std::vector<int>& sizes,
                              const std::string& name) {
  const bool f32 = config.head().dtype() == v1::HeadConfig::FLOAT32;
  const double tolerance = f32 ? 1e-6 : 1e-5;
  const double gradient_tolerance = f32 ? 1e-6 : 1e-2;
  const ProcessRun single = RunProcess(config, b, 0, kV, nullptr);
  EXPECT_TRUE(single.status.ok()) << name << " " << single.status;
  if (!single.status.ok()) return single;
  for (int size : sizes) {
    const std::string where = absl::StrCat(name, " W=", size);
    const std::vector<ProcessRun> runs = RunProcesses(config, b, size);
    bool failed = false;
    for (int q = 0; q < size; ++q) {
      if (!runs[q].status.ok()) {
        ADD_FAILURE() << where << " process " << q << ": " << runs[q].status;
        failed = true;
      }
    }
    if (failed) continue;
    const ProcessRun& first = runs[0];
    ExpectNear(first.result.loss, single.result.loss, tolerance,
               where + " loss");
    ExpectNear(first.result.accuracy, single.result.accuracy, tolerance,
               where + " accuracy");
    ExpectTermsNear(first.result.terms, single.result.terms, tolerance, where);
    EXPECT_EQ(first.argmax, single.argmax) << where;
    EXPECT_EQ(first.teacher_argmax, single.teacher_argmax) << where;
    EXPECT_EQ(first.base_argmax, single.base_argmax) << where;
    EXPECT_EQ(first.top_k, single.top_k) << where;
    EXPECT_EQ(first.top_k_values.size(), single.top_k_values.size()) << where;
    for (size_t i = 0;
         i < single.top_k_values.size() && i < first.top_k_values.size(); ++i) {
      ExpectNear(first.top_k_values[i], single.top_k_values[i], tolerance,
                 absl::StrCat(where, " top_k_values ", i));
    }
    EXPECT_EQ(first.grad_confidence.size(), single.grad_confidence.size());
    for (size_t r = 0;
         r < single.grad_confidence.size() && r < first.grad_confidence.size();
         ++r) {
      // Whole on every process (no sum over the group).
      ExpectNear(first.grad_confidence[r], single.grad_confidence[r], tolerance,
                 absl::StrCat(where, " confidence gradient ", r));
    }
    for (int64_t r = 0; r < b.num_rows(); ++r) {
      ExpectNear(first.neg_log_q[r], single.neg_log_q[r], tolerance,
                 absl::StrCat(where, " neg_log_q ", r));
      ExpectNear(first.loss_weight[r], single.loss_weight[r], tolerance,
                 absl::StrCat(where, " loss_weight ", r));
    }
    EXPECT_LE(NormwiseError(Summed(runs, &ProcessRun::grad_hidden),
                            single.grad_hidden),
              gradient_tolerance)
        << where << " d/d(hidden) summed over the processes";
    if (config.head().trainable()) {
      EXPECT_LE(NormwiseError(Stacked(runs, &ProcessRun::grad_weight),
                              single.grad_weight),
                gradient_tolerance)
          << where << " d/d(weight)";
      EXPECT_LE(NormwiseError(Stacked(runs, &ProcessRun::grad_bias),
                              single.grad_bias),
                gradient_tolerance)
          << where << " d/d(bias)";
    }
    EXPECT_LE(NormwiseError(Summed(runs, &ProcessRun::grad_z), single.grad_z),
              gradient_tolerance)
        << where << " d/d(correction inputs) summed over the processes";
    EXPECT_LE(NormwiseError(Stacked(runs, &ProcessRun::grad_m), single.grad_m),
              gradient_tolerance)
        << where << " d/d(correction weight)";
    for (int q = 1; q < size; ++q) {
      const std::string other = absl::StrCat(where, " process ", q);
      ExpectResultsEqual(runs[q].result, first.result, other);
      EXPECT_EQ(runs[q].argmax, first.argmax) << other;
      EXPECT_EQ(runs[q].teacher_argmax, first.teacher_argmax) << other;
      EXPECT_EQ(runs[q].base_argmax, first.base_argmax) << other;
      EXPECT_EQ(runs[q].top_k, first.top_k) << other;
      EXPECT_EQ(runs[q].top_k_values, first.top_k_values) << other;
      EXPECT_EQ(runs[q].grad_confidence, first.grad_confidence) << other;
      EXPECT_EQ(runs[q].neg_log_q, first.neg_log_q) << other;
      EXPECT_EQ(runs[q].loss_weight, first.loss_weight) << other;
    }
  }
  return single;
}

// Every family the vocab-parallel CUDA head runs (all but Domino): the
// softmax ones, DSpark with and without the teacher's terms, D-PARD,
// distillation, and the teacher diagnostics.
struct Family {
  const char* name;
  const char* loss;
  const char* head = "";  // More HeadConfig fields.
};
const Family kFamilies[] = {
    {"DFlash", "dflash { gamma: 7 }"},
    {"DPace", "dpace { alpha: 0.3 }"},
    {"DPaceSequenceBalanced",
     "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }"},
    {"Tv", "tv { gamma: 7 }"},
    {"LkLambda", "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }"},
    {"DFlashLkLambda",
     "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } }"},
    {"DPaceLkTv", "dpace { alpha: 0.3 lk { type: TV } }"},
    {"DFlashSmoothingZLoss",
     "dflash { gamma: 7 } cross_entropy { label_smoothing: 0.1 "
     "z_loss_scale: 0.01 }"},
    {"DSparkWithoutTeacher",
     "dspark { gamma: 7 l1_weight: 0 confidence_weight: 0 }"},
    {"DFlashTeacherDiagnostics", "dflash { gamma: 7 }",
     "teacher_diagnostics: true"},
    {"DSpark", "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }"},
    {"DPard",
     "dspark { objective: DPARD ce_weight: 0 l1_weight: 0 "
     "confidence_weight: 0.4 }"},
    {"ReverseKl",
     "distillation { divergence: REVERSE_KL temperature: 1.5 gamma: 7 }"},
    {"Jsd", "distillation { divergence: JSD beta: 0.3 temperature: 0.8 }"},
    {"ForwardKl", "distillation { divergence: FORWARD_KL temperature: 2 }"},
    // A correction z M^T added to the logits (DSpark's Markov head), M's
    // rows sharded as the weight's.
    {"DSparkCorrection",
     "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
     "correction_rank: 2"},
    // Domino's split correction: its final and base logits.
    {"Domino", "domino { lambda_base: 0.3 pure_draft_prefix_len: 1 gamma: 4 }",
     "correction_rank: 2"},
    {"DominoShift", "domino { lambda_base: 0.3 shift_label: true }",
     "correction_rank: 2"},
};

void PrintTo(const Family& family, std::ostream* os) { *os << family.name; }

class CudaVocabParallelFamilyTest
    : public ::testing::TestWithParam<std::tuple<Family, const char*>> {};

// float32 trainable (where the family trains: not the batch-level LK
// lambda) in every mode; in FUSED frozen too (it differs only by the
// weight-gradient products) and bfloat16 (the emulated device is slow; the
// tie below runs bfloat16 in CHECKPOINT). 3 chunks, in segments of 2 under
// CHECKPOINT and SELECTIVE.
TEST_P(CudaVocabParallelFamilyTest, EqualsTheSingleProcessHead) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  const Family& family = std::get<0>(GetParam());
  const std::string mode = std::get<1>(GetParam());
  const Batch b = MakeShardBatch();
  const bool trains = head_test::TrainsWith(family.loss);
  const struct {
    v1::HeadConfig::DType dtype;
    bool trainable;
    bool runs;
  } variants[] = {
      {v1::HeadConfig::FLOAT32, trains, true},
      {v1::HeadConfig::FLOAT32, false, trains && mode == "FUSED"},
      {v1::HeadConfig::BFLOAT16, trains, mode == "FUSED"},
  };
  for (const auto& v : variants) {
    if (!v.runs) continue;
    CheckAgainstSingle(OnCuda(ConfigBuilder(family.loss)
                                  .Mode(mode)
                                  .Segment(2)
                                  .Trainable(v.trainable)
                                  .ExtraHead(family.head),
                              v.dtype),
                       b, {2, 3},
                       absl::StrCat(family.name, " ", mode, " ",
                                    v1::HeadConfig::DType_Name(v.dtype),
                                    v.trainable ? " trainable" : " frozen"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    FamiliesAndModes, CudaVocabParallelFamilyTest,
    ::testing::Combine(::testing::ValuesIn(kFamilies),
                       ::testing::ValuesIn(head_test::kModes)),
    [](const ::testing::TestParamInfo<std::tuple<Family, const char*>>& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_",
                          std::get<1>(info.param));
    });

// Every target in the last process's range for W = 2, 3 and 4 (classes
// [18, 23) of SplitVocab(23, 4)'s [0, 6) [6, 12) [12, 18) [18, 23)): the
// others hold no target logit.
TEST(CudaVocabParallelTest, EveryTargetInOneShard) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  Batch b = MakeShardBatch();
  const Ranges four = SplitVocab(kV, 4);
  ASSERT_EQ(four.offsets[3], 18);
  for (RowMeta& row : b.rows) {
    if (row.target >= 0) row.target = 18 + row.target % 5;
  }
  for (const char* mode : {"FUSED", "CHECKPOINT"}) {
    CheckAgainstSingle(
        OnCuda(ConfigBuilder("dpace { alpha: 0.3 }").Mode(mode).Trainable(),
               v1::HeadConfig::FLOAT32),
        b, {2, 3, 4}, absl::StrCat("targets in one shard ", mode));
  }
}

// The maximum logit at two classes either side of a range boundary (11 |
// 12 of W = 2, 7 | 8 of W = 3): weight rows of zeros and the largest bias,
// so that every row's logits there are the bias exactly, in any precision
// and summation order. The argmax is the lower id and the top-k lists them
// in id order, as in one process.
TEST(CudaVocabParallelTest, ATieAcrossAShardBoundaryGoesToTheLowerId) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  for (int size : {2, 3}) {
    const Ranges ranges = SplitVocab(kV, size);
    const int64_t boundary = ranges.offsets[1];
    Batch b = MakeShardBatch();
    for (int64_t v : {boundary - 1, boundary}) {
      for (int64_t h = 0; h < kH; ++h) b.weight[v * kH + h] = 0;
      b.bias[v] = 20;  // Above every other logit (|x W + b| < 17 here).
    }
    for (v1::HeadConfig::DType dtype :
         {v1::HeadConfig::FLOAT32, v1::HeadConfig::BFLOAT16}) {
      const std::string where =
          absl::StrCat("tie at ", boundary - 1, " | ", boundary, " ",
                       v1::HeadConfig::DType_Name(dtype));
      const ProcessRun single =
          CheckAgainstSingle(OnCuda(ConfigBuilder("dflash { gamma: 7 }")
                                        .Mode("CHECKPOINT")
                                        .Trainable(),
                                    dtype),
                             b, {size}, where);
      ASSERT_TRUE(single.status.ok()) << where;
      for (int64_t r = 0; r < b.num_rows(); ++r) {
        if (b.rows[r].mask == 0) continue;
        EXPECT_EQ(single.argmax[r], boundary - 1) << where << " row " << r;
        EXPECT_EQ(single.top_k[r * kTopK], boundary - 1) << where;
        EXPECT_EQ(single.top_k[r * kTopK + 1], boundary) << where;
      }
    }
  }
}

// Nothing carries weight anywhere: loss 0, zero gradients, no hang.
TEST(CudaVocabParallelTest, AFullyMaskedBatch) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  Batch b = MakeShardBatch();
  for (RowMeta& row : b.rows) row.mask = 0;
  for (const char* mode : {"FUSED", "CHECKPOINT"}) {
    CheckAgainstSingle(
        OnCuda(ConfigBuilder("dflash { gamma: 7 }").Mode(mode).Trainable(),
               v1::HeadConfig::FLOAT32),
        b, {2, 3}, absl::StrCat("fully masked ", mode));
  }
}

// The batch rows with weight, and how the head's errors name a batch row.
std::vector<int64_t> WeightedRows(const Batch& b) {
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < b.num_rows(); ++r) {
    if (b.rows[r].mask > 0 && b.rows[r].target >= 0) rows.push_back(r);
  }
  return rows;
}
std::string RowName(const Batch& b, int64_t r) {
  return absl::StrCat("row (b, n, k) = (", r / (b.anchors * kK), ", ",
                      r / kK % b.anchors, ", ", r % kK, "): ");
}

// A NaN in the last process's range of the weight (every row's logit
// there: the first weighted row fails, in chunk 0), or in its copy of the
// last weighted row's hidden state or teacher hidden state (chunk 2, after
// two chunks went well; the teacher's with the teacher diagnostics) is a
// non-finite logit on that process alone. Each case's statuses, and the
// message each process's should end with: the failing process's names the
// logit, the others that process; none hangs (the group's timeout would be
// DeadlineExceeded).
struct NanCase {
  std::string where;
  int64_t row = 0;  // The failing batch row.
  std::vector<absl::Status> statuses;
  std::vector<std::string> details;
  // The single-process head's, with the NaN at the same place, and what
  // it should say.
  absl::Status single;
  std::string single_message;
};

enum class NanIn { kWeight, kHidden, kTeacher };

std::vector<NanCase> RunNanCases(const Batch& b) {
  const std::vector<int64_t> weighted = WeightedRows(b);
  EXPECT_FALSE(weighted.empty());
  EXPECT_GE(weighted.back(), 4 * kK);  // In chunk 2.
  std::vector<NanCase> cases;
  for (const char* mode : {"FUSED", "CHECKPOINT"}) {
    for (NanIn in : {NanIn::kWeight, NanIn::kHidden, NanIn::kTeacher}) {
      const v1::ObjectiveConfig config = OnCuda(
          ConfigBuilder("dflash { gamma: 7 }")
              .Mode(mode)
              .Trainable()
              .ExtraHead(in == NanIn::kTeacher ? "teacher_diagnostics: true"
                                               : ""),
          v1::HeadConfig::FLOAT32);
      const char* what = in == NanIn::kWeight   ? "weight"
                         : in == NanIn::kHidden ? "hidden states"
                                                : "teacher hidden states";
      const std::string logits =
          in == NanIn::kTeacher ? "teacher logits: logit " : "logit ";
      for (int size : {2, 3}) {
        const int failing = size - 1;
        const int64_t offset = SplitVocab(kV, size).offsets[failing];
        NanCase c;
        c.where = absl::StrCat(mode, " W=", size, " NaN in process ", failing,
                               "'s ", what);
        c.row = in == NanIn::kWeight ? weighted.front() : weighted.back();
        // Element `local` of this process's weight rows, or the row's
        // state.
        auto spoil = [&](Extras& extras, int64_t local) {
          if (in == NanIn::kWeight) extras.nan_weight = local;
          if (in == NanIn::kHidden) extras.nan_hidden = c.row * kH + 2;
          if (in == NanIn::kTeacher) extras.nan_teacher = c.row * kH + 2;
        };
        Extras whole;
        spoil(whole, offset * kH + 1);
        c.single = RunProcess(config, b, 0, kV, nullptr, whole).status;
        c.single_message = absl::StrCat(RowName(b, c.row), logits,
                                        in == NanIn::kWeight ? offset : 0,
                                        " is not finite (nan)");
        const std::vector<ProcessRun> runs =
            RunProcesses(config, b, size, [&](int q) {
              Extras extras;
              if (q == failing) spoil(extras, 1);
              return extras;
            });
        for (int q = 0; q < size; ++q) {
          c.statuses.push_back(runs[q].status);
          c.details.push_back(
              q == failing
                  ? absl::StrCat(logits,
                                 "0 is not finite (nan) (counted from class ",
                                 offset, ", this process's first)")
                  : absl::StrCat("vocab_shard: process ", failing, " of ", size,
                                 " failed on this row (its own error says "
                                 "why)"));
        }
        cases.push_back(std::move(c));
      }
    }
  }
  return cases;
}

TEST(CudaVocabParallelTest, ANaNOnOneProcessIsAnErrorOnEvery) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  for (const NanCase& c : RunNanCases(MakeShardBatch())) {
    EXPECT_EQ(std::string(c.single.message()), c.single_message) << c.where;
    for (size_t q = 0; q < c.statuses.size(); ++q) {
      const absl::Status& status = c.statuses[q];
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
          << c.where << " process " << q << ": " << status;
      EXPECT_TRUE(absl::EndsWith(status.message(), c.details[q]))
          << c.where << " process " << q << ": " << status;
      // Every process names the same row.
      const std::string named(status.message().substr(
          0, status.message().size() - c.details[q].size()));
      const std::string first(c.statuses[0].message().substr(
          0, c.statuses[0].message().size() - c.details[0].size()));
      EXPECT_EQ(named, first) << c.where << " process " << q;
    }
  }
}

// The row named as the single-process head names it (NanCase::single): the
// chunk's device error is named by the chunk's row, which the head maps to
// the batch row, on every process (it failed on chunk 0's batch row 1 as
// (0, 0, 2), and named chunk 2's batch row 22 "chunk 2: row 22", before the
// loss mapped the device's caller row back to the chunk's).
TEST(CudaVocabParallelTest, AnErrorNamesTheSingleProcessRow) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  const Batch b = MakeShardBatch();
  for (const NanCase& c : RunNanCases(b)) {
    for (size_t q = 0; q < c.statuses.size(); ++q) {
      EXPECT_EQ(std::string(c.statuses[q].message()),
                RowName(b, c.row) + c.details[q])
          << c.where << " process " << q;
    }
  }
}

// head.device_results (a run that never reads the device back) with a
// shard: the exchange reads each chunk's stats on the host, so it is
// refused, an InvalidArgument on every process.
TEST(CudaVocabParallelTest, DeviceResultsAreRefusedOnEveryProcess) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  v1::ObjectiveConfig config =
      OnCuda(ConfigBuilder("dflash { gamma: 7 }"), v1::HeadConfig::FLOAT32);
  config.mutable_head()->set_row_selection(v1::HeadConfig::ALL_ROWS);
  config.mutable_head()->set_device_results(true);
  const std::vector<ProcessRun> runs =
      RunProcesses(config, MakeShardBatch(), 2, [](int) {
        Extras extras;
        extras.device_results = true;
        return extras;
      });
  for (int q = 0; q < 2; ++q) {
    EXPECT_EQ(runs[q].status.code(), absl::StatusCode::kInvalidArgument)
        << "process " << q << ": " << runs[q].status;
    EXPECT_EQ(std::string(runs[q].status.message()),
              "head.device_results: a vocab-parallel head merges each "
              "chunk's statistics on the host, so it does not finish on the "
              "device; got true with a vocab_shard")
        << "process " << q;
  }
}

// head.row_selection ALL_ROWS makes each chunk's rows on the device; a
// vocab-parallel chunk reads them on the host: refused before any chunk,
// an InvalidArgument on every process naming the field.
TEST(CudaVocabParallelTest, AllRowsIsRefusedOnEveryProcess) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  v1::ObjectiveConfig config =
      OnCuda(ConfigBuilder("dflash { gamma: 7 }"), v1::HeadConfig::FLOAT32);
  config.mutable_head()->set_row_selection(v1::HeadConfig::ALL_ROWS);
  const std::vector<ProcessRun> runs = RunProcesses(
      config, MakeShardBatch(), 2, [](int) { return Extras(); });
  for (int q = 0; q < 2; ++q) {
    EXPECT_EQ(runs[q].status.code(), absl::StatusCode::kInvalidArgument)
        << "process " << q << ": " << runs[q].status;
    EXPECT_EQ(std::string(runs[q].status.message()),
              "head.row_selection: a vocab-parallel CUDA head runs COMPACT "
              "rows (ALL_ROWS makes each chunk's rows on the device, and a "
              "vocab-parallel chunk reads them on the host); got ALL_ROWS "
              "with a vocab_shard")
        << "process " << q;
  }
}

}  // namespace
}  // namespace dflash
