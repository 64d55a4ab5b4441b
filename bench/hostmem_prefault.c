/*
 * hostmem_prefault: a measurement tool (bench.ckpt_memory --preload), not part of the product.
 * It tries whether the host memory the NVIDIA driver stages a checkpoint into can be faulted
 * in huge pages and by several threads at once from inside the job. Measured on the H100
 * (docs/benchmarks.md, "Huge pages for the driver's checkpoint"): 1.4-2.2 s of 24 s saved,
 * no huge pages; the host's THP mode `always` (set by the agent) saved 8.5 s. Build:
 *   gcc -O2 -fPIC -shared -o hostmem_prefault.so bench/hostmem_prefault.c -ldl -lpthread
 *
 * cuCheckpointProcessCheckpoint copies all device memory of a process into one fresh anonymous
 * private mapping of that process's own memory. On the GPU machines the driver's one thread
 * spends two thirds of the checkpoint in the kernel, faulting that mapping in 4 KiB pages
 * (docs/benchmarks.md, "bench.ckpt_memory"): 1.8-2.9 GB/s, against ~50 GB/s over PCIe.
 *
 * Preloaded into a job, this library interposes mmap. A large (>= SPOTGUARD_HOSTMEM_MIN_MB, default 256) anonymous private
 * writable mapping made by the CUDA driver itself (the caller's return address lies in
 * libcuda) is marked MADV_HUGEPAGE and prefaulted with MADV_POPULATE_WRITE by
 * SPOTGUARD_HOSTMEM_THREADS threads (default 8) before the driver gets it, so the driver's copy
 * writes into present huge pages. Every other mapping is left exactly as the job asked: a
 * framework's reserved address space or a large numpy array is never populated. Where the
 * kernel refuses a call (no THP, no MADV_POPULATE_WRITE before 5.14) the mapping is returned
 * as it is and the driver faults it in as before.
 *
 * SPOTGUARD_HOSTMEM=0 turns it off; SPOTGUARD_HOSTMEM_TRACE=1 writes one line per large
 * mapping (caller, size, what was done, seconds) to stderr; SPOTGUARD_HOSTMEM_CALLER names the
 * library whose mappings are prefaulted (default libcuda.so; the CPU tests name their own).
 *
 * Why no library: the interposition is a dozen lines of libc; no maintained library
 * prefaults another library's mappings.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define MAX_THREADS 64

static int cfg_read;
static int cfg_enabled = 1;
static int cfg_trace;
static size_t cfg_min = 256UL << 20;
static int cfg_threads = 8;
static const char *cfg_caller = "libcuda.so";

static void read_config(void)
{
	const char *v;

	if (__atomic_load_n(&cfg_read, __ATOMIC_ACQUIRE))
		return;
	v = getenv("SPOTGUARD_HOSTMEM");
	if (v && strcmp(v, "0") == 0)
		cfg_enabled = 0;
	v = getenv("SPOTGUARD_HOSTMEM_TRACE");
	if (v && strcmp(v, "1") == 0)
		cfg_trace = 1;
	v = getenv("SPOTGUARD_HOSTMEM_MIN_MB");
	if (v && atol(v) > 0)
		cfg_min = (size_t)atol(v) << 20;
	v = getenv("SPOTGUARD_HOSTMEM_CALLER");
	if (v && *v)
		cfg_caller = v;
	v = getenv("SPOTGUARD_HOSTMEM_THREADS");
	if (v && atoi(v) > 0)
		cfg_threads = atoi(v) > MAX_THREADS ? MAX_THREADS : atoi(v);
	__atomic_store_n(&cfg_read, 1, __ATOMIC_RELEASE);
}

/* The kernel's mmap, called directly: no dlsym at a time the loader may not be ready. */
static void *sys_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	long r = syscall(SYS_mmap, addr, len, prot, flags, fd, off);

	if (r < 0 && r > -4096) {
		errno = (int)-r;
		return MAP_FAILED;
	}
	if (r == -1)
		return MAP_FAILED;
	return (void *)r;
}

static int from_driver(const void *caller, const char **name)
{
	Dl_info info;

	*name = "?";
	if (!dladdr(caller, &info) || !info.dli_fname)
		return 0;
	*name = info.dli_fname;
	return strstr(info.dli_fname, cfg_caller) != NULL;
}

struct slice {
	char *addr;
	size_t len;
	int err;
};

static void *populate(void *arg)
{
	struct slice *s = arg;

	if (madvise(s->addr, s->len, MADV_POPULATE_WRITE))
		s->err = errno;
	return NULL;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Huge pages, then every page present, written by up to cfg_threads threads. */
static const char *prefault(char *p, size_t len)
{
	struct slice slices[MAX_THREADS];
	pthread_t tids[MAX_THREADS];
	size_t huge = 2UL << 20, step;
	int n = cfg_threads, i, started = 0, err = 0;

	if (madvise(p, len, MADV_HUGEPAGE))
		err = errno;
	step = (len / n + huge - 1) & ~(huge - 1);
	for (i = 0; i < n && (size_t)i * step < len; i++) {
		size_t off = (size_t)i * step;

		slices[i].addr = p + off;
		slices[i].len = off + step > len ? len - off : step;
		slices[i].err = 0;
		if (i == 0 || pthread_create(&tids[i], NULL, populate, &slices[i])) {
			tids[i] = 0;
			continue; /* done below on this thread */
		}
		started++;
	}
	n = i;
	for (i = 0; i < n; i++)
		if (!tids[i])
			populate(&slices[i]);
	for (i = 0; i < n; i++) {
		if (tids[i])
			pthread_join(tids[i], NULL);
		if (slices[i].err)
			err = slices[i].err;
	}
	(void)started;
	if (err == EINVAL)
		return "populate refused (kernel < 5.14?)";
	return err ? strerror(err) : "huge+populated";
}

/* AnonHugePages of the whole process, in MiB (trace lines only). */
static long anon_huge_mib(void)
{
	char line[256];
	long kb = -1;
	FILE *f = fopen("/proc/self/smaps_rollup", "r");

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1)
			break;
	fclose(f);
	return kb < 0 ? -1 : kb >> 10;
}

static void *interposed(void *addr, size_t len, int prot, int flags, int fd, off_t off,
			const void *caller)
{
	void *p = sys_mmap(addr, len, prot, flags, fd, off);
	const char *name, *what;
	double t0;

	if (p == MAP_FAILED || len < cfg_min)
		return p;
	read_config();
	if (!cfg_enabled || len < cfg_min)
		return p;
	if (!(flags & MAP_ANONYMOUS) || !(flags & MAP_PRIVATE) || !(prot & PROT_WRITE)) {
		if (cfg_trace)
			fprintf(stderr, "spotguard_hostmem: %zu MiB prot=%d flags=%#x: left alone\n",
				len >> 20, prot, flags);
		return p;
	}
	if (!from_driver(caller, &name)) {
		if (cfg_trace)
			fprintf(stderr, "spotguard_hostmem: %zu MiB from %s: left alone\n", len >> 20, name);
		return p;
	}
	t0 = now();
	what = prefault(p, len);
	if (cfg_trace)
		fprintf(stderr, "spotguard_hostmem: %zu MiB from %s: %s in %.3f s (AnonHugePages %ld MiB)\n",
			len >> 20, name, what, now() - t0, anon_huge_mib());
	return p;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	return interposed(addr, len, prot, flags, fd, off, __builtin_return_address(0));
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	return interposed(addr, len, prot, flags, fd, off, __builtin_return_address(0));
}
