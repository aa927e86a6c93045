#ifndef DFLASH_BENCH_GEMM_FLOOR_H_
#define DFLASH_BENCH_GEMM_FLOOR_H_

#include <cstdint>

namespace dflash {

// Seconds of the two GEMMs a frozen head cannot avoid for `rows` projected
// rows (logits = X W^T, [rows, V]; grad = D W, [rows, H]), timed with plain
// cblas_sgemm, best of `repeats`: the faster of one pair over all rows and,
// with 0 < rows_per_chunk < rows, the pair chunk by chunk as a chunked head
// issues it, so that no mode is flattered by a slow floor.
double GemmFloorSeconds(int64_t rows, int64_t hidden, int64_t vocab,
                        int64_t rows_per_chunk, int repeats = 2);

}  // namespace dflash

#endif  // DFLASH_BENCH_GEMM_FLOOR_H_
