#ifndef DFLASH_LOSSES_VOCAB_SHARD_H_
#define DFLASH_LOSSES_VOCAB_SHARD_H_

// A vocabulary split across processes (a vocab-parallel head): each process
// holds a contiguous range of the classes (the rows of the projection's
// weight), computes the logits of its range only, and the loss merges the
// processes' per-row records (max, sum of exponentials, target logit,
// argmax, top-k, a family's row sums) through a VocabExchange, so that
// every process gets the single-process terms and its range's gradient.
// dflash has no transport of its own: the exchange is the caller's (the
// PyTorch binding runs it on torch.distributed).

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace dflash {

// The collective a vocab-parallel loss needs. Every process of the group
// makes the same calls in the same order with spans of the same size.
class VocabExchange {
 public:
  virtual ~VocabExchange() = default;

  // This process's index in the group, and the group's size.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // out[q * local.size() + i] = process q's local[i], for every process q
  // of the group in rank order (out.size() == size() * local.size()).
  // An error (the transport's) is returned by every process that sees it.
  virtual absl::Status AllGather(absl::Span<const double> local,
                                 absl::Span<double> out) = 0;
};

// This process's part of the vocabulary: classes [offset, offset + the
// logits' width) of `vocab`. Target ids and argmax/top-k ids are global.
struct VocabShard {
  int64_t offset = 0;
  int64_t vocab = 0;
  VocabExchange* exchange = nullptr;  // Borrowed.
};

}  // namespace dflash

#endif  // DFLASH_LOSSES_VOCAB_SHARD_H_
