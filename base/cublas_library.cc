#include "base/cublas_library.h"

#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dflash {
namespace {

// The file name this build's headers belong to.
std::string FileName() {
  return absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
}

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}

std::vector<std::string>& Dirs() {
  static auto* dirs = new std::vector<std::string>();
  return *dirs;
}

// libcublas.so.N of other majors in `dir`, for the message.
std::vector<std::string> OtherMajors(const std::string& dir) {
  std::vector<std::string> found;
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return found;
  const std::string ours = FileName();
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name.rfind("libcublas.so.", 0) == 0 && name != ours &&
        name.find('.', 13) == std::string::npos) {
      found.push_back(absl::StrCat(dir, "/", name));
    }
  }
  ::closedir(listing);
  return found;
}

template <typename F>
bool Find(void* library, const char* symbol, F& out) {
  out = reinterpret_cast<F>(::dlsym(library, symbol));
  return out != nullptr;
}

absl::StatusOr<CublasApi> Bind(void* library, std::string path) {
  CublasApi api;
  api.path = std::move(path);
  const char* missing = nullptr;
  if (!Find(library, "cublasCreate_v2", api.create)) {
    missing = "cublasCreate_v2";
  } else if (!Find(library, "cublasDestroy_v2", api.destroy)) {
    missing = "cublasDestroy_v2";
  } else if (!Find(library, "cublasSetStream_v2", api.set_stream)) {
    missing = "cublasSetStream_v2";
  } else if (!Find(library, "cublasSetMathMode", api.set_math_mode)) {
    missing = "cublasSetMathMode";
  } else if (!Find(library, "cublasGemmEx", api.gemm_ex)) {
    missing = "cublasGemmEx";
  } else if (!Find(library, "cublasGetStatusString", api.status_string)) {
    missing = "cublasGetStatusString";
  }
  if (missing == nullptr) return api;
  return absl::FailedPreconditionError(absl::StrCat(
      api.path, ": has no ", missing, "; not the cuBLAS this dflash needs"));
}

}  // namespace

void SetCudaLibraryDirs(std::vector<std::string> dirs) {
  std::lock_guard<std::mutex> lock(Mu());
  Dirs() = std::move(dirs);
}

absl::StatusOr<CublasApi> OpenCublas(const std::vector<std::string>& dirs,
                                     bool search_system) {
  const std::string name = FileName();
  std::vector<std::string> looked, others, errors;
  auto open = [&](const std::string& path) -> void* {
    void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* error = ::dlerror();
      // A file that exists but cannot load (a missing dependency) says why.
      if (path.find('/') != std::string::npos && ::access(path.c_str(), F_OK) == 0
          && error != nullptr) {
        errors.push_back(error);
      }
    }
    return library;
  };
  for (const std::string& dir : dirs) {
    const std::string path = absl::StrCat(dir, "/", name);
    looked.push_back(dir);
    if (void* library = open(path)) return Bind(library, path);
    for (std::string& other : OtherMajors(dir)) others.push_back(other);
  }
  if (search_system) {
    looked.push_back("the system's library path");
    if (void* library = open(name)) return Bind(library, name);
#ifdef DFLASH_CUDA_LIB_DIR
    const std::string toolkit = DFLASH_CUDA_LIB_DIR;
    looked.push_back(toolkit);
    if (void* library = open(absl::StrCat(toolkit, "/", name))) {
      return Bind(library, absl::StrCat(toolkit, "/", name));
    }
    for (std::string& other : OtherMajors(toolkit)) others.push_back(other);
#endif
  }
  std::string message = absl::StrCat(
      name, " (cuBLAS ", CUBLAS_VER_MAJOR,
      ", which this dflash was built with): not found in ",
      absl::StrJoin(looked, ", "));
  if (!others.empty()) {
    absl::StrAppend(&message, "; other cuBLAS versions there: ",
                    absl::StrJoin(others, ", "));
  }
  if (!errors.empty()) {
    absl::StrAppend(&message, "; ", absl::StrJoin(errors, "; "));
  }
  absl::StrAppend(&message,
                  ". Install torch's CUDA build (its NVIDIA libraries) or "
                  "the CUDA toolkit, or add its lib folder to "
                  "LD_LIBRARY_PATH");
  return absl::NotFoundError(message);
}

absl::StatusOr<const CublasApi*> Cublas() {
#if defined(DFLASH_CUDA_EMULATED)
  // The CUDA emulation's cuBLAS, linked in (tools/cuda_emulation).
  static const CublasApi emulated = {
      &cublasCreate_v2,   &cublasDestroy_v2, &cublasSetStream_v2,
      &cublasSetMathMode, &cublasGemmEx,     &cublasGetStatusString,
      "the CUDA emulation's cuBLAS"};
  return &emulated;
#endif
  std::lock_guard<std::mutex> lock(Mu());
  static CublasApi* loaded = nullptr;
  if (loaded != nullptr) return loaded;
  absl::StatusOr<CublasApi> api = OpenCublas(Dirs(), /*search_system=*/true);
  if (!api.ok()) return api.status();
  loaded = new CublasApi(*std::move(api));
  return loaded;
}

}  // namespace dflash
