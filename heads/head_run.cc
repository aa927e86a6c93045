#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/tensor.h"
#include "checkpoint/checkpoint_policy.h"
#include "heads/config/head_facts.h"
#include "heads/gradient_filter.h"
#include "heads/head_backend.h"
#include "heads/head_plan.h"
#include "heads/projection.h"
#include "losses/device_results.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/row_error.h"
#include "losses/vocab_shard.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "proto/config.h"

namespace dflash {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

absl::Status SizeError(absl::string_view name, size_t size, int64_t expected,
                       absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      name, ": must hold ", expected, " values (", why, "), got ", size));
}

}  // namespace

// One forward and backward through the head on a backend; see RunHead.
// RunHeadOn runs both passes in one call (Run); SplitHeadRun runs them
// apart (Forward, then Backward once or more), through the same code.
template <typename T>
class HeadRun {
 public:
  // `gradients`: null for a split run (given at each Backward).
  HeadRun(const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
          const HeadGradients<T>* gradients, const HeadRowOutputs& row_outputs,
          HeadBackend<T>& backend, bool forward_only, const VocabShard* shard)
      : config_(config),
        head_(config.head()),
        inputs_(WithSequenceShares(config, inputs)),
        gradients_(gradients),
        row_outputs_(row_outputs),
        backend_(backend),
        allocator_(backend.allocator()),
        vocab_(head_.vocab_size()),
        classes_(shard != nullptr ? shard->vocab : vocab_),
        plan_vocab_(vocab_),
        hidden_(head_.hidden_size()),
        block_size_(config.layout().block_size()),
        params_(LossParamsOf(config.loss())),
        rank_(head_.correction_rank()),
        teacher_(ProjectsTeacher(config)),
        confidence_(LossTraitsOf(params_).needs_confidence),
        split_(SplitsCorrection(config)),
        forward_only_(forward_only),
        deferred_(gradients == nullptr),
        device_results_(head_.device_results()) {}

  absl::Status Validate() const { return CheckSizes(gradients_, true); }
  // A split run's gradients, before its Backward.
  absl::Status ValidateGradients(const HeadGradients<T>& gradients) const {
    return CheckSizes(&gradients, false);
  }
  // Vocab-parallel: one gather of every process's validation and shape
  // (they must agree; the chunk plan is made for the widest range, so that
  // every process runs the same chunks).
  absl::Status ShardHandshake(const VocabShard& shard, const absl::Status& valid,
                              const HeadOptions& options);
  absl::StatusOr<HeadResult> Run(const HeadOptions& options);
  // The forward pass: every chunk's loss (and, FUSED, its gradient
  // products), the terms finished; result_ holds the loss and the forward
  // stats.
  absl::Status Forward(const HeadOptions& options);
  // A split run's backward pass into `gradients`, scaled by `upstream`;
  // repeatable (frees only what it recomputed).
  absl::StatusOr<HeadStats> Backward(double upstream,
                                     const DeviceUpstream* device_upstream,
                                     const HeadGradients<T>& gradients,
                                     const std::atomic<bool>* interrupt);
  const HeadResult& result() const { return result_; }
  // head.device_results: the terms are finished on the device.
  bool device_results() const { return device_results_; }
  // The forward pass's stats (GEMMs, checkpoint, peak bytes so far).
  void FillForwardStats(HeadStats& stats) const {
    FillStats(Gemms(), base_bytes_, stats);
  }

