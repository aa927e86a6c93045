// The CPU backend of the head: host memory, CBLAS, ChunkLoss on threads.
#include "heads/cpu_head_backend.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/threads.h"
#include "heads/config/head_facts.h"
#include "heads/cpu_projection.h"
#include "heads/prepared_projection.h"
#include "heads/head_backend.h"
#include "heads/row_compaction.h"
#include "losses/accepted_length.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/row_error.h"

namespace dflash {
namespace {

using Clock = std::chrono::steady_clock;

template <typename S>
S Part(S span, int64_t begin, int64_t count) {
  return span.empty() ? span : span.subspan(begin, count);
}

// The chunk's loss with its rows split into groups at block boundaries
// (block-level weights stay within a group), several per thread so that
// the threads finish together; the groups' terms are added in group order,
// so the result does not depend on scheduling.
template <typename T>
absl::StatusOr<ChunkTerms> ThreadedChunkLoss(const CpuChunkLoss<T>& loss,
                                             const ChunkLossInputs<T>& in,
                                             const ChunkLossOutputs& out,
                                             int threads) {
  const int64_t m = static_cast<int64_t>(in.rows.size());
  const int64_t v = in.stride();
  constexpr int kGroupsPerThread = 8;
  // Vocab-parallel, the chunk is one group: its exchange is one sequence
  // of calls per process, which groups on threads would interleave.
  const bool vocab_parallel = loss.options().vocab_shard != nullptr;
  const int wanted =
      threads > 1 && !vocab_parallel ? threads * kGroupsPerThread : 1;
  std::vector<int64_t> bounds = {0};
  for (int g = 1; g < wanted; ++g) {
    int64_t at = std::max(bounds.back(), m * g / wanted);
    while (at > 0 && at < m && in.rows[at].block == in.rows[at - 1].block) {
      ++at;
    }
    if (at > bounds.back() && at < m) bounds.push_back(at);
  }
  bounds.push_back(m);
  const int groups = static_cast<int>(bounds.size()) - 1;
  std::vector<absl::StatusOr<ChunkTerms>> results(groups);
  auto run = [&](int g) {
    const int64_t b = bounds[g], n = bounds[g + 1] - bounds[g];
    ChunkLossInputs<T> part{Part(in.logits, b * v, n * v),
                            Part(in.teacher_logits, b * v, n * v),
                            Part(in.confidence_logits, b, n),
                            in.rows.subspan(b, n),
                            in.vocab,
                            Part(in.correction_logits, b * v, n * v),
                            in.row_stride,
                            in.rows_checked};
    ChunkLossOutputs part_out{Part(out.confidence_grad, b, n),
                              Part(out.neg_log_q, b, n),
                              Part(out.argmax, b, n),
                              Part(out.top_k, b * out.k, n * out.k),
                              out.k,
                              Part(out.target_probability, b, n),
                              Part(out.target_rank, b, n),
                              Part(out.top_k_values, b * out.k, n * out.k),
                              Part(out.loss_weight, b, n),
                              Part(out.teacher_acceptance, b, n),
                              Part(out.base_argmax, b, n),
                              Part(out.teacher_argmax, b, n)};
    results[g] = loss.Run(part, part_out);
    // Rows of a group's errors count from the group's first row.
    if (std::optional<RowErrorInfo> row = GetRowError(results[g].status())) {
      results[g] = RowError(b + row->row, row->detail);
    }
  };
  if (groups == 1) {
    // On the calling thread: a vocab-parallel exchange then calls back into
    // Python on the thread that called the head, the main thread where
    // Python raises Ctrl-C's KeyboardInterrupt (an OpenMP worker would
    // leave it pending until the call returns).
    run(0);
  } else {
    // On OpenMP's threads, the ones oneDNN's GEMMs just ran on, taking
    // groups as they come: a thread that idles spin-waits, which on this
    // machine costs the busy one (measured: 1.8x the loss pass with one
    // group per thread).
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int g = 0; g < groups; ++g) run(g);
  }
  ChunkTerms terms = ChunkTerms::Zero(loss.options().block_size);
  for (absl::StatusOr<ChunkTerms>& result : results) {
    if (!result.ok()) return result.status();
    terms.Add(*result);
  }
  return terms;
}

template <typename T>
class CpuHeadBackend final : public HeadBackend<T> {
 public:
  CpuHeadBackend(const v1::ObjectiveConfig& config,
                 TrackingAllocator& allocator)
      : config_(config),
        allocator_(allocator),
        options_(ChunkLossOptionsOf(config)) {
    terms_ = ChunkTerms::Zero(options_.block_size);
  }

