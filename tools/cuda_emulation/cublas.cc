// cuBLAS on the CPU BLAS, for the CUDA emulation: the calls run in stream
// order on their stream's worker, with device memory opened for them.
#include <cblas.h>

#include <cstdio>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "base/bfloat16.h"
#include "tools/cuda_emulation/include/cublas_v2.h"
#include "tools/cuda_emulation/runtime_internal.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  // The caller's workspace (cublasSetWorkspace); null: cuBLAS's own.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

namespace {

// How much of a caller's workspace a GEMM overwrites: the 16 KiB cuBLAS
// documents as enough for every routine.
constexpr size_t kScratchBytes = 16 << 10;

bool Known(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16BF;
}

// `count` values of `type` at `data` as float.
std::vector<float> ToFloats(const void* data, cudaDataType type,
                            size_t count) {
  std::vector<float> values(count);
  if (type == CUDA_R_32F) {
    std::memcpy(values.data(), data, count * sizeof(float));
  } else {
    const auto* bf16 = static_cast<const dflash::BFloat16*>(data);
    for (size_t i = 0; i < count; ++i) values[i] = dflash::ToFloat(bf16[i]);
  }
  return values;
}

}  // namespace

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  cudaStreamSynchronize(handle->stream);
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  handle->workspace = nullptr;
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace,
                                     size_t workspace_bytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    std::fprintf(stderr,
                 "CUDA emulation: cublasSetWorkspace: %p is not aligned to "
                 "256 bytes\n",
                 workspace);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (workspace_bytes > 0 && !dflash_emu::IsDevicePointerOrNull(workspace)) {
    std::fprintf(stderr,
                 "CUDA emulation: cublasSetWorkspace: %p is not device "
                 "memory\n",
                 workspace);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->workspace = workspace;
  handle->workspace_bytes = workspace == nullptr ? 0 : workspace_bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t) {
  return handle == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED
                           : CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the functionality requested is not supported";
  }
  return "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k,
                            const void* alpha, const void* A,
                            cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta,
                            void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType,
                            cublasGemmAlgo_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  // cuBLAS's checks: sizes, leading dimensions against the stored shapes.
  const int a_rows = transa == CUBLAS_OP_N ? m : k;
  const int b_rows = transb == CUBLAS_OP_N ? k : n;
  if (m < 0 || n < 0 || k < 0 || lda < (a_rows > 1 ? a_rows : 1) ||
      ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1) ||
      (transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
      (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!Known(Atype) || Btype != Atype || !Known(Ctype) ||
      (Atype == CUDA_R_32F && Ctype != CUDA_R_32F) ||
      computeType != CUBLAS_COMPUTE_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  // alpha and beta are host values, read at the call, as cuBLAS's host
  // pointer mode reads them.
  float a_scale, b_scale;
  std::memcpy(&a_scale, alpha, sizeof(float));
  std::memcpy(&b_scale, beta, sizeof(float));
  const int a_cols = transa == CUBLAS_OP_N ? k : m;
  const int b_cols = transb == CUBLAS_OP_N ? n : k;
  std::vector<uintptr_t> words = {reinterpret_cast<uintptr_t>(A),
                                  reinterpret_cast<uintptr_t>(B),
                                  reinterpret_cast<uintptr_t>(C)};
  void* const workspace = handle->workspace;
  const size_t scratch_bytes = std::min<size_t>(handle->workspace_bytes,
                                                kScratchBytes);
  if (workspace != nullptr) {
    words.push_back(reinterpret_cast<uintptr_t>(workspace));
  }
  const cudaError_t queued = dflash_emu::RunInStreamOrder(handle->stream, [=] {
    // A GEMM's scratch: what the caller kept there is gone, as on a GPU.
    if (scratch_bytes > 0) std::memset(workspace, 0xA5, scratch_bytes);
    // Column-major: element (i, j) of an ld-strided matrix at i + j * ld.
    const size_t a_count = k == 0 ? 0 : size_t(lda) * (a_cols - 1) + a_rows;
    const size_t b_count = k == 0 ? 0 : size_t(ldb) * (b_cols - 1) + b_rows;
    const size_t c_count = size_t(ldc) * (n - 1) + m;
    const std::vector<float> a = ToFloats(A, Atype, a_count);
    const std::vector<float> b = ToFloats(B, Btype, b_count);
    std::vector<float> c = ToFloats(C, Ctype, c_count);
    if (k > 0) {
      cblas_sgemm(CblasColMajor,
                  transa == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                  transb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k,
                  a_scale, a.data(), lda, b.data(), ldb, b_scale, c.data(),
                  ldc);
    } else {
      for (float& x : c) x *= b_scale;
    }
    // Only the m x n elements: the gaps between columns stay as they were.
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        const size_t at = i + size_t(j) * ldc;
        if (Ctype == CUDA_R_32F) {
          static_cast<float*>(C)[at] = c[at];
        } else {
          static_cast<dflash::BFloat16*>(C)[at] = dflash::ToBFloat16(c[at]);
        }
      }
    }
  }, words, "cublasGemmEx");
  return queued == cudaSuccess ? CUBLAS_STATUS_SUCCESS
                               : CUBLAS_STATUS_EXECUTION_FAILED;
}
