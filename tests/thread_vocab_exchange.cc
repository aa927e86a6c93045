#include "tests/thread_vocab_exchange.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"

namespace dflash {
namespace testing_vocab {
namespace {

class RankExchange final : public VocabExchange {
 public:
  RankExchange(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  absl::Status AllGather(absl::Span<const double> local,
                         absl::Span<double> out) override {
    return group_.AllGather(rank_, local, out);
  }

 private:
  ThreadGroup& group_;
  const int rank_;
};

}  // namespace

ThreadGroup::ThreadGroup(int size, std::chrono::milliseconds timeout)
    : size_(size),
      timeout_(timeout),
      data_(size),
      calls_(size, 0),
      bytes_(size, 0),
      fail_(size, 0) {
  for (int q = 0; q < size; ++q) {
    exchanges_.push_back(std::make_unique<RankExchange>(*this, q));
  }
}

absl::Status ThreadGroup::AllGather(int rank, absl::Span<const double> local,
                                    absl::Span<double> out) {
  std::unique_lock<std::mutex> lock(mu_);
  ++calls_[rank];
  bytes_[rank] += static_cast<int64_t>(local.size() * sizeof(double));
  if (calls_[rank] == fail_[rank]) {
    return absl::UnavailableError(
        absl::StrCat("AllGather: call ", calls_[rank], " of rank ", rank,
                     " fails (injected)"));
  }
  // The previous call's readers leave before this one's writers arrive.
  if (!cv_.wait_for(lock, timeout_, [&] { return departing_ == 0; })) {
    return absl::DeadlineExceededError("AllGather: the previous call hangs");
  }
  data_[rank].assign(local.begin(), local.end());
  const int64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    departing_ = size_;
    ++generation_;
    cv_.notify_all();
  } else if (!cv_.wait_for(lock, timeout_,
                           [&] { return generation_ != generation; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("AllGather: rank ", rank, " waited ", timeout_.count(),
                     " ms for the others"));
  }
  absl::Status status;
  for (int q = 0; q < size_; ++q) {
    if (data_[q].size() != local.size()) {
      status = absl::InternalError(absl::StrCat(
          "AllGather: rank ", q, " sent ", data_[q].size(), " values, rank ",
          rank, " ", local.size()));
    }
  }
  if (status.ok() && out.size() != local.size() * size_) {
    status = absl::InternalError("AllGather: out has the wrong size");
  }
  if (status.ok()) {
    for (int q = 0; q < size_; ++q) {
      std::copy(data_[q].begin(), data_[q].end(),
                out.begin() + q * local.size());
    }
  }
  if (--departing_ == 0) cv_.notify_all();
  return status;
}

void RunRanks(int size, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int q = 0; q < size; ++q) threads.emplace_back(body, q);
  for (std::thread& t : threads) t.join();
}

Ranges SplitVocab(int64_t vocab, int size) {
  Ranges ranges;
  int64_t offset = 0;
  for (int q = 0; q < size; ++q) {
    const int64_t width = vocab / size + (q < vocab % size ? 1 : 0);
    ranges.offsets.push_back(offset);
    ranges.widths.push_back(width);
    offset += width;
  }
  return ranges;
}

}  // namespace testing_vocab
}  // namespace dflash
