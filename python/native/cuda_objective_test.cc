// The binding's CUDA path: RunObjective and RunTopKValueBackward on "cuda:0"
// tensors, ordered on a caller's stream as on torch's current stream,
// against the same calls on float64 CPU tensors (the CPU head, itself
// checked against naive float64 references in //tests). These are the
// native calls python/tests/cuda_test.py makes through torch's CUDA tensors;
// here they run wherever a CUDA device does, the emulated one included.
// Every upload, zeroing and download is queued on the caller's stream and
// nothing else synchronises: a run not ordered after the caller's work, or
// work queued after it not ordered after the run, reads the wrong values on
// a GPU and is a race the emulation names.
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/bfloat16.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "heads/head_types.h"
#include "losses/device_results.h"
#include "proto/config_overrides.h"
#include "python/native/config_sources.h"
#include "python/native/cuda_run.h"
#include "python/native/objective.h"
#include "python/native/tensor_arg.h"

namespace dflash::python {
namespace {

constexpr int64_t kB = 1, kN = 3, kK = 4, kH = 16, kV = 37, kTopK = 3;

int64_t ElementBytes(const std::string& dtype) {
  if (dtype == "float64" || dtype == "int64") return 8;
  if (dtype == "bool") return 1;
  if (dtype == "bfloat16") return 2;
  return 4;
}

std::vector<char> Encode(const std::vector<double>& values,
                         const std::string& dtype) {
  std::vector<char> bytes(values.size() * ElementBytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    char* at = bytes.data() + i * ElementBytes(dtype);
    const double x = values[i];
    if (dtype == "float64") {
      std::memcpy(at, &x, 8);
    } else if (dtype == "float32") {
      const float f = static_cast<float>(x);
      std::memcpy(at, &f, 4);
    } else if (dtype == "bfloat16") {
      const BFloat16 b = ToBFloat16(static_cast<float>(x));
      std::memcpy(at, &b, 2);
    } else if (dtype == "bool") {
      const uint8_t b = x != 0;
      std::memcpy(at, &b, 1);
    } else if (dtype == "int64") {
      const int64_t n = static_cast<int64_t>(x);
      std::memcpy(at, &n, 8);
    } else {
      const int32_t n = static_cast<int32_t>(x);
      std::memcpy(at, &n, 4);
    }
  }
  return bytes;
}

std::vector<double> Decode(const std::vector<char>& bytes,
                           const std::string& dtype) {
  std::vector<double> values(bytes.size() / ElementBytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const char* at = bytes.data() + i * ElementBytes(dtype);
    if (dtype == "float64") {
      std::memcpy(&values[i], at, 8);
    } else if (dtype == "float32") {
      float f;
      std::memcpy(&f, at, 4);
      values[i] = f;
    } else if (dtype == "bfloat16") {
      BFloat16 b;
      std::memcpy(&b, at, 2);
      values[i] = ToFloat(b);
    } else {
      int32_t n;
      std::memcpy(&n, at, 4);
      values[i] = n;
    }
  }
  return values;
}

// Where a call's tensors live: host memory, or device memory written and
// read in the order of one caller's stream.
class Place {
 public:
  virtual ~Place() = default;
  virtual std::string device() const = 0;
  virtual uintptr_t stream() const = 0;

  TensorArg Tensor(const char* name, const std::vector<double>& values,
                   const std::string& dtype, std::vector<int64_t> shape) {
    TensorArg arg = Describe(name, dtype, std::move(shape));
    keep_.push_back(Encode(values, dtype));
    arg.data = Allocate(keep_.back().size());
    Write(arg.data, keep_.back());
    return arg;
  }
  TensorArg Zeros(const char* name, const std::string& dtype,
                  std::vector<int64_t> shape) {
    TensorArg arg = Describe(name, dtype, std::move(shape));
    arg.data = Allocate(arg.numel() * ElementBytes(dtype));
    return arg;
  }
  // New values into `arg`'s memory (a captured graph's inputs).
  void Overwrite(const TensorArg& arg, const std::vector<double>& values) {
    keep_.push_back(Encode(values, arg.dtype));
    Write(arg.data, keep_.back());
  }
  std::vector<double> Values(const TensorArg& arg) {
    return Decode(Read(arg.data, arg.numel() * ElementBytes(arg.dtype)),
                  arg.dtype);
  }

 protected:
  // Zero-filled, at least 16-byte aligned.
  virtual uintptr_t Allocate(int64_t bytes) = 0;
  virtual void Write(uintptr_t at, const std::vector<char>& bytes) = 0;
  virtual std::vector<char> Read(uintptr_t at, int64_t bytes) = 0;

 private:
  TensorArg Describe(const char* name, const std::string& dtype,
                     std::vector<int64_t> shape) {
    TensorArg arg;
    arg.name = name;
    arg.dtype = dtype;
    arg.device = device();
    arg.strides.assign(shape.size(), 1);
    for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
      arg.strides[i] = arg.strides[i + 1] * shape[i + 1];
    }
    arg.shape = std::move(shape);
    return arg;
  }

  std::deque<std::vector<char>> keep_;  // Host bytes a copy may still read.
};

class HostPlace : public Place {
 public:
  std::string device() const override { return "cpu"; }
  uintptr_t stream() const override { return 0; }

 protected:
  uintptr_t Allocate(int64_t bytes) override {
    memory_.emplace_back(static_cast<size_t>(bytes + 7) / 8, 0.0);
    return reinterpret_cast<uintptr_t>(memory_.back().data());
  }
  void Write(uintptr_t at, const std::vector<char>& bytes) override {
    std::memcpy(reinterpret_cast<void*>(at), bytes.data(), bytes.size());
  }
  std::vector<char> Read(uintptr_t at, int64_t bytes) override {
    const char* from = reinterpret_cast<const char*>(at);
    return std::vector<char>(from, from + bytes);
  }

