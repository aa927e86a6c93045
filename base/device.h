#ifndef DFLASH_BASE_DEVICE_H_
#define DFLASH_BASE_DEVICE_H_

namespace dflash {

// Where a tensor's memory lives.
enum class Device { kCpu, kCuda };

inline const char* DeviceName(Device device) {
  return device == Device::kCpu ? "CPU" : "CUDA";
}

}  // namespace dflash

#endif  // DFLASH_BASE_DEVICE_H_
