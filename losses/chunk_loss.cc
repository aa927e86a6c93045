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
        transform_(options.logit_scale, options.logit_softcap),
        identity_(transform_.identity()),
        transformed_(inputs.rows.size(), false) {
    if constexpr (!std::is_same_v<T, W>) draft_.resize(inputs.vocab);
    if (!inputs.teacher_logits.empty() &&
        (!identity_ || !std::is_same_v<T, W>)) {
      teacher_.resize(inputs.vocab);
    }
    if (transform_.softcap() > 0) transformed_copy_.resize(inputs.vocab);
  }

  absl::Span<W> Draft(int64_t r) {
    absl::Span<T> row =
        inputs_.logits.subspan(r * inputs_.stride(), inputs_.vocab);
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
        inputs_.teacher_logits.subspan(r * inputs_.stride(), inputs_.vocab);
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
    if (transform_.softcap() > 0) std::copy(z.begin(), z.end(), transformed_copy_.begin());
  }

  // Chains d/dz' in `grad` back to d/dz and stores row r. A gradient that
  // overflows the working type (from huge masks, loss weights or logit
  // transforms) is an error naming the row, never a silent inf. `bound` is
  // an upper bound on |d/dz'| over the row, from its coefficients, or
  // infinity where none is cheap: the row is scanned only when the bound
  // (times the chain's factor, at most the logit scale) might not fit.
  absl::Status StoreGradient(int64_t r, absl::Span<W> grad, double weight,
                             double bound) {
    if (transform_.softcap() > 0) {
      for (size_t v = 0; v < grad.size(); ++v) {
        grad[v] =
            static_cast<W>(transform_.Chain(grad[v], transformed_copy_[v]));
      }
    } else if (!identity_) {  // A scale alone: its chain reads no z'.
      for (W& g : grad) g = static_cast<W>(transform_.Chain(g, 0));
    }
    const double fits = std::numeric_limits<W>::max() / 2;
    const bool may_overflow = !(bound < fits && bound * transform_.scale() < fits);
    if (may_overflow &&
        !AllFinite(grad.data(), static_cast<int64_t>(grad.size()))) {
      return RowError(r, absl::StrCat(
          "d(loss)/d(logits) overflows ",
          std::is_same_v<W, float> ? "float32" : "float64",
          " (row weight ", weight,
          "); masks and loss weights this large need rescaling"));
    }
    if constexpr (!std::is_same_v<T, W>) {
      Narrow(grad.data(), inputs_.logits.data() + r * inputs_.stride(),
             inputs_.vocab);
    }
    return absl::OkStatus();
  }

  void StoreZero(int64_t r) {
    absl::Span<T> row =
        inputs_.logits.subspan(r * inputs_.stride(), inputs_.vocab);
    std::fill(row.begin(), row.end(), T{});
  }

 private:
  void Transform(absl::Span<W> row) const {
    if (identity_) return;
    for (W& x : row) x = static_cast<W>(transform_(x));
  }

  const ChunkLossInputs<T>& inputs_;
  const LogitTransform transform_;
  const bool identity_;
  std::vector<bool> transformed_;
  std::vector<W> draft_, teacher_, transformed_copy_;
};

// Distillation divergence of one row; writes its gradient times `weight`
// into z (d/dz' = weight / T * d/du with u = z' / T).
template <typename W>
double DistillationRow(const LossParams& p, absl::Span<W> z,
                       const RowStats& stats, absl::Span<const W> t,
                       const RowStats& teacher_stats, double weight) {
  const double inv_t = p.inv_temperature;
  const double lse = ScaledLogSumExp<W>(z, stats.max_logit, inv_t);
  const double teacher_lse =
      ScaledLogSumExp<W>(t, teacher_stats.max_logit, inv_t);
  const int64_t vocab = static_cast<int64_t>(z.size());
  const double beta = p.beta;
  const double log_beta = std::log(beta), log_rest = std::log1p(-beta);
  auto at = [&](int64_t v) {
    return DistillationAt<double>(p.divergence, beta, log_beta, log_rest,
                                  z[v] * inv_t - lse,
                                  t[v] * inv_t - teacher_lse);
  };
  const double g = weight * inv_t;
  double divergence = 0, student_part = 0;
  if (p.divergence == Divergence::kForwardKl) {
    for (int64_t v = 0; v < vocab; ++v) {
      const DistillationPoint<double> point = at(v);
      divergence += point.divergence;
      z[v] = static_cast<W>(g * point.forward_gradient);
    }
    return divergence;
  }
  for (int64_t v = 0; v < vocab; ++v) {
    const DistillationPoint<double> point = at(v);
    divergence += point.divergence;
    student_part += point.student_part;
  }
  for (int64_t v = 0; v < vocab; ++v) {
    z[v] = static_cast<W>(DistillationGradientAt<double>(
        p.divergence, beta, log_beta, log_rest, z[v] * inv_t - lse,
        t[v] * inv_t - teacher_lse, divergence, student_part, g));
  }
  return divergence;
}

