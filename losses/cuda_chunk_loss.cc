#include "losses/cuda_chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/cuda_row_kernels.h"
#include "losses/loss_math.h"
#include "losses/row_error.h"
#include "losses/vocab_shard.h"

namespace dflash {
namespace {

// Bytes of `count` T, rounded up to 256 so that sub-buffers stay aligned.
template <typename T>
int64_t Aligned(int64_t count) {
  return (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256;
}

// Bytes of a chunk's device scratch of n rows: its rows, block starts,
// per-row statistics and terms.
int64_t ScratchBytes(int64_t n) {
  return Aligned<cuda::Row>(n) + Aligned<int32_t>(n + 1) +
         Aligned<cuda::RowStats>(n) + 3 * Aligned<double>(n) +
         Aligned<double>(kTermSlots * n);
}

// What the CUDA loss does not take vocab-parallel in a chunk.
absl::Status CheckShardChunk(bool device_rows) {
  if (device_rows) {
    return absl::InvalidArgumentError(
        "vocab_shard: the CUDA loss takes host rows vocab-parallel (their "
        "targets are checked against the whole vocabulary there); got device "
        "rows");
  }
  return absl::OkStatus();
}

// `range`, a row's stats over this process's classes from `offset` on, as
// its record's RangeStatsField at `at` (its target logit -inf where another
// range holds the target, or the row has none).
void PutRangeRecord(const cuda::RowStats& range, bool has_target,
                    int64_t offset, double* at) {
  at[kRangeMax] = range.max;
  at[kRangeSumExp] = range.sum_exp;
  at[kRangeTargetLogit] = has_target
                              ? double{range.target}
                              : -std::numeric_limits<double>::infinity();
  at[kRangeArgmax] = static_cast<double>(offset + range.argmax);
}

// The whole row's stats from every range's record at `field`, in rank
// order (MergeRangeRecords), as the kernels read them.
cuda::RowStats WholeRowStats(absl::Span<const double* const> records,
                             int field) {
  const MergedRangeStats merged = MergeRangeRecords(records, field);
  cuda::RowStats whole;
  whole.max = static_cast<float>(merged.max);
  whole.log_sum = static_cast<float>(std::log(merged.sum_exp));
  whole.sum_exp = static_cast<float>(merged.sum_exp);
  whole.target = static_cast<float>(merged.target_logit);
  whole.argmax = merged.argmax;
  return whole;
}

// Row r's record (per_row values after the head) from each process's in
// GatherRecords' `gathered`, in rank order, into `records`.
void RowRecords(const std::vector<double>& gathered, int64_t r, int per_row,
                std::vector<const double*>& records) {
  const size_t record_size = gathered.size() / records.size();
  for (size_t q = 0; q < records.size(); ++q) {
    records[q] = gathered.data() + q * record_size + kRecordHead + r * per_row;
  }
}

// The loss's error word as this range's error: a logit's index counts from
// the range's first class.
absl::Status ShardLossError(unsigned long long code, int64_t offset) {
  const cuda::ErrorKind kind = cuda::DecodeErrorCode(code).kind;
  absl::Status error = CudaLossError(code);
  return kind == cuda::kLogitNotFinite || kind == cuda::kTeacherNotFinite
             ? ShardRangeError(error, offset)
             : error;
}

}  // namespace

// A vocab-parallel chunk's top-k lists on the device (the top-k pass's over
// this range, then the merged ones), freed in stream order with the chunk.
template <typename T>
struct CudaChunkLoss<T>::ShardLists {
  int32_t picks = 0;     // max(caller_k, metric_k): the lists' width.
  int32_t caller_k = 0;  // outputs.k, where top_k is asked for.
  int32_t metric_k = 0;  // The diagnostics', at most the vocabulary.
  bool teacher_metrics = false;  // The diagnostics' teacher mass.
  TrackedBuffer<int32_t> ids, ranks;
  TrackedBuffer<float> values, teacher;
};

template <typename T>
struct CudaChunkLoss<T>::State {
  cuda::KernelParams params;
  CudaStream* stream = nullptr;
  TrackedBuffer<double> totals;
  TrackedBuffer<unsigned long long> error;
  // The scratch of chunks of up to scratch_rows rows, allocated at the
  // first (stream order keeps one chunk's kernels apart from the next's).
  TrackedBuffer<char> scratch;
  int64_t scratch_rows = 0;
  // Host copies of the chunks' metadata, alive until the device has read
  // them (copies from pageable memory are staged, but keep it simple).
  std::vector<std::vector<cuda::Row>> rows;
  std::vector<std::vector<int32_t>> block_begins;
  // RunDeviceRows's stand-in rows for the size checks (positions only).
  std::vector<RowMeta> layout;
  // Vocab-parallel: a chunk's stats on the host, its record, the gathered
  // records.
  std::vector<cuda::RowStats> shard_stats;
  std::vector<double> shard_record, shard_gathered;
  std::vector<cuda::RowSumState> row_sums;  // ShardRounds' rows.
  // The merged top-k lists and the rows' terms their diagnostics fill.
  std::vector<int32_t> top_ids, ranks;
  std::vector<float> top_values, top_teacher;
  std::vector<int32_t> list_heads;  // MergeLists' place in each range's.
  std::vector<double> top_terms;
};

template <typename T>
CudaChunkLoss<T>::CudaChunkLoss(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

template <typename T>
CudaChunkLoss<T>::~CudaChunkLoss() = default;

template <typename T>
absl::StatusOr<std::unique_ptr<CudaChunkLoss<T>>> CudaChunkLoss<T>::Create(
    const LossParams& params, const ChunkLossOptions& options,
    CudaStream& stream, int64_t max_rows) {
  DFLASH_RETURN_IF_ERROR(ValidateChunkLossOptions(options));
  if (options.block_size > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk loss: block_size must lie in [1, 2^20], got ",
                     options.block_size));
  }
  auto state = std::make_unique<State>();
  state->params.loss = params;
  state->params.options = options;
  state->stream = &stream;
  TrackingAllocator& allocator = stream.allocator();
  DFLASH_ASSIGN_OR_RETURN(
      TrackedBuffer<double> totals,
      TrackedBuffer<double>::Create(
          allocator,
          TotalsSize(static_cast<int32_t>(options.block_size))));
  state->totals = std::move(totals);
  DFLASH_ASSIGN_OR_RETURN(
      TrackedBuffer<unsigned long long> error,
      TrackedBuffer<unsigned long long>::Create(allocator, 1));
  state->error = std::move(error);
  state->scratch_rows = std::max<int64_t>(max_rows, 0);
  DFLASH_RETURN_IF_ERROR(
      stream.Zero(state->totals.data(), state->totals.bytes()));
  cuda::LaunchResetError(state->error.data(), stream.stream());
  DFLASH_RETURN_IF_ERROR(stream.LaunchStatus("chunk loss start"));
  return std::unique_ptr<CudaChunkLoss>(new CudaChunkLoss(std::move(state)));
}

absl::Status CudaLossError(unsigned long long code) {
  const cuda::ReportedError e = cuda::DecodeErrorCode(code);
  switch (e.kind) {
    case cuda::kTeacherNotFinite:
      return RowError(e.row, absl::StrCat("teacher logits: logit ", e.logit,
                                          " is not finite (", e.value, ")"));
    case cuda::kConfidenceNotFinite:
      return RowError(e.row, absl::StrCat("confidence logit is not finite (",
                                          e.value, ")"));
    case cuda::kGradientNotFinite:
      return RowError(e.row,
                      "d(loss)/d(logits) overflows float32; masks and loss "
                      "weights this large need rescaling");
    default:
      return RowError(e.row, absl::StrCat("logit ", e.logit,
                                          " is not finite (", e.value, ")"));
  }
}

absl::Status CheckCudaChunkLimits(int64_t vocab, int64_t rows) {
  if (vocab < cuda::kMaxErrorIndex && rows < cuda::kMaxErrorIndex) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "cuda chunk loss: vocab and rows must lie below 2^30 (the device's "
      "error codes), got vocab ",
      vocab, " and ", rows, " rows"));
}

