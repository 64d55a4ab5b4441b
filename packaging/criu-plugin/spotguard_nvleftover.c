/*
 * spotguard_nvleftover: a CRIU plugin that makes leftover references to GPU device files
 * transparent for processes that have no GPU context.
 *
 * Why: a process forked from a CUDA process without exec (PyTorch DataLoader workers with the
 * default "fork" start method) or a process that only used NVML keeps file descriptors on
 * /dev/nvidia* and, for forked children, the parent's device mappings. The driver says such a
 * process has no CUDA context, so nothing can checkpoint its device state, and CRIU refuses the
 * whole tree ("Can't handle non-regular mapping", "Can't dump file ... of that type"). CUDA is
 * not fork-safe: the child can never use these references. spotguard checkpoints every process
 * that does hold a context through the driver BEFORE CRIU runs, and the driver releases all of
 * that process's device files and mappings; so when CRIU dumps, every reference to a device
 * named here is a leftover. This plugin lets CRIU dump and restore them as inert stand-ins:
 *
 *   fd   (DUMP_EXT_FILE / RESTORE_EXT_FILE):  restored as /dev/null opened read-write (the
 *        way the driver libraries open their device files); CRIU itself restores the fd
 *        number, close-on-exec flag and owner.
 *   VMA  (HANDLE_DEVICE_VMA / UPDATE_VMA_MAP): recreated at the same address with the same
 *        size, protection and sharing, over an empty memfd: any access raises SIGBUS. The
 *        contents are not carried (device memory cannot be read, and the driver's system
 *        memory behind /dev/nvidiactl belongs to the parent's context). A worker that does
 *        read memory it inherited this way (e.g. pinned host memory allocated before the
 *        fork) fails loudly instead of computing on zeros.
 *
 * Which devices: path prefixes, colon separated, from SPOTGUARD_CRIU_LEFTOVER_DEVICES in
 * CRIU's environment (default "/dev/nvidia"; every prefix must start with "/dev/"; an empty
 * value turns the plugin off). Tests point it at a device this machine has.
 *
 * The plugin records itself in the image's inventory when it handled anything, so a restore
 * without it fails with CRIU's "Missing required plugin" instead of reopening real devices.
 *
 * Built by scripts/install-criu against the criu-plugin.h of the CRIU it installs, and
 * loaded only when spotguard passes its directory to CRIU with --libdir.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <criu-plugin.h>

#define PLUGIN_NAME "spotguard_nvleftover"
#define ENV_DEVICES "SPOTGUARD_CRIU_LEFTOVER_DEVICES"
#define DEFAULT_DEVICES "/dev/nvidia"
#define MAX_PREFIXES 16
#define PREFIX_LEN 128

/* CRIU's own logging and inventory functions: exported by the criu binary, declared weak so
 * the plugin still loads (and logs nothing / records nothing) where they are missing. */
extern void print_on_level(unsigned int loglevel, const char *format, ...)
	__attribute__((weak, format(printf, 2, 3)));
extern int add_inventory_plugin(const char *name) __attribute__((weak));
extern bool check_and_remove_inventory_plugin(const char *name, size_t n) __attribute__((weak));

enum { LVL_ERROR = 1, LVL_WARN = 2, LVL_INFO = 3, LVL_DEBUG = 4 };

#define plog(level, fmt, ...)                                                        \
	do {                                                                         \
		if (print_on_level)                                                  \
			print_on_level(level, PLUGIN_NAME ": " fmt "\n", ##__VA_ARGS__); \
	} while (0)

static char prefixes[MAX_PREFIXES][PREFIX_LEN];
static int n_prefixes;
static bool disabled;
static bool in_inventory;

static void load_prefixes(void)
{
	const char *env = getenv(ENV_DEVICES);
	char buf[MAX_PREFIXES * PREFIX_LEN];
	char *save = NULL;

	n_prefixes = 0;
	snprintf(buf, sizeof(buf), "%s", env ? env : DEFAULT_DEVICES);
	for (char *tok = strtok_r(buf, ":", &save); tok; tok = strtok_r(NULL, ":", &save)) {
		if (strncmp(tok, "/dev/", 5) != 0 || strlen(tok) >= PREFIX_LEN) {
			plog(LVL_WARN, "ignoring %s entry '%s' (must start with /dev/)", ENV_DEVICES, tok);
			continue;
		}
		if (n_prefixes == MAX_PREFIXES) {
			plog(LVL_WARN, "more than %d prefixes in %s; the rest are ignored", MAX_PREFIXES,
			     ENV_DEVICES);
			break;
		}
		snprintf(prefixes[n_prefixes++], PREFIX_LEN, "%s", tok);
	}
}

/* Collapse "//" (CRIU sometimes records paths that way) and match against the prefixes. */
static bool is_leftover_path(const char *in)
{
	char path[PATH_MAX];
	size_t j = 0;

	for (size_t i = 0; in[i] && j < sizeof(path) - 1; i++) {
		if (in[i] == '/' && j > 0 && path[j - 1] == '/')
			continue;
		path[j++] = in[i];
	}
	path[j] = '\0';
	for (int k = 0; k < n_prefixes; k++)
		if (strncmp(path, prefixes[k], strlen(prefixes[k])) == 0)
			return true;
	return false;
}

/* The path of one of CRIU's own descriptors, if it is a device node named by a prefix. */
static bool fd_is_leftover(int fd, const struct stat *st, char *path, size_t len)
{
	char link[64];
	ssize_t n;

	if (disabled || !(S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode)))
		return false;
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, path, len - 1);
	if (n < 0)
		return false;
	path[n] = '\0';
	return is_leftover_path(path);
}