 private:
  // The sizes of the inputs (with `inputs`) and of `gradients` (unless
  // null) against the config's.
  absl::Status CheckSizes(const HeadGradients<T>* gradients,
                          bool inputs) const;
  absl::Status CheckRows() const;
  // Every chunk's gradient products in reverse, the scale folded first
  // where the backend folds it and the rows did not decide it at Start;
  // frees each chunk's intermediates (`release_kept`) or only what it
  // recomputed.
  absl::Status BackwardPass(double upstream, bool release_kept,
                            const std::function<void()>& report);
  // The GEMMs of both projections so far.
  GemmCount Gemms() const;
  // The stats every pass reports, from `gemms` and the allocator's peak
  // above `base_bytes`.
  void FillStats(const GemmCount& gemms, int64_t base_bytes,
                 HeadStats& stats) const;
  // The caller's inputs or, for D-PACE's SEQUENCE_BALANCED denominator, a
  // copy whose rows carry their sequence shares (SetSequenceShares), which
  // the backends' chunk losses read. Sequences of layout.num_anchors blocks
  // (all rows with none).
  const HeadInputs<T>& WithSequenceShares(const v1::ObjectiveConfig& config,
                                          const HeadInputs<T>& inputs) {
    if (inputs.rows.empty()) {
      // Device rows (BuildCudaRows made their shares); a copy, which
      // HostRows completes with the rows read back.
      shared_inputs_ = inputs;
      return shared_inputs_;
    }
    const LossParams params = LossParamsOf(config.loss());
    const int64_t block = config.layout().block_size();
    if (!params.sequence_balanced || block < 1) return inputs;
    const int64_t anchors = config.layout().num_anchors();
    const int64_t rows = static_cast<int64_t>(inputs.rows.size());
    shared_rows_.assign(inputs.rows.begin(), inputs.rows.end());
    SetSequenceShares(params, block, anchors > 0 ? anchors * block : rows,
                      absl::MakeSpan(shared_rows_));
    shared_inputs_ = inputs;
    shared_inputs_.rows = shared_rows_;
    return shared_inputs_;
  }
  // Device rows read back into inputs_.rows (one wait for the device), the
  // build's first bad element reported first: at Plan under COMPACT, after
  // the last forward chunk under ALL_ROWS.
  absl::Status HostRows() {
    absl::StatusOr<std::vector<RowMeta>> rows =
        backend_.ReadRows(inputs_.device_rows);
    if (!rows.ok()) return NameBatchRowError(rows.status(), config_.layout());
    shared_rows_ = *std::move(rows);
    shared_inputs_.rows = shared_rows_;
    return absl::OkStatus();
  }
  bool AllRows() const {
    return head_.row_selection() == v1::HeadConfig::ALL_ROWS;
  }
  // The batch's loss, after its last chunk: SEQUENCE_BALANCED D-PACE's
  // loss_den is the rows' WeightedSequences, not the chunks' sum of w.
  FinishedLoss Finish(ChunkTerms& terms, int64_t sequences) const {
    if (params_.sequence_balanced) {
      terms.loss_den = WeightedSequences(params_, inputs_.rows);
    }
    return FinishTerms(params_, terms, sequences);
  }
  bool Fused() const { return head_.mode() == v1::HeadConfig::FUSED; }
  int64_t Begin(int64_t c) const { return chunk_begin_[c]; }
  int64_t Rows(int64_t c) const {
    return chunk_begin_[c + 1] - chunk_begin_[c];
  }
  // `width` values for each row of the largest chunk, from `buffer`, which
  // is allocated on first use and kept: one allocation per run instead of
  // one per chunk (fresh pages cost ~5% of a chunk's GEMM in page faults).
  absl::StatusOr<T*> Workspace(TrackedBuffer<T>& buffer, int64_t width) {
    const int64_t size = max_chunk_rows_ * width;
    if (buffer.size() < size) {
      buffer.Reset();
      DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<T> created,
                              TrackedBuffer<T>::Create(allocator_, size));
      buffer = std::move(created);
    }
    return buffer.data();
  }
  TensorView View(T* data, int64_t m) const {
    return TensorView(data, DTypeOf<T>::value, {m, stride_}, backend_.device());
  }
  // Rows of logits (stride_ values each) a chunk of m rows keeps: its
  // logits, and its correction's after them when the loss reads them apart.
  int64_t LogitRows(int64_t m) const { return split_ ? 2 * m : m; }
  // The chunk's logits [m, stride_] from its rows, the correction added or,
  // when split, written to logits + m * stride_.
  absl::Status ProjectChunk(int64_t c, T* logits);
  absl::Status Plan();
  absl::Status ForwardChunk(int64_t c);
  absl::Status BackwardChunk(int64_t c, bool release_kept);
  // The chunk's teacher logits into `out` [m, V].
  absl::Status TeacherLogits(int64_t c, T* out);
  // The chunk's loss over `logits` (overwritten with its gradient); the
  // projection's error first where both failed.
  absl::Status Loss(int64_t c, T* logits, const T* teacher, bool record);
  // The chunk's logits gradient into `out` [m, V], as forward made it.
  absl::Status RecomputeLogitsGradient(int64_t c, const TensorView& out);
  // grad_hidden (and grad_W) of the chunk from its logits gradient.
  absl::Status ProjectionGradients(int64_t c, const T* grad_logits);
  // grad = grad_logits @ W over the vocabulary tiles head.gradient_filter
  // keeps.
  void FilteredInputGradient(const T* grad_logits, int64_t m, T* grad);
  // Cancelled once the caller's interrupt is set (HeadOptions::interrupt).
  absl::Status CheckInterrupt() const {
    if (interrupt_ == nullptr || !interrupt_->load(std::memory_order_relaxed)) {
      return absl::OkStatus();
    }
    return absl::CancelledError("the head run was interrupted");
  }

  // Before inputs_, which may refer to them (WithSequenceShares).
  std::vector<RowMeta> shared_rows_;
  HeadInputs<T> shared_inputs_;
  const v1::ObjectiveConfig& config_;
  const v1::HeadConfig& head_;
  const HeadInputs<T>& inputs_;
  // The caller's gradients; a split run's from its Backward (null before).
  const HeadGradients<T>* gradients_;
  const HeadRowOutputs& row_outputs_;
  HeadBackend<T>& backend_;
  TrackingAllocator& allocator_;
  // This process's classes (head.vocab_size) and the whole vocabulary's;
  // the width the chunk plan is made for (vocab-parallel: the widest
  // process's).
  const int64_t vocab_, classes_;
  int64_t plan_vocab_;
  const int64_t hidden_, block_size_;
  // Values from one logits row to the next: the projection's (padded on
  // CUDA), known once the backend has started.
  int64_t stride_ = 0;
  const LossParams params_;
  const int64_t rank_;
  const bool teacher_, confidence_, split_;
  // HeadOptions::forward_only: the forward pass alone, no gradient.
  const bool forward_only_;
  // A split run: the gradients come at Backward.
  const bool deferred_;
  // head.device_results: nothing is read from the device (the terms are
  // finished there, into HeadOptions::device_results).
  const bool device_results_;
  // What the backend's forward pass gets in a forward-only or split run:
  // no gradient.
  HeadGradients<T> no_gradients_;
  // A split run's gradients of its current Backward.
  HeadGradients<T> backward_gradients_;
  // After Forward: the sequences the loss counts, the scale folded at Start
  // (where the rows decide it), the finished loss and the result.
  int64_t sequences_ = 1;
  std::optional<double> known_scale_;
  FinishedLoss finished_;
  HeadResult result_;
  int64_t base_bytes_ = 0;

  const std::atomic<bool>* interrupt_ = nullptr;  // From Run's options.
  std::unique_ptr<CheckpointContext> context_;
  ChunkPlan plan_;
  std::vector<int64_t> active_;       // Rows with weight, ascending.
  std::vector<int64_t> chunk_begin_;  // Chunk c: active_[begin[c], begin[c+1]).
  int64_t max_chunk_rows_ = 0;
  // Per-run workspaces: forward logits and teacher logits (released before
  // backward), gathered rows and their gradient, and the correction's.
  TrackedBuffer<T> logits_ws_, teacher_ws_, rows_ws_, grad_ws_, z_ws_,
      z_grad_ws_;
  int64_t filter_tiles_ = 0, filter_skipped_ = 0;
};