template <typename T>
absl::Status CudaChunkLoss<T>::Check(const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs,
                                     const int64_t* out_rows) const {
  const State& s = *state_;
  const int64_t n = static_cast<int64_t>(inputs.rows.size());
  DFLASH_RETURN_IF_ERROR(CheckCudaChunkLimits(inputs.vocab, n));
  // With out_rows, per-row arrays hold the caller's rows rather than the
  // chunk's; the checks see the chunk's share of them.
  ChunkLossInputs<T> check_inputs = inputs;
  ChunkLossOutputs check_outputs = outputs;
  if (out_rows != nullptr) {
    auto share = [n](auto span, int64_t per_row) {
      const size_t want = static_cast<size_t>(n * per_row);
      return span.size() >= want ? span.subspan(0, want) : span;
    };
    check_inputs.confidence_logits = share(inputs.confidence_logits, 1);
    check_outputs.confidence_grad = share(outputs.confidence_grad, 1);
    check_outputs.neg_log_q = share(outputs.neg_log_q, 1);
    check_outputs.argmax = share(outputs.argmax, 1);
    check_outputs.top_k = share(outputs.top_k, outputs.k);
    check_outputs.target_probability = share(outputs.target_probability, 1);
    check_outputs.target_rank = share(outputs.target_rank, 1);
    check_outputs.top_k_values = share(outputs.top_k_values, outputs.k);
    check_outputs.loss_weight = share(outputs.loss_weight, 1);
    check_outputs.teacher_acceptance = share(outputs.teacher_acceptance, 1);
    check_outputs.base_argmax = share(outputs.base_argmax, 1);
    check_outputs.teacher_argmax = share(outputs.teacher_argmax, 1);
  }
  return ValidateChunkLossInputs(s.params.loss, s.params.options, check_inputs,
                                 check_outputs);
}

template <typename T>
absl::Status CudaChunkLoss<T>::Run(const ChunkLossInputs<T>& inputs,
                                   const ChunkLossOutputs& outputs,
                                   const int64_t* out_rows, bool record) {
  const State& s = *state_;
  const VocabShard* shard = s.params.options.vocab_shard;
  absl::Status valid = Check(inputs, outputs, out_rows);
  if (valid.ok() && shard != nullptr) {
    valid = CheckShardChunk(/*device_rows=*/false);
  }
  const int64_t n = static_cast<int64_t>(inputs.rows.size());
  if (!valid.ok() && shard == nullptr) return valid;
  const LossParams& loss = s.params.loss;
  // Target ids are global: the whole vocabulary's.
  const int64_t classes = shard != nullptr ? shard->vocab : inputs.vocab;
  std::vector<cuda::Row> rows(valid.ok() ? n : 0);
  for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
    const RowMeta& meta = inputs.rows[r];
    const double mask = EffectiveMask(loss, meta.target, meta.mask);
    if (!inputs.rows_checked && mask != 0 && meta.target != loss.ignore_index &&
        (meta.target < 0 || meta.target >= classes)) {
      valid = RowError(r, absl::StrCat("target id ", meta.target,
                                       " is outside [0, ", classes, ")"));
      if (shard == nullptr) return valid;
      rows.clear();
      break;
    }
    // The kernels read the mask in float32, as the CUDA head computes
    // (CUDA runs float32 or bfloat16; the binding gives them float32
    // masks), and the weight in double, as the CPU's. (LaunchRowsFromMeta
    // does the same on the device.)
    rows[r] = {mask != 0 ? meta.target : 0, meta.position,
               static_cast<float>(mask), RowLossWeight(loss, meta.position, mask),
               DPaceRowScale(loss, meta.sequence_share)};
  }
  std::vector<int32_t> block_begin;
  if (CouplesBlocks(loss)) {
    for (int64_t r = 0; r < n; ++r) {
      if (r == 0 || inputs.rows[r].block != inputs.rows[r - 1].block) {
        block_begin.push_back(static_cast<int32_t>(r));
      }
    }
    block_begin.push_back(static_cast<int32_t>(n));
  }
  return Launch(valid, inputs, outputs, out_rows, record, n, std::move(rows),
                nullptr, std::move(block_begin));
}

