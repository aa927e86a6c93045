#ifndef DFLASH_HEADS_GRADIENT_FILTER_H_
#define DFLASH_HEADS_GRADIENT_FILTER_H_

// Gradient filtering in the manner of Cut Cross-Entropy, for the head's
// input-gradient GEMM (head.gradient_filter): the vocabulary tiles of a
// chunk's d(loss)/d(logits) that hold an entry worth multiplying; the rest
// of the tiles are skipped. Opt-in, as it changes the gradient.

#include <cstdint>
#include <vector>

namespace dflash {

// Vocabulary entries per tile.
inline constexpr int64_t kGradientFilterTile = 256;

// A range [begin, end) of vocabulary ids.
struct VocabRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// The tiles of `tile` ids (the last may be shorter) of grad [rows, vocab]
// in which some row has |g| >= threshold * (that row's largest |g|),
// merged into ascending runs; `skipped_tiles` gets the count of the others.
// A tile is skipped only when every row's entries in it are below the
// cut, so each skipped entry is below its row's cut. Rows run on `threads`
// OpenMP threads (0: OpenMP's default). T: float or double.
template <typename T>
std::vector<VocabRange> KeptVocabRanges(const T* grad, int64_t rows,
                                        int64_t vocab, double threshold,
                                        int64_t tile, int64_t& skipped_tiles,
                                        int threads = 0);

}  // namespace dflash

#endif  // DFLASH_HEADS_GRADIENT_FILTER_H_
