// C++17 stand-in for the slice of the Metal Shading Language that mlxkv's kernel bodies use, so
// `g++ -std=c++17 -fsyntax-only` can check a body wrapped in the signature MLX would generate.
// It catches syntax errors, undeclared names and type mismatches; it proves nothing about
// Metal semantics (address spaces vanish, simd/threadgroup builtins are declarations only).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

// Address-space qualifiers disappear; attributes like [[buffer(0)]] are ignored (-Wno-attributes).
// Under the CPU emulator (metal_emulator.h) threadgroup arrays become function statics, shared by
// the threads of the one threadgroup that runs at a time.
#define device
#define constant
#define thread
#ifdef MLXKV_METAL_EMULATE
#define threadgroup static
#else
#define threadgroup
#endif

using uint = unsigned int;

struct uint3 {
  uint x, y, z;
};

// 16-bit float types: storage-only wrappers with float conversions, like Metal's half and
// MLX's bfloat16_t (the kernels do all arithmetic in float).
struct half {
  half() = default;
  half(float f);
  operator float() const;
  unsigned short bits;
};
struct bfloat16_t {
  bfloat16_t() = default;
  bfloat16_t(float f);
  operator float() const;
  unsigned short bits;
};
using float16_t = half;

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags flags);

// SIMD-group reductions are defined for the arithmetic scalar types.
float simd_sum(float x);
int simd_sum(int x);
float simd_max(float x);
int simd_max(int x);

namespace metal {
// Metal's max/min take two arguments of the same type; a strict template rejects mixed types.
template <typename U>
U max(U a, U b);
template <typename U>
U min(U a, U b);
float exp(float x);
half exp(half x);
float log(float x);
half log(half x);
float rsqrt(float x);
float sqrt(float x);
float abs(float x);
namespace precise {
float exp(float x);
float rsqrt(float x);
}  // namespace precise
}  // namespace metal

using namespace metal;
