// Tensors in fmt and JSON (format.hpp), nested tensor values (tensor_tree.hpp) and the progress bar's
// two renderings (progress.hpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <unordered_map>

#include "xlr8/error.hpp"
#include "xlr8/format.hpp"
#include "xlr8/progress.hpp"
#include "xlr8/tensor_tree.hpp"
#include "xlr8/to_device.hpp"

namespace {

std::string read_all(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text += static_cast<char>(c);
  return text;
}

struct Pair {  // a user struct taking part through map_tensors
  at::Tensor a, b;
  int label = 0;
  Pair map_tensors(const xlr8::TensorFn& fn) const { return {fn(a), fn(b), label}; }
};

}  // namespace

TEST(Format, ScalarsPrintAsNumbersAndTensorsAsPyTorchWritesThem) {
  EXPECT_EQ(fmt::format("{}", at::scalar_tensor(0.25)), "0.25");
  EXPECT_EQ(fmt::format("{:.3f}", at::scalar_tensor(2.0)), "2.000");
  EXPECT_EQ(fmt::format("{}", at::arange(3, at::kLong)), "tensor([0, 1, 2])");
  EXPECT_EQ(fmt::format("{:.1f}", at::arange(4, at::kFloat).view({2, 2})), "tensor([[0.0, 1.0], [2.0, 3.0]])");
  EXPECT_EQ(fmt::format("{}", at::ones({2}, at::kBFloat16)), "tensor([1, 1], dtype=bfloat16)");
  EXPECT_EQ(fmt::format("{}", at::tensor({1, 0}).to(at::kBool)), "tensor([true, false])");
  EXPECT_EQ(fmt::format("{}", at::Tensor()), "tensor(undefined)");
  // Past 1000 elements, three at each edge of each dimension.
  EXPECT_EQ(fmt::format("{}", at::arange(2000, at::kLong)), "tensor([0, 1, 2, ..., 1997, 1998, 1999])");
  auto requires_grad = torch::ones({1}, torch::requires_grad()) * 3;  // printed without detaching by hand
  EXPECT_EQ(fmt::format("{}", requires_grad), "tensor([3])");
  EXPECT_EQ(fmt::format("{} {} {}", at::zeros({2, 3}).sizes(), at::Device(at::kCPU), at::kBFloat16), "[2, 3] cpu bfloat16");
  EXPECT_EQ(fmt::format("{}", at::Device(at::kCUDA, 1)), "cuda:1");
}

TEST(Format, TensorsBecomeJsonNumbersOrNestedArrays) {
  nlohmann::json logged{{"loss", at::scalar_tensor(2.5)},
                        {"steps", at::scalar_tensor(7, at::kLong)},
                        {"ok", at::scalar_tensor(1).to(at::kBool)},
                        {"per_class", at::arange(4, at::kFloat).view({2, 2})}};
  EXPECT_EQ(logged, nlohmann::json::parse(R"({"loss":2.5,"steps":7,"ok":true,"per_class":[[0.0,1.0],[2.0,3.0]]})"));
  EXPECT_TRUE(nlohmann::json(at::Tensor()).is_null());
}

TEST(TensorTree, MapsEveryTensorInAFixedOrderAndKeepsOtherValues) {
  std::unordered_map<std::string, Pair> batch{{"z", {at::full({1}, 3.0), at::full({1}, 4.0), 9}},
                                              {"a", {at::full({1}, 1.0), at::full({1}, 2.0), 8}}};
  std::tuple<std::vector<at::Tensor>, std::map<int, at::Tensor>, int> value{
      {at::full({1}, 5.0)}, {{2, at::full({1}, 7.0)}, {1, at::full({1}, 6.0)}}, 42};
  std::vector<double> order;
  for (const auto& t : xlr8::tensors_of(batch)) order.push_back(t.item<double>());
  for (const auto& t : xlr8::tensors_of(value)) order.push_back(t.item<double>());
  EXPECT_EQ(order, (std::vector<double>{1, 2, 3, 4, 5, 6, 7}));  // unordered keys sorted; map by key
  auto doubled = xlr8::map_tensors(value, [](const at::Tensor& t) { return t * 2; });
  EXPECT_EQ(std::get<1>(doubled).at(2).item<double>(), 14.0);
  EXPECT_EQ(std::get<2>(doubled), 42);
  auto moved = xlr8::to_device(batch, at::Device(at::kCPU));  // to_device reaches user structs the same way
  EXPECT_EQ(moved.at("z").label, 9);
  // Containers with their own comparator or allocator, and data-only examples, are traversed too.
  std::map<std::string, at::Tensor, std::less<>> transparent{{"b", at::full({1}, 2.0)}, {"a", at::full({1}, 1.0)}};
  EXPECT_EQ(xlr8::tensors_of(transparent).front().item<double>(), 1.0);
  auto example = xlr8::map_tensors(torch::data::TensorExample(at::ones({2})), [](const at::Tensor& t) { return t * 3; });
  EXPECT_EQ(example.data.sum().item<double>(), 6.0);
  EXPECT_EQ(xlr8::to_device(torch::data::TensorExample(at::ones({2})), at::Device(at::kCPU)).data.numel(), 2);
  static_assert(xlr8::is_tensor_tree_v<torch::data::TensorExample>);
  static_assert(xlr8::is_tensor_tree_v<std::map<std::string, std::vector<Pair>>>);
  static_assert(!xlr8::is_tensor_tree_v<std::vector<int>>);
  static_assert(!xlr8::is_tensor_tree_v<std::tuple<at::Tensor, int>>);
}