template <typename T>
absl::Status CudaChunkLoss<T>::RunDeviceRows(const RowMeta* rows,
                                             int64_t count,
                                             const ChunkLossInputs<T>& inputs,
                                             const ChunkLossOutputs& outputs,
                                             const int64_t* out_rows,
                                             bool record) {
  State& s = *state_;
  if (s.params.options.vocab_shard != nullptr) {
    // Refused on every process at the chunk's handshake.
    return Launch(CheckShardChunk(/*device_rows=*/true),
                  inputs, outputs, out_rows, record, 0, {}, rows, {});
  }
  const int64_t k = s.params.options.block_size;
  if (!inputs.rows.empty() || count < 0 || count % k != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk loss: device rows must be whole blocks of ", k,
        " rows with inputs.rows empty, got ", count, " rows and ",
        inputs.rows.size(), " host rows"));
  }
  // The size checks read the rows' positions and blocks alone: stand-ins
  // of the layout the device rows have.
  s.layout.resize(count);
  for (int64_t r = 0; r < count; ++r) {
    s.layout[r] = RowMeta();
    s.layout[r].position = static_cast<int32_t>(r % k);
    s.layout[r].block = r / k;
  }
  ChunkLossInputs<T> check_inputs = inputs;
  check_inputs.rows = s.layout;
  check_inputs.rows_checked = true;
  DFLASH_RETURN_IF_ERROR(Check(check_inputs, outputs, out_rows));
  return Launch(absl::OkStatus(), inputs, outputs, out_rows, record, count,
                {}, rows, {});
}

