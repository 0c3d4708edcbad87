// Communicator: native c10d collectives where the backend has them, composite ones where it does not.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <utility>

#include "core/text.hpp"
#include "core/flight_recorder.hpp"
#include "distributed/comm_state.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

// ---------------------------------------------------------------------------------------------- helpers

namespace {

using distributed::combine;
using detail::CommState;
using distributed::divide_for_average;
using distributed::guarded;
using distributed::require;
using detail::WorkState;

// Types Gloo can reduce and move (bf16 from LibTorch 2.2 on, PR #113557).
bool gloo_native(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kChar: case at::kByte: case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// Data-moving collectives only copy bytes: move what Gloo can't type as a Gloo type of equal width
// (Gloo has no int16, so 2-byte types travel as float16 bit patterns, unchanged).
at::Tensor movable(const CommState& s, const at::Tensor& t) {
  if (s.uses_nccl(t) || gloo_native(t.scalar_type())) return t;
  switch (t.element_size()) {
    case 1: return t.view(at::kByte);
    case 2: return t.view(at::kHalf);
    case 4: return t.view(at::kInt);
    case 8: return t.view(at::kLong);
    default: throw Error(fmt::format("cannot move tensors of type {} through Gloo", core::describe(t)));
  }
}

c10d::ReduceOp native_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return c10d::ReduceOp::SUM;
    case ReduceOp::AVG: return c10d::ReduceOp::AVG;
    case ReduceOp::MIN: return c10d::ReduceOp::MIN;
    case ReduceOp::MAX: return c10d::ReduceOp::MAX;
    case ReduceOp::PRODUCT: return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

// Gloo has no AVG: reduce with SUM, then divide (truncating for integers, as NCCL does).
c10d::ReduceOp backend_op(bool nccl, ReduceOp op) {
  return (!nccl && op == ReduceOp::AVG) ? c10d::ReduceOp(c10d::ReduceOp::SUM) : native_op(op);
}

std::string what(const CommState& s, const std::string& op, const at::Tensor& t, const std::string& extra = "") {
  return fmt::format("{}({}{}) on group '{}' (rank {} of {})", op, core::describe(t), extra, s.name, s.rank, s.size);
}

// The flight recorder numbers a group's collectives in issue order, which every rank of the group shares;
// point-to-point operations are recorded unnumbered (0): ranks issue different ones by design.
uint64_t record_in_flight_recorder(CommState& s, const std::string& description) {
  const bool point_to_point = description.rfind("send(", 0) == 0 || description.rfind("recv(", 0) == 0;
  return core::FlightRecorder::instance().enqueued(s.identity, point_to_point ? 0 : ++s.collective_sequence, description);
}

Work native(CommState& s, std::string description, compat::WorkPtr work, std::function<void()> finish = {}) {
  auto st = std::make_shared<WorkState>();
  st->trace_id = record_in_flight_recorder(s, description);
  st->what = std::move(description);
  st->timeout = s.timeout;
  st->work = std::move(work);
  st->finish = std::move(finish);
  return Work(st);
}

Work composite(CommState& s, std::string description, std::function<void()> body, std::function<void()> finish = {}) {
  auto st = std::make_shared<WorkState>();
  st->trace_id = record_in_flight_recorder(s, description);
  st->what = description;
  st->timeout = s.timeout;
  st->future = s.run_composite([body = std::move(body), description, timeout = s.timeout]() mutable {
    // The tensors the body holds go when it returns, before the waiter wakes. A std::packaged_task keeps its
    // callable in the state its futures share, so they went with whichever thread let go of that state last:
    // often this one, after the waiter woke and sometimes milliseconds later (a DDP bucket's fresh gradients
    // were then still alive when the optimizer step ended, and peaks measured from there came out short).
    const auto run = std::exchange(body, nullptr);
    try {
      run();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      distributed::rethrow_with_context(description, timeout, e);
    }
  });
  st->finish = std::move(finish);
  return Work(st);
}

void wait_step(const CommState& s, const compat::WorkPtr& w) { w->wait(s.timeout); }

// Ring reduce-scatter over send/recv: (P-1)/P of the input crosses each link once, in the tensor's
// own dtype, so bf16 stays bf16 on the wire. `input` is contiguous 1-D with P * output.numel() elements.
void ring_reduce_scatter(CommState& s, at::Tensor output, at::Tensor input, ReduceOp op, int tag) {
  const int P = s.size, r = s.rank;
  const int64_t n = output.numel();
  auto chunk = [&](int i) { return input.narrow(0, static_cast<int64_t>(i) * n, n); };
  if (P == 1) {
    output.view(-1).copy_(input);
    return;
  }
  const int next = (r + 1) % P, prev = (r - 1 + P) % P;
  at::Tensor send_buf = chunk((r - 1 + P) % P).clone();
  at::Tensor recv_buf = at::empty_like(send_buf);
  for (int step = 0; step < P - 1; ++step) {
    std::vector<at::Tensor> recv_list{recv_buf}, send_list{send_buf};
    auto receiving = s.gloo->recv(recv_list, prev, tag);
    auto sending = s.gloo->send(send_list, next, tag);
    wait_step(s, sending);
    wait_step(s, receiving);
    combine(recv_buf, chunk((r - step - 2 + 2 * P) % P), op);
    std::swap(send_buf, recv_buf);
  }
  if (op == ReduceOp::AVG) divide_for_average(send_buf, P);
  output.view(-1).copy_(send_buf);
}

int next_ring_tag(CommState& s) {
  // Above any tag a user would pick for send/recv; identical on all ranks since ops are issued in order.
  return static_cast<int>((1u << 28) + (s.ring_sequence++ % (1u << 20)));
}

// Ring all-gather over send/recv; `flat` holds P chunks and this rank's chunk is already in place.
// Composite ops use only tagged point-to-point messages: a native collective issued from the executor
// thread could take its Gloo sequence number in a different order on different ranks.
void ring_all_gather(CommState& s, at::Tensor flat, int tag) {
  const int P = s.size, r = s.rank;
  if (P == 1) return;
  const int64_t n = flat.numel() / P;
  auto chunk = [&](int i) { return flat.narrow(0, static_cast<int64_t>(i) * n, n); };
  const int next = (r + 1) % P, prev = (r - 1 + P) % P;
  for (int step = 0; step < P - 1; ++step) {
    std::vector<at::Tensor> send_list{chunk((r - step + P) % P)}, recv_list{chunk((r - step - 1 + 2 * P) % P)};
    auto receiving = s.gloo->recv(recv_list, prev, tag);
    auto sending = s.gloo->send(send_list, next, tag);
    wait_step(s, sending);
    wait_step(s, receiving);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------- Communicator

int Communicator::rank() const { return state_ ? state_->rank : 0; }
int Communicator::size() const { return state_ ? state_->size : 1; }
const std::string& Communicator::name() const {
  static const std::string none = "none";
  return state_ ? state_->name : none;
}
std::string Communicator::backend() const { return state_ && state_->nccl ? "nccl" : "gloo"; }

compat::Backend& detail::CommState::backend_for(const at::Tensor& t, const std::string& what) const {
  if (!t.is_cuda()) return *gloo;
  if (!nccl)
    throw Error(fmt::format("{}: the tensor is on {} but group '{}' has no NCCL backend (CPU build, or no GPU); move "
                            "it to the CPU",
                            what, t.device().str(), name));
  return *nccl;
}
bool Communicator::uses_shared_memory() const { return state_ && state_->shm; }

at::Tensor Communicator::symmetric_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t;
  if (state_ && state_->shm && options.device().is_cpu()) {
    auto desc = fmt::format("symmetric_empty on group '{}' (rank {} of {})", state_->name, state_->rank, state_->size);
    t = guarded(*state_, desc, [&] { return state_->shm->symmetric_empty(sizes, options); });
  }
  return t.defined() ? t : at::empty(sizes, options);
}

std::chrono::milliseconds Communicator::timeout() const { return state_ ? state_->timeout : std::chrono::milliseconds(0); }

Work Communicator::all_reduce_async(at::Tensor& tensor, ReduceOp op) {
  auto& s = *state_;
  auto desc = what(s, "all_reduce", tensor, ", " + to_string(op));
  require(tensor.defined(), desc, "the tensor is undefined");
  at::Tensor work_tensor = tensor.is_contiguous() ? tensor : tensor.contiguous();
  auto copy_back = [tensor, work_tensor]() mutable {
    if (!work_tensor.is_same(tensor)) tensor.copy_(work_tensor);
  };
  if (s.uses_shm(tensor)) {
    CommState* sp = &s;
    return composite(s, desc, [sp, work_tensor, op, desc] { sp->shm->all_reduce(work_tensor, op, desc); }, copy_back);
  }
  const bool nccl = s.uses_nccl(tensor);
  if (nccl || gloo_native(tensor.scalar_type())) {
    std::vector<at::Tensor> list{work_tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = backend_op(nccl, op);
    opts.timeout = s.timeout;
    auto w = guarded(s, desc, [&] { return s.backend_for(tensor, desc).allreduce(list, opts); });
    bool average = !nccl && op == ReduceOp::AVG;
    return native(s, desc, w, [work_tensor, copy_back, average, size = s.size]() mutable {
      if (average) divide_for_average(work_tensor, size);
      copy_back();
    });
  }
  // Gloo can't reduce this dtype: ring reduce-scatter in the dtype, then a typeless all-gather.
  const int64_t shard = (work_tensor.numel() + s.size - 1) / s.size;
  at::Tensor padded = at::zeros({shard * s.size}, work_tensor.options());
  padded.narrow(0, 0, work_tensor.numel()).copy_(work_tensor.view(-1));
  int scatter_tag = next_ring_tag(s), gather_tag = next_ring_tag(s);
  CommState* sp = &s;
  return composite(
      s, desc,
      [sp, padded, shard, op, scatter_tag, gather_tag]() mutable {
        at::Tensor mine = padded.narrow(0, sp->rank * shard, shard);
        ring_reduce_scatter(*sp, mine, padded, op, scatter_tag);  // reads chunk r before writing it
        ring_all_gather(*sp, padded, gather_tag);
      },
      [work_tensor, padded, copy_back]() mutable {
        work_tensor.view(-1).copy_(padded.narrow(0, 0, work_tensor.numel()));
        copy_back();
      });
}

Work Communicator::all_reduce_into_async(at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op) {
  auto& s = *state_;
  auto desc = what(s, "all_reduce_into", output, fmt::format(", {}, from {} inputs", to_string(op), inputs.size()));
  require(output.defined() && output.is_contiguous(), desc, "the output must be a defined, contiguous tensor");
  const auto* out_begin = static_cast<const std::byte*>(output.data_ptr());
  const auto es = static_cast<int64_t>(output.element_size());
  std::vector<at::Tensor> flat;
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& in = inputs[i];
    require(in.defined() && in.scalar_type() == output.scalar_type() && in.device() == output.device(), desc,
            fmt::format("input {} is {}, but every input must be a defined {} tensor on {}", i,
                        in.defined() ? core::describe(in) + " on " + in.device().str() : "undefined",
                        core::dtype_name(output.scalar_type()), output.device().str()));
    // An input may be its own place in the output (nothing to copy) but must not overlap any other part.
    const auto* p = static_cast<const std::byte*>(in.data_ptr());
    const bool overlaps = p < out_begin + output.nbytes() && p + in.nbytes() > out_begin;
    require(!overlaps || (in.is_contiguous() && p == out_begin + total * es), desc,
            fmt::format("input {} overlaps the output somewhere other than its own place (elements {}..{})", i, total,
                        total + in.numel()));
    flat.push_back(in.is_contiguous() ? in.view(-1) : in.reshape(-1));
    total += in.numel();
  }
  require(total == output.numel(), desc,
          fmt::format("the inputs hold {} elements in all but the output holds {}", total, output.numel()));
  if (s.uses_shm(output)) {
    CommState* sp = &s;
    return composite(s, desc, [sp, output, flat, op, desc] { sp->shm->all_reduce_into(output, flat, op, desc); });
  }
  int64_t offset = 0;
  for (const auto& in : flat) {
    auto place = output.view(-1).narrow(0, offset, in.numel());
    if (!in.is_same(place) && in.data_ptr() != place.data_ptr()) place.copy_(in);
    offset += in.numel();
  }
  return all_reduce_async(output, op);
}

Work Communicator::broadcast_async(at::Tensor& tensor, int root) {
  auto& s = *state_;
  auto desc = what(s, "broadcast", tensor, fmt::format(", root {}", root));
  require(root >= 0 && root < s.size, desc, fmt::format("root must be in [0, {})", s.size));
  at::Tensor work_tensor = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<at::Tensor> list{movable(s, work_tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = s.timeout;
  auto w = guarded(s, desc, [&] { return s.backend_for(tensor, desc).broadcast(list, opts); });
  return native(s, desc, w, [tensor, work_tensor]() mutable {
    if (!work_tensor.is_same(tensor)) tensor.copy_(work_tensor);
  });
}

Work Communicator::all_gather_async(at::Tensor& output, const at::Tensor& input) {
  auto& s = *state_;
  auto desc = what(s, "all_gather", input);
  require(output.numel() == input.numel() * s.size, desc,
          fmt::format("output has {} elements; it needs {} (group size x input)", output.numel(), input.numel() * s.size));
  require(output.scalar_type() == input.scalar_type(), desc, "output and input dtypes differ");
  require(output.is_contiguous(), desc, "output must be contiguous");
  at::Tensor flat_out = output.view(-1);
  at::Tensor in = input.contiguous().view(-1);
  if (s.uses_nccl(input)) {
    c10d::AllgatherOptions opts;
    opts.timeout = s.timeout;
    auto w = guarded(s, desc, [&] { return s.nccl->_allgather_base(flat_out, in, opts); });
    return native(s, desc, w);
  }
  if (s.uses_shm(input)) {
    CommState* sp = &s;
    return composite(s, desc, [sp, flat_out, in, desc] { sp->shm->all_gather(flat_out, in, desc); });
  }
  // Gloo's list all-gather writes each rank's part straight into views of the flat output.
  auto in_m = movable(s, in);
  auto out_m = movable(s, flat_out);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < s.size; ++i) outputs[0].push_back(out_m.narrow(0, i * in.numel(), in.numel()));
  std::vector<at::Tensor> inputs{in_m};
  c10d::AllgatherOptions opts;
  opts.timeout = s.timeout;
  auto w = guarded(s, desc, [&] { return s.backend_for(input, desc).allgather(outputs, inputs, opts); });
  return native(s, desc, w);
}

void Communicator::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  at::Tensor flat = at::empty({input.numel() * size()}, input.options());
  all_gather(flat, input);
  outputs.resize(size());
  for (int i = 0; i < size(); ++i) {
    auto part = flat.narrow(0, i * input.numel(), input.numel()).view(input.sizes());
    if (outputs[i].defined()) outputs[i].copy_(part);
    else outputs[i] = part;
  }
}

Work Communicator::reduce_scatter_async(at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  auto& s = *state_;
  auto desc = what(s, "reduce_scatter", input, ", " + to_string(op));
  require(input.numel() == output.numel() * s.size, desc,
          fmt::format("input has {} elements; it needs {} (group size x output)", input.numel(), output.numel() * s.size));
  require(output.scalar_type() == input.scalar_type(), desc, "output and input dtypes differ");
  require(output.is_contiguous(), desc, "output must be contiguous");
  at::Tensor in = input.contiguous().view(-1);
  if (s.uses_nccl(input)) {
    at::Tensor out = output.view(-1);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = native_op(op);
    opts.timeout = s.timeout;
    auto w = guarded(s, desc, [&] { return s.nccl->_reduce_scatter_base(out, in, opts); });
    return native(s, desc, w);
  }
  CommState* sp = &s;
  at::Tensor out = output;
  if (s.uses_shm(input))
    return composite(s, desc, [sp, out, in, op, desc] { sp->shm->reduce_scatter(out, in, op, desc); });
  int tag = next_ring_tag(s);
  return composite(s, desc, [sp, out, in, op, tag]() mutable { ring_reduce_scatter(*sp, out, in, op, tag); });
}

Work Communicator::all_to_all_async(at::Tensor& output, const at::Tensor& input) {
  auto& s = *state_;
  auto desc = what(s, "all_to_all", input);
  require(output.numel() == input.numel(), desc, "output and input must have the same number of elements");
  require(input.numel() % s.size == 0, desc, fmt::format("{} elements do not split evenly over {} ranks", input.numel(), s.size));
  require(output.is_contiguous(), desc, "output must be contiguous");
  at::Tensor out = movable(s, output.view(-1));
  at::Tensor in = movable(s, input.contiguous().view(-1));
  std::vector<int64_t> counts;  // empty: equal splits
  c10d::AllToAllOptions opts;
  opts.timeout = s.timeout;
  auto w = guarded(s, desc, [&] { return s.backend_for(input, desc).alltoall_base(out, in, counts, counts, opts); });
  return native(s, desc, w);
}

Work Communicator::send_async(const at::Tensor& tensor, int dst, int tag) {
  auto& s = *state_;
  auto desc = what(s, "send", tensor, fmt::format(", to rank {}, tag {}", dst, tag));
  require(dst >= 0 && dst < s.size && dst != s.rank, desc, fmt::format("destination must be another rank in [0, {})", s.size));
  require(tag >= 0 && tag < (1 << 28), desc, "tags must be in [0, 2^28)");
  std::vector<at::Tensor> list{movable(s, tensor.contiguous())};
  auto w = guarded(s, desc, [&] { return s.backend_for(tensor, desc).send(list, dst, tag); });
  return native(s, desc, w);
}

Work Communicator::recv_async(at::Tensor& tensor, int src, int tag) {
  auto& s = *state_;
  auto desc = what(s, "recv", tensor, fmt::format(", from rank {}, tag {}", src, tag));
  require(src >= 0 && src < s.size && src != s.rank, desc, fmt::format("source must be another rank in [0, {})", s.size));
  require(tag >= 0 && tag < (1 << 28), desc, "tags must be in [0, 2^28)");
  at::Tensor work_tensor = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<at::Tensor> list{movable(s, work_tensor)};
  auto w = guarded(s, desc, [&] { return s.backend_for(tensor, desc).recv(list, src, tag); });
  return native(s, desc, w, [tensor, work_tensor]() mutable {
    if (!work_tensor.is_same(tensor)) tensor.copy_(work_tensor);
  });
}

void Communicator::barrier() {
  auto& s = *state_;
  auto desc = fmt::format("barrier on group '{}' (rank {} of {})", s.name, s.rank, s.size);
  c10d::BarrierOptions opts;
  opts.timeout = s.timeout;
  // Gloo: a host-side barrier, which is what "wait for everyone" means (NCCL's only orders streams).
  native(s, desc, guarded(s, desc, [&] { return s.gloo->barrier(opts); })).wait();
}

}  // namespace xlr8
