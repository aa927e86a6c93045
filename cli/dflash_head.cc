// dflash_head: forward and backward of an objective through the fused head,
// on a synthetic batch or on .npy tensors; see the README.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "cli/head_job.h"

ABSL_FLAG(std::string, config, "",
          "Objective config in text format; empty: the built-in "
          "configs/dflash_default.textproto.");
ABSL_FLAG(std::string, loss, "",
          "dflash, dpace, dpace-cumulative-confidence-only, "
          "dpace-continuation-value-only, tv, lk-lambda, dspark, kl, "
          "reverse-kl, jsd.");
ABSL_FLAG(std::optional<double>, gamma, std::nullopt, "Loss decay gamma.");
ABSL_FLAG(std::string, mode, "",
          "materialize, save, checkpoint, selective or fused.");
ABSL_FLAG(int64_t, chunk_blocks, 0, "Anchor blocks per chunk.");
ABSL_FLAG(std::optional<int32_t>, threads, std::nullopt,
          "Threads for the row kernels (0: all cores).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the synthetic batch.");
ABSL_FLAG(int64_t, batch, 1, "Synthetic batch: sequences.");
ABSL_FLAG(int64_t, seq, 4096, "Synthetic batch: tokens per sequence.");
ABSL_FLAG(int64_t, anchors, 128, "Synthetic batch: anchor blocks per sequence.");
ABSL_FLAG(int64_t, block, 0, "Block size K (0: the config's).");
ABSL_FLAG(int64_t, hidden, 0, "Hidden size H (0: the config's).");
ABSL_FLAG(int64_t, vocab, 0, "Vocabulary size V (0: the config's).");
ABSL_FLAG(std::string, inputs, "",
          "Directory of .npy tensors (hidden, lm_head, input_ids, loss_mask, "
          "anchors, keep[, teacher_hidden, confidence_logits]).");
ABSL_FLAG(std::string, out, "",
          "Directory for metrics.json, grad_hidden.npy[, grad_lm_head.npy].");
ABSL_FLAG(bool, compare_modes, false,
          "Also run every mode on the batch and print a table.");

namespace {

// Paths on the command line are relative to where `bazel run` was called.
std::string UserPath(const std::string& path) {
  const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || cwd == nullptr) return path;
  return std::string(cwd) + "/" + path;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs forward and backward of a DFlash-family objective through the "
      "fused head and reports loss, accuracy, GEMMs, time and peak memory.");
  absl::ParseCommandLine(argc, argv);
  dflash::HeadJobOptions options;
  options.config_path = UserPath(absl::GetFlag(FLAGS_config));
  options.loss = absl::GetFlag(FLAGS_loss);
  options.gamma = absl::GetFlag(FLAGS_gamma);
  options.mode = absl::GetFlag(FLAGS_mode);
  options.chunk_blocks = absl::GetFlag(FLAGS_chunk_blocks);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.shape = {absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_seq),
                   absl::GetFlag(FLAGS_anchors)};
  options.block = absl::GetFlag(FLAGS_block);
  options.hidden = absl::GetFlag(FLAGS_hidden);
  options.vocab = absl::GetFlag(FLAGS_vocab);
  options.inputs_dir = UserPath(absl::GetFlag(FLAGS_inputs));
  options.out_dir = UserPath(absl::GetFlag(FLAGS_out));
  options.compare_modes = absl::GetFlag(FLAGS_compare_modes);

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
  auto job = dflash::RunHeadJob(options, std::cout, progress);
  if (printed) std::fflush(stderr);
  if (!job.ok()) {
    std::cerr << "dflash_head: " << job.status().message() << "\n";
    return 1;
  }
  return 0;
}