  Device device() const override { return Device::kCpu; }
  TrackingAllocator& allocator() override { return allocator_; }
  VocabProjection<T>& projection() override { return *projection_; }
  VocabProjection<T>* correction() override { return correction_.get(); }

  absl::Status Start(const HeadRunSpec<T>& spec) override {
    spec_ = spec;
    params_ = *spec.params;
    traits_ = LossTraitsOf(params_);
    confidence_ = traits_.needs_confidence;
    const v1::HeadConfig& head = config_.head();
    DFLASH_ASSIGN_OR_RETURN(threads_,
                            ResolveThreads(head.threads(), "head.threads"));
    // OpenBLAS's threads (a process-wide setting) follow head.threads, as
    // oneDNN's and the loss's do.
    openblas_set_num_threads(threads_);
    DFLASH_ASSIGN_OR_RETURN(projection_, CreateProjection(spec));
    if (head.correction_rank() > 0) {
      DFLASH_ASSIGN_OR_RETURN(
          correction_, CreateCpuProjection<T>(spec.inputs->correction_weight,
                                              {}, head.vocab_size(),
                                              head.correction_rank()));
    }
    options_ = ChunkLossOptionsOf(config_, spec.vocab_shard);
    DFLASH_ASSIGN_OR_RETURN(CpuChunkLoss<T> loss,
                            CpuChunkLoss<T>::Create(params_, options_));
    loss_.emplace(std::move(loss));
    const HeadRowOutputs& o = *spec.row_outputs;
    std::fill(o.neg_log_q.begin(), o.neg_log_q.end(), 0.0);
    std::fill(o.argmax.begin(), o.argmax.end(), -1);
    std::fill(o.base_argmax.begin(), o.base_argmax.end(), -1);
    std::fill(o.teacher_argmax.begin(), o.teacher_argmax.end(), -1);
    std::fill(o.top_k.begin(), o.top_k.end(), -1);
    std::fill(o.top_k_values.begin(), o.top_k_values.end(), 0.0f);
    std::fill(o.loss_weight.begin(), o.loss_weight.end(), 0.0);
    const size_t rows = static_cast<size_t>(RowCount(*spec.inputs));
    row_q_.assign(rows, 0.0);
    row_confidence_grad_.assign(
        confidence_ && spec.keeps_confidence_gradient ? rows : 0, 0.0);
    row_rank_.assign(options_.metric_top_k > 0 ? rows : 0, -1);
    row_teacher_.assign(RecordsTeacherAcceptance(config_) ? rows : 0, 0.0);
    const bool greedy = params_.family == LossFamily::kDomino;
    row_argmax_.assign(greedy ? rows : 0, -1);
    row_base_argmax_.assign(greedy ? rows : 0, -1);
    return absl::OkStatus();
  }

  absl::Status StartGradients(const HeadGradients<T>& g) override {
    spec_.gradients = &g;
    std::fill(g.hidden.begin(), g.hidden.end(), T(0));
    std::fill(g.weight.begin(), g.weight.end(), T(0));
    std::fill(g.bias.begin(), g.bias.end(), T(0));
    std::fill(g.confidence.begin(), g.confidence.end(), 0);
    std::fill(g.correction_inputs.begin(), g.correction_inputs.end(), T(0));
    std::fill(g.correction_weight.begin(), g.correction_weight.end(), T(0));
    return absl::OkStatus();
  }

  absl::Status Resume() override {
    openblas_set_num_threads(threads_);
    return absl::OkStatus();
  }

