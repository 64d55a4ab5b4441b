/*
 * spotguard NCCL shim: communicators that survive a GPU checkpoint.
 *
 * Why: the NVIDIA driver's checkpoint API (r580) cannot capture what NCCL's fast transports
 * share between processes and GPUs (CUDA IPC / cuMem handles, host memory mapped by another
 * process, NVLink multicast). Instead of turning those transports off, spotguard releases
 * every communicator just before the GPU lock and builds it again after the restore (or the
 * resume), so that nothing the driver cannot capture exists at the instant of the freeze.
 *
 * How: `spotguard run` preloads this library (LD_PRELOAD). It defines every function of the
 * public nccl.h that takes a communicator, so the application's calls reach it first; the
 * application gets handles of ours (struct sg_comm), which stay valid while the real
 * communicator behind them is destroyed and created again. For each communicator it records
 * what a rebuild needs (rank, number of ranks, CUDA device, configuration) and a group key that
 * every member computes alike (a hash of the ncclUniqueId; for a split, of the parent's key,
 * the split's sequence number and the color), and counts the operations issued on it.
 *
 * The agent talks to each process over a unix socket, <SPOTGUARD_NCCL_CTL>/<pid>.sock (a
 * root-only directory `spotguard run` names; the socket is created with the first
 * communicator). One request line per connection, one JSON answer:
 *
 *   state                 the record (per communicator: id, key, rank, nranks, dev, ops, p2p
 *                         counts, what would keep it from being released)
 *   quiesce               close the gate: new calls wait; calls inside NCCL go on
 *   drain MS TARGETS      let calls through until this process has issued as many operations
 *                         as its peers (TARGETS: c<id>=<ops> s<id>.<peer>=<n> r<id>.<peer>=<n>;
 *                         while any is owed every call passes, whatever its communicator),
 *                         then answer the counts and whether no call is left inside NCCL
 *   reopen                open the gate again (a checkpoint that failed before release)
 *   release MS            ncclCommFinalize + ncclCommDestroy every communicator (key order)
 *   uid                   a fresh ncclUniqueId from this process (hex)
 *   rebuild MS ID=UID...  create every communicator again with the recorded rank, size,
 *                         device and configuration (one group), then open the gate
 *
 * Calls that only ask (ncclCommGetAsyncError, ncclCommCount, ncclCommUserRank,
 * ncclCommCuDevice, ncclGetLastError) never wait at the gate: while released they answer from
 * the record. ncclGroupStart ... ncclGroupEnd counts as one call inside NCCL.
 *
 * What cannot be released is recorded and reported (the agent then refuses the checkpoint,
 * naming it): a call on a stream being captured into a CUDA graph, buffers registered with
 * ncclCommRegister, windows, ncclMemAlloc memory, NCCL's device API.
 *
 * NCCL's real functions are found with dlsym(RTLD_NEXT), else in the already loaded
 * libnccl.so.2 (PyTorch loads it without RTLD_GLOBAL); the CUDA driver (libcuda.so.1) the same
 * way. The shim links neither.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "sg_shim.h"

#define SG_MAGIC 0x5350474e43434c31ULL /* "SPGNCCL1" */
#define SG_LINE_MAX (1 << 20)

enum sg_state { ST_OPEN, ST_CLOSED, ST_DRAIN, ST_RELEASED, ST_BROKEN };
static const char *const STATE_NAMES[] = {"open", "closed", "draining", "released", "broken"};

typedef struct sg_comm {
  uint64_t magic;
  int id;
  void *real;              /* NCCL's communicator; NULL while released */
  uint64_t key;            /* the same on every member */
  int rank, nranks, dev;   /* nranks 0: not known yet (asked at the next report) */
  void *config;            /* a copy of the application's ncclConfig_t, or NULL */
  uint64_t splits;         /* splits and shrinks of this communicator so far */
  uint64_t ops, target_ops;
  uint64_t *p2p;           /* [0, nranks): sends to each peer; [nranks, 2 nranks): receives */
  uint64_t *p2p_target;
  int queries;             /* query calls inside NCCL now */
  int captured, registered, windows, devapi;
  struct sg_comm *next;
} sg_comm;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static enum sg_state state = ST_OPEN;
static int inflight;     /* application threads inside NCCL (a group counts once) */
static int draining;     /* targets are set */
static int memalloc_live;
static int next_id = 1;
static sg_comm *comms;
static __thread int depth; /* group (and PreMulSum op) nesting of this thread */
/* this thread is inside one of NCCL's functions that creates communicators: should NCCL call
 * its own public functions through the dynamic linker, they reach NCCL, not the record */
static __thread int in_nccl;

/* --- resolving NCCL and the CUDA driver ------------------------------------------------- */

static void *open_lib(const char *soname) {
  void *h = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
  return h ? h : dlopen(soname, RTLD_LAZY | RTLD_LOCAL);
}

void *sg_resolve(void **slot, const char *name) {
  void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (p)
    return p;
  p = dlsym(RTLD_NEXT, name);
  if (!p) {
    static void *lib;
    char pname[128];
    if (!__atomic_load_n(&lib, __ATOMIC_ACQUIRE))
      __atomic_store_n(&lib, open_lib("libnccl.so.2"), __ATOMIC_RELEASE);
    if (lib) {
      p = dlsym(lib, name);
      snprintf(pname, sizeof pname, "p%s", name);
      if (!p)
        p = dlsym(lib, pname);
    }
  }
  if (p)
    __atomic_store_n(slot, p, __ATOMIC_RELEASE);
  return p;
}

#define REAL(type, name) ((type)sg_resolve(&real_##name, #name))
#define SLOT(name) static void *real_##name

typedef int (*cu_get_dev_t)(int *);
typedef int (*cu_retain_t)(void **, int);
typedef int (*cu_set_ctx_t)(void *);
typedef int (*cu_capturing_t)(const void *, int *);
static struct {
  pthread_once_t once;
  cu_get_dev_t get_device;
  cu_retain_t retain;
  cu_set_ctx_t set_current;
  cu_capturing_t capturing;
} cu = {PTHREAD_ONCE_INIT, NULL, NULL, NULL, NULL};

static void cu_load(void) {
  void *h = open_lib("libcuda.so.1");
  if (!h)
    return;
  cu.get_device = (cu_get_dev_t)dlsym(h, "cuCtxGetDevice");
  cu.retain = (cu_retain_t)dlsym(h, "cuDevicePrimaryCtxRetain");
  cu.set_current = (cu_set_ctx_t)dlsym(h, "cuCtxSetCurrent");
  cu.capturing = (cu_capturing_t)dlsym(h, "cuStreamIsCapturing");
}

static int current_device(void) {
  int dev = -1;
  pthread_once(&cu.once, cu_load);
  if (cu.get_device && cu.get_device(&dev) != 0)
    dev = -1;
  return dev;
}

