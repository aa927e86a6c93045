#include <cuda_runtime.h>

#include "base/bfloat16.h"
#include "base/cuda_launch.h"
#include "bench/cuda_stream_floor.h"

namespace dflash {
namespace {


template <typename T>
__global__ void StreamFloorKernel(T* data, const T* other, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float extra = other != nullptr ? ToFloat(other[i]) : 0.0f;
    data[i] = FromFloat<T>(ToFloat(data[i]) + extra);
  }
}

}  // namespace

template <typename T>
void LaunchStreamFloor(T* data, const T* other, int64_t count,
                       CUstream_st* stream) {
  if (count == 0) return;
  DFLASH_LAUNCH(StreamFloorKernel<T>, 4096, 256, 0, stream)
  (data, other, count);
}

template void LaunchStreamFloor<float>(float*, const float*, int64_t,
                                       CUstream_st*);
template void LaunchStreamFloor<BFloat16>(BFloat16*, const BFloat16*, int64_t,
                                          CUstream_st*);

}  // namespace dflash
