#include "python/native/objective_checks.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/loss_family.h"

namespace dflash::python {

using absl::string_view;

absl::Status Invalid(const TensorArg& t, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(t.name, ": ", what));
}

string_view TopKValueDType(const TensorArg& hidden) {
  return hidden.dtype == "float64" ? "float64" : "float32";
}

// ConfidenceOf (losses/chunk_loss.h) of hidden's dtype.
string_view ConfidenceDType(const TensorArg& hidden) {
  return hidden.dtype == "float64" ? "float64" : "float32";
}

absl::Status CheckHidden(const TensorArg& hidden) {
  const bool cuda = hidden.on_cuda();
  if (!cuda && hidden.device != "cpu") {
    return Invalid(hidden, absl::StrCat("must be on the CPU or a CUDA device, "
                                        "got ",
                                        hidden.device));
  }
  static constexpr string_view kCpu[] = {"float32", "float64"};
  static constexpr string_view kCuda[] = {"float32", "bfloat16"};
  DFLASH_RETURN_IF_ERROR(cuda ? ExpectDType(hidden, kCuda, "on CUDA")
                              : ExpectDType(hidden, kCpu, "on the CPU"));
  if (hidden.shape.size() != 4) {
    return Invalid(hidden, absl::StrCat("must have 4 dimensions [B, N, K, H], "
                                        "got shape ",
                                        ShapeString(hidden.shape)));
  }
  for (int64_t d : hidden.shape) {
    if (d <= 0) {
      return Invalid(hidden,
                     absl::StrCat("every dimension of [B, N, K, H] must be > "
                                  "0, got shape ",
                                  ShapeString(hidden.shape)));
    }
  }
  return ExpectContiguous(hidden);
}

absl::Status CheckBeside(const TensorArg& t, const TensorArg& hidden,
                         const std::vector<int64_t>& shape, string_view dims,
                         string_view dtype) {
  const string_view want = dtype.empty() ? string_view(hidden.dtype) : dtype;
  const string_view allowed[] = {want};
  DFLASH_RETURN_IF_ERROR(
      ExpectDType(t, allowed, dtype.empty() ? "hidden's dtype" : ""));
  DFLASH_RETURN_IF_ERROR(ExpectDevice(t, hidden.device, "hidden's device"));
  DFLASH_RETURN_IF_ERROR(ExpectShape(t, shape, dims));
  return ExpectContiguous(t);
}