 private:
  std::deque<std::vector<double>> memory_;
};

class DevicePlace : public Place {
 public:
  // Why the device is unusable, or OK.
  absl::Status Open() {
    if (const cudaError_t error =
            cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        error != cudaSuccess) {
      cudaGetLastError();
      stream_ = nullptr;
      return absl::UnavailableError(cudaGetErrorString(error));
    }
    return absl::OkStatus();
  }
  ~DevicePlace() override {
    if (stream_ == nullptr) return;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (void* p : memory_) EXPECT_EQ(cudaFree(p), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
  }
  std::string device() const override { return "cuda:0"; }
  uintptr_t stream() const override {
    return reinterpret_cast<uintptr_t>(stream_);
  }

 protected:
  uintptr_t Allocate(int64_t bytes) override {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(p, 0, bytes, stream_), cudaSuccess);
    memory_.push_back(p);
    return reinterpret_cast<uintptr_t>(p);
  }
  void Write(uintptr_t at, const std::vector<char>& bytes) override {
    EXPECT_EQ(cudaMemcpyAsync(reinterpret_cast<void*>(at), bytes.data(),
                              bytes.size(), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
  }
  std::vector<char> Read(uintptr_t at, int64_t bytes) override {
    std::vector<char> out(bytes);
    EXPECT_EQ(cudaMemcpyAsync(out.data(), reinterpret_cast<void*>(at), bytes,
                              cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return out;
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<void*> memory_;
};

// A seeded batch in float64: a quarter of the rows masked, one target
// ignored.
struct Batch {
  std::vector<double> hidden, weight, teacher, confidence, ids, mask;

  explicit Batch(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 1);
    const int64_t rows = kB * kN * kK;
    for (int64_t i = 0; i < rows * kH; ++i) hidden.push_back(normal(rng));
    for (int64_t i = 0; i < rows * kH; ++i) teacher.push_back(normal(rng));
    for (int64_t i = 0; i < kV * kH; ++i) {
      weight.push_back(normal(rng) / std::sqrt(kH));
    }
    for (int64_t r = 0; r < rows; ++r) {
      confidence.push_back(normal(rng));
      ids.push_back(static_cast<double>(rng() % kV));
      mask.push_back(r % 4 == 0 ? 0.0 : 1.0);
    }
    ids[5] = -100;
    mask[5] = 1;
  }
};

struct Family {
  const char* loss;
  bool teacher, confidence;
};

// What one call gives back, in float64.
struct Outcome {
  HeadResult head;
  std::vector<double> grad_hidden, grad_weight, grad_confidence, neg_log_q,
      argmax, top_k, top_k_values;
};

// One call's config, tensors and buffers on `place`, inputs stored as
// `dtype`. Targets and masks stay on the host (the binding reads the rows
// there; dflash.torch copies them). Gradient buffers exactly where
// `gradients` (a training run that takes them in the call).
struct Call {
  std::unique_ptr<HostPlace> host = std::make_unique<HostPlace>();
  v1::ObjectiveConfig config;
  ObjectiveTensors tensors;
  ObjectiveOutputs outputs;
  ObjectiveOptions options;
};

// Confidence logits and their gradient, the top-k values and their
// gradient: float64 on the CPU in float64, else float32.
std::string ValuesDType(const std::string& dtype) {
  return dtype == "float64" ? "float64" : "float32";
}

absl::StatusOr<Call> Prepare(Place& place, const std::string& dtype,
                             const Family& family, const std::string& mode,
                             const Batch& batch, bool trainable,
                             bool gradients) {
  Call call;
  call.config = *DefaultConfig();
  ConfigOverrides overrides;
  overrides.loss = family.loss;
  overrides.mode = mode;
  overrides.chunk_blocks = 2;
  if (absl::Status s =
          ApplyOverrides(overrides, OverrideNames::kKeywords, call.config);
      !s.ok()) {
    return s;
  }
  const std::vector<int64_t> rows = {kB, kN, kK};
  const std::vector<int64_t> states = {kB, kN, kK, kH};
  const std::vector<int64_t> ranked = {kB, kN, kK, kTopK};

  ObjectiveTensors& t = call.tensors;
  t.hidden = place.Tensor("hidden", batch.hidden, dtype, states);
  t.weight = place.Tensor("lm_head_weight", batch.weight, dtype, {kV, kH});
  t.target_ids = call.host->Tensor("target_ids", batch.ids, "int64", rows);
  t.weight_mask =
      call.host->Tensor("weight_mask", batch.mask, "float32", rows);
  if (family.teacher) {
    t.teacher_hidden = place.Tensor("teacher_hidden", batch.teacher, dtype,
                                    states);
  }
  const std::string values = ValuesDType(dtype);
  if (family.confidence) {
    t.confidence_logits =
        place.Tensor("confidence_logits", batch.confidence, values, rows);
  }
  ObjectiveOutputs& o = call.outputs;
  if (gradients) {
    o.grad_hidden = place.Zeros("grad_hidden", dtype, states);
    if (trainable) o.grad_weight = place.Zeros("grad_weight", dtype, {kV, kH});
    if (family.confidence) {
      o.grad_confidence = place.Zeros("grad_confidence", values, rows);
    }
  }
  o.neg_log_q = place.Zeros("neg_log_q", "float64", rows);
  o.argmax = place.Zeros("argmax", "int32", rows);
  o.top_k = place.Zeros("top_k", "int32", ranked);
  o.top_k_values = place.Zeros("top_k_values", values, ranked);
  call.options.trainable = trainable;
  call.options.cuda_stream = place.stream();
  return call;
}

// RunObjective on `place` with inputs stored as `dtype`, then the backward
// of top-k values for unit gradients: of its own top k, or of `ranked`'s
// ids and values where given (near-ties rank differently in bfloat16, and
// the backward is a function of the ids it is given). With `forward_only`,
// the forward-only run alone: no gradient buffer, no backward, the
// Outcome's gradients empty.
absl::StatusOr<Outcome> RunOn(Place& place, const std::string& dtype,
                              const Family& family, const std::string& mode,
                              const Batch& batch,
                              const Outcome* ranked_by = nullptr,
                              bool forward_only = false) {
  absl::StatusOr<Call> call = Prepare(place, dtype, family, mode, batch,
                                      !forward_only, !forward_only);
  if (!call.ok()) return call.status();
  const v1::ObjectiveConfig& config = call->config;
  const ObjectiveTensors& t = call->tensors;
  const ObjectiveOutputs& o = call->outputs;
  ObjectiveOptions& options = call->options;
  options.forward_only = forward_only;
  const std::vector<int64_t> ranked = {kB, kN, kK, kTopK};
  const std::string values = ValuesDType(dtype);
  absl::StatusOr<HeadResult> head = RunObjective(config, t, o, options);
  if (!head.ok()) return head.status();
  if (forward_only) {
    Outcome out{*std::move(head)};
    out.neg_log_q = place.Values(*o.neg_log_q);
    out.argmax = place.Values(*o.argmax);
    out.top_k = place.Values(*o.top_k);
    out.top_k_values = place.Values(*o.top_k_values);
    return out;
  }

  TopKBackwardTensors back{t.hidden, t.weight, std::nullopt, *o.top_k,
                           *o.top_k_values};
  if (ranked_by != nullptr) {
    back.top_k = place.Tensor("top_k", ranked_by->top_k, "int32", ranked);
    back.values =
        place.Tensor("top_k_values", ranked_by->top_k_values, values, ranked);
  }
  back.grad_values = place.Tensor(
      "grad_values",
      std::vector<double>(static_cast<size_t>(kB * kN * kK * kTopK), 1.0),
      values, ranked);
  back.grad_hidden = *o.grad_hidden;
  back.grad_weight = o.grad_weight;
  if (absl::Status s = RunTopKValueBackward(config, back, options); !s.ok()) {
    return s;
  }
  Outcome out{*std::move(head)};
  out.grad_hidden = place.Values(*o.grad_hidden);
  out.grad_weight = place.Values(*o.grad_weight);
  if (family.confidence) out.grad_confidence = place.Values(*o.grad_confidence);
  out.neg_log_q = place.Values(*o.neg_log_q);
  out.argmax = place.Values(*o.argmax);
  out.top_k = place.Values(*o.top_k);
  out.top_k_values = place.Values(*o.top_k_values);
  return out;
}

// Inputs as `dtype` would store them, in float64.
Batch RoundedTo(const std::string& dtype, Batch batch) {
  for (std::vector<double>* v : {&batch.hidden, &batch.weight, &batch.teacher}) {
    *v = Decode(Encode(*v, dtype), dtype);
  }
  return batch;
}

struct Case {
  Family family;
  std::string dtype, mode;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.family.loss << " " << c.dtype << " " << c.mode;
}

class CudaObjectiveTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaObjectiveTest, MatchesTheCpuInFloat64) {
  const Case& c = GetParam();
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  // The reference reads the inputs the device reads: bfloat16-rounded.
  const Batch batch = RoundedTo(c.dtype, Batch(7));
  absl::StatusOr<Outcome> got = RunOn(gpu, c.dtype, c.family, c.mode, batch);
  ASSERT_TRUE(got.ok()) << got.status();
  HostPlace cpu;
  absl::StatusOr<Outcome> want =
      RunOn(cpu, "float64", c.family, c.mode, batch, &*got);
  ASSERT_TRUE(want.ok()) << want.status();

  // float32 within 1e-5 (measured 2e-7 at most under emulation). The
  // bfloat16 head rounds its logits and gradients to bfloat16 (2^-8
  // relative): terms within 4e-3 and gradients within 8e-3 (measured 1.2e-3
  // and 2.3e-3).
  const bool bf16 = c.dtype == "bfloat16";
  const double terms = bf16 ? 4e-3 : 1e-5;
  const double grads = bf16 ? 8e-3 : 1e-5;
  EXPECT_NEAR(got->head.terms.loss_num, want->head.terms.loss_num,
              terms * std::max(1.0, std::abs(want->head.terms.loss_num)));
  EXPECT_DOUBLE_EQ(got->head.terms.loss_den, want->head.terms.loss_den);
  EXPECT_NEAR(got->head.loss, want->head.loss,
              terms * std::max(1.0, std::abs(want->head.loss)));
  const Outcome& g = *got;
  const Outcome& w = *want;
  EXPECT_LT(RelativeL2Error<double>(g.grad_hidden, w.grad_hidden), grads);
  EXPECT_LT(RelativeL2Error<double>(g.grad_weight, w.grad_weight), grads);
  EXPECT_LT(RelativeL2Error<double>(g.neg_log_q, w.neg_log_q), terms);
  EXPECT_LT(RelativeL2Error<double>(g.top_k_values, w.top_k_values), terms);
  if (c.family.confidence) {
    EXPECT_LT(RelativeL2Error<double>(g.grad_confidence, w.grad_confidence),
              grads);
  }
  if (!bf16) {
    // Ids are exact where float32 cannot reorder logits: the batch's gaps
    // are far above its rounding.
    EXPECT_EQ(got->argmax, want->argmax);
    EXPECT_EQ(got->top_k, want->top_k);
  }
}

// A forward-only run on the device: the training run's terms and row
// outputs, bit for bit (the same forward kernels), one projection's GEMMs.
TEST_P(CudaObjectiveTest, ForwardOnlyGivesTheTrainingRunsValues) {
  const Case& c = GetParam();
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch = RoundedTo(c.dtype, Batch(7));
  absl::StatusOr<Outcome> train = RunOn(gpu, c.dtype, c.family, c.mode, batch);
  ASSERT_TRUE(train.ok()) << train.status();
  absl::StatusOr<Outcome> eval =
      RunOn(gpu, c.dtype, c.family, c.mode, batch, nullptr, true);
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->head.terms.loss_num, train->head.terms.loss_num);
  EXPECT_EQ(eval->head.terms.loss_den, train->head.terms.loss_den);
  EXPECT_EQ(eval->head.terms.correct, train->head.terms.correct);
  EXPECT_EQ(eval->neg_log_q, train->neg_log_q);
  EXPECT_EQ(eval->argmax, train->argmax);
  EXPECT_EQ(eval->top_k, train->top_k);
  EXPECT_EQ(eval->top_k_values, train->top_k_values);
  EXPECT_LT(eval->head.stats.gemm_passes, train->head.stats.gemm_passes);
  EXPECT_EQ(eval->head.stats.segment_recomputes, 0);
}

// A lent allocator (as the binding lends torch's caching allocator) over
// cudaMalloc that counts the bytes live, their peak, the calls and the
// streams it serves. Its counts outlive a lending: a split state keeps its
// stream's allocator after SetTorchAllocator(std::nullopt).
struct CountingAllocator {
  struct Counts {
    int64_t live = 0, peak = 0, calls = 0;
    std::vector<uintptr_t> streams;
    std::map<uintptr_t, int64_t> sizes;
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();

  TorchAllocator Lent() const {
    TorchAllocator lent;
    lent.allocate = [counts = counts](int64_t bytes, int device,
                                      uintptr_t stream)
        -> absl::StatusOr<uintptr_t> {
      EXPECT_EQ(device, 0);
      void* p = nullptr;
      if (cudaMalloc(&p, bytes) != cudaSuccess) {
        return absl::ResourceExhaustedError("test allocator: full");
      }
      counts->live += bytes;
      counts->peak = std::max(counts->peak, counts->live);
      ++counts->calls;
      counts->streams.push_back(stream);
      counts->sizes[reinterpret_cast<uintptr_t>(p)] = bytes;
      return reinterpret_cast<uintptr_t>(p);
    };
    lent.free = [counts = counts](uintptr_t data) {
      // The free is stream-ordered for torch's allocator; here, wait.
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      counts->live -= counts->sizes.at(data);
      counts->sizes.erase(data);
      EXPECT_EQ(cudaFree(reinterpret_cast<void*>(data)), cudaSuccess);
    };
    return lent;
  }
};

// The cuBLAS workspace a stream's state takes from the allocator, as
// PyTorch sizes one: 32 MiB from compute capability 9, else 4 MiB.
int64_t WorkspaceBytes() {
  cudaDeviceProp properties;
  EXPECT_EQ(cudaGetDeviceProperties(&properties, 0), cudaSuccess);
  return properties.major >= 9 ? int64_t{32} << 20 : int64_t{4} << 20;
}

// The address of the one live allocation of WorkspaceBytes() in `sizes`
// (a lent allocator's live blocks), or 0 (a failure) where there is not
// exactly one.
uintptr_t WorkspaceIn(const std::map<uintptr_t, int64_t>& sizes) {
  uintptr_t found = 0;
  int count = 0;
  for (const auto& [data, bytes] : sizes) {
    if (bytes == WorkspaceBytes()) {
      found = data;
      ++count;
    }
  }
  EXPECT_EQ(count, 1) << "live allocations of the cuBLAS workspace's size";
  return count == 1 ? found : 0;
}

// With an allocator lent (as the binding lends torch's caching allocator),
// a run goes on the caller's stream itself and takes every workspace from
// the allocator, on that stream, and hands each back: the same results as
// the head's own stream and pool.
TEST_P(CudaObjectiveTest, ALentAllocatorServesEveryWorkspace) {
  const Case& c = GetParam();
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch = RoundedTo(c.dtype, Batch(7));
  absl::StatusOr<Outcome> own = RunOn(gpu, c.dtype, c.family, c.mode, batch);
  ASSERT_TRUE(own.ok()) << own.status();

  CountingAllocator lent;
  const std::shared_ptr<CountingAllocator::Counts> counts = lent.counts;
  SetTorchAllocator(lent.Lent());
  absl::StatusOr<Outcome> got = RunOn(gpu, c.dtype, c.family, c.mode, batch);
  SetTorchAllocator(std::nullopt);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(counts->calls, 0);
  EXPECT_GT(counts->peak, 0);
  EXPECT_EQ(counts->live, 0);  // Every workspace handed back.
  for (uintptr_t stream : counts->streams) EXPECT_EQ(stream, gpu.stream());
  EXPECT_EQ(got->head.terms.loss_num, own->head.terms.loss_num);
  EXPECT_EQ(got->head.terms.loss_den, own->head.terms.loss_den);
  EXPECT_EQ(got->grad_hidden, own->grad_hidden);
  EXPECT_EQ(got->grad_weight, own->grad_weight);
  EXPECT_EQ(got->neg_log_q, own->neg_log_q);
  EXPECT_EQ(got->top_k, own->top_k);
}

std::vector<Case> Cases() {
  const Family families[] = {
      {"dflash", false, false}, {"dspark", true, true}, {"kl", true, false}};
  std::vector<Case> cases;
  for (const Family& f : families) {
    for (const char* dtype : {"float32", "bfloat16"}) {
      for (const char* mode : {"fused", "checkpoint"}) {
        cases.push_back({f, dtype, mode});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Families, CudaObjectiveTest, ::testing::ValuesIn(Cases()),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.family.loss, "_", info.param.dtype, "_",
                          info.param.mode);
    });

// The gradients a split run's backward gives, in float64.
struct Gradients {
  std::vector<double> hidden, weight, confidence;
};

// `saved`'s backward into fresh buffers on `place` (whose stream orders
// it: it need not be the forward's), as dflash.torch's backward makes them.
absl::StatusOr<Gradients> BackwardOn(Place& place, SavedObjective& saved,
                                     const Call& call, double upstream,
                                     const std::atomic<bool>* interrupt =
                                         nullptr) {
  const std::string& dtype = call.tensors.hidden.dtype;
  ObjectiveOutputs g;
  g.grad_hidden = place.Zeros("grad_hidden", dtype, {kB, kN, kK, kH});
  g.grad_weight = place.Zeros("grad_weight", dtype, {kV, kH});
  if (call.tensors.confidence_logits.has_value()) {
    g.grad_confidence =
        place.Zeros("grad_confidence", ValuesDType(dtype), {kB, kN, kK});
  }
  absl::StatusOr<HeadStats> stats =
      saved.Backward(upstream, g, place.stream(), interrupt);
  if (!stats.ok()) return stats.status();
  Gradients out{place.Values(*g.grad_hidden), place.Values(*g.grad_weight)};
  if (g.grad_confidence.has_value()) {
    out.confidence = place.Values(*g.grad_confidence);
  }
  return out;
}

// A split run's forward on `place` (a training call, the head trainable):
// its call, and what StartObjective gave.
struct Split {
  Call call;
  StartedObjective started;
};
absl::StatusOr<Split> StartOn(Place& place, const Case& c,
                              const Batch& batch) {
  absl::StatusOr<Call> call =
      Prepare(place, c.dtype, c.family, c.mode, batch, /*trainable=*/true,
              /*gradients=*/false);
  if (!call.ok()) return call.status();
  absl::StatusOr<StartedObjective> started = StartObjective(
      call->config, call->tensors, call->outputs, call->options);
  if (!started.ok()) return started.status();
  return Split{*std::move(call), *std::move(started)};
}

// StartOn with a CountingAllocator lent for the forward pass: the split,
// the allocator (which the state keeps), and the bytes and allocations it
// left live, less the stream state's cuBLAS workspace (which the split
// keeps alive with the state, but which is not the split's).
struct Counted {
  Split split;
  CountingAllocator allocator;
  int64_t held = 0, allocations = 0;
};
absl::StatusOr<Counted> StartCounted(DevicePlace& gpu, const Case& c,
                                     const Batch& batch) {
  CountingAllocator allocator;
  SetTorchAllocator(allocator.Lent());
  absl::StatusOr<Split> split = StartOn(gpu, c, batch);
  SetTorchAllocator(std::nullopt);
  if (!split.ok()) return split.status();
  EXPECT_NE(WorkspaceIn(allocator.counts->sizes), 0u);
  const int64_t held = allocator.counts->live - WorkspaceBytes();
  const int64_t allocations =
      static_cast<int64_t>(allocator.counts->sizes.size()) - 1;
  return Counted{*std::move(split), std::move(allocator), held, allocations};
}

// A CUDA split state's saved_bytes is what the lent allocator shows live
// after its forward pass, less the rounding of each live allocation up to
// 64 bytes (TrackingAllocator counts the bytes asked for; the CUDA head
// keeps nothing outside its stream's allocator; host metadata: no device
// rows).
void ExpectSavedBytesAreHeld(const Counted& counted) {
  const int64_t saved = counted.split.started.saved->saved_bytes();
  EXPECT_LE(saved, counted.held);
  EXPECT_GE(saved, counted.held - 63 * counted.allocations);
}

std::vector<double> Times(double factor, std::vector<double> values) {
  for (double& x : values) x *= factor;
  return values;
}

// The split run on the device against the single call (RunObjective in the
// same mode on the device, itself checked against the CPU above). Not
// bitwise: the single call folds the scale its rows decide into the
// input-gradient GEMMs at its start, the split run upstream x the finished
// scale at backward (//tests:cuda_split_head_test): float32 within 1e-6,
// bfloat16 within 1e-2 (an ulp on some entries).
class CudaSplitObjectiveTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaSplitObjectiveTest, EqualsTheSingleCallRepeatsAndScales) {
  const Case& c = GetParam();
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch = RoundedTo(c.dtype, Batch(7));
  absl::StatusOr<Call> whole = Prepare(gpu, c.dtype, c.family, c.mode, batch,
                                       /*trainable=*/true, /*gradients=*/true);
  ASSERT_TRUE(whole.ok()) << whole.status();
  absl::StatusOr<HeadResult> want = RunObjective(
      whole->config, whole->tensors, whole->outputs, whole->options);
  ASSERT_TRUE(want.ok()) << want.status();
  const ObjectiveOutputs& wo = whole->outputs;

  absl::StatusOr<Split> split = StartOn(gpu, c, batch);
  ASSERT_TRUE(split.ok()) << split.status();
  const HeadResult& forward = split->started.forward;
  const ObjectiveOutputs& so = split->call.outputs;
  // The same forward kernels: the same terms and row outputs, bit for bit.
  EXPECT_EQ(forward.terms.loss_num, want->terms.loss_num);
  EXPECT_EQ(forward.terms.loss_den, want->terms.loss_den);
  EXPECT_EQ(forward.loss, want->loss);
  EXPECT_EQ(gpu.Values(*so.neg_log_q), gpu.Values(*wo.neg_log_q));
  EXPECT_EQ(gpu.Values(*so.argmax), gpu.Values(*wo.argmax));
  EXPECT_EQ(gpu.Values(*so.top_k), gpu.Values(*wo.top_k));
  EXPECT_EQ(gpu.Values(*so.top_k_values), gpu.Values(*wo.top_k_values));
  EXPECT_GT(want->stats.gemm_passes, forward.stats.gemm_passes);

  // Between the passes the state holds saved_bytes (ExpectSavedBytesAreHeld
  // on the same forward with an allocator lent), the head's own pool the
  // same.
  SavedObjective& saved = *split->started.saved;
  absl::StatusOr<Counted> lent = StartCounted(gpu, c, batch);
  ASSERT_TRUE(lent.ok()) << lent.status();
  ExpectSavedBytesAreHeld(*lent);
  EXPECT_EQ(saved.saved_bytes(), lent->split.started.saved->saved_bytes());
  // Over CHECKPOINT's per-row state (the rows' confidence gradient, float32,
  // among it): SAVE_CHUNKS and MATERIALIZE keep each active row's logits
  // gradient, rows padded to 16 bytes; SELECTIVE the teacher's logits where
  // there is a teacher, else nothing.
  absl::StatusOr<Counted> checkpoint =
      StartCounted(gpu, Case{c.family, c.dtype, "checkpoint"}, batch);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ExpectSavedBytesAreHeld(*checkpoint);
  const int64_t per_row = checkpoint->split.started.saved->saved_bytes();
  const int64_t confidence = c.family.confidence ? kB * kN * kK * 4 : 0;
  EXPECT_GT(per_row, confidence);
  const int64_t element = c.dtype == "bfloat16" ? 2 : 4;
  const int64_t stride = (kV * element + 15) / 16 * 16 / element;
  int64_t active = 0;
  for (size_t r = 0; r < batch.mask.size(); ++r) {
    active += batch.mask[r] > 0 && batch.ids[r] != -100;
  }
  const int64_t kept = saved.saved_bytes() - per_row;
  if (c.mode == "selective" && c.family.teacher) {
    EXPECT_GT(kept, 0);
  } else {
    EXPECT_EQ(kept, c.mode == "checkpoint" || c.mode == "selective"
                        ? 0
                        : active * stride * element);
  }

  const bool bf16 = c.dtype == "bfloat16";
  const double tolerance = bf16 ? 1e-2 : 1e-6;
  absl::StatusOr<Gradients> first = BackwardOn(gpu, saved, split->call, 1.0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_LT(RelativeL2Error<double>(first->hidden,
                                    gpu.Values(*wo.grad_hidden)),
            tolerance);
  EXPECT_LT(RelativeL2Error<double>(first->weight,
                                    gpu.Values(*wo.grad_weight)),
            tolerance);
  if (c.family.confidence) {
    EXPECT_LT(RelativeL2Error<double>(first->confidence,
                                      gpu.Values(*wo.grad_confidence)),
              tolerance);
  }
  // Repeatable (a retained graph's second backward): the same bits, and
  // what the mode keeps is still held.
  const int64_t held = saved.saved_bytes();
  absl::StatusOr<Gradients> second = BackwardOn(gpu, saved, split->call, 1.0);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->hidden, first->hidden);
  EXPECT_EQ(second->weight, first->weight);
  EXPECT_EQ(second->confidence, first->confidence);
  EXPECT_EQ(saved.saved_bytes(), held);
  // The upstream scales every gradient.
  absl::StatusOr<Gradients> tripled = BackwardOn(gpu, saved, split->call, 3.0);
  ASSERT_TRUE(tripled.ok()) << tripled.status();
  EXPECT_LT(RelativeL2Error<double>(tripled->hidden, Times(3, first->hidden)),
            tolerance);
  EXPECT_LT(RelativeL2Error<double>(tripled->weight, Times(3, first->weight)),
            tolerance);
  if (c.family.confidence) {
    EXPECT_LT(RelativeL2Error<double>(tripled->confidence,
                                      Times(3, first->confidence)),
              tolerance);
  }
}

std::vector<Case> SplitCases() {
  const Family families[] = {
      {"dflash", false, false}, {"dspark", true, true}, {"kl", true, false}};
  std::vector<Case> cases;
  for (const Family& f : families) {
    for (const char* dtype : {"float32", "bfloat16"}) {
      for (const char* mode : {"checkpoint", "save"}) {
        cases.push_back({f, dtype, mode});
      }
    }
  }
  // The other split modes on a family without and with a teacher
  // (SELECTIVE keeps the teacher's logits).
  for (const char* mode : {"materialize", "selective"}) {
    cases.push_back({families[0], "float32", mode});
    cases.push_back({families[2], "bfloat16", mode});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Families, CudaSplitObjectiveTest, ::testing::ValuesIn(SplitCases()),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.family.loss, "_", info.param.dtype, "_",
                          info.param.mode);
    });

// Autograd may run the backward on another stream than the forward's (a
// side stream made current between the passes): it is ordered on the one
// it is given, with the head's own stream and with the lent allocator
// (whose forward ran on the forward's stream itself), and gives the same
// gradients. Buffers written on one stream and read on another without
// that order are races the emulation names. With the lent allocator every
// workspace comes from it on the forward's stream, the backward hands back
// what it took, and the state hands back the rest when it goes.
TEST(CudaSplitStreamsTest, BackwardOnAnotherStream) {
  DevicePlace gpu, side;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  DFLASH_SKIP_WITHOUT_GPU(side.Open());
  for (const Case& c : {Case{{"dspark", true, true}, "float32", "save"},
                        Case{{"dflash", false, false}, "bfloat16",
                             "checkpoint"}}) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const Batch batch = RoundedTo(c.dtype, Batch(9));
    absl::StatusOr<Split> own = StartOn(gpu, c, batch);
    ASSERT_TRUE(own.ok()) << own.status();
    absl::StatusOr<Gradients> here =
        BackwardOn(gpu, *own->started.saved, own->call, 1.0);
    ASSERT_TRUE(here.ok()) << here.status();
    absl::StatusOr<Gradients> there =
        BackwardOn(side, *own->started.saved, own->call, 1.0);
    ASSERT_TRUE(there.ok()) << there.status();
    EXPECT_EQ(there->hidden, here->hidden);
    EXPECT_EQ(there->weight, here->weight);
    EXPECT_EQ(there->confidence, here->confidence);

    absl::StatusOr<Counted> on_torch = StartCounted(gpu, c, batch);
    ASSERT_TRUE(on_torch.ok()) << on_torch.status();
    const std::shared_ptr<CountingAllocator::Counts> counts =
        on_torch->allocator.counts;
    SavedObjective& saved = *on_torch->split.started.saved;
    // saved_bytes is all the state holds between the passes (the mode's
    // buffers, the per-row state, the chunk loss's scratch), every byte
    // from the lent allocator.
    ExpectSavedBytesAreHeld(*on_torch);
    const int64_t held = counts->live;
    absl::StatusOr<Gradients> lent_there =
        BackwardOn(side, saved, on_torch->split.call, 1.0);
    ASSERT_TRUE(lent_there.ok()) << lent_there.status();
    EXPECT_EQ(lent_there->hidden, here->hidden);
    EXPECT_EQ(lent_there->weight, here->weight);
    EXPECT_EQ(lent_there->confidence, here->confidence);
    EXPECT_EQ(counts->live, held);  // The backward's workspaces went back.
    on_torch->split.started.saved.reset();
    EXPECT_EQ(counts->live, 0);
    EXPECT_FALSE(counts->streams.empty());
    for (uintptr_t stream : counts->streams) EXPECT_EQ(stream, gpu.stream());
  }
}

// Python's garbage collector may run inside the lent allocator's callback
// (torch.cuda.caching_allocator_alloc) and free another split state on the
// same stream, whose run holds that stream's lock on this thread: the
// state's device memory goes back when the run lets go of the lock, not
// deadlocked on it. A watchdog fails the test rather than let it hang.
TEST(CudaSplitStateTest, DestroyedInsideALentAllocatorCall) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  static std::atomic<bool> finished{false};
  std::thread([] {
    for (int i = 0; i < 240 && !finished.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    if (!finished.load()) {
      std::fprintf(stderr, "deadlock: a split state's destructor waits on "
                           "the stream lock its own thread holds\n");
      std::fflush(stderr);
      _exit(3);
    }
  }).detach();
  const Case c{{"dflash", false, false}, "float32", "checkpoint"};
  const Batch batch(7);
  struct Counts {
    std::unique_ptr<SavedObjective> victim;
    bool destroyed_inside = false;
    int64_t live = 0;
    std::map<uintptr_t, int64_t> sizes;
  };
  auto counts = std::make_shared<Counts>();
  TorchAllocator lent;
  lent.allocate = [counts](int64_t bytes, int,
                           uintptr_t) -> absl::StatusOr<uintptr_t> {
    if (counts->victim != nullptr) {
      counts->victim.reset();
      counts->destroyed_inside = true;
    }
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      return absl::ResourceExhaustedError("test allocator: full");
    }
    counts->live += bytes;
    counts->sizes[reinterpret_cast<uintptr_t>(p)] = bytes;
    return reinterpret_cast<uintptr_t>(p);
  };
  lent.free = [counts](uintptr_t data) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    counts->live -= counts->sizes.at(data);
    counts->sizes.erase(data);
    EXPECT_EQ(cudaFree(reinterpret_cast<void*>(data)), cudaSuccess);
  };
  SetTorchAllocator(lent);
  absl::StatusOr<Split> first = StartOn(gpu, c, batch);
  ASSERT_TRUE(first.ok()) << first.status();
  const int64_t first_holds = counts->live;
  EXPECT_GT(first_holds, 0);
  counts->victim = std::move(first->started.saved);
  absl::StatusOr<Split> second = StartOn(gpu, c, batch);
  SetTorchAllocator(std::nullopt);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(counts->destroyed_inside);
  // The first state's memory went back with the second forward's end: what
  // is left is the second's, as much as the first held.
  EXPECT_EQ(counts->live, first_holds);
  // The stream's lock is free: the second state runs its backward.
  absl::StatusOr<Gradients> gradients =
      BackwardOn(gpu, *second->started.saved, second->call, 1.0);
  EXPECT_TRUE(gradients.ok()) << gradients.status();
  second->started.saved.reset();
  EXPECT_EQ(counts->live, 0);
  finished.store(true);
}

