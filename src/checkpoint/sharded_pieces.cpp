#include "checkpoint/sharded_pieces.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/files.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "xlr8/error.hpp"
#include "xlr8/safetensors.hpp"

namespace fs = std::filesystem;

namespace xlr8::checkpoints {

const char* const kPiecesIndex = "sharded_index.json";
std::string pieces_file(int rank) { return fmt::format("shards_rank{}.safetensors", rank); }
std::string model_key(size_t model, const std::string& name) { return fmt::format("model{}/{}", model, name); }

namespace {

// Version 2 adds boxes (tensor-parallel slices); a checkpoint without them is still written as version 1.
constexpr const char* kIndexFormat = "xlr8-sharded-1";
constexpr const char* kIndexFormatBoxes = "xlr8-sharded-2";

std::string piece_name(const std::string& key, int64_t start, const std::vector<int64_t>& box_offsets) {
  if (box_offsets.empty()) return fmt::format("{}@{}", key, start);
  return fmt::format("{}@[{}]@{}", key, fmt::join(box_offsets, ","), start);
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// The box a piece names in the index and its entry's name: none for the whole tensor (the format before boxes).
const Box* named_box(const Piece& p) { return p.placement.unsplit() ? nullptr : &p.placement.boxes().front(); }

// What one rank wrote, as the index lists it.
nlohmann::json describe_pieces(const RankPieces& mine, int rank) {
  nlohmann::json out{{"rank", rank}, {"pieces", nlohmann::json::array()}, {"counters", mine.counters}};
  for (const auto& p : mine.pieces) {
    nlohmann::json piece{{"key", p.key},
                         {"shape", p.placement.whole()},
                         {"dtype", safetensors_dtype_code(p.dtype)},
                         {"start", p.placement.start()},
                         {"count", p.placement.count()}};
    if (const auto* box = named_box(p)) {
      piece["box_offsets"] = box->offsets;
      piece["box_sizes"] = box->sizes;
    }
    out["pieces"].push_back(std::move(piece));
  }
  return out;
}

std::vector<int64_t> box_offsets_of(const nlohmann::json& range) {
  return range.contains("box_offsets") ? range["box_offsets"].get<std::vector<int64_t>>() : std::vector<int64_t>{};
}

// The box an index range lies in: the whole tensor of `shape` when it names none.
Box box_of(const nlohmann::json& range, const std::vector<int64_t>& shape) {
  Box box{box_offsets_of(range), range.contains("box_sizes") ? range["box_sizes"].get<std::vector<int64_t>>() : shape};
  if (box.offsets.empty()) box.offsets.assign(shape.size(), 0);
  return box;
}

bool lies_inside(const Box& box, const std::vector<int64_t>& shape) {
  bool inside = box.offsets.size() == shape.size() && box.sizes.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d)
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] + box.sizes[d] <= shape[d];
  return inside;
}

// The ranges of a tensor (sorted here by box, then start) cover each of their boxes once, and the boxes
// cover the tensor once: every element is saved exactly once.
void check_coverage(const std::string& key, nlohmann::json& t) {
  const auto shape = t["shape"].get<std::vector<int64_t>>();
  auto& ranges = t["ranges"];
  std::sort(ranges.begin(), ranges.end(), [](auto& a, auto& b) {
    return std::pair(box_offsets_of(a), a["start"].template get<int64_t>()) <
           std::pair(box_offsets_of(b), b["start"].template get<int64_t>());
  });
  auto fail = [&](const std::string& what) {
    throw Error(fmt::format("save_state: the ranks' pieces of {:?} {} (an engine bug); nothing was saved", key, what));
  };
  std::vector<Box> boxes;
  int64_t next = 0;
  for (size_t k = 0; k < ranges.size(); ++k) {
    auto& r = ranges[k];
    const auto box = box_of(r, shape);
    if (boxes.empty() || boxes.back().offsets != box.offsets) {
      if (!boxes.empty() && next != numel_of(boxes.back().sizes))
        fail(fmt::format("end at element {} of {} in a box", next, numel_of(boxes.back().sizes)));
      if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) fail("give a box of another rank");
      if (!lies_inside(box, shape)) fail("lie outside it");
      boxes.push_back(box);
      next = 0;
    } else if (box.sizes != boxes.back().sizes) {
      fail("disagree on a box's size");
    }
    if (r["start"].get<int64_t>() != next)
      fail(fmt::format("{} at element {}", r["start"].get<int64_t>() < next ? "overlap" : "leave a gap", next));
    next += r["count"].get<int64_t>();
  }
  if (boxes.empty()) fail("are missing");
  if (next != numel_of(boxes.back().sizes))
    fail(fmt::format("end at element {} of {}", next, numel_of(boxes.back().sizes)));
  int64_t covered = 0;
  for (size_t a = 0; a < boxes.size(); ++a) {
    covered += numel_of(boxes[a].sizes);
    for (size_t b = a + 1; b < boxes.size(); ++b) {
      bool apart = false;
      for (size_t d = 0; d < shape.size() && !apart; ++d)
        apart = boxes[a].offsets[d] + boxes[a].sizes[d] <= boxes[b].offsets[d] ||
                boxes[b].offsets[d] + boxes[b].sizes[d] <= boxes[a].offsets[d];
      if (!apart) fail("overlap in two boxes");
    }
  }
  if (covered != numel_of(shape)) fail(fmt::format("cover {} of its {} elements", covered, numel_of(shape)));
}