template <typename T>
absl::Status CudaChunkLoss<T>::Launch(const absl::Status& valid,
                                      const ChunkLossInputs<T>& inputs,
                                      const ChunkLossOutputs& outputs,
                                      const int64_t* out_rows, bool record,
                                      int64_t n,
                                      std::vector<cuda::Row> host_rows,
                                      const RowMeta* device_rows,
                                      std::vector<int32_t> block_begin) {
  State& s = *state_;
  const LossParams& loss = s.params.loss;
  const VocabShard* shard = s.params.options.vocab_shard;
  const int64_t vocab = inputs.vocab;
  // The chunk's metadata and scratch: the run's, or a buffer of its own
  // freed in stream order when this call returns.
  TrackedBuffer<char> own;
  absl::Status ready = valid;
  if (ready.ok() && n > 0 && n <= s.scratch_rows && s.scratch.size() == 0) {
    absl::StatusOr<TrackedBuffer<char>> scratch = TrackedBuffer<char>::Create(
        s.stream->allocator(), ScratchBytes(s.scratch_rows));
    if (scratch.ok()) s.scratch = *std::move(scratch);
    ready = scratch.status();
  }
  if (ready.ok() && n > s.scratch_rows) {
    absl::StatusOr<TrackedBuffer<char>> scratch =
        TrackedBuffer<char>::Create(s.stream->allocator(), ScratchBytes(n));
    if (scratch.ok()) own = *std::move(scratch);
    ready = scratch.status();
  }
  // Vocab-parallel, the row sums' rounds (ShardRounds) and the top-k
  // lists; freed in stream order as this returns.
  TrackedBuffer<cuda::RowSumState> row_sums;
  TrackedBuffer<cuda::RowStats> base_stats;  // Domino's.
  ShardLists lists;
  if (shard != nullptr) {
    lists.caller_k = outputs.top_k.empty() ? 0 : outputs.k;
    lists.metric_k = static_cast<int32_t>(
        std::min<int64_t>(s.params.options.metric_top_k, shard->vocab));
    lists.picks = std::max(lists.caller_k, lists.metric_k);
    lists.teacher_metrics = !inputs.teacher_logits.empty() &&
                            loss.family != LossFamily::kDSpark &&
                            loss.family != LossFamily::kDistillation;
  }
  auto create = [&](auto& buffer, int64_t count) {
    if (!ready.ok() || count == 0) return;
    auto made = std::remove_reference_t<decltype(buffer)>::Create(
        s.stream->allocator(), count);
    if (made.ok()) buffer = *std::move(made);
    ready = made.status();
  };
  if (shard != nullptr && loss.family == LossFamily::kDomino) {
    create(base_stats, n);
  } else if (shard != nullptr) {
    const int64_t list = n * lists.picks;
    // Only the passes that meet row sums use it.
    if (!inputs.teacher_logits.empty() || loss.dpard) create(row_sums, n);
    create(lists.ids, list);
    create(lists.values, list);
    create(lists.teacher, lists.teacher_metrics ? list : 0);
    create(lists.ranks, lists.picks > 0 ? n : 0);
  }
  if (shard != nullptr) {
    // Every process's checks and scratch meet here, so that a failure on
    // one is a failure on every one.
    DFLASH_RETURN_IF_ERROR(ChunkShardHandshake(
        s.params.options, ready, vocab, n,
        outputs.top_k.empty() ? 0 : outputs.k,
        !inputs.teacher_logits.empty()));
  }
  DFLASH_RETURN_IF_ERROR(ready);
  if (n == 0) return absl::OkStatus();
  char* at = n > s.scratch_rows ? own.data() : s.scratch.data();
  // This process's failure since the chunk's last gather (vocab-parallel).
  absl::Status carried;
  auto take = [&](int64_t bytes) {
    char* here = at;
    at += bytes;
    return here;
  };
  cuda::ChunkArgs<T> args;
  cuda::Row* meta = reinterpret_cast<cuda::Row*>(take(Aligned<cuda::Row>(n)));
  int32_t* blocks = reinterpret_cast<int32_t*>(take(Aligned<int32_t>(n + 1)));
  args.meta = meta;
  args.stats = reinterpret_cast<cuda::RowStats*>(
      take(Aligned<cuda::RowStats>(n)));
  args.weight = reinterpret_cast<double*>(take(Aligned<double>(n)));
  args.ce_share = reinterpret_cast<double*>(take(Aligned<double>(n)));
  args.accept = reinterpret_cast<double*>(take(Aligned<double>(n)));
  args.row_terms =
      reinterpret_cast<double*>(take(Aligned<double>(kTermSlots * n)));
  if (device_rows != nullptr) {
    cuda::LaunchRowsFromMeta(loss, device_rows, n, meta, s.stream->stream());
    args.block_begin = nullptr;
    args.block_size = static_cast<int32_t>(s.params.options.block_size);
    args.blocks = CouplesBlocks(loss)
                      ? static_cast<int32_t>(n / s.params.options.block_size)
                      : 0;
  } else {
    s.rows.push_back(std::move(host_rows));
    s.block_begins.push_back(std::move(block_begin));
    carried = s.stream->CopyToDevice(meta, s.rows.back().data(),
                                     n * sizeof(cuda::Row));
    if (carried.ok()) {
      carried = s.stream->CopyToDevice(
          blocks, s.block_begins.back().data(),
          s.block_begins.back().size() * sizeof(int32_t));
    }
    // Vocab-parallel, a failure from here on goes to the chunk's next
    // gather (never a return between two: the others wait in it).
    if (shard == nullptr) DFLASH_RETURN_IF_ERROR(carried);
    args.block_begin = blocks;
    args.blocks = static_cast<int32_t>(s.block_begins.back().size()) - 1;
  }
  args.logits = inputs.logits.data();
  args.stride = inputs.stride();
  args.teacher =
      inputs.teacher_logits.empty() ? nullptr : inputs.teacher_logits.data();
  args.correction = inputs.correction_logits.empty()
                        ? nullptr
                        : inputs.correction_logits.data();
  args.base_argmax =
      outputs.base_argmax.empty() ? nullptr : outputs.base_argmax.data();
  args.teacher_argmax =
      outputs.teacher_argmax.empty() ? nullptr : outputs.teacher_argmax.data();
  args.rows = n;
  args.out_rows = out_rows;
  args.confidence = inputs.confidence_logits.empty()
                        ? nullptr
                        : inputs.confidence_logits.data();
  args.confidence_grad = outputs.confidence_grad.empty()
                             ? nullptr
                             : outputs.confidence_grad.data();
  args.neg_log_q =
      outputs.neg_log_q.empty() ? nullptr : outputs.neg_log_q.data();
  args.argmax = outputs.argmax.empty() ? nullptr : outputs.argmax.data();
  args.top_k = outputs.top_k.empty() ? nullptr : outputs.top_k.data();
  args.k = outputs.top_k.empty() ? 0 : outputs.k;
  args.target_probability = outputs.target_probability.empty()
                                ? nullptr
                                : outputs.target_probability.data();
  args.metric_k = static_cast<int32_t>(std::min<int64_t>(
      s.params.options.metric_top_k,
      shard != nullptr ? shard->vocab : vocab));
  args.target_rank =
      outputs.target_rank.empty() ? nullptr : outputs.target_rank.data();
  args.top_k_values =
      outputs.top_k_values.empty() ? nullptr : outputs.top_k_values.data();
  args.loss_weight =
      outputs.loss_weight.empty() ? nullptr : outputs.loss_weight.data();
  args.teacher_acceptance = outputs.teacher_acceptance.empty()
                                ? nullptr
                                : outputs.teacher_acceptance.data();
  args.totals = record ? s.totals.data() : nullptr;
  args.error = s.error.data();
  cuda::KernelParams params = s.params;
  params.vocab = vocab;
  params.offset = shard != nullptr ? shard->offset : 0;
  params.classes = shard != nullptr ? shard->vocab : vocab;
  if (shard == nullptr) {
    cuda::LaunchChunkLoss<T>(params, args, s.stream->stream());
    return s.stream->LaunchStatus("chunk loss kernels");
  }
  // Vocab-parallel: the stats, then each pass that meets row sums in
  // rounds (ShardRounds), every merge on the host, then a closing gather
  // of the chunk's errors. A process's own failure travels in the next
  // gather (`carried`); a gather's error is the group's, returned at once.
  CUstream_st* stream = s.stream->stream();
  auto launch_status = [&](const char* what) {
    if (carried.ok()) carried = s.stream->LaunchStatus(what);
  };
  if (loss.family == LossFamily::kDomino) {
    args.base_stats = base_stats.data();
    if (carried.ok()) cuda::LaunchDominoStats<T>(params, args, stream);
    launch_status("domino stats");
    DFLASH_RETURN_IF_ERROR(MergeDominoStats(n, out_rows, args.stats,
                                            args.base_stats, carried));
    if (carried.ok()) cuda::LaunchDominoPass<T>(params, args, stream);
    launch_status("domino pass");
    return CloseShardChunk(n, out_rows, carried);
  }
  if (carried.ok()) {
    cuda::LaunchChunkStats<T>(params, args, stream);
    if (lists.picks > 0) {
      // This range's lists, by chunk row (local ids).
      cuda::ChunkArgs<T> range = args;
      range.top_k = lists.ids.data();
      range.top_k_values = lists.values.data();
      range.top_k_teacher = lists.teacher.data();
      range.k = lists.picks;
      range.metric_k = 0;
      range.out_rows = nullptr;
      range.target_rank = nullptr;
      cuda::LaunchTopK<T>(params, range, stream);
    }
  }
  launch_status("chunk loss stats");
  DFLASH_RETURN_IF_ERROR(MergeShardStats(n, out_rows, args.teacher != nullptr,
                                         args.stats, lists, args.row_terms,
                                         carried));
  if (carried.ok() && lists.caller_k > 0) {
    cuda::LaunchScatterRows(lists.ids.data(), lists.picks, args.top_k, args.k,
                            lists.caller_k, out_rows, n, stream);
    if (args.top_k_values != nullptr) {
      cuda::LaunchScatterRows(lists.values.data(), lists.picks,
                              args.top_k_values, args.k, lists.caller_k,
                              out_rows, n, stream);
    }
  }
  if (carried.ok() && lists.metric_k > 0 && args.target_rank != nullptr) {
    cuda::LaunchScatterRows(lists.ranks.data(), 1, args.target_rank, 1, 1,
                            out_rows, n, stream);
  }
  if (loss.dpard) {
    args.row_sums = row_sums.data();
    DFLASH_RETURN_IF_ERROR(ShardRounds(
        n, args.row_sums,
        [&](bool collect) {
          args.collect = collect;
          cuda::LaunchAcceptancePass<T>(params, args, stream);
        },
        carried));
  }
  if (carried.ok()) cuda::LaunchBlockWeights<T>(params, args, stream);
  // Without teacher logits no pass meets a row sum: one loss pass.
  args.row_sums = args.teacher != nullptr ? row_sums.data() : nullptr;
  DFLASH_RETURN_IF_ERROR(ShardRounds(
      n, args.row_sums,
      [&](bool collect) {
        args.collect = collect;
        cuda::LaunchLossPass<T>(params, args, stream);
      },
      carried));
  return CloseShardChunk(n, out_rows, carried);
}

