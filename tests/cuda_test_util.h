#ifndef DFLASH_TESTS_CUDA_TEST_UTIL_H_
#define DFLASH_TESTS_CUDA_TEST_UTIL_H_

// A CUDA stream and cuBLAS handle for the GPU suites, or the reason there
// is none (they skip with it: base/gpu_test.h); host values to and from
// device buffers.

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
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

// A device copy of host values, each stored as T (FromDouble; empty stays
// empty). Failures are test failures.
template <typename T, typename U>
TrackedBuffer<T> Upload(const std::vector<U>& host, CudaStream& stream) {
  std::vector<T> values;
  values.reserve(host.size());
  for (const U& x : host) values.push_back(FromDouble<T>(x));
  auto buffer = TrackedBuffer<T>::Create(stream.allocator(),
                                         static_cast<int64_t>(values.size()));
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(
      stream.CopyToDevice(buffer->data(), values.data(), buffer->bytes()).ok());
  return *std::move(buffer);
}

// A device buffer's values as stored, and read as doubles (AsDouble).
template <typename T>
std::vector<T> CopyBack(const TrackedBuffer<T>& buffer, CudaStream& stream) {
  std::vector<T> host(buffer.size());
  EXPECT_TRUE(
      stream.CopyToHost(host.data(), buffer.data(), buffer.bytes()).ok());
  return host;
}
template <typename T>
std::vector<double> Download(const TrackedBuffer<T>& buffer,
                             CudaStream& stream) {
  return AsDoubles(CopyBack(buffer, stream));
}

template <typename T>
absl::Span<T> Span(TrackedBuffer<T>& b) {
  return absl::MakeSpan(b.data(), b.size());
}

}  // namespace dflash

#endif  // DFLASH_TESTS_CUDA_TEST_UTIL_H_
