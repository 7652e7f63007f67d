/* The fake driver root's nvidia-smi: enough of the real tool for `helm test` and the probes.
 * `nvidia-smi -L` lists the GPUs NVML reports, one line each, as "GPU <i>: <name> (UUID:
 * <uuid>)"; without arguments it prints the count. It loads libnvidia-ml.so.1 by soname, the
 * way the real one does, so it works only where the container's loader finds the driver's
 * NVML (through the CDI spec), and lists only the GPUs whose device nodes the container has.
 * Exit status 9 when NVML cannot be loaded or initialised, as the real tool does. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*init_fn)(void);
typedef int (*count_fn)(unsigned int *);
typedef int (*handle_fn)(unsigned int, void **);
typedef int (*text_fn)(void *, char *, unsigned int);

int main(int argc, char **argv) {
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) {
        fprintf(stderr, "nvidia-smi: cannot load the driver's NVML: %s\n", dlerror());
        return 9;
    }
    init_fn init = (init_fn)dlsym(nvml, "nvmlInit_v2");
    count_fn count = (count_fn)dlsym(nvml, "nvmlDeviceGetCount_v2");
    handle_fn handle = (handle_fn)dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    text_fn name = (text_fn)dlsym(nvml, "nvmlDeviceGetName");
    text_fn uuid = (text_fn)dlsym(nvml, "nvmlDeviceGetUUID");
    if (!init || !count || !handle || !name || !uuid) {
        fprintf(stderr, "nvidia-smi: NVML lacks a function this tool needs\n");
        return 9;
    }
    int rc = init();
    if (rc != 0) {
        fprintf(stderr, "nvidia-smi: NVML initialisation failed (%d)\n", rc);
        return 9;
    }
    unsigned int n = 0;
    if ((rc = count(&n)) != 0) {
        fprintf(stderr, "nvidia-smi: counting GPUs failed (%d)\n", rc);
        return 9;
    }
    if (argc < 2 || strcmp(argv[1], "-L") != 0) {
        printf("%u GPU(s)\n", n);
        return 0;
    }
    for (unsigned int i = 0; i < n; i++) {
        void *dev = 0;
        char model[96] = "", id[96] = "";
        if (handle(i, &dev) != 0 || name(dev, model, sizeof model) != 0 ||
            uuid(dev, id, sizeof id) != 0) {
            fprintf(stderr, "nvidia-smi: reading GPU %u failed\n", i);
            return 15;
        }
        printf("GPU %u: %s (UUID: %s)\n", i, model, id);
    }
    return 0;
}