template <typename T>
absl::Status CudaChunkLoss<T>::ChunkDeviceError(int64_t n,
                                                const int64_t* out_rows) {
  State& s = *state_;
  unsigned long long code = cuda::kNoError;
  DFLASH_RETURN_IF_ERROR(
      s.stream->CopyToHost(&code, s.error.data(), sizeof(code)));
  if (code == cuda::kNoError) return absl::OkStatus();
  cuda::ReportedError e = cuda::DecodeErrorCode(code);
  if (out_rows != nullptr) {
    // The device names the caller's row (out_rows[r]); the chunk's row is
    // what a chunk's error names.
    std::vector<int64_t> rows(n);
    DFLASH_RETURN_IF_ERROR(
        s.stream->CopyToHost(rows.data(), out_rows, n * sizeof(int64_t)));
    const auto at = std::find(rows.begin(), rows.end(), e.row);
    if (at != rows.end()) e.row = at - rows.begin();
  }
  return ShardLossError(cuda::ErrorCode(e.row, e.kind, e.logit, e.value),
                        s.params.options.vocab_shard->offset);
}

template <typename T>
absl::Status CudaChunkLoss<T>::CloseShardChunk(int64_t n,
                                               const int64_t* out_rows,
                                               const absl::Status& carried) {
  State& s = *state_;
  const absl::Status local =
      carried.ok() ? ChunkDeviceError(n, out_rows) : carried;
  s.shard_record.assign(kHandshakeSize, 0.0);
  return GatherRecords(*s.params.options.vocab_shard->exchange, local,
                       absl::MakeSpan(s.shard_record), s.shard_gathered);
}

