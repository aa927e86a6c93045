#include "losses/vocab_shard.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/row_error.h"

namespace dflash {

absl::Status CheckShardFields(const VocabShard& shard, int64_t width,
                              absl::string_view name) {
  if (shard.exchange == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".exchange: must be set, got none"));
  }
  if (shard.vocab <= 0 ||
      shard.vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".vocab: must lie in [1, 2^31), got ", shard.vocab));
  }
  if (shard.offset < 0 || shard.offset >= shard.vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".offset: must lie in [0, vocab = ", shard.vocab,
                     "), got ", shard.offset));
  }
  if (shard.offset + width > shard.vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": classes [offset, offset + width) = [", shard.offset, ", ",
        shard.offset + width, ") must lie in [0, vocab = ", shard.vocab,
        ") (width: the logits')"));
  }
  return absl::OkStatus();
}

void MergeRange(double max, double sum, double argmax, double& merged_max,
                double& merged_sum, int32_t& merged_argmax) {
  if (max > merged_max) {
    merged_sum = merged_sum * std::exp(merged_max - max) + sum;
    merged_max = max;
    merged_argmax = static_cast<int32_t>(argmax);
  } else {
    merged_sum += sum * std::exp(max - merged_max);
  }
}

MergedRangeStats MergeRangeRecords(absl::Span<const double* const> records,
                                   int field) {
  const double lowest = -std::numeric_limits<double>::infinity();
  MergedRangeStats merged;
  merged.max = lowest;
  for (const double* record : records) {
    const double* at = record + field;
    MergeRange(at[kRangeMax], at[kRangeSumExp], at[kRangeArgmax], merged.max,
               merged.sum_exp, merged.argmax);
    if (at[kRangeTargetLogit] > lowest) {
      merged.target_logit = at[kRangeTargetLogit];
    }
  }
  return merged;
}

absl::Status ShardRangeError(const absl::Status& status, int64_t offset) {
  std::optional<RowErrorInfo> row = GetRowError(status);
  if (!row) return status;
  return RowError(row->row,
                  absl::StrCat(row->detail, " (counted from class ", offset,
                               ", this process's first)"));
}

void SetRecordHead(const absl::Status& error, absl::Span<double> record) {
  record[0] = static_cast<double>(error.code());
  record[1] = -1;
  if (std::optional<RowErrorInfo> row = GetRowError(error)) {
    record[1] = static_cast<double>(row->row);
  }
}

absl::Status GatherRecords(VocabExchange& exchange,
                           const absl::Status& local_error,
                           absl::Span<double> record,
                           std::vector<double>& gathered) {
  SetRecordHead(local_error, record);
  const int size = exchange.size();
  gathered.resize(record.size() * size);
  if (absl::Status sent = exchange.AllGather(record, absl::MakeSpan(gathered));
      !sent.ok()) {
    // This record did not go: the others wait for it in this gather.
    const absl::Status first = local_error.ok() ? sent : local_error;
    SetRecordHead(first, record);
    exchange.AllGather(record, absl::MakeSpan(gathered)).IgnoreError();
    return first;
  }
  for (int q = 0; q < size; ++q) {
    const double* at = gathered.data() + q * record.size();
    if (at[0] == 0) continue;
    if (!local_error.ok()) return local_error;
    auto code = static_cast<absl::StatusCode>(static_cast<int>(at[0]));
    if (at[1] >= 0 && code == absl::StatusCode::kInvalidArgument) {
      return RowError(static_cast<int64_t>(at[1]),
                      absl::StrCat("vocab_shard: process ", q, " of ", size,
                                   " failed on this row (its own error says "
                                   "why)"));
    }
    const std::string what = absl::StatusCodeToString(code);
    if (code == absl::StatusCode::kCancelled) {
      code = absl::StatusCode::kAborted;
    }
    return absl::Status(
        code, absl::StrCat("vocab_shard: process ", q, " of ", size,
                           " failed: ", what, " (its own error says why)"));
  }
  return absl::OkStatus();
}

absl::Status SendError(VocabExchange& exchange, const absl::Status& error) {
  std::vector<double> record(kHandshakeSize), gathered;
  GatherRecords(exchange, error, absl::MakeSpan(record), gathered)
      .IgnoreError();
  return error;
}

absl::Status RunExchange::AllGather(absl::Span<const double> local,
                                    absl::Span<double> out) {
  ++gathers_;
  absl::Status sent = inner_.AllGather(local, out);
  if (!sent.ok()) {
    // GatherRecords sends the record once more: the group stops there.
    stopped_ = true;
    return sent;
  }
  for (size_t at = 0; at < out.size(); at += local.size()) {
    if (out[at] != 0) stopped_ = true;  // Every process's GatherRecords fails.
  }
  return sent;
}

absl::Status RunExchange::Finish(const absl::Status& run) {
  if (!run.ok()) {
    if (!stopped_) SendError(*this, run).IgnoreError();
    return run;
  }
  std::vector<double> record(kHandshakeSize), gathered;
  return GatherRecords(*this, run, absl::MakeSpan(record), gathered);
}

absl::Status CheckShardRecords(absl::Span<const double> gathered,
                               int record_size, int offset_at, int width_at,
                               int vocab_at,
                               absl::Span<const AgreedField> agreed) {
  const int size = static_cast<int>(gathered.size()) / record_size;
  auto at = [&](int q, int index) {
    return gathered[static_cast<size_t>(q) * record_size + index];
  };
  for (int q = 1; q < size; ++q) {
    for (const AgreedField& field : agreed) {
      if (at(q, field.index) != at(0, field.index)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "vocab_shard: ", field.name, " differs across the group: process ",
            q, " has ", at(q, field.index), ", process 0 has ",
            at(0, field.index), " (every process runs the same rows)"));
      }
    }
    if (at(q, vocab_at) != at(0, vocab_at)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "vocab_shard.vocab: differs across the group: process ", q,
          " has ", at(q, vocab_at), ", process 0 has ", at(0, vocab_at)));
    }
  }
  double end = 0;
  for (int q = 0; q < size; ++q) {
    if (at(q, offset_at) != end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "vocab_shard.offset: process ", q, " starts at class ",
          at(q, offset_at), ", expected ", end,
          " (the processes' ranges tile [0, vocab) in rank order)"));
    }
    if (!(at(q, width_at) >= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("vocab_shard: process ", q,
                       " holds no class (its logits' width is ",
                       at(q, width_at), ", expected >= 1)"));
    }
    end += at(q, width_at);
  }
  if (end != at(0, vocab_at)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_shard: the processes' ranges end at class ", end,
        ", expected vocab = ", at(0, vocab_at),
        " (the ranges tile [0, vocab) in rank order)"));
  }
  return absl::OkStatus();
}

}  // namespace dflash
