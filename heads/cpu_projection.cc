#include "heads/cpu_projection.h"

#include <cblas.h>

#include <chrono>
#include <limits>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace dflash {
namespace {

template <typename T>
void Gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int64_t m,
          int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb,
                beta, c, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, trans_a, trans_b, m, n, k, 1.0, a, lda, b, ldb,
                beta, c, ldc);
  }
}

double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

template <typename T>
class CpuProjection final : public VocabProjection<T> {
 public:
  CpuProjection(const T* weight, const T* bias, int64_t vocab, int64_t hidden)
      : VocabProjection<T>(vocab, hidden), weight_(weight), bias_(bias) {}

  void Forward(const T* rows, int64_t m, T* logits) override {
    if (m == 0) return;
    const int64_t v = this->vocab(), h = this->hidden();
    const auto start = std::chrono::steady_clock::now();
    Gemm<T>(CblasNoTrans, CblasTrans, m, v, h, rows, h, weight_, h, T(0),
            logits, v);
    this->Count(m, Since(start));
    if (bias_ == nullptr) return;
    for (int64_t r = 0; r < m; ++r) {
      T* row = logits + r * v;
      for (int64_t j = 0; j < v; ++j) row[j] += bias_[j];
    }
  }

  void AddForward(const T* rows, int64_t m, T* logits) override {
    if (m == 0) return;
    const int64_t v = this->vocab(), h = this->hidden();
    const auto start = std::chrono::steady_clock::now();
    Gemm<T>(CblasNoTrans, CblasTrans, m, v, h, rows, h, weight_, h, T(1),
            logits, v);
    this->Count(m, Since(start));
  }

  void InputGradient(const T* grad_logits, int64_t m, T* grad_rows) override {
    if (m == 0) return;
    const int64_t v = this->vocab(), h = this->hidden();
    const auto start = std::chrono::steady_clock::now();
    Gemm<T>(CblasNoTrans, CblasNoTrans, m, h, v, grad_logits, v, weight_, h,
            T(0), grad_rows, h);
    this->Count(m, Since(start));
  }

  void InputGradientColumns(const T* grad_logits, int64_t m, int64_t begin,
                            int64_t end, bool accumulate,
                            T* grad_rows) override {
    if (m == 0 || end <= begin) return;
    const int64_t v = this->vocab(), h = this->hidden();
    const auto start = std::chrono::steady_clock::now();
    Gemm<T>(CblasNoTrans, CblasNoTrans, m, h, end - begin, grad_logits + begin,
            v, weight_ + begin * h, h, accumulate ? T(1) : T(0), grad_rows, h);
    this->Count(m, Since(start), end - begin);
  }

  void AccumulateWeightGradient(const T* grad_logits, const T* rows, int64_t m,
                                T* grad_weight, T* grad_bias) override {
    if (m == 0) return;
    const int64_t v = this->vocab(), h = this->hidden();
    const auto start = std::chrono::steady_clock::now();
    Gemm<T>(CblasTrans, CblasNoTrans, v, h, m, grad_logits, v, rows, h, T(1),
            grad_weight, h);
    this->Count(m, Since(start));
    if (grad_bias == nullptr) return;
    for (int64_t r = 0; r < m; ++r) {
      const T* row = grad_logits + r * v;
      for (int64_t j = 0; j < v; ++j) grad_bias[j] += row[j];
    }
  }

 private:
  const T* const weight_;
  const T* const bias_;
};

}  // namespace

std::string CpuBlasName() {
  // The config starts "OpenBLAS 0.3.21 ..."; keep the name and version.
  const std::vector<absl::string_view> words =
      absl::StrSplit(openblas_get_config(), ' ');
  return absl::StrCat(words[0], words.size() > 1 ? " " : "",
                      words.size() > 1 ? words[1] : "", " (",
                      openblas_get_corename(), " kernels)");
}

template <typename T>
absl::StatusOr<std::unique_ptr<VocabProjection<T>>> CreateCpuProjection(
    absl::Span<const T> weight, absl::Span<const T> bias, int64_t vocab,
    int64_t hidden) {
  if (absl::Status valid =
          ValidateProjectionShape(weight.size(), bias.size(), vocab, hidden);
      !valid.ok()) {
    return valid;
  }
  return std::unique_ptr<VocabProjection<T>>(new CpuProjection<T>(
      weight.data(), bias.empty() ? nullptr : bias.data(), vocab, hidden));
}

template absl::StatusOr<std::unique_ptr<VocabProjection<float>>>
    CreateCpuProjection<float>(absl::Span<const float>, absl::Span<const float>,
                               int64_t, int64_t);
template absl::StatusOr<std::unique_ptr<VocabProjection<double>>>
    CreateCpuProjection<double>(absl::Span<const double>,
                                absl::Span<const double>, int64_t, int64_t);

}  // namespace dflash
