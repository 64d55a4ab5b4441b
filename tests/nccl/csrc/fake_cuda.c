/*
 * A test double of the CUDA driver (libcuda.so.1) for spotguard's CPU tests: just the four
 * calls the NCCL shim makes. A "context" is its device number + 1, current per thread (none
 * in a new thread); the
 * stream (cudaStream_t)0x5EC is always being captured into a graph.
 */
#include <stdint.h>

#define CAPTURING_STREAM ((const void *)0x5EC)

static __thread int current = -1; /* a new thread has no current context */

int cuCtxGetDevice(int *dev) {
  if (current < 0)
    return 201; /* CUDA_ERROR_INVALID_CONTEXT */
  *dev = current;
  return 0;
}

int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
  *ctx = (void *)(intptr_t)(dev + 1);
  return 0;
}

int cuCtxSetCurrent(void *ctx) {
  current = (int)(intptr_t)ctx - 1;
  return 0;
}

int cuStreamIsCapturing(const void *stream, int *status) {
  *status = stream == CAPTURING_STREAM;
  return 0;
}
