#include "util/memory.hpp"

#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#ifdef DTRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace dtrain {

namespace {

// LibTorch's CPU allocator for blocks of 2 MiB and more: each has pages of its own (an
// mmap), and a freed block is kept, by its size, for the next allocation of that size,
// as the same tensors come back every step (GPT-2's logits, the tied embedding's
// gradient: 0.15-0.2 s of a 1.4 s step on 2 cores went to the kernel zeroing their pages
// when glibc mapped them afresh). Pages of their own, not glibc's heap: blocks of 2-32 MiB
// (a GPT's activations) freed in the heap left holes that the next step's differently
// sized tensors could not fill, and the heap, which tune_allocator never trims, held them:
// gpt_text's peak RSS was 405 MB where the allocator's peak was about 330 (now 343),
// the 253M GPT's 2747 MB (now 2622). It keeps blocks once a run's setup is done
// (keep_cpu_blocks): reading the data and building the model free temporaries that never
// come back, and kept they raised the MLP's peak RSS from 422 to 458-491 MB. What is kept
// and in use together stays within the most in use at once since, plus a little
// (make_room). Smaller blocks go to LibTorch's own allocator (glibc's heap).
class BlockCache final : public c10::Allocator {
 public:
  static constexpr size_t kSmallest = size_t(2) << 20;
  static constexpr size_t kSlack = size_t(64) << 20;

  explicit BlockCache(c10::Allocator* next) : next_(next) {}

  c10::DataPtr allocate(size_t n) override { return take(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  // Bytes kept for reuse, not in use.
  int64_t kept() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return int64_t(kept_bytes_);
  }
  // Bytes of its blocks in use (pages of their own: glibc does not count them).
  int64_t used() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return int64_t(used_bytes_);
  }

  // From now on freed blocks are kept (before, they go straight back); what is kept now
  // goes back, and the bound is what is in use from now on.
  void keep() const {
    std::lock_guard<std::mutex> lock(mutex_);
    free_kept();
    peak_used_ = used_bytes_;
    keeping_ = true;
  }

  static BlockCache* instance;

 private:
  c10::DataPtr take(size_t n) const {
    if (n < kSmallest) return next_->allocate(n);
    void* block = reuse(n);  // a step's tensors come back at the same sizes
    if (!block) {
      make_room(n);
      block = map_pages(n);
      if (!block) {
        give_back();  // the kept blocks make room
        block = map_pages(n);
        if (!block) throw std::bad_alloc();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      in_use(block, n);
    }
    report(block, int64_t(n));
    return {block, block, &release, c10::Device(c10::kCPU)};
  }

  static void* map_pages(size_t n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }

  // `block` of `size` bytes counted in use (the lock held).
  void in_use(void* block, size_t size) const {
    used_[block] = size;
    used_bytes_ += size;
    peak_used_ = std::max(peak_used_, used_bytes_);
  }

  // Before a new block of `size`: kept blocks given back, the largest first, until the
  // blocks held (kept and in use) are no more than the most in use at once since keeping
  // began, so that the process holds little more than it would without the cache at its
  // peak. A little: a quarter of that peak, at most kSlack. Where a step frees a block
  // and then needs one of another size at its peak, an exact bound gave the kept one back
  // and mapped the new one, and the next step the reverse: the CNN mapped three blocks a
  // step and ran at half its speed.
  void make_room(size_t size) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t bound = std::max(peak_used_, used_bytes_ + size) + std::min(peak_used_ / 4, kSlack);
    while (!free_.empty() && kept_bytes_ + used_bytes_ + size > bound) {
      auto largest = std::prev(free_.end());
      ::munmap(largest->second, largest->first);
      kept_bytes_ -= largest->first;
      free_.erase(largest);
    }
  }

  // A kept block of `size` bytes, now in use; nullptr where none is kept.
  void* reuse(size_t size) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(size);
    if (it == free_.end()) return nullptr;
    void* block = it->second;
    free_.erase(it);
    kept_bytes_ -= size;
    in_use(block, size);
    return block;
  }

  // To LibTorch's memory profiler, where one listens, as its own allocator reports (a free
  // as a negative size).
  void report(void* block, int64_t bytes) const {
    if (!c10::memoryProfilingEnabled()) return;
    int64_t used = 0, held = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      used = int64_t(used_bytes_), held = int64_t(used_bytes_ + kept_bytes_);
    }
    c10::reportMemoryUsageToProfiler(block, bytes, used, held, c10::Device(c10::kCPU));
  }

  void give_back() const {
    std::lock_guard<std::mutex> lock(mutex_);
    free_kept();
  }

  // Every kept block back to the system (the lock held).
  void free_kept() const {
    for (const auto& [bytes, block] : free_) ::munmap(block, bytes);
    free_.clear();
    kept_bytes_ = 0;
  }

  // A block back: kept where it is one of ours, else the next allocator's (raw_allocate
  // hands out the next allocator's small blocks with this deleter).
  static void release(void* block) {
    BlockCache& c = *instance;
    size_t size = 0;
    {
      std::lock_guard<std::mutex> lock(c.mutex_);
      if (auto it = c.used_.find(block); it != c.used_.end()) {
        size = it->second;
        if (c.keeping_) c.free_.emplace(size, block), c.kept_bytes_ += size;
        c.used_bytes_ -= size;
        c.used_.erase(it);
        if (!c.keeping_) ::munmap(block, size);
      }
    }
    if (size > 0) return c.report(block, -int64_t(size));
    c.next_->raw_deleter()(block);
  }

  c10::Allocator* next_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, size_t> used_;
  mutable std::multimap<size_t, void*> free_;
  mutable size_t kept_bytes_ = 0;
  mutable size_t used_bytes_ = 0, peak_used_ = 0;  // blocks in use: now, and the most at once
  mutable bool keeping_ = false;
};

BlockCache* BlockCache::instance = nullptr;

}  // namespace

void tune_allocator() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest; also turns off its dynamic threshold
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  static std::once_flag once;
  std::call_once(once, [] {
    BlockCache::instance = new BlockCache(c10::GetDefaultCPUAllocator());  // lives as long as the process
    c10::SetCPUAllocator(BlockCache::instance, /*priority=*/1);
  });
}

void keep_cpu_blocks() {
  if (BlockCache::instance) BlockCache::instance->keep();
}

int64_t kept_cpu_bytes() { return BlockCache::instance ? BlockCache::instance->kept() : 0; }

int64_t allocated_bytes(const c10::Device& device) {
#ifdef DTRAIN_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[0].current;  // [0]: all pools together
  }
#else
  (void)device;
#endif
  const struct mallinfo2 m = mallinfo2();
  // In use from glibc's arenas and its own mmapped chunks, and the cache's blocks in use.
  return int64_t(m.uordblks + m.hblkhd) + (BlockCache::instance ? BlockCache::instance->used() : 0);
}

int64_t peak_allocated_bytes(const c10::Device& device) {
#ifdef DTRAIN_CUDA
  if (device.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak;
#else
  (void)device;
#endif
  return 0;
}

double proc_field_bytes(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string name;
  double kib = 0;
  while (in >> name)
    if (name == key && in >> kib) return kib * 1024;
    else in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  return 0;
}

}  // namespace dtrain