// ObjectiveOptions::interrupt stops a split forward on CUDA: Cancelled,
// no state.
TEST(CudaSplitRefusalsTest, InterruptedForward) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Case c{{"dflash", false, false}, "float32", "checkpoint"};
  absl::StatusOr<Call> call =
      Prepare(gpu, c.dtype, c.family, c.mode, Batch(7), /*trainable=*/true,
              /*gradients=*/false);
  ASSERT_TRUE(call.ok()) << call.status();
  const std::atomic<bool> interrupted{true};
  call->options.interrupt = &interrupted;
  absl::StatusOr<StartedObjective> started = StartObjective(
      call->config, call->tensors, call->outputs, call->options);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kCancelled)
      << started.status();
}

// A backward refused before it runs (a gradient buffer of the wrong shape,
// a non-finite upstream) leaves the state usable; one that failed while
// running (cancelled) breaks it: every later backward is refused.
TEST(CudaSplitRefusalsTest, AfterAFailedBackward) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Case c{{"dflash", false, false}, "float32", "checkpoint"};
  const Batch batch(7);
  absl::StatusOr<Split> split = StartOn(gpu, c, batch);
  ASSERT_TRUE(split.ok()) << split.status();
  SavedObjective& saved = *split->started.saved;

  ObjectiveOutputs wrong;
  wrong.grad_hidden = gpu.Zeros("grad_hidden", "float32", {kB, kN, kK, kH + 1});
  wrong.grad_weight = gpu.Zeros("grad_weight", "float32", {kV, kH});
  absl::StatusOr<HeadStats> refused =
      saved.Backward(1.0, wrong, gpu.stream(), nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("grad_hidden"), std::string::npos)
      << refused.status();
  absl::StatusOr<Gradients> non_finite =
      BackwardOn(gpu, saved, split->call, std::nan(""));
  EXPECT_EQ(non_finite.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(non_finite.status().message().find("upstream"), std::string::npos)
      << non_finite.status();
  absl::StatusOr<Gradients> fine = BackwardOn(gpu, saved, split->call, 1.0);
  ASSERT_TRUE(fine.ok()) << fine.status();

  const std::atomic<bool> interrupted{true};
  absl::StatusOr<Gradients> cancelled =
      BackwardOn(gpu, saved, split->call, 1.0, &interrupted);
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled)
      << cancelled.status();
  absl::StatusOr<Gradients> after = BackwardOn(gpu, saved, split->call, 1.0);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition)
      << after.status();
  EXPECT_NE(after.status().message().find("failed or was cancelled"),
            std::string::npos)
      << after.status();
}