static void use_device(int dev) {
  void *ctx = NULL;
  pthread_once(&cu.once, cu_load);
  if (dev >= 0 && cu.retain && cu.set_current && cu.retain(&ctx, dev) == 0)
    cu.set_current(ctx);
}

static int stream_capturing(const void *stream) {
  int status = 0;
  pthread_once(&cu.once, cu_load);
  if (!cu.capturing || cu.capturing(stream, &status) != 0)
    return 0;
  return status != 0;
}

/* --- handles, keys and the record -------------------------------------------------------- */

static uint64_t mix(uint64_t h, const void *data, size_t n) {
  const unsigned char *p = data;
  if (!h)
    h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

static sg_comm *ours(const void *handle) {
  sg_comm *c = (sg_comm *)handle;
  return c && c->magic == SG_MAGIC ? c : NULL;
}

static void *copy_config(const ncclConfig_t *config) {
  if (!config)
    return NULL;
  size_t size = config->size > sizeof(ncclConfig_t) ? config->size : sizeof(ncclConfig_t);
  if (size > 4096)
    size = sizeof(ncclConfig_t);
  ncclConfig_t *copy = calloc(1, size);
  if (!copy)
    return NULL;
  memcpy(copy, config, config->size < size ? config->size : size);
  /* strings the application may free: keep our own (leaked with the record, a few bytes) */
  if (config->size >= offsetof(ncclConfig_t, netName) + sizeof(void *) && config->netName)
    copy->netName = strdup(config->netName);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 21, 0)
  if (config->size >= offsetof(ncclConfig_t, commName) + sizeof(void *) && config->commName)
    copy->commName = strdup(config->commName);
#endif
  return copy;
}

static void fill(sg_comm *c);

/* Record a new communicator (called with mu held). */
static sg_comm *record(void *real, uint64_t key, int rank, int nranks, int dev, void *config) {
  sg_comm *c = calloc(1, sizeof *c);
  if (!c)
    return NULL;
  c->magic = SG_MAGIC;
  c->id = next_id++;
  c->real = real;
  c->key = key;
  c->rank = rank;
  c->nranks = nranks;
  c->dev = dev;
  c->config = config;
  c->next = comms;
  comms = c;
  return c;
}

static void forget(sg_comm *c) {
  for (sg_comm **p = &comms; *p; p = &(*p)->next) {
    if (*p == c) {
      *p = c->next;
      break;
    }
  }
  c->magic = 0;
  free(c->p2p);
  free(c->p2p_target);
  free(c);
}

static int p2p_ready(sg_comm *c) {
  if (c->p2p)
    return 1;
  fill(c);
  if (c->nranks <= 0)
    return 0;
  c->p2p = calloc(2 * (size_t)c->nranks, sizeof *c->p2p);
  return c->p2p != NULL;
}

/* --- the gate ---------------------------------------------------------------------------- */

static int owes(const sg_comm *c) {
  if (c->ops < c->target_ops)
    return 1;
  if (c->p2p && c->p2p_target)
    for (int i = 0; i < 2 * c->nranks; i++)
      if (c->p2p[i] < c->p2p_target[i])
        return 1;
  return 0;
}

static int any_owes(void) {
  for (sg_comm *c = comms; c; c = c->next)
    if (owes(c))
      return 1;
  return 0;
}

static int may_pass(sg_comm *c, enum sg_kind kind, int peer) {
  if (state == ST_OPEN || state == ST_BROKEN)
    return 1;
  if (state != ST_DRAIN || !draining)
    return 0;
  (void)c;
  (void)kind;
  (void)peer;
  /* While this process owes anything, every call passes, not only the owed ones: the call
   * it owes may come after calls on other communicators in its program's order (a step's
   * collective on a one-rank or other group first), and holding those would hold it short
   * of what it owes for good while its peers wait inside the owed call. Its peers made the
   * same calls before theirs (same program order), so none of them waits for this one;
   * what it passes beyond a peer's count is levelled by the next drain round. */
  return any_owes();
}

static void count(sg_comm *c, enum sg_kind kind, int peer) {
  if (kind == SG_COLL) {
    c->ops++;
  } else if (kind == SG_SEND || kind == SG_RECV) {
    if (p2p_ready(c) && peer >= 0 && peer < c->nranks)
      c->p2p[(kind == SG_SEND ? 0 : c->nranks) + peer]++;
  }
}

/* Wait at the gate (unless this thread is inside a group already); mu held. */
static void enter_locked(sg_comm *c, enum sg_kind kind, int peer) {
  if (depth == 0) {
    while (!may_pass(c, kind, peer))
      pthread_cond_wait(&cv, &mu);
    inflight++;
  }
  if (c)
    count(c, kind, peer);
}

static void leave_locked(void) {
  if (depth == 0) {
    inflight--;
    pthread_cond_broadcast(&cv);
  }
}

int sg_begin(sg_call *call, void *handle, enum sg_kind kind, int peer, const void *stream) {
  call->c = ours(handle);
  call->real = handle;
  call->entered = 0;
  if (!call->c || in_nccl)
    return 0;
  int capturing = stream ? stream_capturing(stream) : 0;
  pthread_mutex_lock(&mu);
  if (capturing)
    call->c->captured++;
  enter_locked(call->c, kind, peer);
  call->entered = 1;
  call->real = call->c->real;
  if (!call->real) { /* broken: a rebuild failed */
    leave_locked();
    call->entered = 0;
    pthread_mutex_unlock(&mu);
    return ncclInvalidUsage;
  }
  pthread_mutex_unlock(&mu);
  return 0;
}

void sg_end(sg_call *call) {
  if (!call->entered)
    return;
  pthread_mutex_lock(&mu);
  leave_locked();
  pthread_mutex_unlock(&mu);
}

/* A query: never waits at the gate; NULL (answer from the record) while released. The
 * communicator cannot be destroyed by a release while c->queries is held. */
static void *query_begin(sg_comm *c) {
  pthread_mutex_lock(&mu);
  void *real = c->real;
  if (real)
    c->queries++;
  pthread_mutex_unlock(&mu);
  return real;
}

static void query_end(sg_comm *c) {
  pthread_mutex_lock(&mu);
  c->queries--;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
}

/* --- the control channel ----------------------------------------------------------------- */

static pthread_mutex_t ctl_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t ctl_pid;
static int ctl_fd = -1;
static char ctl_path[sizeof(((struct sockaddr_un *)0)->sun_path)];

static void *ctl_main(void *arg);

static void warn(const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "spotguard-nccl: %s\n", line);
}

