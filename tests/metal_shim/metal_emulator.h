// CPU emulator for mlxkv's Metal kernel bodies: definitions behind metal_shim.h's declarations.
// One threadgroup runs at a time with one POSIX thread per Metal thread (reused group after group); simd_sum/simd_max
// exchange values through per-simdgroup slots and barriers, threadgroup_barrier waits on a
// threadgroup-wide barrier. This checks a body's indexing and arithmetic on real data; it says
// nothing about Metal's speed, memory-model corners or compiler. Only light C headers, so that
// each emulated kernel compiles quickly.
#pragma once
// System headers first: metal_shim.h defines `thread`, `device`, `constant` as macros.
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MLXKV_METAL_EMULATE 1
#include "metal_shim.h"

// -- 16-bit floats ------------------------------------------------------------------------
inline half::half(float f) {
  _Float16 h = static_cast<_Float16>(f);
  memcpy(&bits, &h, 2);
}
inline half::operator float() const volatile {
  const unsigned short b = bits;
  _Float16 h;
  memcpy(&h, &b, 2);
  return static_cast<float>(h);
}
inline bfloat16_t::bfloat16_t(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
  }
}
inline bfloat16_t::operator float() const volatile {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// -- math ---------------------------------------------------------------------------------
namespace metal {
template <typename U>
MLXKV_MSL_SCALAR(U) max(U a, U b) { return a > b ? a : b; }
template <typename U>
MLXKV_MSL_SCALAR(U) min(U a, U b) { return a < b ? a : b; }
template <typename U>
MLXKV_MSL_SCALAR(U) clamp(U x, U lo, U hi) { return x < lo ? lo : (x > hi ? hi : x); }
#define MLXKV_EMU_1(f, c) \
  inline float f(float x) { return c(x); } \
  inline half f(half x) { return half(c(float(x))); }
MLXKV_EMU_1(exp2, ::exp2f)
MLXKV_EMU_1(log, ::logf)
MLXKV_EMU_1(log2, ::log2f)
MLXKV_EMU_1(sqrt, ::sqrtf)
MLXKV_EMU_1(rsqrt, 1.0f / ::sqrtf)
MLXKV_EMU_1(abs, ::fabsf)
MLXKV_EMU_1(fabs, ::fabsf)
inline float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
inline float fmax(float a, float b) { return ::fmaxf(a, b); }
inline float fmin(float a, float b) { return ::fminf(a, b); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isnan(float x) { return __builtin_isnan(x); }
namespace precise {
MLXKV_EMU_1(log, ::logf)
MLXKV_EMU_1(rsqrt, 1.0f / ::sqrtf)
}  // namespace precise
namespace fast {
MLXKV_EMU_1(exp2, ::exp2f)
MLXKV_EMU_1(log, ::logf)
}  // namespace fast
}  // namespace metal

// -- threads ------------------------------------------------------------------------------
namespace emu {
constexpr int kMaxThreads = 1024;

struct Group {  // one threadgroup; simdgroups are full (launches use multiples of 32 threads)
  int threads;
  pthread_barrier_t all;
  pthread_barrier_t simd[kMaxThreads / 32];
  // Exchange slots, double-buffered per simdgroup: a lane writes buffer `parity`, waits once, reads;
  // its next exchange writes the other buffer, which every lane finished reading before the last wait.
  float slots[2][kMaxThreads];
  int islots[2][kMaxThreads];
  int parity[kMaxThreads];  // per lane
};

struct Lane {
  Group* group;
  int index;  // thread index in the threadgroup
  void (*body)(void*, int);
  void* ctx;
};

inline thread_local Lane* lane_ctx = nullptr;

template <typename V, typename F>
V reduce(V (*slots)[kMaxThreads], V x, F f) {
  const int me = lane_ctx->index, sg = me / 32;
  int& parity = lane_ctx->group->parity[me];
  V* buf = slots[parity];
  parity ^= 1;
  buf[me] = x;
  pthread_barrier_wait(&lane_ctx->group->simd[sg]);
  V acc = buf[sg * 32];
  for (int i = 1; i < 32; ++i) {
    acc = f(acc, buf[sg * 32 + i]);
  }
  return acc;
}

inline void* lane_main(void* p) {
  lane_ctx = static_cast<Lane*>(p);
  lane_ctx->body(lane_ctx->ctx, lane_ctx->index);
  return nullptr;
}

// Run `body(local_index)` on `threads` threads as one threadgroup.
template <typename F>
void run_group(int threads, F body) {
  static Group g;
  static Lane lanes[kMaxThreads];
  static pthread_t ids[kMaxThreads];
  if (threads > kMaxThreads) abort();
  g.threads = threads;
  memset(g.parity, 0, sizeof g.parity);
  pthread_barrier_init(&g.all, nullptr, threads);
  for (int i = 0; i < threads / 32; ++i) pthread_barrier_init(&g.simd[i], nullptr, 32);
  auto call = [](void* ctx, int t) { (*static_cast<F*>(ctx))(t); };
  for (int t = 0; t < threads; ++t) {
    lanes[t] = Lane{&g, t, call, &body};
    if (pthread_create(&ids[t], nullptr, lane_main, &lanes[t]) != 0) abort();
  }
  for (int t = 0; t < threads; ++t) pthread_join(ids[t], nullptr);
  pthread_barrier_destroy(&g.all);
  for (int i = 0; i < threads / 32; ++i) pthread_barrier_destroy(&g.simd[i]);
}

// Host-side buffers: whole files in and out.
inline unsigned char* load(const char* dir, const char* name, size_t* size) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.bin", dir, name);
  FILE* f = fopen(path, "rb");
  if (!f) abort();
  fseek(f, 0, SEEK_END);
  *size = static_cast<size_t>(ftell(f));
  fseek(f, 0, SEEK_SET);
  unsigned char* buf = static_cast<unsigned char*>(malloc(*size ? *size : 1));
  if (fread(buf, 1, *size, f) != *size) abort();
  fclose(f);
  return buf;
}
inline void save(const char* dir, const char* name, const unsigned char* buf, size_t size) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.out", dir, name);
  FILE* f = fopen(path, "wb");
  if (!f || fwrite(buf, 1, size, f) != size) abort();
  fclose(f);
}
}  // namespace emu

