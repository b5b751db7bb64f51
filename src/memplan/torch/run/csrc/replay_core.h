// The record/replay state machine of the planned allocators (Sekiyama et al. 3-4), shared by
// the CPU allocator (planned_allocator.cpp, installed in front of c10's CPU allocator) and the
// CUDA one (cuda_planned_allocator.cpp, a CUDAPluggableAllocator). Header only, no torch and
// no CUDA headers: a "stream" is an opaque pointer, and the base allocator (where requests go
// when the step is neither recorded nor replayed, or when replay cannot serve them) is a pair
// of function pointers.
//
// Record: every request of the owning thread goes to the base allocator and is logged (size,
// stream; then its free) as an event sequence. Replay: request k is served at arena + offsets[k]
// only if its size and stream are the recorded ones and every arena allocation planned to be
// freed before it really was (the safety check: no two arena allocations that overlap in
// address are ever live together); otherwise it goes to the base allocator and is counted.
// Once one request differs from the recording (divergence), the rest of the step goes to the
// base allocator too.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace memplan {

enum Mode { kOff = 0, kRecord = 1, kReplay = 2 };

using BaseAlloc = void* (*)(size_t n, void* stream, void* ctx);
using BaseFree = void (*)(void* p, size_t n, void* stream, void* ctx);

constexpr int kNumStats = 8;

struct ReplayCore {
  BaseAlloc base_alloc = nullptr;
  BaseFree base_free = nullptr;
  void* base_ctx = nullptr;

  std::mutex mu;
  std::atomic<int> mode{kOff};
  std::thread::id owner;

  // recording
  std::vector<int64_t> rec_sizes;    // size of allocation k
  std::vector<int64_t> rec_streams;  // stream of allocation k
  std::vector<int64_t> rec_events;   // k >= 0: allocation k; -(k + 1): free of allocation k
  std::unordered_map<void*, std::pair<int64_t, int64_t>> rec_live;  // pointer -> (recording, allocation)
  int64_t recording = 0;  // which recording is open (frees of older ones are not its events)
  bool recording_open = false;

  // replay
  char* arena = nullptr;
  int64_t arena_size = 0;
  std::vector<int64_t> sizes, streams, offsets, need, free_order;
  std::vector<char> freed;
  std::unordered_map<void*, int64_t> arena_live;  // arena pointer -> allocation index
  int64_t next = 0, prefix = 0, diverged_at = -1;
  int64_t served = 0, served_bytes = 0, fallback = 0, fallback_bytes = 0, blocked = 0;

  // True when a request may be recorded or replayed (cheap check, no lock; allocate() checks
  // the thread under the lock and passes other threads' requests through).
  bool wants(size_t n) const {
    return mode != kOff && n != 0;
  }

  // Serves one request: recorded or replayed when it comes from the owning thread.
  void* allocate(size_t n, void* stream) {
    std::lock_guard<std::mutex> lock(mu);
    if (mode == kRecord && std::this_thread::get_id() == owner) {
      void* p = base_alloc(n, stream, base_ctx);
      if (p == nullptr) {
        return nullptr;
      }
      int64_t k = static_cast<int64_t>(rec_sizes.size());
      rec_sizes.push_back(static_cast<int64_t>(n));
      rec_streams.push_back(reinterpret_cast<int64_t>(stream));
      rec_events.push_back(k);
      rec_live[p] = {recording, k};
      return p;
    }
    if (mode == kReplay && std::this_thread::get_id() == owner) {
      return replay(n, stream);
    }
    return base_alloc(n, stream, base_ctx);
  }

  void* replay(size_t n, void* stream) {
    int64_t k = next++;
    if (diverged_at < 0 && (k >= static_cast<int64_t>(sizes.size()) || sizes[k] != static_cast<int64_t>(n) ||
                            streams[k] != reinterpret_cast<int64_t>(stream))) {
      diverged_at = k;
    }
    if (diverged_at >= 0 || offsets[k] < 0) {
      return fall_back(n, stream);
    }
    while (prefix < static_cast<int64_t>(free_order.size()) && freed[free_order[prefix]]) {
      ++prefix;
    }
    if (prefix < need[k]) {  // something planned to be gone by now is still alive
      ++blocked;
      return fall_back(n, stream);
    }
    void* p = arena + offsets[k];
    arena_live[p] = k;
    ++served;
    served_bytes += static_cast<int64_t>(n);
    return p;
  }

  void* fall_back(size_t n, void* stream) {
    ++fallback;
    fallback_bytes += static_cast<int64_t>(n);
    return base_alloc(n, stream, base_ctx);
  }

