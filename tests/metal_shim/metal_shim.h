// C++17 stand-in for the slice of the Metal Shading Language that mlxkv's kernel bodies use, so
// g++ can check a body wrapped in the signature MLX would generate (static check: `-fsyntax-only`
// with the strict flags of tests/metal_shim/static_check.py) and run it (metal_emulator.h).
//
// What the static check rejects beyond C++ syntax and type errors, because Metal rejects it:
// - a pointer into one address space used as a pointer into another, or as a plain (thread)
//   pointer: the check compiles once per address space with that space's qualifier defined as
//   `volatile` (MLXKV_VOLATILE_DEVICE / _CONSTANT / _THREADGROUP), so dropping it fails
//   ("invalid conversion from 'volatile float*' to 'float*'", -Werror=cast-qual for casts).
//   A thread pointer stored into a device pointer is not caught (adding a qualifier is legal C++);
// - `double`, the C++ and C libraries (`std::`, `printf`, `expf`, `malloc` ...; no system math
//   header is included, so only the Metal functions declared below exist), `new`/`delete`,
//   exceptions, `goto`, `virtual`, `thread_local`: poisoned identifiers at the end of this file;
// - variable-length arrays (-Werror=vla, -pedantic-errors); recursion (call-graph cycle check);
// - atomics other than 32-bit `atomic_int` / `atomic_uint` / `atomic_float` (no 64-bit atomics);
// - bfloat16_t operations beyond copying and explicit conversion to/from float: MLX's bfloat16_t
//   is a struct before Metal 3.1 and the native `bfloat` after, whose arithmetic result types and
//   math/simd overloads differ, so the kernels convert with static_cast<float> and compute in float.
// It proves nothing about Metal's compiler, memory model or speed.
#pragma once
#include <cstddef>
#include <cstdint>

#ifdef MLXKV_METAL_EMULATE
// Under the CPU emulator threadgroup arrays are function statics, shared by the threads of the one
// threadgroup that runs at a time; the other qualifiers vanish.
#define device
#define constant
#define thread
#define threadgroup static
#else
#ifdef MLXKV_VOLATILE_DEVICE
#define device volatile
#else
#define device
#endif
#ifdef MLXKV_VOLATILE_CONSTANT
#define constant volatile
#else
#define constant
#endif
#ifdef MLXKV_VOLATILE_THREADGROUP
#define threadgroup volatile
#else
#define threadgroup
#endif
#define thread
#endif

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif
#ifndef FLT_MAX
#define FLT_MAX (__FLT_MAX__)
#endif

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long;

struct uint3 {
  uint x, y, z;
};

// 16-bit floats: storage wrappers. Copies and conversions accept volatile operands because a
// qualifier stands for an address space in the static check.
#define MLXKV_COPYABLE(X)                                                                  \
  X(const X& o) = default;                                                                 \
  X(const volatile X& o) : bits(o.bits) {}                                                 \
  X& operator=(const X& o) = default;                                                      \
  X& operator=(const volatile X& o) { bits = o.bits; return *this; }                       \
  volatile X& operator=(const X& o) volatile { bits = o.bits; return *this; }              \
  volatile X& operator=(const volatile X& o) volatile { bits = o.bits; return *this; }
struct half {
  half() = default;
  half(float f);
  MLXKV_COPYABLE(half)
  operator float() const volatile;  // half arithmetic happens in float, as Metal promotes half op float
  unsigned short bits;
};
struct bfloat16_t {
  bfloat16_t() = default;
  bfloat16_t(float f);
  MLXKV_COPYABLE(bfloat16_t)
  explicit operator float() const volatile;  // no implicit arithmetic on bfloat16_t (see above)
  unsigned short bits;
};
using float16_t = half;

// Scalar types Metal's generic builtins (max, min, clamp) accept.
template <typename U> struct msl_scalar { static constexpr bool value = false; };
template <> struct msl_scalar<float> { static constexpr bool value = true; };
template <> struct msl_scalar<half> { static constexpr bool value = true; };
template <> struct msl_scalar<int> { static constexpr bool value = true; };
template <> struct msl_scalar<uint> { static constexpr bool value = true; };
template <> struct msl_scalar<short> { static constexpr bool value = true; };
template <> struct msl_scalar<ushort> { static constexpr bool value = true; };
template <> struct msl_scalar<long> { static constexpr bool value = true; };
template <> struct msl_scalar<ulong> { static constexpr bool value = true; };
template <bool B, typename U = void> struct msl_enable_if {};
template <typename U> struct msl_enable_if<true, U> { using type = U; };
#define MLXKV_MSL_SCALAR(U) typename msl_enable_if<msl_scalar<U>::value, U>::type

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