namespace {

// Row metadata, at any strides: on the host (read there), or on a CUDA
// hidden's device (the CUDA head builds the rows there).
absl::Status CheckMetadata(const TensorArg& t, const TensorArg& hidden,
                           const std::vector<int64_t>& bnk,
                           absl::Span<const string_view> dtypes) {
  DFLASH_RETURN_IF_ERROR(ExpectDType(t, dtypes));
  if (t.device != "cpu" && !(hidden.on_cuda() && t.device == hidden.device)) {
    return Invalid(t, hidden.on_cuda()
                          ? absl::StrCat("must be on the CPU or on hidden's "
                                         "device (",
                                         hidden.device, "), got ", t.device)
                          : absl::StrCat("must be on the CPU as hidden is, "
                                         "got ",
                                         t.device));
  }
  DFLASH_RETURN_IF_ERROR(ExpectShape(t, bnk, "[B, N, K] (hidden's)"));
  if (t.strides.size() != 3) {
    return Invalid(t, absl::StrCat("needs one stride per dimension, got ",
                                   ShapeString(t.strides)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckWeight(const TensorArg& w, const TensorArg& hidden) {
  const int64_t h = hidden.shape[3];
  if (w.shape.size() != 2 || w.shape[0] <= 0 || w.shape[1] != h) {
    return Invalid(w, absl::StrCat("must have shape [V, H] with V > 0 and H = ",
                                   h, " (hidden's last dimension), got ",
                                   ShapeString(w.shape)));
  }
  return CheckBeside(w, hidden, w.shape, "[V, H]");
}

absl::Status CheckCorrection(const std::optional<TensorArg>& z,
                             const std::optional<TensorArg>& m,
                             const TensorArg& hidden, const TensorArg& w) {
  if (z.has_value() != m.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        z.has_value() ? "correction_weight" : "correction_inputs",
        ": required beside ",
        z.has_value() ? "correction_inputs" : "correction_weight",
        " (the correction is z @ M^T), got None"));
  }
  if (!z.has_value()) return absl::OkStatus();
  if (z->shape.size() != 4 || z->shape[3] <= 0) {
    return Invalid(*z, absl::StrCat("must have shape [B, N, K, r] with r > "
                                    "0, got ",
                                    ShapeString(z->shape)));
  }
  const std::vector<int64_t>& s = hidden.shape;
  const std::vector<int64_t> shape = {s[0], s[1], s[2], z->shape[3]};
  DFLASH_RETURN_IF_ERROR(CheckBeside(*z, hidden, shape, "[B, N, K, r]"));
  return CheckBeside(*m, hidden, {w.shape[0], shape[3]},
                     "[V, r] (V of lm_head_weight, r of correction_inputs)");
}

absl::Status CheckTensors(const ObjectiveTensors& t) {
  DFLASH_RETURN_IF_ERROR(CheckHidden(t.hidden));
  const std::vector<int64_t>& s = t.hidden.shape;
  const std::vector<int64_t> bnk = {s[0], s[1], s[2]};
  const TensorArg& w = t.weight;
  DFLASH_RETURN_IF_ERROR(CheckWeight(w, t.hidden));
  static constexpr string_view kIds[] = {"int64", "int32"};
  static constexpr string_view kMasks[] = {"float32", "float64", "bool"};
  DFLASH_RETURN_IF_ERROR(CheckMetadata(t.target_ids, t.hidden, bnk, kIds));
  DFLASH_RETURN_IF_ERROR(CheckMetadata(t.weight_mask, t.hidden, bnk, kMasks));
  if (t.bias.has_value()) {
    DFLASH_RETURN_IF_ERROR(CheckBeside(*t.bias, t.hidden, {w.shape[0]}, "[V]"));
  }
  if (t.teacher_hidden.has_value()) {
    DFLASH_RETURN_IF_ERROR(
        CheckBeside(*t.teacher_hidden, t.hidden, s, "[B, N, K, H]"));
  }
  if (t.confidence_logits.has_value()) {
    const string_view dtype[] = {ConfidenceDType(t.hidden)};
    DFLASH_RETURN_IF_ERROR(ExpectDType(
        *t.confidence_logits, dtype,
        absl::StrCat("the loss reads confidence logits in float64 beside "
                     "float64 hidden, else in float32; hidden is ",
                     t.hidden.dtype)));
    DFLASH_RETURN_IF_ERROR(CheckBeside(*t.confidence_logits, t.hidden, bnk,
                                       "[B, N, K]", dtype[0]));
  }
  return CheckCorrection(t.correction_inputs, t.correction_weight, t.hidden,
                         w);
}

namespace {

// An output buffer is required exactly when `needed`.
absl::Status CheckOutput(const std::optional<TensorArg>& t, bool needed,
                         const char* name, const char* why,
                         const TensorArg& hidden,
                         const std::vector<int64_t>& shape, string_view dims,
                         string_view dtype = "") {
  if (t.has_value() != needed) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", needed ? "required" : "not expected", " (",
                     why, "), got ", t.has_value() ? "a tensor" : "None"));
  }
  return needed ? CheckBeside(*t, hidden, shape, dims, dtype)
                : absl::OkStatus();
}

}  // namespace

absl::Status CheckOutputs(const ObjectiveOutputs& o, const ObjectiveTensors& t,
                          const v1::ObjectiveConfig& config,
                          bool forward_only) {
  const std::vector<int64_t>& s = t.hidden.shape;
  const std::vector<int64_t> bnk = {s[0], s[1], s[2]};
  const v1::HeadConfig& head = config.head();
  // A forward-only run takes no gradient buffer at all.
  const bool grads = !forward_only;
  const auto why = [forward_only](const char* when) {
    return forward_only ? "a forward-only run computes none" : when;
  };
  DFLASH_RETURN_IF_ERROR(CheckOutput(o.grad_hidden, grads, "grad_hidden",
                                     why("for every run that trains"),
                                     t.hidden, s, "[B, N, K, H]"));
  DFLASH_RETURN_IF_ERROR(CheckOutput(o.grad_weight, grads && head.trainable(),
                                     "grad_weight",
                                     why("with a trainable head"), t.hidden,
                                     t.weight.shape, "[V, H]"));
  DFLASH_RETURN_IF_ERROR(CheckOutput(
      o.grad_bias, grads && head.trainable() && head.bias(), "grad_bias",
      why("with a trainable head and a bias"), t.hidden, {t.weight.shape[0]},
      "[V]"));
  DFLASH_RETURN_IF_ERROR(CheckOutput(
      o.grad_confidence, grads && t.confidence_logits.has_value(),
      "grad_confidence", why("with confidence logits"), t.hidden, bnk,
      "[B, N, K]", ConfidenceDType(t.hidden)));
  for (const auto& [buffer, dtype] :
       {std::pair{&o.neg_log_q, "float64"}, std::pair{&o.argmax, "int32"},
        std::pair{&o.base_argmax, "int32"},
        std::pair{&o.teacher_argmax, "int32"}}) {
    if (buffer->has_value()) {
      DFLASH_RETURN_IF_ERROR(
          CheckBeside(**buffer, t.hidden, bnk, "[B, N, K]", dtype));
    }
  }
  if (o.top_k.has_value()) {
    const std::vector<int64_t>& k = o.top_k->shape;
    std::vector<int64_t> shape = bnk;
    shape.push_back(k.size() == 4 ? k[3] : 0);
    DFLASH_RETURN_IF_ERROR(
        CheckBeside(*o.top_k, t.hidden, shape, "[B, N, K, k]", "int32"));
    if (o.top_k_values.has_value()) {
      DFLASH_RETURN_IF_ERROR(CheckBeside(*o.top_k_values, t.hidden, shape,
                                         "[B, N, K, k]",
                                         TopKValueDType(t.hidden)));
    }
  } else if (o.top_k_values.has_value()) {
    return Invalid(*o.top_k_values, "needs top_k beside it, got none");
  }
  if (o.loss_weight.has_value()) {
    DFLASH_RETURN_IF_ERROR(
        CheckBeside(*o.loss_weight, t.hidden, bnk, "[B, N, K]", "float64"));
  }
  const bool correction = t.correction_inputs.has_value();
  DFLASH_RETURN_IF_ERROR(CheckOutput(
      o.grad_correction_inputs, grads && correction, "grad_correction_inputs",
      why("with a correction"), t.hidden,
      correction ? t.correction_inputs->shape : std::vector<int64_t>{},
      "[B, N, K, r]"));
  DFLASH_RETURN_IF_ERROR(CheckOutput(
      o.grad_correction_weight, grads && correction, "grad_correction_weight",
      why("with a correction"), t.hidden,
      correction ? t.correction_weight->shape : std::vector<int64_t>{},
      "[V, r]"));
  return absl::OkStatus();
}

absl::Status CheckLossInputs(const v1::ObjectiveConfig& config,
                             const ObjectiveTensors& t) {
  const v1::LossConfig& loss = config.loss();
  const LossTraits traits = LossTraitsOf(loss);
  const std::string family = absl::StrCat("loss.", traits.name);
  // With a loss that reads no teacher, teacher_hidden asks for the teacher
  // diagnostics (BindConfig sets head.teacher_diagnostics).
  if (traits.needs_teacher && !t.teacher_hidden.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_hidden: ", family,
        " reads the teacher's hidden states [B, N, K, H], got None"));
  }
  const bool confidence = traits.needs_confidence;
  if (confidence != t.confidence_logits.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "confidence_logits: ",
        confidence
            ? absl::StrCat(family,
                           ".confidence_weight > 0 reads confidence logits "
                           "[B, N, K], got None")
            : absl::StrCat(family,
                           " has no confidence term, got a tensor (pass "
                           "None)")));
  }
  return absl::OkStatus();
}

