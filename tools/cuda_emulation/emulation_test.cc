// The CUDA emulation itself: kernels run with CUDA's semantics, and each
// kind of fault a GPU run would hit (or hide) is caught with its message,
// so the emulated suites cannot pass by running nothing.
#include "tools/cuda_emulation/emulated_cuda.h"

#include <atomic>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "base/cuda_launch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/cuda_emulation/copies_test_util.h"

namespace {

using ::testing::HasSubstr;

// Sums of each block's values (gridDim.x * blockDim.x of them): a shared
// tree with barriers, then the last warp's shuffles.
__global__ void BlockSums(const float* values, float* sums) {
  DFLASH_SHARED_ARRAY(float, tree, 256);
  const unsigned t = threadIdx.x;
  tree[t] = values[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride >= 32; stride /= 2) {
    if (t < stride) tree[t] += tree[t + stride];
    __syncthreads();
  }
  if (t < 32) {
    float v = tree[t];
    for (int offset = 16; offset > 0; offset /= 2) {
      v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    if (t == 0) sums[blockIdx.x] = v;
  }
}

// A neighbour's slot read with no barrier after the writes.
__global__ void ReadNeighbourWithoutBarrier(int* out) {
  DFLASH_SHARED_ARRAY(int, slots, 64);
  const int t = threadIdx.x;
  slots[t] = t;
  out[t] = slots[(t + 1) % 64];
}

__global__ void HalfBarrier(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void ShuffleFullMask(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

__global__ void Write(float* data, int64_t at) { data[at] = 1; }

__global__ void Copy(const float* from, float* to, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

__global__ void Fill(float* data, int64_t n, float value) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) data[i] = value;
}

__global__ void Add(float* total, float value) { atomicAdd(total, value); }

// out[i] += factor * in[i]: a replay that skipped the memset before it
// would show as a sum over replays.
__global__ void AccumulateScaled(const float* in, float* out, int64_t n,
                                 float factor) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    out[i] += factor * in[i];
  }
}

using ::dflash_emu_test::ToDevice;
using ::dflash_emu_test::ToHost;

class EmulationTest : public ::testing::Test {
 protected:
  // A fault is sticky, as a GPU context's: each test starts clean.
  void TearDown() override { cudaDeviceReset(); }
};

TEST_F(EmulationTest, KernelsRunWithCudasSemantics) {
  constexpr int kBlocks = 5, kThreads = 256;
  std::vector<float> values(kBlocks * kThreads);
  std::iota(values.begin(), values.end(), 0.0f);
  float* d_values = ToDevice(values);
  float* d_sums = nullptr;
  ASSERT_EQ(cudaMalloc(&d_sums, kBlocks * sizeof(float)), cudaSuccess);
  DFLASH_LAUNCH(BlockSums, kBlocks, kThreads, 0, 0)(d_values, d_sums);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> sums = ToHost(d_sums, kBlocks);
  for (int b = 0; b < kBlocks; ++b) {
    const double first = b * kThreads, last = first + kThreads - 1;
    EXPECT_EQ(sums[b], (first + last) * kThreads / 2) << b;
  }
  float* d_total = ToDevice(std::vector<float>{0});
  DFLASH_LAUNCH(Add, 3, 64, 0, 0)(d_total, 0.5f);
  EXPECT_EQ(ToHost(d_total, 1)[0], 96.0f);
  cudaFree(d_values);
  cudaFree(d_sums);
  cudaFree(d_total);
}

// Shared memory starts poisoned (all bits set) in every block, so a read
// that no barrier orders after its write shows, every time: the threads
// run in order, each reading a slot the next has not written yet.
TEST_F(EmulationTest, AMissingBarrierReadsThePoison) {
  int* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, 64 * sizeof(int)), cudaSuccess);
  DFLASH_LAUNCH(ReadNeighbourWithoutBarrier, 2, 64, 0, 0)(d_out);
  const std::vector<int> out = ToHost(d_out, 64);
  for (int t = 0; t < 63; ++t) EXPECT_EQ(out[t], -1) << t;
  EXPECT_EQ(out[63], 0);
  cudaFree(d_out);
}

TEST_F(EmulationTest, ABarrierReachedByPartOfTheBlockIsALaunchFailure) {
  int* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, 32 * sizeof(int)), cudaSuccess);
  ::testing::internal::CaptureStderr();
  DFLASH_LAUNCH(HalfBarrier, 1, 32, 0, 0)(d_out);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("kernel HalfBarrier, block (0, 0, 0): __syncthreads "
                        "reached by 16 of 32 threads (16 had returned)"));
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);  // Sticky.
  cudaFree(d_out);
}

