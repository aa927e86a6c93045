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
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
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
  // An error means this process's record did not go: the others may still
  // wait in this gather, and GatherRecords sends it once more, with the
  // error, to release them. An exchange that fails after its record went
  // (a KeyboardInterrupt as the transport returns) returns OK and sends
  // its error in the head of its next record instead (the binding's does).
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

// A shard's own fields, for a range of `width` classes (the logits'; 0
// where not known yet): an exchange, vocab in [1, 2^31) (ids are int32),
// offset in [0, vocab) and [offset, offset + width) inside [0, vocab).
// Errors name the field under `name` (the caller's: "options.vocab_shard").
absl::Status CheckShardFields(const VocabShard& shard, int64_t width,
                              absl::string_view name);

// The first values of every record GatherRecords exchanges: the sender's
// status code and the row its error names (-1: none).
inline constexpr int kRecordHead = 2;

// Writes `error`'s code and row into `record`'s head (kRecordHead values).
void SetRecordHead(const absl::Status& error, absl::Span<double> record);

// The size of every record of a vocab-parallel run that is not a chunk's
// row data: the run's handshake, each chunk's handshake, the run's closing
// gather, and an error sent in their place (SendError). A process that
// fails outside the loss's gathers is always next due at one of these
// (docs/scaling.md, "Stopping together"), so it can answer the others
// without knowing which.
inline constexpr int kHandshakeSize = 12;

// One AllGather of every process's `record` (its first kRecordHead values
// set here from `local_error`), then the group's first error: `local_error`
// where this process failed, else one naming the first process that did
// (a RowError with that process's row where its error had one). An error
// the loss finds on one process thus reaches every process at the same
// gather (another process's error keeps its code, but CANCELLED, which is
// ABORTED there: that process was interrupted, not this one). A failing
// AllGather is sent once more with its error (see AllGather) and returned;
// a transport that fails on some processes after delivering leaves the
// others to the transport's own timeout. `gathered` gets size() *
// record.size().
absl::Status GatherRecords(VocabExchange& exchange,
                           const absl::Status& local_error,
                           absl::Span<double> record,
                           std::vector<double>& gathered);

// Sends `error` (not OK) in a handshake-shaped record (kHandshakeSize) and
// returns it: the others, due at a handshake or closing gather, fail there
// naming this process.
absl::Status SendError(VocabExchange& exchange, const absl::Status& error);

// One vocab-parallel run's exchange (RunHeadOn's, the binding's): forwards
// to the caller's and notes whether the group has stopped, i.e. a gather
// failed or carried some process's error, where every process's
// GatherRecords fails alike. Finish then ends the run on every process
// together.
class RunExchange final : public VocabExchange {
 public:
  explicit RunExchange(VocabExchange& inner) : inner_(inner) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::Status AllGather(absl::Span<const double> local,
                         absl::Span<double> out) override;

  // The gathers made so far.
  int64_t gathers() const { return gathers_; }
  // The run's end: its error, sent (SendError) unless the group already
  // stopped at a gather; or the closing gather (every process's OK), so
  // that no process leaves a run another one failed.
  absl::Status Finish(const absl::Status& run);

 private:
  VocabExchange& inner_;
  int64_t gathers_ = 0;
  bool stopped_ = false;
};

// A row's statistics over one process's range of classes, as the
// records of a vocab-parallel loss carry them (the CPU loss's and the CUDA
// loss's): the fields' order.
enum RangeStatsField {
  kRangeMax,          // max z' over the range.
  kRangeSumExp,       // sum of exp(z' - max) over the range.
  kRangeTargetLogit,  // z' at the target where the range holds it, else -inf.
  kRangeArgmax,       // The first index of the maximum, a global id.
  kRangeStatsSize
};

// A row's statistics over the whole vocabulary, merged from its ranges'.
struct MergedRangeStats {
  double max = 0;
  double sum_exp = 0;       // sum of exp(z' - max): logsumexp = max + log.
  double target_logit = 0;  // The owner's; 0 where no range holds it.
  int32_t argmax = 0;
};

// One more range's (max, sum of exp(z' - max), argmax) into the merged
// ones, as online softmax: on a tie of the maximum the earlier range's
// argmax stays (the lower id, ranges in rank order).
void MergeRange(double max, double sum, double argmax, double& merged_max,
                double& merged_sum, int32_t& merged_argmax);

// Every process's record fields from `field` on (RangeStatsField), merged
// in rank order as online softmax: ties of the maximum go to the earlier
// range, the lower id. The same records give the same bits everywhere.
MergedRangeStats MergeRangeRecords(absl::Span<const double* const> records,
                                   int field);

// `status`, a range's error, naming where the range starts where it is a
// row error (its logit index counts from this process's first class).
absl::Status ShardRangeError(const absl::Status& status, int64_t offset);

// A record's field that every process must give alike: its index in the
// record and what it is (named in the error).
struct AgreedField {
  int index;
  const char* name;
};

// Over GatherRecords' `gathered` records of `record_size` values: each
// `agreed` field equals process 0's, and the processes' ranges [offset,
// offset + width) (the record's values at offset_at and width_at) are one
// class at least each and tile [0, vocab) (at vocab_at, agreed) in rank
// order; else an InvalidArgument naming the field, the process and the
// values, the same on every process.
absl::Status CheckShardRecords(absl::Span<const double> gathered,
                               int record_size, int offset_at, int width_at,
                               int vocab_at,
                               absl::Span<const AgreedField> agreed);

}  // namespace dflash

#endif  // DFLASH_LOSSES_VOCAB_SHARD_H_
