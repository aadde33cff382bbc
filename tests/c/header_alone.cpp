// The generated header compiles on its own as C++ (pedantic, warnings as errors) and is
// usable twice in one translation unit.
#include "fsdpturbo.h"
#include "fsdpturbo.h"

int main() { return fsdpturbo_abi_version() == FSDPTURBO_ABI_VERSION ? 0 : 1; }
