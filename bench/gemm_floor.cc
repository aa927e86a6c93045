#include "bench/gemm_floor.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace dflash {

double GemmFloorSeconds(int64_t rows, int64_t hidden, int64_t vocab,
                        int repeats, int64_t rows_per_chunk) {
  const int64_t h = hidden, v = vocab;
  const int64_t chunk =
      rows_per_chunk > 0 ? std::min(rows_per_chunk, rows) : rows;
  std::vector<float> x(rows * h, 0.01f), w(v * h, 0.02f), logits(chunk * v),
      grad(rows * h);
  double best = 1e30;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t begin = 0; begin < rows; begin += chunk) {
      const int64_t m = std::min(chunk, rows - begin);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, v, h, 1.0f,
                  x.data() + begin * h, h, w.data(), h, 0.0f, logits.data(), v);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, h, v, 1.0f,
                  logits.data(), v, w.data(), h, 0.0f, grad.data() + begin * h,
                  h);
    }
    best = std::min(best, std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - start)
                              .count());
  }
  return best;
}

}  // namespace dflash
