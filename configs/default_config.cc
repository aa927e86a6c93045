#include "configs/default_config.h"

namespace dflash {

absl::string_view DefaultObjectiveConfigText() {
  static constexpr char kText[] =
#include "configs/dflash_default.inc"
      ;
  return kText;
}

}  // namespace dflash
