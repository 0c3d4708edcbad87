// Tensors on disk between uses, through a few aligned buffers (tensor_swapper.hpp).
#include "parallel/shard/tensor_swapper.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <numeric>

#include "xlr8/error.hpp"

namespace xlr8::shard {

namespace {

int64_t bytes_of(const TensorSwapper::Slot& s) {
  return std::accumulate(s.shape.begin(), s.shape.end(), int64_t{1}, std::multiplies<>()) *
         static_cast<int64_t>(c10::elementSize(s.dtype));
}

int64_t aligned(int64_t bytes) {
  const int64_t a = os::AlignedBuffer::kAlignment;
  return (bytes + a - 1) / a * a;
}

int64_t file_size_for(const std::vector<TensorSwapper::Slot>& slots) {
  int64_t total = 0;
  for (const auto& s : slots) total += aligned(bytes_of(s));
  return std::max<int64_t>(total, os::AlignedBuffer::kAlignment);
}

}  // namespace

struct TensorSwapper::Pool {
  struct Buffer {
    std::unique_ptr<os::AlignedBuffer> memory;
    enum State { Free, Writing, Reading, Lent } state = Free;
    os::IoTicket ticket;
    std::string name;  // Reading: whose values
  };
  std::vector<Buffer> buffers;
  std::deque<size_t> busy;  // Writing and Reading buffers, oldest first
  std::mutex mutex;
};

TensorSwapper::TensorSwapper(SwapOptions options, const std::vector<Slot>& slots)
    : options_(std::move(options)), io_(options_.aio), file_(options_.file, file_size_for(slots)),
      pool_(std::make_shared<Pool>()) {
  if (options_.buffer_count < 1)
    throw ConfigError(fmt::format("offload: buffer_count {} must be 1 or more", options_.buffer_count));
  if (options_.buffer_size == 0)
    for (const auto& s : slots) options_.buffer_size = std::max(options_.buffer_size, aligned(bytes_of(s)));
  int64_t offset = 0;
  for (const auto& s : slots) {
    const int64_t bytes = aligned(bytes_of(s));
    if (bytes > options_.buffer_size)
      throw ConfigError(fmt::format("offload: buffer_size {} is smaller than tensor {} ({} bytes); set buffer_size to "
                                    "at least the largest tensor swapped",
                                    options_.buffer_size, s.name, bytes_of(s)));
    if (!slots_.emplace(s.name, Placed{s, offset, bytes, {}}).second)
      throw Error(fmt::format("offload: two swapped tensors are named {}", s.name));
    offset += bytes;
  }
  pool_->buffers.resize(static_cast<size_t>(options_.buffer_count));
  for (auto& b : pool_->buffers) b.memory = std::make_unique<os::AlignedBuffer>(options_.buffer_size);
}

TensorSwapper::~TensorSwapper() {
  std::lock_guard<std::mutex> lock(pool_->mutex);
  for (auto& b : pool_->buffers) {
    try {
      b.ticket.wait();  // the file and the buffers must outlive every transfer
    } catch (const std::exception&) {  // a failed transfer was reported to whoever waited for it
    }
  }
}

TensorSwapper::Placed& TensorSwapper::placed(const std::string& name) {
  const auto it = slots_.find(name);
  if (it == slots_.end()) throw Error(fmt::format("offload: no swapped tensor is named {}", name));
  return it->second;
}

size_t TensorSwapper::acquire(std::unique_lock<std::mutex>& lock) {
  auto& pool = *pool_;
  for (size_t i = 0; i < pool.buffers.size(); ++i)
    if (pool.buffers[i].state == Pool::Buffer::Free) return i;
  if (pool.busy.empty())
    throw Error(fmt::format("offload: all {} swap buffers hold tensors swapped in and still alive; free them first "
                            "or raise buffer_count",
                            pool.buffers.size()));
  const size_t oldest = pool.busy.front();  // a write behind, or a read ahead nobody took yet
  pool.busy.pop_front();
  auto& b = pool.buffers[oldest];
  const bool write = b.state == Pool::Buffer::Writing;
  b.state = Pool::Buffer::Free;  // whatever the transfer's end: the buffer is not lost with it
  if (write) wait_for(b.ticket, /*write=*/true);
  else wait_unneeded(b.ticket);  // a read ahead nobody took (a swap_in reads anew)
  return oldest;
}

void TensorSwapper::drop_reads_of(const std::string& name) {
  auto& pool = *pool_;
  for (size_t i = 0; i < pool.buffers.size(); ++i) {
    auto& b = pool.buffers[i];
    if (b.state != Pool::Buffer::Reading || b.name != name) continue;
    b.state = Pool::Buffer::Free;
    std::erase(pool.busy, i);
    wait_unneeded(b.ticket);  // values a write replaces; the buffer must be idle before it is reused
  }
}

void TensorSwapper::swap_out(const std::string& name, const at::Tensor& values) {
  auto& p = placed(name);
  if (values.scalar_type() != p.slot.dtype || !values.sizes().equals(p.slot.shape) || !values.device().is_cpu())
    throw Error(fmt::format("offload: swapping out {}: a {} tensor of shape [{}] on {}, its slot holds {} [{}] on the "
                            "CPU",
                            name, c10::toString(values.scalar_type()), fmt::join(values.sizes(), ", "),
                            values.device().str(), c10::toString(p.slot.dtype), fmt::join(p.slot.shape, ", ")));
  std::unique_lock<std::mutex> lock(pool_->mutex);
  throw_if_broken();
  wait_for(p.last_write, /*write=*/true);  // writes of one slot land in order
  drop_reads_of(name);
  const size_t i = acquire(lock);
  auto& b = pool_->buffers[i];
  const auto contiguous = values.contiguous();
  std::memcpy(b.memory->data(), contiguous.data_ptr(), static_cast<size_t>(bytes_of(p.slot)));
  b.ticket = io_.write(file_, p.offset, *b.memory, p.bytes);
  b.state = Pool::Buffer::Writing;
  pool_->busy.push_back(i);
  p.last_write = b.ticket;
}

size_t TensorSwapper::start_read(Placed& p, std::unique_lock<std::mutex>& lock) {
  throw_if_broken();
  wait_for(p.last_write, /*write=*/true);
  const size_t i = acquire(lock);
  auto& b = pool_->buffers[i];
  b.ticket = io_.read(file_, p.offset, *b.memory, p.bytes);
  b.state = Pool::Buffer::Reading;
  b.name = p.slot.name;
  pool_->busy.push_back(i);
  return i;
}

void TensorSwapper::prefetch(const std::string& name) {
  auto& p = placed(name);
  std::unique_lock<std::mutex> lock(pool_->mutex);
  throw_if_broken();
  for (const auto& b : pool_->buffers)
    if (b.state == Pool::Buffer::Reading && b.name == name) return;
  start_read(p, lock);
  ++reads_ahead_;
}

at::Tensor TensorSwapper::swap_in(const std::string& name) {
  auto& p = placed(name);
  std::unique_lock<std::mutex> lock(pool_->mutex);
  throw_if_broken();
  auto& buffers = pool_->buffers;
  size_t i = buffers.size();
  for (size_t k = 0; k < buffers.size(); ++k)
    if (buffers[k].state == Pool::Buffer::Reading && buffers[k].name == name) i = k;
  if (i == buffers.size()) i = start_read(p, lock);
  else ++found_ahead_;
  std::erase(pool_->busy, i);
  try {
    buffers[i].ticket.wait();
  } catch (const std::exception&) {
    buffers[i].state = Pool::Buffer::Free;  // the buffer goes back; a later swap_in reads again
    throw;
  }
  buffers[i].state = Pool::Buffer::Lent;
  // The buffer comes back when the tensor's storage is freed, on whatever thread frees it.
  auto keep = pool_;  // the memory lives as long as the tensor does
  return at::from_blob(
      buffers[i].memory->data(), p.slot.shape,
      [keep, i](void*) {
        std::lock_guard<std::mutex> back(keep->mutex);
        keep->buffers[i].state = Pool::Buffer::Free;
      },
      at::TensorOptions().dtype(p.slot.dtype));
}

nlohmann::json TensorSwapper::stats() const {
  std::lock_guard<std::mutex> lock(pool_->mutex);
  return {{"swap_file", file_.path().string()},
          {"swap_reads_ahead", reads_ahead_},
          {"swap_reads_found_ahead", found_ahead_},
          {"swap_file_bytes", file_bytes()},
          {"swap_pool_bytes", pool_bytes()},
          {"swap_bytes_read", bytes_read()},
          {"swap_bytes_written", bytes_written()}};
}

void TensorSwapper::flush() {
  std::lock_guard<std::mutex> lock(pool_->mutex);
  throw_if_broken();
  auto& pool = *pool_;
  for (size_t i = 0; i < pool.buffers.size(); ++i) {
    auto& b = pool.buffers[i];
    if (b.state != Pool::Buffer::Writing) continue;
    b.state = Pool::Buffer::Free;
    std::erase(pool.busy, i);
    wait_for(b.ticket, /*write=*/true);
  }
}

void TensorSwapper::wait_for(const os::IoTicket& ticket, bool write) {
  try {
    ticket.wait();
  } catch (const std::exception& e) {
    if (!write) throw;  // a read that failed leaves the file as it was
    if (broken_.empty())
      broken_ = fmt::format("{}; the swap file no longer holds the run's state (values written behind are lost): "
                            "this run cannot go on; free the disk or fix its error, then resume from the last "
                            "checkpoint (--resume_from latest, or load_state)",
                            e.what());
    throw Error(broken_);
  }
}

void TensorSwapper::wait_unneeded(const os::IoTicket& ticket) {
  try {
    ticket.wait();
  } catch (const std::exception&) {  // a read whose values nobody will use: its failure is nobody's
  }
}

void TensorSwapper::throw_if_broken() const {
  if (!broken_.empty()) throw Error(broken_);
}

}  // namespace xlr8::shard
