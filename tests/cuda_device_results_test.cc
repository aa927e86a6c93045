// head.device_results: a CUDA head run, forward and backward, that never
// waits for the device nor reads it back, so that it can be captured in a
// CUDA graph. Checked here:
// - the whole run (BuildCudaRows, then RunCudaHead, or StartCudaHead and a
//   Backward whose upstream is a device scalar) captured on the head's
//   stream in global capture mode, which fails on any synchronisation,
//   synchronous or pageable copy, cudaMalloc/cudaFree or event query (the
//   CUDA emulation enforces what CUDA does); every byte it allocates is
//   stream-ordered (the stream's allocator, cudaMallocAsync) and freed
//   within the capture;
// - the graph launched twice with new hidden states, labels and upstream
//   written into the same buffers: the device results (ReadDeviceResults)
//   equal the synchronous run's HeadResult (terms within 1e-9 relative:
//   the same kernels, only the finish's sums in another order) and the
//   gradients its gradients (float32 within 1e-6, bfloat16 1e-2 normwise:
//   the synchronous run folds the scale into the input-gradient GEMM's
//   alpha, the device run scales afterwards), and the row outputs
//   (neg_log_q, loss_weight, top_k_values, argmax, top_k) its row outputs,
//   for dflash, D-PACE, the
//   batch-level LK lambda, dspark with a confidence term, D-PARD (its
//   confidence scale differs from its gradient scale), KL with a teacher,
//   a correction head (correction_rank 4), in FUSED, CHECKPOINT,
//   SAVE_CHUNKS, MATERIALIZE and SELECTIVE, split SEQUENCE_BALANCED D-PACE
//   among them;
// - a launch whose labels hold a weighted target outside [0, V), or whose
//   hidden state holds a NaN, leaves NaN terms, NaN gradients and row
//   outputs (neg_log_q, loss_weight, top_k_values NaN, argmax, top_k -1),
//   and
//   CheckDeviceResults returns the synchronous run's Status, word for
//   word; the next good launch is correct again;
// - a split launch whose device upstream is NaN, inf or -inf: the same, with
//   the synchronous Backward's refusal of that upstream, kept through a
//   second Backward of the run with a finite upstream;
// - the refusals: a CPU head, COMPACT, domino, a missing or unwanted
//   buffer, a device upstream without the option.
// Skipped, with the reason, where no GPU is usable.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "base/status_macros.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cuda_head.h"
#include "losses/device_results.h"
#include "proto/config.h"
#include "tests/cuda_test_util.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using head_test::kK;
using head_test::kV;
using head_test::MakeBatch;

constexpr int64_t kB = 2, kN = 3;  // MakeBatch's batch and anchors.
constexpr int64_t kRows = kB * kN * kK;
constexpr int64_t kR = 4;  // The correction's rank, where a case has one.
constexpr int32_t kOutK = 2;  // The row outputs' top-k width.

template <typename T>
std::vector<T> Cast(const std::vector<double>& host) {
  std::vector<T> values;
  for (double x : host) values.push_back(FromDouble<T>(x));
  return values;
}

template <typename T>
TrackedBuffer<T> Allocate(int64_t count, CudaStream& stream) {
  auto buffer = TrackedBuffer<T>::Create(stream.allocator(), count);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return *std::move(buffer);
}

template <typename T>
void Write(TrackedBuffer<T>& buffer, const std::vector<T>& host,
           CudaStream& stream) {
  ASSERT_EQ(host.size(), static_cast<size_t>(buffer.size()));
  ASSERT_TRUE(
      stream.CopyToDevice(buffer.data(), host.data(), buffer.bytes()).ok());
  ASSERT_TRUE(stream.Synchronize().ok());
}

// One launch's data: hidden states, labels [B, N, K] and the upstream.
struct Data {
  Batch batch;
  std::vector<int64_t> ids;
  std::vector<float> masks;
  float upstream = 1;
  // The correction's z [rows, kR] and M [V, kR], where a case has one.
  std::vector<double> z, m;
};