TEST_F(EmulationTest, AShuffleWhoseMaskNamesAnAbsentLaneIsALaunchFailure) {
  int* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, 32 * sizeof(int)), cudaSuccess);
  ::testing::internal::CaptureStderr();
  DFLASH_LAUNCH(ShuffleFullMask, 1, 16, 0, 0)(d_out);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("__shfl_xor_sync with mask 0xffffffff in warp 0 "
                        "waits for lane 16 (no such thread)"));
  cudaDeviceReset();
  // With all 32 lanes the same kernel swaps neighbours.
  DFLASH_LAUNCH(ShuffleFullMask, 1, 32, 0, 0)(d_out);
  const std::vector<int> out = ToHost(d_out, 32);
  for (int t = 0; t < 32; ++t) EXPECT_EQ(out[t], t ^ 1);
  cudaFree(d_out);
}

TEST_F(EmulationTest, LaunchesBeyondAGpusLimitsAreErrors) {
  ::testing::internal::CaptureStderr();
  DFLASH_LAUNCH(Write, 1, 2048, 0, 0)(nullptr, 0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("beyond a GPU's limits (1024 threads a block)"));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // Not sticky.
}

TEST_F(EmulationTest, CopiesCheckTheirPointers) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64), cudaSuccess);
  std::vector<float> host(32);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cudaMemcpy(host.data(), host.data(), 64, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, host.data(), 128, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  const std::string messages = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(messages, HasSubstr("the destination"));
  EXPECT_THAT(messages, HasSubstr("is host memory, but the copy's kind says "
                                  "device"));
  EXPECT_THAT(messages, HasSubstr("128 bytes from the destination"));
  cudaFree(d);
}

TEST_F(EmulationTest, AKernelGivenAHostPointerFails) {
  std::vector<float> host(4);
  ::testing::internal::CaptureStderr();
  DFLASH_LAUNCH(Write, 1, 1, 0, 0)(host.data(), 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("kernel Write: argument 0 is"));
  EXPECT_EQ(host[0], 0.0f);
}

using EmulationDeathTest = EmulationTest;

TEST_F(EmulationDeathTest, HostCodeReadingDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto fault = [] {
    float* d = nullptr;
    cudaMalloc(&d, 1280);
    volatile float x = d[3];
    (void)x;
  };
  EXPECT_DEATH(fault(),
      "host code read device memory: offset 12 of an allocation of 1280 "
      "bytes at 0x[0-9a-f]+; host code reaches device memory only through "
      "cudaMemcpy");
}

TEST_F(EmulationDeathTest, AKernelWritingPastItsAllocationFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto fault = [] {
    float* d = nullptr;
    cudaMalloc(&d, 4096);
    DFLASH_LAUNCH(Write, 1, 1, 0, 0)(d, 1024);
    cudaDeviceSynchronize();
  };
  EXPECT_DEATH(fault(),
      "kernel Write \\(block \\(0, 0, 0\\)\\) wrote out of bounds: offset "
      "4096 of an allocation of 4096 bytes");
}

TEST_F(EmulationDeathTest, AKernelUsingFreedMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto fault = [] {
    float* d = nullptr;
    cudaMalloc(&d, 4096);
    cudaFree(d);
    DFLASH_LAUNCH(Fill, 1, 32, 0, 0)(d, 8, 1.0f);
    cudaDeviceSynchronize();
  };
  EXPECT_DEATH(fault(),
      "freed device memory");
}

// Work on two streams that uses one allocation must be ordered by an
// event: without one it is a race a GPU runs into at random, stopped here
// when the second use is queued; with one it runs.
TEST_F(EmulationDeathTest, AMissingEventBetweenStreamsIsCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto two_streams = [](bool with_event) {
    cudaStream_t a, b;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    float *x = nullptr, *y = nullptr;
    cudaMalloc(&x, 1024 * sizeof(float));
    cudaMalloc(&y, 1024 * sizeof(float));
    DFLASH_LAUNCH(Fill, 1, 64, 0, a)(x, 1024, 2.0f);
    if (with_event) {
      cudaEvent_t written;
      cudaEventCreate(&written);
      cudaEventRecord(written, a);
      cudaStreamWaitEvent(b, written);
    }
    DFLASH_LAUNCH(Copy, 1, 64, 0, b)(x, y, 1024);
    std::vector<float> out(1024);
    cudaMemcpyAsync(out.data(), y, 1024 * sizeof(float),
                    cudaMemcpyDeviceToHost, b);
    return out;
  };
  EXPECT_DEATH(two_streams(false),
               "kernel Copy on stream 0x[0-9a-f]+ uses the device allocation "
               "of 4096 bytes at 0x[0-9a-f]+ that kernel Fill on stream "
               "0x[0-9a-f]+ used, and no event or synchronisation orders the "
               "two");
  const std::vector<float> out = two_streams(true);
  EXPECT_EQ(out, std::vector<float>(1024, 2.0f));
}

