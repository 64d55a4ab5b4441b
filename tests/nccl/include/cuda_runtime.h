/* Test stand-in for the CUDA runtime header: the one type nccl.h uses (CPU tests only). */
#ifndef SG_TEST_CUDA_RUNTIME_H
#define SG_TEST_CUDA_RUNTIME_H
typedef struct CUstream_st *cudaStream_t;
#endif
