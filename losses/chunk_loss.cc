#include "losses/chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/cpu_dispatch.h"
#include "base/status_macros.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/row_error.h"
#include "losses/row_kernels.h"

namespace dflash {
namespace {

// The type a row is computed in: double for the reference path, else float.
template <typename T>
using Work = std::conditional_t<std::is_same_v<T, double>, double, float>;

// D-PACE block weights (docs/semantics.md section 5.2), without gradient:
// smooth = m > 0 ? (1-alpha)*q + alpha : 1, prefix = cumprod(smooth),
// suffix = reverse-cumsum(prefix * m).
void DPaceWeights(const v1::DPaceLoss& config, absl::Span<const double> q,
                  absl::Span<const double> mask, absl::Span<double> weights) {
  const int64_t k_size = static_cast<int64_t>(mask.size());
  std::vector<double> prefix(k_size), suffix(k_size);
  double running = 1;
  for (int64_t k = 0; k < k_size; ++k) {
    const double smooth = DPaceSmooth(mask[k], q[k], config.alpha());
    running *= smooth;
    prefix[k] = running;
  }
  double tail = 0;
  for (int64_t k = k_size - 1; k >= 0; --k) {
    tail += prefix[k] * mask[k];
    suffix[k] = tail;
  }
  constexpr double kTiny = std::numeric_limits<double>::min();
  for (int64_t k = 0; k < k_size; ++k) {
    switch (config.variant()) {
      case v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY:
        weights[k] = prefix[k];
        break;
      case v1::DPaceLoss::CONTINUATION_VALUE_ONLY:
        weights[k] = suffix[k] / std::max(prefix[k], kTiny);
        break;
      default:
        weights[k] = suffix[k];
        break;
    }
    weights[k] *= mask[k];
  }
}

template <typename Loss>
double DecayWeight(const Loss& loss, int32_t position, double mask) {
  return DFlashWeight(loss.has_gamma(), loss.gamma(), position,
                      static_cast<float>(mask));
}

// logsumexp(z * inv_t) given max(z).
template <typename W>
double ScaledLogSumExp(absl::Span<const W> z, double max, double inv_t) {
  double sum = 0;
  for (W x : z) sum += std::exp((x - max) * inv_t);
  return max * inv_t + std::log(sum);
}

// The row loops below are branch-free, with separate pointers and a local
// count, so that they vectorise (no FP exceptions are enabled).
template <typename W>
DFLASH_CPU_DISPATCH bool AllFinite(const W* __restrict x, int64_t count) {
  int bad = 0;
  for (int64_t v = 0; v < count; ++v) bad |= !(x[v] - x[v] == 0);
  return bad == 0;
}

DFLASH_CPU_DISPATCH void Widen(const BFloat16* __restrict in,
                               float* __restrict out, int64_t count) {
  for (int64_t v = 0; v < count; ++v) out[v] = ToFloat(in[v]);
}

DFLASH_CPU_DISPATCH void Narrow(const float* __restrict in,
                                BFloat16* __restrict out, int64_t count) {
  for (int64_t v = 0; v < count; ++v) out[v] = ToBFloat16(in[v]);
}

// Serves each row as the loss's logits z' in the working type: in place for
// float and double (transformed once), converted into scratch for bfloat16.
template <typename T>
class RowSource {
 public:
  using W = Work<T>;

  RowSource(const ChunkLossInputs<T>& inputs, const ChunkLossOptions& options)
      : inputs_(inputs),
        scale_(options.logit_scale),
        softcap_(options.logit_softcap),
        identity_(options.logit_softcap == 0 && options.logit_scale == 1),
        transformed_(inputs.rows.size(), false) {
    if constexpr (!std::is_same_v<T, W>) draft_.resize(inputs.vocab);
    if (!inputs.teacher_logits.empty() &&
        (!identity_ || !std::is_same_v<T, W>)) {
      teacher_.resize(inputs.vocab);
    }
    if (softcap_ > 0) transformed_copy_.resize(inputs.vocab);
  }