// |p - t|_1 between draft and teacher softmax, and the draft's signed mass
// sum_v p_v sign(p_v - t_v).
struct SoftmaxDistance {
  double l1 = 0;
  double signed_mass = 0;
};
template <typename W>
SoftmaxDistance DistanceToTeacher(absl::Span<const W> z, const RowStats& stats,
                                  absl::Span<const W> t,
                                  const RowStats& teacher_stats) {
  SoftmaxDistance distance;
  for (size_t v = 0; v < z.size(); ++v) {
    const double p = std::exp(z[v] - stats.logsumexp);
    const double d = p - std::exp(t[v] - teacher_stats.logsumexp);
    distance.l1 += std::abs(d);
    distance.signed_mass += p * SignOf(d);
  }
  return distance;
}

// The gradient of DSpark's L1 between draft and teacher softmax (its
// `distance`, DistanceToTeacher's) times l1_coefficient, added to the
// softmax-family gradient `grad`, written into z.
template <typename W>
void WriteDSparkGradient(absl::Span<W> z, int32_t target,
                         const RowStats& stats, absl::Span<const W> t,
                         const RowStats& teacher_stats,
                         const SoftmaxDistance& distance,
                         const SoftmaxGradient& grad, double l1_coefficient) {
  const int64_t vocab = static_cast<int64_t>(z.size());
  const double signed_mass = distance.signed_mass;
  // d|p - t|_1 / dz_v = p_v (sign_v - sum_w p_w sign_w).
  const double uniform = grad.uniform / static_cast<double>(vocab);
  for (int64_t v = 0; v < vocab; ++v) {
    const double p = std::exp(z[v] - stats.logsumexp);
    const double d = p - std::exp(t[v] - teacher_stats.logsumexp);
    z[v] = static_cast<W>(DSparkGradient<double>(grad.softmax, l1_coefficient,
                                                 signed_mass, uniform, p, d));
  }
  z[target] = static_cast<W>(z[target] - grad.target);
}

// D-PARD's Renyi divergence of order 1/2, R = -2 log sum_v sqrt(p_v t_v),
// with its gradient times `credit` written into z.
template <typename W>
double DPardRow(absl::Span<W> z, const RowStats& stats, absl::Span<const W> t,
                const RowStats& teacher_stats, double credit) {
  // log sqrt(p t) = ((z - lse) + (t - lse_t)) / 2, summed stably.
  auto log_root = [&](size_t v) {
    return 0.5 * ((z[v] - stats.logsumexp) + (t[v] - teacher_stats.logsumexp));
  };
  double max = -std::numeric_limits<double>::infinity();
  for (size_t v = 0; v < z.size(); ++v) max = std::max(max, log_root(v));
  double sum = 0;
  for (size_t v = 0; v < z.size(); ++v) sum += std::exp(log_root(v) - max);
  const double log_sum = max + std::log(sum);
  for (size_t v = 0; v < z.size(); ++v) {
    const double q = std::exp(z[v] - stats.logsumexp);
    z[v] = static_cast<W>(credit *
                          RenyiGradient<double>(q, log_root(v) - log_sum));
  }
  return -2 * log_sum;
}

absl::Status CheckSize(const char* name, size_t size, int64_t expected,
                       absl::string_view why) {
  if (static_cast<int64_t>(size) == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("chunk loss: ", name,
                                                 " must hold ", expected,
                                                 " values (", why, "), got ",
                                                 size));
}

}  // namespace

