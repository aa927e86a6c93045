#include "heads/config/head_facts.h"

#include "losses/loss_family.h"

namespace dflash {

bool ProjectsTeacher(const v1::ObjectiveConfig& config) {
  return LossTraitsOf(config.loss()).needs_teacher ||
         config.head().teacher_diagnostics();
}

bool RecordsTeacherAcceptance(const v1::ObjectiveConfig& config) {
  return config.head().teacher_diagnostics() ||
         LossTraitsOf(config.loss()).accepts_teacher;
}

bool SplitsCorrection(const v1::ObjectiveConfig& config) {
  return config.head().correction_rank() > 0 &&
         LossTraitsOf(config.loss()).splits_correction;
}

int64_t LogitsBuffers(const v1::ObjectiveConfig& config) {
  return 1 + ProjectsTeacher(config) + SplitsCorrection(config);
}

}  // namespace dflash
