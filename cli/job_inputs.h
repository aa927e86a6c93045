#ifndef DFLASH_CLI_JOB_INPUTS_H_
#define DFLASH_CLI_JOB_INPUTS_H_

// The dflash_head command's --inputs=DIR: the .npy tensors of a batch
// (docs/command.md lists them). Every header is read and checked against
// the others before any data, so a wrong file fails fast and by name.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "heads/synthetic_batch.h"
#include "io/npy.h"
#include "proto/objective.pb.h"

namespace dflash {

// One .npy file of --inputs: its expected shape (-1: any extent) and types.
struct InputSpec {
  const char* name;
  std::vector<int64_t> shape;
  const std::vector<NpyType>* types;
  // How its indices read in messages.
  const char* axes;
};

// The files a config reads, their headers checked against each other.
struct InputHeaders {
  int64_t batch = 0, seq = 0, anchors = 0, block = 0, hidden = 0, vocab = 0;
  std::map<std::string, NpyHeader> headers;
  std::vector<InputSpec> specs;  // In reading order.
  int64_t largest_file_bytes = 0;
};

// `dir`/`name`, with one slash between them.
std::string JoinPath(const std::string& dir, const std::string& name);

// Reads the headers of every file `config`'s objective needs; shapes are
// checked as each file's extents become known (hidden.npy gives B, N, K, H).
absl::StatusOr<InputHeaders> ReadInputHeaders(
    const std::string& dir, const v1::ObjectiveConfig& config);

// The tensors of --inputs=DIR (docs/semantics.md section 2 derives the
// rows) for a config whose shapes were set from them: T is float for
// FLOAT32, double for FLOAT64. Non-finite values, float64 values that
// overflow float32 when T is float, and mask values other than 0 and 1
// (loss_mask.npy, keep.npy) are errors naming the file and the element's
// index; so is an axis of extent 0.
template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputs(const std::string& dir,
                                        const v1::ObjectiveConfig& config);

// LoadInputs with the headers ReadInputHeaders already read.
template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputsFrom(const std::string& dir,
                                            const InputHeaders& in,
                                            const v1::ObjectiveConfig& config);

// Writes `batch` as the .npy files LoadInputs reads.
template <typename T>
absl::Status SaveInputs(const HeadBatch<T>& batch,
                        const v1::ObjectiveConfig& config, int64_t batch_size,
                        int64_t seq_len, const std::string& dir);

}  // namespace dflash

#endif  // DFLASH_CLI_JOB_INPUTS_H_
