# ctest driver: installs the build tree into a scratch prefix, builds this example against it
# with find_package and the build tree's TOOLCHAIN_FILE, and runs it with ARGS (under EMULATOR
# when cross-compiling; both may be empty). Exit code 77 (no GPU for the NCCL mode) is passed on
# for ctest's SKIP_RETURN_CODE.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_TOOLCHAIN_FILE=${TOOLCHAIN_FILE}
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring cpp_trainer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building cpp_trainer failed: ${rc}")
endif()
separate_arguments(args UNIX_COMMAND "${ARGS}")
separate_arguments(emulator UNIX_COMMAND "${EMULATOR}")
execute_process(COMMAND ${emulator} ${WORK_DIR}/build/cpp_trainer ${args} RESULT_VARIABLE rc)
if(rc EQUAL 77)
  message("cpp_trainer: skipped (exit 77)")
  # cmake -P cannot exit with a chosen code; the SKIP_REGULAR_EXPRESSION of the test catches this.
elseif(rc)
  message(FATAL_ERROR "cpp_trainer failed: ${rc}")
endif()
