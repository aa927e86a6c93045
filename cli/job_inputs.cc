#include "cli/job_inputs.h"

#include <algorithm>
#include <map>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/file.h"
#include "base/status_macros.h"
#include "heads/config/head_facts.h"
#include "io/npy.h"
#include "losses/loss_family.h"

namespace dflash {
namespace {

const std::vector<NpyType> kFloats = {NpyType::kFloat32, NpyType::kFloat64};
const std::vector<NpyType> kInts = {NpyType::kInt32, NpyType::kInt64};
const std::vector<NpyType> kFlags = {NpyType::kBool, NpyType::kUint8,
                                     NpyType::kInt32, NpyType::kInt64};

// An empty axis would reach the config as a zero layout.block_size or
// vocab_size: name it against the file instead.
absl::Status CheckNoEmptyAxis(const NpyHeader& header, const std::string& path,
                              const InputSpec& spec) {
  const std::vector<std::string> axes = absl::StrSplit(
      absl::StripSuffix(absl::StripPrefix(spec.axes, "("), ")"), ", ");
  for (size_t i = 0; i < header.shape.size() && i < axes.size(); ++i) {
    if (header.shape[i] != 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": axis ", axes[i], " of ", spec.axes, " has extent 0 (shape [",
        absl::StrJoin(header.shape, ", "), "]); every axis needs at least 1"));
  }
  return absl::OkStatus();
}

// A float tensor of --inputs in the head's type; non-finite values and,
// for float, float64 values beyond float32 are errors naming the element.
absl::StatusOr<NpyArray> ReadChecked(const std::string& dir,
                                     const InputSpec& spec) {
  const std::string path = JoinPath(dir, spec.name);
  DFLASH_ASSIGN_OR_RETURN(NpyArray array, ReadNpy(path));
  DFLASH_RETURN_IF_ERROR(CheckNpy(array, path, spec.shape, *spec.types));
  return array;
}

template <typename T>
absl::StatusOr<std::vector<T>> ReadFloats(const std::string& dir,
                                          const InputSpec& spec,
                                          const v1::ObjectiveConfig& config) {
  const std::string path = JoinPath(dir, spec.name);
  DFLASH_ASSIGN_OR_RETURN(NpyArray array, ReadChecked(dir, spec));
  auto where = [&](const NpyElement& e) {
    return absl::StrCat(spec.axes, " = (", absl::StrJoin(e.index, ", "), ")");
  };
  if (std::optional<NpyElement> bad = FirstNonFinite(array)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": value ", bad->value, " at ", where(*bad),
                     " is not finite; inputs must be finite"));
  }
  if constexpr (std::is_same_v<T, float>) {
    if (std::optional<NpyElement> big = FirstFloat32Overflow(array)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": value ", big->value, " at ", where(*big),
                       " overflows float32, the head's dtype (",
                       v1::HeadConfig::DType_Name(config.head().dtype()),
                       "); rescale it or use head.dtype FLOAT64"));
    }
    return NpyToFloat(array);
  } else {
    return NpyToFloat64(array);
  }
}

absl::StatusOr<std::vector<int64_t>> ReadInts(const std::string& dir,
                                              const InputSpec& spec) {
  DFLASH_ASSIGN_OR_RETURN(NpyArray array, ReadChecked(dir, spec));
  return NpyToInt64(array);
}

// A [rows, columns] mask of 0 and 1: any other value (a -1 padding
// sentinel, a 255) is an error naming its index, not read as 1.
absl::StatusOr<std::vector<uint8_t>> ReadMask(const std::string& dir,
                                              const InputSpec& spec) {
  DFLASH_ASSIGN_OR_RETURN(std::vector<int64_t> values, ReadInts(dir, spec));
  const int64_t columns = spec.shape[1];
  std::vector<uint8_t> mask(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] != 0 && values[i] != 1) {
      const int64_t at = static_cast<int64_t>(i);
      return absl::InvalidArgumentError(absl::StrCat(
          JoinPath(dir, spec.name), ": value ", values[i], " at ", spec.axes,
          " = (", at / columns, ", ", at % columns,
          ") is not 0 or 1; a mask holds 0 (off) or 1 (on)"));
    }
    mask[i] = static_cast<uint8_t>(values[i]);
  }
  return mask;
}

const InputSpec* FindSpec(const InputHeaders& in, absl::string_view name) {
  for (const InputSpec& spec : in.specs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}
}  // namespace