/* Start this process's control channel once (again in a forked child that makes its own). */
static void ctl_start(void) {
  pid_t me = getpid();
  pthread_mutex_lock(&ctl_mu);
  if (ctl_pid == me) {
    pthread_mutex_unlock(&ctl_mu);
    return;
  }
  ctl_pid = me;
  if (ctl_fd >= 0) { /* inherited from the parent across fork */
    close(ctl_fd);
    ctl_fd = -1;
  }
  const char *dir = getenv("SPOTGUARD_NCCL_CTL");
  if (!dir || !*dir) {
    pthread_mutex_unlock(&ctl_mu);
    return;
  }
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%d.sock", dir, (int)me);
  int fd = -1;
  pthread_t tid;
  pthread_attr_t attr;
  if (n <= 0 || (size_t)n >= sizeof addr.sun_path) {
    warn("control path %s/%d.sock is too long; this process cannot be checkpointed", dir,
         (int)me);
    goto out;
  }
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  unlink(addr.sun_path);
  if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
      chmod(addr.sun_path, 0600) != 0 || listen(fd, 16) != 0) {
    warn("control socket %s: %s; this process cannot be checkpointed", addr.sun_path,
         strerror(errno));
    goto out;
  }
  ctl_fd = fd; /* before the thread starts: it serves ctl_fd */
  memcpy(ctl_path, addr.sun_path, sizeof ctl_path);
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&tid, &attr, ctl_main, NULL) != 0) {
    warn("control thread: %s; this process cannot be checkpointed", strerror(errno));
    pthread_attr_destroy(&attr);
    unlink(addr.sun_path);
    ctl_fd = -1;
    ctl_path[0] = 0;
    goto out;
  }
  pthread_attr_destroy(&attr);
  fd = -1;
out:
  if (fd >= 0)
    close(fd);
  pthread_mutex_unlock(&ctl_mu);
}

__attribute__((destructor)) static void ctl_stop(void) {
  if (ctl_fd >= 0 && ctl_pid == getpid() && ctl_path[0])
    unlink(ctl_path);
}

/* A forked child inherits the parent's record but not its communicators (NCCL is not
 * fork-safe): it starts empty, with the gate open. */
static void after_fork_child(void) {
  pthread_mutex_init(&mu, NULL);
  pthread_cond_init(&cv, NULL);
  pthread_mutex_init(&ctl_mu, NULL);
  comms = NULL;
  state = ST_OPEN;
  inflight = 0;
  draining = 0;
  depth = 0;
}

__attribute__((constructor)) static void sg_load(void) {
  pthread_atfork(NULL, NULL, after_fork_child);
}

/* growable text buffer */
typedef struct {
  char *s;
  size_t n, cap;
} buf_t;

static void bprintf(buf_t *b, const char *fmt, ...) {
  va_list ap;
  for (;;) {
    size_t room = b->cap - b->n;
    va_start(ap, fmt);
    int w = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? room : 0, fmt, ap);
    va_end(ap);
    if (w < 0)
      return;
    if (b->s && (size_t)w < room) {
      b->n += (size_t)w;
      return;
    }
    size_t cap = b->cap ? b->cap * 2 : 4096;
    while (cap < b->n + (size_t)w + 1)
      cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s)
      return;
    b->s = s;
    b->cap = cap;
  }
}

SLOT(ncclCommCount);
SLOT(ncclCommUserRank);
SLOT(ncclCommCuDevice);

/* Learn rank and size of a communicator that was still being created when recorded. */
static void fill(sg_comm *c) {
  typedef ncclResult_t (*q_t)(const ncclComm_t, int *);
  int v;
  if (c->nranks > 0 || !c->real)
    return;
  if (REAL(q_t, ncclCommCount) && REAL(q_t, ncclCommCount)((ncclComm_t)c->real, &v) == 0)
    c->nranks = v;
  if (REAL(q_t, ncclCommUserRank) && REAL(q_t, ncclCommUserRank)((ncclComm_t)c->real, &v) == 0)
    c->rank = v;
  if (c->dev < 0 && REAL(q_t, ncclCommCuDevice) &&
      REAL(q_t, ncclCommCuDevice)((ncclComm_t)c->real, &v) == 0)
    c->dev = v;
}

static void p2p_json(buf_t *b, const sg_comm *c, int base) {
  int first = 1;
  bprintf(b, "[");
  for (int p = 0; c->p2p && p < c->nranks; p++) {
    if (c->p2p[base + p]) {
      bprintf(b, "%s[%d,%llu]", first ? "" : ",", p, (unsigned long long)c->p2p[base + p]);
      first = 0;
    }
  }
  bprintf(b, "]");
}

