#ifndef DFLASH_TOOLS_CUDA_EMULATION_INCLUDE_CUBLAS_V2_H_
#define DFLASH_TOOLS_CUDA_EMULATION_INCLUDE_CUBLAS_V2_H_

// The cuBLAS the project calls, on the CPU BLAS, in stream order, with
// cuBLAS's own semantics (column-major, op transposes, its argument
// checks); tests only (tools/cuda_emulation/cublas.cc).

#include "tools/cuda_emulation/emulated_cuda.h"

#define CUBLAS_VER_MAJOR 13

typedef struct cublasContext* cublasHandle_t;

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

enum cublasOperation_t {
  CUBLAS_OP_N = 0,
  CUBLAS_OP_T = 1,
};

enum cublasMath_t {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16,
};

enum cublasComputeType_t {
  CUBLAS_COMPUTE_32F = 68,
};

enum cublasGemmAlgo_t {
  CUBLAS_GEMM_DEFAULT = -1,
};

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle);
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle);
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream);
// cuBLAS's rules: `workspace` aligned to 256 bytes (else
// CUBLAS_STATUS_INVALID_VALUE), used by every later call until
// cublasSetStream, which goes back to cuBLAS's own pool. The emulation
// also refuses a workspace that is not device memory, and each GEMM uses
// (overwrites) the start of the workspace as scratch.
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace,
                                     size_t workspace_bytes);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
const char* cublasGetStatusString(cublasStatus_t status);
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k,
                            const void* alpha, const void* A,
                            cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta,
                            void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);

#define cublasCreate cublasCreate_v2
#define cublasDestroy cublasDestroy_v2
#define cublasSetStream cublasSetStream_v2
#define cublasSetWorkspace cublasSetWorkspace_v2

#endif  // DFLASH_TOOLS_CUDA_EMULATION_INCLUDE_CUBLAS_V2_H_