absl::Status ValidateChunkLossOptions(const ChunkLossOptions& options) {
  if (options.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: block_size must be >= 1, got ", options.block_size));
  }
  if (!(options.logit_scale > 0) || std::isinf(options.logit_scale) ||
      !(options.logit_softcap >= 0) || std::isinf(options.logit_softcap)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: logit_scale must be finite and > 0 and logit_softcap "
        "finite and >= 0, got ",
        options.logit_scale, " and ", options.logit_softcap));
  }
  if (options.metric_top_k < 0 || options.metric_top_k > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: metric_top_k must lie in [0, 64], got ",
                     options.metric_top_k));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ValidateChunkLossInputs(const LossParams& params,
                                     const ChunkLossOptions& options,
                                     const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs) {
  const int64_t block_size = options.block_size, vocab = inputs.vocab;
  if (vocab <= 0 || vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: vocab must lie in [1, 2^31), got ", vocab));
  }
  if (inputs.row_stride != 0 && inputs.row_stride < vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: row_stride must be 0 (vocab) or >= vocab (",
                     vocab, "), got ", inputs.row_stride));
  }
  const int64_t num_rows = static_cast<int64_t>(inputs.rows.size());
  const int64_t stride = inputs.stride();
  const std::string rows_by = stride == vocab
                                  ? std::string("rows x vocab")
                                  : absl::StrCat("rows x row_stride ", stride);
  if (static_cast<int64_t>(inputs.logits.size()) != num_rows * stride) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: logits hold ", inputs.logits.size(),
                     " values, expected ", num_rows, " rows x ", stride,
                     stride == vocab ? " vocab" : " row_stride"));
  }
  const LossTraits traits = LossTraitsOf(params);
  if (traits.needs_teacher || !inputs.teacher_logits.empty()) {
    absl::Status size = CheckSize(
        "teacher_logits", inputs.teacher_logits.size(), num_rows * stride,
        traits.needs_teacher
            ? rows_by
            : absl::StrCat(rows_by, ", for the teacher diagnostics"));
    if (!size.ok()) return size;
  }
  if (!outputs.teacher_acceptance.empty() &&
      (inputs.teacher_logits.empty() ||
       params.family == LossFamily::kDistillation)) {
    return absl::InvalidArgumentError(
        "chunk loss: outputs.teacher_acceptance needs teacher logits and a "
        "loss other than distillation, got none");
  }
  if (traits.splits_correction) {
    DFLASH_RETURN_IF_ERROR(CheckSize(
        "correction_logits", inputs.correction_logits.size(), num_rows * stride,
        absl::StrCat(rows_by, ", for loss.domino")));
    if (!inputs.teacher_logits.empty() || !outputs.top_k.empty()) {
      return absl::InvalidArgumentError(
          "chunk loss: loss.domino takes no teacher logits and no "
          "outputs.top_k");
    }
  } else if (!inputs.correction_logits.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: correction_logits are read by loss.domino only (add the "
        "correction into the logits for loss.",
        traits.name, "), got ", inputs.correction_logits.size(), " values"));
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
        {"outputs.confidence_grad", outputs.confidence_grad.size()},
        {"outputs.target_probability", outputs.target_probability.size()},
        {"outputs.target_rank", outputs.target_rank.size()},
        {"outputs.loss_weight", outputs.loss_weight.size()},
        {"outputs.teacher_acceptance", outputs.teacher_acceptance.size()},
        {"outputs.base_argmax", outputs.base_argmax.size()}}) {
    if (size != 0) {
      absl::Status status = CheckSize(name, size, num_rows, "one per row");
      if (!status.ok()) return status;
    }
  }
  if (!outputs.target_rank.empty() && options.metric_top_k == 0) {
    return absl::InvalidArgumentError(
        "chunk loss: outputs.target_rank needs options.metric_top_k > 0, got "
        "0");
  }
  if (params.lk == LkMode::kLambdaBatch && outputs.target_probability.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: outputs.target_probability must hold ", num_rows,
        " values (one per row: the batch-level LK lambda scales each row's "
        "gradient by its q once the batch is done), got none"));
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
  if (!outputs.top_k_values.empty()) {
    if (outputs.top_k.empty()) {
      return absl::InvalidArgumentError(
          "chunk loss: outputs.top_k_values needs outputs.top_k, got none");
    }
    DFLASH_RETURN_IF_ERROR(CheckSize("outputs.top_k_values",
                                     outputs.top_k_values.size(),
                                     num_rows * outputs.k, "rows x k"));
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

// Domino's chunk: each row's base logits and, at positions >= suffix_start,
// final = base + correction, both transformed; terms from both, and the
// gradients d/d(base) = g_final + g_base and d/d(correction) = g_final
// (0 before the suffix), with g_final = (1 - lambda) w (softmax - onehot)
// of the final logits and g_base = lambda w (...) of the base logits.
template <typename T>
absl::StatusOr<ChunkTerms> DominoChunk(const LossParams& p,
                                       const ChunkLossOptions& options,
                                       const ChunkLossInputs<T>& inputs,
                                       const ChunkLossOutputs& outputs) {
  using W = Work<T>;
  const int64_t vocab = inputs.vocab;
  const LogitTransform transform(options.logit_scale, options.logit_softcap);
  std::vector<W> base(vocab), final(vocab);
  ChunkTerms terms = ChunkTerms::Zero(options.block_size);
  for (int64_t r = 0; r < static_cast<int64_t>(inputs.rows.size()); ++r) {
    const RowMeta& meta = inputs.rows[r];
    T* base_row = inputs.logits.data() + r * inputs.stride();
    T* correction_row = inputs.correction_logits.data() + r * inputs.stride();
    const double m = EffectiveMask(p, meta.target, meta.mask);
    if (m == 0) {
      std::fill_n(base_row, vocab, T{});
      std::fill_n(correction_row, vocab, T{});
      continue;
    }
    const bool corrected = meta.position >= p.suffix_start;
    for (int64_t v = 0; v < vocab; ++v) {
      const W b = static_cast<W>(AsDouble(base_row[v]));
      // The sum rounded to the logits' own type, as SpecForge adds them.
      const W sum = corrected ? static_cast<W>(AsDouble(FromDouble<T>(
                                    b + static_cast<W>(
                                            AsDouble(correction_row[v])))))
                              : b;
      base[v] = static_cast<W>(transform(b));
      final[v] = static_cast<W>(transform(sum));
    }
    DFLASH_ASSIGN_OR_RETURN(
        const RowStats s,
        ComputeRowStats<W>(absl::MakeConstSpan(final), meta.target, r));
    DFLASH_ASSIGN_OR_RETURN(
        const RowStats sb,
        ComputeRowStats<W>(absl::MakeConstSpan(base), meta.target, r));
    const double w = RowLossWeight(p, meta.position, m);
    const double ce = s.logsumexp - s.target_logit;
    const double base_ce = sb.logsumexp - sb.target_logit;
    const double q = std::exp(-ce);
    const bool hit = m > 0.5 && s.argmax == meta.target;
    const bool base_hit = m > 0.5 && sb.argmax == meta.target;
    const int32_t k = meta.position;
    terms.correct += hit;
    terms.base_correct += base_hit;
    terms.accuracy_den += m;
    terms.target_probability += m * q;
    terms.correct_per_position[k] += hit;
    terms.mask_per_position[k] += m;
    terms.target_probability_per_position[k] += m * q;
    terms.loss_weight_per_position[k] += w;
    terms.loss_den += w;
    terms.ce_num += w * ce;
    terms.base_ce_num += w * base_ce;
    terms.loss_num += (1 - p.lambda_base) * w * ce + p.lambda_base * w * base_ce;
    if (!outputs.neg_log_q.empty()) outputs.neg_log_q[r] = ce;
    if (!outputs.argmax.empty()) outputs.argmax[r] = s.argmax;
    if (!outputs.base_argmax.empty()) outputs.base_argmax[r] = sb.argmax;
    if (!outputs.target_probability.empty()) outputs.target_probability[r] = q;
    if (!outputs.loss_weight.empty()) {
      outputs.loss_weight[r] = static_cast<float>(w);
    }
    const double g_final = (1 - p.lambda_base) * w, g_base = p.lambda_base * w;
    bool finite = true;
    for (int64_t v = 0; v < vocab; ++v) {
      const double onehot = v == meta.target;
      const double d_final = transform.Chain(
          g_final * (std::exp(final[v] - s.logsumexp) - onehot), final[v]);
      const double d_base = transform.Chain(
          g_base * (std::exp(base[v] - sb.logsumexp) - onehot), base[v]);
      const W stored = static_cast<W>(d_final + d_base);
      finite = finite && std::isfinite(stored);
      base_row[v] = FromDouble<T>(stored);
      correction_row[v] = FromDouble<T>(corrected ? d_final : 0.0);
    }
    if (!finite) {
      return RowError(r, absl::StrCat("d(loss)/d(logits) overflows (row "
                                      "weight ",
                                      w,
                                      "); masks and loss weights this large "
                                      "need rescaling"));
    }
  }
  return terms;
}

}  // namespace