std::string JoinPath(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

absl::StatusOr<InputHeaders> ReadInputHeaders(
    const std::string& dir, const v1::ObjectiveConfig& config) {
  InputHeaders in;
  auto read = [&](InputSpec spec) -> absl::StatusOr<const NpyHeader*> {
    const std::string path = JoinPath(dir, spec.name);
    DFLASH_ASSIGN_OR_RETURN(NpyHeader header, ReadNpyHeader(path));
    DFLASH_RETURN_IF_ERROR(CheckNpy(header, path, spec.shape, *spec.types));
    DFLASH_RETURN_IF_ERROR(CheckNoEmptyAxis(header, path, spec));
    in.largest_file_bytes = std::max(in.largest_file_bytes, header.data_bytes);
    in.specs.push_back(spec);
    return &(in.headers[spec.name] = std::move(header));
  };
  DFLASH_ASSIGN_OR_RETURN(
      const NpyHeader* hidden,
      read({"hidden.npy", {-1, -1, -1, -1}, &kFloats, "(b, n, k, h)"}));
  in.batch = hidden->shape[0];
  in.anchors = hidden->shape[1];
  in.block = hidden->shape[2];
  in.hidden = hidden->shape[3];
  const int64_t b = in.batch, n = in.anchors, k = in.block, h = in.hidden;
  DFLASH_ASSIGN_OR_RETURN(const NpyHeader* weight,
                          read({"lm_head.npy", {-1, h}, &kFloats, "(v, h)"}));
  in.vocab = weight->shape[0];
  DFLASH_ASSIGN_OR_RETURN(const NpyHeader* ids,
                          read({"input_ids.npy", {b, -1}, &kInts, "(b, s)"}));
  in.seq = ids->shape[1];
  std::vector<InputSpec> rest = {
      {"loss_mask.npy", {b, in.seq}, &kFlags, "(b, s)"},
      {"anchors.npy", {b, n}, &kInts, "(b, n)"},
      {"keep.npy", {b, n}, &kFlags, "(b, n)"}};
  if (config.head().bias()) {
    rest.push_back({"lm_head_bias.npy", {in.vocab}, &kFloats, "(v)"});
  }
  if (ProjectsTeacher(config)) {
    rest.push_back(
        {"teacher_hidden.npy", {b, n, k, h}, &kFloats, "(b, n, k, h)"});
  }
  if (LossTraitsOf(config.loss()).needs_confidence) {
    rest.push_back({"confidence_logits.npy", {b, n, k}, &kFloats, "(b, n, k)"});
  }
  if (const int64_t r = config.head().correction_rank(); r > 0) {
    rest.push_back(
        {"correction_inputs.npy", {b, n, k, r}, &kFloats, "(b, n, k, r)"});
    rest.push_back({"correction_weight.npy", {in.vocab, r}, &kFloats, "(v, r)"});
  }
  for (const InputSpec& spec : rest) {
    if (absl::StatusOr<const NpyHeader*> ok = read(spec); !ok.ok()) {
      return ok.status();
    }
  }
  return in;
}

template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputsFrom(const std::string& dir,
                                            const InputHeaders& in,
                                            const v1::ObjectiveConfig& config) {
  const int64_t b = in.batch, s = in.seq, n = in.anchors, k = in.block,
                v = in.vocab;
  if (k != config.layout().block_size() || n != config.layout().num_anchors() ||
      in.hidden != config.head().hidden_size() ||
      v != config.head().vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir,
        ": the files' shapes changed after the config was made from "
        "them"));
  }
  HeadBatch<T> batch;
  DFLASH_ASSIGN_OR_RETURN(std::vector<int64_t> ids,
                          ReadInts(dir, *FindSpec(in, "input_ids.npy")));
  batch.input_ids = std::move(ids);
  DFLASH_ASSIGN_OR_RETURN(batch.loss_mask,
                          ReadMask(dir, *FindSpec(in, "loss_mask.npy")));
  DFLASH_ASSIGN_OR_RETURN(std::vector<int64_t> anchors,
                          ReadInts(dir, *FindSpec(in, "anchors.npy")));
  DFLASH_ASSIGN_OR_RETURN(batch.anchors.keep,
                          ReadMask(dir, *FindSpec(in, "keep.npy")));
  batch.anchors.num_anchors = n;
  batch.anchors.positions = std::move(anchors);
  absl::StatusOr<std::vector<RowMeta>> rows = LabelRows(
      {b, s, batch.input_ids, batch.loss_mask}, batch.anchors.positions,
      batch.anchors.keep, n, k, v,
      LossTraitsOf(config.loss()).labeling);
  if (!rows.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": ", rows.status().message()));
  }
  batch.rows = *std::move(rows);
  const std::pair<const char*, std::vector<T>*> floats[] = {
      {"hidden.npy", &batch.hidden},
      {"lm_head.npy", &batch.weight},
      {"lm_head_bias.npy", &batch.bias},
      {"teacher_hidden.npy", &batch.teacher_hidden},
      {"correction_inputs.npy", &batch.correction_inputs},
      {"correction_weight.npy", &batch.correction_weight}};
  for (const auto& [name, out] : floats) {
    const InputSpec* spec = FindSpec(in, name);
    if (spec == nullptr) continue;
    DFLASH_ASSIGN_OR_RETURN(std::vector<T> values,
                            ReadFloats<T>(dir, *spec, config));
    *out = std::move(values);
  }
  if (const InputSpec* spec = FindSpec(in, "confidence_logits.npy")) {
    // In ConfidenceOf<T>: float64 for a FLOAT64 head, else float32.
    v1::ObjectiveConfig as_float = config;
    if (!std::is_same_v<ConfidenceOf<T>, double>) {
      as_float.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
    }
    DFLASH_ASSIGN_OR_RETURN(std::vector<ConfidenceOf<T>> values,
                            ReadFloats<ConfidenceOf<T>>(dir, *spec, as_float));
    batch.confidence_logits = std::move(values);
  }
  return batch;
}

