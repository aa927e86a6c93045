#ifndef DFLASH_HEADS_CUDA_PROJECTION_H_
#define DFLASH_HEADS_CUDA_PROJECTION_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/cuda_stream.h"
#include "heads/projection.h"

struct cublasContext;

namespace dflash {

struct CublasApi;  // base/cublas_library.h

// A cuBLAS handle bound to a CudaStream. Creating one costs milliseconds:
// make it once and reuse it for every step. cuBLAS itself is opened on the
// first (base/cublas_library.h): NotFound, naming where it looked, when it
// is nowhere.
class CublasHandle {
 public:
  static absl::StatusOr<std::unique_ptr<CublasHandle>> Create(
      CudaStream& stream);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  // Hands cuBLAS `bytes` of device memory at `workspace` as the scratch of
  // every later product on this handle, so that cuBLAS never allocates its
  // own: what capturing the products into a CUDA graph needs (cuBLAS's
  // own pool would allocate during the capture, and on CUDA before 12.2
  // make each graph hold a new workspace). cuBLAS recommends at least
  // 4 MiB, 32 MiB on Hopper. `workspace`: non-null, aligned to 256 bytes
  // (cudaMalloc's and cudaMallocAsync's are), at least `bytes` long; the
  // caller keeps it alive, and uses it for nothing else while a product
  // runs, until this handle is destroyed or given another workspace (a
  // product overwrites it). Call it again after anything that calls
  // cublasSetStream on this handle, which goes back to cuBLAS's own.
  // InvalidArgument for a null, misaligned or empty workspace,
  // FailedPrecondition where the cuBLAS found lacks cublasSetWorkspace.
  absl::Status SetWorkspace(void* workspace, int64_t bytes);

  cublasContext* get() const { return handle_; }
  const CublasApi& api() const { return api_; }
  CudaStream& stream() const { return stream_; }

 private:
  CublasHandle(cublasContext* handle, const CublasApi& api, CudaStream& stream)
      : handle_(handle), api_(api), stream_(stream) {}
  cublasContext* const handle_;
  const CublasApi& api_;
  CudaStream& stream_;
};

// The CUDA projection, the twin of CreateCpuProjection: cublasGemmEx with
// FP32 accumulation for T = float (plain FP32 math, no TF32) or BFloat16
// (bf16 inputs and outputs). Weight, bias and every pointer passed to the
// projection are device memory; the products are queued on the handle's
// stream, and a cuBLAS failure shows in status(). The BF16 weight gradient
// accumulates in bf16 across chunks, as autograd's does for a bf16 weight.
// GemmCount.seconds stays 0: the products are not waited for.
// With `float_weight_gradient` pointing at a device pointer (vocab x hidden
// floats, then vocab more when there is a bias; read at each product, so
// the caller may attach the sum when its backward pass starts; a null
// pointer: no sum), AccumulateWeightGradient sums into it in FP32
// instead of into its grad_weight and grad_bias arguments (ignored but for
// whether there is a bias), so that a BF16 weight and bias gradient summed
// over chunks are rounded once, by the caller (LaunchScaleToStorage).
// InputGradient(Columns) multiply their products by *input_gradient_scale
// (the GEMM's alpha; read at each product, so the caller may set it once
// the scale is known; null: 1), so a gradient whose final scale is known is
// rounded once.
template <typename T>
absl::StatusOr<std::unique_ptr<VocabProjection<T>>> CreateCudaProjection(
    absl::Span<const T> weight, absl::Span<const T> bias, int64_t vocab,
    int64_t hidden, CublasHandle& blas,
    float* const* float_weight_gradient = nullptr,
    const float* input_gradient_scale = nullptr);

}  // namespace dflash

#endif  // DFLASH_HEADS_CUDA_PROJECTION_H_