  absl::Status GatherRows(const T* source, int64_t width, int64_t begin,
                          int64_t count, T* out) override {
    dflash::GatherRows(source, width, spec_.active.subspan(begin, count), out);
    return absl::OkStatus();
  }

  absl::Status ScatterRows(const T* rows, int64_t width, int64_t begin,
                           int64_t count, T* out) override {
    dflash::ScatterRows(rows, width, spec_.active.subspan(begin, count), out);
    return absl::OkStatus();
  }

  absl::Status ChunkLoss(int64_t chunk, int64_t begin, int64_t m, T* logits,
                         const T* teacher, T* correction,
                         bool record) override {
    absl::Span<const int64_t> rows = spec_.active.subspan(begin, m);
    const HeadInputs<T>& in = *spec_.inputs;
    const int64_t vocab = config_.head().vocab_size();
    std::vector<RowMeta> meta(m);
    std::vector<ConfidenceOf<T>> confidence(confidence_ ? m : 0);
    for (int64_t i = 0; i < m; ++i) {
      meta[i] = in.rows[rows[i]];
      if (confidence_) confidence[i] = in.confidence_logits[rows[i]];
    }
    // Per-row results of the chunk, scattered to the rows' positions after.
    const HeadRowOutputs& o = *spec_.row_outputs;
    std::vector<double> neg_log_q(record && !o.neg_log_q.empty() ? m : 0);
    std::vector<int32_t> argmax(
        record && (!o.argmax.empty() || !row_argmax_.empty()) ? m : 0);
    // -1 where the family has no base logits (all but domino).
    std::vector<int32_t> base_argmax(
        record && (!o.base_argmax.empty() || !row_base_argmax_.empty()) ? m
                                                                        : 0,
        -1);
    std::vector<int32_t> teacher_argmax(
        record && !o.teacher_argmax.empty() ? m : 0);
    std::vector<int32_t> top_k(record && !o.top_k.empty() ? m * o.k : 0);
    std::vector<float> top_k_values(record && !o.top_k_values.empty() ? m * o.k
                                                                      : 0);
    std::vector<double> loss_weight(record && !o.loss_weight.empty() ? m : 0);
    std::vector<double> confidence_grad(
        record && !row_confidence_grad_.empty() ? m : 0);
    // A recomputation writes the same q and rank again.
    std::vector<double> q(m);
    std::vector<int32_t> rank(row_rank_.empty() ? 0 : m);
    std::vector<double> teacher_acceptance(row_teacher_.empty() ? 0 : m);
    const ChunkLossOutputs outputs{absl::MakeSpan(confidence_grad),
                                   absl::MakeSpan(neg_log_q),
                                   absl::MakeSpan(argmax),
                                   absl::MakeSpan(top_k),
                                   o.k,
                                   absl::MakeSpan(q),
                                   absl::MakeSpan(rank),
                                   absl::MakeSpan(top_k_values),
                                   absl::MakeSpan(loss_weight),
                                   absl::MakeSpan(teacher_acceptance),
                                   absl::MakeSpan(base_argmax),
                                   absl::MakeSpan(teacher_argmax)};
    const Clock::time_point start = Clock::now();
    absl::StatusOr<ChunkTerms> terms = ThreadedChunkLoss<T>(
        *loss_,
        {absl::MakeSpan(logits, m * vocab),
         teacher == nullptr ? absl::Span<const T>()
                            : absl::MakeConstSpan(teacher, m * vocab),
         confidence, meta, vocab,
         correction == nullptr ? absl::Span<T>()
                               : absl::MakeSpan(correction, m * vocab),
         /*row_stride=*/0,
         // HeadRun::Validate checked every row once for the whole run.
         /*rows_checked=*/true},
        outputs, threads_);
    loss_seconds_ +=
        std::chrono::duration<double>(Clock::now() - start).count();
    if (!terms.ok()) {
      return NameChunkLossError(terms.status(), config_.layout(), chunk, rows);
    }
    if (!record) return absl::OkStatus();
    terms_.Add(*terms);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t r = rows[i];
      if (!neg_log_q.empty()) o.neg_log_q[r] = neg_log_q[i];
      if (!o.argmax.empty()) o.argmax[r] = argmax[i];
      if (!o.base_argmax.empty()) o.base_argmax[r] = base_argmax[i];
      if (!teacher_argmax.empty()) o.teacher_argmax[r] = teacher_argmax[i];
      if (!row_argmax_.empty()) {
        row_argmax_[r] = argmax[i];
        row_base_argmax_[r] = base_argmax[i];
      }
      if (!top_k.empty()) {
        std::copy_n(top_k.begin() + i * o.k, o.k, o.top_k.begin() + r * o.k);
      }
      if (!top_k_values.empty()) {
        std::copy_n(top_k_values.begin() + i * o.k, o.k,
                    o.top_k_values.begin() + r * o.k);
      }
      if (!loss_weight.empty()) o.loss_weight[r] = loss_weight[i];
      if (!confidence_grad.empty()) row_confidence_grad_[r] = confidence_grad[i];
      row_q_[r] = q[i];
      if (!rank.empty()) row_rank_[r] = rank[i];
      if (!teacher_acceptance.empty()) row_teacher_[r] = teacher_acceptance[i];
    }
    return absl::OkStatus();
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::StatusOr<ChunkTerms> Terms() override {
    ChunkTerms terms = terms_;
    terms.accepted_length =
        AcceptedLengths(spec_.inputs->rows, row_q_, row_rank_, row_teacher_,
                        options_.block_size, traits_.first_accepted_position);
    if (!row_argmax_.empty()) {
      AddGreedyAcceptedLengths(spec_.inputs->rows, row_argmax_,
                               row_base_argmax_, options_.block_size,
                               terms.accepted_length);
    }
    return terms;
  }