template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputs(const std::string& dir,
                                        const v1::ObjectiveConfig& config) {
  DFLASH_ASSIGN_OR_RETURN(InputHeaders in, ReadInputHeaders(dir, config));
  return LoadInputsFrom<T>(dir, in, config);
}

template <typename T>
absl::Status SaveInputs(const HeadBatch<T>& batch,
                        const v1::ObjectiveConfig& config, int64_t batch_size,
                        int64_t seq_len, const std::string& dir) {
  const int64_t n = batch.anchors.num_anchors, k = config.layout().block_size();
  const int64_t h = config.head().hidden_size(), v = config.head().vocab_size();
  const std::vector<std::pair<std::string, NpyArray>> files = {
      {"hidden.npy", MakeNpy<T>(batch.hidden, {batch_size, n, k, h})},
      {"lm_head.npy", MakeNpy<T>(batch.weight, {v, h})},
      {"lm_head_bias.npy", MakeNpy<T>(batch.bias, {v})},
      {"input_ids.npy",
       MakeNpy<int64_t>(batch.input_ids, {batch_size, seq_len})},
      {"loss_mask.npy",
       MakeNpy<uint8_t>(batch.loss_mask, {batch_size, seq_len})},
      {"anchors.npy",
       MakeNpy<int64_t>(batch.anchors.positions, {batch_size, n})},
      {"keep.npy", MakeNpy<uint8_t>(batch.anchors.keep, {batch_size, n})},
      {"teacher_hidden.npy",
       MakeNpy<T>(batch.teacher_hidden, {batch_size, n, k, h})},
      {"confidence_logits.npy",
       MakeNpy<ConfidenceOf<T>>(batch.confidence_logits, {batch_size, n, k})},
      {"correction_inputs.npy",
       MakeNpy<T>(batch.correction_inputs,
                  {batch_size, n, k, config.head().correction_rank()})},
      {"correction_weight.npy",
       MakeNpy<T>(batch.correction_weight,
                  {v, config.head().correction_rank()})},
  };
  OutputFileSet out;
  for (const auto& [name, array] : files) {
    if (array.data.empty() && name != "hidden.npy") continue;
    if (absl::Status ok =
            StageNpy(out, JoinPath(dir, name), array.type, array.shape, array.data);
        !ok.ok()) {
      return ok;
    }
  }
  return out.Commit();
}

template absl::StatusOr<HeadBatch<float>> LoadInputs<float>(
    const std::string&, const v1::ObjectiveConfig&);
template absl::StatusOr<HeadBatch<double>> LoadInputs<double>(
    const std::string&, const v1::ObjectiveConfig&);
template absl::StatusOr<HeadBatch<float>> LoadInputsFrom<float>(
    const std::string&, const InputHeaders&, const v1::ObjectiveConfig&);
template absl::StatusOr<HeadBatch<double>> LoadInputsFrom<double>(
    const std::string&, const InputHeaders&, const v1::ObjectiveConfig&);
template absl::Status SaveInputs<float>(const HeadBatch<float>&,
                                        const v1::ObjectiveConfig&, int64_t,
                                        int64_t, const std::string&);
template absl::Status SaveInputs<double>(const HeadBatch<double>&,
                                         const v1::ObjectiveConfig&, int64_t,
                                         int64_t, const std::string&);

}  // namespace dflash
