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
// PyTorch already loaded and handed in as pointers (mp_cuda_set_raw). Its policies (issues 33,
// 34), each tested against a host stand-in for the device (tests/torch/test_cuda_policies.py):
//
// - Near size: a free block is reused only on the same device and stream (the rule PyTorch's
//   caching allocator follows without record_stream), by a request of rounded size r when the
//   block's size s is within r <= s <= r + r * slack_num / slack_den (1/8 by default): the
//   smallest such block. A larger block is never handed to a small request (it would be
//   wasted); the in-use counter counts the whole block.
// - Cache bound: before a block is taken from the device, free cached blocks are given back,
//   the largest first, until, after the new block,
//       held <= high_in_use + cache_limit + growth        (cache_limit < 0: no bound)
//   where high_in_use is the most bytes in use since the policy was set (the new block
//   included). Setting the policy gives cached blocks back at once down to in_use + cache_limit,
//   so at every moment held <= high_in_use + cache_limit + growth, i.e. max_memory_reserved <=
//   max_memory_allocated + cache_limit + growth over the time since the policy was set.
// - Growth (issue 34, arena views on this allocator): a bound of a fixed size thrashes when a
//   step frees and asks again for more distinct blocks than it holds: each miss evicts a block a
//   later request needs (vit-base b32 on an H100: 335 cudaMalloc and 335 cudaFree per step, 3.3x
//   eager's step time). So the cache remembers the (device, stream, size) of the last
//   kMaxGhosts blocks its bound gave back; a miss that one of them would have served (a regret)
//   grows the bound by that block's size, up to growth_ceiling (< 0: high_in_use, so reserved
//   <= 2 * max_memory_allocated + cache_limit; 0: no growth). A miss that is a regret never
//   evicts (the bound grew by at least the new block; unless the ceiling or a cap binds), so a
//   step whose requests repeat settles
//   after a few visits (from the fourth in the tests) at what one whole step needs beyond its
//   peak in use, and then makes no device call. Setting the policy resets the growth. The cost:
//   requests that keep changing sizes may grow the bound to its ceiling.
// - Held cap (a memory_budget, mp_cuda_set_held_cap): cached blocks are given back at once, and
//   before every new block, so that held <= cap; only the bytes in use can take held above it.
// - Out of memory: the cache is emptied and the request retried once.
// - Frees: a pointer this cache does not hold live (a second free, a foreign pointer) is never
//   passed to cudaFree; it is counted (unknown_frees) so a test or the GPU suite can see it.
//
// Counters of held and in-use bytes stand in for PyTorch's max_memory_reserved /
// max_memory_allocated, which a pluggable allocator does not keep.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>

#include "replay_core.h"

namespace {

constexpr size_t kBlockAlign = 512;  // PyTorch's CUDA caching allocator rounds to 512 bytes too

using RawMalloc = int (*)(void** ptr, size_t n);  // cudaMalloc's signature (cudaError_t is an int enum)
using RawFree = int (*)(void* ptr);               // cudaFree's

constexpr int kNumMemoryStats = 15;
constexpr size_t kMaxGhosts = 4096;  // evicted blocks remembered for the growth rule

struct BlockCache {
  RawMalloc raw_malloc = nullptr;
  RawFree raw_free = nullptr;
  std::mutex mu;
  using Key = std::tuple<int, int64_t, size_t>;  // device, stream, block size
  std::multimap<Key, void*> cached;
  std::unordered_map<void*, Key> live;
  int64_t held = 0, peak_held = 0, in_use = 0, peak_in_use = 0, raw_calls = 0;
  int64_t cached_bytes = 0, raw_frees = 0, near_hits = 0, evicted = 0, unknown_frees = 0;
  int64_t cache_limit = -1;  // most bytes held beyond high_in_use (+ growth) when a block is taken
  int64_t slack_num = 1, slack_den = 8;  // near-size rule: s <= r + r * slack_num / slack_den
  int64_t high_in_use = 0;   // the most bytes in use since the policy was set
  int64_t growth = 0;        // bytes the bound grew by (regrets)
  int64_t growth_ceiling = -1;  // the most growth (-1: high_in_use; 0: none)
  int64_t regrets = 0;       // misses that a block the bound gave back would have served
  int64_t held_cap = -1;     // the most bytes held (a memory_budget; -1: none)
  std::multiset<Key> ghosts;  // blocks the bound gave back, the last kMaxGhosts of them
  std::deque<Key> ghost_order;

