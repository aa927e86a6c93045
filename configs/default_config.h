#ifndef DFLASH_CONFIGS_DEFAULT_CONFIG_H_
#define DFLASH_CONFIGS_DEFAULT_CONFIG_H_

// The built-in default objective, configs/dflash_default.textproto compiled
// in, for the dflash_head command and the Python package.

#include "absl/strings/string_view.h"

namespace dflash {

inline constexpr char kDefaultConfigSource[] =
    "configs/dflash_default.textproto";

// The file's text, to parse with proto/config.h.
absl::string_view DefaultObjectiveConfigText();

}  // namespace dflash

#endif  // DFLASH_CONFIGS_DEFAULT_CONFIG_H_
