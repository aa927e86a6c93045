#ifndef DFLASH_LOSSES_CUDA_CHUNK_LOSS_H_
#define DFLASH_LOSSES_CUDA_CHUNK_LOSS_H_

// CudaChunkLoss: ChunkLoss on a CUDA device, with the same families, terms
// and gradients, its logits and outputs in device memory, chunks queued on
// a CudaStream and the terms read back once (Terms()).

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/bfloat16.h"
#include "base/cuda_stream.h"
#include "base/tracking_allocator.h"
#include "losses/chunk_loss.h"
#include "losses/cuda_row_kernels.h"
#include "losses/loss_params.h"

namespace dflash {

// CpuChunkLoss on a CUDA device: the same families, options, terms, gradient
// and per-row outputs (chunk_loss.h), T = float or BFloat16 (computed in
// FP32, the gradient rounded to bfloat16 once). The logits, teacher logits,
// confidence logits and every output span are device memory; the rows'
// metadata is on the host, where it is validated as on the CPU (Run), or
// on the device, already checked (RunDeviceRows).
//
// Chunks are queued on the stream without waiting for the device; their
// terms accumulate on the device, and Terms() waits once and reads them.
// Errors only the device can see (a non-finite logit, teacher logit or
// confidence logit) are reported by Terms(), naming the row.
//
// Vocab-parallel (options.vocab_shard), as CpuChunkLoss: the logits are
// this process's range of classes; each chunk's stats over the range are
// read back (one wait per chunk), gathered and merged in rank order on the
// host, and written back as the whole rows', so that every process's terms
// and row outputs are bitwise the same and its gradient is its range's.
// Each chunk ends with a closing gather of its errors, so that an error one
// device found is an error of that chunk on every process; vocab-parallel,
// a row error names the chunk's row (as Run's own checks), not out_rows'. A pass that meets row sums over the whole
// vocabulary (the teacher's L1 of DSpark and of the teacher diagnostics,
// distillation's divergence, D-PARD's) runs in rounds, one gather each
// (ShardRounds), as the CPU loss does. Top-k lists (the caller's top_k,
// options.metric_top_k) are each range's k largest, merged on the host
// (ties to the lower global id). Domino's final and base logits' stats
// travel in one record. Refused with a shard, naming it: device rows (each
// chunk's handshake, on every process).
template <typename T>
class CudaChunkLoss {
 public:
  // `params` as ResolveLoss (loss_family.h) makes them. With max_rows > 0
  // the chunks' device scratch (their rows, per-row statistics and terms)
  // is allocated once, at the first chunk, for chunks of up to max_rows
  // rows, and kept until Terms() or ReleaseScratch(); a larger chunk, or
  // any with max_rows 0, allocates its own. Queues its work: no wait for
  // the device.
  static absl::StatusOr<std::unique_ptr<CudaChunkLoss>> Create(
      const LossParams& params, const ChunkLossOptions& options,
      CudaStream& stream, int64_t max_rows = 0);
  ~CudaChunkLoss();

  // One chunk. Per-row arrays (confidence logits and gradient, neg_log_q,
  // argmax, top-k) are indexed by out_rows[i] for the chunk's row i, a
  // device array, or by i when out_rows is null; so a caller's chunk of
  // compacted rows reads and writes its rows where they are. With
  // `record`, the chunk's terms join Terms(); a recomputation passes false.
  absl::Status Run(const ChunkLossInputs<T>& inputs,
                   const ChunkLossOutputs& outputs, const int64_t* out_rows,
                   bool record);

  // Run with the chunk's rows in device memory: `rows` [count], checked and
  // with their sequence shares (BuildCudaRows, heads/cuda_head.h), whole
  // blocks in order (row r of the chunk at block position r % K); no host
  // copy, no wait. inputs.rows is empty; the sizes are checked against
  // `count`.
  absl::Status RunDeviceRows(const RowMeta* rows, int64_t count,
                             const ChunkLossInputs<T>& inputs,
                             const ChunkLossOutputs& outputs,
                             const int64_t* out_rows, bool record);

  // Waits for the device; the terms of every recorded chunk. Releases the
  // chunks' scratch.
  absl::StatusOr<ChunkTerms> Terms();

  // head.device_results' finish instead of Terms(): queues
  // LaunchDeviceFinish (cuda_row_kernels.h) over the recorded chunks'
  // totals and error word, with the rows' error word (null: none) and
  // `block_terms` (kBlockTermsSize, losses/device_results.h), into
  // `results` (DeviceResultsSize(K)) and `finish` (kFinishSlots); `sequences`
  // as FinishTerms takes it. No wait, nothing read back; the chunks' scratch
  // is released in stream order. Only after device-row chunks
  // (RunDeviceRows), whose metadata the host does not keep.
  absl::Status FinishOnDevice(const unsigned long long* rows_error,
                              const double* block_terms, int64_t sequences,
                              double* results, double* finish);

