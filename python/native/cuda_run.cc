// The CUDA entry point: RunCudaHead ordered on torch's current stream.
#include "python/native/cuda_run.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/bfloat16.h"
#include "base/cublas_library.h"
#include "base/cuda_stream.h"
#include "base/status_macros.h"
#include "base/tracking_allocator.h"
#include "heads/cuda_head.h"
#include "heads/cuda_projection.h"
#include "losses/device_results.h"

namespace dflash::python {
namespace {

absl::Status Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// What a device keeps between calls: the head's stream, its cuBLAS handle
// (milliseconds to create) with a workspace of its own (so that cuBLAS
// never allocates during a capture), and the two events that order it on
// torch's stream (made when first needed). `mu` serialises the calls on the
// stream; `owner` is the thread holding it for a run (OrderedOn), and
// `deferred` the split runs destroyed on that thread meanwhile: the lent
// allocator's callbacks run Python there, whose garbage collector may free
// a split state on this stream, and that state's destructor cannot take
// `mu` again. The run frees them once its work is done.
struct DeviceState {
  ~DeviceState() {
    for (cudaEvent_t event : {after_torch, after_head}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
  std::mutex mu;
  // Declared in this order so that the handle goes first, then the
  // workspace it uses, then the stream whose allocator served it.
  std::unique_ptr<CudaStream> stream;
  TrackedBuffer<uint8_t> workspace;
  std::unique_ptr<CublasHandle> blas;
  cudaEvent_t after_torch = nullptr;
  cudaEvent_t after_head = nullptr;
  std::atomic<std::thread::id> owner{};
  std::vector<std::shared_ptr<void>> deferred;
};

// The cuBLAS workspace of a handle on `device`, sized as PyTorch sizes its
// own (cuBLAS's recommendation): 32 MiB from compute capability 9 (Hopper),
// else 4 MiB.
absl::StatusOr<int64_t> CublasWorkspaceBytes(int device) {
  cudaDeviceProp properties;
  DFLASH_RETURN_IF_ERROR(Check(cudaGetDeviceProperties(&properties, device),
                               "cudaGetDeviceProperties"));
  return properties.major >= 9 ? int64_t{32} << 20 : int64_t{4} << 20;
}

// `state`'s cuBLAS handle on its stream, with a workspace from the stream's
// allocator (torch's when lent) that lives as long as the handle: without
// one cuBLAS would take its own from cudaMalloc on a product's first use,
// which a capture cannot hold.
absl::Status MakeHandle(DeviceState& state, int device) {
  DFLASH_ASSIGN_OR_RETURN(const int64_t bytes, CublasWorkspaceBytes(device));
  DFLASH_ASSIGN_OR_RETURN(
      state.workspace,
      TrackedBuffer<uint8_t>::Create(state.stream->allocator(), bytes));
  DFLASH_ASSIGN_OR_RETURN(state.blas, CublasHandle::Create(*state.stream));
  return state.blas->SetWorkspace(state.workspace.data(), bytes);
}

// FailedPrecondition where torch's `stream` is capturing a CUDA graph: a
// first call on it would make its state (cudaStreamCreate, cublasCreate,
// the workspace's allocation) inside the capture, which breaks it with a
// CUDA error naming none of this.
absl::Status RefuseFirstCallInCapture(int device, uintptr_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t error =
      cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status);
  if (error != cudaSuccess) {
    // Not left for the run's next cudaGetLastError to report as its own.
    cudaGetLastError();
    // The legacy default stream while a blocking stream captures.
    if (error != cudaErrorStreamCaptureImplicit) {
      return Check(error, "cudaStreamIsCapturing");
    }
  } else if (status == cudaStreamCaptureStatusNone) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "CUDA stream 0x%x on device %d: the first call on a stream must run "
      "uncaptured, but this one came while a CUDA graph is being captured "
      "(it makes the stream's cuBLAS handle and workspace, which cannot be "
      "captured); run one call on this stream before capturing (a warm-up "
      "on the stream the graph captures on: with torch.cuda.graph, pass "
      "the warm-up's stream as its stream=)",
      stream, device));
}

// The state of the current device's own stream, made on first use (not
// while torch's `stream` captures). Lives until exit: torch's CUDA context
// outlives any Python object.
absl::StatusOr<std::shared_ptr<DeviceState>> StateOf(int device,
                                                     uintptr_t stream) {
  static std::mutex mu;
  static auto& states = *new std::map<int, std::shared_ptr<DeviceState>>();
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<DeviceState>& state = states[device];
  if (state != nullptr) return state;
  DFLASH_RETURN_IF_ERROR(RefuseFirstCallInCapture(device, stream));
  auto created = std::make_shared<DeviceState>();
  DFLASH_ASSIGN_OR_RETURN(created->stream, CudaStream::Create());
  DFLASH_RETURN_IF_ERROR(MakeHandle(*created, device));
  state = std::move(created);
  return state;
}

// The allocator SetTorchAllocator lent, and the states of the torch streams
// runs were queued on with it (keyed by device and stream; dropped when the
// allocator changes, each kept alive by the runs using it). `lent` counts
// the allocators set, so that a state made with one is not kept for the
// next.
struct Lent {
  std::mutex mu;
  std::optional<TorchAllocator> allocator;
  uint64_t lent = 0;
  std::map<std::pair<int, uintptr_t>, std::shared_ptr<DeviceState>> states;
};

Lent& LentAllocator() {
  static auto& lent = *new Lent();
  return lent;
}

// The state over torch's `stream` on `device` with the lent allocator, or
// null when none is lent. A new one is made without `lent.mu` held: its
// workspace comes from the lent allocator, whose callbacks take the GIL,
// which a thread setting the allocator holds while it waits for `lent.mu`.
absl::StatusOr<std::shared_ptr<DeviceState>> TorchStreamState(
    int device, uintptr_t stream) {
  Lent& lent = LentAllocator();
  std::optional<TorchAllocator> lent_allocator;
  uint64_t lent_count = 0;
  {
    std::lock_guard<std::mutex> lock(lent.mu);
    if (!lent.allocator.has_value()) return std::shared_ptr<DeviceState>();
    const auto found = lent.states.find({device, stream});
    if (found != lent.states.end()) return found->second;
    lent_allocator = lent.allocator;
    lent_count = lent.lent;
  }
  DFLASH_RETURN_IF_ERROR(RefuseFirstCallInCapture(device, stream));
  const TorchAllocator allocator = *std::move(lent_allocator);
  DeviceAllocatorHook hook;
  hook.allocate = [allocator, device](int64_t bytes, CUstream_st* on)
      -> absl::StatusOr<void*> {
    DFLASH_ASSIGN_OR_RETURN(
        const uintptr_t data,
        allocator.allocate(bytes, device, reinterpret_cast<uintptr_t>(on)));
    return reinterpret_cast<void*>(data);
  };
  hook.free = [allocator](void* data, CUstream_st*) {
    allocator.free(reinterpret_cast<uintptr_t>(data));
  };
  auto created = std::make_shared<DeviceState>();
  DFLASH_ASSIGN_OR_RETURN(
      created->stream,
      CudaStream::Wrap(reinterpret_cast<CUstream_st*>(stream), &hook));
  DFLASH_RETURN_IF_ERROR(MakeHandle(*created, device));
  std::shared_ptr<DeviceState> state = created;
  {
    std::lock_guard<std::mutex> lock(lent.mu);
    // Kept for the stream's next calls unless another thread made one
    // meanwhile (that one is used; this one is freed below, the lock let
    // go) or the allocator changed (this one serves this call alone).
    if (lent.lent == lent_count) {
      state = lent.states.try_emplace({device, stream}, created).first->second;
    }
  }
  return state;
}

// Makes `device` current for the scope and restores the caller's after:
// torch tracks its own current device.
class DeviceScope {
 public:
  absl::Status Enter(int device) {
    DFLASH_RETURN_IF_ERROR(Check(cudaGetDevice(&previous_), "cudaGetDevice"));
    entered_ = true;
    return Check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    if (entered_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool entered_ = false;
};

// The state a run on torch's `stream` goes on: the lent allocator's over
// that stream, else the device's own.
absl::StatusOr<std::shared_ptr<DeviceState>> StateFor(int device,
                                                      uintptr_t stream) {
  DFLASH_ASSIGN_OR_RETURN(std::shared_ptr<DeviceState> on_torch,
                          TorchStreamState(device, stream));
  if (on_torch != nullptr) return on_torch;
  return StateOf(device, stream);
}

// `state.mu` held by this thread for a run (OrderedOn): frees the split
// runs deferred meanwhile (freeing one may defer more) when it ends.
class OwnedLock {
 public:
  explicit OwnedLock(DeviceState& state) : state_(state), lock_(state.mu) {
    state_.owner.store(std::this_thread::get_id());
  }
  ~OwnedLock() {
    while (!state_.deferred.empty()) {
      std::vector<std::shared_ptr<void>> freed = std::move(state_.deferred);
      state_.deferred.clear();
    }
    state_.owner.store(std::thread::id());
  }
  OwnedLock(const OwnedLock&) = delete;
  OwnedLock& operator=(const OwnedLock&) = delete;

 private:
  DeviceState& state_;
  std::lock_guard<std::mutex> lock_;
};

// Runs `work(state)` under the state's lock, after the work queued on
// torch's `stream` and before the work queued on it next: directly where
// the state is over that stream itself (ordered with torch's work as its
// own ops are), else between two events.
template <typename Work>
auto OrderedOn(DeviceState& state, uintptr_t stream, Work work)
    -> decltype(work(state)) {
  OwnedLock lock(state);
  const cudaStream_t torch_stream = reinterpret_cast<cudaStream_t>(stream);
  const cudaStream_t head_stream = state.stream->stream();
  if (head_stream == torch_stream) return work(state);
  for (cudaEvent_t* event : {&state.after_torch, &state.after_head}) {
    if (*event != nullptr) continue;
    DFLASH_RETURN_IF_ERROR(
        Check(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
              "cudaEventCreateWithFlags"));
  }
  DFLASH_RETURN_IF_ERROR(
      Check(cudaEventRecord(state.after_torch, torch_stream),
            "cudaEventRecord on torch's stream"));
  DFLASH_RETURN_IF_ERROR(
      Check(cudaStreamWaitEvent(head_stream, state.after_torch, 0),
            "cudaStreamWaitEvent"));
  auto result = work(state);
  // Also after a failure: torch must not reuse memory the head may still
  // be writing.
  absl::Status ordered = Check(cudaEventRecord(state.after_head, head_stream),
                               "cudaEventRecord on the head's stream");
  if (ordered.ok()) {
    ordered = Check(cudaStreamWaitEvent(torch_stream, state.after_head, 0),
                    "cudaStreamWaitEvent");
  }
  if (!result.ok()) return result;
  if (!ordered.ok()) return ordered;
  return result;
}

// Runs `work(state)` on `device` with the state StateFor chooses, ordered
// on torch's `stream` (OrderedOn).
template <typename Work>
auto OnHeadStream(int device, uintptr_t stream, Work work)
    -> decltype(work(std::declval<DeviceState&>())) {
  DeviceScope scope;
  DFLASH_RETURN_IF_ERROR(scope.Enter(device));
  DFLASH_ASSIGN_OR_RETURN(const std::shared_ptr<DeviceState> state,
                          StateFor(device, stream));
  return OrderedOn(*state, stream, work);
}

cuda::RowsTensor RowsTensorOf(const DeviceMetadataTensor& t) {
  cuda::RowsTensor out;
  out.data = reinterpret_cast<const void*>(t.data);
  out.dtype = t.dtype == "int32"     ? cuda::kRowsInt32
              : t.dtype == "int64"   ? cuda::kRowsInt64
              : t.dtype == "float32" ? cuda::kRowsFloat32
              : t.dtype == "float64" ? cuda::kRowsFloat64
                                     : cuda::kRowsBool;
  std::copy_n(t.strides, 3, out.strides);
  return out;
}

// The rows of `metadata` made on `stream` (BuildCudaRows), queued, no wait.
absl::StatusOr<CudaRows> BuildRows(const v1::ObjectiveConfig& config,
                                   const DeviceMetadata& metadata,
                                   CudaStream& stream) {
  return BuildCudaRows(config, RowsTensorOf(metadata.target_ids),
                       RowsTensorOf(metadata.weight_mask), metadata.batch,
                       metadata.anchors, stream);
}

// StartOnTorchStream's run: the split run and the state (stream, cuBLAS
// handle, allocator) it borrows, kept alive with it.
template <typename T>
class SplitOnStream : public TorchStreamRun<T> {
 public:
  SplitOnStream(int device, std::shared_ptr<DeviceState> state)
      : device_(device), state_(std::move(state)) {}
  ~SplitOnStream() override {
    DeviceScope scope;
    if (!scope.Enter(device_).ok()) {
      // The memory cannot be freed on its device: left to the context.
      (void)held_.release();
      return;
    }
    if (held_ != nullptr) {
      if (state_->owner.load() == std::this_thread::get_id()) {
        // Destroyed inside a run on this stream (its lent allocator's
        // callback): that run frees it when done. Its destructor reads
        // nothing it borrows.
        state_->deferred.push_back(std::shared_ptr<void>(std::move(held_)));
      } else {
        std::lock_guard<std::mutex> lock(state_->mu);
        held_.reset();
      }
    }
    // Possibly the state's last reference: its stream and events go on
    // their device.
    state_.reset();
  }

  // The forward pass on torch's `stream`.
  absl::Status Start(const v1::ObjectiveConfig& config,
                     const HeadInputs<T>& inputs,
                     const HeadRowOutputs& row_outputs, uintptr_t stream,
                     const HeadOptions& options,
                     const DeviceMetadata* metadata) {
    return OrderedOn(*state_, stream, [&](DeviceState& state) {
      auto held = std::make_unique<Held>();
      HeadInputs<T> with_rows = inputs;
      if (metadata != nullptr) {
        absl::StatusOr<CudaRows> rows =
            BuildRows(config, *metadata, *state.stream);
        if (!rows.ok()) return rows.status();
        held->rows = *std::move(rows);
        with_rows.device_rows = held->rows->view();
      }
      absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> split =
          StartCudaHead<T>(config, with_rows, *state.blas, row_outputs,
                           options);
      if (!split.ok()) return split.status();
      held->split = *std::move(split);
      held_ = std::move(held);
      // What the split run reports it holds leaves out the rows, which it
      // borrows: the state holds them too (saved_bytes()).
      forward_ = held_->split->forward();
      forward_.stats.saved_bytes += held_->RowBytes();
      return absl::OkStatus();
    });
  }

  const HeadResult& forward() const override { return forward_; }

  int64_t saved_bytes() const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    // The device rows are held between the passes too.
    return held_->split->saved_bytes() + held_->RowBytes();
  }

  absl::StatusOr<HeadStats> Backward(
      double upstream, const HeadGradients<T>& gradients, uintptr_t stream,
      const std::atomic<bool>* interrupt) override {
    DeviceScope scope;
    DFLASH_RETURN_IF_ERROR(scope.Enter(device_));
    return OrderedOn(*state_, stream, [&](DeviceState&) {
      return WithRows(held_->split->Backward(upstream, gradients, interrupt));
    });
  }

  absl::StatusOr<HeadStats> BackwardFromDevice(
      const DeviceUpstream& upstream, const HeadGradients<T>& gradients,
      uintptr_t stream, const std::atomic<bool>* interrupt) override {
    DeviceScope scope;
    DFLASH_RETURN_IF_ERROR(scope.Enter(device_));
    return OrderedOn(*state_, stream, [&](DeviceState&) {
      return WithRows(held_->split->Backward(upstream, gradients, interrupt));
    });
  }

 private:
  // The split run and the device rows it borrows, freed after it.
  struct Held {
    std::optional<CudaRows> rows;
    std::unique_ptr<SplitHeadRun<T>> split;
    int64_t RowBytes() const { return rows.has_value() ? rows->bytes() : 0; }
  };

  // A backward's stats with its peak above the level before the forward,
  // the rows included as the state's other memory is (SplitHeadRun counts
  // from its own start, after the rows were built).
  absl::StatusOr<HeadStats> WithRows(absl::StatusOr<HeadStats> stats) const {
    if (stats.ok()) stats->peak_bytes += held_->RowBytes();
    return stats;
  }

  const int device_;
  std::shared_ptr<DeviceState> state_;
  std::unique_ptr<Held> held_;
  HeadResult forward_;
};

}  // namespace

bool BuiltWithCuda() { return true; }

void SetTorchAllocator(std::optional<TorchAllocator> allocator) {
  Lent& lent = LentAllocator();
  // Freed after the lock is let go: their workspaces go back through the
  // allocator that served them, whose callbacks take the GIL.
  std::map<std::pair<int, uintptr_t>, std::shared_ptr<DeviceState>> dropped;
  std::lock_guard<std::mutex> lock(lent.mu);
  lent.allocator = std::move(allocator);
  ++lent.lent;
  dropped.swap(lent.states);
}

void SetCudaLibraryDirs(std::vector<std::string> dirs) {
  dflash::SetCudaLibraryDirs(std::move(dirs));
}

template <typename T>
absl::StatusOr<HeadResult> RunOnTorchStream(const v1::ObjectiveConfig& config,
                                            const HeadInputs<T>& inputs,
                                            const HeadGradients<T>& gradients,
                                            const HeadRowOutputs& row_outputs,
                                            int device, uintptr_t stream,
                                            bool forward_only,
                                            const DeviceMetadata* metadata,
                                            double* device_results,
                                            const VocabShard* vocab_shard) {
  HeadOptions options;
  options.forward_only = forward_only;
  options.device_results = device_results;
  options.vocab_shard = vocab_shard;
  return OnHeadStream(
      device, stream, [&](DeviceState& state) -> absl::StatusOr<HeadResult> {
        if (metadata == nullptr) {
          return RunCudaHead<T>(config, inputs, gradients, *state.blas,
                                row_outputs, options);
        }
        DFLASH_ASSIGN_OR_RETURN(const CudaRows rows,
                                BuildRows(config, *metadata, *state.stream));
        HeadInputs<T> with_rows = inputs;
        with_rows.device_rows = rows.view();
        return RunCudaHead<T>(config, with_rows, gradients, *state.blas,
                              row_outputs, options);
      });
}

template <typename T>
absl::StatusOr<std::unique_ptr<TorchStreamRun<T>>> StartOnTorchStream(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    const HeadRowOutputs& row_outputs, int device, uintptr_t stream,
    const HeadOptions& options, const DeviceMetadata* metadata) {
  DeviceScope scope;
  DFLASH_RETURN_IF_ERROR(scope.Enter(device));
  DFLASH_ASSIGN_OR_RETURN(std::shared_ptr<DeviceState> state,
                          StateFor(device, stream));
  auto run = std::make_unique<SplitOnStream<T>>(device, std::move(state));
  DFLASH_RETURN_IF_ERROR(
      run->Start(config, inputs, row_outputs, stream, options, metadata));
  return run;
}

template <typename T>
absl::Status AddTopKValueGradientsOnTorchStream(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    absl::Span<const int32_t> ids, absl::Span<const float> values,
    absl::Span<const float> grad_values, int32_t k,
    const HeadGradients<T>& gradients, int device, uintptr_t stream) {
  return OnHeadStream(device, stream, [&](DeviceState& state) {
    return AddCudaTopKValueGradients<T>(
        config, inputs, ids, values, grad_values, k, gradients, *state.stream);
  });
}

absl::Status ReadDeviceResultsStatus(const v1::ObjectiveConfig& config,
                                     int device, uintptr_t stream,
                                     uintptr_t results) {
  double words[2];
  static_assert(kResultRowsStatus == 0 && kResultLossStatus == 1);
  DFLASH_RETURN_IF_ERROR(
      CopyFromDevice(device, stream, results, words, sizeof(words)));
  return DeviceResultsStatus(config, words);
}

absl::Status CopyFromDevice(int device, uintptr_t stream, uintptr_t source,
                            void* host, int64_t bytes) {
  DeviceScope scope;
  DFLASH_RETURN_IF_ERROR(scope.Enter(device));
  const cudaStream_t on = reinterpret_cast<cudaStream_t>(stream);
  DFLASH_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(host, reinterpret_cast<const void*>(source),
                            static_cast<size_t>(bytes), cudaMemcpyDeviceToHost,
                            on),
            "cudaMemcpyAsync to the host"));
  return Check(cudaStreamSynchronize(on), "cudaStreamSynchronize");
}

