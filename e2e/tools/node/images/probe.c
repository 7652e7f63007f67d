/* What a GPU container sees, printed as `key=value` lines for the real-node
 * e2e test: the NVIDIA device nodes, whether the driver libraries load by
 * soname (and from where), what CUDA and NVML count, and whether the mounted
 * driver files are read-only. Exit status 0 unless the probe itself breaks:
 * the test judges the values. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

static void devices(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    if (!d) {
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) {
            continue;
        }
        char path[512];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (lstat(path, &st) == 0 && S_ISCHR(st.st_mode)) {
            printf("device=%s %u:%u\n", path, major(st.st_rdev), minor(st.st_rdev));
        } else if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
            continue;
        } else {
            printf("not_a_device=%s\n", path);
        }
    }
    closedir(d);
}

/* Opens `name` as the dynamic loader would for a program, reports where it
 * came from, and returns the handle (NULL if it did not load). */
static void *load(const char *key, const char *name, const char *symbol) {
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *err = dlerror();
        printf("%s_load=error %s\n", key, err ? err : "unknown");
        return NULL;
    }
    void *sym = dlsym(h, symbol);
    Dl_info info;
    if (sym && dladdr(sym, &info) && info.dli_fname) {
        printf("%s_load=ok\n%s_path=%s\n", key, key, info.dli_fname);
        int fd = open(info.dli_fname, O_WRONLY);
        printf("%s_writable=%s\n", key, fd >= 0 ? "yes" : (errno == EROFS ? "no (EROFS)" : "no"));
        if (fd >= 0) {
            close(fd);
        }
    } else {
        printf("%s_load=ok\n%s_path=unknown\n", key, key);
    }
    return h;
}

int main(void) {
    const char *llp = getenv("LD_LIBRARY_PATH");
    printf("ld_library_path=%s\n", llp ? llp : "");
    printf("uid=%u\n", (unsigned)getuid());
    devices("/dev", "nvidia");
    devices("/dev/nvidia-caps", "nvidia-cap");

    void *cuda = load("libcuda", "libcuda.so.1", "cuInit");
    if (cuda) {
        int (*cu_init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
        int (*cu_count)(int *) = (int (*)(int *))dlsym(cuda, "cuDeviceGetCount");
        int (*cu_version)(int *) = (int (*)(int *))dlsym(cuda, "cuDriverGetVersion");
        int n = -1, v = -1;
        /* Each call before the printf that shows its output: argument
         * evaluation order is unspecified. */
        int rc = cu_init ? cu_init(0) : -1;
        printf("cuInit=%d\n", rc);
        rc = cu_count ? cu_count(&n) : -1;
        printf("cuDeviceGetCount=%d count=%d\n", rc, n);
        rc = cu_version ? cu_version(&v) : -1;
        printf("cuDriverGetVersion=%d version=%d\n", rc, v);
    }
    /* Triton and some JIT stacks link against the unversioned name. */
    load("libcuda_unversioned", "libcuda.so", "cuInit");
    void *nvml = load("libnvml", "libnvidia-ml.so.1", "nvmlInit_v2");
    if (nvml) {
        int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
        int (*count)(unsigned *) = (int (*)(unsigned *))dlsym(nvml, "nvmlDeviceGetCount_v2");
        unsigned n = 0;
        int rc = init ? init() : -1;
        printf("nvmlInit=%d\n", rc);
        if (rc == 0 && count) {
            rc = count(&n);
            printf("nvmlDeviceGetCount=%d count=%u\n", rc, n);
        }
    }
    fflush(stdout);
    return 0;
}
