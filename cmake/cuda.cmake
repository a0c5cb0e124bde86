# The CUDA parts (src/cuda, docs/cuda.md): CTXPAR_CUDA=AUTO builds them where nvcc is found
# (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin), ON insists, OFF leaves them out. What runs on a
# CPU (the tile math, tests/cuda) is built either way.
set(CTXPAR_CUDA AUTO CACHE STRING "Build the CUDA parts: AUTO (where nvcc is found), ON, OFF")
set_property(CACHE CTXPAR_CUDA PROPERTY STRINGS AUTO ON OFF)
if(NOT CTXPAR_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "CTXPAR_CUDA='${CTXPAR_CUDA}': use AUTO, ON or OFF")
endif()
set(CTXPAR_HAVE_CUDA OFF)
if(NOT CTXPAR_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    set(CTXPAR_CUDA_SEARCH /usr/local/cuda/bin CACHE STRING
      "Where else to look for nvcc, after PATH, $CUDA_HOME/bin and $CUDA_PATH/bin")
    find_program(CTXPAR_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH PATH_SUFFIXES bin
      PATHS ${CTXPAR_CUDA_SEARCH})
    if(CTXPAR_NVCC AND EXISTS ${CTXPAR_NVCC})
      set(CMAKE_CUDA_COMPILER ${CTXPAR_NVCC})
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CTXPAR_HAVE_CUDA ON)
  elseif(CTXPAR_CUDA STREQUAL "ON")
    message(FATAL_ERROR "CTXPAR_CUDA=ON but no nvcc was found (PATH, $CUDA_HOME/bin, "
      "$CUDA_PATH/bin, ${CTXPAR_CUDA_SEARCH}): install the CUDA toolkit, set "
      "CMAKE_CUDA_COMPILER, or configure with -DCTXPAR_CUDA=OFF")
  endif()
endif()
if(CTXPAR_HAVE_CUDA)
  # Hopper with its arch-specific features (sm_90a), plus PTX for later GPUs to JIT.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90a-real 90-virtual)
  endif()
  if(CMAKE_CXX_COMPILER_LAUNCHER AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
    set(CMAKE_CUDA_COMPILER_LAUNCHER ${CMAKE_CXX_COMPILER_LAUNCHER})
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  add_subdirectory(src/cuda)
  # make_device(cuda) reaches the runtime through ctxpar_cuda (api_real.cc).
  target_link_libraries(ctxpar_device PRIVATE $<BUILD_INTERFACE:ctxpar_cuda>)
else()
  target_sources(ctxpar_device PRIVATE ${PROJECT_SOURCE_DIR}/src/cuda/api_none.cc)
endif()
message(STATUS "ctxpar: CTXPAR_CUDA=${CTXPAR_CUDA}: CUDA parts ${CTXPAR_HAVE_CUDA}")