absl::Status CheckPrepared(const PreparedProjection* prepared,
                           const ObjectiveTensors& t,
                           const v1::ObjectiveConfig& bound) {
  if (prepared == nullptr) return absl::OkStatus();
  if (bound.head().trainable() || t.hidden.dtype != "float32" ||
      t.hidden.on_cuda()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prepared_projection: serves a frozen float32 CPU lm_head_weight, got ",
        bound.head().trainable() ? "one that requires grad"
                                 : absl::StrCat(t.hidden.dtype, " on ",
                                                t.hidden.device)));
  }
  if (!prepared->PreparedFrom(
          t.weight.span<const float>(),
          t.bias.has_value() ? t.bias->span<const float>()
                             : absl::Span<const float>())) {
    return absl::InvalidArgumentError(
        "prepared_projection: was made from other tensors than "
        "lm_head_weight and lm_head_bias (make it from the ones passed)");
  }
  return absl::OkStatus();
}

absl::Status CheckVocabShard(const VocabShard& shard,
                             const ObjectiveTensors& t) {
  if (t.hidden.device != "cpu" && !t.hidden.on_cuda()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_shard: runs on CPU or CUDA tensors, got hidden on ",
        t.hidden.device));
  }
  const int64_t rows = t.weight.shape.size() == 2 ? t.weight.shape[0] : 0;
  if (shard.exchange == nullptr) {
    return absl::InvalidArgumentError("vocab_shard.exchange: required, got "
                                      "none");
  }
  const int rank = shard.exchange->rank(), size = shard.exchange->size();
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_shard.exchange: rank must lie in [0, size) with size >= 1, "
        "got rank ",
        rank, " of ", size));
  }
  if (shard.offset < 0 || shard.vocab < 1 ||
      shard.offset + rows > shard.vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_shard: rows [offset, offset + V) = [", shard.offset, ", ",
        shard.offset + rows, ") of lm_head_weight must lie in the whole "
        "vocabulary [0, ",
        shard.vocab, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckTopKBackward(const TopKBackwardTensors& t, bool trainable) {
  DFLASH_RETURN_IF_ERROR(CheckHidden(t.hidden));
  const std::vector<int64_t>& s = t.hidden.shape;
  const TensorArg& w = t.weight;
  DFLASH_RETURN_IF_ERROR(CheckWeight(w, t.hidden));
  const int64_t k = t.top_k.shape.size() == 4 ? t.top_k.shape[3] : 0;
  const std::vector<int64_t> shape = {s[0], s[1], s[2], k};
  DFLASH_RETURN_IF_ERROR(
      CheckBeside(t.top_k, t.hidden, shape, "[B, N, K, k]", "int32"));
  const string_view values = TopKValueDType(t.hidden);
  DFLASH_RETURN_IF_ERROR(
      CheckBeside(t.values, t.hidden, shape, "[B, N, K, k]", values));
  DFLASH_RETURN_IF_ERROR(
      CheckBeside(t.grad_values, t.hidden, shape, "[B, N, K, k]", values));
  DFLASH_RETURN_IF_ERROR(
      CheckBeside(t.grad_hidden, t.hidden, s, "[B, N, K, H]"));
  DFLASH_RETURN_IF_ERROR(CheckOutput(t.grad_weight, trainable, "grad_weight",
                                     "with a trainable head", t.hidden,
                                     w.shape, "[V, H]"));
  DFLASH_RETURN_IF_ERROR(CheckOutput(t.grad_bias,
                                     trainable && t.bias.has_value(),
                                     "grad_bias",
                                     "with a trainable head and a bias",
                                     t.hidden, {w.shape[0]}, "[V]"));
  const std::optional<TensorArg>& z = t.correction_inputs;
  DFLASH_RETURN_IF_ERROR(CheckCorrection(z, t.correction_weight, t.hidden, w));
  for (const std::optional<TensorArg>* grad :
       {&t.grad_correction_inputs, &t.grad_correction_weight}) {
    if (grad->has_value() && !z.has_value()) {
      return Invalid(**grad, "needs correction_inputs and correction_weight "
                             "beside it, got none");
    }
  }
  if (t.grad_correction_inputs.has_value()) {
    DFLASH_RETURN_IF_ERROR(CheckBeside(*t.grad_correction_inputs, t.hidden,
                                       z->shape, "[B, N, K, r]"));
  }
  if (t.grad_correction_weight.has_value()) {
    DFLASH_RETURN_IF_ERROR(CheckBeside(*t.grad_correction_weight, t.hidden,
                                       t.correction_weight->shape, "[V, r]"));
  }
  return absl::OkStatus();
}

}  // namespace dflash::python