// The backward of top-k values whose logits hold a correction's u . M[id]:
// d/du and d/dM beside d/dh and d/dW, on the device in float32 against the
// CPU in float64, for the same ids and values (a softcap, so that dz'/dz is
// read off the values; ids of -1 add nothing).
TEST(CudaTopKBackwardTest, CorrectionGetsItsGradients) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  constexpr int64_t kR = 2;
  const Batch batch(7);
  const int64_t rows = kB * kN * kK;
  std::vector<double> u, m, ids, values, grad_values;
  for (int64_t i = 0; i < rows * kR; ++i) u.push_back(std::sin(0.7 * i));
  for (int64_t i = 0; i < kV * kR; ++i) m.push_back(0.5 * std::cos(1.3 * i));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kTopK; ++j) {
      const int64_t id = r % 5 == 0 ? -1 : (7 * r + 11 * j) % kV;
      double z = 0;
      for (int64_t i = 0; id >= 0 && i < kH; ++i) {
        z += batch.hidden[r * kH + i] * batch.weight[id * kH + i];
      }
      for (int64_t i = 0; id >= 0 && i < kR; ++i) {
        z += u[r * kR + i] * m[id * kR + i];
      }
      ids.push_back(static_cast<double>(id));
      values.push_back(id < 0 ? 0.0 : 5 * std::tanh(z / 5));
      grad_values.push_back(0.5 + 0.1 * static_cast<double>(j) - 0.03 * r);
    }
  }
  v1::ObjectiveConfig config = *DefaultConfig();
  config.mutable_head()->set_logit_softcap(5);
  auto run = [&](Place& place, const std::string& dtype)
      -> absl::StatusOr<std::vector<std::vector<double>>> {
    const std::string value_dtype = dtype == "float64" ? "float64" : "float32";
    const std::vector<int64_t> ranked = {kB, kN, kK, kTopK};
    const std::vector<int64_t> states = {kB, kN, kK, kH};
    const std::vector<int64_t> low = {kB, kN, kK, kR};
    TopKBackwardTensors t{
        place.Tensor("hidden", batch.hidden, dtype, states),
        place.Tensor("lm_head_weight", batch.weight, dtype, {kV, kH}),
        std::nullopt,
        place.Tensor("top_k", ids, "int32", ranked),
        place.Tensor("top_k_values", values, value_dtype, ranked),
        place.Tensor("grad_values", grad_values, value_dtype, ranked),
        place.Zeros("grad_hidden", dtype, states),
        place.Zeros("grad_weight", dtype, {kV, kH}),
        std::nullopt,
        place.Tensor("correction_inputs", u, dtype, low),
        place.Tensor("correction_weight", m, dtype, {kV, kR}),
        place.Zeros("grad_correction_inputs", dtype, low),
        place.Zeros("grad_correction_weight", dtype, {kV, kR})};
    ObjectiveOptions options;
    options.trainable = true;
    options.cuda_stream = place.stream();
    if (absl::Status s = RunTopKValueBackward(config, t, options); !s.ok()) {
      return s;
    }
    return std::vector<std::vector<double>>{
        place.Values(t.grad_hidden), place.Values(*t.grad_weight),
        place.Values(*t.grad_correction_inputs),
        place.Values(*t.grad_correction_weight)};
  };
  absl::StatusOr<std::vector<std::vector<double>>> got = run(gpu, "float32");
  ASSERT_TRUE(got.ok()) << got.status();
  HostPlace cpu;
  absl::StatusOr<std::vector<std::vector<double>>> want = run(cpu, "float64");
  ASSERT_TRUE(want.ok()) << want.status();
  const char* names[] = {"hidden", "weight", "correction_inputs",
                         "correction_weight"};
  for (int i = 0; i < 4; ++i) {
    double norm = 0;
    for (double x : (*want)[i]) norm += std::abs(x);
    EXPECT_GT(norm, 0) << names[i];
    EXPECT_LT(RelativeL2Error<double>((*got)[i], (*want)[i]), 1e-5)
        << names[i];
  }
}

