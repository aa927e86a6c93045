#include "heads/cuda_head.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/status_macros.h"
#include "heads/config/head_facts.h"
#include "heads/cuda_head_kernels.h"
#include "heads/head_backend.h"
#include "heads/top_k_gradient.h"
#include "losses/accepted_length.h"
#include "losses/cuda_chunk_loss.h"
#include "losses/cuda_row_kernels.h"
#include "losses/device_results.h"
#include "losses/loss_math.h"
#include "losses/loss_family.h"
#include "losses/row_error.h"

namespace dflash {
namespace {

// BuildCudaRows's error word as RowsOf's error (python/native/objective.cc)
// about the element's row; the caller names the tensors' values.
absl::Status RowsError(const v1::ObjectiveConfig& config,
                       unsigned long long code) {
  const int64_t element = static_cast<int64_t>(code >> 2);
  switch (static_cast<cuda::RowsErrorKind>(code & 3)) {
    case cuda::kRowsMaskInvalid:
      return RowError(element, "weight_mask: must be finite and >= 0");
    case cuda::kRowsMaskSumOverflow:
      return RowError(element,
                      "weight_mask: its values sum to more than float32 "
                      "holds by this element; the loss and accuracy "
                      "denominators would be inf");
    default:
      return RowError(
          element,
          absl::StrCat("target_ids: must lie in [0, V = ",
                       config.head().vocab_size(), ") or be ignore_index (",
                       config.loss().cross_entropy().ignore_index(),
                       ") where weight_mask > 0"));
  }
}

// The CUDA backend of RunHeadOn: cuBLAS, the CUDA loss, device memory.
template <typename T>
class CudaHeadBackend final : public HeadBackend<T> {
 public:
  CudaHeadBackend(const v1::ObjectiveConfig& config, CublasHandle& blas)
      : config_(config),
        blas_(blas),
        stream_(blas.stream()),
        device_results_(config.head().device_results()) {}

  Device device() const override { return Device::kCuda; }
  TrackingAllocator& allocator() override { return stream_.allocator(); }
  VocabProjection<T>& projection() override { return *projection_; }
  VocabProjection<T>* correction() override { return correction_.get(); }

