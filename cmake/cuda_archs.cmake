# Chooses the CUDA architectures to compile for.
#   1. TORCH_CUDA_ARCH_LIST from the environment ("7.0;8.0" or "7.0 8.0+PTX"), else
#   2. the GPUs visible to torch at build time, else
#   3. a default covering V100, T4, A100, A10/3090, H100.
# CUDA >= 13 cannot target sm_70: it is dropped with a warning (build V100 wheels with CUDA <= 12.9).
function(flashv100_select_cuda_archs out_var)
  if(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    set(requested "$ENV{TORCH_CUDA_ARCH_LIST}")
    set(source "TORCH_CUDA_ARCH_LIST")
  else()
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import torch; print(';'.join(sorted({'%d.%d' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})) if torch.cuda.is_available() else '', end='')"
      OUTPUT_VARIABLE requested ERROR_QUIET)
    set(source "visible GPUs")
    if(requested STREQUAL "")
      set(requested "7.0;7.5;8.0;8.6;9.0+PTX")
      set(source "default")
    endif()
  endif()
  string(REPLACE " " ";" requested "${requested}")
  set(torch_list "")
  set(cmake_list "")
  foreach(arch IN LISTS requested)
    string(REGEX MATCH "^([0-9]+)\\.([0-9]+)" _ "${arch}")
    if(NOT CMAKE_MATCH_1)
      message(FATAL_ERROR "torch-flash-v100: cannot parse CUDA arch '${arch}' from ${source}")
    endif()
    set(number "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    if(number LESS 70)
      message(WARNING "torch-flash-v100: sm_${number} has no tensor cores we use; skipped")
      continue()
    endif()
    if(number EQUAL 70 AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 13.0)
      message(WARNING
        "torch-flash-v100: CUDA ${CMAKE_CUDA_COMPILER_VERSION} cannot target sm_70 (V100); sm_70 is "
        "dropped from this build. Build with CUDA 11.8-12.9 for V100.")
      continue()
    endif()
    list(APPEND torch_list "${arch}")
    list(APPEND cmake_list "${number}")
  endforeach()
  if(cmake_list STREQUAL "")
    message(FATAL_ERROR "torch-flash-v100: no buildable CUDA arch left from ${source} (${requested})")
  endif()
  message(STATUS "torch-flash-v100: CUDA archs from ${source}: ${torch_list}")
  set(FLASHV100_TORCH_ARCH_LIST "${torch_list}" PARENT_SCOPE)
  set(${out_var} "${cmake_list}" PARENT_SCOPE)
endfunction()
