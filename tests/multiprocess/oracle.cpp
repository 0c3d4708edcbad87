#include "oracle.hpp"

#include <gtest/gtest.h>

#include "xlr8/safetensors.hpp"

nlohmann::json last_json(const std::string& out) {
  auto end = out.rfind('}');
  auto start = out.rfind('{', end);
  // The line may be prefixed with "[rank0]: "; the JSON object itself may nest braces only in arrays.
  auto line_start = out.rfind('\n', start);
  auto text = out.substr(line_start == std::string::npos ? 0 : line_start + 1);
  text = text.substr(text.find('{'));
  text = text.substr(0, text.rfind('}') + 1);
  return nlohmann::json::parse(text);
}

std::map<std::string, at::Tensor> params(const std::string& dir) {
  auto content = xlr8::load_safetensors(dir + "/model/model.safetensors");
  return {content.tensors.begin(), content.tensors.end()};
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tolerance) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tolerance * (1 + std::abs(b[i]))) << "step " << i;
}

void expect_same_params(const std::string& a, const std::string& b, double tolerance) {
  auto pa = params(a), pb = params(b);
  ASSERT_EQ(pa.size(), pb.size());
  for (auto& [name, t] : pa) {
    ASSERT_TRUE(pb.count(name)) << name;
    double diff = (t - pb[name]).abs().max().item<double>();
    EXPECT_LE(diff, tolerance) << name;
  }
}

Run oracle_command(const std::vector<std::string>& command, const std::string& dir, double timeout_s,
                   const std::map<std::string, std::string>& env) {
  Run r{dir, {}, {}};
  auto result = run(command, timeout_s, env);
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  if (result.exit_code == 0) {
    r.result = last_json(result.out);
    r.losses = r.result["losses"].get<std::vector<double>>();
  }
  return r;
}