  absl::Status Start(const HeadRunSpec<T>& spec) override {
    spec_ = spec;
    traits_ = LossTraitsOf(*spec.params);
    confidence_ = traits_.needs_confidence;
    const v1::HeadConfig& head = config_.head();
    // The FP32 sums of BF16 weight gradients are read through weight_sum_ptr_
    // and correction_sum_ptr_, which StartGradients sets.
    DFLASH_ASSIGN_OR_RETURN(
        std::unique_ptr<VocabProjection<T>> projection,
        CreateCudaProjection<T>(spec.inputs->weight, spec.inputs->bias,
                                head.vocab_size(), head.hidden_size(), blas_,
                                &weight_sum_ptr_, &input_alpha_));
    projection_ = std::move(projection);
    if (const int64_t rank = head.correction_rank(); rank > 0) {
      DFLASH_ASSIGN_OR_RETURN(
          correction_,
          CreateCudaProjection<T>(spec.inputs->correction_weight, {},
                                  head.vocab_size(), rank, blas_,
                                  &correction_sum_ptr_, &input_alpha_));
    }
    DFLASH_ASSIGN_OR_RETURN(
        std::unique_ptr<CudaChunkLoss<T>> loss,
        CudaChunkLoss<T>::Create(*spec.params,
                                 ChunkLossOptionsOf(config_, spec.vocab_shard),
                                 stream_, spec.max_chunk_rows));
    loss_ = std::move(loss);
    const int64_t rows = RowCount(*spec.inputs);
    // The active rows on the device: chunks index into them, and the loss
    // writes per-row outputs through them.
    DFLASH_ASSIGN_OR_RETURN(
        TrackedBuffer<int64_t> active,
        TrackedBuffer<int64_t>::Create(
            allocator(), static_cast<int64_t>(spec.active.size())));
    active_ = std::move(active);
    host_active_.assign(spec.active.begin(), spec.active.end());
    all_rows_ = config_.head().row_selection() == v1::HeadConfig::ALL_ROWS;
    if (all_rows_) {
      // Every row, from the rows on the device (the caller's, or a copy of
      // its host rows): active_ lists them all, weighted_ the rows with
      // weight (-1 for the others, gathered as zeros, never scattered).
      device_meta_ = spec.inputs->device_rows.rows;
      if (!spec.inputs->rows.empty()) {
        DFLASH_ASSIGN_OR_RETURN(
            TrackedBuffer<RowMeta> meta,
            TrackedBuffer<RowMeta>::Create(allocator(), rows));
        own_meta_ = std::move(meta);
        DFLASH_RETURN_IF_ERROR(stream_.CopyToDevice(
            own_meta_.data(), spec.inputs->rows.data(), own_meta_.bytes()));
        device_meta_ = own_meta_.data();
      }
      DFLASH_ASSIGN_OR_RETURN(
          TrackedBuffer<int64_t> weighted,
          TrackedBuffer<int64_t>::Create(allocator(), rows));
      weighted_ = std::move(weighted);
      cuda::LaunchRowLists(device_meta_, rows, *spec.params, active_.data(),
                           weighted_.data(), stream_.stream());
    } else {
      DFLASH_RETURN_IF_ERROR(stream_.CopyToDevice(
          active_.data(), host_active_.data(), active_.bytes()));
    }
    const HeadRowOutputs& o = *spec.row_outputs;
    for (const auto& [data, bytes] :
         {std::pair<void*, size_t>{o.neg_log_q.data(),
                                   o.neg_log_q.size() * sizeof(double)},
          {o.top_k_values.data(), o.top_k_values.size() * sizeof(float)},
          {o.loss_weight.data(), o.loss_weight.size() * sizeof(double)}}) {
      DFLASH_RETURN_IF_ERROR(stream_.Zero(data, static_cast<int64_t>(bytes)));
    }
    cuda::LaunchFillInt32(o.argmax.data(), o.argmax.size(), -1,
                          stream_.stream());
    cuda::LaunchFillInt32(o.base_argmax.data(), o.base_argmax.size(), -1,
                          stream_.stream());
    cuda::LaunchFillInt32(o.teacher_argmax.data(), o.teacher_argmax.size(), -1,
                          stream_.stream());
    cuda::LaunchFillInt32(o.top_k.data(), o.top_k.size(), -1, stream_.stream());
    DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<double> q,
                            TrackedBuffer<double>::Create(allocator(), rows));
    row_q_ = std::move(q);
    DFLASH_RETURN_IF_ERROR(stream_.Zero(row_q_.data(), row_q_.bytes()));
    if (confidence_ && spec.keeps_confidence_gradient) {
      // The loss writes it in double; ScaleGradients rounds it once.
      DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<double> confidence,
                              TrackedBuffer<double>::Create(allocator(), rows));
      row_confidence_ = std::move(confidence);
      DFLASH_RETURN_IF_ERROR(
          stream_.Zero(row_confidence_.data(), row_confidence_.bytes()));
    }
    if (ChunkLossOptionsOf(config_).metric_top_k > 0) {
      DFLASH_ASSIGN_OR_RETURN(
          TrackedBuffer<int32_t> rank,
          TrackedBuffer<int32_t>::Create(allocator(), rows));
      row_rank_ = std::move(rank);
      cuda::LaunchFillInt32(row_rank_.data(), rows, -1, stream_.stream());
    }
    if (RecordsTeacherAcceptance(config_)) {
      DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<double> teacher,
                              TrackedBuffer<double>::Create(allocator(), rows));
      row_teacher_ = std::move(teacher);
      DFLASH_RETURN_IF_ERROR(
          stream_.Zero(row_teacher_.data(), row_teacher_.bytes()));
    }
    if (device_results_) {
      for (auto [buffer, size] :
           {std::pair<TrackedBuffer<double>*, int64_t>{&finish_, kFinishSlots},
            {&block_terms_, kBlockTermsSize}}) {
        DFLASH_ASSIGN_OR_RETURN(
            TrackedBuffer<double> created,
            TrackedBuffer<double>::Create(allocator(), size));
        *buffer = std::move(created);
      }
    }
    if (traits_.splits_correction) {
      // Domino's greedy accepted lengths read both argmaxes of every row.
      for (TrackedBuffer<int32_t>* buffer :
           {&row_argmax_, &row_base_argmax_}) {
        DFLASH_ASSIGN_OR_RETURN(
            TrackedBuffer<int32_t> created,
            TrackedBuffer<int32_t>::Create(allocator(), rows));
        *buffer = std::move(created);
        cuda::LaunchFillInt32(buffer->data(), rows, -1, stream_.stream());
      }
    }
    return stream_.LaunchStatus("head start");
  }

  absl::Status StartGradients(const HeadGradients<T>& g) override {
    spec_.gradients = &g;
    // Until the run tells the scale (InputGradientScale), alpha is 1.
    input_scale_.reset();
    input_alpha_ = 1;
    const v1::HeadConfig& head = config_.head();
    if constexpr (std::is_same_v<T, BFloat16>) {
      // A trainable BF16 weight's gradient (the bias's after it) and a BF16
      // correction weight's are summed over chunks in FP32 and rounded
      // once, when scaled.
      if (head.trainable()) {
        DFLASH_RETURN_IF_ERROR(ZeroedSum(
            head.vocab_size() * head.hidden_size() +
                (head.bias() ? head.vocab_size() : 0),
            weight_sum_, weight_sum_ptr_));
      }
      if (const int64_t rank = head.correction_rank(); rank > 0) {
        DFLASH_RETURN_IF_ERROR(ZeroedSum(head.vocab_size() * rank,
                                         correction_sum_,
                                         correction_sum_ptr_));
      }
    }
    for (const auto& [data, bytes] :
         {std::pair<void*, size_t>{g.hidden.data(),
                                   g.hidden.size() * sizeof(T)},
          {g.weight.data(), g.weight.size() * sizeof(T)},
          {g.bias.data(), g.bias.size() * sizeof(T)},
          {g.confidence.data(),
           g.confidence.size() * sizeof(ConfidenceOf<T>)},
          {g.correction_inputs.data(), g.correction_inputs.size() * sizeof(T)},
          {g.correction_weight.data(),
           g.correction_weight.size() * sizeof(T)}}) {
      DFLASH_RETURN_IF_ERROR(stream_.Zero(data, static_cast<int64_t>(bytes)));
    }
    return stream_.LaunchStatus("gradient start");
  }

  absl::Status GatherRows(const T* source, int64_t width, int64_t begin,
                          int64_t count, T* out) override {
    cuda::LaunchGatherRows<T>(source, width, RowList() + begin, count, out,
                              stream_.stream());
    return stream_.LaunchStatus("row gather");
  }

  absl::Status ScatterRows(const T* rows, int64_t width, int64_t begin,
                           int64_t count, T* out) override {
    cuda::LaunchScatterRows<T>(rows, width, RowList() + begin, count, out,
                               stream_.stream());
    return stream_.LaunchStatus("row scatter");
  }

  absl::Status ChunkLoss(int64_t chunk, int64_t begin, int64_t m, T* logits,
                         const T* teacher, T* correction,
                         bool record) override {
    const HeadInputs<T>& in = *spec_.inputs;
    const HeadRowOutputs& o = *spec_.row_outputs;
    const int64_t vocab = config_.head().vocab_size();
    // The projection's rows, padded to 16 bytes for the loss's vector loads.
    const int64_t stride = projection_->logits_stride();
    std::vector<RowMeta>& meta = chunk_meta_;
    meta.clear();
    if (!all_rows_) {
      meta.resize(m);
      for (int64_t i = 0; i < m; ++i) {
        meta[i] = in.rows[host_active_[begin + i]];
      }
    }
    auto if_recorded = [record](auto span) {
      return record ? span : decltype(span)();
    };
    const ChunkLossInputs<T> inputs{
        absl::MakeSpan(logits, m * stride),
        teacher == nullptr ? absl::Span<const T>()
                           : absl::MakeConstSpan(teacher, m * stride),
        in.confidence_logits,
        meta,
        vocab,
        correction == nullptr ? absl::Span<T>()
                              : absl::MakeSpan(correction, m * stride),
        stride,
        // HeadRun::Validate checked every row once for the whole run.
        /*rows_checked=*/true};
    // The confidence gradient only where the loss has one to write.
    const ChunkLossOutputs outputs{
        if_recorded(
            absl::MakeSpan(row_confidence_.data(), row_confidence_.size())),
        if_recorded(o.neg_log_q),
        row_argmax_.size() > 0
            ? absl::MakeSpan(row_argmax_.data(), row_argmax_.size())
            : if_recorded(o.argmax),
        if_recorded(o.top_k),
        o.k,
        // A recomputation writes the same q and rank again.
        absl::MakeSpan(row_q_.data(), row_q_.size()),
        absl::MakeSpan(row_rank_.data(), row_rank_.size()),
        if_recorded(o.top_k_values), if_recorded(o.loss_weight),
        absl::MakeSpan(row_teacher_.data(), row_teacher_.size()),
        absl::MakeSpan(row_base_argmax_.data(), row_base_argmax_.size()),
        if_recorded(o.teacher_argmax)};
    // ALL_ROWS: the chunk's rows are rows [begin, begin + m) of the batch.
    absl::Status done =
        all_rows_ ? loss_->RunDeviceRows(device_meta_ + begin, m, inputs,
                                         outputs, active_.data() + begin,
                                         record)
                  : loss_->Run(inputs, outputs, active_.data() + begin, record);
    if (!done.ok()) {
      return NameChunkLossError(done, config_.layout(), chunk,
                                absl::MakeConstSpan(host_active_).subspan(begin, m));
    }
    return absl::OkStatus();
  }

  absl::Status Synchronize() override { return stream_.Synchronize(); }

  absl::StatusOr<std::vector<RowMeta>> ReadRows(
      const DeviceRows& rows) override {
    unsigned long long code = cuda::kNoRowsError;
    DFLASH_RETURN_IF_ERROR(
        stream_.CopyToHost(&code, rows.error, sizeof(code)));
    if (code != cuda::kNoRowsError) return RowsError(config_, code);
    std::vector<RowMeta> host(static_cast<size_t>(rows.count));
    DFLASH_RETURN_IF_ERROR(stream_.CopyToHost(
        host.data(), rows.rows,
        rows.count * static_cast<int64_t>(sizeof(RowMeta))));
    return host;
  }

  // Not with the scale on the device (head.device_results): cuBLAS's alpha
  // is a host value here, so ScaleGradients scales the input gradients
  // (a BF16 one is rounded twice, as FUSED's is).
  bool folds_gradient_scale() const override { return !device_results_; }

  absl::Status FinishOnDevice(int64_t sequences, double* results) override {
    results_ = results;
    const HeadInputs<T>& in = *spec_.inputs;
    const int64_t rows = RowCount(in);
    cuda::LaunchBlockTerms(
        device_meta_, rows, config_.layout().block_size(),
        traits_.first_accepted_position, *spec_.params, row_q_.data(),
        row_rank_.size() > 0 ? row_rank_.data() : nullptr,
        row_teacher_.size() > 0 ? row_teacher_.data() : nullptr,
        block_terms_.data(), stream_.stream());
    DFLASH_RETURN_IF_ERROR(stream_.LaunchStatus("accepted lengths"));
    DFLASH_RETURN_IF_ERROR(loss_->FinishOnDevice(
        in.rows.empty() ? in.device_rows.error : nullptr, block_terms_.data(),
        sequences, results, finish_.data()));
    const HeadRowOutputs& o = *spec_.row_outputs;
    cuda::RowOutputs poisoned;
    poisoned.neg_log_q = o.neg_log_q.data();
    poisoned.neg_log_q_count = static_cast<int64_t>(o.neg_log_q.size());
    poisoned.top_k_values = o.top_k_values.data();
    poisoned.top_k_values_count = static_cast<int64_t>(o.top_k_values.size());
    poisoned.loss_weight = o.loss_weight.data();
    poisoned.loss_weight_count = static_cast<int64_t>(o.loss_weight.size());
    poisoned.argmax = o.argmax.data();
    poisoned.argmax_count = static_cast<int64_t>(o.argmax.size());
    poisoned.top_k = o.top_k.data();
    poisoned.top_k_count = static_cast<int64_t>(o.top_k.size());
    poisoned.teacher_argmax = o.teacher_argmax.data();
    poisoned.teacher_argmax_count =
        static_cast<int64_t>(o.teacher_argmax.size());
    cuda::LaunchPoisonRowOutputs(results, poisoned, stream_.stream());
    return stream_.LaunchStatus("row output poisoning");
  }
  void InputGradientScale(double scale) override {
    input_scale_ = scale;
    input_alpha_ = static_cast<float>(scale);
  }

  absl::StatusOr<ChunkTerms> Terms() override {
    DFLASH_ASSIGN_OR_RETURN(ChunkTerms terms, loss_->Terms());
    // The accepted lengths chain whole blocks: from the rows' q and rank.
    std::vector<double> q(row_q_.size());
    std::vector<int32_t> rank(row_rank_.size());
    std::vector<double> teacher(row_teacher_.size());
    DFLASH_RETURN_IF_ERROR(
        stream_.CopyToHost(q.data(), row_q_.data(), row_q_.bytes()));
    DFLASH_RETURN_IF_ERROR(
        stream_.CopyToHost(rank.data(), row_rank_.data(), row_rank_.bytes()));
    DFLASH_RETURN_IF_ERROR(stream_.CopyToHost(
        teacher.data(), row_teacher_.data(), row_teacher_.bytes()));
    terms.accepted_length = AcceptedLengths(
        spec_.inputs->rows, q, rank, teacher, config_.layout().block_size(),
        traits_.first_accepted_position);
    if (row_argmax_.size() > 0) {
      std::vector<int32_t> argmax(row_argmax_.size()),
          base_argmax(row_base_argmax_.size());
      DFLASH_RETURN_IF_ERROR(stream_.CopyToHost(
          argmax.data(), row_argmax_.data(), row_argmax_.bytes()));
      DFLASH_RETURN_IF_ERROR(stream_.CopyToHost(
          base_argmax.data(), row_base_argmax_.data(),
          row_base_argmax_.bytes()));
      AddGreedyAcceptedLengths(spec_.inputs->rows, argmax, base_argmax,
                               config_.layout().block_size(),
                               terms.accepted_length);
      // The caller's argmax outputs, where asked: the final and the base
      // logits'.
      const HeadRowOutputs& o = *spec_.row_outputs;
      if (!o.argmax.empty()) {
        DFLASH_RETURN_IF_ERROR(stream_.CopyToDevice(
            o.argmax.data(), argmax.data(), row_argmax_.bytes()));
      }
      if (!o.base_argmax.empty()) {
        DFLASH_RETURN_IF_ERROR(stream_.CopyToDevice(
            o.base_argmax.data(), base_argmax.data(),
            row_base_argmax_.bytes()));
      }
      if (!o.argmax.empty() || !o.base_argmax.empty()) {
        DFLASH_RETURN_IF_ERROR(stream_.Synchronize());
      }
    }
    return terms;
  }

  absl::Status ScaleGradients(double upstream,
                              const DeviceUpstream* device_upstream,
                              const FinishedLoss& finished) override {
    if (device_results_) return ScaleOnDevice(upstream, device_upstream);
    if (device_upstream != nullptr) {
      return absl::InvalidArgumentError(
          "upstream: an upstream in device memory needs head.device_results");
    }
    const HeadGradients<T>& g = *spec_.gradients;
    const double scale = upstream * finished.gradient_scale;
    const std::optional<double>& kl_weight = finished.lk_kl_weight;
    CUstream_st* stream = stream_.stream();
    if (input_scale_) {
      // Already in the input gradients: it must be the scale the loss ended
      // with.
      if (!(std::abs(*input_scale_ - scale) <= 1e-9 * std::abs(scale))) {
        return absl::InternalError(absl::StrCat(
            "the gradient scale folded into the input gradients (",
            *input_scale_,
            ") differs from the finished one (", scale, ")"));
      }
    } else if (kl_weight) {
      cuda::LaunchScaleRowsByLkFactor<T>(
          g.hidden.data(), config_.head().hidden_size(), active_.data(),
          active_.size(), row_q_.data(), *kl_weight, scale, stream);
    } else {
      cuda::LaunchScale<T>(g.hidden.data(), g.hidden.size(), scale, stream);
    }
    if (weight_sum_.size() > 0) {
      cuda::LaunchScaleToStorage<T>(weight_sum_.data(), g.weight.size(), scale,
                                    g.weight.data(), stream);
      cuda::LaunchScaleToStorage<T>(weight_sum_.data() + g.weight.size(),
                                    g.bias.size(), scale, g.bias.data(),
                                    stream);
    } else {
      cuda::LaunchScale<T>(g.weight.data(), g.weight.size(), scale, stream);
      cuda::LaunchScale<T>(g.bias.data(), g.bias.size(), scale, stream);
    }
    if (!input_scale_) {
      cuda::LaunchScale<T>(g.correction_inputs.data(),
                           g.correction_inputs.size(), scale, stream);
    }
    if (correction_sum_.size() > 0) {
      cuda::LaunchScaleToStorage<T>(correction_sum_.data(),
                                    correction_sum_.size(), scale,
                                    g.correction_weight.data(), stream);
    } else {
      cuda::LaunchScale<T>(g.correction_weight.data(),
                           g.correction_weight.size(), scale, stream);
    }
    cuda::LaunchScaleDoubleToFloat(row_confidence_.data(),
                                   row_confidence_.size(),
                                   upstream * finished.confidence_scale,
                                   g.confidence.data(), stream);
    DFLASH_RETURN_IF_ERROR(stream_.LaunchStatus("gradient scaling"));
    // A split run's recomputed chunks are done: it holds no loss scratch
    // between its passes.
    loss_->ReleaseScratch();
    DFLASH_RETURN_IF_ERROR(stream_.Synchronize());
    // The device has read the recomputed chunks' host rows (a split run's
    // backward reads no terms, which would free them). ScaleOnDevice's
    // chunks are device rows (head.device_results needs ALL_ROWS), which
    // leave none.
    loss_->ReleaseHostRows();
    // Rounded into the gradients: a split run does not hold them between
    // its passes (StartGradients allocates them again).
    weight_sum_.Reset();
    correction_sum_.Reset();
    weight_sum_ptr_ = correction_sum_ptr_ = nullptr;
    return absl::OkStatus();
  }

  double loss_seconds() const override { return 0; }
  std::string gemm_library() const override { return "cuBLAS"; }

 private:
  // ScaleGradients from the device's finish (head.device_results): the
  // final scales made on the device, every scaling kernel reading them
  // there; queued, no wait (frees are stream-ordered).
  absl::Status ScaleOnDevice(double upstream,
                             const DeviceUpstream* device_upstream) {
    const HeadGradients<T>& g = *spec_.gradients;
    CUstream_st* stream = stream_.stream();
    cuda::LaunchDeviceScales(
        finish_.data(), results_, config_.layout().block_size(), upstream,
        device_upstream != nullptr ? device_upstream->value : nullptr,
        device_upstream != nullptr && device_upstream->is_float,
        device_upstream != nullptr && device_upstream->of_loss_num, stream);
    const double* scale = finish_.data() + kFinishScaledGradient;
    if (spec_.params->lk == LkMode::kLambdaBatch) {
      cuda::LaunchScaleRowsByLkFactor<T>(
          g.hidden.data(), config_.head().hidden_size(), active_.data(),
          active_.size(), row_q_.data(), 0, 0, stream, finish_.data());
    } else {
      cuda::LaunchScale<T>(g.hidden.data(), g.hidden.size(), 1, stream, scale);
    }
    if (weight_sum_.size() > 0) {
      cuda::LaunchScaleToStorage<T>(weight_sum_.data(), g.weight.size(), 1,
                                    g.weight.data(), stream, scale);
      cuda::LaunchScaleToStorage<T>(weight_sum_.data() + g.weight.size(),
                                    g.bias.size(), 1, g.bias.data(), stream,
                                    scale);
    } else {
      cuda::LaunchScale<T>(g.weight.data(), g.weight.size(), 1, stream, scale);
      cuda::LaunchScale<T>(g.bias.data(), g.bias.size(), 1, stream, scale);
    }
    cuda::LaunchScale<T>(g.correction_inputs.data(),
                         g.correction_inputs.size(), 1, stream, scale);
    if (correction_sum_.size() > 0) {
      cuda::LaunchScaleToStorage<T>(correction_sum_.data(),
                                    correction_sum_.size(), 1,
                                    g.correction_weight.data(), stream, scale);
    } else {
      cuda::LaunchScale<T>(g.correction_weight.data(),
                           g.correction_weight.size(), 1, stream, scale);
    }
    cuda::LaunchScaleDoubleToFloat(row_confidence_.data(),
                                   row_confidence_.size(), 1,
                                   g.confidence.data(), stream,
                                   finish_.data() + kFinishScaledConfidence);
    DFLASH_RETURN_IF_ERROR(stream_.LaunchStatus("gradient scaling"));
    loss_->ReleaseScratch();
    weight_sum_.Reset();
    correction_sum_.Reset();
    weight_sum_ptr_ = correction_sum_ptr_ = nullptr;
    return absl::OkStatus();
  }

  // The gather and scatter list: ALL_ROWS's weighted rows (-1 elsewhere),
  // else the active rows.
  const int64_t* RowList() const {
    return all_rows_ ? weighted_.data() : active_.data();
  }

  // `size` zeroed floats in `sum` (allocated once), `data` pointing at them.
  absl::Status ZeroedSum(int64_t size, TrackedBuffer<float>& sum,
                         float*& data) {
    if (sum.size() != size) {
      sum.Reset();
      DFLASH_ASSIGN_OR_RETURN(TrackedBuffer<float> created,
                              TrackedBuffer<float>::Create(allocator(), size));
      sum = std::move(created);
    }
    data = sum.data();
    return stream_.Zero(sum.data(), sum.bytes());
  }

  const v1::ObjectiveConfig& config_;
  CublasHandle& blas_;
  CudaStream& stream_;
  LossTraits traits_;  // The run's (Start).
  bool confidence_ = false;
  HeadRunSpec<T> spec_;
  // Folded into the input gradients: the scale and the GEMMs' alpha.
  std::optional<double> input_scale_;
  float input_alpha_ = 1;
  std::unique_ptr<VocabProjection<T>> projection_;
  std::unique_ptr<VocabProjection<T>> correction_;  // With a correction rank.
  // A BF16 correction weight's and trainable weight's gradients, summed in
  // FP32 from StartGradients to ScaleGradients; the projections read the
  // pointers (null: none).
  TrackedBuffer<float> correction_sum_, weight_sum_;
  float* correction_sum_ptr_ = nullptr;
  float* weight_sum_ptr_ = nullptr;
  std::unique_ptr<CudaChunkLoss<T>> loss_;
  TrackedBuffer<int64_t> active_;
  // By batch row: q (the batch-level LK lambda's factor, the accepted
  // lengths) and the target's top-k rank.
  TrackedBuffer<double> row_q_;
  TrackedBuffer<int32_t> row_rank_;
  TrackedBuffer<double> row_teacher_;  // The teacher acceptance, when asked.
  // Domino: the final and the base logits' argmax (its greedy lengths).
  TrackedBuffer<int32_t> row_argmax_, row_base_argmax_;
  // DSpark's confidence gradient by batch row, in double (the loss's), for
  // ScaleGradients to round into gradients.confidence.
  TrackedBuffer<double> row_confidence_;
  std::vector<int64_t> host_active_;
  std::vector<RowMeta> chunk_meta_;
  // head.row_selection ALL_ROWS: the rows on the device (the caller's
  // device rows or own_meta_, a copy of its host rows) and weighted_.
  bool all_rows_ = false;
  const RowMeta* device_meta_ = nullptr;
  TrackedBuffer<RowMeta> own_meta_;
  TrackedBuffer<int64_t> weighted_;
  // head.device_results: the finish's scales (DeviceFinishSlot) and the
  // accepted-length terms before it (kBlockTermsSize), on the device.
  const bool device_results_;
  TrackedBuffer<double> finish_, block_terms_;
  // The caller's results (FinishOnDevice's), where ScaleOnDevice latches a
  // non-finite device upstream.
  double* results_ = nullptr;
};

