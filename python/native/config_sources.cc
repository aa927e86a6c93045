#include "python/native/config_sources.h"

#include <string>

#include "configs/default_config.h"
#include "proto/config.h"

namespace dflash::python {

absl::StatusOr<v1::ObjectiveConfig> DefaultConfig() {
  return ParseObjectiveConfig(DefaultObjectiveConfigText(),
                              kDefaultConfigSource);
}

absl::StatusOr<v1::ObjectiveConfig> ConfigFromFile(const std::string& path) {
  return ParseObjectiveConfigFile(path, "config: ");
}

}  // namespace dflash::python
