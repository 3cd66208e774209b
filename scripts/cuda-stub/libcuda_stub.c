/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1) on a machine without a GPU.
 *
 * PyPI ships only the CUDA build of sgl-kernel; importing it (which SGLang does even with
 * SGLANG_USE_CPU_ENGINE=1) loads libcuda.so.1. Every entry point here answers
 * CUDA_ERROR_NO_DEVICE (100), so CUDA-aware code sees "no GPU" and the CPU engine runs.
 *
 * Build: gcc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 libcuda_stub.c
 * Use it for the SGLang server only (LD_LIBRARY_PATH=<its folder>).
 */
#include <stddef.h>

typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

#define NO_DEVICE(name) \
    CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuInit)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetName)
NO_DEVICE(cuDeviceTotalMem)
NO_DEVICE(cuDeviceTotalMem_v2)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuPointerGetAttribute)

/* The version query must fail too, or callers trust the (missing) driver. */
CUresult cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, unsigned long long flags) {
    (void)symbol; (void)cudaVersion; (void)flags;
    if (pfn) *pfn = NULL;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, unsigned long long flags,
                             void *symbolStatus) {
    (void)symbolStatus;
    return cuGetProcAddress(symbol, pfn, cudaVersion, flags);
}

/* Callers print these strings, so they must point somewhere valid. */
CUresult cuGetErrorString(CUresult error, const char **str) {
    (void)error;
    if (str) *str = "no CUDA-capable device is detected (libcuda stub)";
    return 0;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
    (void)error;
    if (str) *str = "CUDA_ERROR_NO_DEVICE";
    return 0;
}