// SIMD-group functions for the 32-bit arithmetic scalar types (none for bfloat16_t).
float simd_sum(float x);
int simd_sum(int x);
float simd_max(float x);
int simd_max(int x);
float simd_min(float x);
int simd_min(int x);
float simd_shuffle_xor(float x, ushort mask);
float simd_broadcast(float x, ushort lane);
bfloat16_t simd_sum(bfloat16_t x) = delete;
bfloat16_t simd_max(bfloat16_t x) = delete;
bfloat16_t simd_min(bfloat16_t x) = delete;

// Atomics: Metal has 32-bit ones only (64-bit atomic<ulong> is min/max on a few GPUs; not used).
enum memory_order { memory_order_relaxed };
template <typename U> struct atomic;  // only the specialisations below are complete
template <> struct atomic<int> { int value; };
template <> struct atomic<uint> { uint value; };
template <> struct atomic<float> { float value; };
using atomic_int = atomic<int>;
using atomic_uint = atomic<uint>;
using atomic_float = atomic<float>;
#define MLXKV_ATOMIC_OPS(U)                                                          \
  void atomic_store_explicit(volatile atomic<U>* obj, U v, memory_order o);          \
  U atomic_load_explicit(const volatile atomic<U>* obj, memory_order o);             \
  U atomic_exchange_explicit(volatile atomic<U>* obj, U v, memory_order o);          \
  U atomic_fetch_add_explicit(volatile atomic<U>* obj, U v, memory_order o);         \
  U atomic_fetch_sub_explicit(volatile atomic<U>* obj, U v, memory_order o);
MLXKV_ATOMIC_OPS(int)
MLXKV_ATOMIC_OPS(uint)
MLXKV_ATOMIC_OPS(float)
#undef MLXKV_ATOMIC_OPS
int atomic_fetch_max_explicit(volatile atomic<int>* obj, int v, memory_order o);
uint atomic_fetch_max_explicit(volatile atomic<uint>* obj, uint v, memory_order o);
int atomic_fetch_min_explicit(volatile atomic<int>* obj, int v, memory_order o);
uint atomic_fetch_min_explicit(volatile atomic<uint>* obj, uint v, memory_order o);

namespace metal {
// Metal's max/min/clamp take arguments of one scalar type; the strict template rejects mixes.
template <typename U>
MLXKV_MSL_SCALAR(U) max(U a, U b);
template <typename U>
MLXKV_MSL_SCALAR(U) min(U a, U b);
template <typename U>
MLXKV_MSL_SCALAR(U) clamp(U x, U lo, U hi);
#define MLXKV_MATH_1(f) float f(float x); half f(half x); bfloat16_t f(bfloat16_t x) = delete;
MLXKV_MATH_1(exp)
MLXKV_MATH_1(exp2)
MLXKV_MATH_1(log)
MLXKV_MATH_1(log2)
MLXKV_MATH_1(sqrt)
MLXKV_MATH_1(rsqrt)
MLXKV_MATH_1(abs)
MLXKV_MATH_1(fabs)
float fma(float a, float b, float c);
float fmax(float a, float b);
float fmin(float a, float b);
bool isinf(float x);
bool isnan(float x);
namespace precise {
MLXKV_MATH_1(exp)
MLXKV_MATH_1(log)
MLXKV_MATH_1(rsqrt)
}  // namespace precise
namespace fast {
MLXKV_MATH_1(exp)
MLXKV_MATH_1(exp2)
MLXKV_MATH_1(log)
}  // namespace fast
#undef MLXKV_MATH_1
}  // namespace metal

using namespace metal;

#ifndef MLXKV_METAL_EMULATE
// Everything after this line is kernel source: names Metal does not have become hard errors.
#pragma GCC poison double std printf puts malloc calloc realloc free alloca __builtin_alloca
#pragma GCC poison memcpy memset memmove exit abort expf logf sqrtf powf fabsf exp10
#pragma GCC poison new delete throw try catch goto virtual typeid dynamic_cast const_cast
#pragma GCC poison thread_local
#endif
