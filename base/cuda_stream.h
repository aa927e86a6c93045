#ifndef DFLASH_BASE_CUDA_STREAM_H_
#define DFLASH_BASE_CUDA_STREAM_H_

// CudaStream: a CUDA stream with a stream-ordered, byte-counting device
// allocator and copies between host and device. The CUDA backends (loss,
// projection, head) queue their work on one, and tests use it to move data
// to and from the device.

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/tracking_allocator.h"

struct CUstream_st;

namespace dflash {

// A CUDA stream on the current device, its stream-ordered device memory
// (cudaMallocAsync, counted by allocator()), and the copies to and from the
// host that the CUDA backends and their tests need. Work on it runs in
// issue order; nothing here waits for the device except Synchronize() and
// the copies to the host.
// Device memory a caller lends (PyTorch's caching allocator, which the
// Python binding passes in, so that torch's memory statistics count the
// head's workspaces): `allocate` returns `bytes` usable in the order of
// `stream`'s work, or an error saying why; `free` hands it back, in the
// same order.
struct DeviceAllocatorHook {
  std::function<absl::StatusOr<void*>(int64_t bytes, CUstream_st* stream)>
      allocate;
  std::function<void(void* data, CUstream_st* stream)> free;
};

class CudaStream {
 public:
  // Fails with the driver's reason where no device is usable.
  static absl::StatusOr<std::unique_ptr<CudaStream>> Create(
      int64_t limit_bytes = std::numeric_limits<int64_t>::max());
  // A CudaStream over `stream`, which the caller owns and keeps alive
  // (torch's current stream): work is queued on it directly, and it is
  // neither synchronised nor destroyed with this object. Its memory comes
  // from `hook` when given, else from cudaMallocAsync on `stream`.
  static absl::StatusOr<std::unique_ptr<CudaStream>> Wrap(
      CUstream_st* stream, const DeviceAllocatorHook* hook = nullptr,
      int64_t limit_bytes = std::numeric_limits<int64_t>::max());
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  CUstream_st* stream() const { return stream_; }
  // Device memory, stream-ordered on this stream; current and peak bytes.
  TrackingAllocator& allocator() { return *allocator_; }

  absl::Status CopyToDevice(void* device, const void* host, int64_t bytes);
  // Waits for the stream, then copies.
  absl::Status CopyToHost(void* host, const void* device, int64_t bytes);
  absl::Status Zero(void* device, int64_t bytes);
  // Waits for everything issued; the first asynchronous error, if any.
  absl::Status Synchronize();
  // Whether everything issued has finished, without waiting.
  bool Idle() const;
  // The last launch error (a kernel that could not start), without waiting.
  absl::Status LaunchStatus(const char* what);

 private:
  // Over `stream`, with memory from `hook` (checked by Wrap) or else
  // cudaMallocAsync on the stream.
  CudaStream(CUstream_st* stream, bool owned, const DeviceAllocatorHook* hook,
             int64_t limit_bytes);
  CUstream_st* stream_ = nullptr;
  bool owned_ = true;  // Created here (destroyed with it), not wrapped.
  std::unique_ptr<MemorySpace> memory_;
  // memory_'s deferred free errors, where it is stream-ordered CUDA memory.
  absl::Status (*take_deferred_)(MemorySpace&) = nullptr;
  std::unique_ptr<TrackingAllocator> allocator_;
};

}  // namespace dflash

#endif  // DFLASH_BASE_CUDA_STREAM_H_
