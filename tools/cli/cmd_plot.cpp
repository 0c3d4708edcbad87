// `xlr8 plot RUN_DIR [-o curves.png]`: the scalars a run logged (its metrics.jsonl, else metrics.csv,
// else its TensorBoard event files) drawn as PNG curves, one panel per scalar against the step, for people without TensorBoard. Drawn by
// gnuplot (Debian's gnuplot-nox), driven through a script written beside the data in a temporary folder.
#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "cli/commands.hpp"
#include "cli/scratch_dir.hpp"
#include "accelerate/tensorboard.hpp"
#include "xlr8/error.hpp"

extern "C" char** environ;  // as unistd.h declares it (C linkage), whichever comes first

namespace fs = std::filesystem;

namespace xlr8::cli {
namespace {

using Series = std::vector<std::pair<double, double>>;  // (step, value)

struct Scalars {
  std::string source;
  std::map<std::string, Series> series;
};

void add_point(Scalars& s, const std::string& key, double step, const nlohmann::json& value) {
  if (value.is_number() && std::isfinite(value.get<double>())) s.series[key].emplace_back(step, value.get<double>());
}

Scalars read_jsonl(const fs::path& file) {
  Scalars s{file.string(), {}};
  std::ifstream in(file);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  for (int64_t row = 0; row < static_cast<int64_t>(lines.size()); ++row) {
    const auto& line = lines[row];
    if (line.empty()) continue;
    auto parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object()) {
      if (row + 1 == static_cast<int64_t>(lines.size())) break;  // a running job's half-written last line
      throw ConfigError(fmt::format("{} line {} is not a JSON object", file.string(), row + 1));
    }
    double step = static_cast<double>(row);  // rows logged without a step count as steps 0, 1, ...
    if (auto it = parsed.find("step"); it != parsed.end() && it->is_number()) step = it->get<double>();
    for (const auto& [key, value] : parsed.items())
      if (key != "step") add_point(s, key, step, value);
  }
  return s;
}

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (char c : line) {
    if (c == '"') quoted = !quoted;
    else if (c == ',' && !quoted) fields.emplace_back();
    else fields.back() += c;
  }
  return fields;
}

Scalars read_csv(const fs::path& file) {
  Scalars s{file.string(), {}};
  std::ifstream in(file);
  std::string line;
  if (!std::getline(in, line)) return s;
  const auto header = split_csv_line(line);
  for (int64_t row = 0; std::getline(in, line); ++row) {
    const auto fields = split_csv_line(line);
    double step = static_cast<double>(row);
    std::map<std::string, nlohmann::json> values;
    for (size_t i = 0; i < fields.size() && i < header.size(); ++i) {
      char* end = nullptr;
      const double v = std::strtod(fields[i].c_str(), &end);
      if (fields[i].empty() || *end) continue;
      if (header[i] == "step") step = v;
      else values[header[i]] = v;
    }
    for (const auto& [key, value] : values) add_point(s, key, step, value);
  }
  return s;
}

bool is_event_file(const fs::path& file) { return file.filename().string().starts_with("events.out.tfevents."); }

// In name order, which is the order they were started in (a resumed run adds a file).
std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file() && is_event_file(entry.path())) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

Scalars read_events(const std::vector<fs::path>& files) {
  Scalars s{files.front().string(), {}};
  for (const auto& file : files)
    for (const auto& [tag, points] : accelerate::read_tensorboard_scalars(file.string()))
      for (const auto& [step, value] : points) add_point(s, tag, static_cast<double>(step), value);
  return s;
}

bool holds_a_run(const fs::path& dir) {
  return fs::exists(dir / "metrics.jsonl") || fs::exists(dir / "metrics.csv") || !event_files(dir).empty();
}