TEST_F(EmulationDeathTest, AStreamOrderedFreeStillInUseOnAnotherStream) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto fault = [] {
    cudaStream_t a, b;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    float* x = nullptr;
    cudaMallocAsync(&x, 4096, a);
    DFLASH_LAUNCH(Fill, 1, 64, 0, a)(x, 1024, 1.0f);
    cudaFreeAsync(x, b);
  };
  EXPECT_DEATH(fault(),
      "cudaFreeAsync on stream 0x[0-9a-f]+ uses the device allocation of "
      "4096 bytes");
}

// ---------------------------------------------------------- stream capture

// A stream of the test's own, captured in `mode`; the capture, if still
// under way, and the stream end with it.
class CaptureTest : public EmulationTest {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
  }
  void TearDown() override {
    cudaStreamDestroy(stream_);
    EmulationTest::TearDown();
  }
  cudaStreamCaptureStatus Status() {
    cudaStreamCaptureStatus status;
    EXPECT_EQ(cudaStreamIsCapturing(stream_, &status), cudaSuccess);
    return status;
  }
  // Ends the capture expecting it invalidated: no graph.
  void ExpectInvalidated() {
    EXPECT_EQ(Status(), cudaStreamCaptureStatusInvalidated);
    cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(1);
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(cudaStreamEndCapture(stream_, &graph),
              cudaErrorStreamCaptureInvalidated);
    EXPECT_THAT(::testing::internal::GetCapturedStderr(),
                HasSubstr("was invalidated by a call it forbids"));
    EXPECT_EQ(graph, nullptr);
    EXPECT_EQ(Status(), cudaStreamCaptureStatusNone);
  }
  cudaStream_t stream_ = nullptr;
};

