// report: the head in every execution mode and the raw-GEMM floor on one
// synthetic batch, in one process; writes report.md, report.json and
// report.svg into --out_dir. See the README's Heads section.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "base/tracking_allocator.h"
#include "bench/gemm_floor.h"
#include "bench/head_cases.h"
#include "bench/report_format.h"
#include "heads/cpu_projection.h"
#include "heads/head_metrics.h"
#include "heads/prepared_projection.h"

ABSL_FLAG(std::string, out_dir, "bench_report",
          "Directory for report.md, report.json and report.svg (created).");
ABSL_FLAG(int64_t, anchors, 128, "Anchor blocks of 16 positions (rows / 16).");
ABSL_FLAG(int64_t, hidden, 1024, "Hidden size H.");
ABSL_FLAG(int64_t, vocab, 32768, "Vocabulary size V.");
ABSL_FLAG(int64_t, chunk_blocks, 64, "Anchor blocks per chunk.");
ABSL_FLAG(bool, pack_weight, true,
          "Lay the frozen weight out once for oneDNN (prepared before the "
          "timed steps); false: OpenBLAS per chunk.");
ABSL_FLAG(int32_t, threads, 0, "head.threads: 0 for all cores.");
ABSL_FLAG(double, gradient_filter, 0,
          "head.gradient_filter: 0 for the exact gradient.");
ABSL_FLAG(bool, peaked, false,
          "The peaked synthetic batch (Zipf-like ids, a rare-token bias, "
          "logit scale 2) instead of the flat one.");
ABSL_FLAG(int32_t, repeats, 2,
          "Timed steps per mode after a warm-up step; the fastest is "
          "reported.");

