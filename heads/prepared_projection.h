#ifndef DFLASH_HEADS_PREPARED_PROJECTION_H_
#define DFLASH_HEADS_PREPARED_PROJECTION_H_

// PreparedProjection: a frozen float32 vocabulary projection whose weight is
// laid out once in oneDNN's blocked formats for the head's two GEMMs (the
// logits rows @ W^T and the input gradient dlogits @ W), and reused by every
// chunk of every head run it is given to (HeadOptions::prepared_projection).
// A fresh BLAS call per chunk repacks the whole weight each time; this packs
// it once. A weight written in place since is found by its checksum at the
// next run (Revalidate) and laid out again there.

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
  // this object. Sizes are checked as every projection's
  // (ValidateProjectionShape). `threads`: the layout's threads (0: every
  // usable CPU; ResolveThreads). FailedPrecondition where oneDNN has no
  // optimised kernel for this CPU; ResourceExhausted naming the bytes when
  // memory runs out.
  static absl::StatusOr<std::unique_ptr<PreparedProjection>> Create(
      absl::Span<const float> weight, absl::Span<const float> bias,
      int64_t vocab, int64_t hidden, int threads = 0);

  // The bytes Create lays out for a [vocab, hidden] weight (both copies),
  // with `filter_tiles` also the gradient filter's tile copy; nothing is
  // allocated.
  static absl::StatusOr<int64_t> LaidOutBytes(int64_t vocab, int64_t hidden,
                                              bool filter_tiles);

  // Compares the weight and bias with their checksum when last laid out
  // (one pass over them on `threads` >= 1 threads, ~5 ms for 128 MiB) and
  // lays them out again in place if they changed: true then. A run given
  // this object calls it first, so a weight written behind its back (a
  // torch `.data` write) is never served stale.
  absl::StatusOr<bool> Revalidate(int threads) const;
  ~PreparedProjection();
  PreparedProjection(const PreparedProjection&) = delete;
  PreparedProjection& operator=(const PreparedProjection&) = delete;

  int64_t vocab() const;
  int64_t hidden() const;
  // Bytes of the two laid-out copies, and the seconds laying them out (or
  // out again) took.
  int64_t packed_bytes() const;
  // packed_bytes() and the gradient filter's tile copy where made (at the
  // first filtered GEMM): what this object holds now.
  int64_t held_bytes() const;
  double prepare_seconds() const;

  // Whether it was prepared from exactly these spans (same memory and
  // sizes): a run checks it was given the right one.
  bool PreparedFrom(absl::Span<const float> weight,
                    absl::Span<const float> bias) const;

  // A VocabProjection for one run, borrowing this object: the forward and
  // input-gradient GEMMs on the laid-out weight, on `threads` threads (a
  // count from ResolveThreads). InputGradientColumns over whole gradient-filter tiles
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