// RunCudaHead's and StartCudaHead's checks of the target and the options.
template <typename T>
absl::Status CheckCudaHead(const v1::ObjectiveConfig& config,
                           const HeadOptions& options, const char* call) {
  constexpr v1::HeadConfig::DType kDType = std::is_same_v<T, float>
                                               ? v1::HeadConfig::FLOAT32
                                               : v1::HeadConfig::BFLOAT16;
  if (absl::Status ok =
          CheckHeadTarget(config.head(), v1::HeadConfig::CUDA, kDType, call,
                          "CUDA heads run FLOAT32 or BFLOAT16");
      !ok.ok()) {
    return ok;
  }
  if (config.head().device_results() && config.loss().has_domino()) {
    return absl::InvalidArgumentError(
        "head.device_results: loss.domino's greedy accepted lengths are taken "
        "on the host, so it does not finish on the device; got true with "
        "loss.domino");
  }
  return absl::OkStatus();
}

}  // namespace

// The kernels test both status words against kResultStatusClear.
static_assert(cuda::kNoRowsError == kResultStatusClear &&
              cuda::kNoError == kResultStatusClear);

absl::Status DeviceResultsStatus(const v1::ObjectiveConfig& config,
                                 const double* words) {
  unsigned long long rows_word = 0, loss_word = 0;
  std::memcpy(&rows_word, words + kResultRowsStatus, sizeof(rows_word));
  std::memcpy(&loss_word, words + kResultLossStatus, sizeof(loss_word));
  if (rows_word != kResultStatusClear) {
    return NameBatchRowError(RowsError(config, rows_word), config.layout());
  }
  if (cuda::IsUpstreamErrorCode(loss_word)) {
    // SplitHeadRun::Backward's refusal of a host upstream, word for word.
    return absl::InvalidArgumentError(absl::StrCat(
        "upstream: must be finite, got ",
        static_cast<double>(cuda::DecodeErrorCode(loss_word).value)));
  }
  if (loss_word != kResultStatusClear) {
    return NameBatchRowError(CudaLossError(loss_word), config.layout());
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaRows> BuildCudaRows(const v1::ObjectiveConfig& config,
                                       const cuda::RowsTensor& target_ids,
                                       const cuda::RowsTensor& weight_mask,
                                       int64_t batch, int64_t anchors,
                                       CudaStream& stream) {
  const int64_t k = config.layout().block_size();
  if (batch < 0 || anchors < 0 || k < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BuildCudaRows: the batch [B, N, K] must have B, N >= 0 and K = "
        "layout.block_size >= 1, got [",
        batch, ", ", anchors, ", ", k, "]"));
  }
  if (target_ids.dtype != cuda::kRowsInt32 &&
      target_ids.dtype != cuda::kRowsInt64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_ids: must be int32 or int64, got dtype code ",
        target_ids.dtype));
  }
  if (weight_mask.dtype != cuda::kRowsFloat32 &&
      weight_mask.dtype != cuda::kRowsFloat64 &&
      weight_mask.dtype != cuda::kRowsBool) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_mask: must be float32, float64 or bool, got dtype code ",
        weight_mask.dtype));
  }
  const int64_t total = batch * anchors * k;
  cuda::BuildRowsParams params;
  params.batch = batch;
  params.anchors = anchors;
  params.block = k;
  params.vocab = config.head().vocab_size();
  params.ignore_index = config.loss().cross_entropy().ignore_index();
  params.loss = LossParamsOf(config.loss());
  params.count_ignored = params.loss.count_ignored;
  // The CUDA head's terms are float32 (its tensors float32 or bfloat16).
  params.float64_terms = false;
  params.max_sum = std::numeric_limits<float>::max();
  const int64_t num_anchors = config.layout().num_anchors();
  params.sequence_rows = num_anchors > 0 ? num_anchors * k : total;
  TrackingAllocator& allocator = stream.allocator();
  CudaRows rows;
  DFLASH_ASSIGN_OR_RETURN(rows.rows,
                          TrackedBuffer<RowMeta>::Create(allocator, total));
  DFLASH_ASSIGN_OR_RETURN(
      rows.error, TrackedBuffer<unsigned long long>::Create(allocator, 1));
  // Freed as this returns, after the build in the stream's order.
  DFLASH_ASSIGN_OR_RETURN(
      TrackedBuffer<double> tile_sums,
      TrackedBuffer<double>::Create(
          allocator, (total + cuda::kRowsSumTile - 1) / cuda::kRowsSumTile));
  cuda::LaunchBuildRows(target_ids, weight_mask, params, rows.rows.data(),
                        rows.error.data(), tile_sums.data(), stream.stream());
  DFLASH_RETURN_IF_ERROR(stream.LaunchStatus("row build"));
  return rows;
}