ChunkTerms ChunkTerms::Zero(int64_t block_size) {
  ChunkTerms terms;
#define DFLASH_POSITION_TERM(field, slot, dict, key) \
  terms.field.assign(block_size, 0.0);
#include "losses/chunk_terms.inc"
  return terms;
}

namespace {

// Add reaches AcceptedLengthTerms' fields through the table's block terms.
constexpr int kBlockTerms = 0
#define DFLASH_BLOCK_TERM(field, dict, key) +1
#include "losses/chunk_terms.inc"
    ;
static_assert(sizeof(AcceptedLengthTerms) == kBlockTerms * sizeof(double),
              "a field of AcceptedLengthTerms is missing from chunk_terms.inc");

void AddPerPosition(std::vector<double>& a, const std::vector<double>& b) {
  a.resize(std::max(a.size(), b.size()));
  for (size_t k = 0; k < b.size(); ++k) a[k] += b[k];
}

}  // namespace

void ChunkTerms::Add(const ChunkTerms& other) {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) field += other.field;
#define DFLASH_POSITION_TERM(field, slot, dict, key) \
  AddPerPosition(field, other.field);
#define DFLASH_BLOCK_TERM(field, dict, key) \
  accepted_length.field += other.accepted_length.field;
#include "losses/chunk_terms.inc"
}

