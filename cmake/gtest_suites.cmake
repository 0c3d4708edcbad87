# Run after a GoogleTest program is linked (tests/CMakeLists.txt): lists its suites and writes CTest one entry
# per suite, `<Suite>.*`, which runs that suite's tests in one process.
#   cmake -D TEST_EXECUTABLE=<program> -D CTEST_FILE=<out.cmake> -D TEST_TIMEOUT=<s> -D TEST_ENVIRONMENT=<K=V>
#         -P gtest_suites.cmake
# A suite is skipped where none of its tests passed ("[  PASSED  ] 0 tests": all skipped, as the GPU-only suites
# are without a GPU); a suite whose tests partly skip passes, its skipped tests named in its output.
execute_process(COMMAND ${TEST_EXECUTABLE} --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status TIMEOUT 60)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "listing the tests of ${TEST_EXECUTABLE} failed (${status}):\n${errors}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(script "")
set(suites 0)
foreach(line IN LISTS lines)
  # Suite lines start in column 0 and end with a dot (typed and parameterised ones add "  # TypeParam = ...").
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.")
    set(name "${CMAKE_MATCH_1}.*")
    string(APPEND script
      "add_test([==[${name}]==] [==[${TEST_EXECUTABLE}]==] [==[--gtest_filter=${name}]==])\n"
      "set_tests_properties([==[${name}]==] PROPERTIES TIMEOUT ${TEST_TIMEOUT} ENVIRONMENT [==[${TEST_ENVIRONMENT}]==]\n"
      "  SKIP_REGULAR_EXPRESSION [==[\\[  PASSED  \\] 0 tests]==])\n")
    math(EXPR suites "${suites} + 1")
  endif()
endforeach()
if(suites EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no test suite:\n${listing}")
endif()
file(WRITE ${CTEST_FILE} "${script}")
