// The planned CUDA allocator: the CPU allocator's record/replay state machine
// (replay_core.h) behind the two entry points of torch.cuda.memory.CUDAPluggableAllocator,
//   void* mp_cuda_malloc(size_t size, int device, void* stream)
//   void  mp_cuda_free(void* ptr, size_t size, int device, void* stream)
// Built with the system C++ compiler alone: no CUDA headers, no nvcc, no torch headers. A
// stream is an opaque pointer; the arena is a block PyTorch allocated (its address is handed
// in), and planned offsets are pointer arithmetic on it.
//
// Requests that are not replayed (outside a planned step, or beyond the plan) go to the base:
// a small cache of 512-byte-rounded blocks over two raw device functions with the signatures
// of cudaMalloc(void**, size_t) and cudaFree(void*), resolved by Python from the CUDA runtime
// PyTorch already loaded and handed in as pointers (mp_cuda_set_raw). A freed block is reused
// only for a request of the same size on the same stream and device, the rule PyTorch's caching
// allocator follows without record_stream; on an out-of-memory the cache is emptied and the
// request retried once. Counters of held and in-use bytes stand in for PyTorch's
// max_memory_reserved / max_memory_allocated, which a pluggable allocator does not keep.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "replay_core.h"

namespace {

constexpr size_t kBlockAlign = 512;  // PyTorch's CUDA caching allocator rounds to 512 bytes too

using RawMalloc = int (*)(void** ptr, size_t n);  // cudaMalloc's signature (cudaError_t is an int enum)
using RawFree = int (*)(void* ptr);               // cudaFree's

struct BlockCache {
  RawMalloc raw_malloc = nullptr;
  RawFree raw_free = nullptr;
  std::mutex mu;
  using Key = std::tuple<int, int64_t, size_t>;  // device, stream, rounded size
  std::multimap<Key, void*> cached;
  std::unordered_map<void*, Key> live;
  int64_t held = 0, peak_held = 0, in_use = 0, peak_in_use = 0, raw_calls = 0;

  static size_t rounded(size_t n) {
    return (n + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
  }

  void* alloc(size_t n, int device, void* stream) {
    std::lock_guard<std::mutex> lock(mu);
    Key key{device, reinterpret_cast<int64_t>(stream), rounded(n == 0 ? 1 : n)};
    void* p = nullptr;
    auto hit = cached.find(key);
    if (hit != cached.end()) {
      p = hit->second;
      cached.erase(hit);
    } else {
      p = fresh(std::get<2>(key));
      if (p == nullptr) {
        return nullptr;
      }
    }
    live[p] = key;
    in_use += static_cast<int64_t>(std::get<2>(key));
    peak_in_use = std::max(peak_in_use, in_use);
    return p;
  }

  void* fresh(size_t size) {
    void* p = nullptr;
    ++raw_calls;
    if (raw_malloc == nullptr) {
      return nullptr;
    }
    if (raw_malloc(&p, size) != 0 || p == nullptr) {
      release_cached();  // out of memory: give the cached blocks back and try once more
      p = nullptr;
      if (raw_malloc(&p, size) != 0) {
        return nullptr;
      }
    }
    held += static_cast<int64_t>(size);
    peak_held = std::max(peak_held, held);
    return p;
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(p);
    if (it == live.end()) {
      return;  // not ours (never happens through PyTorch); ignoring beats corrupting the cache
    }
    in_use -= static_cast<int64_t>(std::get<2>(it->second));
    cached.emplace(it->second, p);
    live.erase(it);
  }

  void release_cached() {
    for (auto& entry : cached) {
      raw_free(entry.second);
      held -= static_cast<int64_t>(std::get<2>(entry.first));
    }
    cached.clear();
  }
};

BlockCache g_cache;
memplan::ReplayCore g_core;
std::atomic<int> g_device{-1};  // the device whose requests may be recorded or replayed

void* base_alloc(size_t n, void* stream, void* /*ctx*/) {
  return g_cache.alloc(n, g_device, stream);  // the core only sees the planned device's requests
}

void base_free(void* p, size_t /*n*/, void* /*stream*/, void* /*ctx*/) {
  g_cache.free(p);
}

}  // namespace

MEMPLAN_REPLAY_C_API(g_core)

extern "C" {

// The raw device functions (cudaMalloc, cudaFree) and the device to plan for (-1: none yet;
// every request then goes to the cache).
void mp_cuda_set_raw(void* raw_malloc, void* raw_free, int device) {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  g_cache.raw_malloc = reinterpret_cast<RawMalloc>(raw_malloc);
  g_cache.raw_free = reinterpret_cast<RawFree>(raw_free);
  g_core.base_alloc = &base_alloc;
  g_core.base_free = &base_free;
  g_core.base_ctx = nullptr;
  g_device = device;
}

// The device whose requests may be recorded and replayed (set once CUDA is initialised).
void mp_cuda_set_device(int device) {
  g_device = device;
}

void* mp_cuda_malloc(size_t size, int device, void* stream) {
  if (device == g_device && g_core.wants(size)) {
    return g_core.allocate(size, stream);
  }
  return g_cache.alloc(size, device, stream);
}

void mp_cuda_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr == nullptr) {
    return;
  }
  if (device == g_device) {
    g_core.release(ptr, size, stream);  // arena blocks are only marked free; the rest reach the cache
  } else {
    g_cache.free(ptr);
  }
}

// Gives every cached (free) block back to the device.
void mp_cuda_empty_cache() {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  g_cache.release_cached();
}

// stats: held bytes, peak held, in-use bytes, peak in use, raw device allocations so far.
void mp_cuda_memory_stats(int64_t* stats) {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  int64_t values[5] = {g_cache.held, g_cache.peak_held, g_cache.in_use, g_cache.peak_in_use, g_cache.raw_calls};
  std::copy(values, values + 5, stats);
}

void mp_cuda_reset_peaks() {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  g_cache.peak_held = g_cache.held;
  g_cache.peak_in_use = g_cache.in_use;
}

}  // extern "C"
