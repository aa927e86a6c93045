#include "base/cuda_stream.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// Device memory used in the order of `stream`'s work: its copies are
// queued there; allocation is the subclass's.
class OrderedMemory : public MemorySpace {
 public:
  explicit OrderedMemory(cudaStream_t stream) : stream_(stream) {}
  Device device() const override { return Device::kCuda; }
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override {
    return CudaStatus(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
        "device copy");
  }

 protected:
  const cudaStream_t stream_;
};

// Device memory allocated and freed in the order of `stream`'s work.
class StreamMemory final : public OrderedMemory {
 public:
  using OrderedMemory::OrderedMemory;
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    void* data = nullptr;
    const cudaError_t error = cudaMallocAsync(&data, bytes, stream_);
    if (error == cudaSuccess) return data;
    cudaGetLastError();  // Clear it: a failed allocation is a Status.
    const std::string what =
        absl::StrCat("allocating ", bytes, " bytes of CUDA memory (",
                     "cudaMallocAsync): ", cudaGetErrorString(error));
    // Only a full device is ResourceExhausted; no memory pools, a lost
    // device or a bad context are other failures, named as such.
    return error == cudaErrorMemoryAllocation
               ? absl::ResourceExhaustedError(what)
               : absl::InternalError(what);
  }
  void Free(void* data) override {
    const cudaError_t error = cudaFreeAsync(data, stream_);
    if (error == cudaSuccess) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (deferred_.ok()) deferred_ = CudaStatus(error, "cudaFreeAsync");
  }
  // The first failed free since the last call (frees return nothing).
  absl::Status TakeDeferred() {
    std::lock_guard<std::mutex> lock(mutex_);
    absl::Status status = deferred_;
    deferred_ = absl::OkStatus();
    return status;
  }

 private:
  std::mutex mutex_;
  absl::Status deferred_;
};

absl::Status TakeStreamDeferred(MemorySpace& memory) {
  return static_cast<StreamMemory&>(memory).TakeDeferred();
}

// Device memory from a caller's hook (DeviceAllocatorHook), ordered on
// `stream`.
class HookMemory final : public OrderedMemory {
 public:
  HookMemory(const DeviceAllocatorHook& hook, cudaStream_t stream)
      : OrderedMemory(stream), hook_(hook) {}
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    return hook_.allocate(bytes, stream_);
  }
  void Free(void* data) override { hook_.free(data, stream_); }

 private:
  const DeviceAllocatorHook hook_;
};

}  // namespace

CudaStream::CudaStream(CUstream_st* stream, bool owned,
                       const DeviceAllocatorHook* hook, int64_t limit_bytes)
    : stream_(stream), owned_(owned) {
  if (hook != nullptr) {
    memory_ = std::make_unique<HookMemory>(*hook, stream);
  } else {
    memory_ = std::make_unique<StreamMemory>(stream);
    take_deferred_ = TakeStreamDeferred;
  }
  allocator_ = std::make_unique<TrackingAllocator>(
      limit_bytes, /*cache_blocks=*/false, *memory_);
}

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Wrap(
    CUstream_st* stream, const DeviceAllocatorHook* hook,
    int64_t limit_bytes) {
  if (hook != nullptr && (!hook->allocate || !hook->free)) {
    return absl::InvalidArgumentError(
        "a device allocator hook needs both allocate and free");
  }
  return std::unique_ptr<CudaStream>(
      new CudaStream(stream, /*owned=*/false, hook, limit_bytes));
}

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Create(
    int64_t limit_bytes) {
  int count = 0;
  if (cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: ", cudaGetErrorString(error)));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  // Keep freed memory in the device's pool between synchronisations (the
  // default threshold, 0, hands it back to the driver at every one and the
  // next run maps it again), as PyTorch's caching allocator does. Where
  // pools are unsupported, allocations say so.
  int device = 0;
  cudaMemPool_t pool;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  cudaGetLastError();
  cudaStream_t stream = nullptr;
  DFLASH_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
      "cudaStreamCreate"));
  return std::unique_ptr<CudaStream>(
      new CudaStream(stream, /*owned=*/true, /*hook=*/nullptr, limit_bytes));
}

CudaStream::~CudaStream() {
  if (stream_ == nullptr || !owned_) return;
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
  DFLASH_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream_), "CUDA stream"));
  return take_deferred_ != nullptr ? take_deferred_(*memory_)
                                   : absl::OkStatus();
}

bool CudaStream::Idle() const {
  const cudaError_t state = cudaStreamQuery(stream_);
  // Not ready is no error for the next launch check to find.
  if (state == cudaErrorNotReady) cudaGetLastError();
  return state == cudaSuccess;
}

absl::Status CudaStream::LaunchStatus(const char* what) {
  return CudaStatus(cudaGetLastError(), what);
}

}  // namespace dflash
