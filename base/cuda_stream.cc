#include "base/cuda_stream.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// Device memory allocated and freed in the order of `stream`'s work.
class StreamMemory final : public MemorySpace {
 public:
  explicit StreamMemory(cudaStream_t stream) : stream_(stream) {}
  Device device() const override { return Device::kCuda; }
  void* Allocate(int64_t bytes) override {
    void* data = nullptr;
    if (cudaMallocAsync(&data, bytes, stream_) != cudaSuccess) {
      cudaGetLastError();  // Clear it: a failed allocation is a Status.
      return nullptr;
    }
    return data;
  }
  void Free(void* data) override { cudaFreeAsync(data, stream_); }
  void Copy(void* dst, const void* src, int64_t bytes) override {
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_);
  }

 private:
  const cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Create(
    int64_t limit_bytes) {
  int count = 0;
  if (cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: ", cudaGetErrorString(error)));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  std::unique_ptr<CudaStream> stream(new CudaStream);
  DFLASH_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&stream->stream_, cudaStreamNonBlocking),
      "cudaStreamCreate"));
  stream->memory_ = std::make_unique<StreamMemory>(stream->stream_);
  stream->allocator_ = std::make_unique<TrackingAllocator>(
      limit_bytes, /*cache_blocks=*/false, *stream->memory_);
  return stream;
}

CudaStream::~CudaStream() {
  if (stream_ == nullptr) return;
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaStream::CopyToDevice(void* device, const void* host,
                                      int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(
      cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_),
      "copy to the device");
}

absl::Status CudaStream::CopyToHost(void* host, const void* device,
                                    int64_t bytes) {
  if (bytes == 0) return Synchronize();
  DFLASH_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_),
      "copy to the host"));
  return Synchronize();
}

absl::Status CudaStream::Zero(void* device, int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemsetAsync(device, 0, bytes, stream_), "cudaMemset");
}

absl::Status CudaStream::Synchronize() {
  return CudaStatus(cudaStreamSynchronize(stream_), "CUDA stream");
}

absl::Status CudaStream::LaunchStatus(const char* what) {
  return CudaStatus(cudaGetLastError(), what);
}

}  // namespace dflash
