#include "distributed/self_check.hpp"

#include <fmt/format.h>

#include "distributed/comm_state.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                             at::kLong, at::kInt, at::kByte};

// Expected all-reduce of (rank + 1 + i % 3) over ranks, for element i.
// Expected values are computed on the CPU.
at::Tensor expected_reduction(ReduceOp op, int P, int64_t n, at::ScalarType t) {
  auto base = at::arange(n, at::kDouble).remainder(3);
  at::Tensor acc;
  for (int r = 0; r < P; ++r) {
    auto v = base + (r + 1);
    if (!acc.defined()) acc = v;
    else if (op == ReduceOp::MIN) acc = at::minimum(acc, v);
    else if (op == ReduceOp::MAX) acc = at::maximum(acc, v);
    else if (op == ReduceOp::PRODUCT) acc = acc * v;
    else acc = acc + v;
  }
  if (op == ReduceOp::AVG) acc = at::isFloatingType(t) ? acc / P : at::floor(acc / P);
  return acc.to(t);
}

at::Tensor rank_values(int rank, int64_t n, at::ScalarType t) {
  return (at::arange(n, at::kDouble).remainder(3) + (rank + 1)).to(t);
}

std::string compare(const at::Tensor& got_any, const at::Tensor& want) {
  auto got = got_any.cpu();
  if (!got.sizes().equals(want.sizes())) return "shape differs";
  auto diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs();
  double tolerance = got.scalar_type() == at::kBFloat16 || got.scalar_type() == at::kHalf ? 1e-2 : 1e-6;
  auto bad = (diff > tolerance * (want.to(at::kDouble).abs() + 1)).nonzero();
  if (bad.numel() == 0) return "";
  int64_t i = bad[0][0].item<int64_t>();
  return fmt::format("element {}: got {} want {}", i, got.view(-1)[i].to(at::kDouble).item<double>(),
                     want.view(-1)[i].to(at::kDouble).item<double>());
}

// One check per collective, dtype and operation; each records what it found ("" when it passed).
class Checks {
 public:
  Checks(Communicator& comm, const std::string& device_name)
      : comm_(comm),
        device_(device_name),
        where_(device_.is_cpu() ? "" : "[" + device_name + "] "),
        P(comm.size()),
        r(comm.rank()) {}

  void reductions(at::ScalarType t);     // all_reduce with every op, async, reduce_scatter
  void data_movement(at::ScalarType t);  // broadcast, all_gather, all_to_all, send/recv
  void objects_and_groups();             // barrier, object collectives, a subgroup
  std::vector<CheckResult> results;

 private:
  template <class Body>
  void check(const std::string& name, Body&& body) {
    CheckResult result{where_ + name, false, ""};
    try {
      result.detail = body();
      result.ok = result.detail.empty();
    } catch (const std::exception& e) {
      result.detail = std::string(e.what()).substr(0, 300);
    }
    results.push_back(result);
  }
  at::TensorOptions on(at::ScalarType t) const { return at::TensorOptions().dtype(t).device(device_); }
  at::Tensor values(int rank, int64_t count, at::ScalarType t) const { return rank_values(rank, count, t).to(device_); }

  Communicator& comm_;
  at::Device device_;
  std::string where_;
  const int P, r;
  // 1000 elements: not a multiple of the group size, so padding paths run too.
  static constexpr int64_t n = 1000;
};

void Checks::reductions(at::ScalarType t) {
  const std::string dt = core::dtype_name(t);
  for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT}) {
    if (op == ReduceOp::PRODUCT && (t == at::kByte || t == at::kHalf || t == at::kBFloat16) && P > 3) continue;
    check(fmt::format("all_reduce {} {}", to_string(op), dt), [&] {
      auto x = values(r, n, t);
      comm_.all_reduce(x, op);
      return compare(x, expected_reduction(op, P, n, t));
    });
  }
  check(fmt::format("all_reduce async {}", dt), [&] {
    auto x = values(r, n, t);
    auto y = values(r, 7, t);
    auto w1 = comm_.all_reduce_async(x);
    auto w2 = comm_.all_reduce_async(y, ReduceOp::MAX);
    w2.wait();
    w1.wait();
    auto e = compare(x, expected_reduction(ReduceOp::SUM, P, n, t));
    return e.empty() ? compare(y, expected_reduction(ReduceOp::MAX, P, 7, t)) : e;
  });
  for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
    check(fmt::format("reduce_scatter {} {}", to_string(op), dt), [&] {
      auto in = values(r, n * P, t);
      auto out = at::empty({n}, on(t));
      comm_.reduce_scatter(out, in, op);
      // Element j of chunk r has base index r*n + j.
      auto full = expected_reduction(op, P, n * P, t);
      return compare(out, full.narrow(0, r * n, n));
    });
  }
}

