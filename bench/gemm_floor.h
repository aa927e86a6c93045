#ifndef DFLASH_BENCH_GEMM_FLOOR_H_
#define DFLASH_BENCH_GEMM_FLOOR_H_

#include <cstdint>

namespace dflash {

// Seconds of the two GEMMs a frozen head cannot avoid for `rows` projected
// rows (logits = X W^T, [rows, V]; grad = D W, [rows, H]), timed with plain
// cblas_sgemm, best of `repeats`. With 0 < rows_per_chunk < rows the pair
// runs chunk by chunk, as a chunked head issues it.
double GemmFloorSeconds(int64_t rows, int64_t hidden, int64_t vocab,
                        int repeats = 2, int64_t rows_per_chunk = 0);

}  // namespace dflash

#endif  // DFLASH_BENCH_GEMM_FLOOR_H_