// Labels in [0, V) (a few ignore_index), masks 0 at k = 0, else 1, 0.5 or
// 0 (so ALL_ROWS projects rows without weight).
Data MakeData(uint32_t seed) {
  Data d;
  d.batch = MakeBatch(seed);
  std::mt19937 rng(seed);
  for (int64_t e = 0; e < kRows; ++e) {
    d.ids.push_back(e % 11 == 5 ? -100 : static_cast<int64_t>(rng() % kV));
    const float masks[] = {1, 0.5f, 0, 1};
    d.masks.push_back(e % kK == 0 ? 0 : masks[rng() % 4]);
  }
  d.upstream = 0.5f + 0.25f * static_cast<float>(seed % 4);
  std::uniform_real_distribution<double> unit(-1, 1);
  for (int64_t i = 0; i < kRows * kR; ++i) d.z.push_back(unit(rng));
  for (int64_t i = 0; i < kV * kR; ++i) d.m.push_back(0.5 * unit(rng));
  return d;
}

bool NeedsTeacher(const v1::ObjectiveConfig& c) {
  return c.loss().has_dspark() || c.loss().has_distillation();
}
bool NeedsConfidence(const v1::ObjectiveConfig& c) {
  return c.loss().has_dspark() && c.loss().dspark().confidence_weight() > 0;
}
int64_t Rank(const v1::ObjectiveConfig& c) {
  return c.head().correction_rank();
}

// A run's buffers on the device, written before each launch.
template <typename T>
struct Buffers {
  Buffers(const v1::ObjectiveConfig& config, CudaStream& stream)
      : hidden(Allocate<T>(kRows * head_test::kH, stream)),
        teacher(Allocate<T>(NeedsTeacher(config) ? kRows * head_test::kH : 0,
                            stream)),
        confidence(Allocate<float>(NeedsConfidence(config) ? kRows : 0,
                                   stream)),
        weight(Allocate<T>(kV * head_test::kH, stream)),
        bias(Allocate<T>(kV, stream)),
        ids(Allocate<int64_t>(kRows, stream)),
        masks(Allocate<float>(kRows, stream)),
        grad_hidden(Allocate<T>(kRows * head_test::kH, stream)),
        grad_weight(Allocate<T>(kV * head_test::kH, stream)),
        grad_bias(Allocate<T>(kV, stream)),
        grad_confidence(Allocate<float>(NeedsConfidence(config) ? kRows : 0,
                                        stream)),
        upstream(Allocate<float>(1, stream)),
        results(Allocate<double>(DeviceResultsSize(kK), stream)),
        z(Allocate<T>(kRows * Rank(config), stream)),
        m(Allocate<T>(kV * Rank(config), stream)),
        grad_z(Allocate<T>(kRows * Rank(config), stream)),
        grad_m(Allocate<T>(kV * Rank(config), stream)),
        neg_log_q(Allocate<double>(kRows, stream)),
        loss_weight(Allocate<double>(kRows, stream)),
        top_k_values(Allocate<float>(kRows * kOutK, stream)),
        argmax(Allocate<int32_t>(kRows, stream)),
        top_k(Allocate<int32_t>(kRows * kOutK, stream)) {}

  void Load(const Data& d, CudaStream& stream) {
    Write(hidden, Cast<T>(d.batch.hidden), stream);
    if (teacher.size() > 0) Write(teacher, Cast<T>(d.batch.teacher), stream);
    if (confidence.size() > 0) {
      Write(confidence, Cast<float>(d.batch.confidence), stream);
    }
    Write(weight, Cast<T>(d.batch.weight), stream);
    Write(bias, Cast<T>(d.batch.bias), stream);
    Write(ids, d.ids, stream);
    Write(masks, d.masks, stream);
    Write(upstream, std::vector<float>{d.upstream}, stream);
    if (z.size() > 0) {
      Write(z, Cast<T>(d.z), stream);
      Write(m, Cast<T>(d.m), stream);
    }
    // Not zeros: a gradient left unwritten would show.
    for (TrackedBuffer<T>* g :
         {&grad_hidden, &grad_weight, &grad_bias, &grad_z, &grad_m}) {
      if (g->size() == 0) continue;
      Write(*g, Cast<T>(std::vector<double>(g->size(), 7)), stream);
    }
    if (grad_confidence.size() > 0) {
      Write(grad_confidence, std::vector<float>(kRows, 7), stream);
    }
    Write(neg_log_q, std::vector<double>(kRows, 7), stream);
    Write(loss_weight, std::vector<double>(kRows, 7), stream);
    Write(top_k_values, std::vector<float>(kRows * kOutK, 7), stream);
    Write(argmax, std::vector<int32_t>(kRows, 7), stream);
    Write(top_k, std::vector<int32_t>(kRows * kOutK, 7), stream);
  }