void Checks::data_movement(at::ScalarType t) {
  const std::string dt = core::dtype_name(t);
  check(fmt::format("broadcast {}", dt), [&] {
    auto x = values(r, n, t);
    int root = P - 1;
    comm_.broadcast(x, root);
    return compare(x, rank_values(root, n, t));
  });
  check(fmt::format("all_gather {}", dt), [&] {
    auto x = values(r, 10, t);
    auto out = at::empty({P * 10}, on(t));
    comm_.all_gather(out, x);
    std::vector<at::Tensor> want;
    for (int i = 0; i < P; ++i) want.push_back(rank_values(i, 10, t));
    auto e = compare(out, at::cat(want));
    if (!e.empty()) return e;
    std::vector<at::Tensor> list;
    comm_.all_gather(list, x.view({2, 5}));
    for (int i = 0; i < P; ++i)
      if (auto d = compare(list[i], want[i].view({2, 5})); !d.empty()) return "list form: " + d;
    return std::string();
  });
  check(fmt::format("all_to_all {}", dt), [&] {
    // Chunk j sent by rank i holds 10*i + j.
    auto in = (at::arange(P, at::kDouble) + 10 * r).repeat_interleave(3).to(on(t));
    auto out = at::empty_like(in);
    comm_.all_to_all(out, in);
    auto want = (at::arange(P, at::kDouble) * 10 + r).repeat_interleave(3).to(t);
    return compare(out, want);
  });
  if (P > 1) {
    check(fmt::format("send/recv {}", dt), [&] {
      // A ring: send to the next rank, receive from the previous one.
      auto mine = values(r, 16, t);
      auto got = at::empty({16}, on(t));
      auto sending = comm_.send_async(mine, (r + 1) % P, 7);
      comm_.recv(got, (r - 1 + P) % P, 7);
      sending.wait();
      return compare(got, rank_values((r - 1 + P) % P, 16, t));
    });
  }
}

void Checks::objects_and_groups() {
  check("barrier", [&] {
    comm_.barrier();
    return std::string();
  });
  check("broadcast_object", [&] {
    auto got = comm_.broadcast_object(fmt::format("{{\"from\": {}}}", r), 0);
    return got == "{\"from\": 0}" ? "" : "got " + got;
  });
  check("all_gather_object", [&] {
    auto got = comm_.all_gather_object(std::string(static_cast<size_t>(r + 1), 'x'));
    for (int i = 0; i < P; ++i)
      if (got[i] != std::string(static_cast<size_t>(i + 1), 'x')) return fmt::format("entry {} is {:?}", i, got[i]);
    return std::string();
  });
  if (P < 2) return;
  check("new_group (even/odd ranks) all_reduce", [&] {
    std::vector<int> members;
    for (int i = r % 2; i < P; i += 2) members.push_back(i);
    auto group = comm_.new_group(members, r % 2 ? "odd" : "even");
    auto x = at::full({4}, r + 1, on(at::kFloat));
    group.all_reduce(x);
    double want = 0;
    for (int m : members) want += m + 1;
    return compare(x, at::full({4}, want, at::kFloat));
  });
}

}  // namespace

std::vector<CheckResult> run_collective_checks(Communicator& comm, const std::string& device_name) {
  Checks checks(comm, device_name);
  for (auto t : kDtypes) {
    // Every rank runs the same sequence of collectives: one dtype at a time.
    checks.reductions(t);
    checks.data_movement(t);
  }
  checks.objects_and_groups();
  return checks.results;
}

}  // namespace xlr8
