#include "heads/top_k_gradient.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/loss_math.h"

namespace dflash {
namespace {

absl::Status Size(const char* name, size_t size, int64_t expected,
                  const char* what) {
  if (static_cast<int64_t>(size) == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      name, ": must hold ", expected, " values (", what, "), got ", size));
}

// One (row, id) pair's product a . b over n values (x . W[id] or u .
// M[id]), given c: grad_a += c b and grad_b += c a, each where given.
template <typename T>
void AddProductGradients(T c, const T* a, const T* b, int64_t n, T* grad_a,
                         T* grad_b) {
  if (grad_a != nullptr) {
    for (int64_t i = 0; i < n; ++i) grad_a[i] += c * b[i];
  }
  if (grad_b != nullptr) {
    for (int64_t i = 0; i < n; ++i) grad_b[i] += c * a[i];
  }
}

}  // namespace

absl::Status ValidateTopKValueGradients(const v1::ObjectiveConfig& config,
                                        int64_t rows, size_t hidden,
                                        size_t weight, size_t grad_hidden,
                                        size_t grad_weight,
                                        absl::Span<const int32_t> ids,
                                        size_t values, size_t grad_values,
                                        int32_t k) {
  const int64_t vocab = config.head().vocab_size();
  const int64_t h = config.head().hidden_size();
  if (k < 1 || k > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: must lie in [1, 64], got ", k));
  }
  DFLASH_RETURN_IF_ERROR(Size("ids", ids.size(), rows * k, "rows x k"));
  DFLASH_RETURN_IF_ERROR(Size("values", values, rows * k, "rows x k"));
  DFLASH_RETURN_IF_ERROR(
      Size("grad_values", grad_values, rows * k, "rows x k"));
  DFLASH_RETURN_IF_ERROR(
      Size("inputs.hidden", hidden, rows * h, "rows x head.hidden_size"));
  DFLASH_RETURN_IF_ERROR(Size("gradients.hidden", grad_hidden, rows * h,
                              "rows x head.hidden_size"));
  DFLASH_RETURN_IF_ERROR(Size("inputs.weight", weight, vocab * h,
                              "head.vocab_size x head.hidden_size"));
  if (config.head().trainable()) {
    DFLASH_RETURN_IF_ERROR(
        Size("gradients.weight", grad_weight, vocab * h,
             "head.vocab_size x head.hidden_size, as head.trainable"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < -1 || ids[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("ids[", i / k, ", ", i % k, "]: must lie in [0, ", vocab,
                       ") or be -1, got ", ids[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateTopKCorrection(const v1::ObjectiveConfig& config,
                                    int64_t rows, size_t inputs, size_t weight,
                                    size_t grad_inputs, size_t grad_weight) {
  const int64_t rank = config.head().correction_rank();
  const int64_t vocab = config.head().vocab_size();
  const char* what = "rows x head.correction_rank";
  const char* weight_what = "head.vocab_size x head.correction_rank";
  DFLASH_RETURN_IF_ERROR(
      Size("inputs.correction_inputs", inputs, rows * rank, what));
  DFLASH_RETURN_IF_ERROR(
      Size("inputs.correction_weight", weight, vocab * rank, weight_what));
  if (grad_inputs != 0) {
    DFLASH_RETURN_IF_ERROR(Size("gradients.correction_inputs", grad_inputs,
                                rows * rank, what));
  }
  if (grad_weight != 0) {
    DFLASH_RETURN_IF_ERROR(Size("gradients.correction_weight", grad_weight,
                                vocab * rank, weight_what));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status AddTopKValueGradients(const v1::ObjectiveConfig& config,
                                   const HeadInputs<T>& inputs,
                                   absl::Span<const int32_t> ids,
                                   absl::Span<const T> values,
                                   absl::Span<const T> grad_values, int32_t k,
                                   const HeadGradients<T>& gradients) {
  const v1::HeadConfig& head = config.head();
  const int64_t h = head.hidden_size();
  const int64_t rows = k > 0 ? static_cast<int64_t>(ids.size()) / k : 0;
  DFLASH_RETURN_IF_ERROR(ValidateTopKValueGradients(
      config, rows, inputs.hidden.size(), inputs.weight.size(),
      gradients.hidden.size(), gradients.weight.size(), ids, values.size(),
      grad_values.size(), k));
  DFLASH_RETURN_IF_ERROR(ValidateTopKCorrection(
      config, rows, inputs.correction_inputs.size(),
      inputs.correction_weight.size(), gradients.correction_inputs.size(),
      gradients.correction_weight.size()));
  const int64_t rank = head.correction_rank();
  const bool trainable = head.trainable();
  const bool bias = trainable && !gradients.bias.empty();
  const LogitTransform transform(head.logit_scale(), head.logit_softcap());
  auto or_null = [](absl::Span<T> span) {
    return span.empty() ? nullptr : span.data();
  };
  T* const du = or_null(gradients.correction_inputs);
  T* const dm = or_null(gradients.correction_weight);
  // The correction's products only where one of their gradients is wanted.
  const bool correction = rank > 0 && (du != nullptr || dm != nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = inputs.hidden.data() + r * h;
    T* dh = gradients.hidden.data() + r * h;
    for (int32_t j = 0; j < k; ++j) {
      const int32_t id = ids[r * k + j];
      if (id < 0) continue;
      // Once per (row, id), for both products.
      const T c = static_cast<T>(
          transform.Chain(grad_values[r * k + j], values[r * k + j]));
      if (c == T(0)) continue;
      AddProductGradients(
          c, x, inputs.weight.data() + int64_t{id} * h, h, dh,
          trainable ? gradients.weight.data() + int64_t{id} * h : nullptr);
      if (bias) gradients.bias[id] += c;
      if (!correction) continue;
      AddProductGradients(c, inputs.correction_inputs.data() + r * rank,
                          inputs.correction_weight.data() + int64_t{id} * rank,
                          rank, du != nullptr ? du + r * rank : nullptr,
                          dm != nullptr ? dm + int64_t{id} * rank : nullptr);
    }
  }
  return absl::OkStatus();
}

template absl::Status AddTopKValueGradients<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&,
    absl::Span<const int32_t>, absl::Span<const float>, absl::Span<const float>,
    int32_t, const HeadGradients<float>&);
template absl::Status AddTopKValueGradients<double>(
    const v1::ObjectiveConfig&, const HeadInputs<double>&,
    absl::Span<const int32_t>, absl::Span<const double>,
    absl::Span<const double>, int32_t, const HeadGradients<double>&);

}  // namespace dflash
