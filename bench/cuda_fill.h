#ifndef DFLASH_BENCH_CUDA_FILL_H_
#define DFLASH_BENCH_CUDA_FILL_H_

#include <cstdint>

struct CUstream_st;

namespace dflash {

// data[i] = scale * N(0, 1) from a counter-based generator (seeded, the same
// on every run), computed on the device: benchmark tensors of gigabytes
// without generating them on the host. T is float or BFloat16.
template <typename T>
void LaunchFillNormal(T* data, int64_t count, float scale, uint64_t seed,
                      CUstream_st* stream);

}  // namespace dflash

#endif  // DFLASH_BENCH_CUDA_FILL_H_
