#ifndef DFLASH_TOOLS_CUDA_EMULATION_EMULATED_CUDA_H_
#define DFLASH_TOOLS_CUDA_EMULATION_EMULATED_CUDA_H_

// The CUDA the project uses, executed on the CPU, for tests only (never in a
// shipped target): under --config=cuda_emulated the project's .cu sources
// and CUDA host code compile as C++ against this header (it stands in for
// <cuda_runtime.h>) and run for real:
// - a kernel's blocks run one after another on their stream's worker
//   thread, the threads of a block as fibers that switch at __syncthreads
//   and warp shuffles; a barrier reached by part of the block, or a shuffle
//   whose mask names a lane that never reaches it, is a launch failure;
// - __shared__ memory (DFLASH_SHARED, base/cuda_launch.h) is per block and
//   starts poisoned (all bits set: NaN for floats, -1 for integers);
// - device memory lives where host code cannot touch it outside kernels and
//   copies: a host access, an access past an allocation or to a freed one
//   stops the process with a message naming the allocation and the offset;
// - each stream runs in issue order on a worker of its own, so streams
//   without an event between them run concurrently; an error inside a
//   kernel surfaces at the next synchronisation, as on a GPU;
// - stream capture records a stream's work into a graph that
//   cudaGraphLaunch replays, and the calls CUDA prohibits during a capture
//   (synchronisations, cudaMalloc, copies with pageable host memory) fail
//   and invalidate it (see cudaStreamBeginCapture below).
// What only a GPU shows (speed, real scheduling, tensor-core rounding)
// stays with tools/gpu_check.sh.

#include <atomic>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef DFLASH_CUDA_EMULATED
#define DFLASH_CUDA_EMULATED 1
#endif

// Qualifiers: all code is host code here.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__                                                          \
  static_assert(false,                                                      \
                "declare shared memory with DFLASH_SHARED or "              \
                "DFLASH_SHARED_ARRAY (base/cuda_launch.h): the emulation " \
                "gives each block its own, poisoned");

struct uint3 {
  unsigned x, y, z;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureIsolation = 905,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorCapturedEvent = 907,
  cudaErrorStreamCaptureWrongThread = 908,
};

enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMemoryPoolsSupported = 115,
};

enum cudaMemPoolAttr {
  cudaMemPoolAttrReleaseThreshold = 4,
};

enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_16BF = 14,
};
typedef cudaDataType_t cudaDataType;

constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDisableTiming = 2;

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int major, minor;
  int multiProcessorCount;
  int maxThreadsPerBlock;
  size_t sharedMemPerBlock;
};

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUmemPoolHandle_st* cudaMemPool_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;
typedef struct CUgraphNode_st* cudaGraphNode_t;

const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                   int device);
cudaError_t cudaDeviceSynchronize();
// Waits for every stream and clears a sticky error (allocations stay).
cudaError_t cudaDeviceReset();
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                    void* value);

cudaError_t cudaMalloc(void** pointer, size_t bytes);
cudaError_t cudaFree(void* pointer);
cudaError_t cudaMallocAsync(void** pointer, size_t bytes,
                            cudaStream_t stream);
cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream);
// cuda_runtime.h's typed forms.
template <typename T>
cudaError_t cudaMalloc(T** pointer, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}
template <typename T>
cudaError_t cudaMallocAsync(T** pointer, size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(pointer), bytes, stream);
}
// Page-locked host memory: copies to and from it are asynchronous (they
// read and write it when the stream reaches them, not at the call), and
// the only host memory a captured copy may use.
cudaError_t cudaMallocHost(void** pointer, size_t bytes);
cudaError_t cudaFreeHost(void* pointer);
template <typename T>
cudaError_t cudaMallocHost(T** pointer, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(pointer), bytes);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t stream = 0);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes,
                            cudaStream_t stream = 0);
cudaError_t cudaMemset2DAsync(void* dst, size_t pitch, int value,
                              size_t width, size_t height,
                              cudaStream_t stream = 0);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                unsigned flags = 0);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start,
                                 cudaEvent_t end);