  absl::Span<W> Draft(int64_t r) {
    absl::Span<T> row = inputs_.logits.subspan(r * inputs_.vocab, inputs_.vocab);
    if constexpr (std::is_same_v<T, W>) {
      if (!identity_ && !transformed_[r]) Transform(row);
      transformed_[r] = true;
      return row;
    } else {
      Widen(row.data(), draft_.data(), inputs_.vocab);
      Transform(absl::MakeSpan(draft_));
      return absl::MakeSpan(draft_);
    }
  }

  absl::Span<const W> Teacher(int64_t r) {
    absl::Span<const T> row =
        inputs_.teacher_logits.subspan(r * inputs_.vocab, inputs_.vocab);
    if constexpr (std::is_same_v<T, W>) {
      if (identity_) return row;
      std::copy(row.begin(), row.end(), teacher_.begin());
    } else {
      Widen(row.data(), teacher_.data(), inputs_.vocab);
    }
    Transform(absl::MakeSpan(teacher_));
    return teacher_;
  }

  // Call with z' before its gradient overwrites it.
  void KeepTransformed(absl::Span<const W> z) {
    if (softcap_ > 0) std::copy(z.begin(), z.end(), transformed_copy_.begin());
  }

  // Chains d/dz' in `grad` back to d/dz and stores row r. A gradient that
  // overflows the working type (from huge masks, loss weights or logit
  // transforms) is an error naming the row, never a silent inf. `bound` is
  // an upper bound on |d/dz'| over the row, from its coefficients, or
  // infinity where none is cheap: the row is scanned only when the bound
  // (times the chain's factor, at most the logit scale) might not fit.
  absl::Status StoreGradient(int64_t r, absl::Span<W> grad, double weight,
                             double bound) {
    if (softcap_ > 0) {
      for (size_t v = 0; v < grad.size(); ++v) {
        grad[v] = static_cast<W>(ChainTransformedLogit<double>(
            grad[v], transformed_copy_[v], scale_, softcap_));
      }
    } else if (scale_ != 1) {
      for (W& g : grad) g = static_cast<W>(g * scale_);
    }
    const double fits = std::numeric_limits<W>::max() / 2;
    const bool may_overflow = !(bound < fits && bound * scale_ < fits);
    if (may_overflow &&
        !AllFinite(grad.data(), static_cast<int64_t>(grad.size()))) {
      return RowError(r, absl::StrCat(
          "d(loss)/d(logits) overflows ",
          std::is_same_v<W, float> ? "float32" : "float64",
          " (row weight ", weight,
          "); masks and loss weights this large need rescaling"));
    }
    if constexpr (!std::is_same_v<T, W>) {
      Narrow(grad.data(), inputs_.logits.data() + r * inputs_.vocab,
             inputs_.vocab);
    }
    return absl::OkStatus();
  }

  void StoreZero(int64_t r) {
    absl::Span<T> row = inputs_.logits.subspan(r * inputs_.vocab, inputs_.vocab);
    std::fill(row.begin(), row.end(), T{});
  }

 private:
  void Transform(absl::Span<W> row) const {
    if (softcap_ > 0) {
      for (W& x : row) {
        x = static_cast<W>(TransformLogit<double>(x, scale_, softcap_));
      }
    } else if (scale_ != 1) {
      for (W& x : row) x = static_cast<W>(scale_ * x);
    }
  }