// Merges every rank's list into the index and checks it covers each tensor once, with one shape and dtype.
nlohmann::json merge_index(const std::vector<std::string>& per_rank) {
  nlohmann::json tensors = nlohmann::json::object(), counters = nlohmann::json::object();
  bool boxes = false;
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
      nlohmann::json range{{"rank", rank}, {"start", p.at("start")}, {"count", p.at("count")}};
      if (p.contains("box_offsets")) {
        range["box_offsets"] = p.at("box_offsets");
        range["box_sizes"] = p.at("box_sizes");
        boxes = true;
      }
      t["ranges"].push_back(std::move(range));
    }
    for (auto& [k, v] : rank_list.at("counters").items()) counters[k] = v;
  }
  for (auto& [key, t] : tensors.items()) check_coverage(key, t);
  return {{"format", boxes ? kIndexFormatBoxes : kIndexFormat}, {"tensors", tensors}, {"counters", counters}};
}

}  // namespace

int64_t IndexedTensor::numel() const { return numel_of(shape); }

bool IndexedTensor::boxed() const {
  return std::any_of(ranges.begin(), ranges.end(), [&](const Range& r) { return r.box.sizes != shape; });
}

void RankPieces::add(const std::string& key, const Placement& placement, const at::Tensor& values) {
  const auto flat = values.detach().reshape(-1);
  add_later(key, placement, values.scalar_type(), [flat] { return flat; });
}

void RankPieces::add_later(const std::string& key, const Placement& placement, at::ScalarType dtype,
                           std::function<at::Tensor()> values) {
  if (placement.whole_numel() == 0) {  // a tensor without elements still has a name and a shape to save
    pieces.push_back({key, placement, dtype, [values] { return values().reshape(-1); }});
    return;
  }
  for (const auto& span : placement.spans())
    pieces.push_back({key, Placement::of_box(placement.whole(), span.box).chunk(span.begin, span.count), dtype,
                      [values, at = span.at, count = span.count] { return values().reshape(-1).narrow(0, at, count); }});
}

