#ifndef DFLASH_PYTHON_NATIVE_CUDA_RUN_H_
#define DFLASH_PYTHON_NATIVE_CUDA_RUN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "heads/head_types.h"
#include "proto/objective.pb.h"

namespace dflash::python {

// Whether this build has the CUDA head (Bazel found a CUDA toolkit).
bool BuiltWithCuda();

// Folders where the CUDA head looks for cuBLAS first (torch's bundled
// NVIDIA libraries); the system's and the build's toolkit come after. Does
// nothing in a build without CUDA.
void SetCudaLibraryDirs(std::vector<std::string> dirs);

// Device memory lent by the caller: PyTorch's caching allocator
// (torch.cuda.caching_allocator_alloc and _delete), so that torch's memory
// statistics (torch.cuda.max_memory_allocated) count the head's workspaces.
// allocate returns `bytes` on `device` in the order of `stream`, or an
// error saying why (ResourceExhausted when the device is full).
struct TorchAllocator {
  std::function<absl::StatusOr<uintptr_t>(int64_t bytes, int device,
                                          uintptr_t stream)>
      allocate;
  std::function<void(uintptr_t data)> free;
};

// Sets the allocator the CUDA runs below take their memory from, or with
// nullopt goes back to the head's own stream and pool. With one set, a run
// is queued on torch's stream itself (a non-owning wrapper of it, with a
// cuBLAS handle kept per stream): no stream of its own and no events. Does
// nothing in a build without CUDA.
//
// Either way the state a run goes on (per stream with an allocator lent,
// else per device) gives its cuBLAS handle a workspace from its allocator
// (32 MiB from compute capability 9, else 4 MiB), held as long as the state.
// The first run on a stream makes that state: made while the stream
// captures a CUDA graph, it fails with FailedPrecondition (run one call on
// the stream before capturing).
void SetTorchAllocator(std::optional<TorchAllocator> allocator);

// A [B, N, K] tensor of row metadata in device memory: its address, dtype
// ("int32" or "int64" target ids; "float32", "float64" or "bool" masks) and
// strides in elements.
struct DeviceMetadataTensor {
  uintptr_t data = 0;
  std::string dtype;
  int64_t strides[3] = {0, 0, 0};
};

// target_ids and weight_mask on the run's device: the run makes its rows
// there (BuildCudaRows, heads/cuda_head.h) in its stream's order, and a bad
// element fails it with InvalidArgument (the head's RowError, about the
// element's row). Under head.row_selection COMPACT (the default) the rows
// are read back once before the first chunk, a wait for the build, to
// project the weighted rows alone; under ALL_ROWS nothing is read back
// before the head's work is queued.
struct DeviceMetadata {
  DeviceMetadataTensor target_ids, weight_mask;
  int64_t batch = 0, anchors = 0;  // B, N; K is layout.block_size.
};

// RunCudaHead (T = float or BFloat16) on CUDA device `device`, ordered
// after the work already queued on `stream` (torch's current stream there)
// and before the work queued on it next, through events: nothing waits on
// the host beyond the head's own two synchronisations. The head's stream
// and cuBLAS handle are made once per device and kept. With `metadata`,
// the rows come from it and `inputs.rows` is empty. With `vocab_shard`
// (HeadOptions::vocab_shard) the run is vocab-parallel: its exchange is
// called during the run, which waits for the device once per chunk.
// Without CUDA in the build: Unimplemented.
template <typename T>
absl::StatusOr<HeadResult> RunOnTorchStream(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    const HeadGradients<T>& gradients, const HeadRowOutputs& row_outputs,
    int device, uintptr_t stream, bool forward_only = false,
    const DeviceMetadata* metadata = nullptr,
    double* device_results = nullptr,
    const VocabShard* vocab_shard = nullptr);

// A split CUDA run (StartOnTorchStream): StartCudaHead's SplitHeadRun with
// the stream it was queued on, kept for its backward. Destroying it frees
// its device memory in that stream's order (with the lent allocator,
// through torch's, which takes the GIL: destroy it without the GIL held);
// destroyed inside a run on that stream on the same thread (from the lent
// allocator's callback), when that run ends.
template <typename T>
class TorchStreamRun {
 public:
  virtual ~TorchStreamRun() = default;
  // SplitHeadRun::forward.
  virtual const HeadResult& forward() const = 0;
  // SplitHeadRun::saved_bytes: device bytes held between the passes.
  virtual int64_t saved_bytes() const = 0;
  // SplitHeadRun::Backward ordered after the work queued on torch's
  // `stream` (its current stream now, which need not be the forward's) and
  // before the work queued on it next; the gradients are device memory.
  virtual absl::StatusOr<HeadStats> Backward(
      double upstream, const HeadGradients<T>& gradients, uintptr_t stream,
      const std::atomic<bool>* interrupt) = 0;
  // Backward with the upstream in device memory (head.device_results:
  // SplitHeadRun::Backward(DeviceUpstream)), ordered as Backward is; reads
  // nothing back and does not wait.
  virtual absl::StatusOr<HeadStats> BackwardFromDevice(
      const DeviceUpstream& upstream, const HeadGradients<T>& gradients,
      uintptr_t stream, const std::atomic<bool>* interrupt) = 0;
};

// RunOnTorchStream with its passes apart (StartCudaHead, T = float or
// BFloat16): the forward ordered on torch's `stream` as RunOnTorchStream
// orders a run (with the lent allocator on that stream itself, else on the
// head's own stream between two events), `row_outputs` written. The run
// borrows `config` and the memory of `inputs`, which the caller keeps alive
// and unchanged until it is destroyed. With `metadata` (RunOnTorchStream's),
// the rows it makes from it live as long as the run. Without CUDA in the
// build: Unimplemented.
template <typename T>
absl::StatusOr<std::unique_ptr<TorchStreamRun<T>>> StartOnTorchStream(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    const HeadRowOutputs& row_outputs, int device, uintptr_t stream,
    const HeadOptions& options, const DeviceMetadata* metadata = nullptr);

// AddCudaTopKValueGradients (heads/cuda_head.h) ordered on torch's
// `stream` as RunOnTorchStream is.
template <typename T>
absl::Status AddTopKValueGradientsOnTorchStream(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    absl::Span<const int32_t> ids, absl::Span<const float> values,
    absl::Span<const float> grad_values, int32_t k,
    const HeadGradients<T>& gradients, int device, uintptr_t stream);

// The Status a head.device_results run latched in its results buffer at
// `results` (device memory on `device`), read after the work queued on
// torch's `stream` (one wait): OK, or the head's error as the synchronous
// run returns it (DeviceResultsStatus, heads/cuda_head.h). Without CUDA in
// the build: Unimplemented.
absl::Status ReadDeviceResultsStatus(const v1::ObjectiveConfig& config,
                                     int device, uintptr_t stream,
                                     uintptr_t results);

// Copies `bytes` from device memory at `source` on `device` to `host`,
// ordered after the work queued on torch's `stream` (which may still be
// writing it), and waits for the copy. Without CUDA in the build:
// Unimplemented.
absl::Status CopyFromDevice(int device, uintptr_t stream, uintptr_t source,
                            void* host, int64_t bytes);

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_CUDA_RUN_H_