// A float64 CUDA tensor is refused before any work, naming the argument.
TEST(CudaObjectiveRejectsTest, Float64OnCuda) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch(7);
  absl::StatusOr<Outcome> got =
      RunOn(gpu, "float64", {"dflash", false, false}, "fused", batch);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("hidden"), std::string::npos)
      << got.status();
}

// Row metadata on the device: the CUDA head builds the rows there
// (BuildCudaRows) where the binding made them on the host (RowsOf) from the
// same metadata there. The host run is the reference: the same rows give
// the same kernels the same inputs, so terms and gradients agree bit for
// bit; under head.row_selection ALL_ROWS every row is projected (rows
// without weight as zeros), so within float32 rounding.
struct MetadataCase {
  std::string ids, masks;
  bool strided = false;
  bool mask_on_host = false;  // Ids on the device, the mask on the host.
};

void PrintTo(const MetadataCase& m, std::ostream* os) {
  *os << m.ids << " " << m.masks << (m.strided ? " strided" : "")
      << (m.mask_on_host ? " mask on host" : "");
}

// `values` as a [B, N, K] tensor on `place`: contiguous, or the even
// elements of a [B, N, 2K] buffer whose odd ones are invalid (an id
// outside the vocabulary, a NaN mask), so that a read that ignores the
// strides fails.
TensorArg MetadataOn(Place& place, const char* name,
                     const std::vector<double>& values,
                     const std::string& dtype, bool strided) {
  if (!strided) return place.Tensor(name, values, dtype, {kB, kN, kK});
  const bool ids = dtype == "int32" || dtype == "int64";
  std::vector<double> padded(
      values.size() * 2,
      ids ? 1000.0 : dtype == "bool" ? 1.0 : std::nan(""));
  for (size_t i = 0; i < values.size(); ++i) padded[2 * i] = values[i];
  TensorArg arg = place.Tensor(name, padded, dtype, {kB, kN, 2 * kK});
  arg.shape = {kB, kN, kK};
  arg.strides = {kN * 2 * kK, 2 * kK, 2};
  return arg;
}

// Masks that float32 rounds (1/3) and zeros; bool masks are mask > 0.
std::vector<double> MasksOf(const Batch& batch, const std::string& dtype) {
  std::vector<double> masks = batch.mask;
  for (size_t r = 0; r < masks.size(); ++r) {
    if (masks[r] > 0 && dtype != "bool") masks[r] = (1 + r % 3) / 3.0;
  }
  return masks;
}

// A float32 `mode` training call on `gpu` for `family` with loss `loss`
// (a LossConfig in text, or empty for the family's), its metadata as `m`
// on the device, or on the host with `on_host`.
absl::StatusOr<Call> MetadataCall(DevicePlace& gpu, const Family& family,
                                  const std::string& loss,
                                  const std::string& mode, const Batch& batch,
                                  const std::vector<double>& ids,
                                  const std::vector<double>& masks,
                                  const MetadataCase& m, bool on_host,
                                  v1::HeadConfig::RowSelection selection,
                                  bool gradients = true) {
  absl::StatusOr<Call> call = Prepare(gpu, "float32", family, mode, batch,
                                      /*trainable=*/true, gradients);
  if (!call.ok()) return call.status();
  if (!loss.empty() && !google::protobuf::TextFormat::ParseFromString(
                           loss, call->config.mutable_loss())) {
    return absl::InvalidArgumentError(absl::StrCat("bad loss: ", loss));
  }
  call->config.mutable_head()->set_row_selection(selection);
  Place& ids_place = on_host ? static_cast<Place&>(*call->host) : gpu;
  Place& mask_place =
      on_host || m.mask_on_host ? static_cast<Place&>(*call->host) : gpu;
  call->tensors.target_ids =
      MetadataOn(ids_place, "target_ids", ids, m.ids, m.strided);
  call->tensors.weight_mask =
      MetadataOn(mask_place, "weight_mask", masks, m.masks, m.strided);
  return call;
}

struct MetadataOutcome {
  HeadResult head;
  std::vector<double> grad_hidden, grad_weight, grad_confidence, neg_log_q,
      argmax;
};

absl::StatusOr<MetadataOutcome> RunMetadataCall(DevicePlace& gpu, Call& call) {
  absl::StatusOr<HeadResult> head =
      RunObjective(call.config, call.tensors, call.outputs, call.options);
  if (!head.ok()) return head.status();
  const ObjectiveOutputs& o = call.outputs;
  MetadataOutcome out{*std::move(head)};
  out.grad_hidden = gpu.Values(*o.grad_hidden);
  out.grad_weight = gpu.Values(*o.grad_weight);
  if (o.grad_confidence.has_value()) {
    out.grad_confidence = gpu.Values(*o.grad_confidence);
  }
  out.neg_log_q = gpu.Values(*o.neg_log_q);
  out.argmax = gpu.Values(*o.argmax);
  return out;
}

struct MetadataLoss {
  const char* name;
  Family family;
  std::string loss;  // Text LossConfig; empty: the family's.
};

std::vector<MetadataLoss> MetadataLosses() {
  return {{"dflash", {"dflash", false, false}, ""},
          {"dspark", {"dspark", true, true}, ""},
          {"dpace_balanced",
           {"dflash", false, false},
           "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }"}};
}

std::vector<MetadataCase> MetadataCases() {
  return {{"int64", "float32", false, false},
          {"int32", "float64", true, false},
          {"int64", "bool", true, false},
          {"int32", "float32", false, true}};
}

double MaxRelative(const std::vector<double>& got,
                   const std::vector<double>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]) /
                                std::max(1.0, std::abs(want[i])));
  }
  return worst;
}

