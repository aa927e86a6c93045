// Loads, validates and prints the resolved policy of an objective config.
#include <cerrno>
#include <cstdio>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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
  // A closed standard output is the error line below, not a death by
  // SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::cerr << "unexpected argument '" << positional[1]
              << "'; every option is a --flag (see --help)\n";
    return 2;
  }
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "text" && format != "json") {
    std::cerr << "--format: must be text or json, got \"" << format << "\"\n";
    return 2;
  }
  const std::string path = UserPath(absl::GetFlag(FLAGS_config));
  absl::StatusOr<dflash::v1::ObjectiveConfig> config =
      dflash::LoadObjectiveConfigFromFile(path);
  if (!config.ok()) {
    std::cerr << config.status().message() << "\n";
    return 1;
  }
  // What dflash_head refuses whatever shapes it gives the config.
  if (absl::Status runnable = dflash::ValidateConfigAsWritten(*config);
      !runnable.ok()) {
    std::cerr << path << ": invalid config:\n" << runnable.message() << "\n";
    return 1;
  }
  if (format == "text") {
    std::cout << dflash::ToTextFormat(*config);
  } else {
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.preserve_proto_field_names = true;
    google::protobuf::util::MessageToJsonString(*config, &json, options);
    std::cout << json;
  }
  errno = 0;
  std::cout.flush();
  if (!std::cout || std::fflush(stdout) != 0) {
    std::cerr << "check_config: cannot write standard output"
              << (errno != 0 ? absl::StrCat(": ", std::strerror(errno)) : "")
              << "\n";
    return 1;
  }
  return 0;
}
