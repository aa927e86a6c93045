#ifndef DFLASH_LOSSES_DEVICE_RESULTS_H_
#define DFLASH_LOSSES_DEVICE_RESULTS_H_

// The layout of a CUDA head's device results (head.device_results,
// docs/cuda.md "Results on the device"): one buffer of doubles in device
// memory that the head's finish kernel writes at the end of its forward
// pass, so that a run never reads the device. Shared by the kernel, the
// head's host reader (ReadDeviceResults, heads/cuda_head.h) and the
// binding, which views it as a tensor.
//
//   [kResultRowsStatus]  BuildCudaRows's error word, its 64 bits stored in
//                        the slot (cuda::kNoRowsError, all ones: none);
//   [kResultLossStatus]  the loss's error word (cuda::kNoError: none);
//   [kResultLoss .. kResultLkKlWeight]  FinishTerms' FinishedLoss;
//   [DeviceSummedResult(i)]  ChunkTerms' summed terms, in the table's order
//                        (losses/chunk_terms.inc), finished as HeadResult's
//                        terms are (loss_num composed, SEQUENCE_BALANCED
//                        loss_den);
//   [DevicePositionResult(t, k, K)]  the per-position terms, [K] each;
//   [DeviceBlockResult(b, K)]  the accepted-length terms.
// Where a status word is set, every other slot is NaN.
//
// The status words are 64-bit codes stored bitwise in double slots, not
// numbers: kResultStatusClear (no error, all ones) reads as a NaN, and an
// error code may read as any double (a canonicalising conversion could
// even change it). So the buffer is read with CheckDeviceResults /
// ReadDeviceResults (heads/cuda_head.h) or the binding's
// check_objective_results, never tested with isfinite as a whole, and
// never summed or all-reduced across ranks: only the slots from
// kResultLoss on are numbers (the terms' slices are the ones to reduce).

#include <cstdint>

#include "base/host_device.h"
#include "losses/term_slots.h"

namespace dflash {

enum DeviceResultSlot : int {
  kResultRowsStatus = 0,
  kResultLossStatus,
  kResultLoss,
  kResultDenominator,
  kResultAccuracy,
  kResultGradientScale,
  kResultConfidenceScale,
  // The batch-level LK lambda's kl_w; NaN for other compositions.
  kResultLkKlWeight,
  kResultSummed,
};

constexpr int kSummedTerms = 0
#define DFLASH_SUMMED_TERM(field, slot, dict, key) +1
#include "losses/chunk_terms.inc"
    ;
constexpr int kBlockTerms = 0
#define DFLASH_BLOCK_TERM(field, dict, key) +1
#include "losses/chunk_terms.inc"
    ;

// A status word's "no error", the same bits for both words:
// cuda::kNoRowsError (heads/cuda_head_kernels.h) and cuda::kNoError
// (losses/cuda_row_kernels.h), which heads/cuda_head.cc asserts equal this.
constexpr unsigned long long kResultStatusClear = ~0ull;

// The block terms BlockTermsKernel (heads/cuda_head_kernels.cu) sums, by
// their index in the table (DeviceBlockResult's b), checked against the
// table's names below so that a reordered table fails to compile.
enum DeviceBlockTerm : int {
  kDeviceBlockDen = 0,
  kDeviceBlockExpectedNum,
  kDeviceBlockOracleNum,
  kDeviceBlockTeacherExpectedNum,
};
constexpr const char* kBlockTermNames[kBlockTerms] = {
#define DFLASH_BLOCK_TERM(field, dict, key) #field,
#include "losses/chunk_terms.inc"
};
constexpr bool SameBlockTermName(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || SameBlockTermName(a + 1, b + 1));
}
static_assert(
    SameBlockTermName(kBlockTermNames[kDeviceBlockDen], "block_den") &&
    SameBlockTermName(kBlockTermNames[kDeviceBlockExpectedNum],
                      "expected_num") &&
    SameBlockTermName(kBlockTermNames[kDeviceBlockOracleNum], "oracle_num") &&
    SameBlockTermName(kBlockTermNames[kDeviceBlockTeacherExpectedNum],
                      "teacher_expected_num"));

// The TermSlot of the i-th summed term.
DFLASH_HOST_DEVICE constexpr int SummedSlot(int i) {
  constexpr int kSlots[kSummedTerms] = {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) slot,
#include "losses/chunk_terms.inc"
  };
  return kSlots[i];
}

// loss_num and loss_den, the terms the finish changes, lead the table.
constexpr int kSummedLossNum = 0, kSummedLossDen = 1;
static_assert(SummedSlot(kSummedLossNum) == kLossNum &&
              SummedSlot(kSummedLossDen) == kLossDen);

DFLASH_HOST_DEVICE constexpr int64_t DeviceSummedResult(int i) {
  return kResultSummed + i;
}
DFLASH_HOST_DEVICE constexpr int64_t DevicePositionResult(int t, int64_t k,
                                                          int64_t block_size) {
  return kResultSummed + kSummedTerms + t * block_size + k;
}
DFLASH_HOST_DEVICE constexpr int64_t DeviceBlockResult(int b,
                                                       int64_t block_size) {
  return kResultSummed + kSummedTerms + kPositionTerms * block_size + b;
}
// The doubles a buffer for blocks of `block_size` positions holds.
DFLASH_HOST_DEVICE constexpr int64_t DeviceResultsSize(int64_t block_size) {
  return DeviceBlockResult(kBlockTerms, block_size);
}

// The accepted-length kernel's output (heads/cuda_head_kernels.h), before
// the finish: the block terms in the table's order, then SEQUENCE_BALANCED
// D-PACE's weighted sequences (WeightedSequences, chunk_loss.h).
constexpr int kBlockWeightedSequences = kBlockTerms;
constexpr int kBlockTermsSize = kBlockTerms + 1;

// What the head keeps of the finish on the device for its gradient
// scaling (ScaleGradients without a host read): FinishedLoss's scales, kl_w
// and denominator as the finish kernel wrote them, and the final scales
// (upstream folded in) that the scaling kernels read.
enum DeviceFinishSlot : int {
  kFinishGradientScale = 0,
  kFinishConfidenceScale,
  kFinishLkKlWeight,
  kFinishDenominator,
  kFinishScaledGradient,
  kFinishScaledConfidence,
  kFinishSlots,
};

}  // namespace dflash

#endif  // DFLASH_LOSSES_DEVICE_RESULTS_H_
