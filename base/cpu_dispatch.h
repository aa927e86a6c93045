#ifndef DFLASH_BASE_CPU_DISPATCH_H_
#define DFLASH_BASE_CPU_DISPATCH_H_

// DFLASH_CPU_DISPATCH marks a hot loop function to be compiled for several
// x86-64 levels (AVX-512, AVX2 + FMA, baseline) and chosen once at load
// time by the CPU it runs on (GCC's target_clones). One binary then runs on
// any x86-64 and uses the widest vectors present, with no -march flag that
// a consumer inherits. Elsewhere (aarch64, Clang, which does not clone
// templates) it compiles the one baseline version.

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DFLASH_CPU_DISPATCH \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DFLASH_CPU_DISPATCH
#endif

#endif  // DFLASH_BASE_CPU_DISPATCH_H_