FinishedLoss FinishTerms(const LossParams& params, ChunkTerms& terms,
                         int64_t sequences) {
  FinishedLoss f;
  if (params.family == LossFamily::kDomino) {
    constexpr double kEps = kDominoDenominatorOffset;
    const double den = terms.loss_den + kEps;
    f.denominator = den;
    f.loss = terms.loss_num / den;
    f.gradient_scale = f.confidence_scale = 1 / den;
    f.accuracy = terms.correct / (terms.accuracy_den + kEps);
    return f;
  }
  const double den = FlooredLossDen(terms.loss_den);
  f.denominator = den;
  f.accuracy = terms.accuracy_den > 0 ? terms.correct / terms.accuracy_den : 0;
  if (params.family == LossFamily::kDSpark) {
    f.accuracy = terms.correct / std::max(terms.accuracy_den, 1.0);
  }
  f.gradient_scale = f.confidence_scale = 1 / den;
  if (params.lk == LkMode::kLambdaBatch) {
    f.lk_kl_weight =
        BatchLkKlWeight(params, terms.target_probability, terms.accuracy_den);
    terms.loss_num =
        *f.lk_kl_weight * terms.ce_num + (1 - *f.lk_kl_weight) * terms.tv_num;
  }
  if (params.dpard) {
    // SpecForge: dpard_loss_num / sequences + alpha_conf * confidence_num /
    // loss_den, the first part per sequence.
    const double per_sequence = 1.0 / static_cast<double>(std::max<int64_t>(
                                          sequences, 1));
    f.loss = terms.dpard_num * per_sequence +
             params.confidence_weight * terms.confidence_num / den;
    f.gradient_scale = per_sequence;
    terms.loss_num = f.loss * den;
    return f;
  }
  f.loss = terms.loss_num / den;
  return f;
}

std::optional<double> RowsGradientScale(const LossParams& params,
                                        absl::Span<const RowMeta> rows,
                                        int64_t sequences) {
  if (params.family == LossFamily::kDPace ||
      params.lk == LkMode::kLambdaBatch) {
    return std::nullopt;
  }
  if (params.dpard) {
    return 1.0 / static_cast<double>(std::max<int64_t>(sequences, 1));
  }
  // loss_den: the weights of the rows with a mask, as the loss adds them.
  double den = 0;
  for (const RowMeta& row : rows) {
    const double mask = EffectiveMask(params, row.target, row.mask);
    if (mask > 0) den += RowLossWeight(params, row.position, mask);
  }
  if (params.family == LossFamily::kDomino) {
    return 1 / (den + kDominoDenominatorOffset);
  }
  return 1 / FlooredLossDen(den);
}

template <typename T>
absl::StatusOr<CpuChunkLoss<T>> CpuChunkLoss<T>::Create(
    const LossParams& params, const ChunkLossOptions& options) {
  DFLASH_RETURN_IF_ERROR(ValidateChunkLossOptions(options));
  return CpuChunkLoss(params, options);
}

absl::StatusOr<LossParams> ResolveChunkLoss(const v1::LossConfig& config) {
  absl::StatusOr<LossParams> params = ResolveLoss(config);
  if (!params.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: ", params.status().message()));
  }
  return params;
}

template <typename T>
absl::StatusOr<ChunkTerms> ChunkLoss(const v1::LossConfig& config,
                                     const ChunkLossOptions& options,
                                     const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs) {
  DFLASH_ASSIGN_OR_RETURN(LossParams params, ResolveChunkLoss(config));
  DFLASH_ASSIGN_OR_RETURN(CpuChunkLoss<T> loss,
                          CpuChunkLoss<T>::Create(params, options));
  return loss.Run(inputs, outputs);
}