absl::Status CheckDeviceResults(const v1::ObjectiveConfig& config,
                                const double* results, CudaStream& stream) {
  double words[2];
  static_assert(kResultRowsStatus == 0 && kResultLossStatus == 1);
  DFLASH_RETURN_IF_ERROR(stream.CopyToHost(words, results, sizeof(words)));
  return DeviceResultsStatus(config, words);
}

absl::StatusOr<HeadResult> ReadDeviceResults(const v1::ObjectiveConfig& config,
                                             const double* results,
                                             CudaStream& stream) {
  const int64_t k = config.layout().block_size();
  std::vector<double> host(static_cast<size_t>(DeviceResultsSize(k)));
  DFLASH_RETURN_IF_ERROR(stream.CopyToHost(
      host.data(), results, static_cast<int64_t>(host.size() * sizeof(double))));
  DFLASH_RETURN_IF_ERROR(DeviceResultsStatus(config, host.data()));
  HeadResult r;
  r.loss = host[kResultLoss];
  r.loss_denominator = host[kResultDenominator];
  r.loss_den_offset = LossDenOffset(LossParamsOf(config.loss()).family);
  r.accuracy = host[kResultAccuracy];
  if (!std::isnan(host[kResultLkKlWeight])) {
    r.lk_kl_weight = host[kResultLkKlWeight];
  }
  int summed = 0, position = 0, block = 0;
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  r.terms.field = host[DeviceSummedResult(summed++)];
#define DFLASH_POSITION_TERM(field, slot, dict, key)                  \
  r.terms.field.assign(host.begin() + DevicePositionResult(position, 0, k), \
                       host.begin() + DevicePositionResult(position, k, k)); \
  ++position;
#define DFLASH_BLOCK_TERM(field, dict, key) \
  r.terms.accepted_length.field = host[DeviceBlockResult(block++, k)];
#include "losses/chunk_terms.inc"
  for (int64_t p = 0; p < k; ++p) {
    const double mass = r.terms.mask_per_position[p];
    r.accuracy_per_position.push_back(
        mass > 0 ? r.terms.correct_per_position[p] / mass : 0);
  }
  return r;
}

