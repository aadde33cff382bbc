# CMake toolchain: aarch64 Linux (Kunpeng hosts of Ascend servers) from an x86_64 Debian host,
# with Debian's cross compilers (gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu and their sysroot
# libc6-dev-arm64-cross in /usr/aarch64-linux-gnu) and qemu user emulation (qemu-user-static) to
# run the target's programs: ctest runs the C tests under it, and cargo its tests (CMakeLists.txt).
# scripts/test_aarch64.sh installs all of it and uses this file.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64-static -L /usr/aarch64-linux-gnu)
set(FSDPTURBO_RUST_TARGET aarch64-unknown-linux-gnu CACHE STRING "Rust target triple of this toolchain")
