// Stand-in for CUDA's cuda_runtime.h on the CPU backend: everything a kernel
// may use is already declared by the force-included cupaged_shim.h.
#pragma once
#include "cupaged_shim.h"
