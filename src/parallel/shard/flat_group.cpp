#include "parallel/shard/flat_group.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <exception>

#include "parallel/shard/shard_store.hpp"
#include "xlr8/error.hpp"

namespace xlr8::shard {

bool FlatGroup::gathered() const { return full.storage().nbytes() > 0 || padded() == 0; }

int64_t FlatGroup::full_bytes() const { return padded() * static_cast<int64_t>(full.element_size()); }

FlatGroup::Overlap FlatGroup::owned_part(size_t i) const {
  const int64_t lo = static_cast<int64_t>(rank) * shard_numel, hi = lo + shard_numel;
  const int64_t a = std::max(lo, offsets[i]), b = std::min(hi, offsets[i] + params[i].numel());
  if (a >= b) return {};
  return {a - lo, a - offsets[i], b - a};
}

at::Tensor FlatGroup::shard_on_device() const {
  // Asynchronous from page-locked memory: the collective that reads it is ordered after the copy.
  return shard.device() == full.device() ? shard : shard.to(full.device(), /*non_blocking=*/shard.is_pinned());
}

void FlatGroup::gather(Communicator& comm) { gather_async(comm).wait(); }

namespace {

// New memory for `t`'s storage (every view of it sees it), or none.
void fill_storage_anew(const at::Tensor& t, int64_t bytes) {
  auto storage = t.storage();
  storage.set_data_ptr_noswap(storage.allocator()->allocate(static_cast<size_t>(bytes)));
  storage.set_nbytes(static_cast<size_t>(bytes));
}
void free_storage(const at::Tensor& t) {
  auto storage = t.storage();
  storage.set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage.set_nbytes(0);
}

}  // namespace

Work FlatGroup::gather_async(Communicator& comm) {
  if (!owns_shard || gathered()) return Work();
  // Same storage object, new memory: every parameter view (and every tensor autograd saved from them
  // during forward) sees the gathered values.
  fill_storage_anew(full, full_bytes());
  if (!disk) return comm.all_gather_async(full, shard_on_device());
  // From disk: the shard is read, gathered from and let go (a gather changes nothing).
  const bool was_on_disk = shard_on_disk;
  load_shard();
  comm.all_gather_async(full, shard_on_device()).wait();
  if (was_on_disk) drop_shard();
  return Work();
}

void FlatGroup::load_shard() {
  if (!disk || !shard_on_disk) return;
  fill_storage_anew(shard, shard_numel * static_cast<int64_t>(shard.element_size()));
  disk->read(disk_slot, shard);
  shard_on_disk = false;
}

void FlatGroup::store_shard() {
  if (!disk) return;
  if (mixed()) {  // the shard follows its master, whose values are in memory: no read needed
    if (shard_on_disk) fill_storage_anew(shard, shard_numel * static_cast<int64_t>(shard.element_size()));
    at::NoGradGuard no_grad;
    shard.copy_(master);
  } else if (shard_on_disk) {
    return;
  }
  disk->write(disk_slot, shard);
  free_storage(shard);
  shard_on_disk = true;
}

void FlatGroup::drop_shard() {
  if (!disk || shard_on_disk) return;
  free_storage(shard);
  shard_on_disk = true;
}

void FlatGroup::read_ahead() const {
  if (disk && shard_on_disk) disk->prefetch(disk_slot);
}

void FlatGroup::release() {
  if (!owns_shard || !gathered()) return;
  free_storage(full);
}

Work FlatGroup::refresh_async(Communicator& comm) {
  if (disk) {  // synchronous: the shard is in memory only while it is needed
    if (owns_shard && !gathered()) {
      if (!shard_on_disk) store_shard();  // changed in memory (a load): to disk
      return Work();
    }
    const bool was_on_disk = shard_on_disk;
    std::exception_ptr failed;  // a read that failed still joins the gather the other ranks are in, then throws
    try {
      load_shard();
    } catch (...) {
      failed = std::current_exception();
      fill_storage_anew(shard, shard_numel * static_cast<int64_t>(shard.element_size()));
    }
    if (!was_on_disk && mixed()) {
      at::NoGradGuard no_grad;
      shard.copy_(master);
    }
    comm.all_gather_async(full, shard_on_device()).wait();
    if (failed) std::rethrow_exception(failed);
    if (was_on_disk) drop_shard();
    else store_shard();
    return Work();
  }
  if (mixed()) {
    at::NoGradGuard no_grad;
    shard.copy_(master);
  }
  if (owns_shard && !gathered()) return Work();
  return comm.all_gather_async(full, shard_on_device());  // stages 1-2: `shard` is this rank's chunk of `full`: in place
}

at::Tensor FlatGroup::gather_master(Communicator& comm) {
  if (!mixed() && gathered()) return full;
  // Offloaded masters are gathered in host memory (the host's collectives): a checkpoint of an offloaded
  // model must not need the whole fp32 model in device memory.
  auto whole = at::empty({padded()}, master.options());
  const bool was_on_disk = shard_on_disk && !mixed();  // the master is the shard
  if (was_on_disk) load_shard();
  comm.all_gather(whole, master);
  if (was_on_disk) drop_shard();
  return whole;
}

FlatGroup make_flat_group(std::string label, std::vector<std::string> names,
                          std::vector<at::Tensor> params, Communicator& comm, bool owns_shard,
                          std::optional<at::ScalarType> compute_dtype, bool values_from_rank0, HostPlacement host) {
  FlatGroup g;
  g.label = std::move(label);
  g.names = std::move(names);
  g.params = std::move(params);
  g.rank = comm.rank();
  g.ranks = comm.size();
  g.owns_shard = owns_shard;
  g.host = host;
  if (g.params.empty()) throw Error("internal: a sharding unit without parameters");
  g.frozen = !g.params.front().requires_grad();
  const auto options = g.params.front().options().requires_grad(false);
  for (const auto& p : g.params) {
    if (p.requires_grad() == g.frozen)
      throw Error(fmt::format("internal: sharding unit {} mixes frozen and trainable parameters", g.label));
    if (p.scalar_type() != g.params.front().scalar_type() || p.device() != g.params.front().device())
      throw Error(fmt::format("sharding unit {}: its parameters mix dtypes or devices ({} and {}); keep a unit's "
                              "parameters in one dtype on one device",
                              g.label, g.names.front(), g.names[&p - g.params.data()]));
    g.offsets.push_back(g.numel);
    g.numel += p.numel();
  }
  g.shard_numel = (g.numel + g.ranks - 1) / g.ranks;
  at::NoGradGuard no_grad;
  const auto compute = compute_dtype.value_or(options.dtype().toScalarType());
  auto exact = at::zeros({g.padded()}, options);  // the parameters in their own dtype, end to end
  if (!values_from_rank0 || g.rank == 0)
    for (size_t i = 0; i < g.params.size(); ++i)
      exact.narrow(0, g.offsets[i], g.params[i].numel()).copy_(g.params[i].detach().reshape(-1));
  if (values_from_rank0) comm.broadcast(exact, 0);
  g.full = compute == exact.scalar_type() ? exact : exact.to(compute);
  for (size_t i = 0; i < g.params.size(); ++i) {
    // The same parameter object, now a view of the flat buffer: its autograd identity (and the hooks
    // on its gradient accumulator) stay.
    auto& p = g.params[i];
    p.set_data(g.full.narrow(0, g.offsets[i], p.numel()).view(p.sizes()));
  }
  const int64_t own_offset = static_cast<int64_t>(g.rank) * g.shard_numel;
  if (host.shard && !owns_shard) throw Error("internal: only a stage-3 group's shard can live in host memory");
  auto in_host = [&](at::ScalarType dtype) {
    return at::empty({g.shard_numel}, at::TensorOptions().dtype(dtype).pinned_memory(host.pin && g.full.is_cuda()));
  };
  if (owns_shard) {
    g.shard = host.shard ? in_host(compute) : comm.symmetric_empty({g.shard_numel}, g.full.options());
    g.shard.copy_(g.full.narrow(0, own_offset, g.shard_numel));
  } else {
    g.shard = g.full.narrow(0, own_offset, g.shard_numel);
  }
  const auto own_exact = exact.narrow(0, own_offset, g.shard_numel);
  if (compute == exact.scalar_type() && (host.shard || !host.master)) {
    g.master = g.shard;  // where the optimizer wants it already
  } else if (host.master) {
    g.master = in_host(exact.scalar_type());
    g.master.copy_(own_exact);
  } else {
    g.master = own_exact.clone();
  }
  for (size_t i = 0; i < g.params.size(); ++i) {
    auto part = g.owned_part(i);
    auto leaf = g.master.narrow(0, part.in_shard, part.count).detach();
    leaf.set_requires_grad(!g.frozen);
    g.shard_params.push_back(leaf);
  }
  return g;
}

}  // namespace xlr8::shard
