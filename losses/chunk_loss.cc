#include "losses/chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/cpu_dispatch.h"
#include "base/status_macros.h"
#include "losses/family_passes.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/row_rules.h"
#include "losses/row_error.h"
#include "losses/row_kernels.h"
#include "losses/term_slots.h"
#include "losses/vocab_shard.h"

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

// A row's term into ChunkTerms as the CUDA reduction adds it: to its summed
// term and to every per-position term that names its slot.
void AddTerm(ChunkTerms& terms, TermSlot slot, int32_t position,
             double value) {
  switch (slot) {
#define DFLASH_SUMMED_TERM(field, name, dict, key) \
  case name:                                       \
    terms.field += value;                          \
    break;
#include "losses/chunk_terms.inc"
    default:
      break;
  }
#define DFLASH_POSITION_TERM(field, name, dict, key) \
  if (slot == name) terms.field[position] += value;
#include "losses/chunk_terms.inc"
}

absl::Status ConfidenceError(int64_t r, double c) {
  return RowError(r, absl::StrCat("confidence logit is not finite (", c, ")"));
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
  if (const VocabShard* shard = options.vocab_shard; shard != nullptr) {
    DFLASH_RETURN_IF_ERROR(CheckShardFields(*shard, 0, "vocab_shard"));
  }
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
        {"outputs.base_argmax", outputs.base_argmax.size()},
        {"outputs.teacher_argmax", outputs.teacher_argmax.size()}}) {
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
  // Ids are of the whole vocabulary, whatever a process holds of it.
  const VocabShard* shard = options.vocab_shard;
  const int64_t classes = shard != nullptr ? shard->vocab : vocab;
  if (shard != nullptr) {
    DFLASH_RETURN_IF_ERROR(
        CheckShardFields(*shard, vocab, "chunk loss: vocab_shard"));
  }
  if (!outputs.top_k.empty()) {
    if (outputs.k < 1 || outputs.k > 64 || outputs.k > classes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk loss: outputs.k must lie in [1, min(64, V = ", classes,
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
    if (!inputs.rows_checked &&
        (meta.position < 0 || meta.position >= block_size)) {
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
    if (!inputs.rows_checked &&
        (!(meta.mask >= 0) || !std::isfinite(meta.mask))) {
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

// A row's stats as the loss reads them: of its target, or, for a row with
// a mask and no target class (HasTarget, as the passes test it: its target
// ignore_index, counted), with -log q = 0 exactly. Any other target outside
// [0, V) is compute's error.
template <typename W, typename Compute>
absl::StatusOr<RowStats> StatsForTarget(const LossParams& p, int32_t target,
                                        Compute compute) {
  if (HasTarget(target) || target != p.ignore_index) return compute(target);
  absl::StatusOr<RowStats> stats = compute(0);
  if (stats.ok()) stats->target_logit = stats->logsumexp;
  return stats;
}

// A vocab-parallel row's stats record, every process's merged in rank
// order: this range's max, sum of exp(z' - max), target logit (-inf where
// the target lies in another range) and argmax (a global id). ChunkPasses
// adds a family's fields after these; Domino its base logits' four.
// A record's stats of a range (RangeStatsField, vocab_shard.h), then for
// Domino the base logits' from here.
constexpr int kStatsBase = kRangeStatsSize;

// `s`, the stats of a range starting at class `offset` (its target logit
// read where `here`), as a record's first kStatsBase fields at `out`.
void PutRangeStats(const RowStats& s, bool here, int64_t offset,
                   double* out) {
  out[kRangeMax] = s.max_logit;
  out[kRangeSumExp] = std::exp(s.logsumexp - s.max_logit);
  out[kRangeTargetLogit] =
      here ? s.target_logit : -std::numeric_limits<double>::infinity();
  out[kRangeArgmax] = static_cast<double>(offset + s.argmax);
}

// Domino's row on the CPU (family_passes.h's DominoPass): each row's base
// logits and, at positions >= suffix_start, final = base + correction, both
// transformed into scratch in the working type. Vocab-parallel, the row's
// logits are classes [offset, offset + vocab) of the whole vocabulary and
// its whole row's stats (final, then base) are `merged`'s, which every
// process of the group merged alike (DominoShardStats).
template <typename T>
class DominoRow {
 public:
  using W = Work<T>;

  DominoRow(const LossParams& p, const LogitTransform& transform,
            const ChunkLossInputs<T>& inputs, const ChunkLossOutputs& outputs,
            int64_t r, double mask, std::vector<W>& base,
            std::vector<W>& final, ChunkTerms& terms, int64_t offset = 0,
            const RowStats* merged = nullptr)
      : p_(p),
        transform_(transform),
        outputs_(outputs),
        r_(r),
        meta_(inputs.rows[r]),
        mask_(mask),
        weight_(RowLossWeight(p, meta_.position, mask)),
        vocab_(inputs.vocab),
        base_row_(inputs.logits.data() + r * inputs.stride()),
        correction_row_(inputs.correction_logits.data() + r * inputs.stride()),
        base_(base),
        final_(final),
        terms_(terms),
        offset_(offset),
        merged_(merged) {}

  const LossParams& loss() const { return p_; }
  int32_t target() const { return meta_.target; }
  double mask() const { return mask_; }
  double weight() const { return weight_; }

  // Vocab-parallel: this range's record of the row (RangeStatsField of the
  // final logits, then of the base logits at kStatsBase); its target is
  // in [0, vocab) of the whole vocabulary.
  absl::Status RangeStats(double* out) {
    Transform();
    const int64_t local = meta_.target - offset_;
    const bool here = local >= 0 && local < vocab_;
    const int32_t target = here ? static_cast<int32_t>(local) : 0;
    absl::StatusOr<RowStats> s =
        ComputeRowStats<W>(absl::MakeConstSpan(final_), target, r_);
    if (!s.ok()) return ShardRangeError(s.status(), offset_);
    absl::StatusOr<RowStats> b =
        ComputeRowStats<W>(absl::MakeConstSpan(base_), target, r_);
    if (!b.ok()) return ShardRangeError(b.status(), offset_);
    PutRangeStats(*s, here, offset_, out);
    PutRangeStats(*b, here, offset_, out + kStatsBase);
    return absl::OkStatus();
  }

  bool DominoStats(DominoRowStats& out) {
    Transform();
    if (merged_ != nullptr) {
      s_ = merged_[0];
      sb_ = merged_[1];
    } else {
      absl::StatusOr<RowStats> s =
          ComputeRowStats<W>(absl::MakeConstSpan(final_), meta_.target, r_);
      if (s.ok()) {
        sb_ = ComputeRowStats<W>(absl::MakeConstSpan(base_), meta_.target, r_);
      }
      if (!s.ok() || !sb_.ok()) {
        status_ = s.ok() ? sb_.status() : s.status();
        return false;
      }
      s_ = *s;
    }
    out.neg_log_q = s_.logsumexp - s_.target_logit;
    out.base_neg_log_q = sb_->logsumexp - sb_->target_logit;
    out.argmax = s_.argmax;
    out.base_argmax = sb_->argmax;
    return true;
  }

  void SetDominoOutputs(const DominoRowStats& s, double q) {
    if (!outputs_.neg_log_q.empty()) outputs_.neg_log_q[r_] = s.neg_log_q;
    if (!outputs_.argmax.empty()) outputs_.argmax[r_] = s.argmax;
    if (!outputs_.base_argmax.empty()) outputs_.base_argmax[r_] = s.base_argmax;
    if (!outputs_.target_probability.empty()) {
      outputs_.target_probability[r_] = q;
    }
    if (!outputs_.loss_weight.empty()) {
      outputs_.loss_weight[r_] = weight_;
    }
  }

  void WriteDominoGradient(double g_final, double g_base) {
    const bool corrected = meta_.position >= p_.suffix_start;
    bool finite = true;
    for (int64_t v = 0; v < vocab_; ++v) {
      const double onehot = offset_ + v == meta_.target;
      const double d_final = transform_.Chain(
          g_final * (std::exp(final_[v] - s_.logsumexp) - onehot), final_[v]);
      const double d_base = transform_.Chain(
          g_base * (std::exp(base_[v] - sb_->logsumexp) - onehot), base_[v]);
      const W stored = static_cast<W>(d_final + d_base);
      finite = finite && std::isfinite(stored);
      base_row_[v] = FromDouble<T>(stored);
      correction_row_[v] = FromDouble<T>(corrected ? d_final : 0.0);
    }
    if (!finite) {
      status_ = RowError(r_, absl::StrCat("d(loss)/d(logits) overflows (row "
                                          "weight ",
                                          weight_,
                                          "); masks and loss weights this "
                                          "large need rescaling"));
    }
  }

  void Add(TermSlot slot, double value) {
    AddTerm(terms_, slot, meta_.position, value);
  }

  const absl::Status& status() const { return status_; }

 private:
  // The row's base and final logits, transformed, into base_ and final_.
  void Transform() {
    const bool corrected = meta_.position >= p_.suffix_start;
    for (int64_t v = 0; v < vocab_; ++v) {
      const W b = static_cast<W>(AsDouble(base_row_[v]));
      // The sum rounded to the logits' own type, as SpecForge adds them.
      const W sum = corrected ? static_cast<W>(AsDouble(FromDouble<T>(
                                    b + static_cast<W>(
                                            AsDouble(correction_row_[v])))))
                              : b;
      base_[v] = static_cast<W>(transform_(b));
      final_[v] = static_cast<W>(transform_(sum));
    }
  }

  const LossParams& p_;
  const LogitTransform& transform_;
  const ChunkLossOutputs& outputs_;
  const int64_t r_;
  const RowMeta& meta_;
  const double mask_, weight_;
  const int64_t vocab_;
  T* const base_row_;
  T* const correction_row_;
  std::vector<W>& base_;
  std::vector<W>& final_;
  ChunkTerms& terms_;
  const int64_t offset_;
  const RowStats* const merged_;
  RowStats s_;
  absl::StatusOr<RowStats> sb_;
  absl::Status status_;
};

// The whole row's stats from every process's record fields from `field`
// on (RangeStatsField), in rank order; the target logit its owner's.
RowStats MergeRangeStats(absl::Span<const double* const> records,
                         int field) {
  const MergedRangeStats m = MergeRangeRecords(records, field);
  return {m.max, m.max + std::log(m.sum_exp), m.target_logit, m.argmax};
}

// Vocab-parallel Domino: every row's final and base stats over this range
// in one gather (2 * kStatsBase values a row), merged in rank order into
// two RowStats a row (final, base), the same on every process.
template <typename T>
absl::StatusOr<std::vector<RowStats>> DominoShardStats(
    const LossParams& p, const LogitTransform& transform,
    const VocabShard& shard, const ChunkLossInputs<T>& inputs,
    const ChunkLossOutputs& outputs, std::vector<Work<T>>& base,
    std::vector<Work<T>>& final, ChunkTerms& terms) {
  constexpr int kPerRow = 2 * kStatsBase;
  const int64_t num_rows = static_cast<int64_t>(inputs.rows.size());
  std::vector<double> record(kRecordHead + num_rows * kPerRow, 0.0), gathered;
  std::vector<double> mask(num_rows);
  absl::Status local;
  for (int64_t r = 0; r < num_rows && local.ok(); ++r) {
    const RowMeta& meta = inputs.rows[r];
    mask[r] = EffectiveMask(p, meta.target, meta.mask);
    if (mask[r] == 0) continue;
    if (meta.target < 0 || meta.target >= shard.vocab) {
      local = RowError(r, absl::StrCat("target id ", meta.target,
                                       " is outside [0, ", shard.vocab, ")"));
      break;
    }
    DominoRow<T> row(p, transform, inputs, outputs, r, mask[r], base, final,
                     terms, shard.offset);
    local = row.RangeStats(record.data() + kRecordHead + r * kPerRow);
  }
  DFLASH_RETURN_IF_ERROR(GatherRecords(*shard.exchange, local,
                                       absl::MakeSpan(record), gathered));
  const int size = shard.exchange->size();
  std::vector<RowStats> merged(2 * num_rows);
  std::vector<const double*> records(size);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (mask[r] == 0) continue;
    for (int q = 0; q < size; ++q) {
      records[q] =
          gathered.data() + q * record.size() + kRecordHead + r * kPerRow;
    }
    merged[2 * r] = MergeRangeStats(records, 0);
    merged[2 * r + 1] = MergeRangeStats(records, kStatsBase);
  }
  return merged;
}

// Domino's chunk: DominoPass over each row with a mask.
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
  const VocabShard* shard = options.vocab_shard;
  std::vector<RowStats> merged;
  if (shard != nullptr) {
    DFLASH_ASSIGN_OR_RETURN(merged,
                            DominoShardStats<T>(p, transform, *shard, inputs,
                                                outputs, base, final, terms));
  }
  absl::Status local;
  for (int64_t r = 0; r < static_cast<int64_t>(inputs.rows.size()); ++r) {
    const RowMeta& meta = inputs.rows[r];
    const double m = EffectiveMask(p, meta.target, meta.mask);
    if (m == 0) {
      std::fill_n(inputs.logits.data() + r * inputs.stride(), vocab, T{});
      std::fill_n(inputs.correction_logits.data() + r * inputs.stride(), vocab,
                  T{});
      continue;
    }
    DominoRow<T> row(p, transform, inputs, outputs, r, m, base, final, terms,
                     shard != nullptr ? shard->offset : 0,
                     shard != nullptr ? &merged[2 * r] : nullptr);
    DominoPass(row);
    local = row.status();
    if (!local.ok()) break;
  }
  if (shard == nullptr) {
    DFLASH_RETURN_IF_ERROR(local);
    return terms;
  }
  // Vocab-parallel, a gradient may overflow in one range alone: the
  // chunk's closing gather (a record head) stops every process here.
  std::vector<double> record(kRecordHead), gathered;
  DFLASH_RETURN_IF_ERROR(GatherRecords(*shard->exchange, local,
                                       absl::MakeSpan(record), gathered));
  return terms;
}

// Every per-row output as a row without a mask leaves it, so that the rows
// a pass skips read as such.
void ResetRowOutputs(int64_t num_rows, const ChunkLossOutputs& outputs) {
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
    if (!outputs.teacher_argmax.empty()) outputs.teacher_argmax[r] = -1;
    if (!outputs.top_k_values.empty()) {
      std::fill_n(outputs.top_k_values.begin() + r * outputs.k, outputs.k,
                  0.0f);
    }
  }
}

// One chunk of every family but Domino, as passes over its rows: the
// block-coupled families need every row's q before any row's weight, so
// the passes keep what they hand each other (stats, top-k metrics, teacher
// stats, q, weights) per row here. The loss pass of a row is
// family_passes.h's, over ChunkPasses::Row.
template <typename T>
class ChunkPasses {
 public:
  using W = Work<T>;

  ChunkPasses(const LossParams& p, const ChunkLossOptions& options,
              const ChunkLossInputs<T>& inputs,
              const ChunkLossOutputs& outputs)
      : p_(p),
        options_(options),
        inputs_(inputs),
        outputs_(outputs),
        traits_(LossTraitsOf(p)),
        num_rows_(static_cast<int64_t>(inputs.rows.size())),
        teacher_metrics_(!traits_.needs_teacher &&
                         !inputs.teacher_logits.empty()),
        shard_(options.vocab_shard),
        offset_(shard_ != nullptr ? shard_->offset : 0),
        classes_(shard_ != nullptr ? shard_->vocab : inputs.vocab),
        keep_exp_(std::is_same_v<W, float> && p.label_smoothing == 0 &&
                  options.logit_softcap == 0 &&
                  inputs.teacher_logits.empty() && shard_ == nullptr &&
                  (!traits_.couples_blocks || std::is_same_v<T, W>)),
        caller_k_(outputs.top_k.empty() ? 0 : outputs.k),
        metric_k_(static_cast<int32_t>(
            std::min<int64_t>(options.metric_top_k, classes_))),
        top_k_(std::max(caller_k_, metric_k_)),
        source_(inputs, options),
        mask_(num_rows_),
        stats_(num_rows_),
        have_stats_(num_rows_, false),
        ids_(top_k_),
        rank_(num_rows_, -1),
        top_mass_(num_rows_, 0.0),
        metric_ids_(teacher_metrics_ ? num_rows_ * metric_k_ : 0),
        teacher_stats_(inputs.teacher_logits.empty() ? 0 : num_rows_),
        have_teacher_stats_(inputs.teacher_logits.empty() ? 0 : num_rows_,
                            false),
        accept_(num_rows_, 0.0),
        q_(num_rows_, 0.0),
        weight_(num_rows_),
        share_(num_rows_, 1.0) {
    if (shard_ != nullptr) {
      shard_rows_.resize(num_rows_);
      mean_sum_.assign(num_rows_, 0.0);
      teacher_mass_.assign(teacher_metrics_ ? num_rows_ : 0, 0.0);
      gradient_.resize(inputs.vocab);
    }
    for (int64_t r = 0; r < num_rows_; ++r) {
      mask_[r] = EffectiveMask(p, inputs.rows[r].target, inputs.rows[r].mask);
    }
  }

  absl::StatusOr<ChunkTerms> Run() {
    if (shard_ != nullptr) return ShardRun();
    if (traits_.couples_blocks) DFLASH_RETURN_IF_ERROR(CoupledPass());
    WeightPass();
    ChunkTerms terms = ChunkTerms::Zero(options_.block_size);
    for (int64_t r = 0; r < num_rows_; ++r) {
      DFLASH_RETURN_IF_ERROR(RowTerms(r, terms));
    }
    return terms;
  }

 private:
  // How a vocab-parallel row sum merges the processes' partials: added in
  // rank order, or (max, sum of exp(x - max)) pairs merged as online
  // softmax, to a logsumexp.
  enum class Merge { kSum, kLogSumExp };
  // The values of one process's partial of a row sum.
  static constexpr int kPartial = 2;

  // family_passes.h's Row over row r with draft z', teacher t' (empty
  // without one) and its stats, computed in double.
  class Row {
   public:
    using Real = double;

    Row(ChunkPasses& passes, int64_t r, absl::Span<W> z,
        absl::Span<const W> t, const RowStats* teacher, double weight,
        ChunkTerms* terms)
        : c_(passes),
          r_(r),
          meta_(passes.inputs_.rows[r]),
          s_(passes.stats_[r]),
          z_(z),
          t_(t),
          teacher_(teacher),
          weight_(weight),
          terms_(terms),
          lse_(s_.logsumexp),
          teacher_lse_(teacher != nullptr ? teacher->logsumexp : 0) {}

    const LossParams& loss() const { return c_.p_; }
    // The whole vocabulary (vocab-parallel: of every process).
    int64_t vocab() const { return c_.classes_; }
    int32_t target() const { return meta_.target; }
    double mask() const { return c_.mask_[r_]; }
    double weight() const { return weight_; }
    double neg_log_q() const { return s_.logsumexp - s_.target_logit; }
    double lse() const { return s_.logsumexp; }
    double MeanLogit() const {
      if (c_.shard_ != nullptr) {
        return c_.mean_sum_[r_] / static_cast<double>(c_.classes_);
      }
      double sum = 0;
      for (W x : z_) sum += x;
      return sum / static_cast<double>(z_.size());
    }
    double share() const { return c_.share_[r_]; }
    double accept() const { return c_.accept_[r_]; }
    bool has_teacher() const { return !t_.empty(); }
    double confidence() const { return c_.inputs_.confidence_logits[r_]; }

    double LogSoftmax(double zp) const { return zp - lse_; }
    double Softmax(double zp) const { return std::exp(zp - lse_); }
    double TemperedLogSoftmax(double zp) const {
      return zp * c_.p_.inv_temperature - tempered_lse_;
    }
    double TeacherLogSoftmax(double tp) const {
      return tp - teacher_lse_;
    }
    double TeacherSoftmax(double tp) const {
      return std::exp(tp - teacher_lse_);
    }
    double TeacherTemperedLogSoftmax(double tp) const {
      return tp * c_.p_.inv_temperature - teacher_tempered_lse_;
    }
    double DraftTop1() const { return std::exp(s_.max_logit - s_.logsumexp); }
    double TeacherTop1() const {
      return std::exp(teacher_->max_logit - teacher_->logsumexp);
    }
    bool TeacherAgrees() const { return teacher_->argmax == s_.argmax; }

    // Distillation's logsumexps at its temperature. Vocab-parallel, one row
    // sum: the exponentials' sums about the merged maxima, known to all.
    void Temper() {
      const double inv_t = c_.p_.inv_temperature;
      if (c_.shard_ != nullptr) {
        double sums[2] = {0, 0};
        if (!c_.SkipsRowSum(r_)) {
          for (W x : z_) sums[0] += std::exp((x - s_.max_logit) * inv_t);
          for (W x : t_) sums[1] += std::exp((x - teacher_->max_logit) * inv_t);
        }
        c_.RowSum(r_, Merge::kSum, 2, sums);
        tempered_lse_ = s_.max_logit * inv_t + std::log(sums[0]);
        teacher_tempered_lse_ = teacher_->max_logit * inv_t + std::log(sums[1]);
        return;
      }
      tempered_lse_ = ScaledLogSumExp<W>(z_, s_.max_logit, inv_t);
      teacher_tempered_lse_ =
          ScaledLogSumExp<W>(t_, teacher_->max_logit, inv_t);
    }

    // Raw pointers: the span's checked operator[] costs a compare per logit.
    // f gets the global class id. Vocab-parallel, a ForEach feeds the row
    // sum that follows it (as every pass uses it): skipped where that sum
    // is known already or the row waits for one.
    template <typename F>
    void ForEach(F f) const {
      if (c_.SkipsRowSum(r_)) return;
      const int64_t vocab = static_cast<int64_t>(z_.size());
      const int64_t offset = c_.offset_;
      const W* z = z_.data();
      const W* t = t_.empty() ? z : t_.data();
      for (int64_t v = 0; v < vocab; ++v) {
        f(offset + v, double{z[v]}, double{t[v]});
      }
    }
    double Reduce(double partial) const {
      if (c_.shard_ != nullptr) c_.RowSum(r_, Merge::kSum, 1, &partial);
      return partial;
    }
    RowSums<double> Reduce(RowSums<double> partial) const {
      if (c_.shard_ == nullptr) return partial;
      double sums[2] = {partial.a, partial.b};
      c_.RowSum(r_, Merge::kSum, 2, sums);
      return {sums[0], sums[1]};
    }
    template <typename F>
    double LogSumExp(F f) const {
      if (c_.shard_ != nullptr) {
        // This range's (max, sum of exp(f - max)), merged as online softmax.
        double pair[2] = {-std::numeric_limits<double>::infinity(), 0};
        if (!c_.SkipsRowSum(r_)) {
          for (int64_t v = 0; v < static_cast<int64_t>(z_.size()); ++v) {
            pair[0] = std::max(pair[0], f(double{z_[v]}, Tp(v)));
          }
          for (int64_t v = 0; v < static_cast<int64_t>(z_.size()); ++v) {
            pair[1] += std::exp(f(double{z_[v]}, Tp(v)) - pair[0]);
          }
        }
        c_.RowSum(r_, Merge::kLogSumExp, 2, pair);
        return pair[0];
      }
      double max = -std::numeric_limits<double>::infinity();
      ForEach([&](int64_t, double zp, double tp) {
        max = std::max(max, f(zp, tp));
      });
      double sum = 0;
      ForEach([&](int64_t, double zp, double tp) {
        sum += std::exp(f(zp, tp) - max);
      });
      return max + std::log(sum);
    }

    template <typename G>
    void WriteGradient(G g, double bound) {
      if (c_.shard_ != nullptr) {
        // Into scratch: a row sum after it may still make the row wait.
        if (c_.Pending(r_)) return;
        const int64_t vocab = static_cast<int64_t>(z_.size());
        const W* z = z_.data();
        const W* t = t_.empty() ? z : t_.data();
        W* out = c_.gradient_.data();
        for (int64_t v = 0; v < vocab; ++v) {
          out[v] = static_cast<W>(
              g(c_.offset_ + v, double{z[v]}, double{t[v]}));
        }
        c_.gradient_bound_ = bound;
        c_.gradient_ready_ = true;
        return;
      }
      const int64_t vocab = static_cast<int64_t>(z_.size());
      W* z = z_.data();
      const W* t = t_.empty() ? z : t_.data();
      for (int64_t v = 0; v < vocab; ++v) {
        z[v] = static_cast<W>(g(v, double{z[v]}, double{t[v]}));
      }
      Store(bound);
    }
    void WriteSoftmaxGradient(double softmax, double on_target, double uniform,
                              double bound) {
      if (c_.shard_ != nullptr) {
        if (c_.Pending(r_)) return;
        // This range of the whole row's gradient: the target's term where
        // it lies here, uniform / V over the whole vocabulary.
        const int64_t width = static_cast<int64_t>(z_.size());
        const int64_t local = meta_.target - c_.offset_;
        const bool here = local >= 0 && local < width;
        std::copy(z_.begin(), z_.end(), c_.gradient_.begin());
        dflash::WriteSoftmaxGradient<W>(
            absl::MakeSpan(c_.gradient_), here ? static_cast<int32_t>(local) : 0,
            s_,
            {softmax, here ? on_target : 0.0,
             uniform * static_cast<double>(width) /
                 static_cast<double>(c_.classes_)});
        c_.gradient_bound_ = bound;
        c_.gradient_ready_ = true;
        return;
      }
      const SoftmaxGradient grad{softmax, on_target, uniform};
      if constexpr (std::is_same_v<W, float>) {
        if (c_.keep_exp_) {
          WriteSoftmaxGradientFromExp(z_, meta_.target, s_, grad);
          Store(bound);
          return;
        }
      }
      dflash::WriteSoftmaxGradient<W>(z_, meta_.target, s_, grad);
      Store(bound);
    }

    void Add(TermSlot slot, double value) { c_.Put(*terms_, r_, slot, value); }
    void SetTeacherAcceptance(double accept) {
      if (c_.Pending(r_)) return;
      if (!c_.outputs_.teacher_acceptance.empty()) {
        c_.outputs_.teacher_acceptance[r_] = accept;
      }
    }
    void SetConfidenceGradient(double gradient) {
      if (c_.Pending(r_)) return;
      if (!c_.outputs_.confidence_grad.empty()) {
        c_.outputs_.confidence_grad[r_] = gradient;
      }
    }
    void ConfidenceNotFinite(double c) {
      if (!c_.Pending(r_)) Fail(ConfidenceError(r_, c));
    }

    const absl::Status& status() const { return status_; }

   private:
    double Tp(int64_t v) const {
      return t_.empty() ? double{z_[v]} : double{t_[v]};
    }
    void Store(double bound) {
      Fail(c_.source_.StoreGradient(r_, z_, weight_, bound));
    }
    void Fail(absl::Status status) {
      if (status_.ok()) status_ = std::move(status);
    }

    ChunkPasses& c_;
    const int64_t r_;
    const RowMeta& meta_;
    const RowStats& s_;
    const absl::Span<W> z_;
    const absl::Span<const W> t_;
    const RowStats* const teacher_;
    const double weight_;
    ChunkTerms* const terms_;
    // By value, so that the per-logit loops keep them in registers.
    const double lse_, teacher_lse_;
    double tempered_lse_ = 0, teacher_tempered_lse_ = 0;
    absl::Status status_;
  };

  // The top-k and stats pass of row r. Top-k reads z' before the stats pass
  // may overwrite it (keep_exp_ leaves exp(z' - max) in z).
  absl::Status Analyse(int64_t r, absl::Span<W> z) {
    const int32_t target = inputs_.rows[r].target;
    if (top_k_ > 0) {
      DFLASH_RETURN_IF_ERROR(TopK<W>(z, top_k_, absl::MakeSpan(ids_)));
      std::copy_n(ids_.begin(), caller_k_,
                  outputs_.top_k.begin() + r * caller_k_);
      if (!outputs_.top_k_values.empty()) {
        for (int32_t j = 0; j < caller_k_; ++j) {
          outputs_.top_k_values[r * caller_k_ + j] =
              static_cast<float>(z[ids_[j]]);
        }
      }
    }
    absl::StatusOr<RowStats> row_stats =
        StatsForTarget<W>(p_, target, [&](int32_t stats_target) {
          if constexpr (std::is_same_v<W, float>) {
            if (keep_exp_) return ComputeRowStatsKeepExp(z, stats_target, r);
          }
          return ComputeRowStats<W>(z, stats_target, r);
        });
    if (!row_stats.ok()) return row_stats.status();
    const RowStats& s = *row_stats;
    stats_[r] = s;
    have_stats_[r] = true;
    if (metric_k_ > 0) {
      // p = exp(z' - lse); ComputeRowStatsKeepExp left exp(z' - max) in z.
      const double from_exp = std::exp(s.max_logit - s.logsumexp);
      for (int32_t j = 0; j < metric_k_; ++j) {
        if (ids_[j] == target) rank_[r] = j;
        top_mass_[r] += keep_exp_ ? z[ids_[j]] * from_exp
                                  : std::exp(z[ids_[j]] - s.logsumexp);
      }
    }
    if (teacher_metrics_) {
      std::copy_n(ids_.begin(), metric_k_,
                  metric_ids_.begin() + r * metric_k_);
    }
    return absl::OkStatus();
  }

  // The stats of row r's teacher logits t, once.
  absl::Status AnalyseTeacher(int64_t r, absl::Span<const W> t) {
    if (have_teacher_stats_[r]) return absl::OkStatus();
    absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
    if (!teacher.ok()) return TeacherError(teacher.status());
    teacher_stats_[r] = *teacher;
    have_teacher_stats_[r] = true;
    return absl::OkStatus();
  }

  // Pass 1, block-coupled families only: a row's weight reads the q (D-PARD:
  // the acceptance) of the rows before it in its block, so every row with a
  // mask is analysed first.
  absl::Status CoupledPass() {
    for (int64_t r = 0; r < num_rows_; ++r) {
      if (mask_[r] == 0) continue;
      absl::Span<W> z = source_.Draft(r);
      DFLASH_RETURN_IF_ERROR(Analyse(r, z));
      q_[r] = std::exp(stats_[r].target_logit - stats_[r].logsumexp);
      if (p_.dpard) {
        absl::Span<const W> t = source_.Teacher(r);
        DFLASH_RETURN_IF_ERROR(AnalyseTeacher(r, t));
        Row row(*this, r, z, t, &teacher_stats_[r], 0, nullptr);
        accept_[r] = DSparkAcceptance(TeacherL1(row));
      }
    }
    return absl::OkStatus();
  }

  // Pass 2: each row's loss weight and share (family_passes.h's
  // CoupledBlockWeights), block-level over each run of rows sharing a block
  // id. Rows without weight may be left out of a chunk: they change neither
  // the cumulative products nor the sums.
  void WeightPass() {
    auto row_weight = [&](int64_t r) {
      return RowLossWeight(p_, inputs_.rows[r].position, mask_[r]);
    };
    if (!traits_.couples_blocks) {
      for (int64_t r = 0; r < num_rows_; ++r) weight_[r] = row_weight(r);
      return;
    }
    for (int64_t b = 0, end = 0; b < num_rows_; b = end) {
      end = b + 1;
      while (end < num_rows_ &&
             inputs_.rows[end].block == inputs_.rows[b].block) {
        ++end;
      }
      CoupledBlockWeights(
          p_, end - b, [&](int64_t i) { return q_[b + i]; },
          [&](int64_t i) { return accept_[b + i]; },
          [&](int64_t i) { return mask_[b + i]; },
          [&](int64_t i) { return row_weight(b + i); },
          [&](int64_t i) {
            return DPaceRowScale(p_, inputs_.rows[b + i].sequence_share);
          },
          weight_.data() + b, share_.data() + b);
    }
  }

  // Pass 3, one row: metrics, then the family's terms and d(loss_num)/
  // d(logits) (FamilyPass).
  absl::Status RowTerms(int64_t r, ChunkTerms& terms) {
    if (mask_[r] == 0) {
      source_.StoreZero(r);
      return absl::OkStatus();
    }
    absl::Span<W> z = source_.Draft(r);
    if (!have_stats_[r]) DFLASH_RETURN_IF_ERROR(Analyse(r, z));
    RowMetrics(r, stats_[r], terms);
    if (!outputs_.teacher_argmax.empty() && !teacher_stats_.empty()) {
      // Every row with a mask, weighted or not (the loss analyses the
      // teacher of weighted rows alone). Vocab-parallel, ShardStats merged
      // every such row's.
      if (shard_ == nullptr) {
        DFLASH_RETURN_IF_ERROR(AnalyseTeacher(r, source_.Teacher(r)));
      }
      outputs_.teacher_argmax[r] = teacher_stats_[r].argmax;
    }
    if (teacher_metrics_) {
      DFLASH_RETURN_IF_ERROR(TeacherDiagnostics(r, z, terms));
      if (Pending(r)) return absl::OkStatus();
    }
    const double w = weight_[r];
    if (w == 0) {
      source_.StoreZero(r);
      return absl::OkStatus();
    }
    Put(terms, r, kLossDen, w);
    if (!outputs_.loss_weight.empty()) {
      outputs_.loss_weight[r] = w;
    }
    source_.KeepTransformed(z);
    absl::Span<const W> t;
    if (traits_.needs_teacher) {
      t = source_.Teacher(r);
      DFLASH_RETURN_IF_ERROR(AnalyseTeacher(r, t));
    }
    Row row(*this, r, z, t, t.empty() ? nullptr : &teacher_stats_[r], w,
            &terms);
    gradient_ready_ = false;
    if (p_.family == LossFamily::kDistillation) row.Temper();
    FamilyPass(row);
    DFLASH_RETURN_IF_ERROR(row.status());
    if (shard_ == nullptr || Pending(r)) return absl::OkStatus();
    // Vocab-parallel, the row is done: its gradient from scratch.
    if (!gradient_ready_) {
      source_.StoreZero(r);
      return absl::OkStatus();
    }
    std::copy(gradient_.begin(), gradient_.end(), z.begin());
    return source_.StoreGradient(r, z, w, gradient_bound_);
  }

  // What every family reports of a row with a mask, weighted or not.
  void RowMetrics(int64_t r, const RowStats& s, ChunkTerms& terms) {
    const RowMeta& meta = inputs_.rows[r];
    const double neg_log_q = s.logsumexp - s.target_logit;
    if (!outputs_.neg_log_q.empty()) outputs_.neg_log_q[r] = neg_log_q;
    if (!outputs_.argmax.empty()) outputs_.argmax[r] = s.argmax;
    const double hit = mask_[r] > 0.5 && s.argmax == meta.target;
    const double q_r = std::exp(-neg_log_q);
    Put(terms, r, kCorrect, hit);
    Put(terms, r, kAccuracyDen, mask_[r]);
    Put(terms, r, kTargetProbability, mask_[r] * q_r);
    Put(terms, r, kTopKRecall, rank_[r] >= 0 ? mask_[r] : 0.0);
    Put(terms, r, kTopKMass, mask_[r] * top_mass_[r]);
    if (!outputs_.target_probability.empty()) {
      outputs_.target_probability[r] = q_r;
    }
    if (!outputs_.target_rank.empty()) outputs_.target_rank[r] = rank_[r];
  }

  // The teacher diagnostics, for a loss that reads no teacher: z is z' still
  // (no gradient has been written, no exps kept).
  absl::Status TeacherDiagnostics(int64_t r, absl::Span<W> z,
                                  ChunkTerms& terms) {
    absl::Span<const W> t = source_.Teacher(r);
    if (shard_ == nullptr) {
      absl::StatusOr<RowStats> teacher = ComputeRowStats<W>(t, 0, r);
      if (!teacher.ok()) return TeacherError(teacher.status());
      teacher_stats_[r] = *teacher;
    }
    const RowStats& teacher = teacher_stats_[r];
    Row row(*this, r, z, t, &teacher, 0, &terms);
    TeacherDiagnosticsPass(row);
    if (Pending(r)) return absl::OkStatus();
    double mass = 0;
    if (shard_ != nullptr) {
      mass = teacher_mass_[r];
    } else {
      for (int32_t j = 0; j < metric_k_; ++j) {
        mass += std::exp(t[metric_ids_[r * metric_k_ + j]] - teacher.logsumexp);
      }
    }
    Put(terms, r, kTeacherTopKMass, mask_[r] * mass);
    return absl::OkStatus();
  }

  // Vocab-parallel (options.vocab_shard). A row's pass needs its whole
  // row's sums; each process has its range only. So the pass runs in
  // rounds: a row whose pass meets a row sum that no gather has merged yet
  // records its partial and waits (pending: its later sums, terms, outputs
  // and gradient are dropped this round); after each round one AllGather
  // of every row's partial, and the next round replays the waiting rows
  // with the merged sums known. Every process runs the same rounds on the
  // same merged values, so all agree bitwise. A row's terms are kept
  // (ShardRow::adds) and added in row order once every row is done.
  struct ShardRow {
    std::vector<double> known;  // Gathered partials, kPartial per process.
    int32_t next = 0;           // Row sums this round's pass has met.
    bool pending = false;
    double partial[kPartial] = {};
    std::vector<std::pair<TermSlot, double>> adds;
  };

  bool Pending(int64_t r) const {
    return shard_ != nullptr && shard_rows_[r].pending;
  }
  // Whether a ForEach or row sum of row r would be wasted: its sum is known
  // from a gather, or the row already waits for another.
  bool SkipsRowSum(int64_t r) const {
    if (shard_ == nullptr) return false;
    const ShardRow& s = shard_rows_[r];
    const size_t per_sum = kPartial * shard_->exchange->size();
    return s.pending || (s.next + 1) * per_sum <= s.known.size();
  }
  // Row r's next row sum of n values (n <= kPartial) in `value`: this
  // range's partial in, the whole row's (merged) out where a gather has
  // it; else the row waits with the partial recorded.
  void RowSum(int64_t r, Merge merge, int n, double* value) {
    ShardRow& s = shard_rows_[r];
    if (s.pending) return;
    const int size = shard_->exchange->size();
    const size_t at = static_cast<size_t>(s.next++) * kPartial * size;
    if (at + kPartial * size > s.known.size()) {
      s.pending = true;
      std::fill_n(s.partial, kPartial, 0.0);
      std::copy_n(value, n, s.partial);
      return;
    }
    const double* known = s.known.data() + at;
    if (merge == Merge::kSum) {
      for (int i = 0; i < n; ++i) {
        value[i] = 0;
        for (int q = 0; q < size; ++q) value[i] += known[q * kPartial + i];
      }
      return;
    }
    double max = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int q = 0; q < size; ++q) {
      const double m = known[q * kPartial], e = known[q * kPartial + 1];
      if (!(e > 0)) continue;
      if (m > max) {
        sum = sum * std::exp(max - m) + e;
        max = m;
      } else {
        sum += e * std::exp(m - max);
      }
    }
    value[0] = max + std::log(sum);
  }
  // A row's term: added now, or vocab-parallel kept for the row-order sum
  // (none while the row waits).
  void Put(ChunkTerms& terms, int64_t r, TermSlot slot, double value) {
    if (shard_ == nullptr) {
      AddTerm(terms, slot, inputs_.rows[r].position, value);
    } else if (!shard_rows_[r].pending) {
      shard_rows_[r].adds.emplace_back(slot, value);
    }
  }

  // The vocab-parallel chunk: merged stats (one gather), D-PARD's
  // acceptance (rounds), the block weights, the rows' passes (rounds).
  absl::StatusOr<ChunkTerms> ShardRun() {
    DFLASH_RETURN_IF_ERROR(ShardStats());
    ChunkTerms terms = ChunkTerms::Zero(options_.block_size);
    if (traits_.couples_blocks) {
      for (int64_t r = 0; r < num_rows_; ++r) {
        if (mask_[r] > 0) {
          q_[r] = std::exp(stats_[r].target_logit - stats_[r].logsumexp);
        }
      }
      if (p_.dpard) DFLASH_RETURN_IF_ERROR(Rounds(/*row_terms=*/false, terms));
    }
    WeightPass();
    DFLASH_RETURN_IF_ERROR(Rounds(/*row_terms=*/true, terms));
    for (int64_t r = 0; r < num_rows_; ++r) {
      for (const auto& [slot, value] : shard_rows_[r].adds) {
        AddTerm(terms, slot, inputs_.rows[r].position, value);
      }
    }
    return terms;
  }

  // Rounds of RowTerms (every row) or of D-PARD's acceptance (rows with a
  // mask) until no row waits on any process.
  absl::Status Rounds(bool row_terms, ChunkTerms& terms) {
    constexpr int kRow = 1 + kPartial;  // Waits, then its partial.
    const int size = shard_->exchange->size();
    std::vector<double> record(kRecordHead + num_rows_ * kRow), gathered;
    std::vector<bool> run(num_rows_);
    for (int64_t r = 0; r < num_rows_; ++r) {
      shard_rows_[r].known.clear();
      run[r] = row_terms || mask_[r] > 0;
    }
    for (;;) {
      absl::Status local;
      std::fill(record.begin(), record.end(), 0.0);
      for (int64_t r = 0; r < num_rows_ && local.ok(); ++r) {
        if (!run[r]) continue;
        ShardRow& s = shard_rows_[r];
        s.next = 0;
        s.pending = false;
        s.adds.clear();
        local = row_terms ? RowTerms(r, terms) : CoupledRow(r);
        if (s.pending) {
          double* at = record.data() + kRecordHead + r * kRow;
          at[0] = 1;
          std::copy_n(s.partial, kPartial, at + 1);
        }
      }
      DFLASH_RETURN_IF_ERROR(GatherRecords(*shard_->exchange, local,
                                           absl::MakeSpan(record), gathered));
      bool any = false;
      for (int64_t r = 0; r < num_rows_; ++r) {
        const size_t row_at = kRecordHead + r * kRow;
        const bool pending = gathered[row_at] != 0;
        for (int q = 1; q < size; ++q) {
          if ((gathered[q * record.size() + row_at] != 0) != pending) {
            return absl::InternalError(absl::StrCat(
                "vocab_shard: the processes disagree on whether row ", r,
                " needs another row sum"));
          }
        }
        run[r] = pending;
        if (!pending) continue;
        any = true;
        ShardRow& s = shard_rows_[r];
        for (int q = 0; q < size; ++q) {
          const double* at = gathered.data() + q * record.size() + row_at + 1;
          s.known.insert(s.known.end(), at, at + kPartial);
        }
        s.pending = false;
      }
      if (!any) return absl::OkStatus();
    }
  }

  // D-PARD's acceptance of row r, which the block weights read.
  absl::Status CoupledRow(int64_t r) {
    absl::Span<W> z = source_.Draft(r);
    absl::Span<const W> t = source_.Teacher(r);
    Row row(*this, r, z, t, &teacher_stats_[r], 0, nullptr);
    const double accept = DSparkAcceptance(TeacherL1(row));
    if (!Pending(r)) accept_[r] = accept;
    return absl::OkStatus();
  }

  // A row's stats record: always the RangeStatsField (max, sum of
  // exp(z' - max) over this range, the target logit or -inf, the global
  // argmax); then, as the chunk needs them (StatsLayout), the sum
  // of z' (label smoothing's mean), the teacher's max, sum of exp and
  // argmax, and top_k_ entries of (value, global id) and, for the teacher
  // diagnostics' mass, the teacher's logit there.
  struct StatsLayout {
    int sum = -1, teacher = -1;  // -1: not in the record.
    int top_k = 0, entry = 2, width = 0;
  };
  StatsLayout Layout() const {
    StatsLayout layout;
    int next = kStatsBase;
    if (p_.label_smoothing > 0) layout.sum = next++;
    if (!teacher_stats_.empty()) {
      layout.teacher = next;
      next += 3;
    }
    layout.top_k = next;
    layout.entry = teacher_metrics_ ? 3 : 2;
    layout.width = next + layout.entry * top_k_;
    return layout;
  }

  // Every row's stats over this range, one gather, merged in rank order.
  absl::Status ShardStats() {
    const StatsLayout layout = Layout();
    const int64_t per_row = layout.width;
    std::vector<double> record(kRecordHead + num_rows_ * per_row, 0.0),
        gathered;
    absl::Status local;
    for (int64_t r = 0; r < num_rows_ && local.ok(); ++r) {
      if (mask_[r] == 0) continue;
      local =
          AnalyseRange(r, layout, record.data() + kRecordHead + r * per_row);
    }
    DFLASH_RETURN_IF_ERROR(GatherRecords(*shard_->exchange, local,
                                         absl::MakeSpan(record), gathered));
    const int size = shard_->exchange->size();
    std::vector<const double*> records(size);
    for (int64_t r = 0; r < num_rows_; ++r) {
      if (mask_[r] == 0) continue;
      for (int q = 0; q < size; ++q) {
        records[q] =
            gathered.data() + q * record.size() + kRecordHead + r * per_row;
      }
      MergeStats(r, layout, records);
    }
    return absl::OkStatus();
  }

  // Row r's record over this range (RangeStatsField).
  absl::Status AnalyseRange(int64_t r, const StatsLayout& layout,
                            double* out) {
    const int32_t target = inputs_.rows[r].target;
    if (HasTarget(target) ? target >= classes_ : target != p_.ignore_index) {
      return RowError(r, absl::StrCat("target id ", target,
                                      " is outside [0, ", classes_, ")"));
    }
    const int64_t width = inputs_.vocab, local = target - offset_;
    const bool here = HasTarget(target) && local >= 0 && local < width;
    absl::Span<W> z = source_.Draft(r);
    absl::StatusOr<RowStats> s =
        ComputeRowStats<W>(z, here ? static_cast<int32_t>(local) : 0, r);
    if (!s.ok()) return ShardRangeError(s.status(), offset_);
    PutRangeStats(*s, here, offset_, out);
    if (layout.sum >= 0) {
      double sum = 0;
      for (W x : z) sum += x;
      out[layout.sum] = sum;
    }
    absl::Span<const W> t;
    if (layout.teacher >= 0) {
      t = source_.Teacher(r);
      absl::StatusOr<RowStats> ts = ComputeRowStats<W>(t, 0, r);
      if (!ts.ok()) return TeacherError(ShardRangeError(ts.status(), offset_));
      out[layout.teacher] = ts->max_logit;
      out[layout.teacher + 1] = std::exp(ts->logsumexp - ts->max_logit);
      out[layout.teacher + 2] = static_cast<double>(offset_ + ts->argmax);
    }
    if (top_k_ > 0) {
      const int32_t local_k =
          static_cast<int32_t>(std::min<int64_t>(top_k_, width));
      DFLASH_RETURN_IF_ERROR(TopK<W>(z, local_k, absl::MakeSpan(ids_)));
      for (int32_t j = 0; j < top_k_; ++j) {
        double* entry = out + layout.top_k + layout.entry * j;
        if (j >= local_k) {
          entry[0] = -std::numeric_limits<double>::infinity();
          entry[1] = -1;  // None: this range holds fewer than k classes.
          continue;
        }
        entry[0] = z[ids_[j]];
        entry[1] = static_cast<double>(offset_ + ids_[j]);
        if (layout.entry == 3) entry[2] = t[ids_[j]];
      }
    }
    return absl::OkStatus();
  }

  // Row r's stats, top-k and metrics from every process's record, in rank
  // order.
  void MergeStats(int64_t r, const StatsLayout& layout,
                  absl::Span<const double* const> records) {
    const double lowest = -std::numeric_limits<double>::infinity();
    const MergedRangeStats merged = MergeRangeRecords(records, 0);
    double mean_sum = 0, teacher_max = lowest, teacher_sum = 0;
    int32_t teacher_argmax = 0;
    for (const double* rec : records) {
      if (layout.sum >= 0) mean_sum += rec[layout.sum];
      if (layout.teacher >= 0) {
        const double* teacher = rec + layout.teacher;
        MergeRange(teacher[0], teacher[1], teacher[2], teacher_max,
                   teacher_sum, teacher_argmax);
      }
    }
    const double lse = merged.max + std::log(merged.sum_exp);
    const int32_t target = inputs_.rows[r].target;
    // A row without a target class has -log q = 0 (StatsForTarget).
    stats_[r] = {merged.max, lse,
                 HasTarget(target) ? merged.target_logit : lse, merged.argmax};
    have_stats_[r] = true;
    mean_sum_[r] = mean_sum;
    if (!teacher_stats_.empty()) {
      teacher_stats_[r] = {teacher_max, teacher_max + std::log(teacher_sum),
                           0, teacher_argmax};
      have_teacher_stats_[r] = true;
    }
    if (top_k_ == 0) return;
    // Each range's list is sorted (ties to the lower id) and the ranges
    // ascend, so taking the largest head, the earliest range on ties, is
    // the single-process order.
    merge_heads_.assign(records.size(), 0);
    double teacher_mass = 0;
    for (int32_t j = 0; j < top_k_; ++j) {
      int best = -1;
      for (int q = 0; q < static_cast<int>(records.size()); ++q) {
        if (merge_heads_[q] >= top_k_) continue;
        const double* entry =
            records[q] + layout.top_k + layout.entry * merge_heads_[q];
        if (entry[1] < 0) continue;
        if (best < 0 ||
            entry[0] >
                records[best][layout.top_k + layout.entry * merge_heads_[best]]) {
          best = q;
        }
      }
      const double* entry = records[best] + layout.top_k +
                            layout.entry * merge_heads_[best]++;
      const int32_t id = static_cast<int32_t>(entry[1]);
      if (j < caller_k_) {
        outputs_.top_k[r * caller_k_ + j] = id;
        if (!outputs_.top_k_values.empty()) {
          outputs_.top_k_values[r * caller_k_ + j] =
              static_cast<float>(entry[0]);
        }
      }
      if (j < metric_k_) {
        if (id == target) rank_[r] = j;
        top_mass_[r] += std::exp(entry[0] - lse);
        if (teacher_metrics_) {
          teacher_mass += std::exp(entry[2] - teacher_stats_[r].logsumexp);
        }
      }
    }
    if (teacher_metrics_) teacher_mass_[r] = teacher_mass;
  }

  const LossParams& p_;
  const ChunkLossOptions& options_;
  const ChunkLossInputs<T>& inputs_;
  const ChunkLossOutputs& outputs_;
  const LossTraits traits_;
  const int64_t num_rows_;
  // The teacher diagnostics: teacher logits for a loss that reads none.
  const bool teacher_metrics_;
  // Vocab-parallel: the shard (else null), its first class, and the whole
  // vocabulary (inputs.vocab without a shard).
  const VocabShard* const shard_;
  const int64_t offset_, classes_;
  // Float rows whose gradient is a SoftmaxGradient keep exp(z' - max) from
  // the stats pass and skip the second exponential. Not with label
  // smoothing (it reads z'), a softcap (its chain rule reads z') or teacher
  // families; block-coupled families only where the row is computed in
  // place.
  const bool keep_exp_;
  // One top-k serves the caller's k and the diagnostics' (the shorter list
  // is a prefix of the longer: ties go to the lower index in both).
  const int32_t caller_k_, metric_k_, top_k_;
  RowSource<T> source_;
  std::vector<double> mask_;
  std::vector<RowStats> stats_;
  std::vector<bool> have_stats_;
  std::vector<int32_t> ids_;
  std::vector<int32_t> rank_;
  std::vector<double> top_mass_;
  // The teacher diagnostics read each row's metric top-k again in pass 3.
  std::vector<int32_t> metric_ids_;
  std::vector<RowStats> teacher_stats_;
  std::vector<bool> have_teacher_stats_;
  // Pass 1's q and D-PARD acceptance (block-coupled families), pass 2's
  // weights and shares.
  std::vector<double> accept_, q_, weight_, share_;
  // Vocab-parallel: each row's round state, its whole row's sum of z'
  // (label smoothing) and teacher top-k mass; a row's gradient until it is
  // done (gradient_ready_: its pass wrote one, bounded by gradient_bound_);
  // the top-k merge's place in each process's list.
  std::vector<ShardRow> shard_rows_;
  std::vector<double> mean_sum_, teacher_mass_;
  std::vector<W> gradient_;
  double gradient_bound_ = 0;
  bool gradient_ready_ = false;
  std::vector<int32_t> merge_heads_;
};

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
  FinishTotals totals;
  totals.loss_num = terms.loss_num;
  totals.loss_den = terms.loss_den;
  totals.correct = terms.correct;
  totals.accuracy_den = terms.accuracy_den;
  totals.target_probability = terms.target_probability;
  totals.ce_num = terms.ce_num;
  totals.tv_num = terms.tv_num;
  totals.dpard_num = terms.dpard_num;
  totals.confidence_num = terms.confidence_num;
  const FinishedScalars s = FinishScalars(params, totals, sequences);
  terms.loss_num = totals.loss_num;
  FinishedLoss f;
  f.loss = s.loss;
  f.denominator = s.denominator;
  f.accuracy = s.accuracy;
  f.gradient_scale = s.gradient_scale;
  f.confidence_scale = s.confidence_scale;
  if (s.has_lk_kl_weight) f.lk_kl_weight = s.lk_kl_weight;
  return f;
}

std::optional<double> RowsGradientScale(const LossParams& params,
                                        absl::Span<const RowMeta> rows,
                                        int64_t sequences) {
  if (params.lk == LkMode::kLambdaBatch) return std::nullopt;
  if (params.family == LossFamily::kDPace) {
    if (!params.sequence_balanced) return std::nullopt;
    return 1 / FlooredLossDen(WeightedSequences(params, rows));
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

void SetSequenceShares(const LossParams& params, int64_t block_size,
                       int64_t sequence_rows, absl::Span<RowMeta> rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t begin = 0; begin < n; begin += sequence_rows) {
    const int64_t end = std::min(n, begin + sequence_rows);
    const double share =
        SequenceShareOf(params, rows.data(), begin, end, block_size);
    for (int64_t r = begin; r < end; ++r) rows[r].sequence_share = share;
  }
}

double WeightedSequences(const LossParams& params,
                         absl::Span<const RowMeta> rows) {
  double sum = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const bool first_of_block = r == 0 || rows[r].block != rows[r - 1].block;
    if (!first_of_block) continue;
    for (size_t i = r; i < rows.size() && rows[i].block == rows[r].block;
         ++i) {
      if (EffectiveMask(params, rows[i].target, rows[i].mask) > 0) {
        sum += rows[r].sequence_share;
        break;
      }
    }
  }
  return sum;
}

template <typename T>
absl::StatusOr<CpuChunkLoss<T>> CpuChunkLoss<T>::Create(
    const LossParams& params, const ChunkLossOptions& options) {
  DFLASH_RETURN_IF_ERROR(
      ValidateChunkLossOptions(options));
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

absl::Status ChunkShardHandshake(const ChunkLossOptions& options,
                                 const absl::Status& valid, int64_t width,
                                 int64_t rows, int32_t k, bool teacher) {
  const VocabShard& shard = *options.vocab_shard;
  enum {
    kOffset = kRecordHead,
    kWidth,
    kVocab,
    kRows,
    kK,
    kMetricK,
    kTeacher,
    kSize
  };
  // Handshake-shaped (kHandshakeSize), as a process that failed before
  // this chunk sends its error.
  static_assert(kSize <= kHandshakeSize);
  std::vector<double> record(kHandshakeSize), gathered;
  record[kOffset] = static_cast<double>(shard.offset);
  record[kWidth] = static_cast<double>(width);
  record[kVocab] = static_cast<double>(shard.vocab);
  record[kRows] = static_cast<double>(rows);
  record[kK] = k;
  record[kMetricK] = options.metric_top_k;
  record[kTeacher] = teacher;
  DFLASH_RETURN_IF_ERROR(GatherRecords(*shard.exchange, valid,
                                       absl::MakeSpan(record), gathered));
  const AgreedField agreed[] = {{kRows, "the chunk's number of rows"},
                                {kK, "outputs.k (0: no top_k)"},
                                {kMetricK, "options.metric_top_k"},
                                {kTeacher, "whether teacher logits are given"}};
  absl::Status tiles = CheckShardRecords(gathered, kHandshakeSize, kOffset,
                                         kWidth, kVocab, agreed);
  if (tiles.ok()) return tiles;
  return absl::InvalidArgumentError(
      absl::StrCat("chunk loss: ", tiles.message()));
}

template <typename T>
absl::StatusOr<ChunkTerms> CpuChunkLoss<T>::Run(
    const ChunkLossInputs<T>& inputs, const ChunkLossOutputs& outputs) const {
  const absl::Status valid =
      ValidateChunkLossInputs(params_, options_, inputs, outputs);
  if (options_.vocab_shard != nullptr) {
    DFLASH_RETURN_IF_ERROR(ChunkShardHandshake(
        options_, valid, inputs.vocab, static_cast<int64_t>(inputs.rows.size()),
        outputs.top_k.empty() ? 0 : outputs.k, !inputs.teacher_logits.empty()));
  }
  DFLASH_RETURN_IF_ERROR(valid);
  ResetRowOutputs(static_cast<int64_t>(inputs.rows.size()), outputs);
  if (params_.family == LossFamily::kDomino) {
    return DominoChunk<T>(params_, options_, inputs, outputs);
  }
  return ChunkPasses<T>(params_, options_, inputs, outputs).Run();
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
