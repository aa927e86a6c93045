#ifndef DFLASH_BENCH_CUDA_STREAM_FLOOR_H_
#define DFLASH_BENCH_CUDA_STREAM_FLOOR_H_

#include <cstdint>

struct CUstream_st;

namespace dflash {

// The memory traffic a loss over `count` logits cannot avoid, and nothing
// else: data[i] = data[i] + other[i] (other may be null: data[i] read and
// written back), on the device's full grid. The CUDA loss benchmarks time
// it in the same process as their floor. T is float or BFloat16.
template <typename T>
void LaunchStreamFloor(T* data, const T* other, int64_t count,
                       CUstream_st* stream);

}  // namespace dflash

#endif  // DFLASH_BENCH_CUDA_STREAM_FLOOR_H_
