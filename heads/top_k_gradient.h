#ifndef DFLASH_HEADS_TOP_K_GRADIENT_H_
#define DFLASH_HEADS_TOP_K_GRADIENT_H_

// The backward of the head's top-k values (HeadRowOutputs::top_k_values):
// a DFlash2 candidate selector scores the k largest logits of each row, and
// its gradient with respect to those values reaches the hidden states (and
// a trainable projection) as a sparse update, without projecting again.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "heads/head_types.h"
#include "proto/objective.pb.h"

namespace dflash {

// For each row r and j < k with id = ids[r, j] >= 0, the value v = z'(z),
// z = hidden[r] . weight[id] (+ bias[id]) (+ u[r] . M[id] with a
// correction, head.correction_rank > 0: u = inputs.correction_inputs, M =
// inputs.correction_weight), z' the head's logit transform:
//   gradients.hidden[r] += c * weight[id]
//   gradients.weight[id] += c * hidden[r], gradients.bias[id] += c
// (the last two when head.trainable)
//   gradients.correction_inputs[r] += c * M[id]
//   gradients.correction_weight[id] += c * u[r]
// (each when its span is given), c = grad_values[r, j] * dz'/dz, read
// off v. Adds to what is there (RunHead's gradients, already scaled). Ids
// of -1 (rows without mask) add nothing. T is float or double, on the CPU;
// the values and their gradients are in T too, so that a float64 head's
// update is exact. Sizes and ids are checked first, and nothing is written
// on an error.
template <typename T>
absl::Status AddTopKValueGradients(const v1::ObjectiveConfig& config,
                                   const HeadInputs<T>& inputs,
                                   absl::Span<const int32_t> ids,
                                   absl::Span<const T> values,
                                   absl::Span<const T> grad_values, int32_t k,
                                   const HeadGradients<T>& gradients);

// The checks AddTopKValueGradients makes, shared with the CUDA version:
// k in [1, 64] (the CUDA kernel holds a row's k factors in shared memory,
// heads/cuda_head_kernels.cu's kMaxTopK), sizes of rows x k for ids, values and grad_values, rows x H
// for the hidden states and their gradient, V x H for the weight (and its
// gradient when trainable), and ids in [-1, V) (ids are read on the host).
// The correction's spans: none without head.correction_rank; with rank r,
// u of rows x r and M of V x r, each gradient empty (not wanted) or of its
// input's size.
absl::Status ValidateTopKCorrection(const v1::ObjectiveConfig& config,
                                    int64_t rows, size_t inputs, size_t weight,
                                    size_t grad_inputs, size_t grad_weight);

absl::Status ValidateTopKValueGradients(const v1::ObjectiveConfig& config,
                                        int64_t rows, size_t hidden,
                                        size_t weight, size_t grad_hidden,
                                        size_t grad_weight,
                                        absl::Span<const int32_t> ids,
                                        size_t values, size_t grad_values,
                                        int32_t k);

}  // namespace dflash

#endif  // DFLASH_HEADS_TOP_K_GRADIENT_H_