absl::StatusOr<std::optional<CudaRowsError>> ReadCudaRowsError(
    const DeviceRows& rows, CudaStream& stream) {
  unsigned long long code = cuda::kNoRowsError;
  DFLASH_RETURN_IF_ERROR(stream.CopyToHost(&code, rows.error, sizeof(code)));
  if (code == cuda::kNoRowsError) return std::nullopt;
  return CudaRowsError{static_cast<int64_t>(code >> 2),
                       static_cast<cuda::RowsErrorKind>(code & 3)};
}

template <typename T>
absl::StatusOr<HeadResult> RunCudaHead(const v1::ObjectiveConfig& config,
                                       const HeadInputs<T>& inputs,
                                       const HeadGradients<T>& gradients,
                                       CublasHandle& blas,
                                       const HeadRowOutputs& row_outputs,
                                       const HeadOptions& options) {
  DFLASH_RETURN_IF_ERROR(CheckCudaHead<T>(config, options, "RunCudaHead"));
  CudaHeadBackend<T> backend(config, blas);
  absl::StatusOr<HeadResult> result =
      RunHeadOn<T>(config, inputs, gradients, backend, row_outputs, options);
  // A failed run may have left kernels queued on the caller's buffers: wait
  // for them, so that nothing writes after the error has been returned.
  if (!result.ok()) blas.stream().Synchronize().IgnoreError();
  return result;
}