template <typename T>
absl::Status HeadRun<T>::CheckRows() const {
  const int64_t rows = RowCount(inputs_);
  if (rows == 0 || rows % block_size_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.rows: must be a positive number of whole blocks of "
        "layout.block_size = ",
        block_size_, ", got ", rows, " rows"));
  }
  if (inputs_.rows.empty()) {
    // Device rows: BuildCudaRows checked every element (its error word is
    // read with the rows, HostRows).
    if (backend_.device() != Device::kCuda) {
      return absl::InvalidArgumentError(
          "inputs.device_rows: a CPU head reads its rows on the host "
          "(inputs.rows)");
    }
    if (inputs_.device_rows.rows == nullptr ||
        inputs_.device_rows.error == nullptr) {
      return absl::InvalidArgumentError(
          "inputs.device_rows: rows and error must be device memory, got "
          "null");
    }
  }
  const int64_t ignore = config_.loss().cross_entropy().ignore_index();
  for (int64_t r = 0; r < static_cast<int64_t>(inputs_.rows.size()); ++r) {
    const RowMeta& meta = inputs_.rows[r];
    if (meta.position < 0 || meta.position >= block_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs.rows[", r, "].position: must lie in [0, ",
                       block_size_, "), got ", meta.position));
    }
    if (!(meta.mask >= 0) || !std::isfinite(meta.mask)) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs.rows[", r,
                       "].mask: must be finite and >= 0, got ", meta.mask));
    }
    if (meta.mask > 0 && meta.target != ignore &&
        (meta.target < 0 || meta.target >= classes_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs.rows[", r, "].target: must lie in [0, ",
                       classes_, "), got ", meta.target));
    }
  }
  // D-PARD's loss is per sequence: rows / (num_anchors * block_size); so is
  // SEQUENCE_BALANCED D-PACE's denominator.
  const int64_t sequence_rows = config_.layout().num_anchors() * block_size_;
  if ((params_.dpard || params_.sequence_balanced) && sequence_rows > 0 &&
      rows % sequence_rows != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.rows: ",
        params_.dpard ? "loss.dspark objective DPARD"
                      : "loss.dpace denominator SEQUENCE_BALANCED",
        " counts sequences of layout.num_anchors x layout.block_size = ",
        sequence_rows, " rows, got ", rows, " rows"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::CheckSizes(const HeadGradients<T>* gradients,
                                    bool inputs) const {
  const int64_t rows = RowCount(inputs_);
  if (inputs) DFLASH_RETURN_IF_ERROR(CheckRows());
  // Gradients unchecked (a split run's forward pass) are none here.
  const HeadGradients<T> none;
  const HeadGradients<T>& g = gradients != nullptr ? *gradients : none;
  const bool checked = gradients != nullptr && !forward_only_;
  struct Size {
    bool gradient;
    const char* name;
    size_t size;
    int64_t expected;
    bool required;
    const char* why;
  };
  const bool trainable = head_.trainable();
  const Size sizes[] = {
      {false, "inputs.hidden", inputs_.hidden.size(), rows * hidden_, true,
       "rows x head.hidden_size"},
      {false, "inputs.teacher_hidden", inputs_.teacher_hidden.size(), rows * hidden_,
       teacher_,
       "rows x head.hidden_size, for the loss's teacher or "
       "head.teacher_diagnostics"},
      {false, "inputs.confidence_logits", inputs_.confidence_logits.size(), rows,
       confidence_, "one per row, for loss.dspark.confidence_weight"},
      {false, "inputs.weight", inputs_.weight.size(), vocab_ * hidden_, true,
       "head.vocab_size x head.hidden_size"},
      {false, "inputs.bias", inputs_.bias.size(), vocab_, head_.bias(),
       "head.vocab_size, as head.bias is set"},
      {true, "gradients.hidden", g.hidden.size(), rows * hidden_,
       checked, "rows x head.hidden_size"},
      {true, "gradients.weight", g.weight.size(), vocab_ * hidden_,
       trainable && checked,
       "head.vocab_size x head.hidden_size, as head.trainable"},
      {true, "gradients.bias", g.bias.size(), vocab_,
       trainable && head_.bias() && checked,
       "head.vocab_size, as the bias is trained"},
      {true, "gradients.confidence", g.confidence.size(), rows,
       confidence_ && checked,
       "one per row, for loss.dspark.confidence_weight"},
      {false, "inputs.correction_inputs", inputs_.correction_inputs.size(),
       rows * rank_, true, "rows x head.correction_rank"},
      {false, "inputs.correction_weight", inputs_.correction_weight.size(),
       vocab_ * rank_, true, "head.vocab_size x head.correction_rank"},
      {true, "gradients.correction_inputs", g.correction_inputs.size(),
       rows * rank_, checked, "rows x head.correction_rank"},
      {true, "gradients.correction_weight", g.correction_weight.size(),
       vocab_ * rank_, checked,
       "head.vocab_size x head.correction_rank"},
  };
  for (const Size& s : sizes) {
    if (!s.gradient && !inputs) continue;
    if (s.required && static_cast<int64_t>(s.size) != s.expected) {
      return SizeError(s.name, s.size, s.expected, s.why);
    }
  }
  // An unused per-row confidence buffer is either absent or whole: a backend
  // may write every row of it.
  if (gradients != nullptr && !confidence_ && !g.confidence.empty() &&
      static_cast<int64_t>(g.confidence.size()) != rows) {
    return SizeError("gradients.confidence", g.confidence.size(), rows,
                     "none, or one per row");
  }
  if (!inputs) return absl::OkStatus();
  if (!head_.bias() && !inputs_.bias.empty()) {
    return SizeError("inputs.bias", inputs_.bias.size(), 0,
                     "none, as head.bias is not set");
  }
  for (const auto& [name, size] :
       {std::pair<const char*, size_t>{"row_outputs.neg_log_q",
                                       row_outputs_.neg_log_q.size()},
        {"row_outputs.argmax", row_outputs_.argmax.size()},
        {"row_outputs.base_argmax", row_outputs_.base_argmax.size()},
        {"row_outputs.teacher_argmax", row_outputs_.teacher_argmax.size()},
        {"row_outputs.loss_weight", row_outputs_.loss_weight.size()}}) {
    if (size != 0 && static_cast<int64_t>(size) != rows) {
      return SizeError(name, size, rows, "one per row");
    }
  }
  if (!row_outputs_.top_k.empty() &&
      static_cast<int64_t>(row_outputs_.top_k.size()) !=
          rows * row_outputs_.k) {
    return SizeError("row_outputs.top_k", row_outputs_.top_k.size(),
                     rows * row_outputs_.k, "rows x k");
  }
  if (!row_outputs_.top_k_values.empty() &&
      (row_outputs_.top_k.empty() ||
       row_outputs_.top_k_values.size() != row_outputs_.top_k.size())) {
    return SizeError("row_outputs.top_k_values",
                     row_outputs_.top_k_values.size(),
                     static_cast<int64_t>(row_outputs_.top_k.size()),
                     "rows x k, beside row_outputs.top_k");
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::Plan() {
  v1::ObjectiveConfig widest;
  if (plan_vocab_ != vocab_) {
    widest = config_;
    widest.mutable_head()->set_vocab_size(plan_vocab_);
  }
  if (inputs_.rows.empty() && !AllRows()) DFLASH_RETURN_IF_ERROR(HostRows());
  const v1::ObjectiveConfig& planned = plan_vocab_ != vocab_ ? widest : config_;
  DFLASH_ASSIGN_OR_RETURN(
      HeadPlan plan,
      AllRows() ? PlanAllRows(planned, RowCount(inputs_),
                              static_cast<int64_t>(sizeof(T)))
                : PlanHead(planned, inputs_.rows,
                           static_cast<int64_t>(sizeof(T))));
  plan_ = std::move(plan.chunks);
  active_ = std::move(plan.active);
  chunk_begin_ = std::move(plan.chunk_begin);
  max_chunk_rows_ = plan.max_chunk_rows;
  // A forward-only run keeps nothing for a backward pass.
  if (Fused() || forward_only_) return absl::OkStatus();
  if (plan_vocab_ != vocab_ || classes_ != vocab_) {
    // Vocab-parallel: a chunk recomputed in backward runs its loss's
    // exchange again, so every process must keep the same chunks. A byte
    // budget decides by the logits' width, which differs: it must keep
    // every chunk's intermediates at the widest process's.
    if (plan.policy.has_memory_budget_bytes()) {
      const int64_t buffers = LogitRows(1) + (teacher_ ? 1 : 0);
      const int64_t all = static_cast<int64_t>(active_.size()) * buffers *
                          plan_vocab_ * static_cast<int64_t>(sizeof(T));
      if (plan.policy.memory_budget_bytes() < all) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint.memory_budget_bytes: a vocab-parallel head's budget "
            "must keep every chunk's intermediates (",
            all,
            " bytes at the widest process's logits), else its processes "
            "could keep different chunks and their exchanges would not pair; "
            "got ",
            plan.policy.memory_budget_bytes()));
      }
    }
  }
  DFLASH_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointContext> context,
      CheckpointContext::Create(CheckpointOptionsFromPolicy(plan.policy),
                                allocator_));
  context_ = std::move(context);
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::ProjectChunk(int64_t c, T* logits) {
  const int64_t m = Rows(c);
  {
    DFLASH_ASSIGN_OR_RETURN(T * x, Workspace(rows_ws_, hidden_));
    DFLASH_RETURN_IF_ERROR(
        backend_.GatherRows(inputs_.hidden.data(), hidden_, Begin(c), m, x));
    backend_.projection().Forward(x, m, logits);
  }
  if (rank_ == 0) return absl::OkStatus();
  DFLASH_ASSIGN_OR_RETURN(T * z, Workspace(z_ws_, rank_));
  DFLASH_RETURN_IF_ERROR(backend_.GatherRows(inputs_.correction_inputs.data(),
                                             rank_, Begin(c), m, z));
  if (split_) {
    backend_.correction()->Forward(z, m, logits + m * stride_);
  } else {
    backend_.correction()->AddForward(z, m, logits);
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::TeacherLogits(int64_t c, T* out) {
  DFLASH_ASSIGN_OR_RETURN(T * x, Workspace(rows_ws_, hidden_));
  DFLASH_RETURN_IF_ERROR(backend_.GatherRows(inputs_.teacher_hidden.data(),
                                             hidden_, Begin(c), Rows(c), x));
  backend_.projection().Forward(x, Rows(c), out);
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::ProjectionGradients(int64_t c, const T* grad_logits) {
  const int64_t m = Rows(c);
  DFLASH_RETURN_IF_ERROR(CheckInterrupt());
  DFLASH_ASSIGN_OR_RETURN(T * grad, Workspace(grad_ws_, hidden_));
  if (head_.gradient_filter() > 0) {
    FilteredInputGradient(grad_logits, m, grad);
  } else {
    backend_.projection().InputGradient(grad_logits, m, grad);
  }
  DFLASH_RETURN_IF_ERROR(backend_.ScatterRows(grad, hidden_, Begin(c), m,
                                              gradients_->hidden.data()));
  if (head_.trainable()) {
    DFLASH_RETURN_IF_ERROR(CheckInterrupt());
    DFLASH_ASSIGN_OR_RETURN(T * x, Workspace(rows_ws_, hidden_));
    DFLASH_RETURN_IF_ERROR(
        backend_.GatherRows(inputs_.hidden.data(), hidden_, Begin(c), m, x));
    backend_.projection().AccumulateWeightGradient(
        grad_logits, x, m, gradients_->weight.data(),
        gradients_->bias.empty() ? nullptr : gradients_->bias.data());
  }
  if (rank_ == 0) return absl::OkStatus();
  // The correction's logits gradient: the same as the logits' unless split.
  const T* grad_correction = split_ ? grad_logits + m * stride_ : grad_logits;
  DFLASH_ASSIGN_OR_RETURN(T * dz, Workspace(z_grad_ws_, rank_));
  backend_.correction()->InputGradient(grad_correction, m, dz);
  DFLASH_RETURN_IF_ERROR(backend_.ScatterRows(
      dz, rank_, Begin(c), m, gradients_->correction_inputs.data()));
  DFLASH_ASSIGN_OR_RETURN(T * z, Workspace(z_ws_, rank_));
  DFLASH_RETURN_IF_ERROR(backend_.GatherRows(inputs_.correction_inputs.data(),
                                             rank_, Begin(c), m, z));
  backend_.correction()->AccumulateWeightGradient(
      grad_correction, z, m, gradients_->correction_weight.data(), nullptr);
  return absl::OkStatus();
}

template <typename T>
void HeadRun<T>::FilteredInputGradient(const T* grad_logits, int64_t m,
                                       T* grad) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    // The filter is CPU only (heads/config/head_config.cc); BF16 heads run
    // on CUDA.
    backend_.projection().InputGradient(grad_logits, m, grad);
  } else {
    int64_t skipped = 0;
    const std::vector<VocabRange> kept =
        KeptVocabRanges(grad_logits, m, vocab_, head_.gradient_filter(),
                        kGradientFilterTile, skipped, backend_.threads());
    filter_tiles_ += (vocab_ + kGradientFilterTile - 1) / kGradientFilterTile;
    filter_skipped_ += skipped;
    // Host memory: the filter runs on the CPU head only.
    if (kept.empty()) std::fill_n(grad, m * hidden_, T(0));
    for (size_t i = 0; i < kept.size(); ++i) {
      backend_.projection().InputGradientColumns(
          grad_logits, m, kept[i].begin, kept[i].end, /*accumulate=*/i > 0,
          grad);
    }
  }
}

template <typename T>
absl::Status HeadRun<T>::RecomputeLogitsGradient(int64_t c,
                                                 const TensorView& out) {
  DFLASH_RETURN_IF_ERROR(ProjectChunk(c, out.data_as<T>()));
  const T* teacher = nullptr;
  if (teacher_) {
    // Offered before the logits gradient, so kept or already recomputed.
    DFLASH_ASSIGN_OR_RETURN(TensorView kept,
                            context_->Fetch(c, kTeacherLogitsTag));
    teacher = kept.data_as<T>();
  }
  return Loss(c, out.data_as<T>(), teacher, /*record=*/false);
}

template <typename T>
absl::Status HeadRun<T>::Loss(int64_t c, T* logits, const T* teacher,
                              bool record) {
  const absl::Status loss =
      backend_.ChunkLoss(c, Begin(c), Rows(c), logits, teacher,
                         split_ ? logits + Rows(c) * stride_ : nullptr, record);
  if (loss.ok()) return loss;
  // A queued product that failed (CUDA) left the logits the loss rejected:
  // its error is the cause.
  DFLASH_RETURN_IF_ERROR(backend_.projection().status());
  return loss;
}

template <typename T>
absl::Status HeadRun<T>::ForwardChunk(int64_t c) {
  const int64_t m = Rows(c);
  if (m == 0) return absl::OkStatus();
  DFLASH_ASSIGN_OR_RETURN(T * logits,
                          Workspace(logits_ws_, LogitRows(1) * stride_));
  DFLASH_RETURN_IF_ERROR(CheckInterrupt());
  DFLASH_RETURN_IF_ERROR(ProjectChunk(c, logits));
  T* teacher = nullptr;
  if (teacher_) {
    DFLASH_RETURN_IF_ERROR(CheckInterrupt());
    DFLASH_ASSIGN_OR_RETURN(T * buffer, Workspace(teacher_ws_, stride_));
    teacher = buffer;
    DFLASH_RETURN_IF_ERROR(TeacherLogits(c, teacher));
    if (context_ != nullptr) {
      absl::StatusOr<bool> kept =
          context_->Offer(c, TeacherLogitsInfo(head_, m), View(teacher, m),
                          [this, c](const TensorView& out) {
                            return TeacherLogits(c, out.data_as<T>());
                          });
      if (!kept.ok()) return kept.status();
    }
  }
  DFLASH_RETURN_IF_ERROR(Loss(c, logits, teacher, /*record=*/true));
  if (forward_only_) return absl::OkStatus();
  if (Fused()) return ProjectionGradients(c, logits);
  DFLASH_ASSIGN_OR_RETURN(
      const bool kept,
      context_->Offer(c, LogitsGradientInfo(head_, LogitRows(m)),
                      View(logits, LogitRows(m)),
                      [this, c](const TensorView& out) {
                        return RecomputeLogitsGradient(c, out);
                      }));
  // A split run holds what its passes apart need: nothing fetches the
  // teacher logits of a kept logits gradient. (RunHeadOn frees them with
  // the chunk in backward, as before.)
  if (deferred_ && kept && teacher_) context_->Discard(c, kTeacherLogitsTag);
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::BackwardChunk(int64_t c, bool release_kept) {
  if (Rows(c) == 0) return absl::OkStatus();
  DFLASH_ASSIGN_OR_RETURN(TensorView grad,
                          context_->Fetch(c, kLogitsGradientTag));
  absl::Status done = ProjectionGradients(c, grad.data_as<T>());
  if (release_kept) {
    context_->Release(c);
  } else {
    context_->ReleaseRecomputed(c);
  }
  return done;
}

namespace {

// A vocab-parallel head's handshake record (HeadRun::ShardHandshake).
enum HandshakeField {
  kOffset = kRecordHead,
  kWidth,
  kVocab,
  kRows,
  kConfigLow,
  kConfigHigh,
  kRowsLow,
  kRowsHigh,
  kUpstream,
  kForwardOnly,
  kSize
};
// Handshake-shaped, as a process that failed before it sends its error.
static_assert(kSize == kHandshakeSize);

// FNV-1a over bytes: the same on every process of a group (unlike
// absl::Hash, seeded per process).
uint64_t Fingerprint(const void* data, size_t bytes, uint64_t hash) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash = (hash ^ p[i]) * 1099511628211ull;
  }
  return hash;
}

}  // namespace