  HeadInputs<T> Inputs(const DeviceRows& rows) {
    HeadInputs<T> in;
    in.hidden = Span(hidden);
    in.teacher_hidden = Span(teacher);
    in.confidence_logits = Span(confidence);
    in.weight = Span(weight);
    in.bias = Span(bias);
    in.correction_inputs = Span(z);
    in.correction_weight = Span(m);
    in.device_rows = rows;
    return in;
  }
  HeadGradients<T> Gradients() {
    return {Span(grad_hidden), Span(grad_weight), Span(grad_bias),
            Span(grad_confidence), Span(grad_z), Span(grad_m)};
  }
  HeadRowOutputs RowOutputs() {
    HeadRowOutputs o;
    o.neg_log_q = Span(neg_log_q);
    o.argmax = Span(argmax);
    o.top_k = Span(top_k);
    o.k = kOutK;
    o.top_k_values = Span(top_k_values);
    o.loss_weight = Span(loss_weight);
    return o;
  }
  // neg_log_q, loss_weight, top_k_values, argmax, top_k.
  std::vector<std::vector<double>> HostRowOutputs(CudaStream& stream) const {
    return {Download(neg_log_q, stream), Download(loss_weight, stream),
            Download(top_k_values, stream), Download(argmax, stream),
            Download(top_k, stream)};
  }
  std::vector<std::vector<double>> HostGradients(CudaStream& stream) const {
    return {Download(grad_hidden, stream), Download(grad_weight, stream),
            Download(grad_bias, stream), Download(grad_confidence, stream),
            Download(grad_z, stream), Download(grad_m, stream)};
  }

  TrackedBuffer<T> hidden, teacher;
  TrackedBuffer<float> confidence;
  TrackedBuffer<T> weight, bias;
  TrackedBuffer<int64_t> ids;
  TrackedBuffer<float> masks;
  TrackedBuffer<T> grad_hidden, grad_weight, grad_bias;
  TrackedBuffer<float> grad_confidence, upstream;
  TrackedBuffer<double> results;
  TrackedBuffer<T> z, m, grad_z, grad_m;  // The correction's, or empty.
  TrackedBuffer<double> neg_log_q, loss_weight;
  TrackedBuffer<float> top_k_values;
  TrackedBuffer<int32_t> argmax, top_k;
};

// The labels' tensors over `b`'s buffers, row-major [B, N, K].
cuda::RowsTensor Ids(const TrackedBuffer<int64_t>& ids) {
  return {ids.data(), cuda::kRowsInt64, {kN * kK, kK, 1}};
}
cuda::RowsTensor Masks(const TrackedBuffer<float>& masks) {
  return {masks.data(), cuda::kRowsFloat32, {kN * kK, kK, 1}};
}

// One whole run from the buffers: rows built on the device, then the head
// (a split run: forward, then backward with the device upstream, as
// d(objective)/d(loss_num)). `device`: head.device_results, into
// b.results. The synchronous run's result where it is not.
template <typename T>
absl::StatusOr<HeadResult> RunOnce(const v1::ObjectiveConfig& config,
                                   bool split, bool device, Buffers<T>& b,
                                   Gpu& gpu) {
  CudaStream& stream = *gpu.stream;
  DFLASH_ASSIGN_OR_RETURN(
      CudaRows rows,
      BuildCudaRows(config, Ids(b.ids), Masks(b.masks), kB, kN, stream));
  HeadOptions options;
  if (device) options.device_results = b.results.data();
  const HeadInputs<T> inputs = b.Inputs(rows.view());
  if (!split) {
    return RunCudaHead<T>(config, inputs, b.Gradients(), *gpu.blas,
                          b.RowOutputs(), options);
  }
  DFLASH_ASSIGN_OR_RETURN(
      std::unique_ptr<SplitHeadRun<T>> run,
      StartCudaHead<T>(config, inputs, *gpu.blas, b.RowOutputs(), options));
  HeadResult forward = run->forward();
  if (device) {
    DeviceUpstream upstream;
    upstream.value = b.upstream.data();
    upstream.is_float = true;
    upstream.of_loss_num = true;
    DFLASH_RETURN_IF_ERROR(
        run->Backward(upstream, b.Gradients(), nullptr).status());
  } else {
    // The binding's host path: grad(loss_num) x the loss denominator.
    float host_upstream = 0;
    DFLASH_RETURN_IF_ERROR(
        stream.CopyToHost(&host_upstream, b.upstream.data(), sizeof(float)));
    DFLASH_RETURN_IF_ERROR(
        run->Backward(host_upstream * forward.loss_denominator, b.Gradients(),
                      nullptr)
            .status());
  }
  return forward;
}

