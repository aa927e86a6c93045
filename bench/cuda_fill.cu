#include <cuda_runtime.h>

#include "base/bfloat16.h"
#include "base/cuda_launch.h"
#include "bench/cuda_fill.h"

namespace dflash {
namespace {

__device__ __forceinline__ uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}


// Box-Muller on two uniforms from one 64-bit draw.
template <typename T>
__global__ void FillNormalKernel(T* data, int64_t count, float scale,
                                 uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t bits = SplitMix(seed ^ SplitMix(static_cast<uint64_t>(i)));
    const float u1 = ((bits >> 40) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = ((bits >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    data[i] =
        FromFloat<T>(scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

}  // namespace

template <typename T>
void LaunchFillNormal(T* data, int64_t count, float scale, uint64_t seed,
                      CUstream_st* stream) {
  if (count == 0) return;
  DFLASH_LAUNCH(FillNormalKernel<T>, 4096, 256, 0, stream)
  (data, count, scale, seed);
}

template void LaunchFillNormal<float>(float*, int64_t, float, uint64_t,
                                      CUstream_st*);
template void LaunchFillNormal<BFloat16>(BFloat16*, int64_t, float, uint64_t,
                                         CUstream_st*);

}  // namespace dflash