  const ChunkLossInputs<T>& inputs_;
  const double scale_;
  const double softcap_;
  const bool identity_;
  std::vector<bool> transformed_;
  std::vector<W> draft_, teacher_, transformed_copy_;
};

// Distillation divergence of one row; writes its gradient times `weight`
// into z (d/dz' = weight / T * d/du with u = z' / T).
template <typename W>
double DistillationRow(const v1::DistillationLoss& config, absl::Span<W> z,
                       const RowStats& stats, absl::Span<const W> t,
                       const RowStats& teacher_stats, double weight) {
  const double inv_t = 1 / config.temperature();
  const double lse = ScaledLogSumExp<W>(z, stats.max_logit, inv_t);
  const double teacher_lse =
      ScaledLogSumExp<W>(t, teacher_stats.max_logit, inv_t);
  const int64_t vocab = static_cast<int64_t>(z.size());
  const double g = weight * inv_t;
  double divergence = 0;
  switch (config.divergence()) {
    case v1::DistillationLoss::REVERSE_KL: {
      for (int64_t v = 0; v < vocab; ++v) {
        const double ls = z[v] * inv_t - lse, lt = t[v] * inv_t - teacher_lse;
        divergence += std::exp(ls) * (ls - lt);
      }
      for (int64_t v = 0; v < vocab; ++v) {
        const double ls = z[v] * inv_t - lse, lt = t[v] * inv_t - teacher_lse;
        z[v] = static_cast<W>(g * std::exp(ls) * ((ls - lt) - divergence));
      }
      break;
    }
    case v1::DistillationLoss::JSD: {
      const double beta = config.beta();
      const double log_beta = std::log(beta), log_rest = std::log1p(-beta);
      double student_to_mixture = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double ls = z[v] * inv_t - lse, lt = t[v] * inv_t - teacher_lse;
        const double lm = LogAddExp(log_rest + ls, log_beta + lt);
        const double s_part = std::exp(ls) * (ls - lm);
        divergence += beta * std::exp(lt) * (lt - lm) + (1 - beta) * s_part;
        student_to_mixture += s_part;
      }
      // d/ds_v of the JSD is (1 - beta) log(s_v / M_v).
      for (int64_t v = 0; v < vocab; ++v) {
        const double ls = z[v] * inv_t - lse, lt = t[v] * inv_t - teacher_lse;
        const double lm = LogAddExp(log_rest + ls, log_beta + lt);
        z[v] = static_cast<W>(g * (1 - beta) * std::exp(ls) *
                              ((ls - lm) - student_to_mixture));
      }
      break;
    }
    default: {  // FORWARD_KL: KL(t || s), gradient s - t.
      for (int64_t v = 0; v < vocab; ++v) {
        const double ls = z[v] * inv_t - lse, lt = t[v] * inv_t - teacher_lse;
        const double tp = std::exp(lt);
        divergence += tp * (lt - ls);
        z[v] = static_cast<W>(g * (std::exp(ls) - tp));
      }
      break;
    }
  }
  return divergence;
}

// DSpark's L1 between draft and teacher softmax, and its gradient times
// l1_coefficient added to the softmax-family gradient `grad`, written into z.
template <typename W>
double DSparkL1Row(absl::Span<W> z, int32_t target, const RowStats& stats,
                   absl::Span<const W> t, const RowStats& teacher_stats,
                   const SoftmaxGradient& grad, double l1_coefficient) {
  const int64_t vocab = static_cast<int64_t>(z.size());
  double l1 = 0, signed_mass = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const double p = std::exp(z[v] - stats.logsumexp);
    const double d = p - std::exp(t[v] - teacher_stats.logsumexp);
    l1 += std::abs(d);
    signed_mass += p * ((d > 0) - (d < 0));
  }
  // d|p - t|_1 / dz_v = p_v (sign_v - sum_w p_w sign_w).
  const double uniform = grad.uniform / static_cast<double>(vocab);
  for (int64_t v = 0; v < vocab; ++v) {
    const double p = std::exp(z[v] - stats.logsumexp);
    const double d = p - std::exp(t[v] - teacher_stats.logsumexp);
    const double sign = (d > 0) - (d < 0);
    z[v] = static_cast<W>(
        (grad.softmax + l1_coefficient * (sign - signed_mass)) * p - uniform);
  }
  z[target] = static_cast<W>(z[target] - grad.target);
  return l1;
}

absl::Status CheckSize(const char* name, size_t size, int64_t expected,
                       const char* why) {
  if (static_cast<int64_t>(size) == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("chunk loss: ", name,
                                                 " must hold ", expected,
                                                 " values (", why, "), got ",
                                                 size));
}

}  // namespace

