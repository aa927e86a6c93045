#include "python/native/config_sources.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "configs/default_config.h"
#include "proto/config.h"

namespace dflash::python {

absl::StatusOr<v1::ObjectiveConfig> DefaultConfig() {
  return ParseObjectiveConfig(DefaultObjectiveConfigText(),
                              kDefaultConfigSource);
}

absl::StatusOr<v1::ObjectiveConfig> ConfigFromFile(const std::string& path) {
  // A regular file only (a FIFO would block); the OS's reason otherwise.
  constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
  absl::StatusOr<std::string> text = ReadFileToString(path, kMaxConfigBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("config: ", text.status().message()));
  }
  return ParseObjectiveConfig(*text, path);
}

}  // namespace dflash::python