TEST(CudaDeviceMetadataTest, EqualsHostMetadata) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch(7);
  for (const MetadataLoss& l : MetadataLosses()) {
    for (const MetadataCase& m : MetadataCases()) {
      SCOPED_TRACE(absl::StrCat(l.name, " ", ::testing::PrintToString(m)));
      const std::vector<double> masks = MasksOf(batch, m.masks);
      absl::StatusOr<Call> host =
          MetadataCall(gpu, l.family, l.loss, "checkpoint", batch, batch.ids,
                       masks, m, /*on_host=*/true, v1::HeadConfig::COMPACT);
      ASSERT_TRUE(host.ok()) << host.status();
      absl::StatusOr<MetadataOutcome> want = RunMetadataCall(gpu, *host);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_GT(want->head.terms.loss_den, 0);

      absl::StatusOr<Call> device =
          MetadataCall(gpu, l.family, l.loss, "checkpoint", batch, batch.ids,
                       masks, m, /*on_host=*/false, v1::HeadConfig::COMPACT);
      ASSERT_TRUE(device.ok()) << device.status();
      absl::StatusOr<MetadataOutcome> got = RunMetadataCall(gpu, *device);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->head.terms.loss_num, want->head.terms.loss_num);
      EXPECT_EQ(got->head.terms.loss_den, want->head.terms.loss_den);
      EXPECT_EQ(got->head.terms.correct, want->head.terms.correct);
      EXPECT_EQ(got->head.loss, want->head.loss);
      EXPECT_EQ(got->grad_hidden, want->grad_hidden);
      EXPECT_EQ(got->grad_weight, want->grad_weight);
      EXPECT_EQ(got->grad_confidence, want->grad_confidence);
      EXPECT_EQ(got->neg_log_q, want->neg_log_q);
      EXPECT_EQ(got->argmax, want->argmax);

      // ALL_ROWS: every row projected, the same values within rounding.
      absl::StatusOr<Call> all =
          MetadataCall(gpu, l.family, l.loss, "checkpoint", batch, batch.ids,
                       masks, m, /*on_host=*/false, v1::HeadConfig::ALL_ROWS);
      ASSERT_TRUE(all.ok()) << all.status();
      absl::StatusOr<MetadataOutcome> every = RunMetadataCall(gpu, *all);
      ASSERT_TRUE(every.ok()) << every.status();
      EXPECT_EQ(every->head.stats.projected_rows, kB * kN * kK);
      EXPECT_LT(want->head.stats.projected_rows, kB * kN * kK);
      EXPECT_NEAR(every->head.terms.loss_num, want->head.terms.loss_num,
                  1e-6 * std::max(1.0, std::abs(want->head.terms.loss_num)));
      EXPECT_EQ(every->head.terms.loss_den, want->head.terms.loss_den);
      EXPECT_NEAR(every->head.loss, want->head.loss,
                  1e-6 * std::max(1.0, std::abs(want->head.loss)));
      EXPECT_LT(MaxRelative(every->grad_hidden, want->grad_hidden), 1e-6);
      EXPECT_LT(MaxRelative(every->grad_weight, want->grad_weight), 1e-6);
      EXPECT_LT(MaxRelative(every->grad_confidence, want->grad_confidence),
                1e-6);
      EXPECT_LT(MaxRelative(every->neg_log_q, want->neg_log_q), 1e-6);

      // The split run from device metadata: the host metadata's forward
      // and backward, bit for bit.
      absl::StatusOr<Call> split_host =
          MetadataCall(gpu, l.family, l.loss, "checkpoint", batch, batch.ids,
                       masks, m, /*on_host=*/true, v1::HeadConfig::COMPACT,
                       /*gradients=*/false);
      absl::StatusOr<Call> split_device =
          MetadataCall(gpu, l.family, l.loss, "checkpoint", batch, batch.ids,
                       masks, m, /*on_host=*/false, v1::HeadConfig::COMPACT,
                       /*gradients=*/false);
      ASSERT_TRUE(split_host.ok() && split_device.ok());
      absl::StatusOr<StartedObjective> a =
          StartObjective(split_host->config, split_host->tensors,
                         split_host->outputs, split_host->options);
      ASSERT_TRUE(a.ok()) << a.status();
      absl::StatusOr<StartedObjective> b =
          StartObjective(split_device->config, split_device->tensors,
                         split_device->outputs, split_device->options);
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(b->forward.terms.loss_num, a->forward.terms.loss_num);
      EXPECT_EQ(b->forward.terms.loss_den, a->forward.terms.loss_den);
      EXPECT_EQ(b->forward.loss, a->forward.loss);
      absl::StatusOr<Gradients> ga =
          BackwardOn(gpu, *a->saved, *split_host, 1.0);
      absl::StatusOr<Gradients> gb =
          BackwardOn(gpu, *b->saved, *split_device, 1.0);
      ASSERT_TRUE(ga.ok()) << ga.status();
      ASSERT_TRUE(gb.ok()) << gb.status();
      EXPECT_EQ(gb->hidden, ga->hidden);
      EXPECT_EQ(gb->weight, ga->weight);
      EXPECT_EQ(gb->confidence, ga->confidence);
    }
  }
}

// A split state from device metadata keeps the rows built on the device
// to its backward: the forward's stats.saved_bytes is the state's
// saved_bytes, both within a lent counting allocator's live bytes (less
// each allocation's rounding up to 64 bytes), and exceed the same state
// from host metadata by the rows (B N K x 32-byte RowMeta) and their error
// word, no more: the build's tile sums are freed once it has run. The
// backward's peak_bytes (above the level before the forward) counts the
// rows too: its excess over saved_bytes is the host metadata state's.
TEST(CudaDeviceMetadataTest, SplitStateCountsItsRows) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch(7);
  const MetadataCase m{"int64", "float32", false, false};
  const Family family{"dspark", true, true};
  const std::vector<double> masks = MasksOf(batch, m.masks);
  struct Held {
    int64_t stat = 0, saved = 0, live = 0, allocations = 0, excess = 0;
  };
  auto held_by = [&](bool on_host) -> absl::StatusOr<Held> {
    absl::StatusOr<Call> call =
        MetadataCall(gpu, family, "", "checkpoint", batch, batch.ids, masks, m,
                     on_host, v1::HeadConfig::COMPACT, /*gradients=*/false);
    if (!call.ok()) return call.status();
    CountingAllocator allocator;
    SetTorchAllocator(allocator.Lent());
    absl::StatusOr<StartedObjective> started = StartObjective(
        call->config, call->tensors, call->outputs, call->options);
    SetTorchAllocator(std::nullopt);
    if (!started.ok()) return started.status();
    Held h;
    h.stat = started->forward.stats.saved_bytes;
    h.saved = started->saved->saved_bytes();
    // Less the stream state's cuBLAS workspace, kept with the state.
    EXPECT_NE(WorkspaceIn(allocator.counts->sizes), 0u);
    h.live = allocator.counts->live - WorkspaceBytes();
    h.allocations =
        static_cast<int64_t>(allocator.counts->sizes.size()) - 1;
    ObjectiveOutputs g;
    g.grad_hidden = gpu.Zeros("grad_hidden", "float32", {kB, kN, kK, kH});
    g.grad_weight = gpu.Zeros("grad_weight", "float32", {kV, kH});
    if (call->tensors.confidence_logits.has_value()) {
      g.grad_confidence =
          gpu.Zeros("grad_confidence", "float32", {kB, kN, kK});
    }
    absl::StatusOr<HeadStats> stats =
        started->saved->Backward(1.0, g, gpu.stream(), nullptr);
    if (!stats.ok()) return stats.status();
    h.excess = stats->peak_bytes - h.saved;
    return h;
  };
  absl::StatusOr<Held> host = held_by(/*on_host=*/true);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<Held> device = held_by(/*on_host=*/false);
  ASSERT_TRUE(device.ok()) << device.status();
  for (const Held* h : {&*host, &*device}) {
    EXPECT_EQ(h->stat, h->saved);
    EXPECT_LE(h->saved, h->live);
    EXPECT_GE(h->saved, h->live - 63 * h->allocations);
  }
  EXPECT_EQ(device->saved - host->saved, kB * kN * kK * 32 + 8);
  EXPECT_EQ(device->excess, host->excess);
}

// Every error RowsOf gives for host metadata, word for word, for the same
// metadata on the device: a single call, a split forward, and ALL_ROWS
// (which reads the rows back after its forward pass).
TEST(CudaDeviceMetadataTest, BadElementsGetRowsOfsMessages) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch(7);
  const double kNan = std::nan("");
  struct Bad {
    const char* what;
    std::map<int, double> ids, masks;
    const char* message;  // The start of RowsOf's message.
  };
  const std::vector<Bad> bads = {
      {"nan mask", {}, {{7, kNan}}, "weight_mask[0, 1, 3]: must be finite"},
      {"negative mask", {}, {{6, -1}}, "weight_mask[0, 1, 2]: must be finite"},
      {"inf mask", {}, {{9, INFINITY}}, "weight_mask[0, 2, 1]: must be finite"},
      {"mask sum", {}, {{2, 3e38}, {3, 3e38}},
       "weight_mask: its values sum to more than float32 holds"},
      {"target >= V", {{7, kV}}, {}, "target_ids[0, 1, 3]: must lie in [0, V"},
      {"negative target", {{10, -3}}, {},
       "target_ids[0, 2, 2]: must lie in [0, V"},
      // The first bad element wins, whichever tensor it is in.
      {"first wins", {{2, kV + 4}}, {{9, kNan}},
       "target_ids[0, 0, 2]: must lie in [0, V"},
      {"mask before target", {{7, kV}}, {{7, -2}},
       "weight_mask[0, 1, 3]: must be finite"},
  };
  const Family dflash{"dflash", false, false};
  for (const MetadataCase& m :
       {MetadataCase{"int64", "float64", false, false},
        MetadataCase{"int32", "float64", true, false}}) {
    for (const Bad& bad : bads) {
      SCOPED_TRACE(absl::StrCat(bad.what, " ", ::testing::PrintToString(m)));
      std::vector<double> ids = batch.ids, masks = MasksOf(batch, m.masks);
      for (const auto& [at, id] : bad.ids) ids[at] = id;
      for (const auto& [at, mask] : bad.masks) masks[at] = mask;
      absl::StatusOr<Call> host =
          MetadataCall(gpu, dflash, "", "checkpoint", batch, ids, masks, m,
                       /*on_host=*/true, v1::HeadConfig::COMPACT);
      ASSERT_TRUE(host.ok()) << host.status();
      const absl::Status want =
          RunObjective(host->config, host->tensors, host->outputs,
                       host->options)
              .status();
      ASSERT_EQ(want.code(), absl::StatusCode::kInvalidArgument) << want;
      EXPECT_THAT(std::string(want.message()),
                  ::testing::StartsWith(bad.message));
      for (const auto selection :
           {v1::HeadConfig::COMPACT, v1::HeadConfig::ALL_ROWS}) {
        absl::StatusOr<Call> device =
            MetadataCall(gpu, dflash, "", "checkpoint", batch, ids, masks, m,
                         /*on_host=*/false, selection);
        ASSERT_TRUE(device.ok()) << device.status();
        EXPECT_EQ(RunObjective(device->config, device->tensors,
                               device->outputs, device->options)
                      .status(),
                  want);
        absl::StatusOr<Call> split =
            MetadataCall(gpu, dflash, "", "checkpoint", batch, ids, masks, m,
                         /*on_host=*/false, selection, /*gradients=*/false);
        ASSERT_TRUE(split.ok()) << split.status();
        EXPECT_EQ(StartObjective(split->config, split->tensors, split->outputs,
                                 split->options)
                      .status(),
                  want);
      }
    }
  }
}


