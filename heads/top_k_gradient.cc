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
  for (int64_t r = 0; r < rows; ++r) {
    T* dh = gradients.hidden.data() + r * h;
    const T* x = inputs.hidden.data() + r * h;
    for (int32_t j = 0; j < k; ++j) {
      const int32_t id = ids[r * k + j];
      if (id < 0) continue;
      const T c = static_cast<T>(
          transform.Chain(grad_values[r * k + j], values[r * k + j]));
      if (c == T(0)) continue;
      const T* w = inputs.weight.data() + int64_t{id} * h;
      for (int64_t i = 0; i < h; ++i) dh[i] += c * w[i];
      if (trainable) {
        T* dw = gradients.weight.data() + int64_t{id} * h;
        for (int64_t i = 0; i < h; ++i) dw[i] += c * x[i];
      }
      if (bias) gradients.bias[id] += c;
      if (rank == 0) continue;
      const T* u = inputs.correction_inputs.data() + r * rank;
      const T* m = inputs.correction_weight.data() + int64_t{id} * rank;
      if (!gradients.correction_inputs.empty()) {
        T* du = gradients.correction_inputs.data() + r * rank;
        for (int64_t i = 0; i < rank; ++i) du[i] += c * m[i];
      }
      if (!gradients.correction_weight.empty()) {
        T* dm = gradients.correction_weight.data() + int64_t{id} * rank;
        for (int64_t i = 0; i < rank; ++i) dm[i] += c * u[i];
      }
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
