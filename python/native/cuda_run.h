#ifndef DFLASH_PYTHON_NATIVE_CUDA_RUN_H_
#define DFLASH_PYTHON_NATIVE_CUDA_RUN_H_

#include <cstdint>
#include <functional>
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
void SetTorchAllocator(std::optional<TorchAllocator> allocator);

// RunCudaHead (T = float or BFloat16) on CUDA device `device`, ordered
// after the work already queued on `stream` (torch's current stream there)
// and before the work queued on it next, through events: nothing waits on
// the host beyond the head's own two synchronisations. The head's stream
// and cuBLAS handle are made once per device and kept. Without CUDA in the
// build: Unimplemented.
template <typename T>
absl::StatusOr<HeadResult> RunOnTorchStream(const v1::ObjectiveConfig& config,
                                            const HeadInputs<T>& inputs,
                                            const HeadGradients<T>& gradients,
                                            const HeadRowOutputs& row_outputs,
                                            int device, uintptr_t stream,
                                            bool forward_only = false);

// AddCudaTopKValueGradients (heads/cuda_head.h) ordered on torch's
// `stream` as RunOnTorchStream is.
template <typename T>
absl::Status AddTopKValueGradientsOnTorchStream(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    absl::Span<const int32_t> ids, absl::Span<const float> values,
    absl::Span<const float> grad_values, int32_t k,
    const HeadGradients<T>& gradients, int device, uintptr_t stream);

// Copies `bytes` from device memory at `source` on `device` to `host`,
// waiting for the device. Without CUDA in the build: Unimplemented.
absl::Status CopyFromDevice(int device, uintptr_t source, void* host,
                            int64_t bytes);

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_CUDA_RUN_H_
