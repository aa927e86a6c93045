#ifndef DFLASH_BASE_HOST_DEVICE_H_
#define DFLASH_BASE_HOST_DEVICE_H_

// DFLASH_HOST_DEVICE marks an inline function that both the CPU code and
// the CUDA kernels call, so each formula is written once: __host__
// __device__ under nvcc, nothing for the host compiler.

#if defined(__CUDACC__)
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

#endif  // DFLASH_BASE_HOST_DEVICE_H_