template <typename T>
absl::Status HeadRun<T>::ShardHandshake(const VocabShard& shard,
                                        const absl::Status& valid,
                                        const HeadOptions& options) {
  // The config but for what may differ per process: its width, threads.
  v1::ObjectiveConfig shared = config_;
  shared.mutable_head()->clear_vocab_size();
  shared.mutable_head()->clear_threads();
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    shared.SerializeToCodedStream(&coded);
  }
  const uint64_t offset_basis = 14695981039346656037ull;
  const uint64_t config_hash =
      Fingerprint(bytes.data(), bytes.size(), offset_basis);
  uint64_t rows_hash = offset_basis;
  for (const RowMeta& row : inputs_.rows) {
    rows_hash = Fingerprint(&row.target, sizeof(row.target), rows_hash);
    rows_hash = Fingerprint(&row.position, sizeof(row.position), rows_hash);
    rows_hash = Fingerprint(&row.mask, sizeof(row.mask), rows_hash);
    rows_hash = Fingerprint(&row.block, sizeof(row.block), rows_hash);
  }
  std::vector<double> record(kSize), gathered;
  record[kOffset] = static_cast<double>(shard.offset);
  record[kWidth] = static_cast<double>(vocab_);
  record[kVocab] = static_cast<double>(shard.vocab);
  record[kRows] = static_cast<double>(RowCount(inputs_));
  // 32 bits a value: exact in a double.
  record[kConfigLow] = static_cast<double>(config_hash & 0xffffffffu);
  record[kConfigHigh] = static_cast<double>(config_hash >> 32);
  record[kRowsLow] = static_cast<double>(rows_hash & 0xffffffffu);
  record[kRowsHigh] = static_cast<double>(rows_hash >> 32);
  record[kUpstream] = options.upstream_gradient;
  record[kForwardOnly] = options.forward_only;
  DFLASH_RETURN_IF_ERROR(GatherRecords(*shard.exchange, valid,
                                       absl::MakeSpan(record), gathered));
  const AgreedField agreed[] = {
      {kRows, "the number of inputs.rows"},
      {kConfigLow, "the config (but head.vocab_size and head.threads)"},
      {kConfigHigh, "the config (but head.vocab_size and head.threads)"},
      {kRowsLow, "inputs.rows (targets, positions, masks, blocks)"},
      {kRowsHigh, "inputs.rows (targets, positions, masks, blocks)"},
      {kUpstream, "options.upstream_gradient"},
      {kForwardOnly, "options.forward_only"}};
  DFLASH_RETURN_IF_ERROR(
      CheckShardRecords(gathered, kSize, kOffset, kWidth, kVocab, agreed));
  for (size_t at = kWidth; at < gathered.size(); at += kSize) {
    plan_vocab_ = std::max(plan_vocab_, static_cast<int64_t>(gathered[at]));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::Forward(const HeadOptions& options) {
  interrupt_ = options.interrupt;
  base_bytes_ = allocator_.current_bytes();
  allocator_.ResetPeak();
  DFLASH_RETURN_IF_ERROR(Plan());
  const int64_t anchors = config_.layout().num_anchors();
  const int64_t rows = RowCount(inputs_);
  sequences_ = anchors > 0 ? rows / (anchors * block_size_) : 1;
  const bool own_gradients = forward_only_ || deferred_;
  // The loss writes the confidence gradient of each row it records.
  const bool keep_confidence =
      confidence_ && (own_gradients || !gradients_->confidence.empty());
  DFLASH_RETURN_IF_ERROR(backend_.Start(
      {&config_, &params_, &inputs_,
       own_gradients ? &no_gradients_ : gradients_, &row_outputs_, active_,
       options.prepared_projection, options.vocab_shard, max_chunk_rows_,
       keep_confidence}));
  if (!own_gradients) DFLASH_RETURN_IF_ERROR(backend_.StartGradients(*gradients_));
  stride_ = backend_.projection().logits_stride();
  // The final gradient scale, for a backend that folds it into its
  // input-gradient products: now, where the rows alone decide it (a split
  // run's Backward folds upstream x the finished scale instead; rows still
  // on the device leave it to ScaleGradients).
  if (backend_.folds_gradient_scale() && !deferred_ && !inputs_.rows.empty()) {
    known_scale_ = RowsGradientScale(params_, inputs_.rows, sequences_);
  }
  if (known_scale_) {
    backend_.InputGradientScale(options.upstream_gradient * *known_scale_);
  }

  result_.mode = head_.mode();
  const int64_t chunks = static_cast<int64_t>(plan_.chunks.size());
  const int64_t steps = Fused() || forward_only_ ? chunks : 2 * chunks;
  const Clock::time_point forward = Clock::now();
  for (int64_t c = 0; c < chunks; ++c) {
    DFLASH_RETURN_IF_ERROR(ForwardChunk(c));
    if (options.progress) options.progress(c + 1, steps);
  }
  // Results on the device: the work stays queued (forward_seconds is the
  // host's time to queue it).
  if (!device_results_) DFLASH_RETURN_IF_ERROR(backend_.Synchronize());
  DFLASH_RETURN_IF_ERROR(backend_.projection().status());
  result_.stats.forward_seconds = Since(forward);
  logits_ws_.Reset();
  teacher_ws_.Reset();
  if (deferred_) {
    // The backward pass allocates its own.
    rows_ws_.Reset();
    z_ws_.Reset();
  }
  if (device_results_) {
    // The terms, loss and scales are finished on the device; the host's
    // copy of them is NaN, so that nothing reads it as a result.
    DFLASH_RETURN_IF_ERROR(
        backend_.FinishOnDevice(sequences_, options.device_results));
    const double nan = std::numeric_limits<double>::quiet_NaN();
    ChunkTerms& terms = result_.terms;
#define DFLASH_SUMMED_TERM(field, slot, dict, key) terms.field = nan;
#define DFLASH_POSITION_TERM(field, slot, dict, key) \
  terms.field.assign(block_size_, nan);
#define DFLASH_BLOCK_TERM(field, dict, key) terms.accepted_length.field = nan;
#include "losses/chunk_terms.inc"
    result_.loss = result_.loss_denominator = result_.accuracy = nan;
    result_.loss_den_offset = LossDenOffset(params_.family);
    result_.accuracy_per_position.assign(block_size_, nan);
    result_.plan = plan_;
    return absl::OkStatus();
  }
  // Device rows of ALL_ROWS: on the host now, for the terms (accepted
  // lengths) and the finish; their errors before the loss's.
  if (inputs_.rows.empty()) DFLASH_RETURN_IF_ERROR(HostRows());
  // Every chunk's terms are in (a recomputation does not record): the
  // loss and its scales are final.
  absl::StatusOr<ChunkTerms> terms = backend_.Terms();
  // Errors the device saw name a batch row (CUDA reports them here).
  if (!terms.ok()) return NameBatchRowError(terms.status(), config_.layout());
  result_.terms = *std::move(terms);
  // d(loss)/d(.) = upstream * scale * d(loss_num)/d(.), the latter
  // complete once the composition is.
  finished_ = Finish(result_.terms, sequences_);
  result_.lk_kl_weight = finished_.lk_kl_weight;
  result_.loss = finished_.loss;
  result_.loss_denominator = finished_.denominator;
  result_.loss_den_offset = LossDenOffset(params_.family);
  result_.accuracy = finished_.accuracy;
  for (int64_t k = 0; k < block_size_; ++k) {
    const double mass = result_.terms.mask_per_position[k];
    result_.accuracy_per_position.push_back(
        mass > 0 ? result_.terms.correct_per_position[k] / mass : 0);
  }
  result_.plan = plan_;
  return absl::OkStatus();
}

template <typename T>
absl::Status HeadRun<T>::BackwardPass(double upstream, bool release_kept,
                                      const std::function<void()>& report) {
  if (backend_.folds_gradient_scale() && !known_scale_ &&
      params_.lk != LkMode::kLambdaBatch) {
    // The scale the logits decided (D-PACE), known once every chunk's terms
    // are in; not the batch-level LK lambda's factor per row.
    backend_.InputGradientScale(upstream * finished_.gradient_scale);
  }
  for (int64_t c = static_cast<int64_t>(plan_.chunks.size()) - 1; c >= 0;
       --c) {
    DFLASH_RETURN_IF_ERROR(BackwardChunk(c, release_kept));
    report();
  }
  return absl::OkStatus();
}

template <typename T>
GemmCount HeadRun<T>::Gemms() const {
  GemmCount gemms = backend_.projection().gemms();
  if (backend_.correction() != nullptr) {
    const GemmCount& more = backend_.correction()->gemms();
    gemms.calls += more.calls;
    gemms.flops += more.flops;
    gemms.seconds += more.seconds;
  }
  return gemms;
}

template <typename T>
void HeadRun<T>::FillStats(const GemmCount& gemms, int64_t base_bytes,
                           HeadStats& stats) const {
  stats.chunks = static_cast<int64_t>(plan_.chunks.size());
  stats.projected_rows = static_cast<int64_t>(active_.size());
  stats.gemm_calls = gemms.calls;
  stats.gemm_flops = gemms.flops;
  stats.gemm_seconds = gemms.seconds;
  stats.loss_seconds = backend_.loss_seconds();
  stats.prepare_seconds = backend_.prepare_seconds();
  stats.gemm_library = backend_.gemm_library();
  stats.filter_tiles = filter_tiles_;
  stats.filter_skipped_tiles = filter_skipped_;
  stats.threads = backend_.threads();
  const double pass = 2.0 * stats.projected_rows * hidden_ * vocab_;
  stats.gemm_passes = pass > 0 ? stats.gemm_flops / pass : 0;
  if (context_ != nullptr) {
    stats.checkpoint = context_->stats();
    stats.segment_recomputes = stats.checkpoint.segment_recomputes;
  }
  stats.peak_bytes = allocator_.peak_bytes() - base_bytes;
}

template <typename T>
absl::StatusOr<HeadResult> HeadRun<T>::Run(const HeadOptions& options) {
  DFLASH_RETURN_IF_ERROR(Forward(options));
  const int64_t chunks = static_cast<int64_t>(plan_.chunks.size());
  int64_t step = chunks;
  const Clock::time_point backward = Clock::now();
  if (!Fused() && !forward_only_) {
    DFLASH_RETURN_IF_ERROR(BackwardPass(
        options.upstream_gradient, /*release_kept=*/true, [&] {
          if (options.progress) options.progress(++step, 2 * chunks);
        }));
  }
  if (!forward_only_) {
    DFLASH_RETURN_IF_ERROR(backend_.ScaleGradients(
        options.upstream_gradient, /*device_upstream=*/nullptr, finished_));
  }
  DFLASH_RETURN_IF_ERROR(backend_.projection().status());
  result_.stats.backward_seconds = Since(backward);
  FillStats(Gemms(), base_bytes_, result_.stats);
  return result_;
}

template <typename T>
absl::StatusOr<HeadStats> HeadRun<T>::Backward(
    double upstream, const DeviceUpstream* device_upstream,
    const HeadGradients<T>& gradients, const std::atomic<bool>* interrupt) {
  interrupt_ = interrupt;
  const int64_t base_bytes = allocator_.current_bytes();
  allocator_.ResetPeak();
  const GemmCount before = Gemms();
  const int64_t filter_tiles = filter_tiles_, filter_skipped = filter_skipped_;
  const double loss_seconds = backend_.loss_seconds();
  const Clock::time_point backward = Clock::now();
  DFLASH_RETURN_IF_ERROR(backend_.Resume());
  backward_gradients_ = gradients;
  gradients_ = &backward_gradients_;
  DFLASH_RETURN_IF_ERROR(backend_.StartGradients(backward_gradients_));
  DFLASH_RETURN_IF_ERROR(
      BackwardPass(upstream, /*release_kept=*/false, [] {}));
  DFLASH_RETURN_IF_ERROR(
      backend_.ScaleGradients(upstream, device_upstream, finished_));
  DFLASH_RETURN_IF_ERROR(backend_.projection().status());
  // Between backward passes the run holds what forward kept alone.
  rows_ws_.Reset();
  grad_ws_.Reset();
  z_ws_.Reset();
  z_grad_ws_.Reset();
  HeadStats stats;
  GemmCount gemms = Gemms();
  gemms.calls -= before.calls;
  gemms.flops -= before.flops;
  gemms.seconds -= before.seconds;
  FillStats(gemms, base_bytes, stats);
  stats.filter_tiles -= filter_tiles;
  stats.filter_skipped_tiles -= filter_skipped;
  stats.loss_seconds -= loss_seconds;  // Recomputations'.
  stats.prepare_seconds = 0;  // At Start, in forward.
  stats.backward_seconds = Since(backward);
  return stats;
}

absl::Status NameBatchRowError(const absl::Status& error,
                               const v1::BatchLayout& layout) {
  const std::optional<RowErrorInfo> row = GetRowError(error);
  if (!row || row->row < 0) return error;
  const int64_t r = row->row;
  const int64_t k_size = std::max<int64_t>(layout.block_size(), 1);
  const int64_t n_size = layout.num_anchors();
  const int64_t block = r / k_size, k = r % k_size;
  const std::string name =
      n_size > 0 ? absl::StrCat("row (b, n, k) = (", block / n_size, ", ",
                                block % n_size, ", ", k, ")")
                 : absl::StrCat("row (block, k) = (", block, ", ", k, ")");
  return RowError(r, row->detail, name);
}

absl::Status NameChunkLossError(const absl::Status& error,
                                const v1::BatchLayout& layout, int64_t chunk,
                                absl::Span<const int64_t> chunk_rows) {
  const std::optional<RowErrorInfo> row = GetRowError(error);
  if (!row || row->row < 0 ||
      row->row >= static_cast<int64_t>(chunk_rows.size())) {
    return absl::Status(error.code(),
                        absl::StrCat("chunk ", chunk, ": ", error.message()));
  }
  return NameBatchRowError(RowError(chunk_rows[row->row], row->detail), layout);
}

absl::Status CheckVocabShard(const v1::ObjectiveConfig& config,
                             const VocabShard& shard) {
  return CheckShardFields(shard, config.head().vocab_size(),
                          "options.vocab_shard");
}

absl::Status CheckHeadTarget(const v1::HeadConfig& head,
                             v1::HeadConfig::Backend backend,
                             v1::HeadConfig::DType dtype, const char* call,
                             const char* dtypes) {
  if (head.backend() != backend) {
    return absl::InvalidArgumentError(
        absl::StrCat("head.backend: ", call, " runs the ",
                     v1::HeadConfig::Backend_Name(backend), " backend, got ",
                     v1::HeadConfig::Backend_Name(head.backend())));
  }
  if (head.dtype() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("head.dtype: this call takes ",
                     v1::HeadConfig::DType_Name(dtype), " tensors (", dtypes,
                     "), got ", v1::HeadConfig::DType_Name(head.dtype())));
  }
  return absl::OkStatus();
}

