#ifndef DFLASH_LOSSES_CHUNK_LOSS_H_
#define DFLASH_LOSSES_CHUNK_LOSS_H_

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
double DFlashWeight(bool has_gamma, double gamma, int32_t position,
                    float mask);

// The loss of a chunk `logits` [rows x vocab] for the families whose
// gradient is a per-row multiple of softmax - onehot: dflash (decay-weighted
// CE), dpace and its two variants (block-level weights from q, taken without
// gradient; rows must be whole blocks in order), and tv (sum((1 - q) * w)).
// Returns the chunk's terms and overwrites `logits` with
// d(loss_num)/d(logits); a row whose weight is 0 gets a zero row and no
// other work. Accumulation in double; T is float or double.
template <typename T>
absl::StatusOr<ChunkTerms> SoftmaxFamilyChunkLoss(
    const v1::LossConfig& config, int64_t block_size, absl::Span<T> logits,
    int64_t vocab, absl::Span<const RowMeta> rows);

}  // namespace dflash

#endif  // DFLASH_LOSSES_CHUNK_LOSS_H_