template <typename T>
absl::StatusOr<ChunkTerms> CpuChunkLoss<T>::Run(
    const ChunkLossInputs<T>& inputs, const ChunkLossOutputs& outputs) const {
  using W = Work<T>;
  const LossParams& p = params_;
  DFLASH_RETURN_IF_ERROR(ValidateChunkLossInputs(p, options_, inputs, outputs));
  const int64_t num_rows = static_cast<int64_t>(inputs.rows.size());
  const int64_t block_size = options_.block_size;
  RowSource<T> source(inputs, options_);

  std::vector<double> mask(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    mask[r] = EffectiveMask(p, inputs.rows[r].target, inputs.rows[r].mask);
  }

  for (int64_t r = 0; r < num_rows; ++r) {
    if (!outputs.neg_log_q.empty()) outputs.neg_log_q[r] = 0;
    if (!outputs.argmax.empty()) outputs.argmax[r] = -1;
    if (!outputs.top_k.empty()) {
      std::fill_n(outputs.top_k.begin() + r * outputs.k, outputs.k, -1);
    }
    if (!outputs.confidence_grad.empty()) outputs.confidence_grad[r] = 0;
    if (!outputs.target_probability.empty()) outputs.target_probability[r] = 0;
    if (!outputs.target_rank.empty()) outputs.target_rank[r] = -1;
    if (!outputs.loss_weight.empty()) outputs.loss_weight[r] = 0;
    if (!outputs.teacher_acceptance.empty()) outputs.teacher_acceptance[r] = 0;
    if (!outputs.base_argmax.empty()) outputs.base_argmax[r] = -1;
    if (!outputs.top_k_values.empty()) {
      std::fill_n(outputs.top_k_values.begin() + r * outputs.k, outputs.k,
                  0.0f);
    }
  }

  if (p.family == LossFamily::kDomino) {
    return DominoChunk<T>(p, options_, inputs, outputs);
  }

  // Float rows whose gradient is a SoftmaxGradient keep exp(z' - max) from
  // the stats pass and skip the second exponential. Not with label smoothing
  // (it reads z'), a softcap (its chain rule reads z') or teacher families;
  // block-coupled families only where the row is computed in place.
  const LossTraits traits = LossTraitsOf(p);
  const double smoothing = p.label_smoothing;
  // The teacher diagnostics: teacher logits for a loss that reads none.
  const bool teacher_metrics =
      !traits.needs_teacher && !inputs.teacher_logits.empty();
  const bool keep_exp = std::is_same_v<W, float> && smoothing == 0 &&
                        options_.logit_softcap == 0 &&
                        inputs.teacher_logits.empty() &&
                        (!traits.couples_blocks || std::is_same_v<T, W>);

  std::vector<RowStats> stats(num_rows);
  std::vector<bool> have_stats(num_rows, false);
  // One top-k serves the caller's k and the diagnostics' (the shorter list
  // is a prefix of the longer: ties go to the lower index in both).
  const int32_t caller_k = outputs.top_k.empty() ? 0 : outputs.k;
  const int32_t metric_k = static_cast<int32_t>(
      std::min<int64_t>(options_.metric_top_k, inputs.vocab));
  const int32_t top_k = std::max(caller_k, metric_k);
  std::vector<int32_t> ids(top_k);
  std::vector<int32_t> rank(num_rows, -1);
  std::vector<double> top_mass(num_rows, 0.0);
  // The teacher diagnostics read each row's metric top-k again later.
  std::vector<int32_t> metric_ids(teacher_metrics ? num_rows * metric_k : 0);
  // Top-k reads z' before the stats pass may overwrite it.
  auto analyse = [&](int64_t r, absl::Span<W> z) -> absl::Status {
    const int32_t target = inputs.rows[r].target;
    if (top_k > 0) {
      DFLASH_RETURN_IF_ERROR(TopK<W>(z, top_k, absl::MakeSpan(ids)));
      std::copy_n(ids.begin(), caller_k, outputs.top_k.begin() + r * caller_k);
      if (!outputs.top_k_values.empty()) {
        for (int32_t j = 0; j < caller_k; ++j) {
          outputs.top_k_values[r * caller_k + j] =
              static_cast<float>(z[ids[j]]);
        }
      }
    }
    absl::StatusOr<RowStats> row_stats;
    if constexpr (std::is_same_v<W, float>) {
      row_stats = keep_exp ? ComputeRowStatsKeepExp(z, target, r)
                           : ComputeRowStats<W>(z, target, r);
    } else {
      row_stats = ComputeRowStats<W>(z, target, r);
    }
    if (!row_stats.ok()) return row_stats.status();
    const RowStats& s = *row_stats;
    stats[r] = s;
    have_stats[r] = true;
    if (metric_k > 0) {
      // p = exp(z' - lse); ComputeRowStatsKeepExp left exp(z' - max) in z.
      const double from_exp = std::exp(s.max_logit - s.logsumexp);
      for (int32_t j = 0; j < metric_k; ++j) {
        if (ids[j] == target) rank[r] = j;
        top_mass[r] +=
            keep_exp ? z[ids[j]] * from_exp : std::exp(z[ids[j]] - s.logsumexp);
      }
    }
    if (teacher_metrics) {
      std::copy_n(ids.begin(), metric_k, metric_ids.begin() + r * metric_k);
    }
    return absl::OkStatus();
  };

  // DSpark's rows with a teacher: its stats, the softmax distance and each
  // row's acceptance clamp(1 - |q - p|_1 / 2, 0, 1), without gradient.
  std::vector<RowStats> teacher_stats(traits.needs_teacher ? num_rows : 0);
  std::vector<SoftmaxDistance> distances(traits.needs_teacher ? num_rows : 0);
  std::vector<double> accept(num_rows, 0.0);
  auto distance = [&](int64_t r, absl::Span<const W> z,
                      absl::Span<const W> t) -> absl::Status {
    absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
    if (!teacher.ok()) return TeacherError(teacher.status());
    teacher_stats[r] = *teacher;
    distances[r] = DistanceToTeacher<W>(z, stats[r], t, *teacher);
    accept[r] = DSparkAcceptance(distances[r].l1);
    return absl::OkStatus();
  };

  // Pass 1, block-coupled families only: q (D-PARD: the acceptance) of
  // every row with a mask.
  std::vector<double> q(num_rows, 0.0);
  if (traits.couples_blocks) {
    for (int64_t r = 0; r < num_rows; ++r) {
      if (mask[r] == 0) continue;
      absl::Span<W> z = source.Draft(r);
      DFLASH_RETURN_IF_ERROR(analyse(r, z));
      q[r] = std::exp(stats[r].target_logit - stats[r].logsumexp);
      if (p.dpard) {
        DFLASH_RETURN_IF_ERROR(distance(r, z, source.Teacher(r)));
      }
    }
  }

  // Pass 2: each row's loss weight, lk-lambda's per-block CE share and
  // D-PARD's credit.
  std::vector<double> weight(num_rows), ce_share(num_rows, 1.0);
  std::vector<double> credit(p.dpard ? num_rows : 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    weight[r] = RowLossWeight(p, inputs.rows[r].position, mask[r]);
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
    auto q_of = [&](int64_t i) { return q[b + i]; };
    auto mask_of = [&](int64_t i) { return mask[b + i]; };
    if (p.family == LossFamily::kDPace) {
      DPaceBlockWeights(p, n, q_of, mask_of, weight.data() + b);
    } else if (p.dpard) {
      DPaceBlockWeights(
          DPardCreditParams(p), n, [&](int64_t i) { return accept[b + i]; },
          mask_of, credit.data() + b);
    } else if (p.lk == LkMode::kLambdaBlock) {
      std::fill(ce_share.begin() + b, ce_share.begin() + end,
                LkLambdaBlockShare(p, n, q_of, mask_of));
    }
  }

  // Pass 3: metrics, terms and d(loss_num)/d(logits), row by row.
  ChunkTerms terms = ChunkTerms::Zero(block_size);
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
    const double q_r = std::exp(-neg_log_q);
    const int32_t k = meta.position;
    terms.correct += hit;
    terms.accuracy_den += mask[r];
    terms.target_probability += mask[r] * q_r;
    terms.correct_per_position[k] += hit;
    terms.mask_per_position[k] += mask[r];
    terms.target_probability_per_position[k] += mask[r] * q_r;
    terms.top_k_recall_per_position[k] += rank[r] >= 0 ? mask[r] : 0.0;
    terms.top_k_mass_per_position[k] += mask[r] * top_mass[r];
    if (!outputs.target_probability.empty()) {
      outputs.target_probability[r] = q_r;
    }
    if (!outputs.target_rank.empty()) outputs.target_rank[r] = rank[r];
    if (teacher_metrics) {
      // z is z' still: no gradient has been written, no exps kept.
      absl::Span<const W> t = source.Teacher(r);
      absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
      if (!teacher.ok()) return TeacherError(teacher.status());
      const double accept =
          DSparkAcceptance(DistanceToTeacher<W>(z, s, t, *teacher).l1);
      double mass = 0;
      for (int32_t j = 0; j < metric_k; ++j) {
        mass += std::exp(t[metric_ids[r * metric_k + j]] - teacher->logsumexp);
      }
      terms.teacher_acceptance_per_position[k] += mask[r] * accept;
      terms.teacher_agreement_per_position[k] +=
          teacher->argmax == s.argmax ? mask[r] : 0.0;
      terms.teacher_top_k_mass_per_position[k] += mask[r] * mass;
      if (!outputs.teacher_acceptance.empty()) {
        outputs.teacher_acceptance[r] = accept;
      }
    }
    const double w = weight[r];
    if (w == 0) {
      source.StoreZero(r);
      continue;
    }
    terms.loss_den += w;
    terms.loss_weight_per_position[k] += w;
    if (!outputs.loss_weight.empty()) {
      outputs.loss_weight[r] = static_cast<float>(w);
    }
    source.KeepTransformed(z);

    if (p.family == LossFamily::kDistillation) {
      absl::Span<const W> t = source.Teacher(r);
      absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
      if (!teacher.ok()) return TeacherError(teacher.status());
      terms.loss_num += w * DistillationRow<W>(p, z, s, t, *teacher, w);
      // Log-probability differences make no cheap bound here.
      DFLASH_RETURN_IF_ERROR(source.StoreGradient(
          r, z, w, std::numeric_limits<double>::infinity()));
      continue;
    }

    // DSpark's teacher terms, and its confidence term from the acceptance.
    absl::Span<const W> t;  // The teacher's z', for DSpark's gradient.
    if (p.family == LossFamily::kDSpark && traits.needs_teacher) {
      t = source.Teacher(r);
      if (!p.dpard) DFLASH_RETURN_IF_ERROR(distance(r, z, t));
      const RowStats& teacher = teacher_stats[r];
      terms.teacher_top1 +=
          mask[r] * std::exp(teacher.max_logit - teacher.logsumexp);
      terms.draft_top1 += mask[r] * std::exp(s.max_logit - s.logsumexp);
      terms.teacher_agreement_per_position[k] +=
          teacher.argmax == s.argmax ? mask[r] : 0.0;
      terms.teacher_acceptance_per_position[k] += mask[r] * accept[r];
      if (!outputs.teacher_acceptance.empty()) {
        outputs.teacher_acceptance[r] = accept[r];
      }
      if (p.confidence_weight > 0) {
        const double c = inputs.confidence_logits[r];
        if (!std::isfinite(c)) {
          return RowError(
              r, absl::StrCat("confidence logit is not finite (", c, ")"));
        }
        const double bce = ConfidenceBce(c, accept[r]);
        terms.confidence_num += w * bce;
        terms.confidence_error_num +=
            w * std::abs(1 / (1 + std::exp(-c)) - accept[r]);
        terms.loss_num += w * p.confidence_weight * bce;
        if (!outputs.confidence_grad.empty()) {
          outputs.confidence_grad[r] = static_cast<float>(
              w * p.confidence_weight * ConfidenceBceGradient(c, accept[r]));
        }
      }
      if (p.dpard) {
        const double renyi = DPardRow<W>(z, s, t, teacher, credit[r]);
        terms.dpard_num += credit[r] * renyi;
        terms.loss_num += credit[r] * renyi;
        terms.dpard_credit_per_position[k] += credit[r];
        // SpecForge reports D-PARD's CE too, without gradient.
        terms.ce_num += w * neg_log_q;
        terms.ce_per_position[k] += mask[r] * neg_log_q;
        // |q - normalised sqrt(q p)| <= 1.
        DFLASH_RETURN_IF_ERROR(source.StoreGradient(r, z, w, credit[r]));
        continue;
      }
    }

    // Softmax-family terms: CE (label-smoothed), tv and z-loss.
    double mean = 0;
    if (smoothing > 0) {
      for (W x : z) mean += x;
      mean /= static_cast<double>(inputs.vocab);
    }
    const SoftmaxRowTerms row = SoftmaxFamilyRow(
        p, w, CrossEntropyShare(p, ce_share[r]), neg_log_q, s.logsumexp, mean);
    terms.loss_num += row.loss;
    terms.ce_num += row.ce;
    terms.tv_num += row.tv;
    if (p.family == LossFamily::kDSpark) {
      terms.ce_per_position[k] += mask[r] * row.ce / w;
    }
    const SoftmaxGradient grad{row.softmax, row.target, row.uniform};
    // |softmax * p - target * onehot - uniform / V| with p <= 1.
    double bound = std::abs(grad.softmax) + std::abs(grad.target) +
                   std::abs(grad.uniform);

    if (p.family == LossFamily::kDSpark && traits.needs_teacher) {
      const double l1_coefficient = w * p.l1_weight;
      const double l1 = distances[r].l1;
      WriteDSparkGradient<W>(z, meta.target, s, t, teacher_stats[r],
                             distances[r], grad, l1_coefficient);
      bound += 2 * std::abs(l1_coefficient);  // |sign - mass| <= 2.
      terms.loss_num += l1_coefficient * l1;
      if (p.l1_weight > 0) terms.l1_num += w * l1;
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
  template class CpuChunkLoss<T>;                                            \
  template absl::StatusOr<ChunkTerms> ChunkLoss<T>(                          \
      const v1::LossConfig&, const ChunkLossOptions&,                        \
      const ChunkLossInputs<T>&, const ChunkLossOutputs&);                   \
  template absl::Status ValidateChunkLossInputs<T>(                          \
      const LossParams&, const ChunkLossOptions&, const ChunkLossInputs<T>&, \
      const ChunkLossOutputs&);
DFLASH_INSTANTIATE_CHUNK_LOSS(float)
DFLASH_INSTANTIATE_CHUNK_LOSS(double)
DFLASH_INSTANTIATE_CHUNK_LOSS(BFloat16)
#undef DFLASH_INSTANTIATE_CHUNK_LOSS

}  // namespace dflash
