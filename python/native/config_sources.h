#ifndef DFLASH_PYTHON_NATIVE_CONFIG_SOURCES_H_
#define DFLASH_PYTHON_NATIVE_CONFIG_SOURCES_H_

#include <string>

#include "absl/status/statusor.h"
#include "proto/objective.pb.h"

namespace dflash::python {

// Where the binding's configs come from; keyword overrides on top are
// ApplyOverrides (proto/config_overrides.h) with OverrideNames::kKeywords.

// configs/dflash_default.textproto, compiled in.
absl::StatusOr<v1::ObjectiveConfig> DefaultConfig();

// A text-format file, parsed as ParseObjectiveConfig does (no defaults, no
// validation: the tensors fill the shapes at each call); NotFound when it
// cannot be read.
absl::StatusOr<v1::ObjectiveConfig> ConfigFromFile(const std::string& path);

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_CONFIG_SOURCES_H_