static int record_in_inventory(void)
{
	if (in_inventory || !add_inventory_plugin)
		return 0;
	if (add_inventory_plugin(PLUGIN_NAME)) {
		plog(LVL_ERROR, "cannot record the plugin in the image inventory");
		return -1;
	}
	in_inventory = true;
	return 0;
}

static int nvleftover_init(int stage)
{
	load_prefixes();
	disabled = n_prefixes == 0;
	if (stage == CR_PLUGIN_STAGE__RESTORE && check_and_remove_inventory_plugin &&
	    !check_and_remove_inventory_plugin(PLUGIN_NAME, strlen(PLUGIN_NAME)))
		disabled = true; /* this image holds no leftover references of ours */
	plog(LVL_INFO, "stage %d, %d device prefix(es)%s", stage, n_prefixes,
	     disabled ? ", disabled" : "");
	return 0;
}

static void nvleftover_fini(int stage, int ret)
{
	plog(LVL_DEBUG, "stage %d done (%d)", stage, ret);
}

CR_PLUGIN_REGISTER(PLUGIN_NAME, nvleftover_init, nvleftover_fini)

static int dump_file(int fd, int id)
{
	char path[PATH_MAX];
	struct stat st;

	if (fstat(fd, &st) || !fd_is_leftover(fd, &st, path, sizeof(path)))
		return -ENOTSUP;
	if (record_in_inventory())
		return -1;
	plog(LVL_WARN, "leftover device fd %s (file id %#x) will be restored as /dev/null", path, id);
	return 0;
}

static int open_placeholder(int id)
{
	int fd;

	if (disabled)
		return -ENOTSUP;
	fd = open("/dev/null", O_RDWR);
	if (fd < 0) {
		plog(LVL_ERROR, "cannot open /dev/null for file id %#x: %s", id, strerror(errno));
		return -1;
	}
	plog(LVL_INFO, "file id %#x restored as /dev/null (fd %d)", id, fd);
	return fd;
}

/* RESTORE_EXT_FILE gained a "retry needed" out-argument after CRIU 4.2; the hook matching the
 * header this is compiled against is chosen below, so each CRIU gets the signature it calls. */
static __attribute__((unused)) int restore_file_v1(int id)
{
	return open_placeholder(id);
}

static __attribute__((unused)) int restore_file_v2(int id, bool *retry_needed)
{
	*retry_needed = false;
	return open_placeholder(id);
}

#define RESTORE_FILE_HOOK                                              \
	_Generic((CR_PLUGIN_HOOK__RESTORE_EXT_FILE_t *)0,              \
		int (*)(int): (void *)restore_file_v1,                 \
		default: (void *)restore_file_v2)

static int handle_device_vma(int fd, const struct stat *st)
{
	char path[PATH_MAX];

	if (!fd_is_leftover(fd, st, path, sizeof(path)))
		return -ENOTSUP;
	if (record_in_inventory())
		return -1;
	plog(LVL_WARN, "leftover mapping of %s will be restored as an inaccessible placeholder", path);
	return 0;
}

static int update_vma_map(const char *path, const uint64_t addr, const uint64_t old_pgoff,
			  uint64_t *new_pgoff, int *plugin_fd)
{
	int fd;

	if (disabled || !is_leftover_path(path))
		return -ENOTSUP;
	/* A fresh descriptor each time: CRIU closes the one it maps through once the mapping
	 * is made. An empty memfd maps at any size, private or shared; touching it is SIGBUS. */
	fd = memfd_create("spotguard-leftover", MFD_CLOEXEC);
	if (fd < 0) {
		plog(LVL_ERROR, "cannot create a placeholder for %s at %#llx: %s", path,
		     (unsigned long long)addr, strerror(errno));
		return -1;
	}
	plog(LVL_INFO, "mapping of %s at %#llx (offset %#llx) restored as a placeholder", path,
	     (unsigned long long)addr, (unsigned long long)old_pgoff);
	*new_pgoff = 0;
	*plugin_fd = fd;
	return 1;
}

static void __attribute__((constructor)) register_hooks(void)
{
	CR_PLUGIN_DESC.hooks[CR_PLUGIN_HOOK__DUMP_EXT_FILE] = (void *)dump_file;
	CR_PLUGIN_DESC.hooks[CR_PLUGIN_HOOK__RESTORE_EXT_FILE] = RESTORE_FILE_HOOK;
	CR_PLUGIN_DESC.hooks[CR_PLUGIN_HOOK__HANDLE_DEVICE_VMA] = (void *)handle_device_vma;
	CR_PLUGIN_DESC.hooks[CR_PLUGIN_HOOK__UPDATE_VMA_MAP] = (void *)update_vma_map;
}