template <typename T>
absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> StartCudaHead(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    CublasHandle& blas, const HeadRowOutputs& row_outputs,
    const HeadOptions& options) {
  DFLASH_RETURN_IF_ERROR(CheckCudaHead<T>(config, options, "StartCudaHead"));
  // SplitHeadRun::Forward waits for queued work when it fails.
  return SplitHeadRun<T>::Forward(
      config, inputs, std::make_unique<CudaHeadBackend<T>>(config, blas),
      row_outputs, options);
}

template <typename T>
absl::Status AddCudaTopKValueGradients(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    absl::Span<const int32_t> ids, absl::Span<const float> values,
    absl::Span<const float> grad_values, int32_t k,
    const HeadGradients<T>& gradients, CudaStream& stream) {
  const v1::HeadConfig& head = config.head();
  std::vector<int32_t> host_ids(ids.size());
  DFLASH_RETURN_IF_ERROR(stream.CopyToHost(host_ids.data(), ids.data(),
                                           ids.size() * sizeof(int32_t)));
  const int64_t rows = k > 0 ? static_cast<int64_t>(ids.size()) / k : 0;
  DFLASH_RETURN_IF_ERROR(ValidateTopKValueGradients(
      config, rows, inputs.hidden.size(), inputs.weight.size(),
      gradients.hidden.size(), gradients.weight.size(), host_ids, values.size(),
      grad_values.size(), k));
  DFLASH_RETURN_IF_ERROR(ValidateTopKCorrection(
      config, rows, inputs.correction_inputs.size(),
      inputs.correction_weight.size(), gradients.correction_inputs.size(),
      gradients.correction_weight.size()));
  T* grad_weight = head.trainable() ? gradients.weight.data() : nullptr;
  T* grad_bias = head.trainable() && !gradients.bias.empty()
                     ? gradients.bias.data()
                     : nullptr;
  auto or_null = [](absl::Span<T> span) {
    return span.empty() ? nullptr : span.data();
  };
  cuda::LaunchAddTopKValueGradients<T>(
      inputs.hidden.data(), inputs.weight.data(), ids.data(), values.data(),
      grad_values.data(), rows, k, head.hidden_size(), head.logit_scale(),
      head.logit_softcap(), gradients.hidden.data(), grad_weight, grad_bias,
      inputs.correction_inputs.data(), inputs.correction_weight.data(),
      head.correction_rank(), or_null(gradients.correction_inputs),
      or_null(gradients.correction_weight), stream.stream());
  return stream.LaunchStatus("top-k value gradients");
}

