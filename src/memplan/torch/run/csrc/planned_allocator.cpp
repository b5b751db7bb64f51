// A CPU allocator that replays planned addresses (Sekiyama et al. 3-4: profile the alloc/free
// sequence of one step, solve the offsets offline, serve the k-th allocation of later steps at
// its planned offset in one arena).
//
// Installed once as PyTorch's CPU allocator; it passes every request through to the allocator
// it replaced unless a step is being recorded or replayed, and then only for the thread that
// started it. Replay is safe by construction: allocation k is served from the arena only if
// every allocation planned to be freed before it has really been freed (so no two arena
// allocations that overlap in address are ever live together); otherwise, or once the sequence
// differs from the recorded one, requests go to the replaced allocator and are counted.
//
// C interface for ctypes; no pybind11, so it builds in seconds against c10 alone.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

enum Mode { kOff = 0, kRecord = 1, kReplay = 2 };

void planned_delete(void* ptr);

struct PlannedAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::mutex mu;
  std::atomic<int> mode{kOff};
  std::thread::id owner;

  // recording
  std::vector<int64_t> rec_sizes;   // size of allocation k
  std::vector<int64_t> rec_events;  // k >= 0: allocation k; -(k + 1): free of allocation k
  std::unordered_map<void*, std::pair<int64_t, int64_t>> rec_live;  // pointer -> (recording, allocation)
  int64_t recording = 0;  // which recording is open (frees of older ones are not its events)
  bool recording_open = false;

  // replay
  char* arena = nullptr;
  int64_t arena_size = 0;
  std::vector<int64_t> sizes, offsets, need, free_order;
  std::vector<char> freed;
  std::unordered_map<void*, int64_t> arena_live;  // arena pointer -> allocation index
  int64_t next = 0, prefix = 0, diverged_at = -1;
  int64_t served = 0, served_bytes = 0, fallback = 0, fallback_bytes = 0, blocked = 0;

  c10::DataPtr wrap(void* p) {
    return c10::DataPtr(p, p, &planned_delete, c10::Device(c10::DeviceType::CPU));
  }

  c10::DataPtr allocate(size_t n) override {
    if (mode == kOff || n == 0) {
      return base->allocate(n);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (std::this_thread::get_id() != owner || mode == kOff) {
      return base->allocate(n);
    }
    if (mode == kRecord) {
      void* p = base->raw_allocate(n);
      int64_t k = static_cast<int64_t>(rec_sizes.size());
      rec_sizes.push_back(static_cast<int64_t>(n));
      rec_events.push_back(k);
      rec_live[p] = {recording, k};
      return wrap(p);
    }
    return replay(n);
  }

  c10::DataPtr replay(size_t n) {
    int64_t k = next++;
    if (diverged_at < 0 && (k >= static_cast<int64_t>(sizes.size()) || sizes[k] != static_cast<int64_t>(n))) {
      diverged_at = k;
    }
    if (diverged_at >= 0 || offsets[k] < 0) {
      return fall_back(n);
    }
    while (prefix < static_cast<int64_t>(free_order.size()) && freed[free_order[prefix]]) {
      ++prefix;
    }
    if (prefix < need[k]) {  // something planned to be gone by now is still alive
      ++blocked;
      return fall_back(n);
    }
    void* p = arena + offsets[k];
    arena_live[p] = k;
    ++served;
    served_bytes += static_cast<int64_t>(n);
    return wrap(p);
  }

  c10::DataPtr fall_back(size_t n) {
    ++fallback;
    fallback_bytes += static_cast<int64_t>(n);
    return base->allocate(n);
  }

  void release(void* ptr) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto a = arena_live.find(ptr);
      if (a != arena_live.end()) {
        if (a->second < static_cast<int64_t>(freed.size())) {
          freed[a->second] = 1;
        }
        arena_live.erase(a);
        return;  // arena memory is never returned to the base allocator
      }
      auto r = rec_live.find(ptr);
      if (r != rec_live.end()) {
        if (recording_open && r->second.first == recording) {
          rec_events.push_back(-(r->second.second + 1));
        }
        rec_live.erase(r);
      }
    }
    base->raw_deleter()(ptr);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &planned_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PlannedAllocator g_allocator;