// Operation counts per launch (all threads together), printed by the emulated launch's main():
// what "fast by design" can be judged by without a GPU.
namespace emu {
struct Counts {
  unsigned long simd_reductions = 0;  // simd_sum / simd_max / simd_min calls (per lane)
  unsigned long simd_shuffles = 0;    // simd_shuffle_xor / simd_broadcast calls (per lane)
  unsigned long barriers = 0;         // threadgroup_barrier calls (per thread)
  unsigned long exps = 0;             // metal::exp / fast::exp calls (per thread)
};
inline Counts counts;
inline void count(unsigned long* c) { __atomic_fetch_add(c, 1ul, __ATOMIC_RELAXED); }
template <typename V>
V exchange(V (*slots)[kMaxThreads], V x, int src_lane) {
  const int me = lane_ctx->index, sg = me / 32;
  int& parity = lane_ctx->group->parity[me];
  V* buf = slots[parity];
  parity ^= 1;
  buf[me] = x;
  pthread_barrier_wait(&lane_ctx->group->simd[sg]);
  return buf[sg * 32 + (src_lane & 31)];
}
}  // namespace emu

namespace metal {
inline float counted_exp(float x) { emu::count(&emu::counts.exps); return ::expf(x); }
MLXKV_EMU_1(exp, counted_exp)
namespace precise { MLXKV_EMU_1(exp, counted_exp) }
namespace fast { MLXKV_EMU_1(exp, counted_exp) }
}  // namespace metal
#undef MLXKV_EMU_1

inline float simd_sum(float x) { emu::count(&emu::counts.simd_reductions); return emu::reduce(emu::lane_ctx->group->slots, x, [](float a, float b) { return a + b; }); }
inline int simd_sum(int x) { emu::count(&emu::counts.simd_reductions); return emu::reduce(emu::lane_ctx->group->islots, x, [](int a, int b) { return a + b; }); }
inline float simd_max(float x) { emu::count(&emu::counts.simd_reductions); return emu::reduce(emu::lane_ctx->group->slots, x, [](float a, float b) { return a > b ? a : b; }); }
inline int simd_max(int x) { emu::count(&emu::counts.simd_reductions); return emu::reduce(emu::lane_ctx->group->islots, x, [](int a, int b) { return a > b ? a : b; }); }
inline float simd_min(float x) { emu::count(&emu::counts.simd_reductions); return emu::reduce(emu::lane_ctx->group->slots, x, [](float a, float b) { return a < b ? a : b; }); }
inline int simd_min(int x) { emu::count(&emu::counts.simd_reductions); return emu::reduce(emu::lane_ctx->group->islots, x, [](int a, int b) { return a < b ? a : b; }); }
inline float simd_shuffle_xor(float x, ushort mask) { emu::count(&emu::counts.simd_shuffles); return emu::exchange(emu::lane_ctx->group->slots, x, (emu::lane_ctx->index % 32) ^ mask); }
inline float simd_broadcast(float x, ushort lane) { emu::count(&emu::counts.simd_shuffles); return emu::exchange(emu::lane_ctx->group->slots, x, lane); }
inline void threadgroup_barrier(mem_flags) { emu::count(&emu::counts.barriers); pthread_barrier_wait(&emu::lane_ctx->group->all); }
namespace emu {
inline void group_done() { pthread_barrier_wait(&lane_ctx->group->all); }  // not counted: between groups
}  // namespace emu
inline void simdgroup_barrier(mem_flags) { pthread_barrier_wait(&emu::lane_ctx->group->simd[emu::lane_ctx->index / 32]); }
