#ifndef DFLASH_BASE_STATUS_MACROS_H_
#define DFLASH_BASE_STATUS_MACROS_H_

// Early returns for absl::Status and absl::StatusOr, as abseil's internal
// macros and most abseil users define them (abseil 20220623 exports none).
//
//   DFLASH_RETURN_IF_ERROR(Validate(config));
//   DFLASH_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(policy, shape));

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the status of `expr` (an absl::Status) from the enclosing
// function when it is not OK.
#define DFLASH_RETURN_IF_ERROR(expr)                                  \
  do {                                                                \
    if (::absl::Status dflash_status_ = (expr); !dflash_status_.ok()) \
      return dflash_status_;                                          \
  } while (false)

// Evaluates `expr` (an absl::StatusOr<T>); returns its status when it is
// not OK, else moves its value into `lhs` (a declaration or an lvalue).
#define DFLASH_ASSIGN_OR_RETURN(lhs, expr) \
  DFLASH_ASSIGN_OR_RETURN_IMPL_(           \
      DFLASH_STATUS_CONCAT_(dflash_statusor_, __LINE__), lhs, expr)

#define DFLASH_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#define DFLASH_STATUS_CONCAT_(a, b) DFLASH_STATUS_CONCAT_INNER_(a, b)
#define DFLASH_STATUS_CONCAT_INNER_(a, b) a##b

#endif  // DFLASH_BASE_STATUS_MACROS_H_
