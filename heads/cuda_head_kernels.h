#ifndef DFLASH_HEADS_CUDA_HEAD_KERNELS_H_
#define DFLASH_HEADS_CUDA_HEAD_KERNELS_H_

// Small CUDA kernels of the CUDA head: row gather and scatter by index,
// bias add and bias gradient. T is float or dflash::BFloat16; every pointer
// is device memory; launches are queued on `stream`.

#include <cstdint>

struct CUstream_st;

namespace dflash {
namespace cuda {

// out[i, :] = source[rows[i], :], i < count, rows of `width` values.
template <typename T>
void LaunchGatherRows(const T* source, int64_t width, const int64_t* rows,
                      int64_t count, T* out, CUstream_st* stream);

// out[rows[i], :] = values[i, :].
template <typename T>
void LaunchScatterRows(const T* values, int64_t width, const int64_t* rows,
                       int64_t count, T* out, CUstream_st* stream);

// logits[i, v] += bias[v] for a [count, vocab] block, rows `stride` apart.
template <typename T>
void LaunchAddBias(T* logits, const T* bias, int64_t count, int64_t vocab,
                   int64_t stride, CUstream_st* stream);

// grad_bias[v] += sum_i grad_logits[i, v], summed in FP32, rows `stride`
// apart; S is T, or float for an FP32 sum of BF16 gradients.
template <typename T, typename S>
void LaunchAccumulateBiasGradient(const T* grad_logits, int64_t count,
                                  int64_t vocab, int64_t stride, S* grad_bias,
                                  CUstream_st* stream);

// AddTopKValueGradients (heads/top_k_gradient.h) on the device: one block
// per row adds sum_j c[r, j] W[ids[r, j]] to grad_hidden[r], c = grad_values
// * dz'/dz read off the values (the head's logit scale and softcap); with
// grad_weight, grad_weight[id] += c x[r] and grad_bias[id] += c by atomic
// adds (bfloat16 by compare-and-swap, rounded at each add). With a
// correction of rank > 0 (u [rows, rank], M [V, rank]) likewise
// grad_correction_inputs[r] += sum_j c M[id] and, atomically,
// grad_correction_weight[id] += c u[r], each where given (the rank's pass is
// skipped where neither is). Ids of -1 add nothing. k lies in [1, 64]
// (ValidateTopKValueGradients): a row's factors sit in shared memory.
template <typename T>
void LaunchAddTopKValueGradients(const T* hidden, const T* weight,
                                 const int32_t* ids, const float* values,
                                 const float* grad_values, int64_t rows,
                                 int32_t k, int64_t width, double logit_scale,
                                 double logit_softcap, T* grad_hidden,
                                 T* grad_weight, T* grad_bias,
                                 const T* correction_inputs,
                                 const T* correction_weight, int64_t rank,
                                 T* grad_correction_inputs,
                                 T* grad_correction_weight,
                                 CUstream_st* stream);

// out[i] = sum[i] * scale rounded to T once, i < count: a gradient summed
// in FP32 and stored in T.
template <typename T>
void LaunchScaleToStorage(const float* sum, int64_t count, double scale,
                          T* out, CUstream_st* stream);

// out[i] = values[i] * scale rounded to float once, i < count: the
// confidence gradient, written per row in double by the loss.
void LaunchScaleDoubleToFloat(const double* values, int64_t count,
                              double scale, float* out, CUstream_st* stream);

// data[i] = value for i < count (e.g. -1 for argmax and top-k outputs).
void LaunchFillInt32(int32_t* data, int64_t count, int32_t value,
                     CUstream_st* stream);

}  // namespace cuda
}  // namespace dflash

#endif  // DFLASH_HEADS_CUDA_HEAD_KERNELS_H_
