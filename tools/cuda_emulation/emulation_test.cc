// The CUDA emulation itself: kernels run with CUDA's semantics, and each
// kind of fault a GPU run would hit (or hide) is caught with its message,
// so the emulated suites cannot pass by running nothing.
#include "tools/cuda_emulation/emulated_cuda.h"

#include <atomic>
#include <numeric>
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

}  // namespace
