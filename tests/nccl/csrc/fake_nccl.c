/*
 * A test double of NCCL (libnccl.so.2) for spotguard's CPU tests: real communicators between
 * real processes, on the CPU, through files.
 *
 * ncclGetUniqueId makes a directory (under $FAKE_NCCL_DIR, default /tmp) and puts its path in
 * the id. ncclCommInitRank waits until every rank has joined that directory, so ranks that do
 * not create a communicator together hang there, as with NCCL. Every collective is a
 * rendezvous: each rank writes its buffer to <dir>/<op>.r<rank> and waits for every other
 * rank's (host-blocking, so a rank held back leaves its peers waiting inside the call). Split
 * exchanges (color, key) the same way and gives each color a directory of its own.
 *
 * Holding an operation in flight: while the file $FAKE_NCCL_HOLD exists, the process whose
 * $FAKE_NCCL_RANK equals $FAKE_NCCL_HOLD_RANK stays inside its next collective. With
 * $FAKE_NCCL_HOLD_AFTER=N it stays inside only after its part of the next collective of N
 * bytes on a communicator of more than one rank is done (its peers go on past it).
 *
 * Every call that creates or ends a communicator is appended to $FAKE_NCCL_LOG
 * ("<pid> <call> <rank>/<nranks> dev <d> <dir>"). CPU only; the data types are the 32 and
 * 64 bit integers and floats; the only reduction is the sum.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

int cuCtxGetDevice(int *dev);

struct ncclComm {
  char dir[200];
  int rank, nranks, dev;
  uint64_t seq;
};

static void flog(const struct ncclComm *c, const char *what) {
  const char *path = getenv("FAKE_NCCL_LOG");
  if (!path)
    return;
  char line[512];
  int n = snprintf(line, sizeof line, "%d %s %d/%d dev %d %s\n", (int)getpid(), what, c->rank,
                   c->nranks, c->dev, c->dir);
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) {
    if (write(fd, line, (size_t)n) < 0) {
    }
    close(fd);
  }
}

static void pause_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* after: 0 before the exchange, else the bytes of the exchange that has just ended */
static void held(size_t after, int nranks) {
  const char *hold = getenv("FAKE_NCCL_HOLD"), *who = getenv("FAKE_NCCL_HOLD_RANK");
  const char *me = getenv("FAKE_NCCL_RANK"), *when = getenv("FAKE_NCCL_HOLD_AFTER");
  if (!hold || !who || !me || strcmp(who, me))
    return;
  if (when ? (after == 0 || nranks < 2 || (size_t)atoll(when) != after) : after != 0)
    return;
  while (exists(hold))
    pause_us(1000);
}

static int put(const char *dir, const char *tag, int rank, const void *data, size_t n) {
  char tmp[300], path[300];
  snprintf(tmp, sizeof tmp, "%s/.%s.r%d.tmp", dir, tag, rank);
  snprintf(path, sizeof path, "%s/%s.r%d", dir, tag, rank);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return -1;
  ssize_t w = write(fd, data, n);
  close(fd);
  return w == (ssize_t)n ? rename(tmp, path) : -1;
}

/* Wait for every rank's <tag>.r<i> and read it into out + i * n. */
static int gather(const char *dir, const char *tag, int nranks, void *out, size_t n) {
  char path[300];
  for (int i = 0; i < nranks; i++) {
    snprintf(path, sizeof path, "%s/%s.r%d", dir, tag, i);
    for (int waited = 0; !exists(path); waited++) {
      if (waited > 600000) /* 10 minutes */
        return -1;
      pause_us(1000);
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return -1;
    ssize_t r = read(fd, (char *)out + (size_t)i * n, n);
    close(fd);
    if (r != (ssize_t)n)
      return -1;
  }
  return 0;
}

static void forget_op(const struct ncclComm *c, uint64_t seq) {
  char path[300];
  snprintf(path, sizeof path, "%s/op%llu.r%d", c->dir, (unsigned long long)seq, c->rank);
  unlink(path);
}

static size_t width(ncclDataType_t t) {
  switch (t) {
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 1;
  }
}

ncclResult_t ncclGetVersion(int *version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result) {
  return result == ncclSuccess ? "no error" : "fake NCCL error";
}

const char *ncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return "";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  const char *root = getenv("FAKE_NCCL_DIR");
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "%s/fakenccl-XXXXXX", root ? root : "/tmp");
  return mkdtemp(id->internal) ? ncclSuccess : ncclSystemError;
}

