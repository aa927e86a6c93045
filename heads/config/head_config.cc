#include "heads/config/head_config.h"

#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/threads.h"

namespace dflash {

void AddHeadConfigProblems(const v1::HeadConfig& head, ProblemList& problems) {
  if (!head.has_vocab_size()) {
    problems.Add("head.vocab_size", "is required");
  } else if (head.vocab_size() <= 0 ||
             head.vocab_size() > std::numeric_limits<int32_t>::max()) {
    problems.Add("head.vocab_size",
                 absl::StrCat("must lie in [1, 2147483647] (target ids are "
                              "int32), got ",
                              head.vocab_size()));
  }
  if (!head.has_hidden_size()) {
    problems.Add("head.hidden_size", "is required");
  } else if (head.hidden_size() <= 0 ||
             head.hidden_size() > std::numeric_limits<int32_t>::max()) {
    problems.Add("head.hidden_size",
                 absl::StrCat("must lie in [1, 2147483647] (the GEMMs take "
                              "int32 sizes), got ",
                              head.hidden_size()));
  }
  problems.Specified("head.dtype", head.dtype(),
                     v1::HeadConfig::DType_Name(head.dtype()));
  problems.Specified("head.backend", head.backend(),
                     v1::HeadConfig::Backend_Name(head.backend()));
  problems.Specified("head.mode", head.mode(),
                     v1::HeadConfig::ExecutionMode_Name(head.mode()));
  problems.Specified("head.row_selection", head.row_selection(),
                     v1::HeadConfig::RowSelection_Name(head.row_selection()));
  if (head.row_selection() == v1::HeadConfig::ALL_ROWS &&
      head.backend() != v1::HeadConfig::CUDA) {
    // The CPU head finds its weighted rows on the host anyway: projecting
    // the others would cost FLOPs for nothing.
    problems.Add("head.row_selection",
                 "ALL_ROWS is CUDA only (a CPU head projects the rows with "
                 "weight, COMPACT), got ALL_ROWS");
  }
  if (head.device_results()) {
    if (head.backend() != v1::HeadConfig::CUDA) {
      problems.Add("head.device_results",
                   "is CUDA only (a CPU head's results are on the host "
                   "already), got true");
    } else if (head.row_selection() != v1::HeadConfig::ALL_ROWS) {
      // COMPACT finds the weighted rows on the host, before the first
      // chunk.
      problems.Add("head.device_results",
                   absl::StrCat("needs head.row_selection ALL_ROWS (COMPACT "
                                "reads the rows back before its first "
                                "chunk), got true with ",
                                v1::HeadConfig::RowSelection_Name(
                                    head.row_selection())));
    }
  }
  if (head.has_logit_softcap()) {
    problems.AtLeast("head.logit_softcap", head.logit_softcap(), 0);
  }
  problems.Above("head.logit_scale", head.logit_scale(), 0);
  problems.Within("head.threads", head.threads(), 0, kMaxThreads);
  problems.Within("head.metric_top_k", head.metric_top_k(), 0, 64);
  problems.AtLeast("head.correction_rank", head.correction_rank(), 0);
  if (head.has_gradient_filter()) {
    const double filter = head.gradient_filter();
    if (!(filter >= 0 && filter < 1)) {
      problems.Add("head.gradient_filter",
                   absl::StrCat("must lie in [0, 1), got ", filter));
    } else if (filter > 0 && head.backend() == v1::HeadConfig::CUDA) {
      problems.Add("head.gradient_filter",
                   absl::StrCat("is CPU only (the CUDA head computes the "
                                "exact gradient), got ",
                                filter));
    }
  }

  if (head.backend() == v1::HeadConfig::CUDA &&
      head.dtype() == v1::HeadConfig::FLOAT64) {
    problems.Add("head.dtype",
                 "FLOAT64 is not supported on the CUDA backend (FLOAT32 or "
                 "BFLOAT16), got FLOAT64");
  }
  if (head.backend() == v1::HeadConfig::CPU &&
      head.dtype() == v1::HeadConfig::BFLOAT16) {
    problems.Add("head.dtype",
                 "BFLOAT16 is not supported on the CPU backend (FLOAT32 or "
                 "FLOAT64), got BFLOAT16");
  }
}

}  // namespace dflash
