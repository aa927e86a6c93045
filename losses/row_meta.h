#ifndef DFLASH_LOSSES_ROW_META_H_
#define DFLASH_LOSSES_ROW_META_H_

// RowMeta: what the losses know of one row of logits (target, block
// position, weight mask, block id). The batch layout makes them, the chunk
// losses and heads read them; a header of its own so that the layout needs
// no loss config (and no protobuf).

#include <cstdint>

namespace dflash {

// Metadata of one row of a logits chunk.
struct RowMeta {
  int32_t target = 0;    // Token id the row predicts.
  int32_t position = 0;  // k in [0, K): position inside its anchor block.
  // Weight mask m (docs/semantics.md section 2), in double so that a
  // float64 run keeps a mask such as 1/3 exactly (the binding rounds a
  // float32 run's masks to float32). The struct stays 32 bytes: the double
  // fills what was padding before `block`.
  double mask = 0;
  int64_t block = 0;     // Anchor block id (b * N + n); orders block weights.
  // 1 / (anchor blocks with weight in the row's sequence): the factor of
  // its weight under D-PACE's SEQUENCE_BALANCED denominator, which alone
  // reads it. A head sets it from its rows (SetSequenceShares).
  double sequence_share = 1;
};

}  // namespace dflash

#endif  // DFLASH_LOSSES_ROW_META_H_
