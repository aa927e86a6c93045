#include "losses/cuda_chunk_loss_from_host.h"

#include <cstdint>
#include <memory>

#include "absl/types/span.h"
#include "base/status_macros.h"
#include "losses/chunk_loss.h"
#include "losses/cuda_chunk_loss.h"
#include "losses/loss_params.h"

namespace dflash {
namespace {

// A device copy of a host span (empty stays empty).
template <typename U>
absl::StatusOr<TrackedBuffer<U>> Upload(absl::Span<const U> host,
                                        CudaStream& stream) {
  DFLASH_ASSIGN_OR_RETURN(
      TrackedBuffer<U> device,
      TrackedBuffer<U>::Create(stream.allocator(),
                               static_cast<int64_t>(host.size())));
  if (absl::Status ok =
          stream.CopyToDevice(device.data(), host.data(), device.bytes());
      !ok.ok()) {
    return ok;
  }
  return device;
}

template <typename U>
absl::Span<U> View(TrackedBuffer<U>& buffer) {
  return absl::MakeSpan(buffer.data(), buffer.size());
}

}  // namespace

template <typename T>
absl::StatusOr<ChunkTerms> CudaChunkLossFromHost(
    const v1::LossConfig& config, const ChunkLossOptions& options,
    const ChunkLossInputs<T>& inputs, const ChunkLossOutputs& outputs,
    CudaStream& stream) {
  DFLASH_RETURN_IF_ERROR(CheckCudaChunkLimits(
      inputs.vocab, static_cast<int64_t>(inputs.rows.size())));
  auto logits = Upload<T>(inputs.logits, stream);
  auto teacher = Upload<T>(inputs.teacher_logits, stream);
  auto confidence = Upload<ConfidenceOf<T>>(inputs.confidence_logits, stream);
  auto confidence_grad = Upload<double>(outputs.confidence_grad, stream);
  auto neg_log_q = Upload<double>(outputs.neg_log_q, stream);
  auto argmax = Upload<int32_t>(outputs.argmax, stream);
  auto top_k = Upload<int32_t>(outputs.top_k, stream);
  auto target_probability = Upload<double>(outputs.target_probability, stream);
  auto target_rank = Upload<int32_t>(outputs.target_rank, stream);
  auto top_k_values = Upload<float>(outputs.top_k_values, stream);
  auto loss_weight = Upload<double>(outputs.loss_weight, stream);
  auto teacher_acceptance = Upload<double>(outputs.teacher_acceptance, stream);
  auto correction = Upload<T>(inputs.correction_logits, stream);
  auto base_argmax = Upload<int32_t>(outputs.base_argmax, stream);
  auto teacher_argmax = Upload<int32_t>(outputs.teacher_argmax, stream);
  for (const absl::Status& status :
       {logits.status(), teacher.status(), confidence.status(),
        confidence_grad.status(), neg_log_q.status(), argmax.status(),
        top_k.status(), target_probability.status(), target_rank.status(),
        top_k_values.status(), loss_weight.status(),
        teacher_acceptance.status(), correction.status(),
        base_argmax.status(), teacher_argmax.status()}) {
    if (!status.ok()) return status;
  }
  DFLASH_ASSIGN_OR_RETURN(LossParams params, ResolveChunkLoss(config));
  DFLASH_ASSIGN_OR_RETURN(std::unique_ptr<CudaChunkLoss<T>> loss,
                          CudaChunkLoss<T>::Create(params, options, stream));
  const ChunkLossInputs<T> device_inputs{
      View(*logits), View(*teacher),    View(*confidence), inputs.rows,
      inputs.vocab,  View(*correction), inputs.row_stride,
      inputs.rows_checked};
  const ChunkLossOutputs device_outputs{View(*confidence_grad),
                                        View(*neg_log_q),
                                        View(*argmax),
                                        View(*top_k),
                                        outputs.k,
                                        View(*target_probability),
                                        View(*target_rank),
                                        View(*top_k_values),
                                        View(*loss_weight),
                                        View(*teacher_acceptance),
                                        View(*base_argmax),
                                        View(*teacher_argmax)};
  DFLASH_RETURN_IF_ERROR(loss->Run(device_inputs, device_outputs,
                                     /*out_rows=*/nullptr, /*record=*/true));
  DFLASH_ASSIGN_OR_RETURN(ChunkTerms terms, loss->Terms());
  struct Back {
    void* host;
    const void* device;
    int64_t bytes;
  };
  for (const Back& back :
       {Back{inputs.logits.data(), logits->data(), logits->bytes()},
        Back{outputs.confidence_grad.data(), confidence_grad->data(),
             confidence_grad->bytes()},
        Back{outputs.neg_log_q.data(), neg_log_q->data(), neg_log_q->bytes()},
        Back{outputs.argmax.data(), argmax->data(), argmax->bytes()},
        Back{outputs.top_k.data(), top_k->data(), top_k->bytes()},
        Back{outputs.target_probability.data(), target_probability->data(),
             target_probability->bytes()},
        Back{outputs.target_rank.data(), target_rank->data(),
             target_rank->bytes()},
        Back{outputs.top_k_values.data(), top_k_values->data(),
             top_k_values->bytes()},
        Back{outputs.loss_weight.data(), loss_weight->data(),
             loss_weight->bytes()},
        Back{outputs.teacher_acceptance.data(), teacher_acceptance->data(),
             teacher_acceptance->bytes()},
        Back{inputs.correction_logits.data(), correction->data(),
             correction->bytes()},
        Back{outputs.base_argmax.data(), base_argmax->data(),
             base_argmax->bytes()},
        Back{outputs.teacher_argmax.data(), teacher_argmax->data(),
             teacher_argmax->bytes()}}) {
    if (back.bytes == 0) continue;
    DFLASH_RETURN_IF_ERROR(
        stream.CopyToHost(back.host, back.device, back.bytes));
  }
  return terms;
}

template absl::StatusOr<ChunkTerms> CudaChunkLossFromHost<float>(
    const v1::LossConfig&, const ChunkLossOptions&,
    const ChunkLossInputs<float>&, const ChunkLossOutputs&, CudaStream&);
template absl::StatusOr<ChunkTerms> CudaChunkLossFromHost<BFloat16>(
    const v1::LossConfig&, const ChunkLossOptions&,
    const ChunkLossInputs<BFloat16>&, const ChunkLossOutputs&, CudaStream&);

}  // namespace dflash