// The most recently started run below `dir`: a project (<run>/) or a project_dir (<project>/<run>/).
std::optional<fs::path> newest_run(const fs::path& dir) {
  std::optional<fs::path> newest;
  fs::file_time_type newest_time;
  auto consider = [&](const fs::path& candidate) {
    if (!holds_a_run(candidate)) return;
    const auto started = fs::last_write_time(candidate);  // its files were created when it started
    if (!newest || started > newest_time || (started == newest_time && candidate > *newest))
      newest = candidate, newest_time = started;
  };
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_directory()) continue;
    consider(entry.path());
    for (const auto& inner : fs::directory_iterator(entry.path()))
      if (inner.is_directory()) consider(inner.path());
  }
  return newest;
}

Scalars read_run(const std::string& where) {
  const fs::path path(where);
  if (fs::is_regular_file(path)) {
    if (is_event_file(path)) return read_events({path});
    return path.extension() == ".csv" ? read_csv(path) : read_jsonl(path);
  }
  if (!fs::is_directory(path))
    throw ConfigError(fmt::format("xlr8 plot: {} is neither a run directory nor a metrics file", where));
  std::optional<fs::path> run = holds_a_run(path) ? path : newest_run(path);
  if (!run)
    throw ConfigError(fmt::format("xlr8 plot: {} has no metrics.jsonl or metrics.csv, no TensorBoard event file and "
                                  "no run below it; a run writes them with log_with jsonl, csv or tensorboard",
                                  where));
  if (fs::exists(*run / "metrics.jsonl")) return read_jsonl(*run / "metrics.jsonl");
  if (fs::exists(*run / "metrics.csv")) return read_csv(*run / "metrics.csv");
  return read_events(event_files(*run));
}

// Losses first, then the rest by name.
std::vector<std::string> panel_order(const Scalars& s, const std::vector<std::string>& chosen) {
  std::vector<std::string> keys;
  if (!chosen.empty()) {
    for (const auto& k : chosen) {
      if (!s.series.count(k)) {
        std::string known;
        for (const auto& [name, _] : s.series) known += (known.empty() ? "" : ", ") + name;
        throw ConfigError(fmt::format("--keys: {} logged no scalar {:?}; it has {}", s.source, k, known));
      }
      keys.push_back(k);
    }
    return keys;
  }
  for (const auto& [k, _] : s.series) keys.push_back(k);
  std::stable_partition(keys.begin(), keys.end(), [](const std::string& k) { return k.find("loss") != std::string::npos; });
  return keys;
}

// Single-quoted: ' is doubled; control characters (a newline would end the command) become spaces.
std::string gnuplot_string(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') out += "''";
    else out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  }
  return out + "'";
}

