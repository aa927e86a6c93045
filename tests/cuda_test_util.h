#ifndef DFLASH_TESTS_CUDA_TEST_UTIL_H_
#define DFLASH_TESTS_CUDA_TEST_UTIL_H_

// A CUDA stream and cuBLAS handle for the GPU suites, or the reason there
// is none (they skip with it: base/gpu_test.h).

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "base/cuda_stream.h"
#include "base/status_macros.h"
#include "heads/cuda_projection.h"

namespace dflash {

struct Gpu {
  std::unique_ptr<CudaStream> stream;
  std::unique_ptr<CublasHandle> blas;
};

inline absl::StatusOr<Gpu> OpenGpu() {
  DFLASH_ASSIGN_OR_RETURN(std::unique_ptr<CudaStream> stream,
                          CudaStream::Create());
  DFLASH_ASSIGN_OR_RETURN(std::unique_ptr<CublasHandle> blas,
                          CublasHandle::Create(*stream));
  return Gpu{std::move(stream), std::move(blas)};
}

}  // namespace dflash

#endif  // DFLASH_TESTS_CUDA_TEST_UTIL_H_