static ncclResult_t join(struct ncclComm *c) {
  char tag[8] = "join";
  int *all = calloc((size_t)c->nranks, sizeof(int));
  int ok = all && put(c->dir, tag, c->rank, &c->rank, sizeof c->rank) == 0 &&
           gather(c->dir, tag, c->nranks, all, sizeof(int)) == 0;
  free(all);
  return ok ? ncclSuccess : ncclSystemError;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  (void)config;
  struct ncclComm *c = calloc(1, sizeof *c);
  if (!c || nranks < 1 || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  snprintf(c->dir, sizeof c->dir, "%s", commId.internal);
  c->rank = rank;
  c->nranks = nranks;
  if (cuCtxGetDevice(&c->dev) != 0)
    c->dev = -1;
  ncclResult_t rc = join(c);
  flog(c, rc == ncclSuccess ? "init" : "init-failed");
  *comm = c;
  return rc;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return ncclCommInitRankConfig(comm, nranks, commId, rank, NULL);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
  (void)config;
  char tag[32];
  int mine[3] = {color, key, comm->rank};
  int *all = calloc((size_t)comm->nranks * 3, sizeof(int));
  snprintf(tag, sizeof tag, "op%llu", (unsigned long long)comm->seq);
  if (!all || put(comm->dir, tag, comm->rank, mine, sizeof mine) ||
      gather(comm->dir, tag, comm->nranks, all, sizeof mine)) {
    free(all);
    return ncclSystemError;
  }
  if (comm->seq >= 2)
    forget_op(comm, comm->seq - 2);
  uint64_t seq = comm->seq++;
  *newcomm = NULL;
  if (color == NCCL_SPLIT_NOCOLOR) {
    free(all);
    return ncclSuccess;
  }
  struct ncclComm *c = calloc(1, sizeof *c);
  for (int i = 0; i < comm->nranks; i++) {
    if (all[3 * i] != color)
      continue;
    c->nranks++;
    if (all[3 * i + 1] < key || (all[3 * i + 1] == key && i < comm->rank))
      c->rank++;
  }
  free(all);
  snprintf(c->dir, sizeof c->dir, "%s/split%llu.c%d", comm->dir, (unsigned long long)seq, color);
  if (mkdir(c->dir, 0755) != 0 && errno != EEXIST)
    return ncclSystemError;
  c->dev = comm->dev;
  ncclResult_t rc = join(c);
  flog(c, "split");
  *newcomm = c;
  return rc;
}

/* Real NCCL ends finalize and destroy by making the caller's device current again, and the
 * runtime creates a context on device 0 for a thread that had none: called from any device
 * but the communicator's own, this costs a context on another GPU. Logged as such. */
static void check_device(const struct ncclComm *c) {
  int cur = -1;
  if (cuCtxGetDevice(&cur) != 0 || cur != c->dev)
    flog(c, "wrong-device");
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  check_device(comm);
  flog(comm, "finalize");
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  check_device(comm);
  flog(comm, "destroy");
  free(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  flog(comm, "abort");
  free(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  (void)comm;
  *asyncError = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  *device = comm->dev;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  (void)comm, (void)buff, (void)size;
  *handle = malloc(1);
  return ncclSuccess;
}

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle) {
  (void)comm;
  free(handle);
  return ncclSuccess;
}

ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win,
                                    int winFlags) {
  (void)comm, (void)buff, (void)size, (void)winFlags;
  *win = malloc(1);
  return *win ? ncclSuccess : ncclSystemError;
}

ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  (void)comm;
  free(win);
  return ncclSuccess;
}

/* NCCL's device API, host side (nccl_device.h): the requirements and the device
 * communicator are opaque here; the fake only says it made one. */
ncclResult_t ncclDevCommCreate(ncclComm_t comm, const void *reqs, void *outDevComm) {
  (void)comm, (void)reqs;
  memset(outDevComm, 0, 8);
  return ncclSuccess;
}

ncclResult_t ncclDevCommDestroy(ncclComm_t comm, const void *devComm) {
  (void)comm, (void)devComm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }

ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
  *ptr = malloc(size);
  return *ptr ? ncclSuccess : ncclSystemError;
}

ncclResult_t ncclMemFree(void *ptr) {
  free(ptr);
  return ncclSuccess;
}

/* one collective: exchange n bytes per rank, then combine */
static ncclResult_t exchange(ncclComm_t comm, const void *mine, size_t n, void *all) {
  char tag[32];
  held(0, comm->nranks);
  snprintf(tag, sizeof tag, "op%llu", (unsigned long long)comm->seq);
  if (put(comm->dir, tag, comm->rank, mine, n) || gather(comm->dir, tag, comm->nranks, all, n))
    return ncclSystemError;
  if (comm->seq >= 2)
    forget_op(comm, comm->seq - 2);
  comm->seq++;
  held(n, comm->nranks);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  (void)stream;
  size_t w = width(datatype), n = count * w;
  if (op != ncclSum || w == 1)
    return ncclInvalidArgument;
  char *all = malloc(n * (size_t)comm->nranks);
  ncclResult_t rc = all ? exchange(comm, sendbuff, n, all) : ncclSystemError;
  for (size_t i = 0; rc == ncclSuccess && i < count; i++) {
    double d = 0;
    int64_t s = 0;
    for (int r = 0; r < comm->nranks; r++) {
      const char *p = all + (size_t)r * n + i * w;
      if (datatype == ncclFloat64)
        d += *(const double *)p;
      else if (datatype == ncclFloat32)
        d += *(const float *)p;
      else if (w == 8)
        s += *(const int64_t *)p;
      else
        s += *(const int32_t *)p;
    }
    char *q = (char *)recvbuff + i * w;
    if (datatype == ncclFloat64)
      *(double *)q = d;
    else if (datatype == ncclFloat32)
      *(float *)q = (float)d;
    else if (w == 8)
      *(int64_t *)q = s;
    else
      *(int32_t *)q = (int32_t)s;
  }
  free(all);
  return rc;
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return exchange(comm, sendbuff, sendcount * width(datatype), recvbuff);
}
