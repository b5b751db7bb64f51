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
//
// A plan may hold several recorded steps (branches, e.g. a GradScaler step that skips the
// update and one that makes it) placed in one arena: branches a and b share their first
// shared[a][b] allocations (same offsets in both). When request k differs from the current
// branch, replay continues on a branch that shares the first k allocations with it and whose
// allocation k is this request (its own safety check from then on); when none does
// (divergence), the rest of the step goes to the base allocator. Every replayed step is logged
// as a recording is (sizes, streams, events), so a step that diverged can become a branch.

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

constexpr int kNumStats = 9;

// One recorded step of a plan: the arrays begin_replay takes for it.
struct Branch {
  std::vector<int64_t> sizes, streams, offsets, need, free_order;
};

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
  std::vector<Branch> branches;
  std::vector<int64_t> shared;  // shared[a * branches + b]: leading allocations a and b share
  int64_t branch = 0;           // the branch the step follows
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
      log_allocation(n, stream);
      rec_live[p] = {recording, static_cast<int64_t>(rec_sizes.size()) - 1};
      return p;
    }
    if (mode == kReplay && std::this_thread::get_id() == owner) {
      log_allocation(n, stream);
      void* p = replay(n, stream);
      if (p != nullptr && arena_live.find(p) == arena_live.end()) {
        rec_live[p] = {recording, static_cast<int64_t>(rec_sizes.size()) - 1};
      }
      return p;
    }
    return base_alloc(n, stream, base_ctx);
  }

  void log_allocation(size_t n, void* stream) {
    int64_t k = static_cast<int64_t>(rec_sizes.size());
    rec_sizes.push_back(static_cast<int64_t>(n));
    rec_streams.push_back(reinterpret_cast<int64_t>(stream));
    rec_events.push_back(k);
  }

  // True when allocation k of branch b is a request of n bytes on stream.
  bool matches(int64_t b, int64_t k, size_t n, void* stream) const {
    const Branch& br = branches[b];
    return k < static_cast<int64_t>(br.sizes.size()) && br.sizes[k] == static_cast<int64_t>(n) &&
           br.streams[k] == reinterpret_cast<int64_t>(stream);
  }

  // Request k differs from the current branch: follow one that shares allocations 0..k-1 with
  // it and makes this request next (its safety-check prefix counted again); false if none.
  bool switch_branch(int64_t k, size_t n, void* stream) {
    int64_t count = static_cast<int64_t>(branches.size());
    for (int64_t b = 0; b < count; ++b) {
      if (b != branch && shared[branch * count + b] >= k && matches(b, k, n, stream)) {
        branch = b;
        prefix = 0;
        return true;
      }
    }
    return false;
  }

  void* replay(size_t n, void* stream) {
    int64_t k = next++;
    if (diverged_at < 0 && !matches(branch, k, n, stream) && !switch_branch(k, n, stream)) {
      diverged_at = k;
    }
    if (diverged_at >= 0 || branches[branch].offsets[k] < 0) {
      return fall_back(n, stream);
    }
    const Branch& br = branches[branch];
    while (prefix < static_cast<int64_t>(br.free_order.size()) && freed[br.free_order[prefix]]) {
      ++prefix;
    }
    if (prefix < br.need[k]) {  // something planned to be gone by now is still alive
      ++blocked;
      return fall_back(n, stream);
    }
    void* p = arena + br.offsets[k];
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
        if (recording_open) {  // arena allocations are all of the open replay (begin_replay checks)
          rec_events.push_back(-(a->second + 1));
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
    open_log();
    mode = kRecord;
  }

  // Starts a new log of the owning thread's requests (a recording, or a replayed step's).
  void open_log() {
    rec_sizes.clear();
    rec_streams.clear();
    rec_events.clear();
    recording_open = true;
    ++recording;
    owner = std::this_thread::get_id();
  }

  int64_t record_num_events() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<int64_t>(rec_events.size());
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

  // Branch b has lengths[b] allocations; its arrays lie one after another in the inputs
  // (free_order: free_lengths[b] entries each). offsets[k] < 0: allocation k goes to the base
  // allocator; need[k]: how many entries of its branch's free_order must be freed before
  // allocation k may take its offset; streams may be null (every allocation on the null
  // stream); shared: n_branches x n_branches. Returns 0 (and replays nothing) while arena
  // allocations of an earlier replay are alive, or when a planned block lies outside the arena.
  int begin_replay(char* arena_ptr, int64_t size, int64_t n_branches, const int64_t* lengths,
                   const int64_t* in_sizes, const int64_t* in_streams, const int64_t* in_offsets,
                   const int64_t* in_need, const int64_t* free_lengths, const int64_t* in_free_order,
                   const int64_t* in_shared) {
    std::lock_guard<std::mutex> lock(mu);
    if (!arena_live.empty()) {
      return 0;
    }
    std::vector<Branch> loaded(n_branches);
    int64_t at = 0, free_at = 0, longest = 0;
    for (int64_t b = 0; b < n_branches; ++b) {
      int64_t n = lengths[b], n_free = free_lengths[b];
      for (int64_t k = at; k < at + n; ++k) {
        if (in_offsets[k] >= 0 && in_offsets[k] + in_sizes[k] > size) {
          return 0;
        }
      }
      Branch& br = loaded[b];
      br.sizes.assign(in_sizes + at, in_sizes + at + n);
      if (in_streams != nullptr) {
        br.streams.assign(in_streams + at, in_streams + at + n);
      } else {
        br.streams.assign(n, 0);
      }
      br.offsets.assign(in_offsets + at, in_offsets + at + n);
      br.need.assign(in_need + at, in_need + at + n);
      br.free_order.assign(in_free_order + free_at, in_free_order + free_at + n_free);
      at += n;
      free_at += n_free;
      longest = std::max(longest, n);
    }
    arena = arena_ptr;
    arena_size = size;
    branches.swap(loaded);
    shared.assign(in_shared, in_shared + n_branches * n_branches);
    branch = 0;
    freed.assign(longest, 0);
    next = prefix = served = served_bytes = fallback = fallback_bytes = blocked = 0;
    diverged_at = -1;
    open_log();
    mode = kReplay;
    return 1;
  }

  // Stops replaying (the step's log stays readable through record_copy). stats: served,
  // served_bytes, fallback, fallback_bytes, blocked, diverged_at, allocations seen, arena
  // allocations still alive, the branch the step ended on.
  void end_replay(int64_t* stats) {
    std::lock_guard<std::mutex> lock(mu);
    mode = kOff;
    recording_open = false;
    int64_t values[kNumStats] = {served,   served_bytes, fallback, fallback_bytes,
                                 blocked,  diverged_at,  next,     static_cast<int64_t>(arena_live.size()),
                                 branch};
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
  int64_t mp_record_num_events() { return (core).record_num_events(); }                                         \
  void mp_record_copy(int64_t* sizes, int64_t* events, int64_t* streams) {                                      \
    (core).record_copy(sizes, events, streams);                                                                 \
  }                                                                                                             \
  int mp_begin_replay(char* arena, int64_t arena_size, int64_t n_branches, const int64_t* lengths,              \
                      const int64_t* sizes, const int64_t* streams, const int64_t* offsets, const int64_t* need, \
                      const int64_t* free_lengths, const int64_t* free_order, const int64_t* shared) {           \
    return (core).begin_replay(arena, arena_size, n_branches, lengths, sizes, streams, offsets, need,          \
                               free_lengths, free_order, shared);                                               \
  }                                                                                                             \
  void mp_end_replay(int64_t* stats) { (core).end_replay(stats); }                                              \
  }
