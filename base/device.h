#ifndef DFLASH_BASE_DEVICE_H_
#define DFLASH_BASE_DEVICE_H_

// Device says whether memory is on the host (kCpu) or a CUDA device (kCuda);
// DeviceName names it for messages. Tensors, allocators and memory spaces
// carry it.

namespace dflash {

// Where a tensor's memory lives.
enum class Device { kCpu, kCuda };

inline const char* DeviceName(Device device) {
  return device == Device::kCpu ? "CPU" : "CUDA";
}

}  // namespace dflash

#endif  // DFLASH_BASE_DEVICE_H_
