#ifndef DFLASH_BASE_CUBLAS_LIBRARY_H_
#define DFLASH_BASE_CUBLAS_LIBRARY_H_

// cuBLAS, found and opened on first use instead of linked, so that a
// program or Python module holding the CUDA head loads where no CUDA
// library exists (CPU machines), and can take the cuBLAS torch already
// ships (PyPI's torch bundles its CUDA libraries under site-packages/
// nvidia/) rather than a system toolkit.

#include <cublas_v2.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dflash {

// The cuBLAS entry points the project calls.
struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  // The C entry point (the header adds a C++ overload taking a
  // cudaDataType compute type).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t,
                            cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t);
  decltype(&cublasGetStatusString) status_string;
  std::string path;  // The file it was opened from.
};

// Directories tried first, in order (the Python package passes torch's
// bundled NVIDIA library folders). Takes effect for a load not yet made.
void SetCudaLibraryDirs(std::vector<std::string> dirs);

// cuBLAS of this build's major version (libcublas.so.<major>), opened once:
// from the SetCudaLibraryDirs folders, then the system's search path
// (LD_LIBRARY_PATH, ldconfig), then the toolkit the build used. NotFound
// names the file, every place looked and any other major version seen
// there; FailedPrecondition names a library that lacks an entry point.
absl::StatusOr<const CublasApi*> Cublas();

// What Cublas() does, from `dirs`, with or without the system's search
// path and the build's toolkit: for tests.
absl::StatusOr<CublasApi> OpenCublas(const std::vector<std::string>& dirs,
                                     bool search_system);

}  // namespace dflash

#endif  // DFLASH_BASE_CUBLAS_LIBRARY_H_
