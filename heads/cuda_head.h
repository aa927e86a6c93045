#ifndef DFLASH_HEADS_CUDA_HEAD_H_
#define DFLASH_HEADS_CUDA_HEAD_H_

// RunCudaHead: RunHead on a CUDA device, with cuBLAS projections and the
// CUDA loss, on device-resident tensors and a CublasHandle's stream. Reach
// for it when the hidden states and the head's weight live on the GPU; it
// returns the same HeadResult as the CPU head.

#include <memory>

#include "absl/status/statusor.h"
#include "heads/cuda_projection.h"
#include "heads/head_backend.h"
#include "heads/head_types.h"
#include "proto/objective.pb.h"

namespace dflash {

// RunHead on a CUDA device: head.backend CUDA, T = float for FLOAT32 or
// BFloat16 for BFLOAT16. The same modes, chunk plan, checkpoint logic and
// results as RunHead (both are RunHeadOn), with cuBLAS projections and the
// CUDA loss (//losses:cuda_chunk_loss).
//
// Every tensor span in `inputs`, `gradients` and `row_outputs` is device
// memory; `inputs.rows` (the metadata) stays on the host. Work goes on
// `blas`'s stream, and device memory comes from that stream's allocator, so
// HeadStats.peak_bytes are the run's device bytes, measured as on the CPU.
// The chunk loop never waits for the device: the run synchronises once at
// the end of forward and once at the end of backward, where it reads the
// terms; gradients are scaled on the device. GEMM and loss seconds are not
// measured (0); forward and backward seconds are.
template <typename T>
absl::StatusOr<HeadResult> RunCudaHead(const v1::ObjectiveConfig& config,
                                       const HeadInputs<T>& inputs,
                                       const HeadGradients<T>& gradients,
                                       CublasHandle& blas,
                                       const HeadRowOutputs& row_outputs = {},
                                       const HeadOptions& options = {});

// RunCudaHead with its forward and backward passes apart (SplitHeadRun,
// heads/head_backend.h; StartHead's twin): the same checks, every mode but
// FUSED. `config`, `blas` (its stream and allocator) and the device memory
// of `inputs` are borrowed until the run is destroyed; Backward's work goes
// on `blas`'s stream and returns when the gradients are final. The FP32
// sums of BF16 weight gradients live from Backward's start to its end.
template <typename T>
absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> StartCudaHead(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    CublasHandle& blas, const HeadRowOutputs& row_outputs = {},
    const HeadOptions& options = {});

// AddTopKValueGradients (heads/top_k_gradient.h) on a CUDA device: every
// span is device memory, work goes on `stream`. The ids are copied to the
// host and checked first (rows x k int32, small). A trainable head's weight
// and bias gradients take atomic adds: FP32 for float, and for bfloat16 a
// compare-and-swap with the sum rounded to bfloat16 at each add.
template <typename T>
absl::Status AddCudaTopKValueGradients(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    absl::Span<const int32_t> ids, absl::Span<const float> values,
    absl::Span<const float> grad_values, int32_t k,
    const HeadGradients<T>& gradients, CudaStream& stream);

}  // namespace dflash

#endif  // DFLASH_HEADS_CUDA_HEAD_H_