void planned_delete(void* ptr) {
  g_allocator.release(ptr);
}

}  // namespace

extern "C" {

// Installs the allocator in front of PyTorch's current CPU allocator; 1 on success.
int mp_install() {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &g_allocator) {
    return 1;
  }
  if (current->raw_deleter() == nullptr) {
    return 0;  // the base must support raw allocation (PyTorch's default CPU allocator does)
  }
  g_allocator.base = current;
  c10::SetCPUAllocator(&g_allocator, /*priority=*/1);
  return c10::GetCPUAllocator() == &g_allocator ? 1 : 0;
}

int mp_installed() {
  return c10::GetCPUAllocator() == &g_allocator ? 1 : 0;
}

void mp_begin_record() {
  std::lock_guard<std::mutex> lock(g_allocator.mu);
  g_allocator.rec_sizes.clear();
  g_allocator.rec_events.clear();
  g_allocator.recording_open = true;
  ++g_allocator.recording;
  g_allocator.owner = std::this_thread::get_id();
  g_allocator.mode = kRecord;
}

// Stops recording; returns the number of events (allocations + frees) recorded.
int64_t mp_end_record() {
  std::lock_guard<std::mutex> lock(g_allocator.mu);
  g_allocator.mode = kOff;
  g_allocator.recording_open = false;
  return static_cast<int64_t>(g_allocator.rec_events.size());
}

int64_t mp_record_num_allocations() {
  return static_cast<int64_t>(g_allocator.rec_sizes.size());
}

void mp_record_copy(int64_t* sizes, int64_t* events) {
  std::lock_guard<std::mutex> lock(g_allocator.mu);
  std::copy(g_allocator.rec_sizes.begin(), g_allocator.rec_sizes.end(), sizes);
  std::copy(g_allocator.rec_events.begin(), g_allocator.rec_events.end(), events);
}

// offsets[k] < 0: allocation k goes to the base allocator; need[k]: how many entries of
// free_order must be freed before allocation k may take its offset.
// Returns 0 (and replays nothing) while arena allocations of an earlier replay are alive.
int mp_begin_replay(char* arena, int64_t arena_size, int64_t n, const int64_t* sizes, const int64_t* offsets,
                    const int64_t* need, int64_t n_free, const int64_t* free_order) {
  std::lock_guard<std::mutex> lock(g_allocator.mu);
  auto& a = g_allocator;
  if (!a.arena_live.empty()) {
    return 0;
  }
  a.arena = arena;
  a.arena_size = arena_size;
  a.sizes.assign(sizes, sizes + n);
  a.offsets.assign(offsets, offsets + n);
  a.need.assign(need, need + n);
  a.free_order.assign(free_order, free_order + n_free);
  a.freed.assign(n, 0);
  a.next = a.prefix = a.served = a.served_bytes = a.fallback = a.fallback_bytes = a.blocked = 0;
  a.diverged_at = -1;
  a.owner = std::this_thread::get_id();
  a.mode = kReplay;
  return 1;
}

// Stops replaying. stats: served, served_bytes, fallback, fallback_bytes, blocked, diverged_at,
// allocations seen, arena allocations still alive.
void mp_end_replay(int64_t* stats) {
  std::lock_guard<std::mutex> lock(g_allocator.mu);
  auto& a = g_allocator;
  a.mode = kOff;
  int64_t values[8] = {a.served, a.served_bytes, a.fallback, a.fallback_bytes, a.blocked, a.diverged_at, a.next,
                       static_cast<int64_t>(a.arena_live.size())};
  std::copy(values, values + 8, stats);
}

}  // extern "C"