namespace dflash {
namespace {

std::string Machine() {
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return absl::StrCat(model, ", ", std::thread::hardware_concurrency(),
                      " cores, ", CpuBlasName());
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream file(path);
  file << text;
  file.close();
  if (!file)
    return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<v1::BenchReport> Measure(const HeadShape& shape, int repeats) {
  v1::BenchReport report;
  report.set_machine(Machine());
  report.set_hidden(shape.hidden);
  report.set_vocab(shape.vocab);
  for (v1::HeadConfig::ExecutionMode mode : BenchModes()) {
    DFLASH_ASSIGN_OR_RETURN(v1::ObjectiveConfig config,
                            HeadBenchConfig(shape, mode));
    DFLASH_ASSIGN_OR_RETURN(HeadBatch<float> batch,
                            HeadBenchBatch(config, shape));
    // Steps of a training loop: one untimed warm-up step, then `repeats`
    // on the same caching allocator.
    TrackingAllocator allocator(std::numeric_limits<int64_t>::max(),
                                /*cache_blocks=*/true);
    DFLASH_ASSIGN_OR_RETURN(std::unique_ptr<PreparedProjection> prepared,
                            PrepareHeadCase(config, batch));
    if (prepared != nullptr) {
      report.set_prepare_seconds(prepared->prepare_seconds());
      report.set_gemm_library(
          absl::StrCat("oneDNN (", prepared->KernelName(), "), prepared once"));
    } else {
      report.set_gemm_library(CpuBlasName());
    }
    if (absl::StatusOr<HeadResult> warm =
            RunHeadCase(config, batch, allocator, prepared.get());
        !warm.ok()) {
      return warm.status();
    }
    v1::HeadMetrics best;
    for (int i = 0; i < repeats; ++i) {
      DFLASH_ASSIGN_OR_RETURN(
          HeadResult result,
          RunHeadCase(config, batch, allocator, prepared.get()));
      const v1::HeadMetrics metrics = HeadMetricsOf(config, result);
      if (i == 0 || metrics.seconds() < best.seconds()) best = metrics;
      if (mode == v1::HeadConfig::FUSED) {
        report.set_rows_per_chunk(result.plan.rows_per_chunk);
      }
    }
    if (mode == v1::HeadConfig::FUSED && shape.gradient_filter > 0) {
      // The filter's error: its gradient against the exact one.
      v1::ObjectiveConfig exact = config;
      exact.mutable_head()->clear_gradient_filter();
      std::vector<float> filtered, want;
      DFLASH_RETURN_IF_ERROR(
          RunHeadCase(config, batch, allocator, prepared.get(), &filtered)
              .status());
      DFLASH_RETURN_IF_ERROR(
          RunHeadCase(exact, batch, allocator, prepared.get(), &want)
              .status());
      double error = 0, largest = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        error = std::max<double>(error, std::abs(filtered[i] - want[i]));
        largest = std::max<double>(largest, std::abs(want[i]));
      }
      report.set_gradient_filter_error(largest > 0 ? error / largest : 0);
    }
    report.set_loss_family(best.loss_family());
    report.set_rows(best.rows());
    report.set_projected_rows(best.projected_rows());
    std::fprintf(stderr, "  %-12s %.3f s\n", best.mode().c_str(),
                 best.seconds());
    *report.add_modes()->mutable_metrics() = best;
  }
  // Measured after the modes, on the rows they projected.
  const int64_t rows = report.projected_rows();
  report.set_floor_seconds(GemmFloorSeconds(
      rows, shape.hidden, shape.vocab,
      rows * report.rows_per_chunk() / std::max<int64_t>(report.rows(), 1),
      repeats + 1));
  const double floor_flops =
      4.0 * report.projected_rows() * shape.hidden * shape.vocab;
  report.set_floor_gflops(floor_flops / report.floor_seconds() / 1e9);
  for (v1::ModeReport& row : *report.mutable_modes()) {
    const double seconds = row.metrics().seconds();
    row.set_floor_ratio(seconds / report.floor_seconds());
    row.set_effective_gflops(floor_flops / seconds / 1e9);
  }
  return report;
}

}  // namespace
}  // namespace dflash

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs the head in every execution mode next to its raw-GEMM floor and "
      "writes report.md, report.json and report.svg.");
  absl::ParseCommandLine(argc, argv);
  std::string dir = absl::GetFlag(FLAGS_out_dir);
  // Relative to where `bazel run` was called.
  if (const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY");
      cwd != nullptr && !dir.empty() && dir[0] != '/') {
    dir = absl::StrCat(cwd, "/", dir);
  }
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (repeats < 1) {
    std::cerr << "report: --repeats: must be >= 1, got " << repeats << "\n";
    return 1;
  }
  const dflash::HeadShape shape{
      absl::GetFlag(FLAGS_anchors), absl::GetFlag(FLAGS_hidden),
      absl::GetFlag(FLAGS_vocab),         absl::GetFlag(FLAGS_chunk_blocks),
      absl::GetFlag(FLAGS_pack_weight),   absl::GetFlag(FLAGS_threads),
      absl::GetFlag(FLAGS_gradient_filter), absl::GetFlag(FLAGS_peaked)};
  absl::StatusOr<dflash::v1::BenchReport> report =
      dflash::Measure(shape, repeats);
  if (!report.ok()) {
    std::cerr << "report: " << report.status().message() << "\n";
    return 1;
  }
  absl::StatusOr<std::string> json = dflash::ReportJson(*report);
  if (!json.ok()) {
    std::cerr << "report: " << json.status().message() << "\n";
    return 1;
  }
  if (std::system(absl::StrCat("mkdir -p '", dir, "'").c_str()) != 0) {
    std::cerr << "report: --out_dir: cannot create " << dir << "\n";
    return 1;
  }
  const std::string markdown = dflash::ReportMarkdown(*report);
  for (const auto& [name, text] :
       {std::pair<std::string, std::string>{"report.md", markdown},
        {"report.json", *json},
        {"report.svg", dflash::ReportSvg(*report)}}) {
    if (absl::Status ok = dflash::WriteFile(absl::StrCat(dir, "/", name), text);
        !ok.ok()) {
      std::cerr << "report: --out_dir: " << ok.message() << "\n";
      return 1;
    }
  }
  std::cout << markdown << "\nwrote " << dir
            << "/report.md, report.json, report.svg\n";
  return 0;
}
