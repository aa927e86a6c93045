#ifndef DFLASH_CHUNKING_CHUNKED_REDUCE_H_
#define DFLASH_CHUNKING_CHUNKED_REDUCE_H_

// ChunkedReduction runs a ChunkFunction over chunks of its inputs along one
// dimension, sums the chunks' additive Terms, and backpropagates into the
// inputs' gradients, optionally recomputing each chunk (checkpointing), as
// SpecForge's checkpointed_chunk_reduce does. Use it for a reduction (a
// loss) whose per-row intermediates are too large to hold all at once.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/tensor.h"

namespace dflash {

// One additive term of a chunk (a scalar is a term of size 1). Terms of all
// chunks are summed elementwise, unweighted; weighting happens inside the
// chunk function, which returns numerators and denominators.
using Term = std::vector<double>;
using Terms = std::vector<Term>;

// Slices of the inputs for one chunk; an absent input stays absent.
using Slices = absl::Span<const std::optional<TensorView>>;

// What a chunked reduction runs per chunk.
class ChunkFunction {
 public:
  virtual ~ChunkFunction() = default;
  // The chunk's additive terms.
  virtual absl::StatusOr<Terms> Forward(Slices slices) = 0;
  // Adds d(sum_i grad_terms[i] . terms[i]) / d(slices) into grad_slices
  // (absent where an input needs no gradient). A checkpointed chunk has its
  // Forward run again right before this call.
  virtual absl::Status Backward(Slices slices, const Terms& grad_terms,
                                Slices grad_slices) = 0;
};

struct ChunkedReduceOptions {
  // 0: the whole dimension in one call, never checkpointed. Must be >= 0.
  int64_t chunk_size = 0;
  // Negative counts from the end, per input (inputs may differ in rank).
  int64_t dim = 0;
  // Default true, as SpecForge's `checkpoint` argument.
  bool checkpoint = true;
  // Whether gradients are enabled (torch.is_grad_enabled()).
  bool grad_enabled = true;
};

// SpecForge's checkpointed_chunk_reduce: validates, runs Forward over
// [start, start + chunk_size) slices (views, no copies; the last chunk is
// the remainder) and sums the terms in chunk order. A chunk is checkpointed
// when checkpoint is on, chunk_size > 0, gradients are enabled and some input
// needs a gradient (has a gradient tensor); it is then recomputed whole in
// Backward. Inputs and gradient tensors must outlive the reduction.
class ChunkedReduction {
 public:
  // `grads[i]`, when present, receives d/d(inputs[i]) and marks that input
  // as needing a gradient; it must have the input's length along `dim`.
  // `grads` may be empty (no input needs a gradient).
  static absl::StatusOr<ChunkedReduction> Run(
      ChunkFunction& function, std::vector<std::optional<TensorView>> inputs,
      const ChunkedReduceOptions& options,
      std::vector<std::optional<TensorView>> grads = {});

  const Terms& terms() const { return terms_; }
  int64_t num_chunks() const { return static_cast<int64_t>(bounds_.size()); }
  bool checkpointed() const { return checkpointed_; }
  // Forward calls made again in Backward.
  int64_t recomputations() const { return recomputations_; }

  // Backpropagates grad_terms (one per term, same sizes) into the gradient
  // tensors given to Run, chunk by chunk in order.
  absl::Status Backward(const Terms& grad_terms);

 private:
  ChunkedReduction() = default;
  absl::Status SliceAll(const std::vector<std::optional<TensorView>>& all,
                        int64_t start, int64_t length,
                        std::vector<std::optional<TensorView>>& out) const;

  ChunkFunction* function_ = nullptr;
  std::vector<std::optional<TensorView>> inputs_;
  std::vector<std::optional<TensorView>> grads_;
  std::vector<int64_t> dims_;  // Normalised dim per input.
  std::vector<std::pair<int64_t, int64_t>> bounds_;  // (start, length).
  Terms terms_;
  bool checkpointed_ = false;
  int64_t recomputations_ = 0;
};

}  // namespace dflash

#endif  // DFLASH_CHUNKING_CHUNKED_REDUCE_H_
