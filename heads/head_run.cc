#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
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

// One forward and backward through the head on a backend; see RunHead.
template <typename T>
class HeadRun {
 public:
  HeadRun(const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
          const HeadGradients<T>& gradients, const HeadRowOutputs& row_outputs,
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
        forward_only_(forward_only) {}

  absl::Status Validate() const;
  // Vocab-parallel: one gather of every process's validation and shape
  // (they must agree; the chunk plan is made for the widest range, so that
  // every process runs the same chunks).
  absl::Status ShardHandshake(const VocabShard& shard, const absl::Status& valid,
                              const HeadOptions& options);
  absl::StatusOr<HeadResult> Run(const HeadOptions& options);

 private:
  // The caller's inputs or, for D-PACE's SEQUENCE_BALANCED denominator, a
  // copy whose rows carry their sequence shares (SetSequenceShares), which
  // the backends' chunk losses read. Sequences of layout.num_anchors blocks
  // (all rows with none).
  const HeadInputs<T>& WithSequenceShares(const v1::ObjectiveConfig& config,
                                          const HeadInputs<T>& inputs) {
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
  absl::Status BackwardChunk(int64_t c);
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
  const HeadGradients<T>& gradients_;
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
  // What the backend writes to in a forward-only run: no gradient but the
  // confidence's, which the loss writes per row, into confidence_ws_.
  HeadGradients<T> no_gradients_;
  TrackedBuffer<ConfidenceOf<T>> confidence_ws_;

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
absl::Status HeadRun<T>::Validate() const {
  const int64_t rows = static_cast<int64_t>(inputs_.rows.size());
  if (rows == 0 || rows % block_size_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.rows: must be a positive number of whole blocks of "
        "layout.block_size = ",
        block_size_, ", got ", rows, " rows"));
  }
  const int64_t ignore = config_.loss().cross_entropy().ignore_index();
  for (int64_t r = 0; r < rows; ++r) {
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
  struct Size {
    const char* name;
    size_t size;
    int64_t expected;
    bool required;
    const char* why;
  };
  const bool trainable = head_.trainable();
  const Size sizes[] = {
      {"inputs.hidden", inputs_.hidden.size(), rows * hidden_, true,
       "rows x head.hidden_size"},
      {"inputs.teacher_hidden", inputs_.teacher_hidden.size(), rows * hidden_,
       teacher_,
       "rows x head.hidden_size, for the loss's teacher or "
       "head.teacher_diagnostics"},
      {"inputs.confidence_logits", inputs_.confidence_logits.size(), rows,
       confidence_, "one per row, for loss.dspark.confidence_weight"},
      {"inputs.weight", inputs_.weight.size(), vocab_ * hidden_, true,
       "head.vocab_size x head.hidden_size"},
      {"inputs.bias", inputs_.bias.size(), vocab_, head_.bias(),
       "head.vocab_size, as head.bias is set"},
      {"gradients.hidden", gradients_.hidden.size(), rows * hidden_,
       !forward_only_, "rows x head.hidden_size"},
      {"gradients.weight", gradients_.weight.size(), vocab_ * hidden_,
       trainable && !forward_only_,
       "head.vocab_size x head.hidden_size, as head.trainable"},
      {"gradients.bias", gradients_.bias.size(), vocab_,
       trainable && head_.bias() && !forward_only_,
       "head.vocab_size, as the bias is trained"},
      {"gradients.confidence", gradients_.confidence.size(), rows,
       confidence_ && !forward_only_,
       "one per row, for loss.dspark.confidence_weight"},
      {"inputs.correction_inputs", inputs_.correction_inputs.size(),
       rows * rank_, true, "rows x head.correction_rank"},
      {"inputs.correction_weight", inputs_.correction_weight.size(),
       vocab_ * rank_, true, "head.vocab_size x head.correction_rank"},
      {"gradients.correction_inputs", gradients_.correction_inputs.size(),
       rows * rank_, !forward_only_, "rows x head.correction_rank"},
      {"gradients.correction_weight", gradients_.correction_weight.size(),
       vocab_ * rank_, !forward_only_,
       "head.vocab_size x head.correction_rank"},
  };
  for (const Size& s : sizes) {
    if (s.required && static_cast<int64_t>(s.size) != s.expected) {
      return SizeError(s.name, s.size, s.expected, s.why);
    }
  }
  // An unused per-row confidence buffer is either absent or whole: a backend
  // may write every row of it.
  if (!confidence_ && !gradients_.confidence.empty() &&
      static_cast<int64_t>(gradients_.confidence.size()) != rows) {
    return SizeError("gradients.confidence", gradients_.confidence.size(), rows,
                     "none, or one per row");
  }
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
  DFLASH_ASSIGN_OR_RETURN(
      HeadPlan plan,
      PlanHead(plan_vocab_ != vocab_ ? widest : config_, inputs_.rows,
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
                                              gradients_.hidden.data()));
  if (head_.trainable()) {
    DFLASH_RETURN_IF_ERROR(CheckInterrupt());
    DFLASH_ASSIGN_OR_RETURN(T * x, Workspace(rows_ws_, hidden_));
    DFLASH_RETURN_IF_ERROR(
        backend_.GatherRows(inputs_.hidden.data(), hidden_, Begin(c), m, x));
    backend_.projection().AccumulateWeightGradient(
        grad_logits, x, m, gradients_.weight.data(),
        gradients_.bias.empty() ? nullptr : gradients_.bias.data());
  }
  if (rank_ == 0) return absl::OkStatus();
  // The correction's logits gradient: the same as the logits' unless split.
  const T* grad_correction = split_ ? grad_logits + m * stride_ : grad_logits;
  DFLASH_ASSIGN_OR_RETURN(T * dz, Workspace(z_grad_ws_, rank_));
  backend_.correction()->InputGradient(grad_correction, m, dz);
  DFLASH_RETURN_IF_ERROR(backend_.ScatterRows(
      dz, rank_, Begin(c), m, gradients_.correction_inputs.data()));
  DFLASH_ASSIGN_OR_RETURN(T * z, Workspace(z_ws_, rank_));
  DFLASH_RETURN_IF_ERROR(backend_.GatherRows(inputs_.correction_inputs.data(),
                                             rank_, Begin(c), m, z));
  backend_.correction()->AccumulateWeightGradient(
      grad_correction, z, m, gradients_.correction_weight.data(), nullptr);
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
  return context_
      ->Offer(c, LogitsGradientInfo(head_, LogitRows(m)),
              View(logits, LogitRows(m)),
              [this, c](const TensorView& out) {
                return RecomputeLogitsGradient(c, out);
              })
      .status();
}

template <typename T>
absl::Status HeadRun<T>::BackwardChunk(int64_t c) {
  if (Rows(c) == 0) return absl::OkStatus();
  DFLASH_ASSIGN_OR_RETURN(TensorView grad,
                          context_->Fetch(c, kLogitsGradientTag));
  absl::Status done = ProjectionGradients(c, grad.data_as<T>());
  context_->Release(c);
  return done;
}

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
  record[kRows] = static_cast<double>(inputs_.rows.size());
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
absl::StatusOr<HeadResult> HeadRun<T>::Run(const HeadOptions& options) {
  interrupt_ = options.interrupt;
  const int64_t base_bytes = allocator_.current_bytes();
  allocator_.ResetPeak();
  DFLASH_RETURN_IF_ERROR(Plan());
  const int64_t anchors = config_.layout().num_anchors();
  const int64_t sequences =
      anchors > 0
          ? static_cast<int64_t>(inputs_.rows.size()) / (anchors * block_size_)
          : 1;
  if (forward_only_ && confidence_) {
    // The loss writes the confidence gradient of each row it records.
    DFLASH_ASSIGN_OR_RETURN(
        TrackedBuffer<ConfidenceOf<T>> created,
        TrackedBuffer<ConfidenceOf<T>>::Create(
            allocator_, static_cast<int64_t>(inputs_.rows.size())));
    confidence_ws_ = std::move(created);
    no_gradients_.confidence =
        absl::MakeSpan(confidence_ws_.data(), inputs_.rows.size());
  }
  DFLASH_RETURN_IF_ERROR(backend_.Start(
      {&config_, &params_, &inputs_,
       forward_only_ ? &no_gradients_ : &gradients_, &row_outputs_, active_,
       options.prepared_projection, options.vocab_shard}));
  stride_ = backend_.projection().logits_stride();
  // The final gradient scale, for a backend that folds it into its
  // input-gradient products: now, where the rows alone decide it.
  const bool folds = backend_.folds_gradient_scale();
  const std::optional<double> known_scale =
      folds ? RowsGradientScale(params_, inputs_.rows, sequences)
            : std::nullopt;
  if (known_scale) {
    backend_.InputGradientScale(options.upstream_gradient * *known_scale);
  }

  HeadResult result;
  result.mode = head_.mode();
  const int64_t chunks = static_cast<int64_t>(plan_.chunks.size());
  const bool backward_pass = !Fused() && !forward_only_;
  const int64_t steps = backward_pass ? 2 * chunks : chunks;
  int64_t step = 0;
  auto report = [&] {
    if (options.progress) options.progress(++step, steps);
  };
  const Clock::time_point forward = Clock::now();
  for (int64_t c = 0; c < chunks; ++c) {
    DFLASH_RETURN_IF_ERROR(ForwardChunk(c));
    report();
  }
  DFLASH_RETURN_IF_ERROR(backend_.Synchronize());
  DFLASH_RETURN_IF_ERROR(backend_.projection().status());
  result.stats.forward_seconds = Since(forward);
  logits_ws_.Reset();
  teacher_ws_.Reset();

  const Clock::time_point backward = Clock::now();
  if (folds && !known_scale && backward_pass &&
      params_.lk != LkMode::kLambdaBatch) {
    // Every chunk's terms are in before the backward pass: the scale the
    // logits decided (D-PACE) is known now; not the batch-level LK lambda's
    // factor per row.
    absl::StatusOr<ChunkTerms> terms = backend_.Terms();
    if (!terms.ok()) return NameBatchRowError(terms.status(), config_.layout());
    backend_.InputGradientScale(
        options.upstream_gradient *
        Finish(*terms, sequences).gradient_scale);
  }
  if (backward_pass) {
    for (int64_t c = chunks - 1; c >= 0; --c) {
      DFLASH_RETURN_IF_ERROR(BackwardChunk(c));
      report();
    }
  }
  absl::StatusOr<ChunkTerms> terms = backend_.Terms();
  // Errors the device saw name a batch row (CUDA reports them here).
  if (!terms.ok()) return NameBatchRowError(terms.status(), config_.layout());
  result.terms = *std::move(terms);
  // d(loss)/d(.) = upstream * scale * d(loss_num)/d(.), the latter
  // complete once the composition is.
  const FinishedLoss finished = Finish(result.terms, sequences);
  result.lk_kl_weight = finished.lk_kl_weight;
  if (!forward_only_) {
    DFLASH_RETURN_IF_ERROR(
        backend_.ScaleGradients(options.upstream_gradient, finished));
  }
  DFLASH_RETURN_IF_ERROR(backend_.projection().status());
  result.stats.backward_seconds = Since(backward);
  result.loss = finished.loss;
  result.loss_denominator = finished.denominator;
  result.loss_den_offset = LossDenOffset(params_.family);
  result.accuracy = finished.accuracy;
  for (int64_t k = 0; k < block_size_; ++k) {
    const double mass = result.terms.mask_per_position[k];
    result.accuracy_per_position.push_back(
        mass > 0 ? result.terms.correct_per_position[k] / mass : 0);
  }
  HeadStats& stats = result.stats;
  GemmCount gemms = backend_.projection().gemms();
  if (backend_.correction() != nullptr) {
    const GemmCount& more = backend_.correction()->gemms();
    gemms.calls += more.calls;
    gemms.flops += more.flops;
    gemms.seconds += more.seconds;
  }
  stats.chunks = chunks;
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
  result.plan = plan_;
  return result;
}

}  // namespace

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
  if (!std::isfinite(options.upstream_gradient)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.upstream_gradient: must be finite, got ",
                     options.upstream_gradient));
  }
  if (shard != nullptr) DFLASH_RETURN_IF_ERROR(CheckVocabShard(config, *shard));
  HeadRun<T> run(config, inputs, gradients, row_outputs, backend,
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

#define DFLASH_INSTANTIATE_RUN_HEAD(T)                                 \
  template absl::StatusOr<HeadResult> RunHeadOn<T>(                    \
      const v1::ObjectiveConfig&, const HeadInputs<T>&,                \
      const HeadGradients<T>&, HeadBackend<T>&, const HeadRowOutputs&, \
      const HeadOptions&);
DFLASH_INSTANTIATE_RUN_HEAD(float)
DFLASH_INSTANTIATE_RUN_HEAD(double)
DFLASH_INSTANTIATE_RUN_HEAD(BFloat16)
#undef DFLASH_INSTANTIATE_RUN_HEAD

}  // namespace dflash