void ExpectNear(double got, double want, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), 1e-9 * (1 + std::fabs(want)))
      << what << ": " << got << " vs " << want;
}

void ExpectSameResult(const HeadResult& got, const HeadResult& want) {
  ExpectNear(got.loss, want.loss, "loss");
  ExpectNear(got.loss_denominator, want.loss_denominator, "denominator");
  ExpectNear(got.accuracy, want.accuracy, "accuracy");
  EXPECT_EQ(got.lk_kl_weight.has_value(), want.lk_kl_weight.has_value());
  if (got.lk_kl_weight && want.lk_kl_weight) {
    ExpectNear(*got.lk_kl_weight, *want.lk_kl_weight, "kl_w");
  }
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  ExpectNear(got.terms.field, want.terms.field, #field);
#define DFLASH_POSITION_TERM(field, slot, dict, key)                    \
  ASSERT_EQ(got.terms.field.size(), want.terms.field.size()) << #field; \
  for (size_t k = 0; k < want.terms.field.size(); ++k) {                \
    ExpectNear(got.terms.field[k], want.terms.field[k],                 \
               absl::StrCat(#field, "[", k, "]"));                      \
  }
#define DFLASH_BLOCK_TERM(field, dict, key)                               \
  ExpectNear(got.terms.accepted_length.field,                             \
             want.terms.accepted_length.field, "accepted_length." #field);
#include "losses/chunk_terms.inc"
  for (size_t k = 0; k < want.accuracy_per_position.size(); ++k) {
    ExpectNear(got.accuracy_per_position[k], want.accuracy_per_position[k],
               "accuracy_per_position");
  }
}

template <typename T>
v1::ObjectiveConfig CudaConfig(const std::string& loss, const std::string& mode,
                               const std::string& extra_head = "") {
  // Trainable but for the batch-level LK lambda, which needs a frozen head.
  v1::ObjectiveConfig config =
      ConfigBuilder(loss)
          .Mode(mode)
          .Trainable(loss.find("lk { type: LAMBDA") == std::string::npos)
          .ExtraHead(extra_head)
          .Build();
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(std::is_same_v<T, float>
                                       ? v1::HeadConfig::FLOAT32
                                       : v1::HeadConfig::BFLOAT16);
  config.mutable_head()->set_row_selection(v1::HeadConfig::ALL_ROWS);
  return config;
}

v1::ObjectiveConfig WithDeviceResults(v1::ObjectiveConfig config) {
  config.mutable_head()->set_device_results(true);
  return config;
}

// A captured graph of one whole run, destroyed with it.
struct Graph {
  ~Graph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

// Captures RunOnce with head.device_results on the head's stream. The
// host HeadResult of a device run is NaN throughout.
template <typename T>
void Capture(const v1::ObjectiveConfig& config, bool split, Buffers<T>& b,
             Gpu& gpu, Graph& g) {
  CudaStream& stream = *gpu.stream;
  const int64_t before = stream.allocator().current_bytes();
  ASSERT_EQ(cudaStreamBeginCapture(stream.stream(),
                                   cudaStreamCaptureModeGlobal),
            cudaSuccess);
  absl::StatusOr<HeadResult> run =
      RunOnce<T>(WithDeviceResults(config), split, true, b, gpu);
  const cudaError_t ended = cudaStreamEndCapture(stream.stream(), &g.graph);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorString(ended);
  EXPECT_TRUE(std::isnan(run->loss));
  EXPECT_TRUE(std::isnan(run->terms.loss_num));
  EXPECT_TRUE(std::isnan(run->terms.accepted_length.expected_num));
  // Everything the run allocated is stream-ordered and freed in the graph.
  EXPECT_EQ(stream.allocator().current_bytes(), before);
  ASSERT_EQ(cudaGraphInstantiate(&g.exec, g.graph, 0), cudaSuccess);
}

template <typename T>
void ExpectGraphMatchesSynchronousRuns(const std::string& loss,
                                       const std::string& mode, bool split,
                                       Gpu& gpu,
                                       const std::string& extra_head = "") {
  SCOPED_TRACE(absl::StrCat(loss, " ", extra_head, " ", mode,
                            split ? " split" : " single",
                            std::is_same_v<T, float> ? " float32"
                                                     : " bfloat16"));
  CudaStream& stream = *gpu.stream;
  const v1::ObjectiveConfig config = CudaConfig<T>(loss, mode, extra_head);
  Buffers<T> b(config, stream), reference(config, stream);
  b.Load(MakeData(1), stream);
  Graph graph;
  Capture<T>(config, split, b, gpu, graph);
  if (::testing::Test::HasFatalFailure()) return;
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-2;
  for (uint32_t seed : {11u, 12u}) {
    SCOPED_TRACE(absl::StrCat("launch with data ", seed));
    const Data data = MakeData(seed);
    b.Load(data, stream);
    ASSERT_EQ(cudaGraphLaunch(graph.exec, stream.stream()), cudaSuccess);
    absl::StatusOr<HeadResult> got =
        ReadDeviceResults(config, b.results.data(), stream);
    ASSERT_TRUE(got.ok()) << got.status();
    reference.Load(data, stream);
    absl::StatusOr<HeadResult> want =
        RunOnce<T>(config, split, false, reference, gpu);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameResult(*got, *want);
    const auto have = b.HostGradients(stream);
    const auto expected = reference.HostGradients(stream);
    for (size_t i = 0; i < have.size(); ++i) {
      if (expected[i].empty()) continue;
      EXPECT_LE(RelativeMaxError<double>(have[i], expected[i]), tolerance)
          << "gradient " << i;
    }
    // The forward's row outputs: the same kernels on the same logits.
    const auto rows_got = b.HostRowOutputs(stream);
    const auto rows_want = reference.HostRowOutputs(stream);
    for (size_t i = 0; i < rows_got.size(); ++i) {
      ASSERT_EQ(rows_got[i].size(), rows_want[i].size());
      for (size_t j = 0; j < rows_got[i].size(); ++j) {
        ExpectNear(rows_got[i][j], rows_want[i][j],
                   absl::StrCat("row output ", i, " [", j, "]"));
      }
    }
  }
}

TEST(CudaDeviceResultsTest, CapturedRunsEqualTheSynchronousRuns) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  constexpr int64_t kWorkspace = int64_t{4} << 20;
  TrackedBuffer<char> workspace = Allocate<char>(kWorkspace, *gpu->stream);
  // cuBLAS allocates nothing while the graph is captured.
  ASSERT_TRUE(gpu->blas->SetWorkspace(workspace.data(), kWorkspace).ok());
  struct Case {
    const char* loss;
    const char* mode;
    const char* extra_head = "";
  };
  const Case cases[] = {
      {"dflash { gamma: 7 }", "FUSED"},
      {"dflash { gamma: 7 }", "CHECKPOINT"},
      {"dflash { gamma: 7 }", "SAVE_CHUNKS"},
      {"dpace { alpha: 0.3 }", "CHECKPOINT"},
      {"dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }", "FUSED"},
      {"dflash { lk { type: LAMBDA } }", "CHECKPOINT"},
      {"dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
       "CHECKPOINT"},
      {"dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }", "FUSED"},
      {"distillation { divergence: FORWARD_KL temperature: 2 }",
       "SAVE_CHUNKS"},
      // Split SEQUENCE_BALANCED: the device upstream times the floored
      // weighted-sequence denominator.
      {"dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }", "CHECKPOINT"},
      {"dflash { gamma: 7 }", "MATERIALIZE"},
      {"dflash { gamma: 7 }", "SELECTIVE"},
      // D-PARD: the confidence scale differs from the gradient scale, and
      // loss_num is loss x den.
      {"dspark { gamma: 7 objective: DPARD ce_weight: 0 l1_weight: 0 "
       "confidence_weight: 0.3 }",
       "CHECKPOINT"},
      {"dspark { gamma: 7 objective: DPARD ce_weight: 0 l1_weight: 0 "
       "confidence_weight: 0.3 }",
       "FUSED"},
      // A correction: its input gradient is scaled after the GEMM here,
      // where the synchronous run folds the scale into alpha.
      {"dflash { gamma: 7 }", "FUSED", "correction_rank: 4"},
      {"dflash { gamma: 7 }", "CHECKPOINT", "correction_rank: 4"},
      {"dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
       "SAVE_CHUNKS", "correction_rank: 4"},
  };
  for (const Case& c : cases) {
    const bool splits = std::string(c.mode) != "FUSED";
    ExpectGraphMatchesSynchronousRuns<float>(c.loss, c.mode, false, *gpu,
                                             c.extra_head);
    if (splits) {
      ExpectGraphMatchesSynchronousRuns<float>(c.loss, c.mode, true, *gpu,
                                               c.extra_head);
    }
  }
  ExpectGraphMatchesSynchronousRuns<BFloat16>("dflash { gamma: 7 }",
                                              "CHECKPOINT", true, *gpu);
  ExpectGraphMatchesSynchronousRuns<BFloat16>(
      "distillation { divergence: FORWARD_KL temperature: 2 }", "FUSED", false,
      *gpu);
}

// An error the device sees poisons the results and the gradients, and
// CheckDeviceResults reports what the synchronous run does.
TEST(CudaDeviceResultsTest, ErrorsAreLatchedAndReportedAsSynchronously) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  constexpr int64_t kWorkspace = int64_t{4} << 20;
  TrackedBuffer<char> workspace = Allocate<char>(kWorkspace, stream);
  ASSERT_TRUE(gpu->blas->SetWorkspace(workspace.data(), kWorkspace).ok());
  for (bool split : {false, true}) {
    SCOPED_TRACE(split ? "split" : "single");
    const v1::ObjectiveConfig config =
        CudaConfig<float>("dflash { gamma: 7 }", "CHECKPOINT");
    Buffers<float> b(config, stream), reference(config, stream);
    b.Load(MakeData(1), stream);
    Graph graph;
    Capture<float>(config, split, b, *gpu, graph);
    if (::testing::Test::HasFatalFailure()) return;
    Data bad_target = MakeData(2);
    bad_target.ids[6] = kV;
    bad_target.masks[6] = 1;
    Data nan_hidden = MakeData(3);
    nan_hidden.masks[9] = 1;  // A weighted row,
    nan_hidden.batch.hidden[9 * head_test::kH + 2] = std::nan("");
    for (const Data* data : {&bad_target, &nan_hidden}) {
      b.Load(*data, stream);
      ASSERT_EQ(cudaGraphLaunch(graph.exec, stream.stream()), cudaSuccess);
      const absl::Status got =
          CheckDeviceResults(config, b.results.data(), stream);
      reference.Load(*data, stream);
      const absl::StatusOr<HeadResult> want =
          RunOnce<float>(config, split, false, reference, *gpu);
      ASSERT_FALSE(want.ok());
      EXPECT_EQ(got, want.status());
      EXPECT_EQ(ReadDeviceResults(config, b.results.data(), stream).status(),
                want.status());
      std::vector<double> raw = Download(b.results, stream);
      for (int64_t i = kResultLoss; i < DeviceResultsSize(kK); ++i) {
        EXPECT_TRUE(std::isnan(raw[i])) << "slot " << i;
      }
      for (double g : Download(b.grad_hidden, stream)) {
        ASSERT_TRUE(std::isnan(g));
      }
      // The row outputs the synchronous run never returns: NaN values, -1
      // ids.
      const auto rows = b.HostRowOutputs(stream);
      for (size_t i = 0; i < rows.size(); ++i) {
        const bool ids = i >= 3;
        for (double x : rows[i]) {
          ASSERT_TRUE(ids ? x == -1 : std::isnan(x))
              << "row output " << i << ": " << x;
        }
      }
    }
    // Each launch starts clean.
    const Data good = MakeData(4);
    b.Load(good, stream);
    ASSERT_EQ(cudaGraphLaunch(graph.exec, stream.stream()), cudaSuccess);
    absl::StatusOr<HeadResult> got =
        ReadDeviceResults(config, b.results.data(), stream);
    ASSERT_TRUE(got.ok()) << got.status();
    reference.Load(good, stream);
    absl::StatusOr<HeadResult> want =
        RunOnce<float>(config, split, false, reference, *gpu);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameResult(*got, *want);
  }
}

// A device upstream that is not finite: the synchronous Backward refuses
// it ("upstream: must be finite"); the device run latches that refusal,
// poisons the results and leaves every gradient NaN (an inf upstream too,
// where inf x scale would read as a number).
TEST(CudaDeviceResultsTest, NonFiniteDeviceUpstreamIsLatched) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  constexpr int64_t kWorkspace = int64_t{4} << 20;
  TrackedBuffer<char> workspace = Allocate<char>(kWorkspace, stream);
  ASSERT_TRUE(gpu->blas->SetWorkspace(workspace.data(), kWorkspace).ok());
  for (const char* loss :
       {"dflash { gamma: 7 }",
        "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }"}) {
    SCOPED_TRACE(loss);
    const v1::ObjectiveConfig config = CudaConfig<float>(loss, "CHECKPOINT");
    Buffers<float> b(config, stream), reference(config, stream);
    b.Load(MakeData(1), stream);
    Graph graph;
    Capture<float>(config, true, b, *gpu, graph);
    if (::testing::Test::HasFatalFailure()) return;
    for (float upstream :
         {std::nanf(""), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      SCOPED_TRACE(absl::StrCat("upstream ", upstream));
      Data data = MakeData(5);
      data.upstream = upstream;
      b.Load(data, stream);
      ASSERT_EQ(cudaGraphLaunch(graph.exec, stream.stream()), cudaSuccess);
      const absl::Status got =
          CheckDeviceResults(config, b.results.data(), stream);
      reference.Load(data, stream);
      const absl::StatusOr<HeadResult> want =
          RunOnce<float>(config, true, false, reference, *gpu);
      ASSERT_FALSE(want.ok());
      EXPECT_NE(want.status().message().find("upstream: must be finite"),
                std::string::npos)
          << want.status();
      EXPECT_EQ(got, want.status());
      EXPECT_EQ(ReadDeviceResults(config, b.results.data(), stream).status(),
                want.status());
      std::vector<double> raw = Download(b.results, stream);
      for (int64_t i = kResultLoss; i < DeviceResultsSize(kK); ++i) {
        EXPECT_TRUE(std::isnan(raw[i])) << "slot " << i;
      }
      const auto gradients = b.HostGradients(stream);
      for (size_t i = 0; i < gradients.size(); ++i) {
        for (double g : gradients[i]) {
          ASSERT_TRUE(std::isnan(g)) << "gradient " << i << ": " << g;
        }
      }
    }
    // Uncaptured, the same run's second Backward with a finite upstream
    // keeps the error and NaN gradients (a split run may run Backward more
    // than once): the word stays set until the next forward.
    {
      Data data = MakeData(7);
      data.upstream = std::nanf("");
      b.Load(data, stream);
      absl::StatusOr<CudaRows> rows = BuildCudaRows(
          config, Ids(b.ids), Masks(b.masks), kB, kN, stream);
      ASSERT_TRUE(rows.ok()) << rows.status();
      HeadOptions options;
      options.device_results = b.results.data();
      // Borrowed by the run until it is destroyed.
      const v1::ObjectiveConfig device_config = WithDeviceResults(config);
      auto run = StartCudaHead<float>(device_config, b.Inputs(rows->view()),
                                      *gpu->blas, b.RowOutputs(), options);
      ASSERT_TRUE(run.ok()) << run.status();
      DeviceUpstream upstream;
      upstream.value = b.upstream.data();
      upstream.is_float = true;
      upstream.of_loss_num = true;
      ASSERT_TRUE((*run)->Backward(upstream, b.Gradients(), nullptr).ok());
      const absl::Status first =
          CheckDeviceResults(config, b.results.data(), stream);
      EXPECT_EQ(first.code(), absl::StatusCode::kInvalidArgument) << first;
      Write(b.upstream, std::vector<float>{1}, stream);
      const auto second = (*run)->Backward(upstream, b.Gradients(), nullptr);
      ASSERT_TRUE(second.ok()) << second.status();
      EXPECT_EQ(CheckDeviceResults(config, b.results.data(), stream), first);
      for (double g : Download(b.grad_hidden, stream)) {
        ASSERT_TRUE(std::isnan(g)) << g;
      }
    }
    // The next launch with a finite upstream is clean again.
    const Data good = MakeData(6);
    b.Load(good, stream);
    ASSERT_EQ(cudaGraphLaunch(graph.exec, stream.stream()), cudaSuccess);
    absl::StatusOr<HeadResult> got =
        ReadDeviceResults(config, b.results.data(), stream);
    ASSERT_TRUE(got.ok()) << got.status();
    reference.Load(good, stream);
    absl::StatusOr<HeadResult> want =
        RunOnce<float>(config, true, false, reference, *gpu);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameResult(*got, *want);
  }
}

TEST(CudaDeviceResultsTest, Refusals) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  auto expect_refused = [](const absl::Status& status, const char* field,
                           const char* detail) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
    EXPECT_NE(status.message().find(detail), std::string::npos) << status;
  };
  // The config: CUDA only, ALL_ROWS only.
  v1::ObjectiveConfig cpu = ConfigBuilder("dflash {}").Build();
  cpu.mutable_head()->set_device_results(true);
  expect_refused(ValidateObjectiveConfig(cpu), "head.device_results",
                 "CUDA only");
  v1::ObjectiveConfig compact =
      WithDeviceResults(CudaConfig<float>("dflash {}", "FUSED"));
  compact.mutable_head()->set_row_selection(v1::HeadConfig::COMPACT);
  expect_refused(ValidateObjectiveConfig(compact), "head.device_results",
                 "needs head.row_selection ALL_ROWS");

  Buffers<float> b(CudaConfig<float>("dflash {}", "FUSED"), stream);
  b.Load(MakeData(1), stream);
  absl::StatusOr<CudaRows> rows =
      BuildCudaRows(CudaConfig<float>("dflash {}", "FUSED"), Ids(b.ids),
                    Masks(b.masks), kB, kN, stream);
  ASSERT_TRUE(rows.ok()) << rows.status();
  const HeadInputs<float> inputs = b.Inputs(rows->view());
  HeadOptions with_buffer;
  with_buffer.device_results = b.results.data();
  // The options: the buffer exactly with the config's field.
  expect_refused(
      RunCudaHead<float>(
          WithDeviceResults(CudaConfig<float>("dflash {}", "FUSED")), inputs,
          b.Gradients(), *gpu->blas)
          .status(),
      "options.device_results", "got null");
  expect_refused(RunCudaHead<float>(CudaConfig<float>("dflash {}", "FUSED"),
                                    inputs, b.Gradients(), *gpu->blas, {},
                                    with_buffer)
                     .status(),
                 "options.device_results", "head.device_results is not set");
  // Domino's greedy lengths are the host's.
  expect_refused(
      RunCudaHead<float>(WithDeviceResults(CudaConfig<float>(
                             "domino { lambda_base: 0.3 gamma: 3 }", "FUSED")),
                         inputs, b.Gradients(), *gpu->blas, {}, with_buffer)
          .status(),
      "head.device_results", "loss.domino");
  // A device upstream needs the scales on the device.
  auto split = StartCudaHead<float>(
      CudaConfig<float>("dflash {}", "CHECKPOINT"), inputs, *gpu->blas);
  ASSERT_TRUE(split.ok()) << split.status();
  DeviceUpstream upstream;
  upstream.value = b.upstream.data();
  expect_refused((*split)->Backward(upstream, b.Gradients(), nullptr).status(),
                 "upstream", "needs head.device_results");
}

}  // namespace
}  // namespace dflash