// Stream capture, with CUDA's rules for what a capture forbids. While a
// stream captures, the work queued on it (kernels, copies, memsets, cuBLAS
// calls, cudaMallocAsync and cudaFreeAsync) is recorded, not run, and
// cudaGraphLaunch queues the recording, in order, on its stream, each time.
// Calls that fail with cudaErrorStreamCaptureUnsupported and invalidate the
// capture (cudaStreamEndCapture then returns
// cudaErrorStreamCaptureInvalidated and no graph):
// - on the capturing stream: cudaStreamSynchronize, cudaStreamQuery, a
//   cudaMemcpyAsync with pageable (not cudaMallocHost) host memory;
// - "potentially unsafe" calls, from the capturing thread (modes Global
//   and ThreadLocal) or from any thread whose own mode is Global while a
//   Global capture runs: cudaMalloc, cudaFree, cudaMallocHost,
//   cudaFreeHost, cudaDeviceSynchronize, cudaEventSynchronize,
//   cudaEventQuery, cudaMemcpy, cudaMemset, synchronising or querying the
//   legacy default stream, and any copy with pageable host memory (the
//   emulation counts a pageable copy on another stream as unsafe too,
//   which may be stricter than CUDA).
// An event recorded in a capture fails cudaEventSynchronize and
// cudaEventQuery with cudaErrorCapturedEvent; a capturing stream waiting
// on an event recorded outside it fails with
// cudaErrorStreamCaptureIsolation; work on the legacy default stream while
// a blocking stream captures fails with cudaErrorStreamCaptureImplicit.
// Not emulated: captures that span streams (another stream waiting on an
// event recorded in a capture fails with cudaErrorStreamCaptureUnsupported
// here, where CUDA would join it to the capture), graph editing and
// update, and cudaEventRecord nodes (a record in a capture only orders).
cudaError_t cudaStreamBeginCapture(cudaStream_t stream,
                                   cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                  cudaStreamCaptureStatus* status);
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream,
                                     cudaStreamCaptureStatus* status,
                                     unsigned long long* id = nullptr);
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
// With `nodes` null, only their count.
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes,
                              size_t* count);

namespace dflash_emu {

// Sizes a GPU of compute capability 8.x/9.x allows.
inline constexpr unsigned kMaxThreadsPerBlock = 1024;
inline constexpr size_t kMaxSharedBytes = 48 << 10;
inline constexpr int kWarpSize = 32;

// The GPU thread the calling code runs as; outside a kernel, an abort.
struct ThreadIndex {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
const ThreadIndex& Current();

void SyncThreads();
// The value of lane (lane ^ lane_mask) within groups of `width`, once every
// lane `mask` names has reached this shuffle.
uint64_t ShuffleXor(unsigned mask, uint64_t bits, int lane_mask, int width);
// The block's own storage for one DFLASH_SHARED declaration (`tag` tells
// them apart), poisoned when the block starts.
void* Shared(const void* tag, size_t bytes, size_t align);

// A device-side failure the emulation found (a launch failure on a GPU).
[[noreturn]] void KernelFault(const std::string& what);

// Queues `blocks` on `stream` (0: the default stream). Launch-configuration
// errors are reported through cudaGetLastError, as on a GPU.
// `device_words`: every 8-byte word of the arguments that lies in device
// memory (pointers, also inside structs), for the check that streams using
// the same allocation are ordered by events.
void Launch(const char* name, dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t stream, std::function<void()> thread_body,
            std::function<std::string()> check_arguments,
            std::vector<uintptr_t> device_words);

// The words of `value`'s bytes that lie in device memory.
bool IsDevicePointer(uintptr_t word);
template <typename T>
void CollectDeviceWords(const T& value, std::vector<uintptr_t>& out) {
  if constexpr (std::is_trivially_copyable_v<T>) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    for (size_t at = 0; at + sizeof(uintptr_t) <= sizeof(T);
         at += alignof(uintptr_t)) {
      uintptr_t word;
      std::memcpy(&word, bytes + at, sizeof(word));
      if (IsDevicePointer(word)) out.push_back(word);
    }
  }
}

// Whether the emulated GPU is hidden (DFLASH_EMULATED_GPUS=0 in the
// environment, what ScopedNoEmulatedGpu sets): then the calls that need a
// device fail with cudaErrorNoDevice, as on a machine without one.
bool GpuHidden();

// Whether `pointer` lies in an emulated device allocation (or is null).
bool IsDevicePointerOrNull(const void* pointer);

template <typename T>
std::string CheckArgument(int index, const T& value) {
  if constexpr (std::is_pointer_v<T>) {
    if (!IsDevicePointerOrNull(value)) {
      char text[128];
      std::snprintf(text, sizeof(text),
                    "argument %d is %p, which is not device memory; ", index,
                    static_cast<const void*>(value));
      return text;
    }
  }
  return "";
}

// kernel<<<grid, block, shared, stream>>>(args...) as the emulation runs it
// (DFLASH_LAUNCH, base/cuda_launch.h): every thread of every block calls
// kernel(args...), the arguments converted once, at launch, to the
// kernel's parameter types, and its pointer arguments checked to be device
// memory.
template <typename... Params>
struct BoundLaunch {
  const char* name;
  void (*kernel)(Params...);
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params),
                  "a kernel launch with the wrong number of arguments");
    auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(
        static_cast<std::decay_t<Params>>(std::forward<Args>(args))...);
    auto check = [params] {
      std::string problems;
      std::apply(
          [&](const auto&... values) {
            int index = 0;
            ((problems += CheckArgument(index++, values)), ...);
          },
          *params);
      return problems;
    };
    std::vector<uintptr_t> words;
    std::apply(
        [&](const auto&... values) { (CollectDeviceWords(values, words), ...); },
        *params);
    void (*body)(Params...) = kernel;
    Launch(name, grid, block, shared_bytes, stream,
           [body, params] { std::apply(body, *params); }, check,
           std::move(words));
  }
};

