// The planned CPU allocator: a c10::Allocator installed once in front of PyTorch's CPU
// allocator. It passes every request through to the allocator it replaced unless a step is
// being recorded or replayed, and then only for the thread that started it; the record/replay
// state machine and its safety check are replay_core.h's, shared with the CUDA allocator.
//
// C interface for ctypes; no pybind11, so it builds in seconds against c10 alone.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "replay_core.h"

namespace {

void planned_delete(void* ptr);

void* base_alloc(size_t n, void* /*stream*/, void* ctx) {
  return static_cast<c10::Allocator*>(ctx)->raw_allocate(n);
}

void base_free(void* p, size_t /*n*/, void* /*stream*/, void* ctx) {
  static_cast<c10::Allocator*>(ctx)->raw_deleter()(p);
}

struct PlannedAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  memplan::ReplayCore core;

  c10::DataPtr allocate(size_t n) override {
    if (!core.wants(n)) {
      return base->allocate(n);
    }
    void* p = core.allocate(n, nullptr);
    return c10::DataPtr(p, p, &planned_delete, c10::Device(c10::DeviceType::CPU));
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
  g_allocator.core.release(ptr, 0, nullptr);
}

}  // namespace

MEMPLAN_REPLAY_C_API(g_allocator.core)

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
  g_allocator.core.base_alloc = &base_alloc;
  g_allocator.core.base_free = &base_free;
  g_allocator.core.base_ctx = current;
  c10::SetCPUAllocator(&g_allocator, /*priority=*/1);
  return c10::GetCPUAllocator() == &g_allocator ? 1 : 0;
}

int mp_installed() {
  return c10::GetCPUAllocator() == &g_allocator ? 1 : 0;
}

}  // extern "C"
