#ifndef DFLASH_TESTS_THREAD_VOCAB_EXCHANGE_H_
#define DFLASH_TESTS_THREAD_VOCAB_EXCHANGE_H_

// A VocabExchange between threads of one process, for the vocab-parallel
// tests: each "process" of the group is a thread with its own exchange,
// and AllGather is a barrier. A call that waits longer than the group's
// timeout returns DeadlineExceeded, so a hang fails the test instead of
// blocking it; spans of different sizes in one call are an error on every
// thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "losses/vocab_shard.h"

namespace dflash {
namespace testing_vocab {

class ThreadGroup {
 public:
  ThreadGroup(int size, std::chrono::milliseconds timeout);

  // Process `rank`'s exchange, owned by the group.
  VocabExchange& exchange(int rank) { return *exchanges_[rank]; }
  int size() const { return size_; }
  // AllGather calls made by each rank so far, and the bytes it sent.
  int64_t calls(int rank) const { return calls_[rank]; }
  int64_t bytes(int rank) const { return bytes_[rank]; }

  // Rank `rank`'s AllGather number `call` (from 1) fails without sending,
  // as a transport or callback error on that process alone would.
  void FailCall(int rank, int64_t call) { fail_[rank] = call; }

  absl::Status AllGather(int rank, absl::Span<const double> local,
                         absl::Span<double> out);

 private:
  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0, departing_ = 0;
  int64_t generation_ = 0;
  std::vector<std::vector<double>> data_;
  std::vector<int64_t> calls_, bytes_, fail_;
  std::vector<std::unique_ptr<VocabExchange>> exchanges_;
};

// Runs body(rank) on `size` threads at once and waits for all of them.
void RunRanks(int size, const std::function<void(int)>& body);

// The contiguous ranges of `vocab` classes over `size` processes, sizes
// differing by at most one (the larger first): offsets[q], widths[q].
struct Ranges {
  std::vector<int64_t> offsets, widths;
};
Ranges SplitVocab(int64_t vocab, int size);

}  // namespace testing_vocab
}  // namespace dflash

#endif  // DFLASH_TESTS_THREAD_VOCAB_EXCHANGE_H_
