#include "chunking/chunked_reduce.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace dflash {

absl::StatusOr<ChunkedReduction> ChunkedReduction::Run(
    ChunkFunction& function, std::vector<std::optional<TensorView>> inputs,
    const ChunkedReduceOptions& options,
    std::vector<std::optional<TensorView>> grads) {
  // Validation order and messages follow SpecForge's checkpointed_chunk_reduce.
  if (options.chunk_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_size must be >= 0, got ", options.chunk_size));
  }
  const auto first = std::find_if(inputs.begin(), inputs.end(),
                                  [](const auto& t) { return t.has_value(); });
  if (first == inputs.end()) {
    return absl::InvalidArgumentError(
        "chunked reduction requires at least one tensor");
  }
  ChunkedReduction reduction;
  reduction.dims_.assign(inputs.size(), 0);
  // The first tensor's dim and length, then each other tensor's dim and
  // alignment in turn.
  auto dim_of = [&](size_t i) -> absl::Status {
    const int64_t rank = inputs[i]->rank();
    const int64_t dim = options.dim < 0 ? options.dim + rank : options.dim;
    if (dim < 0 || dim >= rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dim ", options.dim, " is invalid for a ", rank, "D tensor"));
    }
    reduction.dims_[i] = dim;
    return absl::OkStatus();
  };
  const size_t first_index = first - inputs.begin();
  DFLASH_RETURN_IF_ERROR(dim_of(first_index));
  const int64_t length = (*first)->dim(reduction.dims_[first_index]);
  if (length == 0) {
    return absl::InvalidArgumentError(
        "chunked reduction received an empty dimension");
  }
  for (size_t i = first_index + 1; i < inputs.size(); ++i) {
    if (!inputs[i]) continue;
    DFLASH_RETURN_IF_ERROR(dim_of(i));
    if (inputs[i]->dim(reduction.dims_[i]) != length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunked reduction inputs must be aligned: expected dimension "
          "length ",
          length, ", got ", inputs[i]->dim(reduction.dims_[i])));
    }
  }
  if (!grads.empty() && grads.size() != inputs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("grads must be empty or one per input (", inputs.size(),
                     "), got ", grads.size()));
  }
  bool needs_grad = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i]) continue;
    if (!inputs[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("grads[", i, "] is given for an absent input"));
    }
    if (grads[i]->rank() != inputs[i]->rank() ||
        grads[i]->dim(reduction.dims_[i]) != length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grads[", i, "] must match input ", inputs[i]->DebugString(),
          ", got ", grads[i]->DebugString()));
    }
    needs_grad = true;
  }

  reduction.function_ = &function;
  reduction.inputs_ = std::move(inputs);
  reduction.grads_ = std::move(grads);
  // One (possibly absent) gradient per input, so Backward slices both alike.
  reduction.grads_.resize(reduction.inputs_.size());
  reduction.checkpointed_ = options.checkpoint && options.chunk_size > 0 &&
                            options.grad_enabled && needs_grad;
  const int64_t step = options.chunk_size == 0 ? length : options.chunk_size;
  for (int64_t start = 0; start < length; start += step) {
    reduction.bounds_.emplace_back(start, std::min(step, length - start));
  }

  std::vector<std::optional<TensorView>> slices;
  for (size_t c = 0; c < reduction.bounds_.size(); ++c) {
    const auto [start, size] = reduction.bounds_[c];
    if (absl::Status ok =
            reduction.SliceAll(reduction.inputs_, start, size, slices);
        !ok.ok()) {
      return ok;
    }
    DFLASH_ASSIGN_OR_RETURN(Terms terms, function.Forward(slices));
    if (c == 0) {
      reduction.terms_ = std::move(terms);
      continue;
    }
    if (terms.size() != reduction.terms_.size()) {
      return absl::InvalidArgumentError(
          "chunk function returned a different number of terms");
    }
    for (size_t t = 0; t < terms.size(); ++t) {
      Term& sum = reduction.terms_[t];
      const Term& term = terms[t];
      if (term.size() != sum.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("term ", t, " of chunk ", c, " has ", term.size(),
                         " elements, expected ", sum.size()));
      }
      for (size_t e = 0; e < term.size(); ++e) sum[e] += term[e];
    }
  }
  return reduction;
}

absl::Status ChunkedReduction::SliceAll(
    const std::vector<std::optional<TensorView>>& all, int64_t start,
    int64_t length, std::vector<std::optional<TensorView>>& out) const {
  out.assign(all.size(), std::nullopt);
  for (size_t i = 0; i < all.size(); ++i) {
    if (!all[i]) continue;
    DFLASH_ASSIGN_OR_RETURN(TensorView slice,
                            all[i]->Slice(dims_[i], start, length));
    out[i] = slice;
  }
  return absl::OkStatus();
}

absl::Status ChunkedReduction::Backward(const Terms& grad_terms) {
  if (grad_terms.size() != terms_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_terms must have one gradient per term (",
                     terms_.size(), "), got ", grad_terms.size()));
  }
  for (size_t t = 0; t < terms_.size(); ++t) {
    if (grad_terms[t].size() != terms_[t].size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_terms[", t, "] must have ", terms_[t].size(),
                       " elements, got ", grad_terms[t].size()));
    }
  }
  std::vector<std::optional<TensorView>> slices, grad_slices;
  for (const auto& [start, size] : bounds_) {
    DFLASH_RETURN_IF_ERROR(SliceAll(inputs_, start, size, slices));
    DFLASH_RETURN_IF_ERROR(SliceAll(grads_, start, size, grad_slices));
    if (checkpointed_) {
      DFLASH_ASSIGN_OR_RETURN(Terms again, function_->Forward(slices));
      ++recomputations_;
    }
    DFLASH_RETURN_IF_ERROR(
        function_->Backward(slices, grad_terms, grad_slices));
  }
  return absl::OkStatus();
}

}  // namespace dflash