template absl::Status AddCudaTopKValueGradients<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&,
    absl::Span<const int32_t>, absl::Span<const float>, absl::Span<const float>,
    int32_t, const HeadGradients<float>&, CudaStream&);
template absl::Status AddCudaTopKValueGradients<BFloat16>(
    const v1::ObjectiveConfig&, const HeadInputs<BFloat16>&,
    absl::Span<const int32_t>, absl::Span<const float>, absl::Span<const float>,
    int32_t, const HeadGradients<BFloat16>&, CudaStream&);

template absl::StatusOr<HeadResult> RunCudaHead<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&,
    const HeadGradients<float>&, CublasHandle&, const HeadRowOutputs&,
    const HeadOptions&);
template absl::StatusOr<HeadResult> RunCudaHead<BFloat16>(
    const v1::ObjectiveConfig&, const HeadInputs<BFloat16>&,
    const HeadGradients<BFloat16>&, CublasHandle&, const HeadRowOutputs&,
    const HeadOptions&);

template absl::StatusOr<std::unique_ptr<SplitHeadRun<float>>>
StartCudaHead<float>(const v1::ObjectiveConfig&, const HeadInputs<float>&,
                     CublasHandle&, const HeadRowOutputs&, const HeadOptions&);
template absl::StatusOr<std::unique_ptr<SplitHeadRun<BFloat16>>>
StartCudaHead<BFloat16>(const v1::ObjectiveConfig&,
                        const HeadInputs<BFloat16>&, CublasHandle&,
                        const HeadRowOutputs&, const HeadOptions&);

}  // namespace dflash
