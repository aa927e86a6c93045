#ifndef DFLASH_LOSSES_CUDA_ROW_KERNELS_H_
#define DFLASH_LOSSES_CUDA_ROW_KERNELS_H_

// The CUDA row kernels of every //losses family, the device twin of
// row_kernels.h + chunk_loss.cc, with the same formulas (loss_math.h).
// Plain types only: nvcc compiles the .cu, and //losses:cuda_chunk_loss
// (host C++) prepares these structs from LossParams and launches them.

#include <cstdint>
#include <cstring>

#include "base/host_device.h"
#include "losses/loss_params.h"
#include "losses/row_meta.h"
#include "losses/term_slots.h"

struct CUstream_st;

namespace dflash {
namespace cuda {

// The loss and the head's options, resolved on the host (loss_params.h).
// Vocab-parallel, the logits are classes [offset, offset + vocab) of
// `classes`; target ids and the ids a row pass sees are global.
struct KernelParams {
  LossParams loss;
  ChunkLossOptions options;
  int64_t vocab = 0;    // The logits' width.
  int64_t offset = 0;   // Their first class.
  int64_t classes = 0;  // The whole vocabulary (vocab without a shard).
};

// A chunk row, prepared on the host: mask is EffectiveMask (0 where the
// target is ignore_index, unless counted: the target is then negative, no
// class), weight is RowLossWeight (replaced per block for D-PACE), scale
// its DPaceRowScale.
struct Row {
  int32_t target = 0;
  int32_t position = 0;
  float mask = 0;
  double weight = 0;  // In double, as the CPU's.
  double scale = 1;
};

// What the stats pass leaves per row (of the transformed logits z').
struct RowStats {
  float max = 0;
  // logsumexp(z') = max + log_sum, kept apart: one float for both would
  // round away log_sum at large offsets.
  float log_sum = 0;
  float lse_t = 0;   // logsumexp(z' / T), distillation.
  float target = 0;  // z'[target].
  float sum = 0;     // sum(z'), label smoothing.
  float t_lse = 0;   // Teacher: logsumexp(t' / T) (T = 1 for DSpark).
  int32_t argmax = 0;
  int32_t t_argmax = 0;  // Teacher: first index of the maximum.
  // Vocab-parallel, the sums behind the logsumexps, which a range's record
  // carries (log_sum, lse_t and t_lse round them): sum of exp(z' - max),
  // of exp((z' - max) / T) (distillation), the teacher's maximum and its
  // sum at t_lse's temperature.
  float sum_exp = 0;
  float sum_exp_t = 0;
  float t_max = 0;
  float t_sum_exp = 0;
};

// Vocab-parallel, a row pass's row sums (Reduce, LogSumExp) over the whole
// vocabulary: the pass runs in rounds (ChunkArgs::collect), each meeting
// one more sum that no round has merged yet, whose partial over this
// range it leaves here; the host merges every process's and appends the
// result to `known`, so that the pass with every sum known writes its
// terms and gradient.
constexpr int kMaxRowSums = 4;
struct RowSumState {
  double known[kMaxRowSums][2] = {};  // Merged sums (host).
  int32_t known_count = 0;           // (host)
  int32_t pending = 0;  // 1: the last round met an unknown sum (device).
  int32_t kind = 0;     // Its RowSumKind (device).
  double partial[2] = {};  // Its partial over this range (device).
  // The row sums the last round's pass met in all, those past the first
  // unknown one included (device): a pass meets the same ones whatever
  // their values, so a row whose known sums reach it waits no more.
  int32_t met = 0;
};
enum RowSumKind : int32_t { kRowSum = 0, kRowSums = 1, kRowLogSumExp = 2 };

// The term slots (TermSlot, kTermSlots, PositionSlot, TotalsSize) are
// losses/term_slots.h's: one kTermSlots row per chunk row in row_terms,
// then the totals.

// Errors the kernels report through an atomic minimum of ErrorCode, so the
// first by kind, then row, then logit wins: a bad input before the
// non-finite gradients it causes in other rows of its block (as the CPU
// checks every row's logits first there), and the host names the row's
// first bad logit and its value, as the CPU's messages do. Rows and logits
// below 2^30 (CudaChunkLoss checks).
enum ErrorKind : int32_t {
  kLogitNotFinite = 0,
  kTeacherNotFinite = 1,
  kConfidenceNotFinite = 2,
  kGradientNotFinite = 3,
};
constexpr unsigned long long kNoError = ~0ull;
constexpr int64_t kMaxErrorIndex = int64_t{1} << 30;  // Rows and logits.

// kind << 62 | row << 32 | logit << 2 | the value's class (NaN, -NaN, inf,
// -inf; finite values, where the kind has none, read as NaN).
DFLASH_HOST_DEVICE inline unsigned long long ErrorCode(int64_t row,
                                                       ErrorKind kind,
                                                       int64_t logit,
                                                       float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  const unsigned negative = bits >> 31;
  const bool infinite = value == value && value - value != 0.0f;
  const unsigned value_class = infinite ? 2 + negative : negative;
  return (static_cast<unsigned long long>(kind) << 62) |
         (static_cast<unsigned long long>(row) << 32) |
         (static_cast<unsigned long long>(logit) << 2) | value_class;
}

// head.device_results: a device upstream that is not finite (times the
// loss denominator where it is d(objective)/d(loss_num)), which
// LaunchDeviceScales latches into the loss's error word: row field all
// ones, which no row reaches (CheckCudaChunkLimits keeps chunk rows below
// kMaxErrorIndex - 1), logit field 0 (kNoError's is all ones), the class
// of the upstream's value. SplitHeadRun::Backward refuses a host upstream
// that is not finite; this is that refusal, found on the device.
constexpr int64_t kUpstreamErrorRow = kMaxErrorIndex - 1;
DFLASH_HOST_DEVICE inline unsigned long long UpstreamErrorCode(
    double upstream) {
  return ErrorCode(kUpstreamErrorRow, kLogitNotFinite, 0,
                   static_cast<float>(upstream));
}
DFLASH_HOST_DEVICE inline bool IsUpstreamErrorCode(unsigned long long code) {
  return code >> 2 == UpstreamErrorCode(0) >> 2;
}

struct ReportedError {
  int64_t row;
  ErrorKind kind;
  int64_t logit;
  float value;  // NaN, -NaN, inf or -inf, as reported.
};
inline ReportedError DecodeErrorCode(unsigned long long code) {
  constexpr float kValues[4] = {__builtin_nanf(""), -__builtin_nanf(""),
                                __builtin_huge_valf(), -__builtin_huge_valf()};
  return ReportedError{static_cast<int64_t>((code >> 32) & 0x3fffffffull),
                       static_cast<ErrorKind>(code >> 62),
                       static_cast<int64_t>((code & 0xffffffffull) >> 2),
                       kValues[code & 3]};
}

// One chunk's device buffers. Per-row arrays marked "by out row" are indexed
// by out_rows[r] (the row's place in the caller's arrays), or r when
// out_rows is null. Optional buffers are null when not wanted.
template <typename T>
struct ChunkArgs {
  // Rows of the three logit tensors lie `stride` >= V values apart; a
  // padded row (stride past V rounded up to 16 bytes) gets 16-byte loads
  // even where V does not divide into them.
  T* logits = nullptr;         // [rows, stride]; overwritten with the gradient.
  const T* teacher = nullptr;  // [rows, stride], dspark and distillation.
  // [rows, stride], domino: the correction's logits apart, overwritten with
  // their gradient.
  T* correction = nullptr;
  int64_t stride = 0;
  int64_t rows = 0;
  const Row* meta = nullptr;             // [rows]
  // [blocks + 1], coupled families; or null, for blocks of block_size rows
  // each (block j: rows [j block_size, (j + 1) block_size), all rows of a
  // chunk of whole blocks).
  const int32_t* block_begin = nullptr;
  int32_t blocks = 0;
  int32_t block_size = 0;
  const int64_t* out_rows = nullptr;
  // By out row, DSpark: float, ConfidenceOf<T> for the float and BFloat16
  // logits the CUDA loss runs.
  const float* confidence = nullptr;
  double* confidence_grad = nullptr;  // By out row.
  double* neg_log_q = nullptr;        // By out row.
  int32_t* argmax = nullptr;          // By out row.
  int32_t* top_k = nullptr;           // [out row, k].
  int32_t k = 0;
  double* target_probability = nullptr;  // By out row.
  // The diagnostics' top-k width (0: none) and the target's rank by out row.
  int32_t metric_k = 0;
  int32_t* target_rank = nullptr;
  float* top_k_values = nullptr;  // [out row, k], beside top_k.
  // Vocab-parallel, with the teacher diagnostics: t' at each top_k id.
  float* top_k_teacher = nullptr;
  double* loss_weight = nullptr;  // By out row.
  // The teacher diagnostics (teacher logits for a loss that reads none):
  // each row's teacher acceptance, by out row.
  double* teacher_acceptance = nullptr;
  int32_t* base_argmax = nullptr;  // Domino: the base logits', by out row.
  int32_t* teacher_argmax = nullptr;  // The teacher logits', by out row.
  // Scratch, [rows] each (row_terms [rows, kTermSlots]).
  RowStats* stats = nullptr;
  double* weight = nullptr;
  double* ce_share = nullptr;  // D-PARD: its credit.
  double* accept = nullptr;    // D-PARD: each row's acceptance.
  double* row_terms = nullptr;
  double* totals = nullptr;  // TotalsSize(K); null: terms are not recorded.
  unsigned long long* error = nullptr;
  // Vocab-parallel Domino: [rows], the base logits' stats beside `stats`
  // (the final logits'), over the range from LaunchDominoStats, the whole
  // rows' for LaunchDominoPass.
  RowStats* base_stats = nullptr;
  // Vocab-parallel with row sums: [rows] (null otherwise), and whether
  // this launch only collects their partials (nothing written but them).
  RowSumState* row_sums = nullptr;
  bool collect = false;
};

// Queues the chunk's kernels on `stream`: stats, top-k, block weights,
// loss terms with the gradient written in place, and the terms' reduction
// into `totals` in a fixed order. T is float or BFloat16 (dflash::BFloat16).
template <typename T>
void LaunchChunkLoss(const KernelParams& params, const ChunkArgs<T>& args,
                     CUstream_st* stream);

// LaunchChunkLoss in parts, for a vocab-parallel chunk whose stats and row
// sums are merged across the processes in between: the stats pass over
// this range (args.stats); D-PARD's acceptance pass (AcceptancePass, a
// round of it with args.collect); the block weights (BlockWeights); the
// loss pass (LossPass, likewise) and the terms' reduction. They read
// args.stats as the whole rows'. Domino has its own (below); the top-k
// lists come from LaunchTopK.
template <typename T>
void LaunchChunkStats(const KernelParams& params, const ChunkArgs<T>& args,
                      CUstream_st* stream);
// Domino vocab-parallel: its final and base logits' stats over this range
// (args.stats, args.base_stats), then, with them merged into the whole
// rows', its pass and the terms' reduction.
template <typename T>
void LaunchDominoStats(const KernelParams& params, const ChunkArgs<T>& args,
                       CUstream_st* stream);
template <typename T>
void LaunchDominoPass(const KernelParams& params, const ChunkArgs<T>& args,
                      CUstream_st* stream);
// The top-k pass alone (after the stats pass): args.k largest z' of each
// row into args.top_k and args.top_k_values (and top_k_teacher), local ids,
// -1 past the row's classes; the diagnostics' slots as args.metric_k says.
template <typename T>
void LaunchTopK(const KernelParams& params, const ChunkArgs<T>& args,
                CUstream_st* stream);
// dst[out_rows[r] * dst_width + j] = src[r * src_width + j] for r < rows,
// j < width (out_rows null: r), queued. V is int32_t or float.
template <typename V>
void LaunchScatterRows(const V* src, int64_t src_width, V* dst,
                       int64_t dst_width, int64_t width,
                       const int64_t* out_rows, int64_t rows,
                       CUstream_st* stream);
template <typename T>
void LaunchAcceptancePass(const KernelParams& params, const ChunkArgs<T>& args,
                          CUstream_st* stream);
template <typename T>
void LaunchBlockWeights(const KernelParams& params, const ChunkArgs<T>& args,
                        CUstream_st* stream);
template <typename T>
void LaunchLossPass(const KernelParams& params, const ChunkArgs<T>& args,
                    CUstream_st* stream);

// out[i] for rows[i], i < count, as CudaChunkLoss prepares a host row:
// the effective mask (target 0 where it is 0), RowLossWeight and
// DPaceRowScale (loss_math.h). The rows are checked (BuildCudaRows).
void LaunchRowsFromMeta(const LossParams& loss, const RowMeta* rows,
                        int64_t count, Row* out, CUstream_st* stream);

// *error = kNoError, queued (no host memory to keep alive).
void LaunchResetError(unsigned long long* error, CUstream_st* stream);

// data[i] *= scale for i < count: the gradients' final scale, or
// *device_scale instead where given (head.device_results: the scale never
// reaches the host). T is float or BFloat16.
template <typename T>
void LaunchScale(T* data, int64_t count, double scale, CUstream_st* stream,
                 const double* device_scale = nullptr);

// The batch-level LK lambda's deferred factor: data[rows[i], :] *=
// scale * LkDeferredFactor(kl_weight, q[rows[i]]) for i < count, rows of
// `width` values; with `device_finish` (DeviceFinishSlot,
// losses/device_results.h) kl_weight and scale are read there instead.
// T is float or BFloat16.
template <typename T>
void LaunchScaleRowsByLkFactor(T* data, int64_t width, const int64_t* rows,
                               int64_t count, const double* q, double kl_weight,
                               double scale, CUstream_st* stream,
                               const double* device_finish = nullptr);

// head.device_results' finish, one thread, queued: reads the chunks'
// `totals` (TotalsSize(block_size)), the loss's and the rows' error words
// (rows_error null: host rows) and `block_terms` (kBlockTermsSize: the
// accepted lengths and weighted sequences), and writes `results`
// (DeviceResultsSize(block_size), losses/device_results.h) by FinishScalars
// (loss_math.h), the formula FinishTerms runs on the host, and `finish`
// (kFinishSlots). A set error word poisons both with NaN.
void LaunchDeviceFinish(const LossParams& loss, int32_t block_size,
                        const double* totals,
                        const unsigned long long* loss_error,
                        const unsigned long long* rows_error,
                        const double* block_terms, int64_t sequences,
                        double* results, double* finish, CUstream_st* stream);

// A head's per-row outputs (HeadRowOutputs), device memory; null or
// count 0 where not asked.
struct RowOutputs {
  double* neg_log_q = nullptr;
  int64_t neg_log_q_count = 0;
  float* top_k_values = nullptr;
  int64_t top_k_values_count = 0;
  double* loss_weight = nullptr;
  int64_t loss_weight_count = 0;
  int32_t* argmax = nullptr;
  int64_t argmax_count = 0;
  int32_t* top_k = nullptr;
  int64_t top_k_count = 0;
  int32_t* teacher_argmax = nullptr;
  int64_t teacher_argmax_count = 0;
};

// head.device_results, queued after LaunchDeviceFinish: where a status word
// of `results` is set, the row outputs of that failed run read NaN (values)
// and -1 (ids), as its terms read NaN, instead of numbers the synchronous
// run would never have returned.
void LaunchPoisonRowOutputs(const double* results, const RowOutputs& out,
                            CUstream_st* stream);

// finish[kFinishScaled*] = upstream x *device_upstream (a float or a
// double; 1 where null; times finish[kFinishDenominator] with
// times_denominator) x the finished scale, queued. Where that upstream is
// not finite and `results`' status words (DeviceResultsSize(block_size)
// doubles) are clear, UpstreamErrorCode goes into its loss word and NaN
// into its other slots and every finish slot, as DeviceFinish's poisoning
// does (a later Backward of the run scales by NaN too).
void LaunchDeviceScales(double* finish, double* results, int32_t block_size,
                        double upstream, const void* device_upstream,
                        bool upstream_float, bool times_denominator,
                        CUstream_st* stream);

}  // namespace cuda
}  // namespace dflash

#endif  // DFLASH_LOSSES_CUDA_ROW_KERNELS_H_
