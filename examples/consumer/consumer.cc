// Uses dflash's config library alone: no heads, no CUDA in its closure.
#include <iostream>

#include "proto/config.h"

int main() {
  absl::StatusOr<dflash::v1::ObjectiveConfig> config =
      dflash::LoadObjectiveConfigFromString(
          "head { vocab_size: 1000 hidden_size: 64 } loss { dflash { gamma: 7 } }");
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  std::cout << "blocks_per_chunk " << config->chunking().blocks_per_chunk() << "\n";
  return 0;
}