/* The record as JSON (mu held). */
static void report(buf_t *b, const char *extra) {
  bprintf(b, "{\"pid\":%d,\"state\":\"%s\",\"inflight\":%d,\"memalloc\":%d,\"comms\":[",
          (int)getpid(), STATE_NAMES[state], inflight, memalloc_live);
  for (sg_comm *c = comms; c; c = c->next) {
    fill(c);
    bprintf(b, "%s{\"id\":%d,\"key\":\"%016llx\",\"rank\":%d,\"nranks\":%d,\"dev\":%d,",
            c == comms ? "" : ",", c->id, (unsigned long long)c->key, c->rank, c->nranks,
            c->dev);
    bprintf(b, "\"ops\":%llu,\"send\":", (unsigned long long)c->ops);
    p2p_json(b, c, 0);
    bprintf(b, ",\"recv\":");
    p2p_json(b, c, c->nranks);
    bprintf(b, ",\"captured\":%d,\"registered\":%d,\"windows\":%d,\"devapi\":%d}", c->captured,
            c->registered, c->windows, c->devapi);
  }
  bprintf(b, "]%s}", extra ? extra : "");
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void deadline_ts(struct timespec *ts, long ms) {
  clock_gettime(CLOCK_REALTIME, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

static sg_comm *by_id(int id) {
  for (sg_comm *c = comms; c; c = c->next)
    if (c->id == id)
      return c;
  return NULL;
}

/* "c3=10" "s3.1=4" "r3.0=4": a target (mu held); 0 if malformed. */
static int set_target(const char *tok) {
  char kind = tok[0];
  int id, peer = -1;
  unsigned long long n;
  if (kind == 'c' ? sscanf(tok + 1, "%d=%llu", &id, &n) != 2
                  : sscanf(tok + 1, "%d.%d=%llu", &id, &peer, &n) != 3)
    return 0;
  sg_comm *c = by_id(id);
  if (!c)
    return 0;
  if (kind == 'c') {
    c->target_ops = n;
    return 1;
  }
  if ((kind != 's' && kind != 'r') || !p2p_ready(c) || peer < 0 || peer >= c->nranks)
    return 0;
  if (!c->p2p_target && !(c->p2p_target = calloc(2 * (size_t)c->nranks, sizeof(uint64_t))))
    return 0;
  c->p2p_target[(kind == 's' ? 0 : c->nranks) + peer] = n;
  return 1;
}

static void clear_targets(void) {
  draining = 0;
  for (sg_comm *c = comms; c; c = c->next) {
    c->target_ops = 0;
    free(c->p2p_target);
    c->p2p_target = NULL;
  }
}

static void cmd_drain(buf_t *out, char *args) {
  char *save = NULL;
  char *tok = strtok_r(args, " ", &save);
  long ms = tok ? strtol(tok, NULL, 10) : 0;
  struct timespec until;
  pthread_mutex_lock(&mu);
  if (state != ST_CLOSED && state != ST_DRAIN) {
    pthread_mutex_unlock(&mu);
    bprintf(out, "{\"error\":\"not quiesced (state %s)\"}", STATE_NAMES[state]);
    return;
  }
  clear_targets();
  while ((tok = strtok_r(NULL, " ", &save))) {
    if (!set_target(tok)) {
      pthread_mutex_unlock(&mu);
      bprintf(out, "{\"error\":\"bad drain target %s\"}", tok);
      return;
    }
  }
  draining = 1;
  state = ST_DRAIN;
  pthread_cond_broadcast(&cv);
  deadline_ts(&until, ms);
  while ((inflight > 0 || any_owes()) && pthread_cond_timedwait(&cv, &mu, &until) == 0)
    ;
  int settled = inflight == 0 && !any_owes();
  state = ST_CLOSED;
  clear_targets();
  report(out, settled ? ",\"settled\":true" : ",\"settled\":false");
  pthread_mutex_unlock(&mu);
}

static int cmp_key(const void *a, const void *b) {
  const sg_comm *x = *(sg_comm *const *)a, *y = *(sg_comm *const *)b;
  if (x->key != y->key)
    return x->key < y->key ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* Every communicator of this process in key order (the same order in every member), or
 * NULL with *n = 0. mu held. */
static sg_comm **sorted(int *n) {
  int k = 0;
  for (sg_comm *c = comms; c; c = c->next)
    k++;
  *n = k;
  sg_comm **v = k ? calloc((size_t)k, sizeof *v) : NULL;
  if (!v) {
    *n = 0;
    return NULL;
  }
  k = 0;
  for (sg_comm *c = comms; c; c = c->next)
    v[k++] = c;
  qsort(v, (size_t)*n, sizeof *v, cmp_key);
  return v;
}

SLOT(ncclCommFinalize);
SLOT(ncclCommDestroy);
SLOT(ncclCommGetAsyncError);
SLOT(ncclCommInitRankConfig);
SLOT(ncclGroupStart);
SLOT(ncclGroupEnd);
SLOT(ncclGetUniqueId);

typedef ncclResult_t (*comm_fn_t)(ncclComm_t);
typedef ncclResult_t (*async_fn_t)(ncclComm_t, ncclResult_t *);

/* Wait until a communicator's pending work is done (non-blocking communicators). */
static ncclResult_t settle(void *real, double until) {
  ncclResult_t st = ncclInProgress;
  async_fn_t async_err = REAL(async_fn_t, ncclCommGetAsyncError);
  while (async_err && async_err((ncclComm_t)real, &st) == ncclSuccess && st == ncclInProgress &&
         now_s() < until)
    usleep(1000);
  return st;
}

static void cmd_release(buf_t *out, char *args) {
  long ms = strtol(args, NULL, 10);
  double t0 = now_s(), until = t0 + (ms > 0 ? (double)ms / 1000.0 : 300.0);
  int n = 0;
  pthread_mutex_lock(&mu);
  if (state != ST_CLOSED || inflight > 0) {
    bprintf(out, "{\"error\":\"not quiesced (state %s, %d calls inside NCCL)\"}",
            STATE_NAMES[state], inflight);
    pthread_mutex_unlock(&mu);
    return;
  }
  sg_comm **v = sorted(&n);
  for (int i = 0; i < n; i++)
    fill(v[i]);
  state = ST_RELEASED;
  void **reals = n ? calloc((size_t)n, sizeof *reals) : NULL;
  for (int i = 0; reals && i < n; i++) {
    while (v[i]->queries > 0)
      pthread_cond_wait(&cv, &mu);
    reals[i] = v[i]->real;
    v[i]->real = NULL;
  }
  pthread_mutex_unlock(&mu);
  comm_fn_t finalize = REAL(comm_fn_t, ncclCommFinalize);
  comm_fn_t destroy = REAL(comm_fn_t, ncclCommDestroy);
  const char *failed = NULL;
  ncclResult_t rc = ncclSuccess;
  /* NCCL's finalize and destroy end by setting the caller's device back: a control thread
   * that never chose one would make device 0 current, which since CUDA 12 creates a primary
   * context there (~500 MiB of GPU 0 in every other rank, and one more context to
   * checkpoint). Each call runs with its communicator's own device current. */
  for (int i = 0; reals && i < n && !failed; i++) {
    if (!reals[i])
      continue;
    use_device(v[i]->dev);
    rc = finalize ? finalize((ncclComm_t)reals[i]) : ncclInternalError;
    if (rc == ncclInProgress)
      rc = settle(reals[i], until);
    if (rc != ncclSuccess)
      failed = "ncclCommFinalize";
  }
  for (int i = 0; reals && i < n && !failed; i++) {
    if (reals[i])
      use_device(v[i]->dev);
    if (reals[i] && (rc = destroy ? destroy((ncclComm_t)reals[i]) : ncclInternalError))
      failed = "ncclCommDestroy";
  }
  pthread_mutex_lock(&mu);
  if (failed || (n && !reals)) {
    state = ST_BROKEN;
    bprintf(out, "{\"error\":\"%s failed (NCCL error %d)\"}", failed ? failed : "calloc", rc);
  } else {
    char extra[96];
    snprintf(extra, sizeof extra, ",\"released\":%d,\"seconds\":%.6f", n, now_s() - t0);
    report(out, extra);
  }
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  free(reals);
  free(v);
}

static const char HEX[] = "0123456789abcdef";

static void cmd_uid(buf_t *out) {
  typedef ncclResult_t (*uid_fn_t)(ncclUniqueId *);
  ncclUniqueId id;
  /* on a device this process already uses (see cmd_release): never a new context on 0 */
  pthread_mutex_lock(&mu);
  int dev = comms ? comms->dev : -1;
  pthread_mutex_unlock(&mu);
  use_device(dev);
  uid_fn_t get = REAL(uid_fn_t, ncclGetUniqueId);
  ncclResult_t rc = get ? get(&id) : ncclInternalError;
  if (rc != ncclSuccess) {
    bprintf(out, "{\"error\":\"ncclGetUniqueId failed (NCCL error %d)\"}", rc);
    return;
  }
  bprintf(out, "{\"uid\":\"");
  for (size_t i = 0; i < sizeof id.internal; i++)
    bprintf(out, "%c%c", HEX[(unsigned char)id.internal[i] >> 4],
            HEX[(unsigned char)id.internal[i] & 15]);
  bprintf(out, "\"}");
}

static int unhex(const char *s, ncclUniqueId *id) {
  if (strlen(s) != 2 * sizeof id->internal)
    return 0;
  for (size_t i = 0; i < sizeof id->internal; i++) {
    const char *hi = strchr(HEX, s[2 * i]), *lo = strchr(HEX, s[2 * i + 1]);
    if (!hi || !lo || !*hi || !*lo)
      return 0;
    id->internal[i] = (char)(((hi - HEX) << 4) | (lo - HEX));
  }
  return 1;
}

typedef struct {
  int id;
  ncclUniqueId uid;
} uid_arg;

static ncclResult_t reinit(sg_comm **v, void **fresh, int n, uid_arg *ids, int nids,
                           double until) {
  typedef ncclResult_t (*init_fn_t)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  typedef ncclResult_t (*grp_fn_t)(void);
  init_fn_t init = REAL(init_fn_t, ncclCommInitRankConfig);
  grp_fn_t start = REAL(grp_fn_t, ncclGroupStart), end = REAL(grp_fn_t, ncclGroupEnd);
  ncclResult_t rc = ncclSuccess;
  if (!init || !start || !end)
    return ncclInternalError;
  in_nccl++; /* the control thread's own calls: never recorded, never gated */
  start();
  for (int i = 0; i < n && rc == ncclSuccess; i++) {
    const uid_arg *a = NULL;
    for (int j = 0; j < nids; j++)
      if (ids[j].id == v[i]->id)
        a = &ids[j];
    if (!a) {
      rc = ncclInvalidArgument;
      break;
    }
    use_device(v[i]->dev);
    rc = init((ncclComm_t *)&fresh[i], v[i]->nranks, a->uid, v[i]->rank,
              (ncclConfig_t *)v[i]->config);
    if (rc == ncclInProgress)
      rc = ncclSuccess;
  }
  ncclResult_t endrc = end();
  if (rc == ncclSuccess && endrc != ncclSuccess && endrc != ncclInProgress)
    rc = endrc;
  for (int i = 0; i < n && rc == ncclSuccess; i++)
    if (fresh[i] && settle(fresh[i], until) != ncclSuccess)
      rc = ncclSystemError;
  in_nccl--;
  return rc;
}

static void cmd_rebuild(buf_t *out, char *args) {
  char *save = NULL;
  char *tok = strtok_r(args, " ", &save);
  long ms = tok ? strtol(tok, NULL, 10) : 0;
  double t0 = now_s(), until = t0 + (ms > 0 ? (double)ms / 1000.0 : 300.0);
  int nids = 0, n = 0;
  uid_arg *ids = calloc(256, sizeof *ids);
  while (ids && nids < 256 && (tok = strtok_r(NULL, " ", &save))) {
    char *eq = strchr(tok, '=');
    if (!eq || !unhex(eq + 1, &ids[nids].uid)) {
      bprintf(out, "{\"error\":\"bad rebuild argument\"}");
      free(ids);
      return;
    }
    ids[nids++].id = atoi(tok);
  }
  pthread_mutex_lock(&mu);
  if (state != ST_RELEASED) {
    bprintf(out, "{\"error\":\"not released (state %s)\"}", STATE_NAMES[state]);
    pthread_mutex_unlock(&mu);
    free(ids);
    return;
  }
  sg_comm **v = sorted(&n);
  pthread_mutex_unlock(&mu);
  void **fresh = calloc((size_t)(n ? n : 1), sizeof *fresh);
  ncclResult_t rc = ids && fresh && (v || !n) ? reinit(v, fresh, n, ids, nids, until)
                                                : ncclSystemError;
  pthread_mutex_lock(&mu);
  if (rc == ncclSuccess) {
    for (int i = 0; i < n; i++)
      v[i]->real = fresh[i];
    state = ST_OPEN;
    char extra[96];
    snprintf(extra, sizeof extra, ",\"rebuilt\":%d,\"seconds\":%.6f", n, now_s() - t0);
    report(out, extra);
  } else {
    state = ST_BROKEN; /* calls now fail with ncclInvalidUsage instead of hanging */
    bprintf(out, "{\"error\":\"ncclCommInitRankConfig failed (NCCL error %d)\"}", rc);
  }
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  free(fresh);
  free(v);
  free(ids);
}

static void dispatch(buf_t *out, char *line) {
  char *args = strchr(line, ' ');
  if (args)
    *args++ = 0;
  else
    args = line + strlen(line);
  if (!strcmp(line, "state") || !strcmp(line, "quiesce") || !strcmp(line, "reopen")) {
    pthread_mutex_lock(&mu);
    if (!strcmp(line, "quiesce") && state == ST_OPEN)
      state = ST_CLOSED;
    if (!strcmp(line, "reopen") && (state == ST_CLOSED || state == ST_DRAIN)) {
      clear_targets();
      state = ST_OPEN;
      pthread_cond_broadcast(&cv);
    }
    report(out, NULL);
    pthread_mutex_unlock(&mu);
  } else if (!strcmp(line, "drain")) {
    cmd_drain(out, args);
  } else if (!strcmp(line, "release")) {
    cmd_release(out, args);
  } else if (!strcmp(line, "uid")) {
    cmd_uid(out);
  } else if (!strcmp(line, "rebuild")) {
    cmd_rebuild(out, args);
  } else {
    bprintf(out, "{\"error\":\"unknown command\"}");
  }
}

static void serve(int fd) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  struct timeval tv = {.tv_sec = 5};
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      (cred.uid != 0 && cred.uid != geteuid()))
    return;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char *line = malloc(SG_LINE_MAX);
  size_t n = 0;
  while (line && n < SG_LINE_MAX - 1) {
    ssize_t r = read(fd, line + n, SG_LINE_MAX - 1 - n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    n += (size_t)r;
    if (memchr(line, '\n', n))
      break;
  }
  if (line && n) {
    line[n] = 0;
    line[strcspn(line, "\r\n")] = 0;
    buf_t out = {0};
    dispatch(&out, line);
    bprintf(&out, "\n");
    for (size_t done = 0; out.s && done < out.n;) {
      ssize_t w = write(fd, out.s + done, out.n - done);
      if (w < 0 && errno == EINTR)
        continue;
      if (w <= 0)
        break;
      done += (size_t)w;
    }
    free(out.s);
  }
  free(line);
}

static void *ctl_main(void *arg) {
  (void)arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL); /* the application's threads take its signals */
  for (;;) {
    int lfd = ctl_fd;
    if (lfd < 0 || ctl_pid != getpid())
      return NULL;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EINTR && errno != ECONNABORTED)
        usleep(10000);
      continue;
    }
    serve(fd);
    close(fd);
  }
}

