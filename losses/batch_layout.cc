#include "losses/batch_layout.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

absl::Status CheckTokens(const TokenBatch& tokens) {
  if (tokens.batch <= 0 || tokens.seq_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch layout: batch and seq_len must be > 0, got ",
                     tokens.batch, " and ", tokens.seq_len));
  }
  const int64_t size = tokens.batch * tokens.seq_len;
  if (static_cast<int64_t>(tokens.input_ids.size()) != size ||
      static_cast<int64_t>(tokens.loss_mask.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch layout: input_ids and loss_mask must hold batch x seq_len = ",
        size, " values, got ", tokens.input_ids.size(), " and ",
        tokens.loss_mask.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Anchors> SampleAnchors(
    const TokenBatch& tokens, int64_t num_anchors, uint64_t seed,
    std::optional<int64_t> max_valid_anchors) {
  DFLASH_RETURN_IF_ERROR(CheckTokens(tokens));
  if (num_anchors <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch layout: num_anchors must be > 0, got ", num_anchors));
  }
  if (max_valid_anchors.has_value() && *max_valid_anchors < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch layout: max_valid_anchors must be >= 0, got ",
                     *max_valid_anchors));
  }
  const int64_t s_len = tokens.seq_len;
  std::vector<std::vector<int64_t>> candidates(tokens.batch);
  int64_t most = 0;
  for (int64_t b = 0; b < tokens.batch; ++b) {
    const uint8_t* mask = tokens.loss_mask.data() + b * s_len;
    for (int64_t p = 0; p + 1 < s_len; ++p) {
      if (mask[p] && mask[p + 1]) candidates[b].push_back(p);
    }
    most = std::max<int64_t>(most, candidates[b].size());
  }
  const int64_t width = std::min(num_anchors, max_valid_anchors.value_or(most));
  if (width == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch layout: DFlash-family training requires two consecutive "
        "supervised tokens, got ",
        most == 0
            ? absl::StrCat("none in any of the ", tokens.batch, " sequence(s)")
            : "max_valid_anchors 0"));
  }
  std::mt19937_64 rng(seed);
  Anchors anchors;
  anchors.num_anchors = width;
  anchors.positions.assign(tokens.batch * width, 0);
  anchors.keep.assign(tokens.batch * width, 0);
  for (int64_t b = 0; b < tokens.batch; ++b) {
    std::vector<int64_t>& valid = candidates[b];
    const int64_t take = std::min<int64_t>(width, valid.size());
    for (int64_t i = 0; i < take; ++i) {  // Partial Fisher-Yates.
      std::uniform_int_distribution<int64_t> pick(i, valid.size() - 1);
      std::swap(valid[i], valid[pick(rng)]);
    }
    std::sort(valid.begin(), valid.begin() + take);
    for (int64_t i = 0; i < take; ++i) {
      anchors.positions[b * width + i] = valid[i];
      anchors.keep[b * width + i] = 1;
    }
  }
  return anchors;
}

absl::StatusOr<std::vector<RowMeta>> LabelRows(const TokenBatch& tokens,
                                               absl::Span<const int64_t> anchors,
                                               absl::Span<const uint8_t> keep,
                                               int64_t num_anchors,
                                               int64_t block_size,
                                               int64_t vocab,
                                               Labeling labeling) {
  DFLASH_RETURN_IF_ERROR(CheckTokens(tokens));
  if (num_anchors <= 0 || block_size <= 0 || vocab <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch layout: num_anchors, block_size and vocab must be > 0, got ",
        num_anchors, ", ", block_size, " and ", vocab));
  }
  const int64_t blocks = tokens.batch * num_anchors;
  if (static_cast<int64_t>(anchors.size()) != blocks ||
      static_cast<int64_t>(keep.size()) != blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch layout: anchors and keep must hold batch x num_anchors = ",
        blocks, " values, got ", anchors.size(), " and ", keep.size()));
  }
  const int64_t s_len = tokens.seq_len;
  const int64_t first = labeling == Labeling::kDFlash ? 0 : 1;
  std::vector<RowMeta> rows(blocks * block_size);
  for (int64_t b = 0; b < tokens.batch; ++b) {
    for (int64_t n = 0; n < num_anchors; ++n) {
      const int64_t block = b * num_anchors + n;
      RowMeta* out = rows.data() + block * block_size;
      for (int64_t k = 0; k < block_size; ++k) {
        out[k].position = static_cast<int32_t>(k);
        out[k].block = block;
      }
      if (!keep[block]) continue;
      const int64_t anchor = anchors[block];
      if (anchor < 0 || anchor >= s_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "batch layout: anchor (", b, ", ", n, ") = ", anchor,
            " is outside [0, ", s_len, ")"));
      }
      bool contiguous = true;
      for (int64_t k = 0; k < block_size; ++k) {
        const int64_t s = anchor + first + k;
        const bool in_range = s < s_len;
        const bool supervised = in_range && tokens.loss_mask[b * s_len + s];
        bool weighted;
        if (labeling == Labeling::kDSpark) {
          contiguous = contiguous && supervised;
          weighted = contiguous;
        } else if (labeling == Labeling::kShifted) {
          weighted = supervised;
        } else {
          weighted = k > 0 && supervised;
        }
        if (!weighted) continue;
        const int64_t id = tokens.input_ids[b * s_len + s];
        if (id < 0 || id >= vocab) {
          return absl::InvalidArgumentError(
              absl::StrCat("batch layout: input_ids (", b, ", ", s, ") = ", id,
                           " is outside [0, ", vocab, ")"));
        }
        out[k].target = static_cast<int32_t>(id);
        out[k].mask = 1.0f;
      }
    }
  }
  return rows;
}

}  // namespace dflash
