#ifndef DFLASH_HEADS_SYNTHETIC_BATCH_H_
#define DFLASH_HEADS_SYNTHETIC_BATCH_H_

// MakeSyntheticBatch: a seeded synthetic DFlash batch (HeadBatch: token ids,
// loss mask, anchors, row metadata, hidden states, head weight) with the
// statistics of a real one, for tests, benchmarks and the dflash_head
// command when no real tensors are given.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "heads/head_types.h"
#include "losses/batch_layout.h"
#include "proto/objective.pb.h"

namespace dflash {

// The shape of a synthetic DFlash batch: `batch` sequences of `seq_len`
// tokens, `num_anchors` anchor blocks each (layout.block_size, hidden and
// vocab from the config).
struct SyntheticShape {
  int64_t batch = 1;
  int64_t seq_len = 4096;
  int64_t num_anchors = 128;
  // A peaked batch, as a trained draft model sees one: token ids drawn
  // log-uniformly (Zipf-like: the low ids are the frequent ones, as in a
  // BPE vocabulary), and with head.bias a bias of kRareTokenBias on ids >=
  // kFrequentTokens, so that the softmax mass sits on the target and the
  // frequent ids.
  bool peaked = false;
};
inline constexpr int64_t kFrequentTokens = 1024;
inline constexpr double kRareTokenBias = -8;

// A batch's tensors, as the head reads them. MakeSyntheticBatch fills one
// with the statistics of a real batch: token ids uniform over
// the vocabulary, every 7th token unsupervised, anchors sampled as in
// docs/semantics.md section 2.2, weight N(0, 1/H) and hidden states N(0, 1) so
// that logits are of order 1, plus a pull towards the row's target that lifts
// its logit by kSyntheticMargin - kSyntheticMarginDecay * k (accuracy falls
// along the block, as a draft model's does); the teacher's states are the
// draft's plus N(0, 0.3); a correction's z is N(0, 1) and M N(0, 1/r).
inline constexpr double kSyntheticMargin = 6.0;
inline constexpr double kSyntheticMarginDecay = 0.25;

template <typename T>
struct HeadBatch {
  std::vector<int64_t> input_ids;
  std::vector<uint8_t> loss_mask;
  Anchors anchors;
  std::vector<RowMeta> rows;
  std::vector<T> hidden, teacher_hidden, weight, bias;
  std::vector<ConfidenceOf<T>> confidence_logits;
  // With head.correction_rank r: z [rows, r] and M [V, r].
  std::vector<T> correction_inputs, correction_weight;

  // Views for RunHead; teacher and confidence only where the loss reads them.
  HeadInputs<T> Inputs(const v1::ObjectiveConfig& config) const;
};

// The anchor blocks a synthetic sequence of `seq_len` tokens holds: an
// anchor needs two consecutive supervised tokens (docs/semantics.md section
// 2.2), and every 7th token is unsupervised. MakeSyntheticBatch asked for
// more makes this many.
int64_t SyntheticAnchorCapacity(int64_t seq_len);

template <typename T>
absl::StatusOr<HeadBatch<T>> MakeSyntheticBatch(
    const v1::ObjectiveConfig& config, const SyntheticShape& shape,
    uint64_t seed);

}  // namespace dflash

#endif  // DFLASH_HEADS_SYNTHETIC_BATCH_H_