template <typename... Params>
BoundLaunch<Params...> Bind(const char* name, void (*kernel)(Params...),
                            dim3 grid, dim3 block, size_t shared_bytes = 0,
                            cudaStream_t stream = 0) {
  return {name, kernel, grid, block, shared_bytes, stream};
}

}  // namespace dflash_emu

#define threadIdx (::dflash_emu::Current().thread_idx)
#define blockIdx (::dflash_emu::Current().block_idx)
#define blockDim (::dflash_emu::Current().block_dim)
#define gridDim (::dflash_emu::Current().grid_dim)
#define warpSize (::dflash_emu::kWarpSize)

inline void __syncthreads() { ::dflash_emu::SyncThreads(); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>,
                "__shfl_xor_sync: a type of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ::dflash_emu::ShuffleXor(mask, bits, lane_mask, width);
  T result;
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}

// Device atomics: blocks of kernels on different streams run at once.
template <typename T>
T atomicAdd(T* address, T value) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(address, &old, old + value, true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
inline float atomicAdd(float* address, float value) {
  uint32_t* word = reinterpret_cast<uint32_t*>(address);
  uint32_t old = __atomic_load_n(word, __ATOMIC_RELAXED);
  while (true) {
    float current;
    std::memcpy(&current, &old, 4);
    const float sum = current + value;
    uint32_t updated;
    std::memcpy(&updated, &sum, 4);
    if (__atomic_compare_exchange_n(word, &old, updated, true,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      return current;
    }
  }
}
template <typename T>
T atomicMin(T* address, T value) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (value < old &&
         !__atomic_compare_exchange_n(address, &old, value, true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  __atomic_compare_exchange_n(address, &compare, value, false,
                              __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}

// CUDA's math functions in the global namespace (<cmath> puts the
// classification ones in std), and those <cmath> lacks.
using std::isfinite;
using std::isinf;
using std::isnan;
inline float cospif(float x) {
  return static_cast<float>(std::cos(3.14159265358979323846 * x));
}
inline float sinpif(float x) {
  return static_cast<float>(std::sin(3.14159265358979323846 * x));
}

// The intrinsic as the hardware computes it: exp2 of x log2(e) rounded to
// float, results below FLT_MIN flushed to zero (ex2.approx.ftz).
inline float __expf(float x) {
  const float r = std::exp2(x * 1.44269504088896341f);
  return std::fabs(r) < std::numeric_limits<float>::min() ? 0.0f : r;
}

inline float __uint_as_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

#endif  // DFLASH_TOOLS_CUDA_EMULATION_EMULATED_CUDA_H_
