// The test programs' main: gtest's, then the process ends without running static destructors. ctest starts one
// process per test, and LibTorch's destructors (its operator registry) cost each about 0.1 s of CPU for nothing;
// the tests own no static whose destructor matters (their helpers clean up in their scopes).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();
  std::fflush(nullptr);
  std::_Exit(result);
}
