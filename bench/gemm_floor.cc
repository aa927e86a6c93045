#include "bench/gemm_floor.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace dflash {
namespace {

// Best of `repeats` of the pair, `chunk` rows at a time.
double PairSeconds(int64_t rows, int64_t hidden, int64_t vocab, int64_t chunk,
                   int repeats) {
  const int64_t h = hidden, v = vocab;
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

}  // namespace

double GemmFloorSeconds(int64_t rows, int64_t hidden, int64_t vocab,
                        int64_t rows_per_chunk, int repeats) {
  const double whole = PairSeconds(rows, hidden, vocab, rows, repeats);
  if (rows_per_chunk <= 0 || rows_per_chunk >= rows) return whole;
  return std::min(whole,
                  PairSeconds(rows, hidden, vocab, rows_per_chunk, repeats));
}

}  // namespace dflash
