#ifndef DFLASH_BASE_CUDA_LAUNCH_H_
#define DFLASH_BASE_CUDA_LAUNCH_H_

// Kernel launches and shared memory, written once for nvcc and for the CPU
// emulation of CUDA the tests run under --config=cuda_emulated
// (tools/cuda_emulation):
//   DFLASH_LAUNCH(Kernel<T>, grid, block, shared_bytes, stream)(args...);
//   DFLASH_SHARED(float, total);            // __shared__ float total;
//   DFLASH_SHARED_ARRAY(float, sums, 512);  // __shared__ float sums[512];
// Under nvcc these are <<<>>> and __shared__; emulated, the launch queues
// the kernel on the stream's worker and shared memory is the block's own,
// poisoned when the block starts.

#if defined(DFLASH_CUDA_EMULATED)

#define DFLASH_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::dflash_emu::Bind(#kernel, kernel, grid, block, shared_bytes, stream)
#define DFLASH_SHARED(type, name)                                        \
  static const char dflash_shared_tag_##name = 0;                        \
  type& name = *static_cast<type*>(::dflash_emu::Shared(                 \
      &dflash_shared_tag_##name, sizeof(type), alignof(type)))
#define DFLASH_SHARED_ARRAY(type, name, count)                           \
  static const char dflash_shared_tag_##name = 0;                        \
  type(&name)[count] = *static_cast<type(*)[count]>(::dflash_emu::Shared( \
      &dflash_shared_tag_##name, sizeof(type[count]), alignof(type)))

#else

#define DFLASH_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  kernel<<<grid, block, shared_bytes, stream>>>
#define DFLASH_SHARED(type, name) __shared__ type name
#define DFLASH_SHARED_ARRAY(type, name, count) __shared__ type name[count]

#endif

#endif  // DFLASH_BASE_CUDA_LAUNCH_H_