namespace {

// HeadOptions::device_results against head.device_results: given exactly
// when it is set.
absl::Status CheckDeviceResultsOption(const v1::ObjectiveConfig& config,
                                      const HeadOptions& options) {
  if (config.head().device_results() && options.device_results == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.device_results: head.device_results is set, so must be a "
        "device buffer of DeviceResultsSize(layout.block_size) = ",
        DeviceResultsSize(config.layout().block_size()),
        " doubles (losses/device_results.h), got null"));
  }
  if (!config.head().device_results() && options.device_results != nullptr) {
    return absl::InvalidArgumentError(
        "options.device_results: a buffer is given but head.device_results "
        "is not set (the results are returned on the host)");
  }
  if (config.head().device_results() && options.vocab_shard != nullptr) {
    return absl::InvalidArgumentError(
        "head.device_results: a vocab-parallel head merges each chunk's "
        "statistics on the host, so it does not finish on the device; got "
        "true with a vocab_shard");
  }
  return absl::OkStatus();
}

// RunHeadOn's checks and run; vocab-parallel, the run's handshake first.
template <typename T>
absl::StatusOr<HeadResult> RunHeadOnce(const v1::ObjectiveConfig& config,
                                       const HeadInputs<T>& inputs,
                                       const HeadGradients<T>& gradients,
                                       HeadBackend<T>& backend,
                                       const HeadRowOutputs& row_outputs,
                                       const HeadOptions& options) {
  const VocabShard* shard = options.vocab_shard;
  DFLASH_RETURN_IF_ERROR(ValidateObjectiveConfig(config));
  DFLASH_RETURN_IF_ERROR(CheckDeviceResultsOption(config, options));
  if (!std::isfinite(options.upstream_gradient)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.upstream_gradient: must be finite, got ",
                     options.upstream_gradient));
  }
  if (shard != nullptr) DFLASH_RETURN_IF_ERROR(CheckVocabShard(config, *shard));
  if (shard != nullptr && config.head().backend() == v1::HeadConfig::CUDA &&
      config.head().row_selection() == v1::HeadConfig::ALL_ROWS) {
    return absl::InvalidArgumentError(
        "head.row_selection: a vocab-parallel CUDA head runs COMPACT rows "
        "(ALL_ROWS makes each chunk's rows on the device, and a "
        "vocab-parallel chunk reads them on the host); got ALL_ROWS with a "
        "vocab_shard");
  }
  HeadRun<T> run(config, inputs, &gradients, row_outputs, backend,
                 options.forward_only, shard);
  if (shard != nullptr) {
    DFLASH_RETURN_IF_ERROR(run.ShardHandshake(*shard, run.Validate(), options));
  } else {
    DFLASH_RETURN_IF_ERROR(run.Validate());
  }
  return run.Run(options);
}

}  // namespace