template <typename T>
absl::Status CudaChunkLoss<T>::ShardRounds(
    int64_t n, cuda::RowSumState* device,
    const std::function<void(bool collect)>& launch, absl::Status& carried) {
  State& s = *state_;
  auto write = [&] {
    if (!carried.ok()) return;
    launch(/*collect=*/false);
    carried = s.stream->LaunchStatus("chunk loss pass");
  };
  if (device == nullptr) {
    write();
    return absl::OkStatus();
  }
  const VocabShard& shard = *s.params.options.vocab_shard;
  const int size = shard.exchange->size();
  std::vector<cuda::RowSumState>& host = s.row_sums;
  host.assign(n, cuda::RowSumState());
  // A row's record: whether it waits, the sum's kind, its two parts, the
  // sums its pass met.
  constexpr int kRow = 5;
  for (;;) {
    absl::Status local = carried;
    if (local.ok()) {
      local = s.stream->CopyToDevice(device, host.data(),
                                     n * sizeof(cuda::RowSumState));
    }
    if (local.ok()) {
      launch(/*collect=*/true);
      local = s.stream->LaunchStatus("chunk loss row sums");
    }
    if (local.ok()) {
      local = s.stream->CopyToHost(host.data(), device,
                                   n * sizeof(cuda::RowSumState));
    }
    s.shard_record.assign(kRecordHead + n * kRow, 0.0);
    for (int64_t r = 0; r < n && local.ok(); ++r) {
      if (host[r].pending == 0) continue;
      double* at = s.shard_record.data() + kRecordHead + r * kRow;
      at[0] = 1;
      at[1] = host[r].kind;
      at[2] = host[r].partial[0];
      at[3] = host[r].partial[1];
      at[4] = host[r].met;
    }
    DFLASH_RETURN_IF_ERROR(GatherRecords(*shard.exchange, local,
                                         absl::MakeSpan(s.shard_record),
                                         s.shard_gathered));
    const size_t record_size = s.shard_record.size();
    // Whether another collecting round is needed: some row waits for a
    // sum this round did not merge. A round after which every row's sums
    // are known would only find that no row waits: skipped.
    bool again = false;
    for (int64_t r = 0; r < n; ++r) {
      auto field = [&](int q, int i) {
        return s.shard_gathered[q * record_size + kRecordHead + r * kRow + i];
      };
      const bool pending = field(0, 0) != 0;
      for (int q = 1; q < size; ++q) {
        if ((field(q, 0) != 0) != pending) {
          return absl::InternalError(absl::StrCat(
              "vocab_shard: the processes disagree on whether row ", r,
              " needs another row sum"));
        }
      }
      if (!pending) continue;
      cuda::RowSumState& state = host[r];
      if (state.known_count == cuda::kMaxRowSums) {
        return absl::InternalError(absl::StrCat(
            "vocab_shard: row ", r, " needs more than ", cuda::kMaxRowSums,
            " row sums"));
      }
      double* known = state.known[state.known_count++];
      if (static_cast<int>(field(0, 1)) == cuda::kRowLogSumExp) {
        // Every range's (max, sum of exp(x - max)), as one logsumexp.
        double max = -std::numeric_limits<double>::infinity(), sum = 0;
        for (int q = 0; q < size; ++q) {
          if (field(q, 3) > 0) max = std::max(max, field(q, 2));
        }
        for (int q = 0; q < size; ++q) {
          if (field(q, 3) > 0) sum += field(q, 3) * std::exp(field(q, 2) - max);
        }
        known[0] = max + std::log(sum);
        known[1] = 0;
      } else {
        known[0] = known[1] = 0;
        for (int q = 0; q < size; ++q) {
          known[0] += field(q, 2);
          known[1] += field(q, 3);
        }
      }
      state.pending = 0;
      again = again || state.known_count < static_cast<int32_t>(field(0, 4));
    }
    for (cuda::RowSumState& state : host) state.met = 0;
    if (!again) break;
  }
  // Every row's sums are known now: to the device, for the writing pass.
  if (carried.ok()) {
    carried = s.stream->CopyToDevice(device, host.data(),
                                     n * sizeof(cuda::RowSumState));
  }
  write();
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaChunkLoss<T>::MergeDominoStats(int64_t n,
                                                const int64_t* out_rows,
                                                cuda::RowStats* final_stats,
                                                cuda::RowStats* base_stats,
                                                absl::Status& carried) {
  State& s = *state_;
  absl::Status local = carried;
  const VocabShard& shard = *s.params.options.vocab_shard;
  const std::vector<cuda::Row>& rows = s.rows.back();
  // A row's record: the final logits' RangeStatsField, then the base's.
  constexpr int kPerRow = 2 * kRangeStatsSize;
  std::vector<cuda::RowStats>& both = s.shard_stats;
  both.resize(2 * n);
  if (local.ok()) {
    local = s.stream->CopyToHost(both.data(), final_stats,
                                 n * sizeof(cuda::RowStats));
  }
  if (local.ok()) {
    local = s.stream->CopyToHost(both.data() + n, base_stats,
                                 n * sizeof(cuda::RowStats));
  }
  if (local.ok()) local = ChunkDeviceError(n, out_rows);
  s.shard_record.assign(kRecordHead + n * kPerRow, 0.0);
  for (int64_t r = 0; r < n && local.ok(); ++r) {
    if (rows[r].mask == 0) continue;
    double* at = s.shard_record.data() + kRecordHead + r * kPerRow;
    PutRangeRecord(both[r], true, shard.offset, at);
    PutRangeRecord(both[n + r], true, shard.offset, at + kRangeStatsSize);
  }
  DFLASH_RETURN_IF_ERROR(GatherRecords(*shard.exchange, local,
                                       absl::MakeSpan(s.shard_record),
                                       s.shard_gathered));
  std::vector<const double*> records(shard.exchange->size());
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r].mask == 0) continue;
    RowRecords(s.shard_gathered, r, kPerRow, records);
    both[r] = WholeRowStats(records, 0);
    both[n + r] = WholeRowStats(records, kRangeStatsSize);
  }
  carried = s.stream->CopyToDevice(final_stats, both.data(),
                                   n * sizeof(cuda::RowStats));
  if (carried.ok()) {
    carried = s.stream->CopyToDevice(base_stats, both.data() + n,
                                     n * sizeof(cuda::RowStats));
  }
  return absl::OkStatus();
}