// head.device_results through the binding: a run captured in a CUDA graph
// on the caller's stream with a lent allocator, as torch.cuda.graph
// captures a training step. The allocator serves a capture as torch's
// caching allocator does, stream-ordered (cudaMallocAsync and
// cudaFreeAsync on the stream it is asked for), and counts what it serves.
struct StreamOrderedAllocator {
  struct Counts {
    int64_t live = 0, calls = 0;
    std::map<uintptr_t, std::pair<int64_t, uintptr_t>> blocks;
    std::vector<uintptr_t> streams;
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();

  TorchAllocator Lent() const {
    TorchAllocator lent;
    lent.allocate = [counts = counts](int64_t bytes, int device,
                                      uintptr_t stream)
        -> absl::StatusOr<uintptr_t> {
      EXPECT_EQ(device, 0);
      void* p = nullptr;
      if (cudaMallocAsync(&p, bytes, reinterpret_cast<cudaStream_t>(
                                         stream)) != cudaSuccess) {
        return absl::ResourceExhaustedError("test allocator: full");
      }
      counts->live += bytes;
      ++counts->calls;
      counts->streams.push_back(stream);
      counts->blocks[reinterpret_cast<uintptr_t>(p)] = {bytes, stream};
      return reinterpret_cast<uintptr_t>(p);
    };
    lent.free = [counts = counts](uintptr_t data) {
      const auto [bytes, stream] = counts->blocks.at(data);
      counts->live -= bytes;
      counts->blocks.erase(data);
      EXPECT_EQ(cudaFreeAsync(reinterpret_cast<void*>(data),
                              reinterpret_cast<cudaStream_t>(stream)),
                cudaSuccess);
    };
    return lent;
  }
};

// A float32 training call on `gpu` with its metadata there and
// row_selection ALL_ROWS; with `device`, head.device_results and its
// buffer.
absl::StatusOr<Call> DeviceResultsCall(DevicePlace& gpu, const Family& family,
                                       const std::string& mode,
                                       const Batch& batch, bool device,
                                       bool gradients) {
  absl::StatusOr<Call> call = Prepare(gpu, "float32", family, mode, batch,
                                      /*trainable=*/true, gradients);
  if (!call.ok()) return call.status();
  call->config.mutable_head()->set_row_selection(v1::HeadConfig::ALL_ROWS);
  call->config.mutable_head()->set_device_results(device);
  call->tensors.target_ids =
      gpu.Tensor("target_ids", batch.ids, "int64", {kB, kN, kK});
  call->tensors.weight_mask =
      gpu.Tensor("weight_mask", batch.mask, "float32", {kB, kN, kK});
  if (device) {
    call->options.device_results =
        gpu.Zeros("device_results", "float64", {DeviceResultsSize(kK)});
  }
  return call;
}

// `batch`'s hidden states and labels into `call`'s buffers.
void Reload(DevicePlace& gpu, const Call& call, const Batch& batch) {
  gpu.Overwrite(call.tensors.hidden, batch.hidden);
  gpu.Overwrite(call.tensors.target_ids, batch.ids);
  gpu.Overwrite(call.tensors.weight_mask, batch.mask);
  if (call.tensors.teacher_hidden.has_value()) {
    gpu.Overwrite(*call.tensors.teacher_hidden, batch.teacher);
  }
  if (call.tensors.confidence_logits.has_value()) {
    gpu.Overwrite(*call.tensors.confidence_logits, batch.confidence);
  }
}

void ExpectResultsMatch(const std::vector<double>& results,
                        const HeadResult& want) {
  auto near = [](double got, double expected, const char* what) {
    EXPECT_LE(std::abs(got - expected), 1e-9 * (1 + std::abs(expected)))
        << what << ": " << got << " vs " << expected;
  };
  near(results[kResultLoss], want.loss, "loss");
  near(results[kResultDenominator], want.loss_denominator, "denominator");
  near(results[kResultAccuracy], want.accuracy, "accuracy");
  near(results[DeviceSummedResult(kSummedLossNum)], want.terms.loss_num,
       "loss_num");
  near(results[DeviceSummedResult(kSummedLossDen)], want.terms.loss_den,
       "loss_den");
  int block = 0;
#define DFLASH_BLOCK_TERM(field, dict, key)                                \
  near(results[DeviceBlockResult(block++, kK)],                            \
       want.terms.accepted_length.field, key);
#include "losses/chunk_terms.inc"
  for (int64_t k = 0; k < kK; ++k) {
    near(results[DevicePositionResult(1, k, kK)],
         want.terms.mask_per_position[k], "mask_per_position");
  }
}

// The whole call captured (a single run; a split run's forward, its
// backward with the upstream on the device, and the state freed), then
// launched with new inputs against the synchronous call; every byte the
// capture allocates is the lent allocator's, on the caller's stream, and
// handed back within it. A bad label latches RowsOf's own error.
TEST(CudaDeviceResultsObjectiveTest, CapturedCallsEqualTheSynchronousCalls) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(gpu.stream());
  StreamOrderedAllocator lent;
  SetTorchAllocator(lent.Lent());
  struct Captured {
    Family family;
    const char* mode;
    bool split;
  };
  for (const Captured& c :
       {Captured{{"dflash", false, false}, "fused", false},
        Captured{{"dspark", true, true}, "checkpoint", true}}) {
    SCOPED_TRACE(absl::StrCat(c.family.loss, " ", c.mode));
    const Batch first(3);
    absl::StatusOr<Call> call = DeviceResultsCall(
        gpu, c.family, c.mode, first, /*device=*/true, !c.split);
    ASSERT_TRUE(call.ok()) << call.status();
    absl::StatusOr<Call> reference = DeviceResultsCall(
        gpu, c.family, c.mode, first, /*device=*/false, !c.split);
    ASSERT_TRUE(reference.ok()) << reference.status();
    const TensorArg upstream = gpu.Tensor("upstream", {0.75}, "float32", {1});
    ObjectiveOutputs grads;
    grads.grad_hidden = gpu.Zeros("grad_hidden", "float32", {kB, kN, kK, kH});
    grads.grad_weight = gpu.Zeros("grad_weight", "float32", {kV, kH});
    if (c.family.confidence) {
      grads.grad_confidence =
          gpu.Zeros("grad_confidence", "float32", {kB, kN, kK});
    }
    const ObjectiveOutputs& run_grads = c.split ? grads : call->outputs;
    auto enqueue = [&]() -> absl::Status {
      if (!c.split) {
        absl::StatusOr<HeadResult> run = RunObjective(
            call->config, call->tensors, call->outputs, call->options);
        if (run.ok() && !std::isnan(run->loss)) {
          return absl::InternalError("the host's loss should be NaN");
        }
        return run.status();
      }
      absl::StatusOr<StartedObjective> started = StartObjective(
          call->config, call->tensors, call->outputs, call->options);
      if (!started.ok()) return started.status();
      return started->saved
          ->BackwardFromDevice(upstream, /*of_loss_num=*/true, grads,
                               gpu.stream(), nullptr)
          .status();
    };
    // Uncaptured first: the stream's state (its cuBLAS handle and the
    // handle's workspace, from the lent allocator on this stream) is made.
    ASSERT_TRUE(enqueue().ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::map<uintptr_t, int64_t> live_sizes;
    for (const auto& [data, block] : lent.counts->blocks) {
      live_sizes[data] = block.first;
      EXPECT_EQ(block.second, gpu.stream());
    }
    // The workspace is all that is left live by the uncaptured call.
    ASSERT_NE(WorkspaceIn(live_sizes), 0u);
    EXPECT_EQ(lent.counts->live, WorkspaceBytes());
    const int64_t live = lent.counts->live, calls = lent.counts->calls;
    const size_t streams = lent.counts->streams.size();
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
              cudaSuccess);
    const absl::Status captured = enqueue();
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    ASSERT_TRUE(captured.ok()) << captured;
    ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorString(ended);
    EXPECT_GT(lent.counts->calls, calls);
    EXPECT_EQ(lent.counts->live, live);
    for (size_t i = streams; i < lent.counts->streams.size(); ++i) {
      EXPECT_EQ(lent.counts->streams[i], gpu.stream());
    }
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (uint32_t seed : {11u, 12u}) {
      SCOPED_TRACE(seed);
      const Batch batch(seed);
      Reload(gpu, *call, batch);
      gpu.Overwrite(upstream, {0.5 + seed % 3});
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      EXPECT_TRUE(CheckObjectiveResults(call->config, call->tensors,
                                        *call->options.device_results,
                                        gpu.stream())
                      .ok());
      const std::vector<double> results =
          gpu.Values(*call->options.device_results);
      Reload(gpu, *reference, batch);
      HeadResult want;
      ObjectiveOutputs want_grads = reference->outputs;
      if (!c.split) {
        absl::StatusOr<HeadResult> run =
            RunObjective(reference->config, reference->tensors,
                         reference->outputs, reference->options);
        ASSERT_TRUE(run.ok()) << run.status();
        want = *run;
      } else {
        absl::StatusOr<StartedObjective> started =
            StartObjective(reference->config, reference->tensors,
                           reference->outputs, reference->options);
        ASSERT_TRUE(started.ok()) << started.status();
        want = started->forward;
        want_grads.grad_hidden =
            gpu.Zeros("grad_hidden", "float32", {kB, kN, kK, kH});
        want_grads.grad_weight = gpu.Zeros("grad_weight", "float32", {kV, kH});
        if (c.family.confidence) {
          want_grads.grad_confidence =
              gpu.Zeros("grad_confidence", "float32", {kB, kN, kK});
        }
        ASSERT_TRUE(started->saved
                        ->Backward((0.5 + seed % 3) * want.loss_denominator,
                                   want_grads, gpu.stream(), nullptr)
                        .ok());
      }
      ExpectResultsMatch(results, want);
      EXPECT_LT(MaxRelative(gpu.Values(*run_grads.grad_hidden),
                            gpu.Values(*want_grads.grad_hidden)),
                1e-6);
      EXPECT_LT(MaxRelative(gpu.Values(*run_grads.grad_weight),
                            gpu.Values(*want_grads.grad_weight)),
                1e-6);
      if (c.family.confidence) {
        EXPECT_LT(MaxRelative(gpu.Values(*run_grads.grad_confidence),
                              gpu.Values(*want_grads.grad_confidence)),
                  1e-6);
      }
    }
    if (!c.split) {
      // A weighted target outside [0, V): NaN terms, and the synchronous
      // call's ValueError text (RowsOf's, from the metadata) on request.
      Batch bad(13);
      bad.ids[6] = kV;
      bad.mask[6] = 1;
      Reload(gpu, *call, bad);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      const absl::Status got = CheckObjectiveResults(
          call->config, call->tensors, *call->options.device_results,
          gpu.stream());
      Reload(gpu, *reference, bad);
      const absl::StatusOr<HeadResult> want = RunObjective(
          reference->config, reference->tensors, reference->outputs,
          reference->options);
      ASSERT_FALSE(want.ok());
      EXPECT_EQ(got, want.status());
      EXPECT_THAT(std::string(got.message()),
                  ::testing::HasSubstr("target_ids"));
      EXPECT_TRUE(
          std::isnan(gpu.Values(*call->options.device_results)[kResultLoss]));
      // A NaN hidden state in a weighted row: the synchronous call's
      // ExplainFailure text, naming the element.
      Batch nan(14);
      nan.mask[9] = 1;
      nan.hidden[9 * kH + 2] = std::nan("");
      Reload(gpu, *call, nan);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      const absl::Status got_nan = CheckObjectiveResults(
          call->config, call->tensors, *call->options.device_results,
          gpu.stream());
      Reload(gpu, *reference, nan);
      const absl::StatusOr<HeadResult> want_nan = RunObjective(
          reference->config, reference->tensors, reference->outputs,
          reference->options);
      ASSERT_FALSE(want_nan.ok());
      EXPECT_EQ(got_nan, want_nan.status());
      EXPECT_THAT(std::string(got_nan.message()),
                  ::testing::HasSubstr("hidden[0, 2, 1, 2]: must be finite"));
      for (double g : gpu.Values(*call->outputs.grad_hidden)) {
        ASSERT_TRUE(std::isnan(g));
      }
    }
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  SetTorchAllocator(std::nullopt);
  // The stream's state went with the lending, its workspace with it.
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(lent.counts->live, 0);
}

// A stream's state gives its cuBLAS handle a workspace from the lent
// allocator, of PyTorch's size: the products write there (the emulation's
// GEMM overwrites the head of a caller's workspace, as cuBLAS may), it is
// live while a split run keeps the state after the lending ends, and it
// goes back with the state.
TEST(CudaStreamStateTest, ItsCublasHandleHasAWorkspaceFromTheAllocator) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Case c{{"dflash", false, false}, "float32", "checkpoint"};
  CountingAllocator lent;
  const std::shared_ptr<CountingAllocator::Counts> counts = lent.counts;
  SetTorchAllocator(lent.Lent());
  absl::StatusOr<Split> split = StartOn(gpu, c, Batch(7));
  SetTorchAllocator(std::nullopt);
  ASSERT_TRUE(split.ok()) << split.status();
  const uintptr_t workspace = WorkspaceIn(counts->sizes);
  ASSERT_NE(workspace, 0u);
  // Cleared, then the backward's products run on the state's handle.
  constexpr int64_t kHead = 256;
  void* const at = reinterpret_cast<void*>(workspace);
  ASSERT_EQ(cudaMemsetAsync(at, 0, kHead,
                            reinterpret_cast<cudaStream_t>(gpu.stream())),
            cudaSuccess);
  absl::StatusOr<Gradients> gradients =
      BackwardOn(gpu, *split->started.saved, split->call, 1.0);
  ASSERT_TRUE(gradients.ok()) << gradients.status();
  std::vector<unsigned char> head(kHead);
  ASSERT_EQ(cudaMemcpyAsync(head.data(), at, kHead, cudaMemcpyDeviceToHost,
                            reinterpret_cast<cudaStream_t>(gpu.stream())),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(gpu.stream())),
            cudaSuccess);
  EXPECT_NE(head, std::vector<unsigned char>(kHead, 0))
      << "no product wrote the workspace the state allocated";
  EXPECT_EQ(counts->sizes.count(workspace), 1u);  // Live with the state.
  split->started.saved.reset();
  EXPECT_EQ(counts->sizes.count(workspace), 0u);
  EXPECT_EQ(counts->live, 0);
}

