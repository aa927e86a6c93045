#ifndef DFLASH_BENCH_REPORT_FORMAT_H_
#define DFLASH_BENCH_REPORT_FORMAT_H_

#include <string>

#include "absl/status/statusor.h"
#include "proto/metrics.pb.h"

namespace dflash {

// The side-by-side benchmark (//bench:report) written three ways.

// A Markdown table: one line per mode (seconds, times the GEMM floor, GEMM
// passes, effective GFLOP/s, peak MiB, loss), under a line naming the batch,
// the machine and the floor.
std::string ReportMarkdown(const v1::BenchReport& report);

// The report as JSON (protobuf's JSON printer, field names as in the proto).
absl::StatusOr<std::string> ReportJson(const v1::BenchReport& report);

// A standalone SVG chart of two panels: time per mode with the GEMM floor
// drawn across it, and peak memory per mode. Bar heights are proportional
// to the values (each bar carries its mode and value as data- attributes).
std::string ReportSvg(const v1::BenchReport& report);

}  // namespace dflash

#endif  // DFLASH_BENCH_REPORT_FORMAT_H_
