#ifndef DFLASH_LOSSES_DFLASH_LOSS_H_
#define DFLASH_LOSSES_DFLASH_LOSS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/policy.pb.h"

namespace dflash {

// Metadata of one row of a logits chunk.
struct RowMeta {
  int32_t target = 0;    // Token id the row predicts.
  int32_t position = 0;  // k in [0, K): position inside its anchor block.
  float mask = 0;        // Weight mask m (SEMANTICS.md section 2).
};

// Additive terms of one chunk; sum them over chunks, then divide.
struct ChunkTerms {
  double loss_num = 0;
  double loss_den = 0;
  double correct = 0;       // argmax == target where m > 0.5.
  double accuracy_den = 0;  // sum(m).
  std::vector<double> correct_per_position;  // Size K.
  std::vector<double> mask_per_position;     // Size K: sum(m) at each k.
};

// The DFlash decay weight of a row: m * exp(-max(k-1, 0) / gamma), no decay
// when gamma is absent or 0.
double DFlashWeight(const v1::DFlashLoss& config, int32_t position, float mask);

// DFlash decay-weighted cross-entropy over a chunk `logits` [rows x vocab]:
// returns the chunk's terms and overwrites `logits` with
// d(loss_num)/d(logits) (a zero row where the weight is 0, with no other
// work for it). Accumulation in double; T is float or double.
template <typename T>
absl::StatusOr<ChunkTerms> DFlashCrossEntropyChunk(
    const v1::DFlashLoss& config, int64_t block_size, absl::Span<T> logits,
    int64_t vocab, absl::Span<const RowMeta> rows);

}  // namespace dflash

#endif  // DFLASH_LOSSES_DFLASH_LOSS_H_