void write_pieces(const fs::path& dir, const RankPieces& mine, Communicator& world) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& p : mine.pieces) {
    const auto* box = named_box(p);
    specs.push_back({piece_name(p.key, p.placement.start(), box ? box->offsets : std::vector<int64_t>{}), p.dtype,
                     {p.placement.count()}});
  }
  {  // one piece in memory at a time
    SafetensorsWriter writer((dir / pieces_file(world.rank())).string(), std::move(specs),
                             {{"rank", std::to_string(world.rank())}});
    for (const auto& p : mine.pieces) writer.write(p.data().reshape(-1));
    writer.commit();
  }
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
      entry.ranges.push_back({name, e.name, {std::vector<int64_t>(e.shape.size(), 0), e.shape}, 0, entry.numel()});
      tensors_.emplace(model_key(i, e.name), std::move(entry));
    }
  }
  if (!checkpoint.has(kPiecesIndex)) return;
  const auto path = (checkpoint.dir() / kPiecesIndex).string();
  try {
    auto index = nlohmann::json::parse(checkpoint.file(kPiecesIndex));
    if (index.at("format") != kIndexFormat && index.at("format") != kIndexFormatBoxes)
      throw std::runtime_error("unknown format " + index.at("format").dump());
    for (auto& [key, t] : index.at("tensors").items()) {
      IndexedTensor entry;
      entry.shape = t.at("shape").get<std::vector<int64_t>>();
      auto dtype = safetensors_dtype_from_code(t.at("dtype").get<std::string>());
      if (!dtype) throw std::runtime_error("unknown dtype " + t.at("dtype").dump());
      entry.dtype = *dtype;
      for (auto& r : t.at("ranges")) {
        const auto offsets = box_offsets_of(r);
        auto box = box_of(r, entry.shape);
        if (!lies_inside(box, entry.shape)) throw std::runtime_error("a box of " + key + " does not lie inside its shape");
        entry.ranges.push_back({pieces_file(r.at("rank").get<int>()), piece_name(key, r.at("start").get<int64_t>(), offsets),
                                std::move(box), r.at("start").get<int64_t>(), r.at("count").get<int64_t>()});
      }
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

const SafetensorsEntry& PieceReader::entry_of(const std::string& key, const IndexedTensor::Range& r) const {
  const auto* entry = find(key);
  const auto& entries = entries_of(r.file);
  auto found = entries.find(r.entry);
  const SafetensorsEntry* piece = found == entries.end() ? nullptr : &found->second;
  if (!piece || piece->dtype != entry->dtype ||
      piece->bytes != static_cast<size_t>(r.count) * at::elementSize(entry->dtype))
    throw Error(fmt::format("load_state: {} does not hold the piece of {:?} at element {} that {} lists; the "
                            "checkpoint is corrupt, nothing was loaded",
                            (checkpoint_.dir() / r.file).string(), key, r.start, kPiecesIndex));
  checkpoint_.verify(r.file);
  return *piece;
}

void PieceReader::read_range(const std::string& key, const IndexedTensor::Range& r, int64_t a, int64_t b,
                             void* out) const {
  const auto& piece = entry_of(key, r);
  const size_t element = at::elementSize(find(key)->dtype);
  checkpoint_.read_into(r.file, piece.begin + (a - r.start) * element, static_cast<size_t>(b - a) * element, out);
}

const IndexedTensor& PieceReader::fitting(const std::string& key, const Placement& placement) const {
  const auto* entry = find(key);
  if (!entry) throw Error(fmt::format("load_state: {} is missing; nothing was loaded", describe(key)));
  if (placement.whole() != entry->shape)
    throw Error(fmt::format("load_state: {} is [{}], but this rank holds {}; nothing was loaded", describe(key),
                            fmt::join(entry->shape, ", "), placement.describe()));
  return *entry;
}

namespace {

// Whether some range of `entry` lies in `box`: it was saved in the same box (the same tp layout, or no tensor
// parallelism either time), and a read takes that box's ranges, not a cut of the whole tensor.
bool saved_alike(const IndexedTensor& entry, const Box& box) {
  return std::any_of(entry.ranges.begin(), entry.ranges.end(), [&](const auto& r) { return r.box == box; });
}

}  // namespace

void PieceReader::check(const std::string& key, const Placement& placement) const {
  const auto& entry = fitting(key, placement);
  for (const auto& span : placement.spans())
    for (const auto& r : entry.ranges) {
      // Saved in the same box: the ranges the span overlaps. Otherwise read() cuts it out of the whole tensor.
      const bool alike = saved_alike(entry, span.box);
      if (!alike || (r.box == span.box && r.start < span.begin + span.count && span.begin < r.start + r.count))
        entry_of(key, r);
    }
}

at::Tensor PieceReader::read(const std::string& key, const Placement& placement) const {
  const auto& entry = fitting(key, placement);
  std::vector<at::Tensor> parts;
  for (const auto& span : placement.spans()) parts.push_back(read_box(key, span.box, span.begin, span.count));
  if (parts.empty()) return at::empty({0}, at::TensorOptions().dtype(entry.dtype));  // a rank's empty shard
  return parts.size() == 1 ? parts.front() : at::cat(parts);
}

at::Tensor PieceReader::read_box(const std::string& key, const Box& box, int64_t start, int64_t count) const {
  const auto* entry = find(key);
  if (saved_alike(*entry, box)) {
    auto out = at::empty({count}, at::TensorOptions().dtype(entry->dtype));
    const size_t element = at::elementSize(entry->dtype);
    for (const auto& r : entry->ranges) {
      if (r.box != box) continue;
      const int64_t a = std::max(start, r.start), b = std::min(start + count, r.start + r.count);
      if (a < b) read_range(key, r, a, b, static_cast<char*>(out.data_ptr()) + (a - start) * element);
    }
    return out;
  }
  // Another layout: cut the box out of the whole tensor.
  const auto cut = Placement::of_box(entry->shape, box).chunk(start, count).take(whole(key));
  return cut.clone();  // not a view keeping the whole alive
}

const at::Tensor& PieceReader::whole(const std::string& key) const {
  if (last_whole_.first == key && last_whole_.second.defined()) return last_whole_.second;
  const auto* entry = find(key);
  auto out = at::empty(entry->shape, at::TensorOptions().dtype(entry->dtype));
  const size_t element = at::elementSize(entry->dtype);
  // Ranges come sorted by box: fill each box's buffer, then put it in place.
  for (size_t k = 0; k < entry->ranges.size();) {
    const auto& first = entry->ranges[k];
    const auto& sizes = first.box.sizes;
    auto buffer = at::empty({numel_of(sizes)}, out.options());
    for (; k < entry->ranges.size() && entry->ranges[k].box == first.box; ++k) {
      const auto& r = entry->ranges[k];
      read_range(key, r, r.start, r.start + r.count, static_cast<char*>(buffer.data_ptr()) + r.start * element);
    }
    at::Tensor place = out;
    for (size_t d = 0; d < sizes.size(); ++d) place = place.narrow(static_cast<int64_t>(d), first.box.offsets[d], sizes[d]);
    place.copy_(buffer.view(sizes));
  }
  last_whole_ = {key, out};
  return last_whole_.second;
}

}  // namespace xlr8::checkpoints
