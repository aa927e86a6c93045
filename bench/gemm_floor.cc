#include "bench/gemm_floor.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace dflash {

double GemmFloorSeconds(int64_t rows, int64_t hidden, int64_t vocab,
                        int repeats) {
  const int64_t h = hidden, v = vocab;
  std::vector<float> x(rows * h, 0.01f), w(v * h, 0.02f), logits(rows * v),
      grad(rows * h);
  double best = 1e30;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, v, h, 1.0f,
                x.data(), h, w.data(), h, 0.0f, logits.data(), v);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, h, v, 1.0f,
                logits.data(), v, w.data(), h, 0.0f, grad.data(), h);
    best = std::min(best, std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - start)
                              .count());
  }
  return best;
}

}  // namespace dflash