  // Frees a pointer this allocator returned (any thread): arena memory is only marked free,
  // everything else goes back to the base allocator.
  void release(void* p, size_t n, void* stream) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto a = arena_live.find(p);
      if (a != arena_live.end()) {
        if (a->second < static_cast<int64_t>(freed.size())) {
          freed[a->second] = 1;
        }
        arena_live.erase(a);
        return;
      }
      auto r = rec_live.find(p);
      if (r != rec_live.end()) {
        if (recording_open && r->second.first == recording) {
          rec_events.push_back(-(r->second.second + 1));
        }
        rec_live.erase(r);
      }
    }
    base_free(p, n, stream, base_ctx);
  }

  void begin_record() {
    std::lock_guard<std::mutex> lock(mu);
    rec_sizes.clear();
    rec_streams.clear();
    rec_events.clear();
    recording_open = true;
    ++recording;
    owner = std::this_thread::get_id();
    mode = kRecord;
  }

  // Stops recording; returns the number of events (allocations + frees) recorded.
  int64_t end_record() {
    std::lock_guard<std::mutex> lock(mu);
    mode = kOff;
    recording_open = false;
    return static_cast<int64_t>(rec_events.size());
  }

  int64_t record_num_allocations() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<int64_t>(rec_sizes.size());
  }

  void record_copy(int64_t* out_sizes, int64_t* out_events, int64_t* out_streams) {
    std::lock_guard<std::mutex> lock(mu);
    std::copy(rec_sizes.begin(), rec_sizes.end(), out_sizes);
    std::copy(rec_events.begin(), rec_events.end(), out_events);
    if (out_streams != nullptr) {
      std::copy(rec_streams.begin(), rec_streams.end(), out_streams);
    }
  }

  // offsets[k] < 0: allocation k goes to the base allocator; need[k]: how many entries of
  // free_order must be freed before allocation k may take its offset; streams may be null
  // (every allocation on the null stream). Returns 0 (and replays nothing) while arena
  // allocations of an earlier replay are alive, or when a planned block lies outside the arena.
  int begin_replay(char* arena_ptr, int64_t size, int64_t n, const int64_t* in_sizes, const int64_t* in_streams,
                   const int64_t* in_offsets, const int64_t* in_need, int64_t n_free, const int64_t* in_free_order) {
    std::lock_guard<std::mutex> lock(mu);
    if (!arena_live.empty()) {
      return 0;
    }
    for (int64_t k = 0; k < n; ++k) {
      if (in_offsets[k] >= 0 && in_offsets[k] + in_sizes[k] > size) {
        return 0;
      }
    }
    arena = arena_ptr;
    arena_size = size;
    sizes.assign(in_sizes, in_sizes + n);
    if (in_streams != nullptr) {
      streams.assign(in_streams, in_streams + n);
    } else {
      streams.assign(n, 0);
    }
    offsets.assign(in_offsets, in_offsets + n);
    need.assign(in_need, in_need + n);
    free_order.assign(in_free_order, in_free_order + n_free);
    freed.assign(n, 0);
    next = prefix = served = served_bytes = fallback = fallback_bytes = blocked = 0;
    diverged_at = -1;
    owner = std::this_thread::get_id();
    mode = kReplay;
    return 1;
  }

  // Stops replaying. stats: served, served_bytes, fallback, fallback_bytes, blocked,
  // diverged_at, allocations seen, arena allocations still alive.
  void end_replay(int64_t* stats) {
    std::lock_guard<std::mutex> lock(mu);
    mode = kOff;
    int64_t values[kNumStats] = {served,      served_bytes, fallback, fallback_bytes,
                                 blocked,     diverged_at,  next,     static_cast<int64_t>(arena_live.size())};
    std::copy(values, values + kNumStats, stats);
  }
};

}  // namespace memplan

// The C interface of one ReplayCore, the same in both libraries (ctypes drives it).
#define MEMPLAN_REPLAY_C_API(core)                                                                              \
  extern "C" {                                                                                                  \
  void mp_begin_record() { (core).begin_record(); }                                                             \
  int64_t mp_end_record() { return (core).end_record(); }                                                       \
  int64_t mp_record_num_allocations() { return (core).record_num_allocations(); }                               \
  void mp_record_copy(int64_t* sizes, int64_t* events, int64_t* streams) {                                      \
    (core).record_copy(sizes, events, streams);                                                                 \
  }                                                                                                             \
  int mp_begin_replay(char* arena, int64_t arena_size, int64_t n, const int64_t* sizes, const int64_t* streams, \
                      const int64_t* offsets, const int64_t* need, int64_t n_free, const int64_t* free_order) { \
    return (core).begin_replay(arena, arena_size, n, sizes, streams, offsets, need, n_free, free_order);        \
  }                                                                                                             \
  void mp_end_replay(int64_t* stats) { (core).end_replay(stats); }                                              \
  }