/* --- communicators: creation, destruction, queries (hand-written wrappers) ---------------- */

/* Record what NCCL returned for a new communicator and hand back our handle. */
static ncclResult_t adopt(ncclResult_t rc, ncclComm_t *out, void *real, uint64_t key, int rank,
                          int nranks, int dev, void *config) {
  if ((rc != ncclSuccess && rc != ncclInProgress) || !real) {
    free(config);
    return rc;
  }
  pthread_mutex_lock(&mu);
  sg_comm *c = record(real, key, rank, nranks, dev, config);
  pthread_mutex_unlock(&mu);
  *out = c ? (ncclComm_t)c : (ncclComm_t)real;
  return rc;
}

static void gate_in(sg_comm *c, enum sg_kind kind) {
  pthread_mutex_lock(&mu);
  enter_locked(c, kind, -1);
  pthread_mutex_unlock(&mu);
}

static void gate_out(void) {
  pthread_mutex_lock(&mu);
  leave_locked();
  pthread_mutex_unlock(&mu);
}

SLOT(ncclCommInitRank);
SLOT(ncclCommInitAll);
SLOT(ncclCommInitRankScalable);
SLOT(ncclCommSplit);
SLOT(ncclCommShrink);
SLOT(ncclCommAbort);
SLOT(ncclGetLastError);
SLOT(ncclCommRegister);
SLOT(ncclCommDeregister);
SLOT(ncclCommWindowRegister);
SLOT(ncclCommWindowDeregister);
SLOT(ncclRedOpCreatePreMulSum);
SLOT(ncclRedOpDestroy);
SLOT(ncclGroupSimulateEnd);
SLOT(ncclMemAlloc);
SLOT(ncclMemFree);

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  typedef ncclResult_t (*fn_t)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  fn_t fn = REAL(fn_t, ncclCommInitRankConfig);
  ncclComm_t real = NULL;
  if (!fn)
    return ncclInternalError;
  if (in_nccl)
    return fn(comm, nranks, commId, rank, config);
  ctl_start();
  gate_in(NULL, SG_NONE);
  in_nccl++;
  ncclResult_t rc = fn(&real, nranks, commId, rank, config);
  in_nccl--;
  gate_out();
  return adopt(rc, comm, real, mix(0, &commId, sizeof commId), rank, nranks, current_device(),
               copy_config(config));
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  typedef ncclResult_t (*fn_t)(ncclComm_t *, int, ncclUniqueId, int);
  fn_t fn = REAL(fn_t, ncclCommInitRank);
  ncclComm_t real = NULL;
  if (!fn)
    return ncclInternalError;
  if (in_nccl)
    return fn(comm, nranks, commId, rank);
  ctl_start();
  gate_in(NULL, SG_NONE);
  in_nccl++;
  ncclResult_t rc = fn(&real, nranks, commId, rank);
  in_nccl--;
  gate_out();
  return adopt(rc, comm, real, mix(0, &commId, sizeof commId), rank, nranks, current_device(),
               NULL);
}

ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId *commIds, ncclConfig_t *config) {
  typedef ncclResult_t (*fn_t)(ncclComm_t *, int, int, int, ncclUniqueId *, ncclConfig_t *);
  fn_t fn = REAL(fn_t, ncclCommInitRankScalable);
  ncclComm_t real = NULL;
  if (!fn)
    return ncclInternalError;
  if (in_nccl)
    return fn(newcomm, nranks, myrank, nId, commIds, config);
  ctl_start();
  gate_in(NULL, SG_NONE);
  in_nccl++;
  ncclResult_t rc = fn(&real, nranks, myrank, nId, commIds, config);
  in_nccl--;
  gate_out();
  uint64_t key = mix(0, "scalable", 8);
  for (int i = 0; i < nId; i++)
    key = mix(key, &commIds[i], sizeof commIds[i]);
  return adopt(rc, newcomm, real, key, myrank, nranks, current_device(), copy_config(config));
}

ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist) {
  typedef ncclResult_t (*fn_t)(ncclComm_t *, int, const int *);
  fn_t fn = REAL(fn_t, ncclCommInitAll);
  if (!fn)
    return ncclInternalError;
  if (in_nccl)
    return fn(comm, ndev, devlist);
  ctl_start();
  gate_in(NULL, SG_NONE);
  in_nccl++;
  ncclResult_t rc = fn(comm, ndev, devlist);
  in_nccl--;
  gate_out();
  /* one clique inside this process: a key of its own */
  struct {
    pid_t pid;
    double t;
    const void *at;
  } seed = {getpid(), now_s(), comm};
  uint64_t key = mix(0, &seed, sizeof seed);
  for (int i = 0; rc == ncclSuccess && i < ndev; i++)
    adopt(rc, &comm[i], comm[i], key, i, ndev, devlist ? devlist[i] : i, NULL);
  return rc;
}