template absl::StatusOr<HeadResult> RunOnTorchStream<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&,
    const HeadGradients<float>&, const HeadRowOutputs&, int, uintptr_t, bool,
    const DeviceMetadata*, double*, const VocabShard*);
template absl::StatusOr<HeadResult> RunOnTorchStream<BFloat16>(
    const v1::ObjectiveConfig&, const HeadInputs<BFloat16>&,
    const HeadGradients<BFloat16>&, const HeadRowOutputs&, int, uintptr_t,
    bool, const DeviceMetadata*, double*, const VocabShard*);
#define DFLASH_INSTANTIATE_SPLIT_AND_TOP_K(T)                          \
  template absl::StatusOr<std::unique_ptr<TorchStreamRun<T>>>         \
  StartOnTorchStream<T>(const v1::ObjectiveConfig&, const HeadInputs<T>&, \
                        const HeadRowOutputs&, int, uintptr_t,        \
                        const HeadOptions&, const DeviceMetadata*);   \
  template absl::Status AddTopKValueGradientsOnTorchStream<T>(        \
      const v1::ObjectiveConfig&, const HeadInputs<T>&,               \
      absl::Span<const int32_t>, absl::Span<const float>,             \
      absl::Span<const float>, int32_t, const HeadGradients<T>&, int, \
      uintptr_t);
DFLASH_INSTANTIATE_SPLIT_AND_TOP_K(float)
DFLASH_INSTANTIATE_SPLIT_AND_TOP_K(BFloat16)
#undef DFLASH_INSTANTIATE_SPLIT_AND_TOP_K

}  // namespace dflash::python