template <typename T>
void CudaChunkLoss<T>::MergeLists(int64_t r,
                                  absl::Span<const double* const> records,
                                  int list_at, int entry,
                                  const ShardLists& lists) {
  State& s = *state_;
  const cuda::Row& row = s.rows.back()[r];
  const cuda::RowStats& whole = s.shard_stats[r];
  const int32_t picks = lists.picks;
  int32_t* ids = s.top_ids.data() + r * picks;
  float* values = s.top_values.data() + r * picks;
  // Each range's list is sorted (ties to the lower id) and the ranges
  // ascend, so the largest head, the earlier range's on a tie, is next.
  std::vector<int32_t>& heads = s.list_heads;
  heads.assign(records.size(), 0);
  double mass = 0, teacher_mass = 0;
  int32_t rank = -1;
  for (int32_t j = 0; j < picks; ++j) {
    const double* best = nullptr;
    int best_range = -1;
    for (size_t q = 0; q < records.size(); ++q) {
      if (heads[q] >= picks) continue;
      const double* pick = records[q] + list_at + entry * heads[q];
      if (pick[1] < 0) continue;
      if (best == nullptr || pick[0] > best[0]) {
        best = pick;
        best_range = static_cast<int>(q);
      }
    }
    if (best == nullptr) {  // Fewer classes than picks.
      ids[j] = -1;
      values[j] = 0;
      continue;
    }
    ++heads[best_range];
    ids[j] = static_cast<int32_t>(best[1]);
    values[j] = static_cast<float>(best[0]);
    if (j >= lists.metric_k) continue;
    // As the single-process top-k pass.
    if (ids[j] == row.target) rank = j;
    mass += std::exp((best[0] - double{whole.max}) - double{whole.log_sum});
    if (lists.teacher_metrics) {
      teacher_mass += std::exp(best[2] - double{whole.t_lse});
    }
  }
  if (lists.metric_k == 0) return;
  s.ranks[r] = rank;
  double* terms = s.top_terms.data() + r * kTermSlots;
  terms[kTopKRecall] = rank >= 0 ? double{row.mask} : 0.0;
  terms[kTopKMass] = row.mask * mass;
  terms[kTeacherTopKMass] = row.mask * teacher_mass;
}