template <typename T>
absl::StatusOr<HeadResult> RunHeadOn(const v1::ObjectiveConfig& config,
                                     const HeadInputs<T>& inputs,
                                     const HeadGradients<T>& gradients,
                                     HeadBackend<T>& backend,
                                     const HeadRowOutputs& row_outputs,
                                     const HeadOptions& options) {
  const VocabShard* shard = options.vocab_shard;
  if (shard == nullptr || shard->exchange == nullptr) {
    return RunHeadOnce(config, inputs, gradients, backend, row_outputs,
                       options);
  }
  // Vocab-parallel: whatever fails on this process, and wherever, every
  // process stops together (RunExchange::Finish; docs/scaling.md).
  RunExchange exchange(*shard->exchange);
  const VocabShard run_shard{shard->offset, shard->vocab, &exchange};
  HeadOptions run_options = options;
  run_options.vocab_shard = &run_shard;
  absl::StatusOr<HeadResult> result = RunHeadOnce(
      config, inputs, gradients, backend, row_outputs, run_options);
  DFLASH_RETURN_IF_ERROR(exchange.Finish(result.status()));
  return result;
}

bool SplitsBackward(const v1::ObjectiveConfig& config,
                    const HeadOptions& options) {
  return config.head().mode() != v1::HeadConfig::FUSED &&
         !options.forward_only && options.vocab_shard == nullptr;
}

