// The SIMD capability of the translation unit that includes this first: the CPU kernels are written once
// over at::vec::Vectorized and compiled once per capability. The including .cpp file defines
// DRO_EXT_CAPABILITY_AVX512 or DRO_EXT_CAPABILITY_AVX2 (or neither) before any include; ATen's vector headers
// then pick their AVX-512, AVX2 or default implementation from CPU_CAPABILITY.
#pragma once

#if defined(DRO_EXT_CAPABILITY_AVX512)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 reports every AVX-512 vector that ATen builds from _mm512_undefined_* (its own avx512fintrin.h) as
// used uninitialized: over 5000 false warnings per build that buried any real one. Silenced for this translation
// unit only; the AVX2 and default builds compile the same kernels with the warnings on.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#elif defined(DRO_EXT_CAPABILITY_AVX2)
#pragma GCC target("avx2,fma,f16c")
#endif

// The target pragma enables the instructions but not the feature macros that ATen's and Sleef's headers
// test, so state them here; nothing outside this translation unit sees them.
#if defined(DRO_EXT_CAPABILITY_AVX512) || defined(DRO_EXT_CAPABILITY_AVX2)
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#endif
#if defined(DRO_EXT_CAPABILITY_AVX512)
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#endif

#if defined(DRO_EXT_CAPABILITY_AVX512)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(DRO_EXT_CAPABILITY_AVX2)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
