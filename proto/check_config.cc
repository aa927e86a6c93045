// Loads, validates and prints the resolved policy of an objective config.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "google/protobuf/util/json_util.h"
#include "proto/config.h"

ABSL_FLAG(std::string, config, "configs/dflash_default.textproto",
          "Objective config in protobuf text format.");
ABSL_FLAG(std::string, format, "text", "Output format: text or json.");

namespace {

// `bazel run` starts in the runfiles tree; paths the user typed are relative
// to where they typed them.
std::string UserPath(const std::string& path) {
  const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || cwd == nullptr) return path;
  const std::string user = std::string(cwd) + "/" + path;
  return std::ifstream(user).good() ? user : path;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Loads an objective config, fills defaults, validates it and prints the "
      "resolved policy.\n  check_config --config=FILE [--format=text|json]");
  absl::ParseCommandLine(argc, argv);
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "text" && format != "json") {
    std::cerr << "--format: must be text or json, got \"" << format << "\"\n";
    return 2;
  }
  absl::StatusOr<dflash::v1::ObjectiveConfig> config =
      dflash::LoadObjectiveConfigFromFile(UserPath(absl::GetFlag(FLAGS_config)));
  if (!config.ok()) {
    std::cerr << config.status().message() << "\n";
    return 1;
  }
  if (format == "text") {
    std::cout << dflash::ToTextFormat(*config);
    return 0;
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  google::protobuf::util::MessageToJsonString(*config, &json, options);
  std::cout << json;
  return 0;
}