  // Frees the chunks' scratch (in stream order) until the next chunk: a
  // split run's backward pass holds none after it.
  void ReleaseScratch();

  // Frees the host copies of the metadata of the chunks Run queued, which
  // their copies to the device read: call only once the stream has run
  // every chunk queued (after a Synchronize). Terms() frees them itself; a
  // split run's backward, whose chunks record nothing and read no terms,
  // calls this after its final wait, else they would pile up with every
  // backward.
  void ReleaseHostRows();
  // The chunks whose host metadata is held (Run's, until Terms() or
  // ReleaseHostRows()).
  int64_t host_row_chunks() const;

 private:
  struct State;
  explicit CudaChunkLoss(std::unique_ptr<State> state);
  // Run's work once its rows are prepared: `host_rows` (copied to the
  // device) or `device_rows` (converted there), `block_begin` for coupled
  // blocks (empty with device rows: uniform blocks). `valid` is the
  // chunk's checks: vocab-parallel, every process's meet in the chunk's
  // handshake (ChunkShardHandshake) after this one's scratch is ready.
  absl::Status Launch(const absl::Status& valid,
                      const ChunkLossInputs<T>& inputs,
                      const ChunkLossOutputs& outputs, const int64_t* out_rows,
                      bool record, int64_t n, std::vector<cuda::Row> host_rows,
                      const RowMeta* device_rows,
                      std::vector<int32_t> block_begin);
  // Vocab-parallel top-k lists (defined in the .cc).
  struct ShardLists;
  // Vocab-parallel: the stats pass's rows over this range (`stats`, n
  // rows; the teacher's too with `teacher`) and its top-k `lists`,
  // gathered with `carried` (this process's failure since the last
  // gather) or the device's error (ChunkDeviceError) and merged in rank
  // order into the whole rows' stats and lists, written back (the lists'
  // diagnostics into `row_terms`). Returns the gather's (the group's)
  // error; a failure after it goes into `carried`, for the next gather.
  absl::Status MergeShardStats(int64_t n, const int64_t* out_rows,
                               bool teacher, cuda::RowStats* stats,
                               ShardLists& lists, double* row_terms,
                               absl::Status& carried);
  // Domino's MergeShardStats: its final and base logits' stats, merged
  // into the whole rows' alike.
  absl::Status MergeDominoStats(int64_t n, const int64_t* out_rows,
                                cuda::RowStats* final_stats,
                                cuda::RowStats* base_stats,
                                absl::Status& carried);
  // Row r's top-k list merged from every range's `records` (picks at
  // list_at, `entry` values each), after its stats: ids, values, the
  // target's rank and the diagnostics' terms, on the host.
  void MergeLists(int64_t r, absl::Span<const double* const> records,
                  int list_at, int entry, const ShardLists& lists);
  // Vocab-parallel: launch(true) (a collecting round of a pass over n
  // rows) until no row meets a row sum the rounds have not merged, each
  // round's partials gathered and merged into `device` (cuda::RowSumState,
  // null: the pass meets none), then launch(false), the pass with every sum
  // known. Nothing is launched once `carried` holds a failure, which each
  // round's gather sends; returns a gather's (the group's) error.
  absl::Status ShardRounds(int64_t n, cuda::RowSumState* device,
                           const std::function<void(bool collect)>& launch,
                           absl::Status& carried);
  // Vocab-parallel: the device's error word as the chunk's error, its row
  // the chunk's (found among `out_rows`, device memory), or OK.
  absl::Status ChunkDeviceError(int64_t n, const int64_t* out_rows);
  // Vocab-parallel: the chunk's closing gather of `carried` or the
  // device's error, so that every process fails at the same chunk alike.
  absl::Status CloseShardChunk(int64_t n, const int64_t* out_rows,
                               const absl::Status& carried);
  // The checks of Run: limits, sizes (the chunk's share of per-row arrays
  // indexed by out_rows), with `inputs.rows` standing for the chunk.
  absl::Status Check(const ChunkLossInputs<T>& inputs,
                     const ChunkLossOutputs& outputs,
                     const int64_t* out_rows) const;
  std::unique_ptr<State> state_;
};

// The loss's error word (cuda::kNoError excepted) as Terms() reports it: a
// RowError about the batch row (out_rows) with the CPU's message.
absl::Status CudaLossError(unsigned long long code);

// The device's error codes hold rows and logits below 2^30: Run checks
// the chunk with it; a caller that copies inputs first checks before.
absl::Status CheckCudaChunkLimits(int64_t vocab, int64_t rows);

}  // namespace dflash

#endif  // DFLASH_LOSSES_CUDA_CHUNK_LOSS_H_
