#ifndef DFLASH_BENCH_CUDA_GEMM_FLOOR_H_
#define DFLASH_BENCH_CUDA_GEMM_FLOOR_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "heads/cuda_projection.h"

namespace dflash {

// Seconds of the two GEMMs a frozen head cannot avoid for `rows` projected
// rows (logits = X W^T, [rows, V]; grad = D W, [rows, H]), BF16 inputs and
// outputs with FP32 accumulation (or FP32 throughout), as cublasGemmEx runs
// them on `blas`'s stream, timed with CUDA events, best of `repeats` after a
// warm-up: the faster of one pair over all rows and, with 0 <
// rows_per_chunk < rows, the pair chunk by chunk (as CPU GemmFloorSeconds).
absl::StatusOr<double> CudaGemmFloorSeconds(CublasHandle& blas, int64_t rows,
                                            int64_t hidden, int64_t vocab,
                                            bool bfloat16,
                                            int64_t rows_per_chunk,
                                            int repeats = 3);

}  // namespace dflash

#endif  // DFLASH_BENCH_CUDA_GEMM_FLOOR_H_