  static size_t rounded(size_t n) {
    return (n + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
  }

  // The largest block a request of rounded size r may take from the cache.
  size_t largest_served(size_t r) const {
    return r + r / static_cast<size_t>(slack_den) * static_cast<size_t>(slack_num);
  }

  // Whether a block `have` serves a request `want` (same device and stream, near size).
  bool serves(const Key& have, const Key& want) const {
    return std::get<0>(have) == std::get<0>(want) && std::get<1>(have) == std::get<1>(want) &&
           std::get<2>(have) <= largest_served(std::get<2>(want));
  }

  void* alloc(size_t n, int device, void* stream) {
    std::lock_guard<std::mutex> lock(mu);
    size_t r = rounded(n == 0 ? 1 : n);
    Key key{device, reinterpret_cast<int64_t>(stream), r};
    void* p = nullptr;
    auto hit = cached.lower_bound(key);  // the smallest block of at least r on this device and stream
    if (hit != cached.end() && serves(hit->first, key)) {
      p = hit->second;
      key = hit->first;
      near_hits += std::get<2>(key) != r;
      cached_bytes -= static_cast<int64_t>(std::get<2>(key));
      cached.erase(hit);
    } else {
      p = fresh(key);
      if (p == nullptr) {
        return nullptr;
      }
    }
    live[p] = key;
    in_use += static_cast<int64_t>(std::get<2>(key));
    peak_in_use = std::max(peak_in_use, in_use);
    high_in_use = std::max(high_in_use, in_use);
    return p;
  }

  // The most bytes the device may hold after a new block of `size` (the bound, then the cap).
  int64_t held_target(int64_t size) const {
    int64_t target = std::numeric_limits<int64_t>::max();
    if (cache_limit >= 0) {
      target = std::max(high_in_use, in_use + size) + cache_limit + growth;
    }
    return held_cap >= 0 ? std::min(target, held_cap) : target;
  }

  // A miss that a block the bound gave back would have served: the bound grows by that block.
  void regret(const Key& key, int64_t size) {
    auto ghost = ghosts.lower_bound(key);
    if (cache_limit < 0 || ghost == ghosts.end() || !serves(*ghost, key)) {
      return;
    }
    ++regrets;
    int64_t ceiling = growth_ceiling >= 0 ? growth_ceiling : std::max(high_in_use, in_use + size);
    growth = std::min(growth + static_cast<int64_t>(std::get<2>(*ghost)), std::max(growth, ceiling));
    ghosts.erase(ghost);
  }

  // A new block from the device, after giving back what the cache bound and the cap ask for.
  void* fresh(const Key& key) {
    size_t size = std::get<2>(key);
    void* p = nullptr;
    ++raw_calls;
    if (raw_malloc == nullptr) {
      return nullptr;
    }
    regret(key, static_cast<int64_t>(size));
    evict_above(held_target(static_cast<int64_t>(size)) - static_cast<int64_t>(size), true);
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

  // Gives cached blocks back, the largest first, until held <= target; `remember`: as ghosts.
  void evict_above(int64_t target, bool remember) {
    while (held > target && !cached.empty()) {
      auto largest = cached.begin();
      for (auto it = cached.begin(); it != cached.end(); ++it) {
        if (std::get<2>(it->first) > std::get<2>(largest->first)) {
          largest = it;
        }
      }
      if (remember) {
        remember_ghost(largest->first);
      }
      give_back(largest->second, std::get<2>(largest->first));
      ++evicted;
      cached.erase(largest);
    }
  }

  void remember_ghost(const Key& key) {
    ghosts.insert(key);
    ghost_order.push_back(key);
    if (ghost_order.size() > kMaxGhosts) {  // forget the oldest (one block of its key, if still remembered)
      auto oldest = ghosts.find(ghost_order.front());
      if (oldest != ghosts.end()) {
        ghosts.erase(oldest);
      }
      ghost_order.pop_front();
    }
  }

  // A new policy: the growth and the ghosts start over, and cached blocks are given back at once
  // so that held <= in_use + cache_limit and held <= held_cap.
  void restart_policy() {
    growth = 0;
    ghosts.clear();
    ghost_order.clear();
    high_in_use = in_use;
    int64_t target = std::numeric_limits<int64_t>::max();
    if (cache_limit >= 0) {
      target = in_use + cache_limit;
    }
    if (held_cap >= 0) {
      target = std::min(target, held_cap);
    }
    evict_above(target, false);
  }

  void give_back(void* p, size_t size) {
    raw_free(p);
    ++raw_frees;
    held -= static_cast<int64_t>(size);
    cached_bytes -= static_cast<int64_t>(size);
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(p);
    if (it == live.end()) {
      ++unknown_frees;  // a second free or a foreign pointer: never reaches cudaFree
      return;
    }
    in_use -= static_cast<int64_t>(std::get<2>(it->second));
    cached_bytes += static_cast<int64_t>(std::get<2>(it->second));
    cached.emplace(it->second, p);
    live.erase(it);
  }

  void release_cached() {
    for (auto& entry : cached) {
      give_back(entry.second, std::get<2>(entry.first));
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

// stats: held bytes, peak held, in-use bytes, peak in use, raw device allocations so far, cached
// (free) bytes, raw device frees, near-size hits, blocks evicted by the bound, unknown frees, the
// cache bound (-1: none), its growth, regrets, the held cap (-1: none), the most in use since the
// policy was set.
void mp_cuda_memory_stats(int64_t* stats) {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  const BlockCache& c = g_cache;
  int64_t values[kNumMemoryStats] = {c.held,        c.peak_held,     c.in_use,    c.peak_in_use, c.raw_calls,
                                     c.cached_bytes, c.raw_frees,    c.near_hits, c.evicted,     c.unknown_frees,
                                     c.cache_limit, c.growth,        c.regrets,   c.held_cap,    c.high_in_use};
  std::copy(values, values + kNumMemoryStats, stats);
}

// The cache bound in bytes (-1: none), the near-size slack (a block of s bytes serves a request
// of r when r <= s <= r + r * slack_num / slack_den; slack_num 0: the same size only) and the
// most the bound may grow by (-1: the most bytes in use; 0: no growth). The growth starts over,
// and cached blocks beyond in_use + cache_limit are given back now.
void mp_cuda_set_cache_policy(int64_t cache_limit, int64_t slack_num, int64_t slack_den, int64_t growth_ceiling) {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  g_cache.cache_limit = cache_limit;
  g_cache.slack_num = slack_num < 0 ? 0 : slack_num;
  g_cache.slack_den = slack_den < 1 ? 1 : slack_den;
  g_cache.growth_ceiling = growth_ceiling;
  g_cache.restart_policy();
}

// The most bytes the device may hold (-1: no cap): cached blocks beyond it are given back now.
void mp_cuda_set_held_cap(int64_t held_cap) {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  g_cache.held_cap = held_cap;
  if (held_cap >= 0) {
    g_cache.evict_above(held_cap, false);
  }
}

void mp_cuda_reset_peaks() {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  g_cache.peak_held = g_cache.held;
  g_cache.peak_in_use = g_cache.in_use;
}

}  // extern "C"
