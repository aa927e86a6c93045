#ifndef DFLASH_LOSSES_TOP_K_CURSOR_H_
#define DFLASH_LOSSES_TOP_K_CURSOR_H_

// One thread's share of a row's top-k in a single pass: the thread keeps
// the best kCapacity of its own elements, in order; the block merges the
// threads' heads pick by pick, and a thread that runs out of its list
// rescans its elements below the last one it gave (rare: only a thread
// holding more than kCapacity of the row's top k). Written once for the
// CUDA kernel and the host test that checks it against a sort.

#include <cmath>
#include <cstdint>

#include "base/host_device.h"

namespace dflash {

struct Candidate {
  float value;
  int32_t index;
};

// The row's order: larger values first, ties to the lower index.
DFLASH_HOST_DEVICE inline bool Precedes(const Candidate& a,
                                        const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// What an exhausted thread offers: every element precedes it.
DFLASH_HOST_DEVICE inline Candidate NoCandidate() {
  return Candidate{-INFINITY, INT32_MAX};
}

template <int kCapacity>
class TopKCursor {
 public:
  // Fills the list from `scan`, which calls offer(Candidate) for each of
  // this thread's elements. NaNs are never candidates.
  template <typename Scan>
  DFLASH_HOST_DEVICE void Fill(Scan&& scan) {
    count_ = 0;
    head_ = 0;
    scan([this](Candidate c) {
      if (c.value == c.value && Precedes(bound_, c)) Offer(c);
    });
    full_ = count_ == kCapacity;
  }

  // This thread's best element not yet given, or NoCandidate().
  DFLASH_HOST_DEVICE Candidate Head() const {
    return head_ < count_ ? items_[head_] : NoCandidate();
  }
  DFLASH_HOST_DEVICE bool HasHead() const { return head_ < count_; }

  // After the block picked Head(): moves on, refilling from `scan` when the
  // list ran out and may have left elements behind.
  template <typename Scan>
  DFLASH_HOST_DEVICE void Pop(Scan&& scan) {
    bound_ = items_[head_++];
    if (head_ == count_ && full_) Fill(scan);
  }

 private:
  DFLASH_HOST_DEVICE void Offer(Candidate c) {
    if (count_ == kCapacity && !Precedes(c, items_[kCapacity - 1])) return;
    int i = count_ < kCapacity ? count_++ : kCapacity - 1;
    for (; i > 0 && Precedes(c, items_[i - 1]); --i) items_[i] = items_[i - 1];
    items_[i] = c;
  }

  Candidate items_[kCapacity];
  int count_ = 0;
  int head_ = 0;
  bool full_ = false;
  // The last element this thread gave: the list holds only what follows it.
  Candidate bound_{INFINITY, -1};
};

}  // namespace dflash

#endif  // DFLASH_LOSSES_TOP_K_CURSOR_H_