TEST(ProgressBar, LinesModeWritesALineEveryNStepsAndAtTheEnd) {
  std::FILE* out = std::tmpfile();
  {
    xlr8::ProgressBar bar(5, {.description = "train", .unit = "step", .line_every = 2}, xlr8::ProgressMode::LINES, out);
    for (int i = 0; i < 5; ++i) {
      bar.set_postfix({{"loss", 1.0 / (i + 1)}, {"epoch", 1}});
      bar.update();
    }
  }  // the destructor closes it: a last line for step 5
  const auto text = read_all(out);
  std::fclose(out);
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_NE(text.find("train 2/5 (40%) "), std::string::npos) << text;
  EXPECT_NE(text.find("train 4/5 (80%) "), std::string::npos) << text;
  EXPECT_NE(text.find("train 5/5 (100%) "), std::string::npos) << text;
  EXPECT_NE(text.find(" ETA 00:00 loss=0.2, epoch=1\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("train 1/5"), std::string::npos) << text;
}

TEST(ProgressBar, BarModeRedrawsInPlaceAndEndsWithANewline) {
  std::FILE* out = std::tmpfile();
  xlr8::ProgressBar bar(4, {.description = "eval", .initial = 1}, xlr8::ProgressMode::BAR, out);
  EXPECT_NE(bar.render(60).find(" 25%|"), std::string::npos) << bar.render(60);  // resumed at 1 of 4
  bar.update(3);  // the last step always draws
  bar.close();
  bar.close();  // idempotent
  const auto text = read_all(out);
  std::fclose(out);
  EXPECT_EQ(text.front(), '\r');
  EXPECT_NE(text.find("\reval 100%|"), std::string::npos) << text;
  EXPECT_NE(text.find("| 4/4 [00:00<00:00, "), std::string::npos) << text;
  EXPECT_EQ(text.substr(text.size() - 4), "\x1b[K\n");
  EXPECT_EQ(bar.count(), 4);
}

TEST(ProgressBar, AFrameWiderThanTheTerminalIsCutToItSoRedrawsStayOnOneLine) {
  std::FILE* out = std::tmpfile();
  xlr8::ProgressBar bar(4, {.description = "run", .initial = 2}, xlr8::ProgressMode::BAR, out);
  bar.set_postfix({{"loss", 1.25}, {"learning_rate", 0.0003}, {"tokens_per_second", 13760.0}});
  auto characters = [](const std::string& text) {
    return std::count_if(text.begin(), text.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  };
  // A half-filled cell is three bytes: the cut counts characters. LC_ALL, read first, and put back after.
  const char* before = std::getenv("LC_ALL");
  const std::string saved = before ? before : "";
  ::setenv("LC_ALL", "C.UTF-8", 1);
  const auto frame = bar.render(70);
  const auto whole = bar.render(400);
  if (before) ::setenv("LC_ALL", saved.c_str(), 1);
  else ::unsetenv("LC_ALL");
  EXPECT_EQ(characters(frame), 69) << frame;  // the last column left free
  EXPECT_EQ(frame.rfind("run  50%|\u258c| 2/4 [", 0), 0u) << frame;  // the bar one cell, then cut in the postfix
  EXPECT_NE(whole.find("tokens_per_second=13760]"), std::string::npos) << whole;
  EXPECT_EQ(whole.rfind(']'), whole.size() - 1) << whole;
  bar.close();
  std::fclose(out);
}

TEST(ProgressBar, TheLaunchersTerminalCountsOnlyWhileStderrIsItsPipe) {
  // A worker's child inherits XLR8_TERMINAL_COLUMNS; with its stderr sent to a file it must not draw.
  ::setenv("XLR8_TERMINAL_COLUMNS", "80", 1);
  std::fflush(stderr);
  const int saved = ::dup(2);
  std::FILE* file = std::tmpfile();
  ::dup2(::fileno(file), 2);
  const auto to_file = xlr8::ProgressBar(3, {}, xlr8::ProgressMode::AUTO, stderr).mode();
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  ::dup2(pipe_fds[1], 2);
  const auto to_pipe = xlr8::ProgressBar(3, {}, xlr8::ProgressMode::AUTO, stderr).mode();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  std::fclose(file);
  ::unsetenv("XLR8_TERMINAL_COLUMNS");
  EXPECT_EQ(to_file, xlr8::ProgressMode::LINES);
  EXPECT_EQ(to_pipe, xlr8::ProgressMode::BAR);
}

TEST(ProgressBar, AutoIsLinesOffATerminalAndOffIsSilent) {
  std::FILE* out = std::tmpfile();
  EXPECT_EQ(xlr8::ProgressBar(3, {}, xlr8::ProgressMode::AUTO, out).mode(), xlr8::ProgressMode::LINES);
  read_all(out);
  std::FILE* quiet = std::tmpfile();
  {
    xlr8::ProgressBar bar(3, {}, xlr8::ProgressMode::OFF, quiet);
    bar.update(3);
  }
  EXPECT_EQ(read_all(quiet), "");
  std::fclose(out);
  std::fclose(quiet);
  EXPECT_EQ(xlr8::parse_progress_mode("lines", "XLR8_PROGRESS"), xlr8::ProgressMode::LINES);
  try {
    xlr8::parse_progress_mode("loud", "XLR8_PROGRESS");
    FAIL() << "accepted";
  } catch (const xlr8::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("XLR8_PROGRESS=\"loud\" is not a progress mode: use auto"), std::string::npos);
  }
}
