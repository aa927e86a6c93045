#ifndef DFLASH_HEADS_PROJECTION_H_
#define DFLASH_HEADS_PROJECTION_H_

// VocabProjection, the interface through which the heads compute logits
// from hidden rows and the gradients back (input and weight), counting
// their GEMM work (GemmCount). CreateCpuProjection makes the CPU one on
// OpenBLAS; another backend implements the same interface.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dflash {

// GEMM work a projection has done, for the heads' cost accounting.
struct GemmCount {
  int64_t calls = 0;
  double flops = 0;  // 2 * m * n * k per call.
  double seconds = 0;
};

// A vocabulary projection: weight [V, H] (row-major, as torch's lm_head),
// optional bias [V]. Rows are contiguous [m, H]; logits [m, V] with rows
// logits_stride() apart (V on the CPU; the CUDA projection pads rows to 16
// bytes for the loss's vector loads, and keeps the padding zero). A backend
// (CPU here, CUDA in //heads/cuda) implements the three products; the fused
// head only talks to this interface.
template <typename T>
class VocabProjection {
 public:
  virtual ~VocabProjection() = default;

  int64_t vocab() const { return vocab_; }
  int64_t hidden() const { return hidden_; }
  int64_t logits_stride() const { return logits_stride_; }
  const GemmCount& gemms() const { return gemms_; }

  // logits = rows @ W^T + bias.
  virtual void Forward(const T* rows, int64_t m, T* logits) = 0;
  // logits += rows @ W^T, without the bias: a second projection adding into
  // the same logits (the head's low-rank correction).
  virtual void AddForward(const T* rows, int64_t m, T* logits) = 0;
  // grad_rows = grad_logits @ W.
  virtual void InputGradient(const T* grad_logits, int64_t m,
                             T* grad_rows) = 0;
  // grad_rows (+)= grad_logits[:, begin:end) @ W[begin:end), over a range
  // of the vocabulary (grad_logits rows still V wide): `accumulate` adds,
  // else overwrites. The gradient filter's GEMM.
  virtual void InputGradientColumns(const T* grad_logits, int64_t m,
                                    int64_t begin, int64_t end, bool accumulate,
                                    T* grad_rows) = 0;
  // grad_weight += grad_logits^T @ rows; grad_bias += column sums (when
  // non-null).
  virtual void AccumulateWeightGradient(const T* grad_logits, const T* rows,
                                        int64_t m, T* grad_weight,
                                        T* grad_bias) = 0;

  // The first error of the products so far: a backend that queues them
  // (CUDA) learns of a failure after the call; the CPU's never fail.
  virtual absl::Status status() const { return absl::OkStatus(); }

 protected:
  VocabProjection(int64_t vocab, int64_t hidden, int64_t logits_stride = 0)
      : vocab_(vocab),
        hidden_(hidden),
        logits_stride_(logits_stride > 0 ? logits_stride : vocab) {}
  // A product of m rows over `columns` of the vocabulary (all by default).
  void Count(int64_t m, double seconds, int64_t columns = -1) {
    ++gemms_.calls;
    gemms_.flops += 2.0 * static_cast<double>(m) *
                    (columns < 0 ? vocab_ : columns) * hidden_;
    gemms_.seconds += seconds;
  }

 private:
  const int64_t vocab_;
  const int64_t hidden_;
  const int64_t logits_stride_;
  GemmCount gemms_;
};

// The checks every projection makes: vocab and hidden in [1, 2^31) (BLAS
// dimensions are 32-bit), a weight of vocab x hidden values, a bias of vocab
// values or none.
absl::Status ValidateProjectionShape(size_t weight_size, size_t bias_size,
                                     int64_t vocab, int64_t hidden);

}  // namespace dflash

#endif  // DFLASH_HEADS_PROJECTION_H_
