#include <cstdio>
#include <cstring>

#include <fsdpturbo.h>

int main() {
  std::printf("libfsdpturbo %s (ABI %u)\n", fsdpturbo_version(), fsdpturbo_abi_version());
  return fsdpturbo_abi_version() == FSDPTURBO_ABI_VERSION && std::strlen(fsdpturbo_version()) > 0 ? 0 : 1;
}