// The first call on a stream makes its state (cuBLAS handle, workspace),
// which a capture cannot hold: made while the stream captures, it is
// refused by name, nothing queued or allocated, and the capture ends
// cleanly. Run uncaptured, the same call goes.
TEST(CudaStreamStateTest, AFirstCallInACaptureIsRefused) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(gpu.stream());
  absl::StatusOr<Call> call =
      DeviceResultsCall(gpu, {"dflash", false, false}, "fused", Batch(3),
                        /*device=*/true, /*gradients=*/true);
  ASSERT_TRUE(call.ok()) << call.status();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  StreamOrderedAllocator lent;
  SetTorchAllocator(lent.Lent());
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  const absl::StatusOr<HeadResult> refused = RunObjective(
      call->config, call->tensors, call->outputs, call->options);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      std::string(refused.status().message()),
      ::testing::AllOf(
          ::testing::HasSubstr(absl::StrFormat("CUDA stream 0x%x on device 0",
                                               gpu.stream())),
          ::testing::HasSubstr("the first call on a stream must run "
                               "uncaptured"),
          ::testing::HasSubstr("run one call on this stream before "
                               "capturing (a warm-up on the stream the "
                               "graph captures on")));
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorString(ended);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(lent.counts->calls, 0);
  const absl::StatusOr<HeadResult> warm = RunObjective(
      call->config, call->tensors, call->outputs, call->options);
  EXPECT_TRUE(warm.ok()) << warm.status();
  SetTorchAllocator(std::nullopt);
}

// The binding's refusals: the buffer without the field and the field
// without the buffer, a wrong buffer, a tensor upstream for a state
// without device results.
TEST(CudaDeviceResultsObjectiveTest, Refusals) {
  DevicePlace gpu;
  DFLASH_SKIP_WITHOUT_GPU(gpu.Open());
  const Batch batch(3);
  const Family dflash{"dflash", false, false};
  absl::StatusOr<Call> call =
      DeviceResultsCall(gpu, dflash, "fused", batch, /*device=*/true, true);
  ASSERT_TRUE(call.ok()) << call.status();
  Call missing = *std::move(call);
  const TensorArg buffer = *missing.options.device_results;
  missing.options.device_results.reset();
  absl::StatusOr<HeadResult> run = RunObjective(
      missing.config, missing.tensors, missing.outputs, missing.options);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(run.status().message()),
              ::testing::HasSubstr("device_results: head.device_results is set"));
  missing.options.device_results =
      gpu.Zeros("device_results", "float32", {DeviceResultsSize(kK)});
  run = RunObjective(missing.config, missing.tensors, missing.outputs,
                     missing.options);
  EXPECT_THAT(std::string(run.status().message()),
              ::testing::HasSubstr("must be a contiguous float64 tensor"));
  missing.config.mutable_head()->set_device_results(false);
  missing.options.device_results = buffer;
  run = RunObjective(missing.config, missing.tensors, missing.outputs,
                     missing.options);
  EXPECT_THAT(std::string(run.status().message()),
              ::testing::HasSubstr("head.device_results is not set"));
  // Labels on the host: their rows would be copied from pageable memory,
  // which a capture cannot hold.
  missing.config.mutable_head()->set_device_results(true);
  missing.tensors.target_ids =
      missing.host->Tensor("target_ids", batch.ids, "int64", {kB, kN, kK});
  run = RunObjective(missing.config, missing.tensors, missing.outputs,
                     missing.options);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run.status().message(),
            "device_results: needs target_ids and weight_mask on hidden's "
            "device (cuda:0), got target_ids on cpu and weight_mask on cuda:0 "
            "(host labels are copied from pageable memory, which a CUDA graph "
            "cannot capture)");
  missing.tensors.weight_mask =
      missing.host->Tensor("weight_mask", batch.mask, "float32", {kB, kN, kK});
  run = RunObjective(missing.config, missing.tensors, missing.outputs,
                     missing.options);
  EXPECT_THAT(std::string(run.status().message()),
              ::testing::HasSubstr("got target_ids on cpu and weight_mask on "
                                   "cpu"));
  absl::StatusOr<Call> split =
      DeviceResultsCall(gpu, dflash, "checkpoint", batch, /*device=*/false,
                        /*gradients=*/false);
  ASSERT_TRUE(split.ok()) << split.status();
  absl::StatusOr<StartedObjective> started = StartObjective(
      split->config, split->tensors, split->outputs, split->options);
  ASSERT_TRUE(started.ok()) << started.status();
  ObjectiveOutputs grads;
  grads.grad_hidden = gpu.Zeros("grad_hidden", "float32", {kB, kN, kK, kH});
  grads.grad_weight = gpu.Zeros("grad_weight", "float32", {kV, kH});
  const TensorArg upstream = gpu.Tensor("upstream", {1.0}, "float32", {1});
  const absl::Status refused =
      started->saved
          ->BackwardFromDevice(upstream, true, grads, gpu.stream(), nullptr)
          .status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("needs head.device_results"));
}

}  // namespace
}  // namespace dflash::python
