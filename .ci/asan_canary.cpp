// Proof that the sanitizer build catches what it is for: this writes one element past a heap buffer. Built with
// the flags of fastagg._C_asan and run under the same preload, it must be stopped by AddressSanitizer; if it runs
// to the end, the sanitizer job is not checking anything (.ci/asan.sh fails then).
#include <cstdio>
#include <vector>

int main(int argc, char**) {
  std::vector<float> mean(8);
  float* p = mean.data();
  p[8 + argc - 1] = 1.0f;  // one past the end (argc = 1)
  std::printf("not caught\n");
  return 0;
}