  absl::Status ScaleGradients(double upstream,
                              const DeviceUpstream* device_upstream,
                              const FinishedLoss& finished) override {
    if (device_upstream != nullptr) {
      return absl::InvalidArgumentError(
          "upstream: the CPU head takes its upstream on the host");
    }
    const HeadGradients<T>& g = *spec_.gradients;
    const int64_t hidden = config_.head().hidden_size();
    const double scale = upstream * finished.gradient_scale;
    const std::optional<double>& kl_weight = finished.lk_kl_weight;
    const double confidence_scale = upstream * finished.confidence_scale;
    for (int64_t r : spec_.active) {
      const T row_scale = static_cast<T>(
          kl_weight ? scale * LkDeferredFactor(*kl_weight, row_q_[r]) : scale);
      T* row = g.hidden.data() + r * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] *= row_scale;
      if (!row_confidence_grad_.empty()) {
        g.confidence[r] = static_cast<ConfidenceOf<T>>(
            row_confidence_grad_[r] * confidence_scale);
      }
    }
    const T all = static_cast<T>(scale);
    for (absl::Span<T> span : {g.weight, g.bias, g.correction_inputs,
                               g.correction_weight}) {
      for (T& x : span) x *= all;
    }
    return absl::OkStatus();
  }

  double loss_seconds() const override { return loss_seconds_; }
  int threads() const override { return threads_; }
  double prepare_seconds() const override { return prepare_seconds_; }
  std::string gemm_library() const override { return gemm_library_; }
  int64_t unallocated_bytes() const override {
    int64_t bytes =
        own_prepared_ != nullptr ? own_prepared_->held_bytes() : 0;
    auto add = [&bytes](const auto& row_state) {
      bytes += static_cast<int64_t>(row_state.capacity() *
                                    sizeof(row_state[0]));
    };
    add(row_q_);
    add(row_confidence_grad_);
    add(row_rank_);
    add(row_teacher_);
    add(row_argmax_);
    add(row_base_argmax_);
    return bytes;
  }

