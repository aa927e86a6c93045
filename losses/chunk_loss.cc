#include "losses/chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "losses/row_kernels.h"

namespace dflash {
namespace {

// D-PACE block weights (SEMANTICS.md section 3), without gradient:
// smooth = m > 0 ? (1-alpha)*q + alpha : 1, prefix = cumprod(smooth),
// suffix = reverse-cumsum(prefix * m).
void DPaceWeights(const v1::DPaceLoss& config, absl::Span<const double> q,
                  absl::Span<const RowMeta> block, absl::Span<double> weights) {
  const int64_t k_size = static_cast<int64_t>(block.size());
  std::vector<double> prefix(k_size), suffix(k_size);
  double running = 1;
  for (int64_t k = 0; k < k_size; ++k) {
    const double smooth =
        block[k].mask > 0 ? (1 - config.alpha()) * q[k] + config.alpha() : 1;
    running *= smooth;
    prefix[k] = running;
  }
  double tail = 0;
  for (int64_t k = k_size - 1; k >= 0; --k) {
    tail += prefix[k] * block[k].mask;
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
  }
}

}  // namespace

double DFlashWeight(bool has_gamma, double gamma, int32_t position,
                    float mask) {
  if (!has_gamma || gamma == 0) return mask;
  return mask * std::exp(-std::max(position - 1, 0) / gamma);
}

template <typename T>
absl::StatusOr<ChunkTerms> SoftmaxFamilyChunkLoss(
    const v1::LossConfig& config, int64_t block_size, absl::Span<T> logits,
    int64_t vocab, absl::Span<const RowMeta> rows) {
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  if (block_size <= 0 || vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: block_size and vocab must be > 0, got ",
                     block_size, " and ", vocab));
  }
  if (static_cast<int64_t>(logits.size()) != num_rows * vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: logits hold ", logits.size(),
                     " values, expected ", num_rows, " rows x ", vocab,
                     " vocab"));
  }
  if (!config.has_dflash() && !config.has_dpace() && !config.has_tv()) {
    return absl::InvalidArgumentError(
        "chunk loss: loss family must be dflash, dpace or tv for the "
        "softmax-family row kernel");
  }
  const bool block_weights = config.has_dpace();
  if (block_weights && num_rows % block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: loss.dpace needs whole blocks, got ", num_rows,
        " rows for block_size ", block_size));
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const RowMeta& meta = rows[r];
    if (meta.position < 0 || meta.position >= block_size ||
        (block_weights && meta.position != r % block_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", r, ": block position ", meta.position, " is outside [0, ",
          block_size, ")",
          block_weights ? absl::StrCat(" or not ", r % block_size,
                                       " (loss.dpace needs blocks in order)")
                        : ""));
    }
    if (!(meta.mask >= 0) || !std::isfinite(meta.mask)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", r, ": mask must be finite and >= 0, got ", meta.mask));
    }
  }

  // Pass 1: row statistics where a row can carry loss.
  std::vector<RowStats> stats(num_rows);
  std::vector<double> q(num_rows, 0.0);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (rows[r].mask == 0) continue;
    absl::StatusOr<RowStats> row_stats = ComputeRowStats<T>(
        logits.subspan(r * vocab, vocab), rows[r].target, r);
    if (!row_stats.ok()) return row_stats.status();
    stats[r] = *row_stats;
    q[r] = std::exp(row_stats->target_logit - row_stats->logsumexp);
  }

  // Pass 2: the weight of each row's loss term.
  std::vector<double> weight(num_rows, 0.0);
  if (block_weights) {
    for (int64_t b = 0; b < num_rows; b += block_size) {
      DPaceWeights(config.dpace(), absl::MakeConstSpan(q).subspan(b, block_size),
                   rows.subspan(b, block_size),
                   absl::MakeSpan(weight).subspan(b, block_size));
    }
    for (int64_t r = 0; r < num_rows; ++r) weight[r] *= rows[r].mask;
  } else {
    const bool has_gamma =
        config.has_dflash() ? config.dflash().has_gamma() : config.tv().has_gamma();
    const double gamma =
        config.has_dflash() ? config.dflash().gamma() : config.tv().gamma();
    for (int64_t r = 0; r < num_rows; ++r) {
      weight[r] = DFlashWeight(has_gamma, gamma, rows[r].position, rows[r].mask);
    }
  }

  // Pass 3: terms and d(loss_num)/d(logits) = coefficient * (softmax - onehot).
  ChunkTerms terms;
  terms.correct_per_position.assign(block_size, 0.0);
  terms.mask_per_position.assign(block_size, 0.0);
  for (int64_t r = 0; r < num_rows; ++r) {
    const RowMeta& meta = rows[r];
    absl::Span<T> row = logits.subspan(r * vocab, vocab);
    if (meta.mask == 0 || weight[r] == 0) {
      std::fill(row.begin(), row.end(), T(0));
      continue;
    }
    const double neg_log_q = stats[r].logsumexp - stats[r].target_logit;
    double coefficient = weight[r];
    if (config.has_tv()) {
      terms.loss_num += (1 - q[r]) * weight[r];
      coefficient = weight[r] * q[r];
    } else {
      terms.loss_num += neg_log_q * weight[r];
    }
    terms.loss_den += weight[r];
    const double hit = meta.mask > 0.5 && stats[r].argmax == meta.target;
    terms.correct += hit;
    terms.accuracy_den += meta.mask;
    terms.correct_per_position[meta.position] += hit;
    terms.mask_per_position[meta.position] += meta.mask;
    WriteCrossEntropyGradient(row, meta.target, stats[r], coefficient);
  }
  return terms;
}

template absl::StatusOr<ChunkTerms> SoftmaxFamilyChunkLoss<float>(
    const v1::LossConfig&, int64_t, absl::Span<float>, int64_t,
    absl::Span<const RowMeta>);
template absl::StatusOr<ChunkTerms> SoftmaxFamilyChunkLoss<double>(
    const v1::LossConfig&, int64_t, absl::Span<double>, int64_t,
    absl::Span<const RowMeta>);

}  // namespace dflash