template <typename T>
absl::Status CudaChunkLoss<T>::MergeShardStats(int64_t n,
                                               const int64_t* out_rows,
                                               bool teacher,
                                               cuda::RowStats* stats,
                                               ShardLists& lists,
                                               double* row_terms,
                                               absl::Status& carried) {
  State& s = *state_;
  const VocabShard& shard = *s.params.options.vocab_shard;
  const LossParams& loss = s.params.loss;
  const std::vector<cuda::Row>& rows = s.rows.back();
  // A row's record: RangeStatsField, then as the chunk needs them the sum
  // of z' (label smoothing), the teacher's (max, sum at t_lse's
  // temperature, global argmax), and distillation's tempered sum.
  const bool distill = loss.family == LossFamily::kDistillation;
  const double inv_t = loss.inv_temperature;
  const bool tempered = distill && static_cast<float>(inv_t) != 1.0f;
  int per_row = kRangeStatsSize;
  const int sum_at = loss.label_smoothing > 0 ? per_row++ : -1;
  const int teacher_at = teacher ? per_row : -1;
  if (teacher) per_row += 3;
  const int tempered_at = distill ? per_row++ : -1;
  // Then the range's top-k list: (value, global id or -1: none, and the
  // teacher's value there for the diagnostics' mass) a pick.
  const int list_at = per_row, entry = lists.teacher_metrics ? 3 : 2;
  const int32_t picks = lists.picks;
  per_row += picks * entry;
  absl::Status local = carried;
  s.shard_stats.resize(n);
  s.shard_record.assign(kRecordHead + n * per_row, 0.0);
  if (local.ok()) {
    local = s.stream->CopyToHost(s.shard_stats.data(), stats,
                                 n * sizeof(cuda::RowStats));
  }
  s.top_ids.resize(n * picks);
  s.top_values.resize(n * picks);
  std::vector<float>& top_teacher = s.top_teacher;
  top_teacher.resize(lists.teacher_metrics ? n * picks : 0);
  if (local.ok() && picks > 0) {
    local = s.stream->CopyToHost(s.top_ids.data(), lists.ids.data(),
                                 lists.ids.bytes());
    if (local.ok()) {
      local = s.stream->CopyToHost(s.top_values.data(), lists.values.data(),
                                   lists.values.bytes());
    }
    if (local.ok() && lists.teacher_metrics) {
      local = s.stream->CopyToHost(top_teacher.data(), lists.teacher.data(),
                                   lists.teacher.bytes());
    }
  }
  if (local.ok()) local = ChunkDeviceError(n, out_rows);
  const double lowest = -std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < n && local.ok(); ++r) {
    if (rows[r].mask == 0) continue;
    const cuda::RowStats& range = s.shard_stats[r];
    double* at = s.shard_record.data() + kRecordHead + r * per_row;
    PutRangeRecord(range, HasTarget(rows[r].target), shard.offset, at);
    if (sum_at >= 0) at[sum_at] = range.sum;
    if (teacher_at >= 0) {
      at[teacher_at] = range.t_max;
      at[teacher_at + 1] = range.t_sum_exp;
      at[teacher_at + 2] = static_cast<double>(shard.offset + range.t_argmax);
    }
    if (tempered_at >= 0) at[tempered_at] = range.sum_exp_t;
    for (int32_t j = 0; j < picks; ++j) {
      double* pick = at + list_at + entry * j;
      const int32_t id = s.top_ids[r * picks + j];
      pick[0] = id >= 0 ? s.top_values[r * picks + j] : lowest;
      pick[1] = id >= 0 ? static_cast<double>(shard.offset + id) : -1;
      if (lists.teacher_metrics) pick[2] = top_teacher[r * picks + j];
    }
  }
  DFLASH_RETURN_IF_ERROR(GatherRecords(*shard.exchange, local,
                                       absl::MakeSpan(s.shard_record),
                                       s.shard_gathered));
  std::vector<const double*> records(shard.exchange->size());
  s.ranks.assign(n, -1);
  s.top_terms.assign(picks > 0 ? n * kTermSlots : 0, 0.0);
  // Over every range's (max at max_at, sum of exp((x - max) * scale) at
  // sum_at), in rank order: the whole row's maximum and that sum about it.
  auto scaled_sum = [&](int max_at, int sum_at_, double scale, double max) {
    double sum = 0;
    for (const double* rec : records) {
      sum += rec[sum_at_] * std::exp((rec[max_at] - max) * scale);
    }
    return sum;
  };
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r].mask == 0) continue;
    RowRecords(s.shard_gathered, r, per_row, records);
    cuda::RowStats& whole = s.shard_stats[r];
    whole = WholeRowStats(records, 0);
    const double merged_max = whole.max;
    if (sum_at >= 0) {
      double sum = 0;
      for (const double* rec : records) sum += rec[sum_at];
      whole.sum = static_cast<float>(sum);
    }
    if (tempered_at >= 0) {
      // The stats pass's lse_t, over the whole row.
      const double sum_t =
          scaled_sum(kRangeMax, tempered_at, tempered ? inv_t : 1.0,
                     merged_max);
      whole.sum_exp_t = static_cast<float>(sum_t);
      whole.lse_t = tempered ? static_cast<float>(merged_max * inv_t +
                                                  std::log(sum_t))
                             : whole.max + whole.log_sum;
    }
    if (teacher_at >= 0) {
      // The maximum and its first id: the earlier range's on a tie.
      double max = lowest;
      int32_t argmax = 0;
      for (const double* rec : records) {
        if (rec[teacher_at] > max) {
          max = rec[teacher_at];
          argmax = static_cast<int32_t>(rec[teacher_at + 2]);
        }
      }
      const double scale = tempered ? inv_t : 1.0;
      const double sum = scaled_sum(teacher_at, teacher_at + 1, scale, max);
      whole.t_max = static_cast<float>(max);
      whole.t_sum_exp = static_cast<float>(sum);
      whole.t_lse = static_cast<float>(max * scale + std::log(sum));
      whole.t_argmax = argmax;
    }
    if (picks > 0) MergeLists(r, records, list_at, entry, lists);
  }
  if (picks > 0) {
    // Masked rows: no list, no rank, no terms (as the single-process pass).
    for (int64_t r = 0; r < n; ++r) {
      if (rows[r].mask != 0) continue;
      std::fill_n(s.top_ids.begin() + r * picks, picks, -1);
      std::fill_n(s.top_values.begin() + r * picks, picks, 0.0f);
      s.ranks[r] = -1;
    }
    carried = s.stream->CopyToDevice(lists.ids.data(), s.top_ids.data(),
                                     lists.ids.bytes());
    if (carried.ok()) {
      carried = s.stream->CopyToDevice(
          lists.values.data(), s.top_values.data(), lists.values.bytes());
    }
    if (carried.ok() && lists.metric_k > 0) {
      carried = s.stream->CopyToDevice(lists.ranks.data(), s.ranks.data(),
                                       lists.ranks.bytes());
    }
    if (carried.ok() && lists.metric_k > 0) {
      carried = s.stream->CopyToDevice(
          row_terms, s.top_terms.data(), s.top_terms.size() * sizeof(double));
    }
  }
  // The device reads them before the next chunk's stats come back here.
  if (carried.ok()) {
    carried = s.stream->CopyToDevice(stats, s.shard_stats.data(),
                                     n * sizeof(cuda::RowStats));
  }
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<ChunkTerms> CudaChunkLoss<T>::Terms() {
  State& s = *state_;
  unsigned long long error = 0;
  if (absl::Status ok =
          s.stream->CopyToHost(&error, s.error.data(), sizeof(error));
      !ok.ok()) {
    return ok;
  }
  ReleaseHostRows();
  ReleaseScratch();
  // (Vocab-parallel, each chunk's closing gather agreed on its errors.)
  if (error != cuda::kNoError) return CudaLossError(error);
  std::vector<double> totals(s.totals.size());
  DFLASH_RETURN_IF_ERROR(
      s.stream->CopyToHost(totals.data(), s.totals.data(), s.totals.bytes()));
  const int64_t k = s.params.options.block_size;
  ChunkTerms terms;
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  terms.field = totals[slot];
#include "losses/chunk_terms.inc"
  // The per-position totals follow the slots, [K] each, in the table's order.
  auto position_totals = totals.begin() + kTermSlots;
#define DFLASH_POSITION_TERM(field, slot, dict, key)        \
  terms.field.assign(position_totals, position_totals + k); \
  position_totals += k;
#include "losses/chunk_terms.inc"
  return terms;
}

template <typename T>
absl::Status CudaChunkLoss<T>::FinishOnDevice(
    const unsigned long long* rows_error, const double* block_terms,
    int64_t sequences, double* results, double* finish) {
  State& s = *state_;
  if (!s.rows.empty()) {
    return absl::FailedPreconditionError(
        "chunk loss: a device finish takes device-row chunks (RunDeviceRows); "
        "host-row chunks keep host metadata until Terms() reads the device");
  }
  cuda::LaunchDeviceFinish(
      s.params.loss, static_cast<int32_t>(s.params.options.block_size),
      s.totals.data(), s.error.data(), rows_error, block_terms, sequences,
      results, finish, s.stream->stream());
  ReleaseScratch();
  return s.stream->LaunchStatus("device finish");
}

template <typename T>
void CudaChunkLoss<T>::ReleaseScratch() {
  state_->scratch.Reset();
}

template <typename T>
void CudaChunkLoss<T>::ReleaseHostRows() {
  state_->rows.clear();
  state_->block_begins.clear();
}

template <typename T>
int64_t CudaChunkLoss<T>::host_row_chunks() const {
  return static_cast<int64_t>(state_->rows.size());
}

template class CudaChunkLoss<float>;
template class CudaChunkLoss<BFloat16>;

}  // namespace dflash
