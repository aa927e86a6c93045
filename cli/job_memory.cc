#include "cli/job_memory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/checked_math.h"
#include "base/system_memory.h"
#include "heads/config/head_facts.h"
#include "losses/row_meta.h"
#include "proto/config.h"

namespace dflash {
namespace {

std::string Bytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  if (bytes < (int64_t{1} << 20))
    return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  if (bytes < (int64_t{1} << 30)) {
    return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  }
  return absl::StrFormat("%.1f GiB", bytes / 1073741824.0);
}

absl::Status TooBig(const std::string& what) {
  return absl::ResourceExhaustedError(absl::StrCat(
      what, "; use a smaller batch, sequence, hidden size or vocabulary"));
}

}  // namespace

std::optional<int64_t> JobBytes::Total() const {
  return CheckedSum({batch, gradients, head.value_or(0), layout, runtime});
}

std::optional<MemoryBudget> JobMemoryBudget(
    std::optional<int64_t> memory_limit) {
  if (memory_limit.has_value()) {
    return MemoryBudget{*memory_limit, "--memory_limit"};
  }
  if (std::optional<AvailableMemory> system = SystemAvailableMemory()) {
    return MemoryBudget{system->bytes, system->source};
  }
  return std::nullopt;
}

absl::StatusOr<std::pair<int64_t, int64_t>> HostBytes(
    const v1::ObjectiveConfig& config, int64_t b, int64_t s, int64_t n,
    int64_t transient, int64_t sets) {
  const int64_t k = config.layout().block_size(),
                h = config.head().hidden_size(), v = config.head().vocab_size(),
                e = BytesPerLogit(config.head().dtype());
  const bool teacher = ProjectsTeacher(config);
  const bool trainable = config.head().trainable();
  const std::optional<int64_t> rows = CheckedProduct({b, n, k});
  const std::optional<int64_t> tokens = CheckedMul(b, s);
  const std::optional<int64_t> blocks = CheckedMul(b, n);
  const std::optional<int64_t> row_values =
      rows ? CheckedMul(*rows, h) : std::nullopt;
  const std::optional<int64_t> weight = CheckedProduct({v, h, e});
  // A correction's z and M, and as much again for their gradients.
  const int64_t rank = config.head().correction_rank();
  const std::optional<int64_t> correction =
      rows ? CheckedProduct({*rows + v, rank, e}) : std::nullopt;
  if (!rows || !tokens || !blocks || !row_values || !weight || !correction) {
    return TooBig(absl::StrCat("the batch's sizes (", b, " x ", n, " x ", k,
                               " rows of ", h, ", ", b, " x ", s, " tokens, V ",
                               v, ") overflow 64 bits"));
  }
  const std::optional<int64_t> hidden = CheckedMul(*row_values, e);
  const std::optional<int64_t> tokens_bytes = CheckedMul(*tokens, 17);
  const std::optional<int64_t> rows_bytes =
      CheckedMul(*rows, static_cast<int64_t>(sizeof(RowMeta)) + 4);
  const std::optional<int64_t> batch =
      hidden && tokens_bytes && rows_bytes
          ? CheckedSum({*tokens_bytes, *blocks * 9, *rows_bytes, *hidden,
                        teacher ? *hidden : 0, *weight, v * e, *correction,
                        transient})
          : std::nullopt;
  const std::optional<int64_t> grads =
      hidden ? CheckedSum({*hidden, trainable ? *weight : 0,
                           trainable ? v * e : 0, *rows * 4, *correction})
             : std::nullopt;
  const std::optional<int64_t> all_grads =
      grads ? CheckedMul(*grads, sets) : std::nullopt;
  if (!batch || !all_grads) {
    return TooBig(absl::StrCat("the batch's bytes (", b, " x ", n, " x ", k,
                               " rows of ", h, ", V ", v,
                               ") overflow 64 bits"));
  }
  return std::make_pair(*batch, *all_grads);
}

// Measured at 3-24 MiB on two threads (OpenBLAS's packing buffers are most
// of it); //cli:memory_prediction_test checks the whole prediction against
// the peak resident memory.
int64_t RuntimeBytes(int threads) {
  return (int64_t{32} << 20) + threads * (int64_t{8} << 20);
}

absl::Status CheckFits(const std::optional<MemoryBudget>& budget,
                       const JobBytes& bytes) {
  const std::optional<int64_t> total = bytes.Total();
  if (budget && total && *total <= budget->bytes) return absl::OkStatus();
  if (!budget && total) return absl::OkStatus();
  const std::string needs =
      total ? absl::StrCat(*total, " bytes (", Bytes(*total), ")")
            : std::string("more than 2^63 bytes");
  return TooBig(absl::StrCat(
      "this run needs ", bytes.head ? "" : "at least ", needs, ": batch ",
      Bytes(bytes.batch),
      ", gradients ", Bytes(bytes.gradients), ", head buffers ",
      bytes.head ? Bytes(*bytes.head) : "not yet planned", ", weight layout ",
      Bytes(bytes.layout),
      ", libraries and threads ", Bytes(bytes.runtime), "; ",
      budget ? absl::StrCat(budget->bytes, " bytes (", Bytes(budget->bytes),
                            ") are available (", budget->source, ")")
             : std::string("")));
}

}  // namespace dflash
