#include "losses/dflash_loss.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "losses/row_kernels.h"

namespace dflash {

double DFlashWeight(const v1::DFlashLoss& config, int32_t position,
                    float mask) {
  if (!config.has_gamma() || config.gamma() == 0) return mask;
  return mask * std::exp(-std::max(position - 1, 0) / config.gamma());
}

template <typename T>
absl::StatusOr<ChunkTerms> DFlashCrossEntropyChunk(
    const v1::DFlashLoss& config, int64_t block_size, absl::Span<T> logits,
    int64_t vocab, absl::Span<const RowMeta> rows) {
  if (block_size <= 0 || vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dflash loss: block_size and vocab must be > 0, got ",
                     block_size, " and ", vocab));
  }
  if (static_cast<int64_t>(logits.size()) !=
      static_cast<int64_t>(rows.size()) * vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dflash loss: logits hold ", logits.size(), " values, expected ",
        rows.size(), " rows x ", vocab, " vocab"));
  }
  ChunkTerms terms;
  terms.correct_per_position.assign(block_size, 0.0);
  terms.mask_per_position.assign(block_size, 0.0);
  for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
    const RowMeta& meta = rows[r];
    absl::Span<T> row = logits.subspan(r * vocab, vocab);
    if (meta.position < 0 || meta.position >= block_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", r, ": block position ", meta.position,
                       " is outside [0, ", block_size, ")"));
    }
    if (!(meta.mask >= 0) || !std::isfinite(meta.mask)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", r, ": mask must be finite and >= 0, got ", meta.mask));
    }
    const double weight = DFlashWeight(config, meta.position, meta.mask);
    if (weight == 0) {
      std::fill(row.begin(), row.end(), T(0));
      continue;
    }
    absl::StatusOr<RowStats> stats =
        ComputeRowStats<T>(row, meta.target, r);
    if (!stats.ok()) return stats.status();
    terms.loss_num += weight * (stats->logsumexp - stats->target_logit);
    terms.loss_den += weight;
    const double hit = meta.mask > 0.5 && stats->argmax == meta.target;
    terms.correct += hit;
    terms.accuracy_den += meta.mask;
    terms.correct_per_position[meta.position] += hit;
    terms.mask_per_position[meta.position] += meta.mask;
    WriteCrossEntropyGradient(row, meta.target, stats->logsumexp, weight);
  }
  return terms;
}

template absl::StatusOr<ChunkTerms> DFlashCrossEntropyChunk<float>(
    const v1::DFlashLoss&, int64_t, absl::Span<float>, int64_t,
    absl::Span<const RowMeta>);
template absl::StatusOr<ChunkTerms> DFlashCrossEntropyChunk<double>(
    const v1::DFlashLoss&, int64_t, absl::Span<double>, int64_t,
    absl::Span<const RowMeta>);

}  // namespace dflash
