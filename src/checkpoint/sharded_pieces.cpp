#include "checkpoint/sharded_pieces.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>

#include "checkpoint/files.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "xlr8/error.hpp"
#include "xlr8/safetensors.hpp"

namespace fs = std::filesystem;

namespace xlr8::checkpoint {

const char* const kPiecesIndex = "sharded_index.json";
std::string pieces_file(int rank) { return fmt::format("shards_rank{}.safetensors", rank); }
std::string model_key(size_t model, const std::string& name) { return fmt::format("model{}/{}", model, name); }

namespace {

constexpr const char* kIndexFormat = "xlr8-sharded-1";

std::string piece_name(const std::string& key, int64_t start) { return fmt::format("{}@{}", key, start); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// What one rank wrote, as the index lists it.
nlohmann::json describe_pieces(const RankPieces& mine, int rank) {
  nlohmann::json out{{"rank", rank}, {"pieces", nlohmann::json::array()}, {"counters", mine.counters}};
  for (const auto& p : mine.pieces)
    out["pieces"].push_back({{"key", p.key},
                             {"shape", p.shape},
                             {"dtype", safetensors_dtype_code(p.data.scalar_type())},
                             {"start", p.start},
                             {"count", p.data.numel()}});
  return out;
}

// Merges every rank's list into the index and checks it covers each tensor once, with one shape and dtype.
nlohmann::json merge_index(const std::vector<std::string>& per_rank) {
  nlohmann::json tensors = nlohmann::json::object(), counters = nlohmann::json::object();
  for (const auto& text : per_rank) {
    auto rank_list = nlohmann::json::parse(text);
    int rank = rank_list.at("rank");
    for (auto& p : rank_list.at("pieces")) {
      auto& t = tensors[p.at("key").get<std::string>()];
      if (t.is_null()) t = {{"shape", p.at("shape")}, {"dtype", p.at("dtype")}, {"ranges", nlohmann::json::array()}};
      if (t.at("shape") != p.at("shape") || t.at("dtype") != p.at("dtype"))
        throw Error(fmt::format("save_state: ranks disagree on the shape or dtype of {} ({} {} against {} {})",
                                p.at("key").dump(), t.at("dtype").dump(), t.at("shape").dump(), p.at("dtype").dump(),
                                p.at("shape").dump()));
      t["ranges"].push_back({{"rank", rank}, {"start", p.at("start")}, {"count", p.at("count")}});
    }
    for (auto& [k, v] : rank_list.at("counters").items()) counters[k] = v;
  }
  for (auto& [key, t] : tensors.items()) {
    auto& ranges = t["ranges"];
    std::sort(ranges.begin(), ranges.end(), [](auto& a, auto& b) { return a["start"] < b["start"]; });
    int64_t next = 0;
    for (auto& r : ranges) {
      if (r["start"].get<int64_t>() != next)
        throw Error(fmt::format("save_state: the ranks' pieces of {:?} {} at element {} (an engine bug); nothing was "
                                "saved",
                                key, r["start"].get<int64_t>() < next ? "overlap" : "leave a gap", next));
      next += r["count"].get<int64_t>();
    }
    if (next != numel_of(t["shape"].get<std::vector<int64_t>>()))
      throw Error(fmt::format("save_state: the ranks' pieces of {:?} end at element {} of {}; nothing was saved", key,
                              next, numel_of(t["shape"].get<std::vector<int64_t>>())));
  }
  return {{"format", kIndexFormat}, {"tensors", tensors}, {"counters", counters}};
}

}  // namespace

int64_t IndexedTensor::numel() const { return numel_of(shape); }

void write_pieces(const fs::path& dir, const RankPieces& mine, Communicator& world) {
  NamedTensors named;
  for (const auto& p : mine.pieces) named.emplace_back(piece_name(p.key, p.start), p.data.reshape(-1));
  save_safetensors((dir / pieces_file(world.rank())).string(), named, {{"rank", std::to_string(world.rank())}});
  auto all = world.all_gather_object(describe_pieces(mine, world.rank()).dump());
  auto index = merge_index(all);  // every rank: a bad layout fails everywhere
  if (world.rank() == 0) files::write_durably((dir / kPiecesIndex).string(), index.dump());
}

const std::map<std::string, SafetensorsEntry>& PieceReader::entries_of(const std::string& name) const {
  auto& entries = headers_[name];
  if (!entries.empty()) return entries;
  const auto read = [&](size_t offset, size_t size, void* out) { checkpoint_.read_into(name, offset, size, out); };
  for (auto& e : read_safetensors_header(checkpoint_.size_of(name), read, (checkpoint_.dir() / name).string()).entries)
    entries.emplace(e.name, e);
  return entries;
}

PieceReader::PieceReader(const Verified& checkpoint) : checkpoint_(checkpoint) {
  for (size_t i = 0; i < checkpoint.models(); ++i) {
    const auto name = model_file(i);
    for (const auto& [tensor, e] : entries_of(name)) {
      IndexedTensor entry{e.shape, e.dtype, {}};
      entry.ranges.push_back({name, e.name, 0, entry.numel()});
      tensors_.emplace(model_key(i, e.name), std::move(entry));
    }
  }
  if (!checkpoint.has(kPiecesIndex)) return;
  const auto path = (checkpoint.dir() / kPiecesIndex).string();
  try {
    auto index = nlohmann::json::parse(checkpoint.file(kPiecesIndex));
    if (index.at("format") != kIndexFormat) throw std::runtime_error("unknown format " + index.at("format").dump());
    for (auto& [key, t] : index.at("tensors").items()) {
      IndexedTensor entry;
      entry.shape = t.at("shape").get<std::vector<int64_t>>();
      auto dtype = safetensors_dtype_from_code(t.at("dtype").get<std::string>());
      if (!dtype) throw std::runtime_error("unknown dtype " + t.at("dtype").dump());
      entry.dtype = *dtype;
      for (auto& r : t.at("ranges"))
        entry.ranges.push_back({pieces_file(r.at("rank").get<int>()), piece_name(key, r.at("start").get<int64_t>()),
                                r.at("start").get<int64_t>(), r.at("count").get<int64_t>()});
      tensors_.emplace(key, std::move(entry));
    }
    for (auto& [k, v] : index.at("counters").items()) counters_[k] = v.get<int64_t>();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format("load_state: {} is corrupt ({}); nothing was loaded", path, e.what()));
  }
}

const IndexedTensor* PieceReader::find(const std::string& key) const {
  auto it = tensors_.find(key);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::optional<int64_t> PieceReader::counter(const std::string& key) const {
  auto it = counters_.find(key);
  if (it == counters_.end()) return std::nullopt;
  return it->second;
}

std::string PieceReader::describe(const std::string& key) const {
  return fmt::format("tensor {:?} of {}", key, checkpoint_.dir().string());
}

at::Tensor PieceReader::read(const std::string& key, int64_t start, int64_t count) const {
  const auto* entry = find(key);
  if (!entry) throw Error(fmt::format("load_state: {} is missing; nothing was loaded", describe(key)));
  auto out = at::empty({count}, at::TensorOptions().dtype(entry->dtype));
  const size_t element = at::elementSize(entry->dtype);
  for (const auto& r : entry->ranges) {
    const int64_t a = std::max(start, r.start), b = std::min(start + count, r.start + r.count);
    if (a >= b) continue;
    const auto& name = r.file;
    const auto& entries = entries_of(name);
    auto found = entries.find(r.entry);
    const SafetensorsEntry* piece = found == entries.end() ? nullptr : &found->second;
    if (!piece || piece->dtype != entry->dtype || piece->bytes != static_cast<size_t>(r.count) * element)
      throw Error(fmt::format("load_state: {} does not hold the piece of {:?} at element {} that {} lists; the "
                              "checkpoint is corrupt, nothing was loaded",
                              (checkpoint_.dir() / name).string(), key, r.start, kPiecesIndex));
    checkpoint_.read_into(name, piece->begin + (a - r.start) * element, static_cast<size_t>(b - a) * element,
                          static_cast<char*>(out.data_ptr()) + (a - start) * element);
  }
  return out;
}

}  // namespace xlr8::checkpoint
