#ifndef DFLASH_TOOLS_CUDA_EMULATION_COPIES_TEST_UTIL_H_
#define DFLASH_TOOLS_CUDA_EMULATION_COPIES_TEST_UTIL_H_

// Host vectors into device memory and back for the emulation's own tests,
// each CUDA call's status checked.

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"
#include "tools/cuda_emulation/emulated_cuda.h"

namespace dflash_emu_test {

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  return device;
}

template <typename T>
std::vector<T> ToHost(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

}  // namespace dflash_emu_test

#endif  // DFLASH_TOOLS_CUDA_EMULATION_COPIES_TEST_UTIL_H_
