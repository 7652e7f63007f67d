/* The pod sandbox's process: holds the pod's namespaces until the kubelet
 * stops it. Built static so the image needs nothing else. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { _exit(sig == SIGTERM || sig == SIGINT ? 0 : 2); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = quit};
    struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) ||
        sigaction(SIGCHLD, &child, NULL)) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