/* A child communicator (split or shrink) of `parent`: its key derives from the parent's. */
static ncclResult_t child(ncclResult_t rc, sg_comm *p, uint64_t seq, uint64_t salt,
                          ncclComm_t real, ncclComm_t *newcomm, ncclConfig_t *config) {
  if (!p || !real || (rc != ncclSuccess && rc != ncclInProgress))
    return rc;
  uint64_t key = mix(p->key, &seq, sizeof seq);
  key = mix(key, &salt, sizeof salt);
  void *cfg = config ? copy_config(config) : NULL;
  if (!config && p->config) {
    size_t size = ((ncclConfig_t *)p->config)->size;
    if (size < sizeof(ncclConfig_t))
      size = sizeof(ncclConfig_t);
    if ((cfg = malloc(size)))
      memcpy(cfg, p->config, size);
  }
  rc = adopt(rc, newcomm, real, key, -1, 0, p->dev, cfg);
  sg_comm *c = ours(*newcomm);
  if (c) {
    pthread_mutex_lock(&mu);
    fill(c);
    pthread_mutex_unlock(&mu);
  }
  return rc;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
  typedef ncclResult_t (*fn_t)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
  fn_t fn = REAL(fn_t, ncclCommSplit);
  sg_call call;
  ncclComm_t real = NULL;
  uint64_t seq = 0;
  if (!fn)
    return ncclInternalError;
  if (in_nccl)
    return fn(comm, color, key, newcomm, config);
  int err = sg_begin(&call, comm, SG_COLL, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  if (call.c) {
    pthread_mutex_lock(&mu);
    seq = call.c->splits++;
    pthread_mutex_unlock(&mu);
  }
  in_nccl++;
  ncclResult_t rc = fn((ncclComm_t)call.real, color, key, &real, config);
  in_nccl--;
  sg_end(&call);
  if (!call.c) {
    *newcomm = real;
    return rc;
  }
  *newcomm = real; /* NULL for NCCL_SPLIT_NOCOLOR */
  return child(rc, call.c, seq, (uint64_t)(int64_t)color, real, newcomm, config);
}

ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                            ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
  typedef ncclResult_t (*fn_t)(ncclComm_t, int *, int, ncclComm_t *, ncclConfig_t *, int);
  fn_t fn = REAL(fn_t, ncclCommShrink);
  sg_call call;
  ncclComm_t real = NULL;
  uint64_t seq = 0;
  if (!fn)
    return ncclInternalError;
  if (in_nccl)
    return fn(comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags);
  int err = sg_begin(&call, comm, SG_COLL, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  if (call.c) {
    pthread_mutex_lock(&mu);
    seq = call.c->splits++;
    pthread_mutex_unlock(&mu);
  }
  in_nccl++;
  ncclResult_t rc = fn((ncclComm_t)call.real, excludeRanksList, excludeRanksCount, &real, config,
                       shrinkFlags);
  in_nccl--;
  sg_end(&call);
  *newcomm = real;
  if (!call.c)
    return rc;
  uint64_t salt = mix(0, "shrink", 6);
  if (excludeRanksList && excludeRanksCount > 0)
    salt = mix(salt, excludeRanksList, (size_t)excludeRanksCount * sizeof(int));
  return child(rc, call.c, seq, salt, real, newcomm, config);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  comm_fn_t fn = REAL(comm_fn_t, ncclCommFinalize);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real);
  sg_end(&call);
  return rc;
}

