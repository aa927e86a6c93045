#include "losses/vocab_shard.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/row_error.h"

namespace dflash {

absl::Status GatherRecords(VocabExchange& exchange,
                           const absl::Status& local_error,
                           absl::Span<double> record,
                           std::vector<double>& gathered) {
  record[0] = static_cast<double>(local_error.code());
  record[1] = -1;
  if (std::optional<RowErrorInfo> row = GetRowError(local_error)) {
    record[1] = static_cast<double>(row->row);
  }
  const int size = exchange.size();
  gathered.resize(record.size() * size);
  DFLASH_RETURN_IF_ERROR(
      exchange.AllGather(record, absl::MakeSpan(gathered)));
  for (int q = 0; q < size; ++q) {
    const double* at = gathered.data() + q * record.size();
    if (at[0] == 0) continue;
    if (!local_error.ok()) return local_error;
    const auto code = static_cast<absl::StatusCode>(static_cast<int>(at[0]));
    if (at[1] >= 0 && code == absl::StatusCode::kInvalidArgument) {
      return RowError(static_cast<int64_t>(at[1]),
                      absl::StrCat("vocab_shard: process ", q, " of ", size,
                                   " failed on this row (its own error says "
                                   "why)"));
    }
    return absl::Status(
        code, absl::StrCat("vocab_shard: process ", q, " of ", size,
                           " failed (its own error says why)"));
  }
  return absl::OkStatus();
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