template <typename T>
absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> SplitHeadRun<T>::Forward(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    std::unique_ptr<HeadBackend<T>> backend, const HeadRowOutputs& row_outputs,
    const HeadOptions& options) {
  DFLASH_RETURN_IF_ERROR(ValidateObjectiveConfig(config));
  if (config.head().mode() == v1::HeadConfig::FUSED) {
    return absl::InvalidArgumentError(
        "head.mode: FUSED makes its gradients in forward and does not split "
        "(run RunHeadOn), got FUSED");
  }
  if (options.forward_only) {
    return absl::InvalidArgumentError(
        "options.forward_only: a split run's forward pass is a training "
        "run's (run RunHeadOn for the forward pass alone), got true");
  }
  if (options.vocab_shard != nullptr) {
    return absl::InvalidArgumentError(
        "options.vocab_shard: a vocab-parallel head runs both passes in one "
        "call (RunHeadOn), got a shard");
  }
  if (options.upstream_gradient != 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.upstream_gradient: a split run takes upstream at Backward, "
        "so must be 1 here, got ",
        options.upstream_gradient));
  }
  if (backend == nullptr) {
    return absl::InvalidArgumentError("backend: must be given, got null");
  }
  DFLASH_RETURN_IF_ERROR(CheckDeviceResultsOption(config, options));
  std::unique_ptr<SplitHeadRun<T>> split(new SplitHeadRun<T>());
  TrackingAllocator& allocator = backend->allocator();
  const int64_t entry_bytes = allocator.current_bytes();
  split->inputs_ = inputs;
  split->row_outputs_ = row_outputs;
  split->backend_ = std::move(backend);
  split->run_ = std::make_unique<HeadRun<T>>(
      config, split->inputs_, /*gradients=*/nullptr, split->row_outputs_,
      *split->backend_, /*forward_only=*/false, /*shard=*/nullptr);
  DFLASH_RETURN_IF_ERROR(split->run_->Validate());
  if (absl::Status done = split->run_->Forward(options); !done.ok()) {
    // Work still queued (CUDA) must not outlive the buffers freed with the
    // run.
    split->backend_->Synchronize().IgnoreError();
    return done;
  }
  split->allocated_bytes_ = allocator.current_bytes() - entry_bytes;
  split->forward_ = split->run_->result();
  split->forward_.stats.backward_seconds = 0;
  split->run_->FillForwardStats(split->forward_.stats);
  split->forward_.stats.saved_bytes = split->saved_bytes();
  // The caller's row outputs are written; recomputations record nothing
  // and read only k.
  split->row_outputs_ = HeadRowOutputs{};
  split->row_outputs_.k = row_outputs.k;
  return split;
}

