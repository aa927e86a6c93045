#ifndef DFLASH_HEADS_CUDA_HEAD_KERNELS_H_
#define DFLASH_HEADS_CUDA_HEAD_KERNELS_H_

// Small CUDA kernels of the CUDA head: row gather and scatter by index,
// bias add and bias gradient. T is float or dflash::BFloat16; every pointer
// is device memory; launches are queued on `stream`.

#include <cstdint>

#include "base/host_device.h"
#include "losses/loss_params.h"
#include "losses/row_meta.h"

struct CUstream_st;

namespace dflash {
namespace cuda {

// out[i, :] = source[rows[i], :], i < count, rows of `width` values; a
// negative rows[i] gives a row of zeros (a row without weight, whose
// hidden state is never read: a NaN there must not reach grad_W).
template <typename T>
void LaunchGatherRows(const T* source, int64_t width, const int64_t* rows,
                      int64_t count, T* out, CUstream_st* stream);

// out[rows[i], :] = values[i, :]; a negative rows[i] writes nothing.
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
// (*device_scale instead of scale where given.)
template <typename T>
void LaunchScaleToStorage(const float* sum, int64_t count, double scale,
                          T* out, CUstream_st* stream,
                          const double* device_scale = nullptr);

// out[i] = values[i] * scale rounded to float once, i < count: the
// confidence gradient, written per row in double by the loss
// (*device_scale instead of scale where given).
void LaunchScaleDoubleToFloat(const double* values, int64_t count,
                              double scale, float* out, CUstream_st* stream,
                              const double* device_scale = nullptr);

// head.device_results: out[kBlockTermsSize] (losses/device_results.h) =
// the accepted-length terms (AcceptedLengths, losses/accepted_length.h)
// of `count` rows in batch order (row r at block r / K, position r % K)
// from their q, rank (null: no oracle length) and teacher acceptance
// (null: none), then the weighted sequences of SEQUENCE_BALANCED D-PACE
// (WeightedSequences); the host's formulas (loss_math.h), summed in a
// fixed order. One CUDA block, queued.
void LaunchBlockTerms(const RowMeta* rows, int64_t count, int64_t block_size,
                      int64_t first_position, const LossParams& loss,
                      const double* q, const int32_t* rank,
                      const double* teacher, double* out,
                      CUstream_st* stream);

// data[i] = value for i < count (e.g. -1 for argmax and top-k outputs).
void LaunchFillInt32(int32_t* data, int64_t count, int32_t value,
                     CUstream_st* stream);

// BuildCudaRows's kernels (heads/cuda_head.h): RowsOf's rules
// (python/native/objective.cc) on the device.

// A [B, N, K] tensor of target ids or weight masks in device memory, its
// strides in elements.
enum RowsDType : int32_t {
  kRowsInt32 = 0,
  kRowsInt64 = 1,
  kRowsFloat32 = 2,
  kRowsFloat64 = 3,
  kRowsBool = 4,  // One byte, 0 or 1.
};
struct RowsTensor {
  const void* data = nullptr;
  RowsDType dtype = kRowsInt64;
  int64_t strides[3] = {0, 0, 0};
};

struct BuildRowsParams {
  int64_t batch = 0, anchors = 0, block = 0;  // B, N, K.
  int64_t vocab = 0;
  int64_t ignore_index = -100;
  bool count_ignored = false;
  // Masks kept in float64 (else rounded to float32), and the largest sum
  // of the raw masks the terms' dtype holds.
  bool float64_terms = false;
  double max_sum = 0;
  // D-PACE SEQUENCE_BALANCED (loss.sequence_balanced): each row's
  // sequence_share over sequences of `sequence_rows` rows.
  LossParams loss;
  int64_t sequence_rows = 0;
};

// The first bad element e (the linear index b N K + n K + k, RowsOf's
// order) and what is wrong with it, as an atomic minimum of e << 2 | kind:
// the first element wins, and within it RowsOf's order of checks.
enum RowsErrorKind : int32_t {
  kRowsMaskInvalid = 0,   // weight_mask: not finite, or negative.
  kRowsMaskSumOverflow = 1,  // The masks' running sum passed max_sum here.
  kRowsTargetInvalid = 2,  // target_ids: outside [0, V) and not ignored.
};
constexpr unsigned long long kNoRowsError = ~0ull;
DFLASH_HOST_DEVICE inline unsigned long long RowsErrorCode(int64_t element,
                                                           RowsErrorKind kind) {
  return (static_cast<unsigned long long>(element) << 2) |
         static_cast<unsigned long long>(kind);
}

// The masks' sums in tiles of this many elements (the overflow check's
// scratch: one double per tile).
constexpr int64_t kRowsSumTile = 256;

// rows[e] for every element e < B N K, as RowsOf makes them (a bad element
// gets mask 0, so that nothing downstream reads its target), the first bad
// element in *error (which the launch sets to kNoRowsError first), and,
// with params.loss.sequence_balanced, the sequence shares
// (SetSequenceShares). `tile_sums`: ceil(B N K / kRowsSumTile) doubles of
// scratch.
void LaunchBuildRows(const RowsTensor& target_ids,
                     const RowsTensor& weight_mask,
                     const BuildRowsParams& params, RowMeta* rows,
                     unsigned long long* error, double* tile_sums,
                     CUstream_st* stream);

// ALL_ROWS's row lists over `count` rows: all[i] = i, and weighted[i] = i
// where EffectiveMask(loss, ...) > 0, else -1 (for the masked gather and
// scatter above).
void LaunchRowLists(const RowMeta* rows, int64_t count, const LossParams& loss,
                    int64_t* all, int64_t* weighted, CUstream_st* stream);

}  // namespace cuda
}  // namespace dflash

#endif  // DFLASH_HEADS_CUDA_HEAD_KERNELS_H_