 private:
  // The laid-out weight for a frozen float head (given, or made here when
  // head.pack_weight), else OpenBLAS per chunk.
  absl::StatusOr<std::unique_ptr<VocabProjection<T>>> CreateProjection(
      const HeadRunSpec<T>& spec) {
    const v1::HeadConfig& head = config_.head();
    const HeadInputs<T>& in = *spec.inputs;
    const bool frozen_float = std::is_same_v<T, float> && !head.trainable();
    const PreparedProjection* prepared = spec.prepared_projection;
    if (prepared != nullptr && !frozen_float) {
      return absl::InvalidArgumentError(
          "options.prepared_projection: serves a frozen FLOAT32 head, got "
          "a trainable or FLOAT64 one");
    }
    if constexpr (std::is_same_v<T, float>) {
      if (prepared != nullptr) {
        if (!prepared->PreparedFrom(in.weight, in.bias)) {
          return absl::InvalidArgumentError(
              "options.prepared_projection: was prepared from another "
              "weight or bias than inputs.weight and inputs.bias (prepare "
              "it from the tensors the run reads)");
        }
        // A weight written in place since it was laid out is laid out again.
        DFLASH_ASSIGN_OR_RETURN(const bool relaid,
                                prepared->Revalidate(threads_));
        if (relaid) prepare_seconds_ = prepared->prepare_seconds();
        gemm_library_ = absl::StrCat(
            "oneDNN (", prepared->KernelName(),
            relaid ? "), the weight laid out by the caller and again here "
                     "(it changed since)"
                   : "), the weight laid out by the caller");
        return prepared->NewProjection(threads_);
      }
      if (frozen_float && head.pack_weight()) {
        absl::StatusOr<std::unique_ptr<PreparedProjection>> own =
            PreparedProjection::Create(in.weight, in.bias, head.vocab_size(),
                                       head.hidden_size(), threads_);
        // Without an optimised oneDNN kernel for this CPU, OpenBLAS runs.
        if (own.ok()) {
          own_prepared_ = *std::move(own);
          prepare_seconds_ = own_prepared_->prepare_seconds();
          gemm_library_ = absl::StrCat("oneDNN (", own_prepared_->KernelName(),
                                       "), the weight laid out for this run");
          return own_prepared_->NewProjection(threads_);
        }
        if (own.status().code() != absl::StatusCode::kFailedPrecondition) {
          return own.status();
        }
      }
    }
    gemm_library_ = CpuBlasName();
    return CreateCpuProjection<T>(in.weight, in.bias, head.vocab_size(),
                                  head.hidden_size());
  }

  const v1::ObjectiveConfig& config_;
  TrackingAllocator& allocator_;
  LossParams params_;  // The run's (Start).
  ChunkLossOptions options_;  // With the run's vocab_shard from Start.
  std::optional<CpuChunkLoss<T>> loss_;  // From Start.
  LossTraits traits_;
  bool confidence_ = false;
  int threads_ = 1;
  HeadRunSpec<T> spec_;
  std::unique_ptr<VocabProjection<T>> projection_;
  std::unique_ptr<VocabProjection<T>> correction_;  // With a correction rank.
  ChunkTerms terms_;
  // By batch row: q (the batch-level LK lambda's factor, the accepted
  // lengths) and the target's top-k rank.
  std::vector<double> row_q_;
  // The confidence gradient in double until ScaleGradients rounds it once
  // into gradients.confidence (ConfidenceOf<T>), as the CUDA head does.
  std::vector<double> row_confidence_grad_;
  std::vector<int32_t> row_rank_;
  std::vector<double> row_teacher_;  // The teacher acceptance, when asked.
  // Domino: the final and the base logits' argmax (its greedy lengths).
  std::vector<int32_t> row_argmax_, row_base_argmax_;
  double loss_seconds_ = 0;
  double prepare_seconds_ = 0;
  std::string gemm_library_;
  std::unique_ptr<PreparedProjection> own_prepared_;  // Made for one run.
};

}  // namespace

template <typename T>
std::unique_ptr<HeadBackend<T>> CreateCpuHeadBackend(
    const v1::ObjectiveConfig& config, TrackingAllocator& allocator) {
  return std::make_unique<CpuHeadBackend<T>>(config, allocator);
}

template std::unique_ptr<HeadBackend<float>> CreateCpuHeadBackend<float>(
    const v1::ObjectiveConfig&, TrackingAllocator&);
template std::unique_ptr<HeadBackend<double>> CreateCpuHeadBackend<double>(
    const v1::ObjectiveConfig&, TrackingAllocator&);

}  // namespace dflash
