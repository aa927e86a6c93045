// dflash_head: forward and backward of an objective through the fused head,
// on a synthetic batch or on .npy tensors; see the README.
#include <unistd.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/file.h"
#include "base/status_macros.h"
#include "cli/head_job.h"

ABSL_FLAG(std::string, config, "",
          "Objective config in text format; empty: the built-in "
          "configs/dflash_default.textproto.");
ABSL_FLAG(std::string, loss, "",
          "dflash, dpace, dpace-cumulative-confidence-only, "
          "dpace-continuation-value-only, tv, lk-lambda, dspark, dpard, "
          "domino, kl, reverse-kl, jsd.");
ABSL_FLAG(std::optional<double>, gamma, std::nullopt, "Loss decay gamma.");
ABSL_FLAG(std::string, lk, "",
          "LK composition of the dflash or dpace loss (SpecForge's "
          "lk_loss_type): alpha, tv or lambda.");
ABSL_FLAG(std::optional<double>, kl_scale, std::nullopt,
          "--lk=lambda's kl_scale (default 1).");
ABSL_FLAG(std::optional<double>, kl_decay, std::nullopt,
          "--lk=lambda's kl_decay (default 1).");
ABSL_FLAG(std::string, mode, "",
          "materialize, save, checkpoint, selective or fused.");
ABSL_FLAG(std::optional<int64_t>, chunk_blocks, std::nullopt,
          "Anchor blocks per chunk (default: the config's).");
ABSL_FLAG(std::optional<int32_t>, threads, std::nullopt,
          "Threads for the row kernels (0: all cores).");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "Seed of the synthetic batch (default 1).");
ABSL_FLAG(std::optional<int64_t>, batch, std::nullopt,
          "Synthetic batch: sequences (default 1).");
ABSL_FLAG(std::optional<int64_t>, seq, std::nullopt,
          "Synthetic batch: tokens per sequence (default 4096).");
ABSL_FLAG(std::optional<int64_t>, anchors, std::nullopt,
          "Synthetic batch: anchor blocks per sequence (default 128).");
ABSL_FLAG(std::optional<int64_t>, block, std::nullopt,
          "Synthetic batch: block size K (default: the config's).");
ABSL_FLAG(std::optional<int64_t>, hidden, std::nullopt,
          "Synthetic batch: hidden size H (default: the config's).");
ABSL_FLAG(std::optional<int64_t>, vocab, std::nullopt,
          "Synthetic batch: vocabulary size V (default: the config's).");
ABSL_FLAG(std::string, inputs, "",
          "Directory of .npy tensors (hidden, lm_head, input_ids, loss_mask, "
          "anchors, keep[, lm_head_bias, teacher_hidden, confidence_logits]) "
          "instead of the synthetic batch.");
ABSL_FLAG(std::string, out, "",
          "Directory for metrics.json, grad_hidden.npy[, grad_lm_head.npy]; "
          "created if missing, its files replaced together.");
ABSL_FLAG(bool, compare_modes, false,
          "Also run every mode on the batch and print a table.");
ABSL_FLAG(std::string, memory_limit, "",
          "Bytes the run may hold, e.g. 8G, 512M or 1000000 (default: the "
          "memory available to this process).");

namespace {

// Paths on the command line are relative to where `bazel run` was called.
std::string UserPath(const std::string& path) {
  const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || cwd == nullptr) return path;
  return std::string(cwd) + "/" + path;
}

// The flags whose empty value reads as unset. Given empty (--out= or
// --out '', as an unset shell variable gives them) they are errors, not
// silently ignored. Read from argv: abseil 20220623 keeps whether a flag
// was given to itself (CommandLineFlag::IsSpecifiedOnCommandLine is
// private there).
constexpr const char* kNeedValues[] = {
    "config", "loss",   "gamma", "lk",     "kl_scale", "kl_decay",
    "mode",   "chunk_blocks", "threads", "seed", "batch", "seq",
    "anchors", "block", "hidden", "vocab", "inputs", "out", "memory_limit"};

absl::Status CheckNotEmpty(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      continue;
    }
    for (const char* name : kNeedValues) {
      absl::string_view value = arg;
      if (!absl::ConsumePrefix(&value, name)) continue;
      // --name=VALUE, or --name VALUE in the next argument.
      const bool separate = value.empty() && i + 1 < argc;
      if (separate) value = argv[++i];
      else if (!absl::ConsumePrefix(&value, "=")) continue;
      if (value.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": needs a value, got ''"));
      }
      break;
    }
  }
  return absl::OkStatus();
}

// "8G", "512M", "64K" (powers of 1024) or plain bytes.
absl::StatusOr<std::optional<int64_t>> MemoryLimit(const std::string& text) {
  if (text.empty()) return std::nullopt;
  int64_t scale = 1;
  std::string digits = text;
  const char unit = digits.back();
  const std::string units = "KMGT";
  if (const size_t at = units.find(unit); at != std::string::npos) {
    scale = int64_t{1} << (10 * (at + 1));
    digits.pop_back();
  }
  int64_t value;
  if (!absl::SimpleAtoi(digits, &value) || value <= 0 ||
      value > std::numeric_limits<int64_t>::max() / scale) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--memory_limit: must be a positive number of bytes, optionally with "
        "K, M, G or T, got '",
        text, "'"));
  }
  return value * scale;
}