/* Destroy or abort: while released there is nothing of NCCL's to free (no wait). */
static ncclResult_t end_comm(ncclComm_t comm, comm_fn_t fn) {
  sg_comm *c = ours(comm);
  if (!fn)
    return ncclInternalError;
  if (!c)
    return fn(comm);
  pthread_mutex_lock(&mu);
  if (state == ST_RELEASED || !c->real) {
    forget(c);
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
  }
  enter_locked(c, SG_NONE, -1);
  void *real = c->real;
  pthread_mutex_unlock(&mu);
  ncclResult_t rc = fn((ncclComm_t)real);
  pthread_mutex_lock(&mu);
  leave_locked();
  while (c->queries > 0)
    pthread_cond_wait(&cv, &mu);
  forget(c);
  pthread_mutex_unlock(&mu);
  return rc;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return end_comm(comm, REAL(comm_fn_t, ncclCommDestroy));
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return end_comm(comm, REAL(comm_fn_t, ncclCommAbort));
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  async_fn_t fn = REAL(async_fn_t, ncclCommGetAsyncError);
  sg_comm *c = ours(comm);
  if (!fn)
    return ncclInternalError;
  if (!c)
    return fn(comm, asyncError);
  void *real = query_begin(c);
  if (!real) {
    *asyncError = state == ST_BROKEN ? ncclSystemError : ncclSuccess;
    return ncclSuccess;
  }
  ncclResult_t rc = fn((ncclComm_t)real, asyncError);
  query_end(c);
  return rc;
}

typedef ncclResult_t (*int_query_t)(const ncclComm_t, int *);

static ncclResult_t int_query(ncclComm_t comm, int *out, int_query_t fn, int which) {
  sg_comm *c = ours(comm);
  if (!fn)
    return ncclInternalError;
  if (!c)
    return fn(comm, out);
  pthread_mutex_lock(&mu);
  fill(c);
  int known = c->nranks > 0 && (which != 2 || c->dev >= 0);
  int value = which == 0 ? c->nranks : which == 1 ? c->rank : c->dev;
  pthread_mutex_unlock(&mu);
  if (known) {
    *out = value;
    return ncclSuccess;
  }
  void *real = query_begin(c);
  if (!real)
    return ncclInvalidUsage;
  ncclResult_t rc = fn((ncclComm_t)real, out);
  query_end(c);
  return rc;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  return int_query(comm, count, REAL(int_query_t, ncclCommCount), 0);
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  return int_query(comm, rank, REAL(int_query_t, ncclCommUserRank), 1);
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  return int_query(comm, device, REAL(int_query_t, ncclCommCuDevice), 2);
}

const char *ncclGetLastError(ncclComm_t comm) {
  typedef const char *(*fn_t)(ncclComm_t);
  fn_t fn = REAL(fn_t, ncclGetLastError);
  sg_comm *c = ours(comm);
  if (!fn)
    return "";
  if (!c)
    return fn(comm);
  void *real = query_begin(c);
  if (!real)
    return "";
  const char *s = fn((ncclComm_t)real);
  query_end(c);
  return s;
}

/* What cannot be released: counted per communicator while it exists. */
static void note(sg_comm *c, int *field, int delta) {
  if (!c)
    return;
  pthread_mutex_lock(&mu);
  *field += delta;
  pthread_mutex_unlock(&mu);
}

ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  typedef ncclResult_t (*fn_t)(const ncclComm_t, void *, size_t, void **);
  fn_t fn = REAL(fn_t, ncclCommRegister);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real, buff, size, handle);
  sg_end(&call);
  if (rc == ncclSuccess && call.c)
    note(call.c, &call.c->registered, 1);
  return rc;
}

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle) {
  typedef ncclResult_t (*fn_t)(const ncclComm_t, void *);
  fn_t fn = REAL(fn_t, ncclCommDeregister);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real, handle);
  sg_end(&call);
  if (rc == ncclSuccess && call.c)
    note(call.c, &call.c->registered, -1);
  return rc;
}

ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win,
                                    int winFlags) {
  typedef ncclResult_t (*fn_t)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
  fn_t fn = REAL(fn_t, ncclCommWindowRegister);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real, buff, size, win, winFlags);
  sg_end(&call);
  if (rc == ncclSuccess && call.c)
    note(call.c, &call.c->windows, 1);
  return rc;
}

ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  typedef ncclResult_t (*fn_t)(ncclComm_t, ncclWindow_t);
  fn_t fn = REAL(fn_t, ncclCommWindowDeregister);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real, win);
  sg_end(&call);
  if (rc == ncclSuccess && call.c)
    note(call.c, &call.c->windows, -1);
  return rc;
}