template <typename T>
SplitHeadRun<T>::~SplitHeadRun() = default;

template <typename T>
int64_t SplitHeadRun<T>::saved_bytes() const {
  return allocated_bytes_ + backend_->unallocated_bytes();
}

template <typename T>
absl::StatusOr<HeadStats> SplitHeadRun<T>::Backward(
    double upstream, const HeadGradients<T>& gradients,
    const std::atomic<bool>* interrupt) {
  return BackwardWith(upstream, nullptr, gradients, interrupt);
}

template <typename T>
absl::StatusOr<HeadStats> SplitHeadRun<T>::Backward(
    const DeviceUpstream& upstream, const HeadGradients<T>& gradients,
    const std::atomic<bool>* interrupt) {
  if (!run_->device_results()) {
    return absl::InvalidArgumentError(
        "upstream: an upstream in device memory needs head.device_results "
        "(the scales are on the host otherwise; pass a double)");
  }
  if (upstream.value == nullptr) {
    return absl::InvalidArgumentError(
        "upstream.value: must be device memory, got null");
  }
  return BackwardWith(1.0, &upstream, gradients, interrupt);
}

template <typename T>
absl::StatusOr<HeadStats> SplitHeadRun<T>::BackwardWith(
    double upstream, const DeviceUpstream* device_upstream,
    const HeadGradients<T>& gradients, const std::atomic<bool>* interrupt) {
  if (broken_) {
    return absl::FailedPreconditionError(
        "SplitHeadRun::Backward: an earlier Backward of this run failed or "
        "was cancelled, leaving its saved state partly released (run "
        "Forward again)");
  }
  if (!std::isfinite(upstream)) {
    return absl::InvalidArgumentError(
        absl::StrCat("upstream: must be finite, got ", upstream));
  }
  DFLASH_RETURN_IF_ERROR(run_->ValidateGradients(gradients));
  absl::StatusOr<HeadStats> stats =
      run_->Backward(upstream, device_upstream, gradients, interrupt);
  if (!stats.ok()) {
    broken_ = true;
    // Nothing queued writes the caller's gradients after the error.
    backend_->Synchronize().IgnoreError();
    return stats;
  }
  // Above the level before Forward, as RunHeadOn's backward peak is.
  stats->peak_bytes += allocated_bytes_;
  return stats;
}

#define DFLASH_INSTANTIATE_RUN_HEAD(T)                                 \
  template class SplitHeadRun<T>;                                      \
  template absl::StatusOr<HeadResult> RunHeadOn<T>(                    \
      const v1::ObjectiveConfig&, const HeadInputs<T>&,                \
      const HeadGradients<T>&, HeadBackend<T>&, const HeadRowOutputs&, \
      const HeadOptions&);
DFLASH_INSTANTIATE_RUN_HEAD(float)
DFLASH_INSTANTIATE_RUN_HEAD(double)
DFLASH_INSTANTIATE_RUN_HEAD(BFloat16)
#undef DFLASH_INSTANTIATE_RUN_HEAD

}  // namespace dflash
