/* The generated header compiles on its own (C11, pedantic, warnings as errors). */
#include "fsdpturbo.h"

int main(void) { return fsdpturbo_abi_version() == FSDPTURBO_ABI_VERSION ? 0 : 1; }