/* A PreMulSum operator lives for one collective (PyTorch creates it, runs the collective,
 * destroys it): from its creation to its destruction the thread counts as inside NCCL, like
 * a group, so a release never finds a live operator of a destroyed communicator. */
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  typedef ncclResult_t (*fn_t)(ncclRedOp_t *, void *, ncclDataType_t, ncclScalarResidence_t,
                               ncclComm_t);
  fn_t fn = REAL(fn_t, ncclRedOpCreatePreMulSum);
  sg_comm *c = ours(comm);
  if (!fn)
    return ncclInternalError;
  if (!c)
    return fn(op, scalar, datatype, residence, comm);
  pthread_mutex_lock(&mu);
  if (depth == 0) {
    while (!may_pass(c, SG_COLL, -1))
      pthread_cond_wait(&cv, &mu);
    inflight++;
  }
  depth++;
  void *real = c->real;
  pthread_mutex_unlock(&mu);
  ncclResult_t rc = real ? fn(op, scalar, datatype, residence, (ncclComm_t)real) : ncclInvalidUsage;
  if (rc != ncclSuccess) {
    pthread_mutex_lock(&mu);
    depth--;
    leave_locked();
    pthread_mutex_unlock(&mu);
  }
  return rc;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  typedef ncclResult_t (*fn_t)(ncclRedOp_t, ncclComm_t);
  fn_t fn = REAL(fn_t, ncclRedOpDestroy);
  sg_comm *c = ours(comm);
  if (!fn)
    return ncclInternalError;
  if (!c)
    return fn(op, comm);
  ncclResult_t rc = c->real ? fn(op, (ncclComm_t)c->real) : ncclInvalidUsage;
  pthread_mutex_lock(&mu);
  if (depth > 0) {
    depth--;
    leave_locked();
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

ncclResult_t ncclGroupStart(void) {
  typedef ncclResult_t (*fn_t)(void);
  fn_t fn = REAL(fn_t, ncclGroupStart);
  if (!fn)
    return ncclInternalError;
  pthread_mutex_lock(&mu);
  enter_locked(NULL, SG_NONE, -1);
  depth++;
  pthread_mutex_unlock(&mu);
  ncclResult_t rc = fn();
  if (rc != ncclSuccess) {
    pthread_mutex_lock(&mu);
    depth--;
    leave_locked();
    pthread_mutex_unlock(&mu);
  }
  return rc;
}

static ncclResult_t group_done(ncclResult_t rc) {
  pthread_mutex_lock(&mu);
  if (depth > 0) {
    depth--;
    leave_locked();
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

ncclResult_t ncclGroupEnd(void) {
  typedef ncclResult_t (*fn_t)(void);
  fn_t fn = REAL(fn_t, ncclGroupEnd);
  return group_done(fn ? fn() : ncclInternalError);
}

ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo) {
  typedef ncclResult_t (*fn_t)(ncclSimInfo_t *);
  fn_t fn = REAL(fn_t, ncclGroupSimulateEnd);
  return group_done(fn ? fn(simInfo) : ncclInternalError);
}

ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
  typedef ncclResult_t (*fn_t)(void **, size_t);
  fn_t fn = REAL(fn_t, ncclMemAlloc);
  ncclResult_t rc = fn ? fn(ptr, size) : ncclInternalError;
  if (rc == ncclSuccess)
    __atomic_add_fetch(&memalloc_live, 1, __ATOMIC_RELAXED);
  return rc;
}

ncclResult_t ncclMemFree(void *ptr) {
  typedef ncclResult_t (*fn_t)(void *);
  fn_t fn = REAL(fn_t, ncclMemFree);
  ncclResult_t rc = fn ? fn(ptr) : ncclInternalError;
  if (rc == ncclSuccess && ptr)
    __atomic_sub_fetch(&memalloc_live, 1, __ATOMIC_RELAXED);
  return rc;
}

/* --- NCCL's device API (nccl_device.h, host side): handles translated, use recorded ------ */

typedef struct {
  int nRanks, rank, stride;
} sg_team; /* ncclTeam_t's layout (nccl_device/core.h) */

SLOT(ncclDevCommCreate);
SLOT(ncclDevCommDestroy);
SLOT(ncclTeamWorld);
SLOT(ncclTeamLsa);
SLOT(ncclTeamRail);
SLOT(ncclTeamRankToWorld);
SLOT(ncclTeamRankToLsa);

ncclResult_t ncclDevCommCreate(ncclComm_t comm, const void *reqs, void *outDevComm) {
  typedef ncclResult_t (*fn_t)(ncclComm_t, const void *, void *);
  fn_t fn = REAL(fn_t, ncclDevCommCreate);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real, reqs, outDevComm);
  sg_end(&call);
  if (rc == ncclSuccess && call.c)
    note(call.c, &call.c->devapi, 1);
  return rc;
}

ncclResult_t ncclDevCommDestroy(ncclComm_t comm, const void *devComm) {
  typedef ncclResult_t (*fn_t)(ncclComm_t, const void *);
  fn_t fn = REAL(fn_t, ncclDevCommDestroy);
  sg_call call;
  if (!fn)
    return ncclInternalError;
  int err = sg_begin(&call, comm, SG_NONE, -1, NULL);
  if (err)
    return (ncclResult_t)err;
  ncclResult_t rc = fn((ncclComm_t)call.real, devComm);
  sg_end(&call);
  if (rc == ncclSuccess && call.c)
    note(call.c, &call.c->devapi, -1);
  return rc;
}

#define TEAM_OF(name)                                                                         \
  sg_team name(ncclComm_t comm) {                                                             \
    typedef sg_team (*fn_t)(ncclComm_t);                                                      \
    fn_t fn = REAL(fn_t, name);                                                               \
    sg_comm *c = ours(comm);                                                                  \
    sg_team none = {0, 0, 0};                                                                 \
    if (!fn)                                                                                  \
      return none;                                                                            \
    if (!c)                                                                                   \
      return fn(comm);                                                                        \
    void *real = query_begin(c);                                                              \
    if (!real)                                                                                \
      return none;                                                                            \
    sg_team t = fn((ncclComm_t)real);                                                         \
    query_end(c);                                                                             \
    return t;                                                                                 \
  }
TEAM_OF(ncclTeamWorld)
TEAM_OF(ncclTeamLsa)
TEAM_OF(ncclTeamRail)

#define TEAM_RANK(name)                                                                       \
  int name(ncclComm_t comm, sg_team team, int rank) {                                         \
    typedef int (*fn_t)(ncclComm_t, sg_team, int);                                            \
    fn_t fn = REAL(fn_t, name);                                                               \
    sg_comm *c = ours(comm);                                                                  \
    if (!fn)                                                                                  \
      return -1;                                                                              \
    if (!c)                                                                                   \
      return fn(comm, team, rank);                                                            \
    void *real = query_begin(c);                                                              \
    if (!real)                                                                                \
      return -1;                                                                              \
    int r = fn((ncclComm_t)real, team, rank);                                                 \
    query_end(c);                                                                             \
    return r;                                                                                 \
  }
TEAM_RANK(ncclTeamRankToWorld)
TEAM_RANK(ncclTeamRankToLsa)