absl::StatusOr<dflash::HeadJobOptions> OptionsFromFlags() {
  dflash::HeadJobOptions options;
  options.config_path = UserPath(absl::GetFlag(FLAGS_config));
  dflash::ConfigOverrides& o = options.overrides;
  // An empty string flag is one not given.
  for (auto [flag, value] :
       {std::pair{&FLAGS_loss, &o.loss}, {&FLAGS_lk, &o.lk},
        {&FLAGS_mode, &o.mode}}) {
    if (std::string text = absl::GetFlag(*flag); !text.empty()) *value = text;
  }
  o.gamma = absl::GetFlag(FLAGS_gamma);
  o.kl_scale = absl::GetFlag(FLAGS_kl_scale);
  o.kl_decay = absl::GetFlag(FLAGS_kl_decay);
  o.chunk_blocks = absl::GetFlag(FLAGS_chunk_blocks);
  o.threads = absl::GetFlag(FLAGS_threads);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.batch = absl::GetFlag(FLAGS_batch);
  options.seq = absl::GetFlag(FLAGS_seq);
  options.anchors = absl::GetFlag(FLAGS_anchors);
  options.block = absl::GetFlag(FLAGS_block);
  options.hidden = absl::GetFlag(FLAGS_hidden);
  options.vocab = absl::GetFlag(FLAGS_vocab);
  options.inputs_dir = UserPath(absl::GetFlag(FLAGS_inputs));
  options.out_dir = UserPath(absl::GetFlag(FLAGS_out));
  options.compare_modes = absl::GetFlag(FLAGS_compare_modes);
  DFLASH_ASSIGN_OR_RETURN(std::optional<int64_t> limit,
                          MemoryLimit(absl::GetFlag(FLAGS_memory_limit)));
  options.memory_limit = limit;
  return options;
}

int Fail(const std::string& message) {
  std::cerr << "dflash_head: " << message << "\n";
  return 1;
}

int Run(int argc, char** argv) {
  if (absl::Status ok = CheckNotEmpty(argc, argv); !ok.ok()) {
    return Fail(std::string(ok.message()));
  }
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return Fail(absl::StrCat("unexpected argument '", positional[1],
                             "'; every option is a --flag (see --help)"));
  }
  absl::StatusOr<dflash::HeadJobOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(std::string(options.status().message()));

  // A progress line, only on a terminal and once a run passes one second.
  const auto start = std::chrono::steady_clock::now();
  const bool terminal = isatty(STDERR_FILENO);
  bool printed = false;
  auto progress = [&](int64_t done, int64_t total) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    if (!terminal || seconds < 1) return;
    const double rate = done / seconds;
    std::fprintf(stderr, "\r  chunk steps %lld/%lld, %.2f/s, ETA %.1f s   ",
                 static_cast<long long>(done), static_cast<long long>(total),
                 rate, (total - done) / rate);
    printed = true;
    if (done == total) std::fputc('\n', stderr);
  };
  auto job = dflash::RunHeadJob(*options, std::cout, progress);
  if (printed) std::fflush(stderr);
  if (!job.ok()) return Fail(std::string(job.status().message()));
  for (const std::string& note : job->notes) {
    std::cerr << "dflash_head: note: " << note << "\n";
  }
  errno = 0;
  std::cout.flush();
  if (!std::cout || std::fflush(stdout) != 0) {
    return Fail(absl::StrCat(
        "cannot write standard output",
        errno != 0 ? absl::StrCat(": ", std::strerror(errno)) : std::string(),
        options->out_dir.empty()
            ? std::string()
            : absl::StrCat(" (the outputs in ", options->out_dir,
                           " were written)")));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs forward and backward of a DFlash-family objective through the "
      "fused head and reports loss, accuracy, GEMMs, time and peak memory.");
  // A closed standard output is an error said once the outputs are safe,
  // not a death by SIGPIPE before.
  std::signal(SIGPIPE, SIG_IGN);
  // A file-size limit (ulimit -f) is a write error naming the file too.
  std::signal(SIGXFSZ, SIG_IGN);
  // An interrupted run leaves no temporaries in --out.
  dflash::RemoveTemporariesOnSignals();
#if defined(__GLIBC__)
  // Buffers of 1 MiB and more go back to the system when freed. glibc
  // otherwise raises its mmap threshold to each large block freed (up to 32
  // MiB) and keeps later ones of that size in its heap, so one run after
  // another (--compare_modes) grows the resident peak past what the runs
  // hold at once, which --memory_limit and the prediction are about.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  // Sizes are checked before they are allocated; anything that still
  // escapes is reported, not an abort.
  try {
    return Run(argc, argv);
  } catch (const std::bad_alloc&) {
    return Fail(
        "out of memory: a size passed the checks but could not be allocated "
        "(is --memory_limit, or the memory reported available, more than "
        "this process may hold?); lower the sizes or --memory_limit");
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()));
  }
}
