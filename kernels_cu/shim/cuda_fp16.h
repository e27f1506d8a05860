// Stand-in for CUDA's cuda_fp16.h on the CPU backend: the types and functions
// come from cupaged_fp16.hpp (already force-included through cupaged_shim.h).
#pragma once
#include "cupaged_fp16.hpp"