template <typename T>
absl::Status ValidateChunkLossInputs(const v1::LossConfig& config,
                                     const ChunkLossOptions& options,
                                     const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs) {
  if (absl::Status valid = ValidateLossConfig(config); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: ", valid.message()));
  }
  const int64_t block_size = options.block_size, vocab = inputs.vocab;
  if (block_size <= 0 || vocab <= 0 ||
      vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: block_size and vocab must lie in [1, 2^31), got ",
        block_size, " and ", vocab));
  }
  if (!(options.logit_scale > 0) || std::isinf(options.logit_scale) ||
      !(options.logit_softcap >= 0) || std::isinf(options.logit_softcap)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: logit_scale must be finite and > 0 and logit_softcap "
        "finite and >= 0, got ",
        options.logit_scale, " and ", options.logit_softcap));
  }
  const int64_t num_rows = static_cast<int64_t>(inputs.rows.size());
  if (static_cast<int64_t>(inputs.logits.size()) != num_rows * vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: logits hold ", inputs.logits.size(),
                     " values, expected ", num_rows, " rows x ", vocab,
                     " vocab"));
  }
  const LossTraits traits = LossTraitsOf(config);
  if (traits.needs_teacher) {
    absl::Status size = CheckSize("teacher_logits", inputs.teacher_logits.size(),
                                  num_rows * vocab, "rows x vocab");
    if (!size.ok()) return size;
  }
  if (traits.needs_confidence) {
    absl::Status size =
        CheckSize("confidence_logits", inputs.confidence_logits.size(),
                  num_rows, "one per row for loss.dspark.confidence_weight");
    if (!size.ok()) return size;
  }
  for (const auto& [name, size] :
       {std::pair<const char*, size_t>{"outputs.neg_log_q",
                                       outputs.neg_log_q.size()},
        {"outputs.argmax", outputs.argmax.size()},
        {"outputs.confidence_grad", outputs.confidence_grad.size()}}) {
    if (size != 0) {
      absl::Status status = CheckSize(name, size, num_rows, "one per row");
      if (!status.ok()) return status;
    }
  }
  if (!outputs.top_k.empty()) {
    if (outputs.k < 1 || outputs.k > 64 || outputs.k > vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk loss: outputs.k must lie in [1, min(64, V = ", vocab,
          ")], got ", outputs.k));
    }
    absl::Status size = CheckSize("outputs.top_k", outputs.top_k.size(),
                                  num_rows * outputs.k, "rows x k");
    if (!size.ok()) return size;
  }
  const bool coupled = traits.couples_blocks;
  for (int64_t r = 0; r < num_rows; ++r) {
    const RowMeta& meta = inputs.rows[r];
    if (meta.position < 0 || meta.position >= block_size) {
      return RowError(r, absl::StrCat("block position ", meta.position,
                                      " is outside [0, ", block_size, ")"));
    }
    if (coupled && r > 0) {
      const RowMeta& prev = inputs.rows[r - 1];
      const bool follows = meta.block == prev.block
                               ? meta.position > prev.position
                               : meta.block > prev.block;
      if (!follows) {
        return RowError(r, absl::StrCat(
            "block ", meta.block, " position ", meta.position,
            " does not follow block ", prev.block, " position ", prev.position,
            " (block-level weights need each block's rows together, in "
            "position order)"));
      }
    }
    if (!(meta.mask >= 0) || !std::isfinite(meta.mask)) {
      return RowError(
          r, absl::StrCat("mask must be finite and >= 0, got ", meta.mask));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status TeacherError(const absl::Status& status) {
  if (std::optional<RowErrorInfo> row = GetRowError(status)) {
    return RowError(row->row, absl::StrCat("teacher logits: ", row->detail));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("teacher logits: ", status.message()));
}

}  // namespace

void ChunkTerms::Add(const ChunkTerms& other) {
  loss_num += other.loss_num;
  loss_den += other.loss_den;
  correct += other.correct;
  accuracy_den += other.accuracy_den;
  correct_per_position.resize(
      std::max(correct_per_position.size(), other.correct_per_position.size()));
  mask_per_position.resize(
      std::max(mask_per_position.size(), other.mask_per_position.size()));
  for (size_t k = 0; k < other.correct_per_position.size(); ++k) {
    correct_per_position[k] += other.correct_per_position[k];
    mask_per_position[k] += other.mask_per_position[k];
  }
}

double RowLossWeight(const v1::LossConfig& config, int32_t position, double mask) {
  switch (config.family_case()) {
    case v1::LossConfig::kDflash:
      return DecayWeight(config.dflash(), position, mask);
    case v1::LossConfig::kTv:
      return DecayWeight(config.tv(), position, mask);
    case v1::LossConfig::kLkLambda:
      return DecayWeight(config.lk_lambda(), position, mask);
    case v1::LossConfig::kDistillation:
      return DecayWeight(config.distillation(), position, mask);
    case v1::LossConfig::kDspark: {
      const double gamma = config.dspark().gamma();
      return gamma > 0 ? mask * std::exp(-position / gamma) : mask;
    }
    default:
      return mask;  // dpace: replaced by its block weights.
  }
}

double DFlashWeight(bool has_gamma, double gamma, int32_t position,
                    float mask) {
  if (!has_gamma || gamma == 0) return mask;
  return mask * std::exp(-std::max(position - 1, 0) / gamma);
}

template <typename T>
absl::StatusOr<ChunkTerms> ChunkLoss(const v1::LossConfig& config,
                                     const ChunkLossOptions& options,
                                     const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs) {
  using W = Work<T>;
  DFLASH_RETURN_IF_ERROR(
      ValidateChunkLossInputs(config, options, inputs, outputs));
  const int64_t num_rows = static_cast<int64_t>(inputs.rows.size());
  const int64_t block_size = options.block_size;
  const v1::CrossEntropyOptions& ce = config.cross_entropy();
  RowSource<T> source(inputs, options);

  // The mask a row counts with: 0 where the target is ignore_index.
  std::vector<double> mask(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    mask[r] = inputs.rows[r].target == ce.ignore_index() ? 0.0
                                                         : inputs.rows[r].mask;
  }

  for (int64_t r = 0; r < num_rows; ++r) {
    if (!outputs.neg_log_q.empty()) outputs.neg_log_q[r] = 0;
    if (!outputs.argmax.empty()) outputs.argmax[r] = -1;
    if (!outputs.top_k.empty()) {
      std::fill_n(outputs.top_k.begin() + r * outputs.k, outputs.k, -1);
    }
    if (!outputs.confidence_grad.empty()) outputs.confidence_grad[r] = 0;
  }

  // Float rows whose gradient is a SoftmaxGradient keep exp(z' - max) from
  // the stats pass and skip the second exponential. Not with label smoothing
  // (it reads z'), a softcap (its chain rule reads z') or teacher families;
  // block-coupled families only where the row is computed in place.
  const LossTraits traits = LossTraitsOf(config);
  const double smoothing = traits.has_cross_entropy ? ce.label_smoothing() : 0;
  const bool keep_exp =
      std::is_same_v<W, float> && smoothing == 0 &&
      options.logit_softcap == 0 && !traits.needs_teacher &&
      (!traits.couples_blocks || std::is_same_v<T, W>);

  std::vector<RowStats> stats(num_rows);
  std::vector<bool> have_stats(num_rows, false);
  // Top-k reads z' before the stats pass may overwrite it.
  auto analyse = [&](int64_t r, absl::Span<W> z) -> absl::Status {
    if (!outputs.top_k.empty()) {
      absl::Status top = TopK<W>(
          z, outputs.k, outputs.top_k.subspan(r * outputs.k, outputs.k));
      if (!top.ok()) return top;
    }
    absl::StatusOr<RowStats> row_stats;
    if constexpr (std::is_same_v<W, float>) {
      row_stats = keep_exp ? ComputeRowStatsKeepExp(z, inputs.rows[r].target, r)
                           : ComputeRowStats<W>(z, inputs.rows[r].target, r);
    } else {
      row_stats = ComputeRowStats<W>(z, inputs.rows[r].target, r);
    }
    if (!row_stats.ok()) return row_stats.status();
    stats[r] = *row_stats;
    have_stats[r] = true;
    return absl::OkStatus();
  };

  // Pass 1, block-coupled families only: q of every row with a mask.
  std::vector<double> q(num_rows, 0.0);
  if (traits.couples_blocks) {
    for (int64_t r = 0; r < num_rows; ++r) {
      if (mask[r] == 0) continue;
      DFLASH_RETURN_IF_ERROR(analyse(r, source.Draft(r)));
      q[r] = std::exp(stats[r].target_logit - stats[r].logsumexp);
    }
  }

  // Pass 2: each row's loss weight, and lk-lambda's per-block CE share.
  std::vector<double> weight(num_rows), ce_share(num_rows, 1.0);
  for (int64_t r = 0; r < num_rows; ++r) {
    weight[r] = RowLossWeight(config, inputs.rows[r].position, mask[r]);
  }
  // Block-level weights over each run of rows sharing a block id. Rows
  // without weight may be left out of a chunk: they change neither the
  // cumulative products nor the sums.
  for (int64_t b = 0, end = 0; b < num_rows; b = end) {
    end = b + 1;
    while (end < num_rows && inputs.rows[end].block == inputs.rows[b].block) {
      ++end;
    }
    const int64_t n = end - b;
    if (config.has_dpace()) {
      DPaceWeights(config.dpace(), absl::MakeConstSpan(q).subspan(b, n),
                   absl::MakeConstSpan(mask).subspan(b, n),
                   absl::MakeSpan(weight).subspan(b, n));
    } else if (config.has_lk_lambda()) {
      const v1::LkLambdaLoss& lk = config.lk_lambda();
      double hit_mass = 0, mass = 0;
      for (int64_t r = b; r < end; ++r) {
        hit_mass += q[r] * mask[r];
        mass += mask[r];
      }
      const double acc = mass > 0 ? hit_mass / mass : 0;
      const double kl_w = LkLambdaKlWeight(lk.kl_scale(), lk.kl_decay(), acc);
      std::fill(ce_share.begin() + b, ce_share.begin() + end, kl_w);
    }
  }

  // Pass 3: metrics, terms and d(loss_num)/d(logits), row by row.
  ChunkTerms terms;
  terms.correct_per_position.assign(block_size, 0.0);
  terms.mask_per_position.assign(block_size, 0.0);
  for (int64_t r = 0; r < num_rows; ++r) {
    const RowMeta& meta = inputs.rows[r];
    if (mask[r] == 0) {
      source.StoreZero(r);
      continue;
    }
    absl::Span<W> z = source.Draft(r);
    if (!have_stats[r]) {
      DFLASH_RETURN_IF_ERROR(analyse(r, z));
    }
    const RowStats& s = stats[r];
    const double neg_log_q = s.logsumexp - s.target_logit;
    if (!outputs.neg_log_q.empty()) outputs.neg_log_q[r] = neg_log_q;
    if (!outputs.argmax.empty()) outputs.argmax[r] = s.argmax;
    const double hit = mask[r] > 0.5 && s.argmax == meta.target;
    terms.correct += hit;
    terms.accuracy_den += mask[r];
    terms.correct_per_position[meta.position] += hit;
    terms.mask_per_position[meta.position] += mask[r];
    const double w = weight[r];
    if (w == 0) {
      source.StoreZero(r);
      continue;
    }
    terms.loss_den += w;
    source.KeepTransformed(z);

    if (config.has_distillation()) {
      absl::Span<const W> t = source.Teacher(r);
      absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
      if (!teacher.ok()) return TeacherError(teacher.status());
      terms.loss_num +=
          w * DistillationRow<W>(config.distillation(), z, s, t, *teacher, w);
      // Log-probability differences make no cheap bound here.
      DFLASH_RETURN_IF_ERROR(source.StoreGradient(
          r, z, w, std::numeric_limits<double>::infinity()));
      continue;
    }

    // Softmax-family terms: CE (label-smoothed), tv and z-loss.
    const double q_row = std::exp(-neg_log_q);
    const double ce_weight = config.has_tv() ? 0 : w * ce_share[r];
    const double tv_weight = config.has_tv()        ? w
                             : config.has_lk_lambda() ? w * (1 - ce_share[r])
                                                      : 0;
    const double z_weight = w * ce.z_loss_scale();
    double ce_term = neg_log_q;
    if (smoothing > 0) {
      double sum = 0;
      for (W x : z) sum += x;
      const double mean = sum / static_cast<double>(inputs.vocab);
      ce_term = (1 - smoothing) * neg_log_q + smoothing * (s.logsumexp - mean);
    }
    terms.loss_num += ce_weight * ce_term + tv_weight * (1 - q_row) +
                      z_weight * s.logsumexp * s.logsumexp;
    const SoftmaxGradient grad{
        ce_weight + tv_weight * q_row + 2 * z_weight * s.logsumexp,
        ce_weight * (1 - smoothing) + tv_weight * q_row,
        ce_weight * smoothing};
    // |softmax * p - target * onehot - uniform / V| with p <= 1.
    double bound = std::abs(grad.softmax) + std::abs(grad.target) +
                   std::abs(grad.uniform);

    if (config.has_dspark()) {
      const v1::DSparkLoss& dspark = config.dspark();
      absl::Span<const W> t = source.Teacher(r);
      absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
      if (!teacher.ok()) return TeacherError(teacher.status());
      const double l1 = DSparkL1Row<W>(z, meta.target, s, t, *teacher, grad,
                                       w * dspark.l1_weight());
      bound += 2 * std::abs(w * dspark.l1_weight());  // |sign - mass| <= 2.
      terms.loss_num += w * dspark.l1_weight() * l1;
      if (dspark.confidence_weight() > 0) {
        const double accept = DSparkAcceptance(l1);
        const double c = inputs.confidence_logits[r];
        if (!std::isfinite(c)) {
          return RowError(
              r, absl::StrCat("confidence logit is not finite (", c, ")"));
        }
        terms.loss_num +=
            w * dspark.confidence_weight() * ConfidenceBce(c, accept);
        if (!outputs.confidence_grad.empty()) {
          outputs.confidence_grad[r] =
              static_cast<float>(w * dspark.confidence_weight() *
                                 ConfidenceBceGradient(c, accept));
        }
      }
    } else if constexpr (std::is_same_v<W, float>) {
      if (keep_exp) {
        WriteSoftmaxGradientFromExp(z, meta.target, s, grad);
      } else {
        WriteSoftmaxGradient<W>(z, meta.target, s, grad);
      }
    } else {
      WriteSoftmaxGradient<W>(z, meta.target, s, grad);
    }
    DFLASH_RETURN_IF_ERROR(source.StoreGradient(r, z, w, bound));
  }
  return terms;
}

#define DFLASH_INSTANTIATE_CHUNK_LOSS(T)                                     \
  template absl::StatusOr<ChunkTerms> ChunkLoss<T>(                          \
      const v1::LossConfig&, const ChunkLossOptions&,                        \
      const ChunkLossInputs<T>&, const ChunkLossOutputs&);                   \
  template absl::Status ValidateChunkLossInputs<T>(                          \
      const v1::LossConfig&, const ChunkLossOptions&,                        \
      const ChunkLossInputs<T>&, const ChunkLossOutputs&);
DFLASH_INSTANTIATE_CHUNK_LOSS(float)
DFLASH_INSTANTIATE_CHUNK_LOSS(double)
DFLASH_INSTANTIATE_CHUNK_LOSS(BFloat16)
#undef DFLASH_INSTANTIATE_CHUNK_LOSS

}  // namespace dflash
