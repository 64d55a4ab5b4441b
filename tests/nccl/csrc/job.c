/*
 * A multi-rank NCCL job for spotguard's CPU tests (built against tests/nccl/include/nccl.h and
 * linked to the fake libnccl.so.2 / libcuda.so.1, as PyTorch links NCCL: the shim comes first
 * through LD_PRELOAD). The parent forks NRANKS ranks; each makes a world communicator and a
 * split of it (even and odd ranks), and at every step all-reduces on both and all-gathers the
 * halves' sums; rank 0 prints every value (exact hex floats), the communicators' sizes, ranks
 * and CUDA devices as the application sees them. A second thread asks NCCL for errors all
 * the time, as PyTorch's watchdog does.
 *
 *   nccl_job NRANKS STEPS STEP_MS [--register] [--capture] [--window] [--devcomm]
 *                                 [--memalloc] [--only-rank R | --skip-rank R]
 *
 * --register: rank 0 registers a buffer with ncclCommRegister and keeps it.
 * --capture: rank 0 issues its first all-reduce on a stream being captured (fake CUDA).
 * --window: rank 0 registers a window (ncclCommWindowRegister) and keeps it.
 * --devcomm: rank 0 creates a device communicator (ncclDevCommCreate) and keeps it.
 * --memalloc: rank 0 allocates a buffer with ncclMemAlloc and keeps it.
 * --only-rank R / --skip-rank R: this process runs rank R only / every rank but R; the
 *   ranks meet through the id directory named by $NCCL_JOB_ID (two processes, one world).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

int cuDevicePrimaryCtxRetain(void **ctx, int dev);
int cuCtxSetCurrent(void *ctx);
/* NCCL's device API (nccl_device.h, not in the test nccl.h): opaque here */
ncclResult_t ncclDevCommCreate(ncclComm_t comm, const void *reqs, void *outDevComm);
ncclResult_t ncclDevCommDestroy(ncclComm_t comm, const void *devComm);

enum { REG = 1, CAPTURE = 2, WINDOW = 4, DEVCOMM = 8, MEMALLOC = 16 };

