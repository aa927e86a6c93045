#include "losses/cuda_chunk_loss.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/cuda_row_kernels.h"
#include "losses/loss_math.h"
#include "losses/row_error.h"

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

}  // namespace

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
  DFLASH_RETURN_IF_ERROR(Check(inputs, outputs, out_rows));
  const int64_t n = static_cast<int64_t>(inputs.rows.size());
  if (n == 0) return absl::OkStatus();
  const LossParams& loss = s.params.loss;
  const int64_t vocab = inputs.vocab;
  std::vector<cuda::Row> rows(n);
  for (int64_t r = 0; r < n; ++r) {
    const RowMeta& meta = inputs.rows[r];
    const double mask = EffectiveMask(loss, meta.target, meta.mask);
    if (!inputs.rows_checked && mask != 0 && meta.target != loss.ignore_index &&
        (meta.target < 0 || meta.target >= vocab)) {
      return RowError(r, absl::StrCat("target id ", meta.target,
                                      " is outside [0, ", vocab, ")"));
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
  return Launch(inputs, outputs, out_rows, record, n, std::move(rows),
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
  if (count == 0) return absl::OkStatus();
  return Launch(inputs, outputs, out_rows, record, count, {}, rows, {});
}

template <typename T>
absl::Status CudaChunkLoss<T>::Launch(const ChunkLossInputs<T>& inputs,
                                      const ChunkLossOutputs& outputs,
                                      const int64_t* out_rows, bool record,
                                      int64_t n,
                                      std::vector<cuda::Row> host_rows,
                                      const RowMeta* device_rows,
                                      std::vector<int32_t> block_begin) {
  State& s = *state_;
  const LossParams& loss = s.params.loss;
  const int64_t vocab = inputs.vocab;
  // The chunk's metadata and scratch: the run's, or a buffer of its own
  // freed in stream order when this call returns.
  TrackedBuffer<char> own;
  if (n <= s.scratch_rows && s.scratch.size() == 0) {
    DFLASH_ASSIGN_OR_RETURN(
        s.scratch, TrackedBuffer<char>::Create(s.stream->allocator(),
                                               ScratchBytes(s.scratch_rows)));
  }
  char* at = s.scratch.data();
  if (n > s.scratch_rows) {
    DFLASH_ASSIGN_OR_RETURN(
        own, TrackedBuffer<char>::Create(s.stream->allocator(),
                                         ScratchBytes(n)));
    at = own.data();
  }
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
    DFLASH_RETURN_IF_ERROR(s.stream->CopyToDevice(
        meta, s.rows.back().data(), n * sizeof(cuda::Row)));
    DFLASH_RETURN_IF_ERROR(s.stream->CopyToDevice(
        blocks, s.block_begins.back().data(),
        s.block_begins.back().size() * sizeof(int32_t)));
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
  args.metric_k = static_cast<int32_t>(
      std::min<int64_t>(s.params.options.metric_top_k, vocab));
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
  cuda::LaunchChunkLoss<T>(params, args, s.stream->stream());
  return s.stream->LaunchStatus("chunk loss kernels");
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