// Runs gnuplot on `script`; its stderr goes to `log`. Returns the exit status (127: not installed).
int run_gnuplot(const fs::path& script, const fs::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  std::string program = "gnuplot", file = script.string();
  char* argv[] = {program.data(), file.data(), nullptr};
  pid_t pid = -1;
  int spawned = posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return 127;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      throw Error("xlr8 plot: gnuplot did not finish within 120 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// About four labelled tics on the value axis however short the panel (gnuplot's own choice crowds
// short panels): a round step, 1, 2 or 5 times a power of ten.
std::string tic_step(const Series& series) {
  double low = series.front().second, high = low;
  for (const auto& [step, value] : series) low = std::min(low, value), high = std::max(high, value);
  if (!(high > low)) return fmt::format("({:g})", low);  // constant: one tic, at its value
  const double raw = (high - low) / 4;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / power <= 1 ? power : raw / power <= 2 ? 2 * power : raw / power <= 5 ? 5 * power : 10 * power;
  return fmt::format("{:g}", step);
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// --size's WIDTH,HEIGHT in pixels.
std::pair<int, int> parse_size(const std::string& text) {
  int width = 0, height = 0;
  char comma = 0;
  std::istringstream size(text);
  if (!(size >> width >> comma >> height) || comma != ',' || width < 100 || height < 100 || width > 20000 ||
      height > 20000)
    throw ConfigError(fmt::format("--size {:?} is not WIDTH,HEIGHT in pixels (each 100 to 20000), e.g. 1200,800", text));
  return {width, height};
}

std::vector<std::string> split_keys(const std::string& text) {
  std::vector<std::string> chosen;
  std::istringstream keys(text);
  for (std::string key; std::getline(keys, key, ',');)
    if (!key.empty()) chosen.push_back(key);
  return chosen;
}

// One panel per key, two columns when there are several, written to `output` by gnuplot.
void draw(const Scalars& scalars, const std::vector<std::string>& keys, const fs::path& output,
          std::pair<int, int> size) {
  const ScratchDir work("plot");
  fs::create_directories(work.path());
  const int columns = keys.size() > 1 ? 2 : 1;
  const int rows = static_cast<int>((keys.size() + columns - 1) / columns);
  std::string plots;
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto data = work.path() / fmt::format("series{}.dat", i);
    std::ofstream out(data);
    const auto& series = scalars.series.at(keys[i]);
    for (const auto& [step, value] : series) out << fmt::format("{} {}\n", step, value);
    plots += fmt::format("set title {}\nset ytics {}\nplot {} using 1:2 with {} lw 2 pt 7 lc rgb '#1f77b4'\n",
                         gnuplot_string(keys[i]), tic_step(series), gnuplot_string(data.string()),
                         series.size() == 1 ? "points" : "lines");
  }
  const std::string run_name = fs::path(scalars.source).parent_path().filename().string();
  auto script_for = [&](const std::string& terminal) {
    return fmt::format(
        "set terminal {} size {},{} noenhanced\nset output {}\nset multiplot layout {},{} title {}\nset grid\n"
        "set key off\nset xlabel 'step'\nset format y '%g'\n{}unset multiplot\n",
        terminal, size.first, size.second, gnuplot_string(fs::absolute(output).string()), rows, columns,
        gnuplot_string(run_name), plots);
  };
  const auto script = work.path() / "curves.gp", log = work.path() / "gnuplot.log";
  std::ofstream(script) << script_for("pngcairo");
  int status = run_gnuplot(script, log);
  if (status != 0 && read_text(log).find("unknown or ambiguous terminal") != std::string::npos) {
    std::ofstream(script) << script_for("png");  // a gnuplot built without cairo: libgd's PNG
    status = run_gnuplot(script, log);
  }
  if (status == 127) throw Error("xlr8 plot needs gnuplot: install Debian's gnuplot-nox (apt-get install gnuplot-nox)");
  if (status != 0) throw Error(fmt::format("xlr8 plot: gnuplot failed (exit {}): {}", status, read_text(log)));
}

}  // namespace

Handler add_plot(CLI::App& app) {
  auto* cmd = app.add_subcommand("plot", "Draw a run's logged scalars (loss, learning rate, throughput) to a PNG");
  struct Args {
    std::string run, output, size = "1200,800", keys;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("run", a->run,
                  "A run directory (<project_dir>/<project>/<run>), its metrics.jsonl / metrics.csv / TensorBoard event "
                  "file, or a project_dir or project (its newest run)")
      ->required();
  cmd->add_option("-o,--output", a->output, "The PNG to write (default: curves.png in the run directory)");
  cmd->add_option("--size", a->size, "Width,height in pixels");
  cmd->add_option("--keys", a->keys, "Comma-separated scalars to draw (default: all; losses first)");
  return [a]() {
    const auto size = parse_size(a->size);
    const auto scalars = read_run(a->run);
    const auto chosen = split_keys(a->keys);
    if (scalars.series.empty())
      throw ConfigError(fmt::format("xlr8 plot: {} holds no numeric scalars to draw", scalars.source));
    const auto keys = panel_order(scalars, chosen);
    const fs::path run_dir = fs::path(scalars.source).parent_path();  // the run drawn, also when a->run is a project
    const fs::path output = a->output.empty() ? run_dir / "curves.png" : fs::path(a->output);
    draw(scalars, keys, output, size);
    size_t points = 0;
    std::string names;
    for (const auto& k : keys) {
      points = std::max(points, scalars.series.at(k).size());
      names += (names.empty() ? "" : ", ") + k;
    }
    fmt::print("xlr8 plot: wrote {} ({}x{}; {}; up to {} points each) from {}\n", output.string(), size.first,
               size.second, names, points, scalars.source);
    return 0;
  };
}

}  // namespace xlr8::cli
