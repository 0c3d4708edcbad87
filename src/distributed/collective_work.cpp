// What every collective shares: ReduceOp's names, the error context a failed or timed-out collective
// carries, the reduction arithmetic of composite collectives, and Work, the handle of one in flight.
#include <fmt/format.h>

#include <atomic>
#include <chrono>

#include "core/flight_recorder.hpp"
#include "core/text.hpp"
#include "distributed/collective_timing.hpp"
#include "distributed/comm_state.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::PRODUCT: return "PRODUCT";
  }
  return "?";
}

namespace detail {

std::shared_future<void> CommState::run_composite(std::function<void()> task) {
  auto packaged = std::make_shared<std::packaged_task<void()>>(std::move(task));
  auto future = packaged->get_future().share();
  if (!executor) executor = std::make_unique<WorkerPool>(1);
  executor->submit([packaged] { (*packaged)(); });
  return future;
}

}  // namespace detail

namespace distributed {

namespace {
// What a transport says when the other end of its connection went away: a symptom of a peer's failure.
bool lost_peer(const std::string& message) {
  for (const char* sign : {"Connection reset by peer", "Broken pipe", "Connection closed by peer", "ECONNRESET", "EPIPE"})
    if (message.find(sign) != std::string::npos) return true;
  return false;
}
}  // namespace

void rethrow_with_context(const std::string& what, std::chrono::milliseconds timeout, const std::exception& cause) {
  std::string message = cause.what();
  // c10::Error messages carry a C++ backtrace after the first line; keep the first line only.
  if (auto nl = message.find('\n'); nl != std::string::npos) message = message.substr(0, nl);
  // gloo words a refused connection "timed out connecting: ... Connection refused" at once, long before the timeout.
  if (message.find("Connection refused") != std::string::npos)
    throw Error(fmt::format("{} could not connect to a peer rank: connection refused (the peer ended, or the addresses "
                            "the store gave are another group's). Cause: {}",
                            what, message));
  bool timed_out = message.find("imed out") != std::string::npos || message.find("imeout") != std::string::npos;
  if (timed_out)
    throw TimeoutError(fmt::format("{} timed out after {} s: a peer rank did not reach this collective or died "
                                   "(set XLR8_COLLECTIVE_TIMEOUT to wait longer). Cause: {}",
                                   what, timeout.count() / 1000.0, message));
  if (lost_peer(message))
    throw Error(fmt::format("{} lost its peer: another rank ended or failed first, its error is the cause ({})", what,
                            message));
  throw Error(fmt::format("{} failed: {}", what, message));
}

void divide_for_average(at::Tensor& t, int size) {
  if (at::isFloatingType(t.scalar_type())) t.div_(size);
  else t.div_(size, "trunc");
}

void combine(at::Tensor& acc, const at::Tensor& other, ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: case ReduceOp::AVG: acc.add_(other); break;
    case ReduceOp::MIN: at::minimum_out(acc, acc, other); break;
    case ReduceOp::MAX: at::maximum_out(acc, acc, other); break;
    case ReduceOp::PRODUCT: acc.mul_(other); break;
  }
}

}  // namespace distributed

// ---------------------------------------------------------------------------------------------- Work

namespace {
std::atomic<int64_t> waited_ns{0};

struct WaitClock {
  std::chrono::steady_clock::time_point began = std::chrono::steady_clock::now();
  ~WaitClock() {
    waited_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began).count(),
                        std::memory_order_relaxed);
  }
};
}  // namespace

int64_t distributed::collective_wait_ns() { return waited_ns.load(std::memory_order_relaxed); }

namespace {
void wait_for_work(detail::WorkState& s) {
  WaitClock clock;
  if (s.work) {
    try {
      s.work->wait(s.timeout);
    } catch (const std::exception& e) {
      distributed::rethrow_with_context(s.what, s.timeout, e);
    }
  } else if (s.future.valid()) {
    // The composite op enforces the timeout on each of its steps; this is a backstop.
    if (s.future.wait_for(s.timeout + std::chrono::seconds(5)) != std::future_status::ready)
      throw TimeoutError(fmt::format("{} timed out after {} s", s.what, s.timeout.count() / 1000.0));
    s.future.get();
  }
  if (s.finish) s.finish();
  s.done = true;
}
}  // namespace

void Work::wait() {
  if (!state_) return;
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.done) return;
  auto& recorder = core::FlightRecorder::instance();
  try {
    wait_for_work(s);
  } catch (const TimeoutError&) {
    recorder.failed(s.trace_id, true, s.what);
    throw;
  } catch (...) {
    recorder.failed(s.trace_id, false, s.what);
    throw;
  }
  recorder.completed(s.trace_id, true);
}

bool Work::is_completed() const {
  if (!state_) return true;
  if (state_->work) return state_->work->isCompleted();
  if (state_->future.valid()) return state_->future.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  return true;
}

}  // namespace xlr8
