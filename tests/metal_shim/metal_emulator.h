// CPU emulator for mlxkv's Metal kernel bodies: definitions behind metal_shim.h's declarations.
// One threadgroup runs at a time with one std::thread per Metal thread; simd_sum/simd_max
// exchange values through per-simdgroup slots and std::barrier, threadgroup_barrier waits on a
// threadgroup-wide barrier. This checks a body's indexing and arithmetic on real data; it says
// nothing about Metal's speed, memory model corners or compiler.
#pragma once
// Standard headers first: metal_shim.h defines `thread`, `device`, `constant` as macros.
#include <barrier>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace emu {
using os_thread = std::thread;  // the name `thread` is a macro from here on
}  // namespace emu

#define MLXKV_METAL_EMULATE 1
#include "metal_shim.h"

// -- 16-bit floats ------------------------------------------------------------------------
inline half::half(float f) {
  _Float16 h = static_cast<_Float16>(f);
  std::memcpy(&bits, &h, 2);
}
inline half::operator float() const {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}
inline bfloat16_t::bfloat16_t(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
  }
}
inline bfloat16_t::operator float() const {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// -- math ---------------------------------------------------------------------------------
namespace metal {
template <typename U>
U max(U a, U b) { return a > b ? a : b; }
template <typename U>
U min(U a, U b) { return a < b ? a : b; }
inline float exp(float x) { return std::exp(x); }
inline half exp(half x) { return half(std::exp(float(x))); }
inline float log(float x) { return std::log(x); }
inline half log(half x) { return half(std::log(float(x))); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace precise
}  // namespace metal

// -- threads ------------------------------------------------------------------------------
namespace emu {
struct Group {
  // Simdgroups are full: every kernel here launches threadgroups of a multiple of 32 threads.
  explicit Group(int threads) : all(threads), simd_count(threads / 32) {
    for (int i = 0; i < simd_count; ++i) {
      simd.emplace_back(std::make_unique<std::barrier<>>(32));
    }
    slots.assign(simd_count * 32, 0.0f);
    islots.assign(simd_count * 32, 0);
  }
  std::barrier<> all;
  int simd_count;
  std::vector<std::unique_ptr<std::barrier<>>> simd;
  std::vector<float> slots;
  std::vector<int> islots;
};
inline thread_local Group* group = nullptr;
inline thread_local int sg = 0;
inline thread_local int lane = 0;

template <typename V, typename F>
V reduce(std::vector<V>& slots, V x, F f) {
  auto& bar = *group->simd[sg];
  slots[sg * 32 + lane] = x;
  bar.arrive_and_wait();
  V acc = slots[sg * 32];
  for (int i = 1; i < 32; ++i) {
    acc = f(acc, slots[sg * 32 + i]);
  }
  bar.arrive_and_wait();
  return acc;
}

// Run `body(local_index)` on `threads` threads as one threadgroup.
template <typename F>
void run_group(int threads, F body) {
  Group g(threads);
  std::vector<os_thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      group = &g;
      sg = t / 32;
      lane = t % 32;
      body(t);
    });
  }
  for (auto& th : pool) th.join();
}
}  // namespace emu

inline float simd_sum(float x) { return emu::reduce(emu::group->slots, x, [](float a, float b) { return a + b; }); }
inline int simd_sum(int x) { return emu::reduce(emu::group->islots, x, [](int a, int b) { return a + b; }); }
inline float simd_max(float x) { return emu::reduce(emu::group->slots, x, [](float a, float b) { return a > b ? a : b; }); }
inline int simd_max(int x) { return emu::reduce(emu::group->islots, x, [](int a, int b) { return a > b ? a : b; }); }
inline void threadgroup_barrier(mem_flags) { emu::group->all.arrive_and_wait(); }
