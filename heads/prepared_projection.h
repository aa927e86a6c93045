#ifndef DFLASH_HEADS_PREPARED_PROJECTION_H_
#define DFLASH_HEADS_PREPARED_PROJECTION_H_

// PreparedProjection: a frozen float32 vocabulary projection whose weight is
// laid out once in oneDNN's blocked formats for the head's two GEMMs (the
// logits rows @ W^T and the input gradient dlogits @ W), and reused by every
// chunk of every head run it is given to (HeadOptions::prepared_projection).
// A fresh BLAS call per chunk repacks the whole weight each time; this packs
// it once. Prepare again after the weight changes: nothing watches it.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "heads/projection.h"

namespace dflash {

class PreparedProjection {
 public:
  // Lays out `weight` [vocab, hidden] (row-major, as torch's lm_head) and
  // keeps `bias` [vocab] (or none); both are borrowed and must outlive
  // this object and stay unchanged. Sizes are checked as every projection's
  // (ValidateProjectionShape). `threads`: the GEMMs' threads, 0 for all
  // cores. FailedPrecondition where oneDNN has no optimised kernel for this
  // CPU.
  static absl::StatusOr<std::unique_ptr<PreparedProjection>> Create(
      absl::Span<const float> weight, absl::Span<const float> bias,
      int64_t vocab, int64_t hidden, int threads = 0);
  ~PreparedProjection();
  PreparedProjection(const PreparedProjection&) = delete;
  PreparedProjection& operator=(const PreparedProjection&) = delete;

  int64_t vocab() const;
  int64_t hidden() const;
  // Bytes of the two laid-out copies, and the seconds laying them out took.
  int64_t packed_bytes() const;
  double prepare_seconds() const;

  // Whether it was prepared from exactly these spans (same memory and
  // sizes): a run checks it was given the right one.
  bool PreparedFrom(absl::Span<const float> weight,
                    absl::Span<const float> bias) const;

  // A VocabProjection for one run, borrowing this object: the forward and
  // input-gradient GEMMs on the laid-out weight, on `threads` threads (0:
  // all cores). InputGradientColumns over whole gradient-filter tiles
  // runs on W laid out a tile at a time, made on the first such call (a
  // third copy, not in packed_bytes); other ranges on OpenBLAS. The weight
  // is frozen: AccumulateWeightGradient is an error (status()), AddForward
  // too.
  std::unique_ptr<VocabProjection<float>> NewProjection(int threads) const;

  // The name of the kernels oneDNN picked, e.g. "brg:avx512_core".
  std::string KernelName() const;

  // The laid-out weight and its GEMM primitives (prepared_projection.cc).
  struct Impl;

 private:
  explicit PreparedProjection(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash

#endif  // DFLASH_HEADS_PREPARED_PROJECTION_H_