// A memset, a kernel and a device-to-device copy, captured once and
// launched three times with new input copied into the static buffer
// before each launch, give what the same work run eagerly gives (the
// products computed here in double).
TEST_F(CaptureTest, ACapturedSequenceReplaysOnEachLaunch) {
  constexpr int64_t kN = 300;
  constexpr float kFactor = 1.5f;
  float* d_in = ToDevice(std::vector<float>(kN, 0.0f));
  float* d_sum = ToDevice(std::vector<float>(kN, 7.0f));
  float* d_out = ToDevice(std::vector<float>(kN, -1.0f));
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d_sum, 0, kN * sizeof(float), stream_),
            cudaSuccess);
  DFLASH_LAUNCH(AccumulateScaled, 1, 64, 0, stream_)(d_in, d_sum, kN,
                                                      kFactor);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d_out, d_sum, kN * sizeof(float),
                            cudaMemcpyDeviceToDevice, stream_),
            cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 3u);
  // Captured work does not run at capture.
  EXPECT_EQ(ToHost(d_sum, kN), std::vector<float>(kN, 7.0f));
  EXPECT_EQ(ToHost(d_out, kN), std::vector<float>(kN, -1.0f));
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);  // The exec keeps a copy.
  for (int launch = 0; launch < 3; ++launch) {
    std::vector<float> in(kN);
    for (int64_t i = 0; i < kN; ++i) in[i] = 0.25f * (i % 17) - launch;
    ASSERT_EQ(cudaMemcpyAsync(d_in, in.data(), kN * sizeof(float),
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    std::vector<float> out(kN);
    ASSERT_EQ(cudaMemcpyAsync(out.data(), d_out, kN * sizeof(float),
                              cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(out[i], static_cast<float>(double{kFactor} * in[i]))
          << "launch " << launch << ", element " << i;
    }
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  cudaFree(d_in);
  cudaFree(d_sum);
  cudaFree(d_out);
}

// Stream-ordered memory allocated and freed inside a capture gets its
// address at capture and is allocated again by each launch; page-locked
// host memory is read when a launch runs, not at capture.
TEST_F(CaptureTest, CapturedAllocationsAndPageLockedCopiesReplay) {
  constexpr int64_t kN = 64;
  float* host = nullptr;
  ASSERT_EQ(cudaMallocHost(&host, kN * sizeof(float)), cudaSuccess);
  float* d_out = ToDevice(std::vector<float>(kN, 0.0f));
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  float* d_temp = nullptr;
  ASSERT_EQ(cudaMallocAsync(&d_temp, kN * sizeof(float), stream_),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d_temp, host, kN * sizeof(float),
                            cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d_out, 0, kN * sizeof(float), stream_),
            cudaSuccess);
  DFLASH_LAUNCH(AccumulateScaled, 1, 32, 0, stream_)(d_temp, d_out, kN,
                                                      2.0f);
  ASSERT_EQ(cudaFreeAsync(d_temp, stream_), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  // Outside a launch the graph's allocation does not exist.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cudaMemcpy(host, d_temp, 4, cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("freed allocation"));
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph), cudaSuccess);
  for (int launch = 0; launch < 2; ++launch) {
    for (int64_t i = 0; i < kN; ++i) host[i] = float(i) + 100.0f * launch;
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::vector<float> out = ToHost(d_out, kN);
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(out[i], 2.0 * (i + 100.0 * launch)) << launch << " " << i;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFreeHost(host);
  cudaFree(d_out);
}

// Each call CUDA forbids during a capture fails with CUDA's error, says
// why, and invalidates the capture: it ends with no graph.
TEST_F(CaptureTest, ForbiddenCallsFailAndInvalidateTheCapture) {
  float* d = ToDevice(std::vector<float>(16, 1.0f));
  std::vector<float> pageable(16);
  cudaEvent_t outside, inside;
  ASSERT_EQ(cudaEventCreate(&outside), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&inside), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(outside, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  struct Forbidden {
    const char* name;
    std::function<cudaError_t()> call;
    cudaError_t error;
  };
  const std::vector<Forbidden> calls = {
      {"cudaStreamSynchronize", [&] { return cudaStreamSynchronize(stream_); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaStreamQuery", [&] { return cudaStreamQuery(stream_); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaDeviceSynchronize", [] { return cudaDeviceSynchronize(); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaEventSynchronize", [&] { return cudaEventSynchronize(outside); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaEventQuery", [&] { return cudaEventQuery(outside); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaEventSynchronize",
       [&] {
         EXPECT_EQ(cudaEventRecord(inside, stream_), cudaSuccess);
         return cudaEventSynchronize(inside);
       },
       cudaErrorCapturedEvent},
      {"cudaMemcpy",
       [&] {
         return cudaMemcpy(d, pageable.data(), 64, cudaMemcpyHostToDevice);
       },
       cudaErrorStreamCaptureUnsupported},
      {"cudaMemcpy",
       [&] {
         return cudaMemcpy(pageable.data(), d, 64, cudaMemcpyDeviceToHost);
       },
       cudaErrorStreamCaptureUnsupported},
      {"is pageable",
       [&] {
         return cudaMemcpyAsync(d, pageable.data(), 64,
                                cudaMemcpyHostToDevice, stream_);
       },
       cudaErrorStreamCaptureUnsupported},
      {"is pageable",
       [&] {
         return cudaMemcpyAsync(pageable.data(), d, 64,
                                cudaMemcpyDeviceToHost, stream_);
       },
       cudaErrorStreamCaptureUnsupported},
      {"cudaMemset", [&] { return cudaMemset(d, 0, 64); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaMalloc",
       [] {
         void* p = nullptr;
         return cudaMalloc(&p, 64);
       },
       cudaErrorStreamCaptureUnsupported},
      {"cudaFree", [&] { return cudaFree(d); },
       cudaErrorStreamCaptureUnsupported},
      {"cudaMallocHost",
       [] {
         void* p = nullptr;
         return cudaMallocHost(&p, 64);
       },
       cudaErrorStreamCaptureUnsupported},
      {"recorded outside the capture",
       [&] { return cudaStreamWaitEvent(stream_, outside); },
       cudaErrorStreamCaptureIsolation},
  };
  for (const Forbidden& forbidden : calls) {
    SCOPED_TRACE(forbidden.name);
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
              cudaSuccess);
    DFLASH_LAUNCH(Fill, 1, 16, 0, stream_)(d, 16, 5.0f);
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(forbidden.call(), forbidden.error);
    EXPECT_THAT(::testing::internal::GetCapturedStderr(),
                HasSubstr(forbidden.name));
    cudaGetLastError();
    ExpectInvalidated();
  }
  // The refused cudaFree left the memory allocated, and no captured Fill
  // ran.
  EXPECT_EQ(ToHost(d, 16), std::vector<float>(16, 1.0f));
  cudaEventDestroy(outside);
  cudaEventDestroy(inside);
  cudaFree(d);
}

// Waiting for an event recorded in the capture, on the capturing stream,
// is in-stream order: allowed, as is a pinned copy.
TEST_F(CaptureTest, InStreamEventsAndPinnedCopiesAreAllowed) {
  cudaEvent_t event;
  ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);
  float* host = nullptr;
  ASSERT_EQ(cudaMallocHost(&host, 64), cudaSuccess);
  float* d = ToDevice(std::vector<float>(16, 1.0f));
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  ASSERT_EQ(cudaEventRecord(event, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(stream_, event), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(host, d, 64, cudaMemcpyDeviceToHost, stream_),
            cudaSuccess);
  EXPECT_EQ(Status(), cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  cudaEventDestroy(event);
  cudaFreeHost(host);
  cudaFree(d);
}

// Global mode forbids unsafe calls from every thread whose own mode is
// global; thread-local mode only the capturing thread's; relaxed none (but
// a capturing stream still cannot be synchronised).
TEST_F(CaptureTest, CaptureModesDecideWhoIsForbidden) {
  auto malloc_on_other_thread = [](cudaStreamCaptureMode own_mode) {
    cudaError_t result;
    std::thread other([&] {
      cudaStreamCaptureMode mode = own_mode;
      cudaThreadExchangeStreamCaptureMode(&mode);
      void* p = nullptr;
      result = cudaMalloc(&p, 64);
      if (result == cudaSuccess) cudaFreeAsync(p, nullptr);
      cudaThreadExchangeStreamCaptureMode(&mode);
    });
    other.join();
    return result;
  };
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
            cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(Status(), cudaStreamCaptureStatusActive);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 64), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeRelaxed),
            cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeThreadLocal),
            cudaSuccess);
  EXPECT_EQ(Status(), cudaStreamCaptureStatusActive);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeGlobal),
            cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed),
            cudaSuccess);
  ASSERT_EQ(cudaMalloc(&p, 64), cudaSuccess);
  EXPECT_EQ(Status(), cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();
  cudaFree(p);
}

TEST_F(CaptureTest, CaptureStatusAndItsMisuses) {
  EXPECT_EQ(Status(), cudaStreamCaptureStatusNone);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal),
            cudaErrorStreamCaptureUnsupported);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorIllegalState);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaErrorIllegalState);
  cudaStreamCaptureStatus status;
  unsigned long long first = 0, second = 0;
  ASSERT_EQ(cudaStreamGetCaptureInfo(stream_, &status, &first), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  // A global capture ends on the thread that began it.
  cudaError_t elsewhere;
  std::thread([&] { elsewhere = cudaStreamEndCapture(stream_, &graph); })
      .join();
  EXPECT_EQ(elsewhere, cudaErrorStreamCaptureWrongThread);
  EXPECT_EQ(Status(), cudaStreamCaptureStatusActive);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  size_t nodes = 1;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 0u);
  cudaGraphDestroy(graph);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  ASSERT_EQ(cudaStreamGetCaptureInfo(stream_, &status, &second), cudaSuccess);
  EXPECT_NE(first, second);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  EXPECT_EQ(Status(), cudaStreamCaptureStatusNone);
  ::testing::internal::GetCapturedStderr();
}

// The legacy default stream waits for every blocking stream, so it cannot
// take work while one captures.
TEST_F(CaptureTest, TheLegacyStreamCannotWaitForACapturingBlockingStream) {
  cudaStream_t blocking;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  float* d = ToDevice(std::vector<float>(16, 1.0f));
  ASSERT_EQ(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  ::testing::internal::CaptureStderr();
  DFLASH_LAUNCH(Fill, 1, 16, 0, 0)(d, 16, 5.0f);
  EXPECT_EQ(cudaGetLastError(), cudaErrorStreamCaptureImplicit);
  cudaStreamCaptureStatus status;
  EXPECT_EQ(cudaStreamIsCapturing(nullptr, &status),
            cudaErrorStreamCaptureImplicit);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("kernel Fill on the legacy default stream"));
  cudaGetLastError();
  cudaGraph_t graph = nullptr;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cudaStreamEndCapture(blocking, &graph),
            cudaErrorStreamCaptureInvalidated);
  ::testing::internal::GetCapturedStderr();
  cudaStreamDestroy(blocking);
  EXPECT_EQ(ToHost(d, 16), std::vector<float>(16, 1.0f));
  cudaFree(d);
}

}  // namespace