#define CHECK(call)                                                                           \
  do {                                                                                        \
    ncclResult_t rc_ = (call);                                                                \
    if (rc_ != ncclSuccess) {                                                                 \
      fprintf(stderr, "rank %d: %s failed: %d\n", rank, #call, rc_);                        \
      exit(3);                                                                                \
    }                                                                                         \
  } while (0)

static ncclComm_t world, half;
static volatile int stop;

static void *watchdog(void *arg) {
  (void)arg;
  struct timespec ts = {0, 2000000};
  while (!stop) {
    ncclResult_t e1 = ncclSuccess, e2 = ncclSuccess;
    int n = 0;
    if (ncclCommGetAsyncError(world, &e1) != ncclSuccess || e1 != ncclSuccess ||
        ncclCommGetAsyncError(half, &e2) != ncclSuccess || e2 != ncclSuccess ||
        ncclCommCount(world, &n) != ncclSuccess || n < 1) {
      fprintf(stderr, "watchdog: communicator error\n");
      exit(4);
    }
    nanosleep(&ts, NULL);
  }
  return NULL;
}

static int run_rank(int rank, int nranks, ncclUniqueId id, int steps, int step_ms, int flags) {
  int reg = flags & REG, capture = flags & CAPTURE;
  char env[16];
  void *ctx;
  snprintf(env, sizeof env, "%d", rank);
  setenv("FAKE_NCCL_RANK", env, 1);
  cuDevicePrimaryCtxRetain(&ctx, rank + 2);
  cuCtxSetCurrent(ctx);
  CHECK(ncclCommInitRank(&world, nranks, id, rank));
  CHECK(ncclCommSplit(world, rank % 2, rank, &half, NULL));
  void *handle = NULL;
  if (reg && rank == 0)
    CHECK(ncclCommRegister(world, env, sizeof env, &handle));
  ncclWindow_t win = NULL;
  if ((flags & WINDOW) && rank == 0)
    CHECK(ncclCommWindowRegister(world, env, sizeof env, &win, 0));
  char devcomm[64];
  if ((flags & DEVCOMM) && rank == 0)
    CHECK(ncclDevCommCreate(world, NULL, devcomm));
  void *mem = NULL;
  if ((flags & MEMALLOC) && rank == 0)
    CHECK(ncclMemAlloc(&mem, 64));
  pthread_t wd;
  pthread_create(&wd, NULL, watchdog, NULL);
  for (int step = 0; step < steps; step++) {
    double x[3] = {rank + 1.0, step * 0.25 + rank, 1.0 / (step + rank + 1.0)};
    double w[3], h[3], halves[64];
    int64_t count = step;
    cudaStream_t stream = (capture && rank == 0 && step == 0) ? (cudaStream_t)0x5EC : NULL;
    CHECK(ncclAllReduce(x, w, 3, ncclFloat64, ncclSum, world, stream));
    CHECK(ncclAllReduce(x, h, 3, ncclFloat64, ncclSum, half, NULL));
    CHECK(ncclAllReduce(&count, &count, 1, ncclInt64, ncclSum, world, NULL));
    CHECK(ncclAllGather(&h[2], halves, 1, ncclFloat64, world, NULL));
    if (rank == 0) {
      int wn, wr, wd_, hn, hr, hd;
      CHECK(ncclCommCount(world, &wn));
      CHECK(ncclCommUserRank(world, &wr));
      CHECK(ncclCommCuDevice(world, &wd_));
      CHECK(ncclCommCount(half, &hn));
      CHECK(ncclCommUserRank(half, &hr));
      CHECK(ncclCommCuDevice(half, &hd));
      printf("step %d world %a %a %a half %a %a %a count %lld comms %d/%d@%d %d/%d@%d halves",
             step, w[0], w[1], w[2], h[0], h[1], h[2], (long long)count, wr, wn, wd_, hr, hn,
             hd);
      for (int r = 0; r < nranks && r < 64; r++)
        printf(" %a", halves[r]);
      printf("\n");
      fflush(stdout);
    }
    struct timespec ts = {step_ms / 1000, (step_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  stop = 1;
  pthread_join(wd, NULL);
  if (handle)
    CHECK(ncclCommDeregister(world, handle));
  if (win)
    CHECK(ncclCommWindowDeregister(world, win));
  if ((flags & DEVCOMM) && rank == 0)
    CHECK(ncclDevCommDestroy(world, devcomm));
  if (mem)
    CHECK(ncclMemFree(mem));
  CHECK(ncclCommDestroy(half));
  CHECK(ncclCommDestroy(world));
  if (rank == 0) {
    printf("done\n");
    fflush(stdout); /* the rank ends with _exit */
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: nccl_job NRANKS STEPS STEP_MS [--register] [--capture] "
                    "[--window] [--devcomm] [--memalloc] [--only-rank R | --skip-rank R]\n");
    return 2;
  }
  int nranks = atoi(argv[1]), steps = atoi(argv[2]), step_ms = atoi(argv[3]);
  int flags = 0, rank = -1, only = -1, skip = -1;
  for (int i = 4; i < argc; i++) {
    flags |= !strcmp(argv[i], "--register") ? REG : 0;
    flags |= !strcmp(argv[i], "--capture") ? CAPTURE : 0;
    flags |= !strcmp(argv[i], "--window") ? WINDOW : 0;
    flags |= !strcmp(argv[i], "--devcomm") ? DEVCOMM : 0;
    flags |= !strcmp(argv[i], "--memalloc") ? MEMALLOC : 0;
    if (!strcmp(argv[i], "--only-rank") && i + 1 < argc)
      only = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--skip-rank") && i + 1 < argc)
      skip = atoi(argv[++i]);
  }
  ncclUniqueId id;
  const char *shared = getenv("NCCL_JOB_ID");
  if (shared) {
    memset(&id, 0, sizeof id);
    snprintf(id.internal, sizeof id.internal, "%s", shared);
  } else {
    CHECK(ncclGetUniqueId(&id));
  }
  pid_t pids[64];
  for (int r = 0; r < nranks && r < 64; r++) {
    pids[r] = -1;
    if ((only >= 0 && r != only) || r == skip)
      continue;
    pids[r] = fork();
    if (pids[r] == 0)
      _exit(run_rank(r, nranks, id, steps, step_ms, flags));
  }
  int bad = 0;
  for (int r = 0; r < nranks && r < 64; r++) {
    int st;
    if (pids[r] < 0)
      continue;
    if (waitpid(pids[r], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
      bad = 1;
  }
  return bad;
}
